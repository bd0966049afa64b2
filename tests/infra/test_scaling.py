"""The scaling operations' state machine (pure: the controller's part is a function that
records what it was asked)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from relax.infra.control.scaling import RolloutScaler, ScaleConflict, ScaleError, moved_servers


def _scaler(applied: list[int]) -> RolloutScaler:
    def apply(n: int, urls: list[str] | None) -> list[str]:
        assert urls is None
        applied.append(n)
        return [f"rollout-{i}" for i in range(n)]
    return RolloutScaler(instances=1, max_instances=3, apply=apply, timeout_s=60)


def _beats(n: int, loop: float | None = 0.1) -> dict:
    return {f"rollout-{i}": {"loop_age_s": loop} for i in range(n)}


def _rows(n: int, version: int) -> list[dict]:
    ts = datetime.now(timezone.utc) + timedelta(milliseconds=1)  # as decoded from the bus
    return [{"component": f"rollout-{i}", "policy_version": version, "ts": ts} for i in range(n)]


def test_an_operation_goes_through_its_states_once():
    applied = []
    sc = _scaler(applied)
    op = sc.request(2)
    assert op.state == "PENDING" and sc.request(2) is op  # a retry is the same operation
    assert sc.base() == 1  # a retried "+1" names the same target
    sc.advance({}, [], trainer_version=5)
    assert op.state == "HEALTH_CHECKING" and applied == [2] and sc.instances == 2
    sc.advance(_beats(2, loop=None), [], 5)
    assert op.state == "HEALTH_CHECKING"  # loops not turning yet
    sc.advance(_beats(2), [], 5)
    assert op.state == "WEIGHT_SYNCING"
    sc.advance(_beats(2), _rows(2, 4), 6)  # weights older than the trainer's at the start
    assert op.state == "WEIGHT_SYNCING"
    sc.advance(_beats(2), _rows(1, 5), 6)  # one instance only
    assert op.state == "WEIGHT_SYNCING"
    sc.advance(_beats(2), _rows(2, 5), 6)
    assert op.state == "ACTIVE" and applied == [2]
    assert [h.split(" ", 1)[1].split(":")[0] for h in op.history] == \
        ["PENDING", "STARTING", "HEALTH_CHECKING", "WEIGHT_SYNCING", "ACTIVE"]
    assert sc.request(2) is op and sc.base() == 2  # already there


def test_one_operation_at_a_time_and_cancel_only_before_it_starts():
    sc = _scaler([])
    op = sc.request(2)
    with pytest.raises(ScaleConflict, match=op.id):
        sc.request(3)
    assert sc.cancel(op.id).state == "CANCELLED"
    op3 = sc.request(3)
    sc.advance({}, [], 0)
    with pytest.raises(ScaleConflict, match="only a PENDING one"):
        sc.cancel(op3.id)
    with pytest.raises(KeyError):
        sc.cancel("nope")


@pytest.mark.parametrize("n", [0, 4])
def test_counts_outside_the_partitions_are_refused(n):
    with pytest.raises(ScaleError, match=r"instances: .* outside 1\.\.3"):
        _scaler([]).request(n)


def test_an_operation_that_does_not_finish_fails():
    sc = _scaler([])
    sc.timeout_s = 0.0
    op = sc.request(2)
    sc.advance({}, [], 0)
    sc.advance({}, [], 0)
    assert op.state == "FAILED" and "not ACTIVE after" in op.error


def test_engines_report_the_running_operation():
    sc = _scaler([])
    sc.request(2)
    sc.advance({}, [], 0)
    engines = sc.engines(_beats(2), {"rollout-0": {"pid": 7, "node": "10.0.0.2", "restarts": 1}})
    assert [(e["name"], e["state"], e["pid"]) for e in engines] == \
        [("rollout-0", "HEALTH_CHECKING", 7), ("rollout-1", "HEALTH_CHECKING", None)]


def test_sglang_servers_are_added_at_the_end_and_removed_newest_first():
    applied = []

    def apply(n: int, urls: list[str] | None) -> list[str]:
        applied.append((n, urls))
        return [f"rollout-{i}" for i in range(n)]

    sc = RolloutScaler(1, 3, apply, timeout_s=60, engine_urls=["http://a:30000"])
    with pytest.raises(ScaleError, match="rollout engine is sglang: give the servers"):
        sc.request(2)
    n, urls = moved_servers(sc.base_engine_urls(), ["http://b:30000"], +1)
    op = sc.request(n, urls)
    assert sc.request(2, ["http://a:30000", "http://b:30000"]) is op  # a retry
    with pytest.raises(ScaleConflict):
        sc.request(2, ["http://a:30000", "http://c:30000"])  # other servers, same count
    assert sc.base_engine_urls() == ["http://a:30000"]  # until it is done
    sc.advance({}, [], 0)
    assert applied == [(2, ["http://a:30000", "http://b:30000"])]
    assert sc.engine_urls == ["http://a:30000", "http://b:30000"]
    sc.advance(_beats(2), _rows(2, 0), 0)
    sc.advance(_beats(2), _rows(2, 0), 0)
    assert op.state == "ACTIVE" and sc.base_engine_urls() == sc.engine_urls
    assert [e["engine_url"] for e in sc.engines(_beats(2), {})] == sc.engine_urls
    with pytest.raises(ScaleError, match=r"drive an instance already"):
        moved_servers(sc.engine_urls, ["http://b:30000"], +1)
    with pytest.raises(ScaleError, match=r"newest 1 are \['http://b:30000'\]"):
        moved_servers(sc.engine_urls, ["http://a:30000"], -1)
    assert moved_servers(sc.engine_urls, ["http://b:30000"], -1) == (1, ["http://a:30000"])
    with pytest.raises(ScaleError, match="one distinct server per instance"):
        sc.request(3, ["http://a:30000", "http://b:30000", "http://b:30000"])


def test_an_engine_inside_the_instances_scales_by_count_only():
    sc = _scaler([])
    with pytest.raises(ScaleError, match="run inside its rollout instances"):
        moved_servers(sc.base_engine_urls(), ["http://b:30000"], +1)
    with pytest.raises(ScaleError, match="run inside its rollout instances"):
        sc.request(1, ["http://b:30000"])


def test_the_api_takes_servers_on_an_sglang_run_and_counts_on_another():
    from fastapi.testclient import TestClient

    from relax.infra.control.scale_api import build_app

    def serve(urls):
        sc = RolloutScaler(1, 3, lambda n, u: [], engine_urls=urls)
        client = TestClient(build_app(sc, "t", dict, list))
        client.headers["Authorization"] = "Bearer t"
        return client

    sglang = serve(["http://a:30000"])
    r = sglang.post("/rollout/scale_out", json={"engine_urls": ["http://b:30000"]})
    assert r.status_code == 202 and r.json()["engine_urls"] == ["http://a:30000", "http://b:30000"]
    r = sglang.post("/rollout/scale_out", json={"instances": 1})
    assert r.status_code == 422 and "give the servers" in r.json()["detail"]
    r = sglang.post("/rollout/scale_out", json={"instances": 1, "engine_urls": ["http://c:1"]})
    assert r.status_code == 422 and "one of them" in r.json()["detail"]
    hf = serve(None)
    r = hf.post("/rollout/scale_out", json={"engine_urls": ["http://b:30000"]})
    assert r.status_code == 422 and "run inside its rollout instances" in r.json()["detail"]
    assert hf.post("/rollout/scale_out", json={"instances": 1}).status_code == 202
