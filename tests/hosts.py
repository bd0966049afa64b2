"""Hosts for tests on one machine: Linux network namespaces joined by veth pairs to a
bridge, each host with its own address on a private /24 (``10.77.<k>.0``) and its own
loopback. Nothing leaves the machine: the bridge has no uplink and no route.

    with Hosts(["a", "b", "c"]) as hosts:        # 10.77.k.1, .2, .3
        hosts.run("a", ["ip", "addr"])
        p = hosts.popen("b", [sys.executable, "-m", "..."], env=...)

A host may have its own disk at a path (:meth:`Hosts.own_disk`): every command run on it
then sees a folder of its own there (a bind mount in a private mount namespace), so
what it writes under that path no other host sees, as on separate machines; it also gets
a ``/dev/shm`` of its own (a tmpfs), so nothing passes between hosts through RAM files
either (the weight channel's same-host transport looks there).

Needs root and iproute2 (``ip netns``): :func:`unavailable` says why not, for a skip.
The namespace and bridge names carry this process's pid, so concurrent sessions do not
collide; :meth:`Hosts.close` kills what :meth:`Hosts.popen` started and removes them.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess


def unavailable() -> str | None:
    """Why network namespaces cannot be made here (None when they can)."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"rxprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, check=False)
    if r.returncode:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Hosts:
    """Named hosts ``names[i]`` at ``10.77.<subnet>.<i+1>``.

    Args:
        names: host names (short: they become part of interface names).
        subnet: third octet of the hosts' /24 (default: from this process's pid).

    Raises:
        subprocess.CalledProcessError: a namespace, veth or bridge could not be made.
    """

    def __init__(self, names: list[str], subnet: int | None = None):
        self.tag = f"{os.getpid() % 100000}"
        self.subnet = subnet if subnet is not None else 100 + os.getpid() % 150
        self.names = list(names)
        self.bridge = f"rxbr{self.tag}"
        self.procs: list[subprocess.Popen] = []
        self._made: list[str] = []
        self._disks: dict[str, tuple[str, str, str]] = {}

    def ns(self, name: str) -> str:
        """The network namespace of host ``name``."""
        return f"rx{self.tag}{name}"

    def addr(self, name: str) -> str:
        """Host ``name``'s address."""
        return f"10.77.{self.subnet}.{self.names.index(name) + 1}"

    def __enter__(self) -> Hosts:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made.append("bridge")
        _ip("link", "set", self.bridge, "up")
        for i, name in enumerate(self.names):
            ns, veth = self.ns(name), f"rxv{self.tag}{i}"
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", veth, "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(name)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        return self

    def own_disk(self, name: str, path: str, backing: str) -> None:
        """From now on, commands on host ``name`` see folder ``backing`` at ``path`` (both
        must exist): the host's own disk there; and a tmpfs of its own at ``/dev/shm``
        (mounted at ``<backing>.shm``, the same for every command on the host).
        Processes a command leaves running (a daemon) keep the view.

        Raises:
            subprocess.CalledProcessError: the tmpfs could not be mounted.
        """
        shm = f"{backing.rstrip('/')}.shm"
        os.makedirs(shm, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4g", "tmpfs", shm], check=True,
                       capture_output=True)
        self._made.append(f"mount:{shm}")
        self._disks[name] = (backing, path, shm)

    def command(self, name: str, cmd: list[str]) -> list[str]:
        """``cmd`` run inside host ``name`` (in a mount namespace of its own when the host
        has its own disk: ``unshare --mount`` then ``mount --bind``)."""
        if name in self._disks:
            mount = 'mount --bind "$1" "$2" && mount --bind "$3" /dev/shm && shift 3 && exec "$@"'
            cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount,
                   f"host-{name}", *self._disks[name], *cmd]
        return ["ip", "netns", "exec", self.ns(name), *cmd]

    def run(self, name: str, cmd: list[str], **kw) -> subprocess.CompletedProcess:
        """Run ``cmd`` on host ``name`` to its end (``subprocess.run`` keywords)."""
        return subprocess.run(self.command(name, cmd), **{"check": False, **kw})

    def popen(self, name: str, cmd: list[str], **kw) -> subprocess.Popen:
        """Start ``cmd`` on host ``name`` in its own session (killed by :meth:`close`)."""
        p = subprocess.Popen(self.command(name, cmd), start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def close(self) -> None:
        """Kill every process still running in the hosts, remove them and the bridge."""
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for name in self.names:
            if self.ns(name) in self._made:
                pids = subprocess.run(["ip", "netns", "pids", self.ns(name)],
                                      capture_output=True, text=True, check=False).stdout.split()
                if pids:  # some may be gone by now: kill says so, nothing to do
                    subprocess.run(["kill", "-9", *pids], capture_output=True, check=False)
                subprocess.run(["ip", "netns", "del", self.ns(name)], capture_output=True, check=False)
        if "bridge" in self._made:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)
        for m in self._made:
            if m.startswith("mount:"):  # lazily: a killed daemon may still hold a file
                subprocess.run(["umount", "-l", m[6:]], capture_output=True, check=False)
        self._made.clear()

    def __exit__(self, *exc) -> None:
        self.close()
