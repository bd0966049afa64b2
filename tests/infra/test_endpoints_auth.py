"""Every HTTP endpoint of relax is behind the run's token (relax.streams.http_token): the
dashboard, the trainer's Prometheus endpoint and the control API answer 401 with an empty
body without it and 403 with another one; each refuses a bind beyond loopback without
$RELAX_API_TOKEN at start, and serves one with it."""

from __future__ import annotations

import threading

import httpx
import pytest
from pydantic import ValidationError

from relax.infra.control.scale_api import ApiServer, build_app
from relax.infra.control.scaling import RolloutScaler
from relax.infra.observe.dashboard import Dashboard
from relax.infra.recipe.recipe import ApiSection
from relax.streams.http_token import WideBindError, endpoint_token, is_loopback
from relax.trainer.telemetry import Telemetry, TelemetryConfig


@pytest.fixture(autouse=True)
def _no_env_token(monkeypatch):
    monkeypatch.delenv("RELAX_API_TOKEN", raising=False)


def _refused_without_token(url: str, token: str) -> None:
    """401 and nothing else without the token, 403 with another, 200 with it."""
    bare = httpx.get(url, timeout=10)
    assert bare.status_code == 401 and bare.content == b""
    assert bare.headers["www-authenticate"] == "Bearer"
    wrong = httpx.get(url, headers={"Authorization": "Bearer nope"}, timeout=10)
    assert wrong.status_code == 403 and wrong.content == b""
    assert httpx.get(url, headers={"Authorization": f"Bearer {token}"}, timeout=10).status_code == 200


def test_dashboard_needs_the_token(bus, unique):
    d = Dashboard(bus, unique, port=0, interval_s=0.5)
    try:
        url = d.start()
        for path in ("", "api/snapshot"):
            _refused_without_token(url + path, d.token)
        assert httpx.get(url + "api/snapshot?token=nope", timeout=10).status_code == 403
        # a browser: ?token= once sets the cookie, which the page's fetches then carry
        with httpx.Client(timeout=10) as browser:
            first = browser.get(d.login_url)
            assert first.status_code == 200 and b"reward-chart" in first.content
            assert "HttpOnly" in first.headers["set-cookie"]
            assert browser.get(url + "api/snapshot").json()["run"] == unique
    finally:
        d.stop()


def test_prometheus_needs_the_run_token(tmp_path):
    tel = Telemetry(tmp_path, "auth", TelemetryConfig(prometheus_port=0, tensorboard=False,
                                                       wandb="off"))
    try:
        tel.log_step({"loss": 0.5}, 1)
        token = (tmp_path / "api_token").read_text()
        assert (tmp_path / "api_token").stat().st_mode & 0o777 == 0o600
        _refused_without_token(f"http://127.0.0.1:{tel.prometheus_port}/metrics", token)
        body = httpx.get(f"http://127.0.0.1:{tel.prometheus_port}/metrics",
                         headers={"Authorization": f"Bearer {token}"}).text
        assert "relax_loss 0.5" in body
    finally:
        tel.close()


def _control_api(tmp_path, host: str = "127.0.0.1") -> ApiServer:
    scaler = RolloutScaler(1, 2, lambda n, urls: [])
    app = build_app(scaler, endpoint_token(tmp_path / "api_token"), lambda: {"run": "auth"},
                    lambda: [])
    return ApiServer(app, tmp_path, host, 0)


def test_control_api_needs_the_token(tmp_path):
    api = _control_api(tmp_path)
    try:
        for _ in range(100):  # uvicorn's thread starts serving
            if api.server.started:
                break
            threading.Event().wait(0.05)
        token = (tmp_path / "api_token").read_text()
        _refused_without_token(f"{api.url}/status", token)
        assert httpx.post(f"{api.url}/rollout/scale_out", json={"instances": 1}).status_code == 401
    finally:
        api.close()


def test_the_processes_of_a_run_share_its_token_file(tmp_path):
    first = endpoint_token(tmp_path / "api_token")
    assert endpoint_token(tmp_path / "api_token") == first and len(first) >= 32
    assert endpoint_token() != endpoint_token()  # no file: one per process


def test_a_wide_bind_without_the_env_token_is_refused(bus, unique, tmp_path, monkeypatch):
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    with pytest.raises(WideBindError, match=r"^the dashboard: binding 0.0.0.0 .* needs "
                                            r"\$RELAX_API_TOKEN"):
        Dashboard(bus, unique, port=0, host="0.0.0.0")
    with pytest.raises(ValidationError, match="telemetry.prometheus_host: binding 0.0.0.0"):
        TelemetryConfig(prometheus_port=0, prometheus_host="0.0.0.0")
    with pytest.raises(ValidationError, match="api.host: binding 10.0.0.7"):
        ApiSection(host="10.0.0.7")
    assert ApiSection(host="10.0.0.7", enabled=False).host == "10.0.0.7"  # nothing binds
    with pytest.raises(WideBindError, match="the control API: binding 0.0.0.0"):
        _control_api(tmp_path, "0.0.0.0")
    assert not (tmp_path / "api.json").exists()
    # with $RELAX_API_TOKEN the wide bind starts, and wants that token
    monkeypatch.setenv("RELAX_API_TOKEN", "wide-token-123")
    tel = Telemetry(tmp_path, "wide", TelemetryConfig(prometheus_port=0, prometheus_host="0.0.0.0",
                                                      tensorboard=False, wandb="off"))
    try:
        _refused_without_token(f"http://127.0.0.1:{tel.prometheus_port}/metrics", "wide-token-123")
    finally:
        tel.close()


def test_relax_dashboard_refuses_a_wide_bind_in_one_line():
    from typer.testing import CliRunner

    from relax.infra.cli.app import app

    r = CliRunner().invoke(app, ["dashboard", "--run", "x", "--host", "0.0.0.0",
                                 "--bootstrap", "127.0.0.1:1"])
    assert r.exit_code == 2
    out = r.output.strip()
    assert len(out.splitlines()) == 1 and out.startswith("error: the dashboard: binding 0.0.0.0")
