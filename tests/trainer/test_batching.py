"""Micro-batching of whole groups and collation (lengths -> masks, never token values)."""

from __future__ import annotations

import pyarrow as pa
import pytest
from hypothesis import given, settings, strategies as st

from relax.streams.codec import group_by_key
from relax.trainer.batching import collate, micro_batches, pack_groups, split_groups

from testdata import train_sample_table


@given(st.lists(st.lists(st.integers(1, 50), min_size=1, max_size=6), min_size=1, max_size=12),
       st.integers(10, 200))
@settings(max_examples=60, deadline=None)
def test_pack_groups_whole_and_under_budget(groups, budget):
    mbs = pack_groups(groups, budget)
    assert sorted(i for mb in mbs for i in mb) == list(range(len(groups)))
    for mb in mbs:
        rows = sum(len(groups[i]) for i in mb)
        longest = max(max(groups[i]) for i in mb)
        assert rows * longest <= budget or len(mb) == 1


def test_pack_groups_rejects_bad_budget():
    with pytest.raises(ValueError, match="max_tokens_per_microbatch"):
        pack_groups([[3]], 0)


def test_collate_shares_prompts_and_builds_masks_from_lengths():
    t = train_sample_table(2, group_size=3, prompt_len=(3, 5), response_len=(2, 4), seed=3)
    rows = t.to_pylist()
    rows[0]["response_ids"][-1] = 0  # a token equal to the pad value must stay trained
    t = pa.Table.from_pylist(rows, schema=t.schema)
    mb = collate(t)
    assert mb.prompt_ids.shape[0] == 2 and mb.prompt_of_row.tolist() == [0, 0, 0, 1, 1, 1]
    P = mb.prompt_ids.shape[1]
    for b, r in enumerate(rows):
        u, p, n = int(mb.prompt_of_row[b]), len(r["prompt_ids"]), len(r["response_ids"])
        assert mb.prompt_ids[u, P - p:].tolist() == r["prompt_ids"]
        assert mb.prompt_mask[u].tolist() == [0] * (P - p) + [1] * p
        assert mb.response_ids[b, :n].tolist() == r["response_ids"]
        assert mb.response_mask[b].tolist()[:n] == [1] * n and mb.response_mask[b, n:].sum() == 0
        assert mb.loss_mask[b].tolist()[:n] == [1.0] * n and mb.loss_mask[b, n:].sum() == 0
        assert mb.rollout_logprobs[b, :n].tolist() == pytest.approx(r["logprobs"])


def test_collate_rejects_mixed_temperatures():
    t = train_sample_table(1, group_size=2)
    rows = t.to_pylist()
    rows[1]["temperature"] = 0.7
    with pytest.raises(ValueError, match="temperature"):
        collate(pa.Table.from_pylist(rows, schema=t.schema))


def test_micro_batches_keep_groups_together():
    t = train_sample_table(6, group_size=3)
    groups = [g for _, g in group_by_key(t, "group_id")]
    mbs = micro_batches(groups, max_tokens=60)
    assert len(mbs) > 1
    seen = []
    for mb in mbs:
        gids = {rid.split("/")[0] for rid in mb.rollout_ids}
        for g in gids:
            assert sum(rid.startswith(g + "/") for rid in mb.rollout_ids) == 3
        seen += mb.rollout_ids
    assert sorted(seen) == sorted(t.column("rollout_id").to_pylist())


def _tokens(g: pa.Table) -> int:
    return sum(len(x) for x in g.column("prompt_ids").to_pylist()) + \
        sum(len(x) for x in g.column("response_ids").to_pylist())


@settings(max_examples=40, deadline=None)
@given(n_groups=st.integers(0, 9), n=st.integers(1, 4), seed=st.integers(0, 1000))
def test_split_groups_deals_every_group_once_balanced(n_groups, n, seed):
    t = train_sample_table(n_groups, group_size=2, seed=seed, response_len=(1, 30))
    groups = [g for _, g in group_by_key(t, "group_id")] if n_groups else []
    shares = split_groups(groups, n)
    assert len(shares) == n
    ids = [g.column("group_id")[0].as_py() for s in shares for g in s]
    assert sorted(ids) == sorted(g.column("group_id")[0].as_py() for g in groups)
    for s in shares:  # each rank keeps the batch's order
        order = [groups.index(g) for g in s]
        assert order == sorted(order)
    loads = [sum(map(_tokens, s)) for s in shares]
    # greedy bound: the heaviest rank exceeds the lightest by at most one group
    assert max(loads) - min(loads) <= max(map(_tokens, groups), default=0)
    assert split_groups(groups, n) == shares  # deterministic


def test_split_groups_rejects_no_ranks():
    with pytest.raises(ValueError, match="n >= 1"):
        split_groups([], 0)


def test_teacher_kl_is_the_mean_over_loss_tokens_of_rows_with_a_teacher():
    from relax.trainer.batching import teacher_kl

    g = train_sample_table(2, group_size=2)
    assert teacher_kl([x for _, x in group_by_key(g, "group_id")]) is None  # no teacher log-probs anywhere
    rows = g.to_pylist()
    for i, r in enumerate(rows):
        n = len(r["response_ids"])
        r["loss_mask"] = [1] * (n - 1) + [0]
        # rows 0 and 2 have a teacher 0.5 / 1.5 nats below the student; rows 1, 3 none
        r["teacher_logprobs"] = None if i % 2 else [lp - (0.5 if i == 0 else 1.5)
                                                     for lp in r["logprobs"]]
    t = pa.Table.from_pylist(rows, schema=g.schema)
    n0, n2 = len(rows[0]["response_ids"]) - 1, len(rows[2]["response_ids"]) - 1
    want = (0.5 * n0 + 1.5 * n2) / (n0 + n2)
    assert teacher_kl([x for _, x in group_by_key(t, "group_id")]) == pytest.approx(want, abs=1e-6)
