"""REINFORCE++ over the global batch, in the trainer (issue 16): the advantages the
trainer trains on equal the estimator over every row of the step's batch, not over one
group as the aggregator would compute them."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
import torch
from testdata import rollout_rows, train_sample_rows

from relax.infra.recipe.recipe import RecipeError, load_recipe
from relax.schemas.v1 import TRAIN_SAMPLES
from relax.trainer.advantage.batch import row_advantages, with_batch_advantages
from relax.trainer.advantage.registry import compute_advantages
from relax.trainer.advantage.reinforce_pp import (
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
)
from relax.trainer.config import TrainerConfig
from relax.trainer.loop import advantage_metrics

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
REWARDS = [[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.5]]


def _batch() -> list[pa.Table]:
    groups = []
    for g, values in enumerate(REWARDS):
        rolls = rollout_rows(4, group_size=4, tokens=3 + g)
        for r in rolls:
            r["group_id"] = f"g{g}"
            r["rollout_id"] = f"g{g}/{r['sample_index']}"
        rows = train_sample_rows(rolls, [{"value": v, "reward_name": "math"} for v in values])
        groups.append(pa.Table.from_pylist(rows, schema=TRAIN_SAMPLES))
    return groups


@pytest.mark.parametrize("estimator", ["reinforce_pp", "reinforce_pp_baseline"])
def test_batch_advantages_are_the_estimator_over_the_whole_batch(estimator):
    groups = with_batch_advantages(_batch(), estimator)
    flat = torch.tensor([v for vs in REWARDS for v in vs])
    gids = torch.tensor([g for g, vs in enumerate(REWARDS) for _ in vs])
    fn = {"reinforce_pp": reinforce_pp_advantages,
          "reinforce_pp_baseline": reinforce_pp_baseline_advantages}[estimator]
    want = fn(flat, gids).tolist()
    got = [a for g in groups for a in g.column("advantages").to_pylist()]
    for a, w in zip(got, want):
        assert a == pytest.approx([w] * len(a), abs=1e-6)
    assert [len(a) for a in got] == [3] * 4 + [4] * 4 + [5] * 4  # one per response token
    # what one group at a time (the aggregator) gives differs: the batch matters
    per_group = torch.cat([compute_advantages(estimator, torch.tensor(vs), torch.zeros(4, dtype=torch.int64))
                           for vs in REWARDS])
    assert not torch.allclose(per_group, torch.tensor(want), atol=1e-3)
    m = advantage_metrics(groups)
    assert m["advantage_std"] == pytest.approx(float(torch.tensor(want).std()), abs=1e-6)
    if estimator == "reinforce_pp":
        assert m["advantage_mean"] == pytest.approx(0.0, abs=1e-6)
        assert m["advantage_std"] == pytest.approx(1.0, abs=1e-5)


def test_row_advantages_name_an_unknown_estimator():
    with pytest.raises(ValueError, match="reinforce_pp"):
        row_advantages(_batch(), "nope")


def test_recipe_puts_a_batch_estimator_in_the_trainer():
    r = load_recipe(RECIPES / "tiny_ci.yaml", ["advantage.estimator=reinforce_pp",
                                               "advantage.estimator_options={eps: 0.001}"])
    assert r.trainer.batch_advantage == "reinforce_pp"
    assert r.trainer.batch_advantage_options == {"eps": 0.001}
    assert load_recipe(RECIPES / "tiny_ci.yaml").trainer.batch_advantage is None  # grpo
    with pytest.raises(RecipeError, match="batch estimator runs in the trainer"):
        load_recipe(RECIPES / "tiny_ci.yaml", ["advantage.estimator=reinforce_pp",
                                               "trainer.batch_advantage=reinforce_pp_baseline"])
    with pytest.raises(ValueError, match="per group and run in the aggregator"):
        TrainerConfig(batch_advantage="grpo")
