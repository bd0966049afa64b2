"""relax dashboard: the JSON API, and the page rendered by a real headless chromium."""

from __future__ import annotations

import contextlib
import json
import os
import time
import urllib.request
from pathlib import Path

import pytest
from testdata import produce_run

from relax.infra.observe.dashboard import Dashboard
from relax.schemas import topics

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def _commit(cfg, group: str, topic: str, offsets: dict[int, int]) -> None:
    """Commit offsets for ``group`` without joining it (manual assignment)."""
    from kafka import KafkaConsumer, TopicPartition
    from kafka.structs import OffsetAndMetadata

    from relax.streams.client import consumer_kwargs

    c = KafkaConsumer(**consumer_kwargs(cfg, group))
    try:
        tps = {TopicPartition(topic, p): OffsetAndMetadata(o, "", -1) for p, o in offsets.items()}
        c.assign(list(tps))
        c.commit(tps)
    finally:
        c.close(autocommit=False)


def _finished_run(cfg, run: str) -> str:
    """A synthetic finished run whose trainer consumer group is 2 messages behind."""
    produce_run(cfg, run, steps=4)
    group = topics.group(run, "trainer")
    _commit(cfg, group, topics.run_topic(run, "train_samples"), {0: 3, 1: 3})  # of 8 messages
    return group


def _get(url: str, token: str) -> bytes:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200
        return r.read()


def test_dashboard_api_serves_the_snapshot(bus, unique):
    group = _finished_run(bus, unique)
    d = Dashboard(bus, unique, port=0, interval_s=0.3)
    try:
        url = d.start()
        assert url.startswith("http://127.0.0.1:")
        deadline = time.monotonic() + 20
        snap = json.loads(_get(url + "api/snapshot", d.token))
        while snap.get("pending") and time.monotonic() < deadline:
            time.sleep(0.1)
            snap = json.loads(_get(url + "api/snapshot", d.token))
        assert snap["run"] == unique and snap["error"] is None and snap["interval_s"] == 0.3
        assert snap["groups"][group]["lag"] == 2
        assert [v["policy_version"] for v in snap["versions"]] == [1, 2, 3, 4]
        assert b"<svg id=\"reward-chart\"" in _get(url, d.token)
        with pytest.raises(urllib.error.HTTPError, match="404"):
            _get(url + "nope", d.token)
    finally:
        d.stop()


@contextlib.contextmanager
def _dashboard_page(bus, run: str):
    """A headless-chromium page opened on ``relax dashboard`` of ``run`` (skips when
    chromium is absent); the browser and the server stop on exit."""
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is absent (apt-get install -y chromium)")
    from playwright.sync_api import sync_playwright

    d = Dashboard(bus, run, port=0, interval_s=0.5)
    d.start()
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.goto(d.login_url)  # the token once; the page's fetches carry its cookie
                yield page
            finally:
                browser.close()
    finally:
        d.stop()


