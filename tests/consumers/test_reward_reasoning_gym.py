"""reasoning-gym reward (consumers/reward/reasoning_gym.py): each task's own
score_answer, from the task name and entry carried in the metadata JSON."""

import json

import pytest

from relax.consumers.reward.reasoning_gym import reasoning_gym_reward, scorer

rg = pytest.importorskip("reasoning_gym")

TASKS = ["basic_arithmetic", "chain_sum", "countdown", "leg_counting"]


def _metadata(task, entry, with_task=True):
    """What the publisher writes, after the JSON round trip of the bus."""
    meta = {"source": "reasoning_gym", "entry": entry, "index": 0, "seed": 7, "size": 3}
    if with_task:
        meta["task"] = task
    return json.loads(json.dumps(meta))


@pytest.mark.parametrize("task", TASKS)
def test_task_score_answer_from_metadata(task):
    ds = rg.create_dataset(task, size=3, seed=7)
    entries = [ds[i] for i in range(3)]
    metas = [_metadata(task, e) for e in entries]
    right = [f"thinking...</think> <answer>{e['answer']}</answer>" for e in entries]
    out = reasoning_gym_reward(right, [None] * 3, metas)
    assert [s.value for s in out] == [1.0] * 3
    assert out[0].details == {"task": task, "extracted": entries[0]["answer"]}
    wrong = ["<answer>definitely not it</answer>"] * 3
    assert all(s.value < 1.0 for s in reasoning_gym_reward(wrong, [None] * 3, metas))


def test_answer_without_tags_uses_text_after_think_and_task_from_entry():
    e = rg.create_dataset("basic_arithmetic", size=1, seed=3)[0]
    meta = _metadata("basic_arithmetic", e, with_task=False)  # entry.metadata.source_dataset
    out = reasoning_gym_reward([f"<think>hmm 99</think>\n {e['answer']} "], [None], [meta])
    assert out[0].value == 1.0


def test_missing_keys_and_unknown_task_are_row_errors():
    e = rg.create_dataset("basic_arithmetic", size=1, seed=3)[0]
    out = reasoning_gym_reward(["<answer>1</answer>"] * 3, [None] * 3,
                               [{}, {"task": "no_such_task", "entry": {"answer": "1"}},
                                _metadata("basic_arithmetic", e)])
    assert out[0].value is None and "metadata key 'entry'" in out[0].error
    assert out[1].value is None and "no task 'no_such_task'" in out[1].error
    assert out[2].error is None and out[2].value is not None


def test_scorer_is_cached_without_generating_items():
    assert scorer("chain_sum") is scorer("chain_sum")
    assert reasoning_gym_reward([], [], []) == []


# ---- a list label (issue 57): any of its answers, as publish and `relax reward eval` write it

def test_a_list_label_changes_nothing():
    e = rg.create_dataset("basic_arithmetic", size=1, seed=3)[0]
    meta, right = _metadata("basic_arithmetic", e), [f"<answer>{e['answer']}</answer>"]
    assert reasoning_gym_reward(right, ['["3", "4"]'], [meta])[0].value == 1.0  # the entry's
