"""Security settings of every client (``BusConfig.security_protocol``, SASL, TLS), the
``--secure`` local Kafka (SASL_SSL, SCRAM-SHA-256, a CA it makes) and the bus check that
fails fast in one line (``streams/bus_check.py``): a tiny run end to end on SASL_SSL, and
``relax train`` refused in seconds, before any run folder or topic, on a wrong password,
an unknown CA, a plaintext client on the TLS port or nothing listening."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from pydantic import ValidationError
from testdata import PARITY_REWARD, RECIPES, tiny_recipe

from relax.infra.broker import secure as kafka_secure
from relax.infra.broker.kafka import start_kafka
from relax.infra.broker.local import save_state, stop_broker
from relax.streams.bus_check import BusUnreachable, check_bus
from relax.streams.client import (
    BusConfig,
    ensure_topics,
    list_topics,
    sasl_password,
    security_kwargs,
)
from relax.streams.ports import free_port

CLI = [sys.executable, "-m", "relax.infra.cli.app"]

SASL_SSL = {"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-256",
                "sasl_username": "relax", "sasl_password_file": "/x/client.password",
                "ssl_cafile": "/x/ca.pem"}


# --- settings, no broker ---------------------------------------------------------------

@pytest.mark.parametrize(("settings", "message"), [
    ({"security_protocol": "SASL_SSL"}, "SASL_SSL needs sasl_mechanism and sasl_username"),
    ({"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "PLAIN"},
     "SASL_PLAINTEXT needs sasl_username"),
    ({"sasl_username": "u"}, "sasl_username set but security_protocol is PLAINTEXT"),
    ({"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "PLAIN", "sasl_username": "u",
          "ssl_cafile": "ca.pem"}, "ssl_cafile set but security_protocol is SASL_PLAINTEXT"),
    ({"security_protocol": "SSL", "ssl_keyfile": "k.pem"}, "ssl_keyfile set without ssl_certfile"),
    ({"security_protocol": "TLS"}, "security_protocol"),
    ({"security_protocol": "SASL_SSL", "sasl_mechanism": "GSSAPI", "sasl_username": "u"},
     "sasl_mechanism"),
])
def test_security_settings_that_cannot_work_are_refused_naming_the_field(settings, message):
    with pytest.raises(ValidationError, match=message):
        BusConfig(bootstrap_servers="h:1", **settings)


def test_security_kwargs_give_kafka_python_what_the_protocol_needs(tmp_path, monkeypatch):
    monkeypatch.delenv("RELAX_BUS_SASL_PASSWORD", raising=False)
    assert security_kwargs(BusConfig(bootstrap_servers="h:1")) == {
        "security_protocol": "PLAINTEXT"}
    pw = tmp_path / "pw"
    pw.write_text("s3cret-Value\n")
    cfg = BusConfig(bootstrap_servers="h:1", **dict(SASL_SSL, sasl_password_file=str(pw)))
    assert security_kwargs(cfg) == {
        "security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-256",
        "sasl_plain_username": "relax", "sasl_plain_password": "s3cret-Value",
        "ssl_cafile": "/x/ca.pem", "ssl_certfile": None, "ssl_keyfile": None,
        "ssl_check_hostname": True}
    assert "s3cret" not in repr(cfg) and "s3cret" not in cfg.model_dump_json()
    ssl_only = BusConfig(bootstrap_servers="h:1", security_protocol="SSL",
                         ssl_certfile="c.pem", ssl_check_hostname=False)
    assert security_kwargs(ssl_only) == {
        "security_protocol": "SSL", "ssl_cafile": None, "ssl_certfile": "c.pem",
        "ssl_keyfile": None, "ssl_check_hostname": False}


def test_the_password_comes_from_its_file_else_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("RELAX_BUS_SASL_PASSWORD", raising=False)
    no_file = BusConfig(bootstrap_servers="h:1", **dict(SASL_SSL, sasl_password_file=None))
    with pytest.raises(ValueError, match=r"needs a password: set bus.sasl_password_file .* "
                                         r"or \$RELAX_BUS_SASL_PASSWORD"):
        sasl_password(no_file)
    monkeypatch.setenv("RELAX_BUS_SASL_PASSWORD", "from-env")
    assert sasl_password(no_file) == "from-env"
    missing = BusConfig(bootstrap_servers="h:1",
                        **dict(SASL_SSL, sasl_password_file=str(tmp_path / "none")))
    with pytest.raises(ValueError, match="sasl_password_file .*none.*: cannot read it"):
        sasl_password(missing)  # a file named but missing is an error, not the variable
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="its first line is empty"):
        sasl_password(BusConfig(bootstrap_servers="h:1",
                                **dict(SASL_SSL, sasl_password_file=str(tmp_path / "empty"))))


def test_nothing_listening_is_one_line_at_once():
    t0 = time.monotonic()
    with pytest.raises(BusUnreachable, match=r"^nothing listening on 127\.0\.0\.1:\d+ "
                                             r"\(connection refused\)"):
        check_bus(BusConfig(bootstrap_servers=f"127.0.0.1:{free_port()}"))
    assert time.monotonic() - t0 < 2


def test_a_port_that_accepts_but_never_answers_is_named_with_the_request_it_left_unanswered():
    import socket

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(BusUnreachable, match=rf"^127\.0\.0\.1:{port} accepted a connection "
                                                 r"but gave no answer to ApiVersions within 1 s"):
            check_bus(BusConfig(bootstrap_servers=f"127.0.0.1:{port}"), timeout_s=1)
        assert time.monotonic() - t0 < 3


# --- a --secure local Kafka --------------------------------------------------------------

@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    """A one-node ``--secure`` local Kafka (SASL_SSL client listener) for the module."""
    h = start_kafka(tmp_path_factory.mktemp("kafka-secure"), secure=True)
    yield h
    stop_broker(h)


def _bus(h, **changes) -> BusConfig:
    return BusConfig(bootstrap_servers=h.bootstrap, **{**h.security, **changes})


def _other_ca(tmp_path: Path) -> str:
    """A CA that did not sign the broker's certificate (made like the broker's own)."""
    kafka_secure.make_tls(tmp_path, "127.0.0.1")
    return str(tmp_path / kafka_secure.CA_FILE)


@pytest.mark.kafka
def test_the_secure_layout_keeps_its_secret_to_its_owner(secure):
    d = Path(secure.data_dir)
    for name in (kafka_secure.PASSWORD_FILE, kafka_secure.SERVER_PEM):
        assert (d / name).stat().st_mode & 0o777 == 0o600, name
    password = (d / kafka_secure.PASSWORD_FILE).read_text().strip()
    assert len(password) >= 24
    assert secure.security == kafka_secure.client_settings(d)
    assert password not in str(secure.security)
    props = (d / "node-1" / "server.properties").read_text()
    assert f"SASL_SSL://127.0.0.1:{secure.port}" in props and password not in props
    for node in secure.nodes:  # clients get the TLS port only; brokers talk on loopback
        assert node.internal_port and f"INTERNAL://127.0.0.1:{node.internal_port}" in props


@pytest.mark.kafka
def test_check_bus_names_each_cause_in_one_line(secure, tmp_path):
    check_bus(_bus(secure))  # the right settings pass
    wrong = tmp_path / "wrong.password"
    wrong.write_text("not-the-password\n")
    cases = [
        (_bus(secure, sasl_password_file=str(wrong)),
         (r"^authentication failed at 127\.0\.0\.1:\d+ \(user 'relax', SCRAM-SHA-256, "
         r"password from bus\.sasl_password_file '.*wrong\.password'\): the broker says: "
         r".*invalid credentials")),
        (_bus(secure, sasl_username="mallory"), r"^authentication failed .*user 'mallory'"),
        (_bus(secure, ssl_cafile=_other_ca(tmp_path)),
         r"^the TLS certificate of 127\.0\.0\.1:\d+ is not signed by the CA in bus\.ssl_cafile"),
        (BusConfig(bootstrap_servers=secure.bootstrap),
         r"^127\.0\.0\.1:\d+ is a TLS port but bus\.security_protocol is PLAINTEXT"),
        (_bus(secure, sasl_mechanism="SCRAM-SHA-512"),
         r"does not enable bus\.sasl_mechanism SCRAM-SHA-512; it offers SCRAM-SHA-256"),
        (BusConfig(bootstrap_servers=secure.bootstrap, security_protocol="SSL",
                   ssl_cafile=secure.security["ssl_cafile"]), r"its listener wants SASL"),
    ]
    for cfg, pattern in cases:
        t0 = time.monotonic()
        with pytest.raises(BusUnreachable) as e:
            check_bus(cfg)
        assert time.monotonic() - t0 < 5, (pattern, time.monotonic() - t0)
        assert "\n" not in str(e.value)
        assert re.search(pattern, str(e.value)), (pattern, str(e.value))


def _train(recipe_args: list[str], run_root: Path, run: str) -> tuple[subprocess.CompletedProcess,
                                                                       float]:
    t0 = time.monotonic()
    r = subprocess.run([*CLI, "train", str(RECIPES / "tiny_ci.yaml"), f"run={run}",
                        f"run_root={run_root}", PARITY_REWARD, *recipe_args],
                       capture_output=True, text=True, timeout=120, env=os.environ.copy(),
                       check=False)
    return r, time.monotonic() - t0


def _overrides(bootstrap: str, settings: dict) -> list[str]:
    return [f"bootstrap_servers={bootstrap}", *(f"bus.{k}={v}" for k, v in settings.items())]


@pytest.mark.kafka
@pytest.mark.parametrize("case", ["wrong-password", "wrong-ca", "plaintext-to-tls",
                                  "nothing-listening"])
def test_relax_train_on_a_bus_it_cannot_use_exits_2_in_one_line_before_anything_is_made(
        secure, tmp_path, case):
    settings = dict(secure.security)
    bootstrap = secure.bootstrap
    if case == "wrong-password":
        (tmp_path / "pw").write_text("not-the-password\n")
        settings["sasl_password_file"] = str(tmp_path / "pw")
        cause = "authentication failed at"
    elif case == "wrong-ca":
        settings["ssl_cafile"] = _other_ca(tmp_path)
        cause = "is not signed by the CA in bus.ssl_cafile"
    elif case == "plaintext-to-tls":
        settings = {}
        cause = "is a TLS port but bus.security_protocol is PLAINTEXT"
    else:
        bootstrap = f"127.0.0.1:{free_port()}"
        cause = "nothing listening on"
    run = f"refused-{uuid.uuid4().hex[:6]}"
    before = set(list_topics(_bus(secure)))
    r, seconds = _train(_overrides(bootstrap, settings), tmp_path / "runs", run)
    print(f"{case}: exit {r.returncode} in {seconds:.1f}s")
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.startswith("error: bus: ") and r.stderr.count("\n") == 1, r.stderr
    assert cause in r.stderr, r.stderr
    assert seconds < 10, seconds
    assert not (tmp_path / "runs").exists()  # no run folder
    assert set(list_topics(_bus(secure))) == before  # no topic


@pytest.mark.kafka
def test_train_called_in_process_checks_the_bus_before_the_run_folder(secure, tmp_path):
    """``relax train`` checks before loading the recipe; ``launch.train`` (what tests and
    scripts call with a loaded recipe) checks too."""
    from relax.infra.control.launch import train
    from relax.infra.recipe.recipe import RecipeError

    (tmp_path / "pw").write_text("not-the-password\n")
    recipe = tiny_recipe(secure.bootstrap, tmp_path / "runs", "inproc",
                         *(f"bus.{k}={v}" for k, v in
                           {**secure.security, "sasl_password_file": tmp_path / "pw"}.items()))
    with pytest.raises(RecipeError, match=r"^bus: authentication failed at "):
        train(recipe)
    assert not (tmp_path / "runs").exists()


@pytest.mark.kafka
def test_resume_of_a_run_whose_password_changed_exits_2_in_one_line(secure, tmp_path):
    import yaml

    (tmp_path / "pw").write_text("not-the-password\n")
    recipe = tiny_recipe(secure.bootstrap, tmp_path, "gone",
                         *(f"bus.{k}={v}" for k, v in
                           {**secure.security, "sasl_password_file": tmp_path / "pw"}.items()))
    (tmp_path / "gone").mkdir()
    (tmp_path / "gone" / "recipe.yaml").write_text(yaml.safe_dump(recipe.model_dump(mode="json")))
    t0 = time.monotonic()
    r = subprocess.run([*CLI, "train", "--resume", str(tmp_path / "gone")], capture_output=True,
                       text=True, timeout=120, env=os.environ.copy(), check=False)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stdout + r.stderr
    assert r.stderr.startswith("error: bus: authentication failed at "), r.stderr
    assert time.monotonic() - t0 < 10


@pytest.mark.kafka
def test_a_sasl_ssl_run_needs_bootstrap_servers(tmp_path):
    """Without ``bootstrap_servers`` a run starts its own PLAINTEXT Kafka: SASL settings
    would never reach it, so that is refused in one line too."""
    r, _ = _train([f"bus.{k}={v}" for k, v in SASL_SSL.items()], tmp_path / "runs", "nobus")
    assert r.returncode == 2 and r.stderr.startswith(
        "error: bus.security_protocol: SASL_SSL needs bootstrap_servers"), r.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.kafka
@pytest.mark.e2e
def test_the_tiny_run_on_sasl_ssl_is_whole_and_leaves_the_password_nowhere(secure, local_ray,
                                                                           tmp_path):
    from relax.infra.control.launch import train

    password = Path(secure.security["sasl_password_file"]).read_text().strip()
    run = "secure" + uuid.uuid4().hex[:6]
    recipe = tiny_recipe(secure.bootstrap, tmp_path, run,
                         *(f"bus.{k}={v}" for k, v in secure.security.items()))
    lines: list[str] = []
    summary = train(recipe, say=lines.append, timeout_s=400)
    assert summary["steps"] == 3 and summary["balanced"], summary
    assert summary["trained"] + summary["stale"] + summary["filtered"] + summary["errors"] \
        == summary["sampled"] > 0
    run_dir = Path(summary["run_dir"])
    assert "sasl_password_file" in (run_dir / "recipe.yaml").read_text()
    assert password not in "\n".join(lines)
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    files += [p for p in Path(secure.data_dir).rglob("*.log") if p.is_file()]
    assert len(files) > 10 and any(p.name == "stages.json" for p in files)
    leaks = [str(p) for p in files if password.encode() in p.read_bytes()]
    assert not leaks, leaks


@pytest.mark.kafka
def test_relax_broker_start_secure_prints_the_settings_the_tools_then_use(tmp_path):
    env = {**os.environ, "RELAX_HOME": str(tmp_path / "home")}
    for k in [k for k in env if k.startswith("RELAX_BUS_") or k == "RELAX_BOOTSTRAP"]:
        del env[k]

    def relax(*args, extra_env=None):
        return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=180,
                              env={**env, **(extra_env or {})}, check=False)

    t0 = time.monotonic()
    r = relax("broker", "start", "--secure", "--dir", str(tmp_path / "k"))
    print(f"relax broker start --secure: {time.monotonic() - t0:.1f}s; {r.stdout}")
    assert r.returncode == 0, r.stdout + r.stderr
    try:
        d = tmp_path / "k"
        assert (f"bus.security_protocol=SASL_SSL bus.sasl_mechanism=SCRAM-SHA-256 "
                f"bus.sasl_username=relax bus.sasl_password_file={d / 'client.password'} "
                f"bus.ssl_cafile={d / 'tls' / 'ca.pem'}") in r.stdout
        assert (d / "client.password").read_text().strip() not in r.stdout + r.stderr
        assert (d / "client.properties").stat().st_mode & 0o777 == 0o600
        assert "security=SASL_SSL" in relax("broker", "status").stdout
        bootstrap = r.stdout.split("bootstrap=")[1].split()[0]
        ensure_topics(BusConfig(bootstrap_servers=bootstrap, **kafka_secure.client_settings(d)),
                      {"secured.topic": 2})
        # the recorded broker's settings, with no option at all
        t = relax("topics")
        assert t.returncode == 0 and "secured.topic" in t.stdout, t.stdout + t.stderr
        # Kafka's own tools with the settings file it prints
        assert f"--command-config {d / 'client.properties'}" in r.stdout
        t = relax("broker", "tool", "topics", "--bootstrap-server", bootstrap, "--list",
                  "--command-config", str(d / "client.properties"))
        assert t.returncode == 0 and "secured.topic" in t.stdout, t.stdout + t.stderr
        # the environment's settings win: a plaintext client is refused in one line
        t0 = time.monotonic()
        t = relax("topics", extra_env={"RELAX_BUS_SECURITY_PROTOCOL": "PLAINTEXT"})
        assert t.returncode == 2 and t.stderr.count("\n") == 1, t.stdout + t.stderr
        assert "is a TLS port but bus.security_protocol is PLAINTEXT" in t.stderr
        assert time.monotonic() - t0 < 10
        t = relax("topics", extra_env={"RELAX_BUS_SECURITY_PROTOCOL": "SASL_SSL"})
        assert t.returncode == 2 and "needs sasl_mechanism and sasl_username" in t.stderr
    finally:
        assert relax("broker", "stop", "--wipe").returncode == 0


@pytest.mark.kafka
def test_a_folder_keeps_the_security_it_was_made_with(secure, tmp_path):
    with pytest.raises(ValueError, match="holds a 1-node SASL_SSL Kafka cluster .* not the "
                                         "1-node PLAINTEXT cluster asked for"):
        start_kafka(secure.data_dir, secure=False)
    save_state(secure, tmp_path / "state.json")  # the record carries the settings, no secret
    assert (Path(secure.data_dir) / "client.password").read_text().strip() not in \
        (tmp_path / "state.json").read_text()
