"""trainer telemetry: TensorBoard event files, a Prometheus endpoint and an offline W&B
run from step metrics."""

from __future__ import annotations

import math
import urllib.request

import pytest
from wandb_records import history, run_ids

from relax.trainer.telemetry import (
    Telemetry,
    TelemetryConfig,
    has_wandb_key,
    prometheus_name,
    wandb_id,
    wandb_mode,
)


def test_tensorboard_scalars_prometheus_gauges_and_wandb_history(tmp_path, monkeypatch):
    monkeypatch.delenv("RELAX_API_TOKEN", raising=False)
    import torch
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tel = Telemetry(tmp_path, "tel-run", TelemetryConfig(prometheus_port=0, wandb="offline"))
    assert tel.wandb_mode == "offline"
    try:
        for step in range(1, 4):
            n = tel.log_step({"loss": 1.0 / step, "step_s": 2.0, "staleness_hist.1": 3 * step,
                              "grad_norm": torch.tensor(0.5 * step), "skip_nan": math.nan,
                              "skip_text": "x", "skip_none": None}, step)
            assert n == 4
        token = (tmp_path / "api_token").read_text()  # the run's token (no $RELAX_API_TOKEN)
        body = urllib.request.urlopen(urllib.request.Request(
            f"http://127.0.0.1:{tel.prometheus_port}/metrics",
            headers={"Authorization": f"Bearer {token}"}), timeout=5).read().decode()
    finally:
        tel.close()
    lines = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in body.splitlines()
             if ln and not ln.startswith("#")}
    assert lines["relax_loss"] == 1.0 / 3 and lines["relax_step"] == 3.0
    assert lines["relax_staleness_hist_1"] == 9.0 and lines["relax_grad_norm"] == 1.5
    assert not any("skip" in k for k in lines)

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"loss", "step_s", "staleness_hist.1", "grad_norm"}
    loss = acc.Scalars("loss")
    assert [e.step for e in loss] == [1, 2, 3]
    assert [round(e.value, 6) for e in loss] == [1.0, 0.5, round(1 / 3, 6)]

    rows = history(tmp_path)
    assert [r["_step"] for r in rows] == [1, 2, 3]
    assert [r["loss"] for r in rows] == [1.0, 0.5, 1 / 3]
    assert [r["grad_norm"] for r in rows] == [0.5, 1.0, 1.5]
    assert not any(k.startswith("skip") for r in rows for k in r)
    assert run_ids(tmp_path) == {"tel-run"}


def test_wandb_resumes_the_run_and_spans_log_blocks(tmp_path):
    """A restarted trainer logs into the same W&B run id; 300 steps of 40 metrics cross
    the transaction log's 32 KiB blocks (records split over blocks read back whole)."""
    metrics = {f"m{i}": float(i) for i in range(40)}
    for first, last in ((1, 150), (151, 300)):
        with Telemetry(tmp_path, "resumed", TelemetryConfig(tensorboard=False, wandb="offline")) as tel:
            for step in range(first, last + 1):
                tel.log_step({**metrics, "step_no": step}, step)
    rows = history(tmp_path)
    assert [r["_step"] for r in rows] == list(range(1, 301))
    assert all(r["step_no"] == r["_step"] and r["m39"] == 39.0 for r in rows)
    assert run_ids(tmp_path) == {"resumed"}
    assert not (tmp_path / "tensorboard").exists()


def test_wandb_off_writes_nothing(tmp_path):
    with Telemetry(tmp_path, "off", TelemetryConfig(tensorboard=False, wandb="off")) as tel:
        assert tel.log_step({"loss": 1.0}, 1) == 1
    assert not (tmp_path / "wandb").exists()


def test_wandb_auto_is_online_only_with_a_key(tmp_path):
    netrc = tmp_path / "netrc"
    assert not has_wandb_key({}, str(netrc))
    assert has_wandb_key({"WANDB_API_KEY": "k"}, str(netrc))
    netrc.write_text("machine example.com login u password p\n")
    assert not has_wandb_key({}, str(netrc))
    netrc.write_text("machine api.wandb.ai login user password secret\n")
    assert has_wandb_key({}, str(netrc))
    assert has_wandb_key({"NETRC": str(netrc)}, None)
    assert wandb_mode("auto", True) == "online" and wandb_mode("auto", False) == "offline"
    assert wandb_mode("off", True) == "off" and wandb_mode("offline", True) == "offline"


def test_bad_telemetry_settings_are_named():
    with pytest.raises(ValueError, match="wandb"):
        TelemetryConfig(wandb="cloud")
    with pytest.raises(ValueError, match="prometheus_port"):
        TelemetryConfig(prometheus_port=70000)


def test_names():
    assert prometheus_name("staleness_hist.12") == "relax_staleness_hist_12"
    assert prometheus_name("reward.gsm8k/x") == "relax_reward_gsm8k_x"
    assert wandb_id("a/b:c") == "a-b-c"


def test_stage_board_writes_every_other_stage_under_component_and_name(tmp_path):
    from datetime import datetime, timezone

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from relax.trainer.telemetry import StageBoard

    ts = datetime(2026, 12, 7, tzinfo=timezone.utc)
    rows = [dict(ts=ts, component="rollout-0", name="gen_tokens_per_s", value=12.5,
                 policy_version=3),
            dict(ts=ts, component="aggregate-0", name="partial_groups", value=2.0,
                 policy_version=None),
            dict(ts=ts, component="trainer", name="loss", value=0.1, policy_version=3),
            dict(ts=ts, component="eval", name="eval_accuracy", value=0.5, policy_version=2),
            dict(ts=ts, component="reward.parity", name="reward_rows", value=float("nan"),
                 policy_version=1)]
    board = StageBoard(tmp_path)
    assert board.add(rows) == 2  # the trainer's and the eval's have their own sinks
    board.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard" / "stages"))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["aggregate-0/partial_groups",
                                              "rollout-0/gen_tokens_per_s"]
    (e,) = acc.Scalars("rollout-0/gen_tokens_per_s")
    assert (e.step, e.value, e.wall_time) == (3, 12.5, ts.timestamp())
    assert acc.Scalars("aggregate-0/partial_groups")[0].step == 0
