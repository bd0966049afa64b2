"""Run untrusted Python (model-written code) in a bubblewrap sandbox that contains it.

Each call starts a fresh ``bwrap`` (bubblewrap, Debian package ``bubblewrap``) around the
Python that runs relax, in isolated mode without ``site`` (``python -I -S``: the standard
library only). What the code gets:

* **no network**: new network namespace (no interface but a down loopback), and new
  IPC, UTS, cgroup and mount namespaces;
* **a read-only view of the system and nothing else**: ``/usr`` (with the host's
  ``/bin``, ``/lib``, ``/lib64``, ``/sbin`` links) and the Python install
  (``sys.base_prefix``), read-only; a fresh ``/proc`` of its own pid namespace, a minimal
  ``/dev`` (read-only, like ``/``); its working folder ``/tmp`` is a private tmpfs of
  ``disk_bytes`` (the only writable place). No home folder, checkout, run folder, broker data, ``/etc`` or
  ``/sys``; the environment is cleared (``PATH``, ``HOME=/tmp``, ``LANG`` only);
* **not root**: uid/gid 65534 in a user namespace of its own, every capability dropped,
  no further user namespaces (``--disable-userns``: ``unshare``/``setns`` fail);
  on the host the code's uid is the caller's, or 65534 when the caller is root (the
  sandbox is then started through ``setpriv``, and, when 65534 cannot reach the Python
  install, through a first ``bwrap`` that shows it the install only);
* **its own pid namespace and session** (``--unshare-pid --new-session
  --die-with-parent``): it sees and signals only its own processes, cannot inject into the
  caller's terminal, and dies with the call;
* **limits**: ``RLIMIT_NPROC`` (``processes``, counted in its own user namespace),
  ``RLIMIT_NOFILE`` (``open_files``), ``RLIMIT_AS`` (``memory_bytes``), ``RLIMIT_FSIZE``
  and the tmpfs size (``disk_bytes``), ``RLIMIT_CPU`` (the time limit rounded up), a wall
  clock (``timeout_s``) after which the whole process group and pid namespace are
  killed, and at most ``output_bytes`` read from each of stdout and stderr (more kills
  the run: :attr:`SandboxResult.killed` ``"output"``). Memory is limited per process
  (no cgroup): a run can hold at most ``processes * memory_bytes``.

Fail closed: without ``bwrap`` (or ``setpriv`` as root), or when bubblewrap cannot set
the sandbox up (no user namespaces here), nothing runs: :class:`SandboxError` with one
line saying what is missing. There is no unsandboxed fallback.

The result is what the caller sees from outside: exit status and output. Code run here
decides nothing itself; a caller that scores code (:mod:`.humaneval`) looks for a marker
printed after its tests and for exit status 0. Linux only.
"""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

SANDBOX_ID = 65534
"""uid and gid of the code inside its user namespace (``nobody``); on the host too when
the caller is root."""
SCRATCH = "/tmp"
"""The code's working folder inside the sandbox: a private tmpfs, the only writable place."""
READY = b"\x06"
"""The first byte the sandbox's bootstrap writes to stdout: the sandbox is set up."""
CPU_KILLED = 128 + signal.SIGXCPU
"""bwrap's exit status when the code was killed by its CPU limit (128 + SIGXCPU)."""

_BOOTSTRAP = r"""
import os, resource, sys
mem, cpu, nproc, nofile, fsize = map(int, sys.argv[1:6])
if mem:
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
code = sys.stdin.read()
sys.stdin.close()
os.write(1, b"\x06")
sys.argv = ["main.py"]
g = {"__name__": "__main__", "__builtins__": __builtins__}
del os, resource, mem, cpu, nproc, nofile, fsize
exec(compile(code, "main.py", "exec"), g)
"""


class SandboxError(RuntimeError):
    """The sandbox could not be set up (bubblewrap missing or refused): nothing ran."""


@dataclass(frozen=True)
class SandboxResult:
    """What one run did, as seen from outside.

    Attributes:
        returncode: the exit status (None when a limit killed it: see ``killed``).
        stdout / stderr: what it wrote (UTF-8, undecodable bytes replaced), at most
            ``output_bytes`` of each.
        killed: ``"time"`` (wall clock or CPU limit), ``"output"`` (wrote more than
            ``output_bytes`` to a stream) or None.
        elapsed_s: wall seconds of the call, sandbox set-up included.
    """

    returncode: int | None
    stdout: str
    stderr: str
    killed: str | None = None
    elapsed_s: float = 0.0

    @property
    def timed_out(self) -> bool:
        """Killed by the wall clock or the CPU limit."""
        return self.killed == "time"

    @property
    def ok(self) -> bool:
        """Exited 0 within its limits."""
        return self.returncode == 0 and self.killed is None


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise SandboxError(f"the sandbox needs {name} on PATH and it is missing "
                           f"(Debian: apt-get install {'bubblewrap' if name == 'bwrap' else 'util-linux'}); "
                           "nothing ran")
    return path


def _searchable_by_others(path: Path) -> bool:
    """Every folder above ``path`` lets other users through (o+x)."""
    return all(os.stat(p).st_mode & stat.S_IXOTH for p in path.parents)


def _python() -> tuple[str, str]:
    """``(interpreter, install folder)`` of the Python that runs relax (a venv's base)."""
    exe = os.path.realpath(sys.executable)
    prefix = os.path.realpath(sys.base_prefix)
    if not exe.startswith(prefix + os.sep):
        prefix = str(Path(exe).parent.parent)
    return exe, prefix


