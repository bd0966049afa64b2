"""trainer telemetry: TensorBoard event files and a Prometheus endpoint from step metrics."""

from __future__ import annotations

import math
import urllib.request

from relax.trainer.telemetry import Telemetry, prometheus_name


def test_tensorboard_scalars_and_prometheus_gauges(tmp_path):
    import torch
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tel = Telemetry(tmp_path / "tb", prometheus_port=0)
    try:
        for step in range(1, 4):
            n = tel.log_step({"loss": 1.0 / step, "step_s": 2.0, "staleness_hist.1": 3 * step,
                              "grad_norm": torch.tensor(0.5 * step), "skip_nan": math.nan,
                              "skip_text": "x", "skip_none": None}, step)
            assert n == 4
        body = urllib.request.urlopen(
            f"http://127.0.0.1:{tel.prometheus_port}/metrics", timeout=5).read().decode()
    finally:
        tel.close()
    lines = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in body.splitlines()
             if ln and not ln.startswith("#")}
    assert lines["relax_loss"] == 1.0 / 3 and lines["relax_step"] == 3.0
    assert lines["relax_staleness_hist_1"] == 9.0 and lines["relax_grad_norm"] == 1.5
    assert not any("skip" in k for k in lines)

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"loss", "step_s", "staleness_hist.1", "grad_norm"}
    loss = acc.Scalars("loss")
    assert [e.step for e in loss] == [1, 2, 3]
    assert [round(e.value, 6) for e in loss] == [1.0, 0.5, round(1 / 3, 6)]


def test_prometheus_names():
    assert prometheus_name("staleness_hist.12") == "relax_staleness_hist_12"
    assert prometheus_name("reward.gsm8k/x") == "relax_reward_gsm8k_x"
