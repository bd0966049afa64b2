"""Run untrusted Python in a sandbox process: a wall-clock and CPU time limit, an
address-space limit, no network, a fresh empty working folder, no inherited
environment.

The child is ``python -I`` (isolated: no user site, no ``PYTHON*`` variables) running a
small bootstrap that, before the code runs, moves itself into a new network namespace
(``unshare(CLONE_NEWNET)``; without the privilege for it, a new user namespace with it:
``CLONE_NEWUSER | CLONE_NEWNET``) so that no address, loopback included, is reachable,
and sets ``RLIMIT_AS`` and ``RLIMIT_CPU``. If neither unshare is allowed, nothing runs:
:class:`SandboxError` (fail closed). A run over its time is killed with its whole
process group; so is one the kernel stops at its CPU limit (``SIGXCPU``: on a busy host
the child can spend its CPU second before the parent's wall clock fires). The limits are
per call; the code sees ``__name__ == "__main__"``. Linux only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

MAX_OUTPUT_CHARS = 4000
"""stdout / stderr kept per run (the head; a note says how much was cut)."""

_BOOTSTRAP = r"""
import ctypes, resource, sys
libc = ctypes.CDLL(None, use_errno=True)
if libc.unshare(0x40000000) != 0 and libc.unshare(0x10000000 | 0x40000000) != 0:
    sys.stderr.write("relax-sandbox: cannot isolate the network (unshare: errno %d)\n"
                     % ctypes.get_errno())
    sys.exit(97)
mem, cpu = int(sys.argv[1]), int(sys.argv[2])
if mem:
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
code = sys.stdin.read()
sys.argv = ["main.py"]
exec(compile(code, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""
NO_NETWORK_EXIT = 97


class SandboxError(RuntimeError):
    """The sandbox could not be set up (no network isolation here): nothing ran."""


@dataclass(frozen=True)
class SandboxResult:
    """What one run did: ``returncode`` (None when killed for time), its output (the
    first :data:`MAX_OUTPUT_CHARS` of each), ``timed_out``."""

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool

    @property
    def ok(self) -> bool:
        """Exited 0 in time."""
        return self.returncode == 0 and not self.timed_out


def _cut(text: str) -> str:
    if len(text) <= MAX_OUTPUT_CHARS:
        return text
    return text[:MAX_OUTPUT_CHARS] + f"\n... ({len(text) - MAX_OUTPUT_CHARS} more characters)"


def run_python(code: str, *, timeout_s: float = 10.0, memory_bytes: int = 1 << 30) -> SandboxResult:
    """Run ``code`` in the sandbox (see the module docstring).

    Args:
        code: Python source (UTF-8 text).
        timeout_s: wall-clock limit (seconds); the CPU limit is its ceiling.
        memory_bytes: address-space limit (bytes; 0 = none).

    Returns:
        the :class:`SandboxResult`.

    Raises:
        SandboxError: the network could not be isolated (nothing was run).
    """
    with tempfile.TemporaryDirectory(prefix="relax-sandbox-") as cwd:
        p = subprocess.Popen(
            [sys.executable, "-I", "-c", _BOOTSTRAP, str(int(memory_bytes)),
             str(max(1, int(timeout_s + 0.999)))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, start_new_session=True)
        try:
            out, err = p.communicate(code.encode(), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
            return SandboxResult(None, _cut(out.decode(errors="replace")),
                                 _cut(err.decode(errors="replace")), True)
    if p.returncode == NO_NETWORK_EXIT and err.startswith(b"relax-sandbox: cannot isolate"):
        raise SandboxError(err.decode(errors="replace").strip())
    cpu_limit = p.returncode == -signal.SIGXCPU  # out of its time by the other clock
    return SandboxResult(None if cpu_limit else p.returncode, _cut(out.decode(errors="replace")),
                         _cut(err.decode(errors="replace")), cpu_limit)