def _system_view(prefix: str) -> list[str]:
    """bwrap options of the read-only system view: /usr, the top-level links, the Python."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/lib", "/lib64", "/sbin"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    if not prefix.startswith("/usr/"):
        args += ["--ro-bind", prefix, prefix]
    return args


def _as_nobody(prefix: str) -> list[str]:
    """The command prefix that starts the sandbox as uid 65534 when the caller is root: a
    first bwrap showing the Python install to that uid when a folder above it is
    closed to others (``/root/.pyenv``), then ``setpriv``."""
    setpriv = [_tool("setpriv"), f"--reuid={SANDBOX_ID}", f"--regid={SANDBOX_ID}",
               "--clear-groups", "--inh-caps=-all", "--bounding-set=-all", "--"]
    path = Path(prefix)
    if _searchable_by_others(path):
        return setpriv
    closed = next(p for p in reversed(path.parents) if not os.stat(p).st_mode & stat.S_IXOTH)
    outer = [_tool("bwrap"), "--dev-bind", "/", "/", "--perms", "0755", "--tmpfs", str(closed)]
    for p in reversed(path.parents):
        if p != closed and closed in p.parents:
            outer += ["--perms", "0755", "--dir", str(p)]
    return outer + ["--ro-bind", prefix, prefix, "--die-with-parent", "--clearenv"] + setpriv


def sandbox_command(*, timeout_s: float, memory_bytes: int, processes: int,
                    open_files: int, disk_bytes: int) -> list[str]:
    """The argv that runs the bootstrap (code on stdin) in the sandbox (module docstring).

    Raises:
        SandboxError: ``bwrap`` (or, as root, ``setpriv``) is not installed.
    """
    exe, prefix = _python()
    bwrap = _tool("bwrap")
    prefix_cmd = _as_nobody(prefix) if os.geteuid() == 0 else []
    return prefix_cmd + [
        bwrap, "--unshare-all", "--unshare-user", "--disable-userns",
        "--uid", str(SANDBOX_ID), "--gid", str(SANDBOX_ID), "--cap-drop", "ALL",
        "--die-with-parent", "--new-session", "--hostname", "sandbox",
        "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", SCRATCH,
        "--setenv", "LANG", "C.UTF-8",
        *_system_view(prefix), "--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev",
        "--size", str(int(disk_bytes)), "--perms", "0700", "--tmpfs", SCRATCH,
        "--remount-ro", "/", "--chdir", SCRATCH,
        "--", exe, "-I", "-S", "-c", _BOOTSTRAP,
        str(int(memory_bytes)), str(max(1, int(timeout_s + 0.999))), str(int(processes)),
        str(int(open_files)), str(int(disk_bytes))]


def _feed(pipe, data: bytes) -> None:
    try:
        pipe.write(data)
        pipe.close()
    except BrokenPipeError:  # the sandbox ended (or failed to start) before reading it all
        pass


def run_python(code: str, *, timeout_s: float = 10.0, memory_bytes: int = 1 << 30,
               processes: int = 16, open_files: int = 64, disk_bytes: int = 16 << 20,
               output_bytes: int = 1 << 16) -> SandboxResult:
    """Run ``code`` in the sandbox (see the module docstring); the code sees
    ``__name__ == "__main__"`` and an empty writable working folder.

    Args:
        code: Python source (UTF-8 text).
        timeout_s: wall-clock limit (seconds); the CPU limit is its ceiling.
        memory_bytes: address-space limit per process (bytes; 0 = none).
        processes: most processes (and threads) at once, the first included.
        open_files: most open file descriptors per process.
        disk_bytes: size of the scratch tmpfs and the largest file (bytes).
        output_bytes: most bytes read from each of stdout and stderr; more kills the run.

    Returns:
        the :class:`SandboxResult`.

    Raises:
        SandboxError: bubblewrap is missing or could not set the sandbox up (nothing ran).
    """
    argv = sandbox_command(timeout_s=timeout_s, memory_bytes=memory_bytes, processes=processes,
                           open_files=open_files, disk_bytes=disk_bytes)
    t0 = time.monotonic()
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, cwd="/", env={"PATH": "/usr/bin:/bin"},
                         start_new_session=True)
    threading.Thread(target=_feed, args=(p.stdin, code.encode()), daemon=True).start()
    bufs = {p.stdout: bytearray(), p.stderr: bytearray()}
    killed = None
    with selectors.DefaultSelector() as sel:
        for f in bufs:
            sel.register(f, selectors.EVENT_READ)
        while sel.get_map() and killed is None:
            left = t0 + timeout_s - time.monotonic()
            if left <= 0:
                killed = "time"
                break
            for key, _ in sel.select(left):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                buf = bufs[key.fileobj]
                buf += chunk
                if len(buf) > output_bytes + (key.fileobj is p.stdout):  # + the ready byte
                    killed = "output"
    if killed is None:  # both streams closed: wait for the exit within the time left
        try:
            p.wait(max(0.0, t0 + timeout_s - time.monotonic()))
        except subprocess.TimeoutExpired:
            killed = "time"
    if killed is not None:
        os.killpg(p.pid, signal.SIGKILL)
    returncode = p.wait()
    p.stdout.close()
    p.stderr.close()
    out, err = bytes(bufs[p.stdout]), bytes(bufs[p.stderr])
    if not out.startswith(READY) and killed is None:
        line = (err.decode(errors="replace").strip().splitlines() or [f"exit status {returncode}"])[0]
        raise SandboxError(f"the sandbox could not be set up, nothing ran: {line}")
    if returncode == CPU_KILLED and killed is None:  # out of its time by the other clock
        killed = "time"
    return SandboxResult(None if killed else returncode,
                         out[len(READY):output_bytes + len(READY)].decode(errors="replace"),
                         err[:output_bytes].decode(errors="replace"), killed,
                         round(time.monotonic() - t0, 4))
