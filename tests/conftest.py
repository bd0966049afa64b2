"""Shared fixtures: a real Apache Kafka, started once for the whole session.

Tests that touch the bus take ``broker`` (its ``bootstrap_servers``) or ``bus`` (a
:class:`relax.streams.client.BusConfig` for it), and make their own topics with unique
names (``unique``), so they never see each other's records. Kafka starts at the first
test that needs it (about 5 s). Tests of the broker itself (faults, restarts, clusters,
retention, security) carry the ``kafka`` marker: ``pytest -m kafka`` runs them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import httpx
import pytest

# Tests stay on this machine: huggingface_hub answers "offline" at once instead of
# reaching for the Hub (preflight's check of an unknown model name, for one).
os.environ["HF_HUB_OFFLINE"] = "1"


@pytest.fixture(scope="session")
def broker(tmp_path_factory):
    """``bootstrap_servers`` of a single-node Apache Kafka (KRaft) on free ports for the
    test session, its data in the session's temporary folder; stopped at the end.
    ``RELAX_TEST_BOOTSTRAP`` runs the suite against another Kafka cluster instead."""
    from relax.infra.broker.kafka import start_kafka
    from relax.infra.broker.local import stop_broker

    external = os.environ.get("RELAX_TEST_BOOTSTRAP")
    if external:
        yield external
        return
    h = start_kafka(tmp_path_factory.mktemp("kafka"))
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
def s3_endpoint():
    """``host:port`` of an S3-compatible server (moto's) on loopback, with test
    credentials in the environment (where pyarrow's S3 file system reads them)."""
    from relax.streams.ports import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    old = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                          "AWS_REGION")}
    os.environ.update(AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test",
                      AWS_REGION="us-east-1")
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(f"http://127.0.0.1:{port}/", timeout=1)
            break
        except httpx.TransportError:
            assert proc.poll() is None and time.monotonic() < deadline, "moto did not start"
            time.sleep(0.2)
    yield f"127.0.0.1:{port}"
    proc.kill()
    proc.wait()
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def local_ray(tmp_path_factory):
    """One local Ray for the session's in-process runs: a run's controller finds it up,
    uses it and leaves it up, which saves the ~6 s a Ray takes to start and stop on 2
    cores in each run (the ``relax train`` subprocesses still start their own)."""
    import ray

    from relax.infra.control.controller import start_local_ray

    home = tmp_path_factory.getbasetemp() / "relax_home"  # what _relax_home gives each test
    home.mkdir(exist_ok=True)
    old = os.environ.get("RELAX_HOME")
    os.environ["RELAX_HOME"] = str(home)  # the stage processes inherit Ray's environment
    start_local_ray(8)
    if old is None:
        os.environ.pop("RELAX_HOME")
    else:
        os.environ["RELAX_HOME"] = old
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_run(broker, local_ray, tmp_path_factory):
    """``(recipe, summary)`` of recipes/tiny_ci.yaml run end to end through the session
    broker (every stage its own process); its topics stay on the broker for the tests
    that read them (archive, monitor, dashboard, recompute-loss)."""
    from testdata import tiny_recipe

    from relax.infra.control.launch import train

    root = tmp_path_factory.mktemp("runs")
    recipe = tiny_recipe(broker, root, "tiny" + uuid.uuid4().hex[:6],
                         "trainer.keep_checkpoints=10", "telemetry.wandb=offline")
    lines: list[str] = []
    summary = train(recipe, say=lines.append, timeout_s=400)
    summary["lines"] = lines
    return recipe, summary
