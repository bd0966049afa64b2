"""Worker pool (consumers/reward/pool.py): a reward that raises, one that sleeps past
the time limit, one that allocates past the memory limit, one whose worker dies: the
bad rows get null values with the error text, the good rows their values, the pool
replaces workers and keeps going."""

import os
import sys
import textwrap

import pytest

from relax.consumers.reward.base import Score
from relax.consumers.reward.pool import RewardLoadError, RewardPool, normalise

FAULTY = textwrap.dedent('''
    import os, time

    def flaky(responses, labels, metadata, **options):
        """len(response) for good rows; misbehaves on the magic responses."""
        out = []
        for r in responses:
            if r == "raise":
                raise RuntimeError("bad row on purpose")
            if r == "sleep":
                time.sleep(60)
            if r == "hog":
                blob = bytearray(2 << 30)  # 2 GiB, past the worker's limit
                out.append(float(len(blob)))
                continue
            if r == "die":
                os._exit(3)
            if r == "nan":
                out.append(float("nan"))
                continue
            if r == "text":
                out.append("1.0")
                continue
            if r == "abstain":
                out.append(None)
                continue
            out.append(float(len(r)))
        return out

    def short(responses, labels, metadata):
        return [1.0] * (len(responses) - 1) if responses else []

    def needs_option(responses, labels, metadata, *, required):
        return []

    def pid(responses, labels, metadata):
        return [float(os.getpid())] * len(responses)
''')

MODULE = "relax_test_faulty_rewards"


@pytest.fixture(scope="module")
def faulty_module(tmp_path_factory):
    d = tmp_path_factory.mktemp("faulty")
    (d / f"{MODULE}.py").write_text(FAULTY)
    sys.path.insert(0, str(d))  # spawned workers inherit sys.path
    yield MODULE
    sys.path.remove(str(d))


def test_faulty_rows_become_errors_and_good_rows_keep_their_values(faulty_module):
    good = ["a", "bb", "ccc", "dddd", "eeeee", "ffffff"]
    bad = ["raise", "sleep", "hog", "die", "nan", "text"]
    rows = [x for pair in zip(good, bad) for x in pair] + ["abstain"]
    with RewardPool(f"{faulty_module}:flaky", workers=2, timeout_s=2.0,
                    memory_limit_bytes=512 << 20, batch_rows=4) as pool:
        res = pool.score(rows, [None] * len(rows), [{}] * len(rows))
        by = dict(zip(rows, res))
        for g in good:
            assert by[g].value == float(len(g)) and by[g].error is None
        assert "RuntimeError: bad row on purpose" in by["raise"].error
        assert "timeout" in by["sleep"].error and "timeout_s=2.0" in by["sleep"].error
        assert "MemoryError" in by["hog"].error and "memory limit" in by["hog"].error
        assert "worker died" in by["die"].error and "exit code 3" in by["die"].error
        assert "not finite" in by["nan"].error
        assert "not a number" in by["text"].error
        assert by["abstain"].value is None and by["abstain"].error is None
        for b in bad:
            assert by[b].value is None
        s = pool.stats
        assert s.timeouts >= 1 and s.exceptions >= 1 and s.memory_errors >= 1
        assert s.worker_deaths >= 1 and s.restarts >= 3 and s.retried_rows > 0
        assert s.row_errors == len(bad)
        # replaced workers serve the next call
        again = pool.score(good, [None] * 6, [{}] * 6)
        assert [r.value for r in again] == [float(len(g)) for g in good]
        assert all(r.elapsed_s >= 0 for r in again)


def test_calls_are_spread_over_workers(faulty_module):
    with RewardPool(f"{faulty_module}:pid", workers=2, batch_rows=64) as pool:
        res = pool.score(["x"] * 10, [None] * 10, [{}] * 10)
        assert {r.value for r in res} == {float(p) for p in pool.pids()}
        assert pool.stats.calls == 2  # 10 rows over 2 workers -> 2 calls of 5


def test_wrong_length_output_is_an_error_per_row(faulty_module):
    with RewardPool(f"{faulty_module}:short", workers=1, batch_rows=8) as pool:
        res = pool.score(["a", "b", "c"], [None] * 3, [{}] * 3)
    assert all(r.value is None and "returned 0 values for 1 rows" in r.error for r in res)


def test_load_and_warm_up_failures_stop_the_start(faulty_module):
    with pytest.raises(RewardLoadError, match="required"):
        RewardPool(f"{faulty_module}:needs_option", workers=1)
    with pytest.raises(RewardLoadError, match="unknown reward 'nope'.*valid: math"):
        RewardPool("nope", workers=1)
    with pytest.raises(ValueError, match="JSON-serialisable"):
        RewardPool("math", {"x": object()})


def test_normalise_values():
    import numpy as np

    rows = normalise([1, True, np.float32(0.5), None, Score(2.0, {"a": 1}),
                      Score(3.0, error="bad label")], 6)
    assert rows == [[1.0, {}, None], [1.0, {}, None], [0.5, {}, None], [None, {}, None],
                    [2.0, {"a": 1}, None], [None, {}, "bad label"]]
    with pytest.raises(ValueError, match="2 values for 3 rows"):
        normalise([1, 2], 3)
    with pytest.raises(TypeError, match="expected a list"):
        normalise(1.0, 1)


def test_pool_workers_are_separate_processes(faulty_module):
    with RewardPool(f"{faulty_module}:pid", workers=1) as pool:
        [r] = pool.score(["x"], [None], [{}])
        assert r.value != float(os.getpid())
