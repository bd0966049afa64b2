"""The processes that run no model load no torch: the driver (``relax train``'s modules,
every recipe's checks and stage configs, the TensorBoard file of the stages' metrics) and
the reward stage. Importing torch costs about 470 MB of RSS and 4-5 s of CPU per process
(torch 2.13 on the 2-core VM); in ``benchmarks/memory.py``'s colocated 0.5B run the driver
peaked at 812 MB and the reward stage at 692 MB before the configs were split from their
stages (326 MB and 205 MB after).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

DRIVER_AND_REWARD = """
import sys
from pathlib import Path

import relax.infra.cli.app, relax.infra.control.launch, relax.infra.control.runners
from relax.consumers.reward import load_reward_fn
from relax.infra.recipe.recipe import load_recipe
from relax.infra.recipe.specs import stage_class, stage_specs
from relax.trainer.telemetry import StageBoard

stage_class("reward")
load_reward_fn("gsm8k")
tmp = Path(sys.argv[1])
recipes = sorted(Path(sys.argv[2]).glob("*.yaml"))
for f in recipes:
    stage_specs(load_recipe(f), tmp / f.stem)
board = StageBoard(tmp)
board.add([{"ts": 0, "component": "reward.correct", "name": "busy_fraction", "value": 0.5}])
board.close()
{extra}
print(len(recipes), sorted(m for m in sys.modules if m.split(".")[0] == "torch")[:3])
"""


def _modules_after(tmp_path: Path, extra: str = "") -> str:
    out = subprocess.run([sys.executable, "-c", DRIVER_AND_REWARD.replace("{extra}", extra),
                          str(tmp_path), str(ROOT / "recipes")],
                         capture_output=True, text=True, timeout=300, check=True)
    return out.stdout.strip().splitlines()[-1]


def test_the_driver_and_the_reward_stage_import_no_torch(tmp_path):
    n, _, mods = _modules_after(tmp_path).partition(" ")
    assert int(n) >= 10 and mods == "[]"


def test_the_check_sees_a_module_that_brings_torch(tmp_path):
    """The aggregator computes advantages with torch: importing it shows up."""
    assert "'torch'" in _modules_after(tmp_path, "import relax.consumers.aggregate")
