"""Shared fixtures: a real Kafka-protocol broker (Tansu) for the whole session.

Tests that touch the bus take ``bus`` (a :class:`relax.streams.client.BusConfig`)
and make their own topics with unique names (``unique``), so they never see
each other's records.
"""

from __future__ import annotations

import os
import uuid

import pytest


@pytest.fixture(scope="session")
def broker():
    """A Tansu broker on a free port for the test session; stopped at the end."""
    from relax.infra.broker import start_broker, stop_broker

    external = os.environ.get("RELAX_TEST_BOOTSTRAP")
    if external:  # run the suite against another Kafka cluster
        yield external
        return
    h = start_broker()
    try:
        yield h.bootstrap
    finally:
        stop_broker(h)


@pytest.fixture
def bus(broker, tmp_path):
    """Bus settings for the session broker, with a blob store in ``tmp_path``."""
    from relax.streams.client import BusConfig

    return BusConfig(bootstrap_servers=broker, blob_store=str(tmp_path / "blobs"))


@pytest.fixture
def unique():
    """A short unique name for runs, topics and groups of one test."""
    return "t" + uuid.uuid4().hex[:10]


@pytest.fixture(scope="session", autouse=True)
def _tests_importable_by_stage_processes():
    """Stage processes (Ray actors, reward workers) import test helpers such as
    ``testdata:parity_reward``: put tests/ on their PYTHONPATH."""
    here = os.path.dirname(os.path.abspath(__file__))
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = here + (os.pathsep + old if old else "")
    yield
    if old is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = old


@pytest.fixture(autouse=True)
def _relax_home(tmp_path_factory, monkeypatch):
    """Keep relax's local state (broker state file, caches) out of the user's home,
    except the model cache, which is expensive to rebuild."""
    home = tmp_path_factory.getbasetemp() / "relax_home"
    home.mkdir(exist_ok=True)
    monkeypatch.setenv("RELAX_HOME", str(home))


@pytest.fixture(scope="session")
def tiny_run(broker, tmp_path_factory):
    """``(recipe, summary)`` of recipes/tiny_ci.yaml run end to end through the session
    broker (every stage its own process); its topics stay on the broker for the tests
    that read them (archive, monitor, dashboard, recompute-loss)."""
    from relax.infra.launch import train
    from testdata import tiny_recipe

    root = tmp_path_factory.mktemp("runs")
    recipe = tiny_recipe(broker, root, "tiny" + uuid.uuid4().hex[:6],
                         "trainer.keep_checkpoints=10")
    lines: list[str] = []
    summary = train(recipe, say=lines.append, timeout_s=400)
    summary["lines"] = lines
    return recipe, summary
