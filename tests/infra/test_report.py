"""Pure helpers of the run report."""

from __future__ import annotations

from relax.infra.observe.report import accounting, stall_report, step_rows


def _row(ts, comp, name, value, v=None):
    return {"ts": ts, "component": comp, "name": name, "value": value, "policy_version": v}


def test_stall_report_gives_each_components_latest_values_and_age():
    rows = [_row(1000, "trainer", "groups_consumed", 6, 3),
            _row(2000, "trainer", "groups_consumed", 8, 4),
            _row(2000, "trainer", "staleness_hist.1", 8, 4),
            _row(9000, "aggregate-0", "partial_groups", 2),
            _row(9000, "aggregate-0", "oldest_partial_s", 130.5)]
    lines = stall_report(rows, now_ms=11000).splitlines()
    assert lines == ["aggregate-0 (2s ago): oldest_partial_s=130.5 partial_groups=2",
                     "trainer (9s ago): groups_consumed=8"]


def test_stall_report_takes_rows_decoded_from_the_metrics_topic():
    """Decoded ``metrics`` rows carry ``ts`` as a UTC datetime (the crash of the chaos-hang
    evidence, 2026-12-01: ``'>' not supported between datetime and int``)."""
    import pyarrow as pa

    from relax.schemas.v1 import METRICS
    from relax.streams.codec import decode, encode

    rows = [_row(1_000, "trainer", "groups_consumed", 8, 4),
            _row(9_000, "aggregate-0", "partial_groups", 2)]
    decoded = decode(encode(pa.RecordBatch.from_pylist(rows, schema=METRICS)), "metrics")
    decoded = decoded.to_pylist()
    assert not isinstance(decoded[0]["ts"], int)
    lines = stall_report(decoded, now_ms=11_000).splitlines()
    assert lines == ["aggregate-0 (2s ago): partial_groups=2", "trainer (10s ago): groups_consumed=8"]


def test_step_rows_groups_trainer_metrics_by_policy_version():
    """A step is finished once its step_s is written; other components are left out."""
    rows = [_row(1, "trainer", "loss", 0.5, 1), _row(1, "trainer", "step_s", 2.0, 1),
            _row(2, "rollout-0", "groups_sampled", 4, 1), _row(3, "trainer", "loss", 0.4, 2)]
    steps = step_rows(rows)
    assert [s["step"] for s in steps] == [1]
    assert steps[0]["loss"] == 0.5 and steps[0]["step_s"] == 2.0 and "groups_sampled" not in steps[0]


def test_accounting_balances_only_when_every_sampled_rollout_is_decided():
    ok = accounting({"a", "b", "c"}, {"trained": 2, "stale": 1}, {"a", "b", "c"})
    assert ok["balanced"] and ok["unaccounted"] == 0
    bad = accounting({"a", "b", "c", "d"}, {"trained": 2, "stale": 1}, {"a", "b", "c"})
    assert not bad["balanced"] and bad["unaccounted"] == 1