def _screenshot(page, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / name
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    return shot


@pytest.mark.browser
def test_dashboard_page_renders_charts_in_headless_chromium(bus, unique):
    _finished_run(bus, unique)
    with _dashboard_page(bus, unique) as page:
        # reward: 4 versions x (reward_mean, accuracy); lag: >= 2 refreshes
        page.wait_for_function(
            "document.querySelectorAll('#reward-chart circle.pt-reward').length === 4"
            " && document.querySelectorAll('#lag-chart circle.pt-lag').length >= 2",
            timeout=30_000)
        assert page.locator("#reward-chart circle.pt-accuracy").count() == 4
        assert page.locator("#reward-chart polyline").count() == 2
        bars = page.locator("#staleness-chart rect.bar")
        assert bars.count() == 2
        assert [bars.nth(i).get_attribute("data-v") for i in range(2)] == ["24", "14"]
        ys = [float(page.locator("#reward-chart circle.pt-reward").nth(i)
                    .get_attribute("data-y")) for i in range(4)]
        assert ys == pytest.approx([0.2, 0.3, 0.4, 0.5])
        assert page.text_content("#tile-version") == "4"
        assert page.text_content("#tile-wait") == "25.0%"
        assert page.text_content("#tile-lag") == "2"
        assert page.text_content("#tile-errors") == "1"
        assert page.text_content("#tile-reward") == "0.500"
        assert "trainer" in page.text_content("#groups")
        assert page.locator("#topics tr").count() == 9  # the run topics (testdata.produce_run)
        assert "updated" in page.text_content("#status")
        cells = page.locator("#timeline-chart rect.busy-cell")  # the trainer's 4 steps
        assert cells.count() == 4
        assert {cells.nth(i).get_attribute("data-component") for i in range(4)} == {"trainer"}
        assert [float(cells.nth(i).get_attribute("data-frac")) for i in range(4)] == [0.75] * 4
        shot = _screenshot(page, "dashboard.png")
        print(f"dashboard screenshot: {shot}")
    assert os.path.exists(shot)


@pytest.mark.browser
def test_dashboard_of_a_finished_tiny_run_in_headless_chromium(tiny_run, bus):
    """The page of a real finished tiny-model run: the reward chart has one point per
    trained step, the staleness histogram has bars, the version tile says 3, the stage
    timeline has a row of busy/idle cells for every stage (busy_frac in [0, 1], some
    stage busy at some time)."""
    recipe, summary = tiny_run
    with _dashboard_page(bus, recipe.run) as page:
        page.wait_for_function(
            "document.querySelectorAll('#reward-chart circle.pt-reward').length === 3",
            timeout=30_000)
        assert page.locator("#staleness-chart rect.bar").count() >= 1
        assert page.text_content("#tile-version") == "3"
        page.wait_for_function(
            "document.querySelectorAll('#timeline-chart text.stage-name').length >= 4",
            timeout=30_000)
        stages = {page.locator("#timeline-chart text.stage-name").nth(i).text_content()
                  for i in range(page.locator("#timeline-chart text.stage-name").count())}
        assert {"trainer", "rollout-0", "aggregate-0", "reward.parity"} <= stages, stages
        fracs = page.eval_on_selector_all(
            "#timeline-chart rect.busy-cell", "rs => rs.map(r => Number(r.dataset.frac))")
        assert all(0.0 <= f <= 1.0 for f in fracs) and max(fracs) > 0.2, fracs
        _screenshot(page, "dashboard-tiny-run.png")


@pytest.mark.browser
def test_dashboard_draws_the_held_out_eval_curve(bus, unique):
    """``eval.every``'s rows (component ``eval``: versions 0, 2, 4) are a third curve of the
    reward chart, and the newest is the held-out tile."""
    from relax.schemas import metric_names as M
    from relax.streams.metrics import MetricsWriter
    from relax.streams.producer import BatchProducer

    produce_run(bus, unique, steps=4, partitions=1)  # <run>.metrics: 1, as the stages make it
    p = BatchProducer(bus, producer_id=f"{unique}-eval")
    w = MetricsWriter(p, unique, M.EVAL_COMPONENT)
    for v, acc in ((0, 0.25), (2, 0.5), (4, 0.75)):
        w.add_many({M.EVAL_ACCURACY: acc, M.EVAL_N: 4, M.EVAL_CORRECT: 4 * acc}, v)
    w.flush()
    p.close()
    with _dashboard_page(bus, unique) as page:
        page.wait_for_function(
            "document.querySelectorAll('#reward-chart circle.pt-eval').length === 3", timeout=30_000)
        pts = page.locator("#reward-chart circle.pt-eval")
        assert [(float(pts.nth(i).get_attribute("data-x")), float(pts.nth(i).get_attribute("data-y")))
                for i in range(3)] == [(0, 0.25), (2, 0.5), (4, 0.75)]
        assert page.text_content("#tile-eval") == "0.750 @ v4"
        assert "held-out accuracy" in page.text_content("#reward-legend")
