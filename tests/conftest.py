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


@pytest.fixture(autouse=True)
def _relax_home(tmp_path_factory, monkeypatch):
    """Keep relax's local state (broker state file, caches) out of the user's home,
    except the model cache, which is expensive to rebuild."""
    home = tmp_path_factory.getbasetemp() / "relax_home"
    home.mkdir(exist_ok=True)
    monkeypatch.setenv("RELAX_HOME", str(home))
