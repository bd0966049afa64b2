"""Step metrics to TensorBoard, Prometheus and Weights & Biases, for the trainer.

The bus (``<run>.metrics``) is the record of a run; this helper also exposes the
trainer's step metrics to the tools people already watch (recipe block ``telemetry:``,
:class:`TelemetryConfig`):

* TensorBoard event files under ``<run_dir>/tensorboard`` (:class:`ScalarWriter`, on
  the ``tensorboard`` package's own event writer; one scalar per metric name, x = step);
* a Prometheus scrape endpoint (``prometheus_client``'s text format) on
  ``prometheus_host:prometheus_port`` when a port is given, behind the run's token
  (:mod:`relax.streams.http_token`: ``Authorization: Bearer``, the token in
  ``<run_dir>/api_token`` or ``$RELAX_API_TOKEN``; 401 with an empty body without it; a
  host beyond loopback needs ``$RELAX_API_TOKEN``): one gauge per metric, named ``relax_<name>`` with every
  character outside ``[a-zA-Z0-9_]`` replaced by ``_`` (``staleness_hist.2`` ->
  ``relax_staleness_hist_2``), plus ``relax_step``. The registry is private to the
  instance, so several may live in one process;
* a W&B run (``wandb``) with the relax run's name as its id (a restarted trainer resumes
  it), one history row per step (``step`` = policy_version). Mode ``auto`` (the default)
  is ``online`` when the user has a W&B key (``WANDB_API_KEY`` or an ``api.wandb.ai``
  entry in ``~/.netrc``) and ``offline`` otherwise: the run is written under
  ``<run_dir>/wandb/`` and ``wandb sync <run_dir>/wandb/offline-run-*`` uploads it later.

Values that are not finite numbers (None, NaN, inf, text) are skipped.
"""

from __future__ import annotations

import math
import netrc
import os
import re
import threading
import time
from pathlib import Path
from typing import Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator

from relax.streams.http_token import bearer, check_bind, endpoint_token, token_status

_BAD = re.compile(r"[^a-zA-Z0-9_]")


def prometheus_name(name: str, prefix: str = "relax_") -> str:
    """A legal Prometheus metric name for a relax metric name."""
    return prefix + _BAD.sub("_", name)


WandbMode = Literal["auto", "offline", "online", "off"]


def wandb_id(run: str) -> str:
    """A W&B run id for a relax run name (W&B ids may not hold ``/ \\ # ? % :``)."""
    return re.sub(r"[/\\#?%:]", "-", run)


class ScalarWriter:
    """TensorBoard scalars in an event file under ``log_dir``: the ``tensorboard``
    package's ``EventFileWriter`` with ``Summary.Value(simple_value=...)`` events, what
    ``torch.utils.tensorboard.SummaryWriter.add_scalar`` writes, without importing torch
    (the driver's :class:`StageBoard` runs in a process without it).

    Args:
        log_dir: folder of the event file (created).
    """

    def __init__(self, log_dir: str | Path):
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._writer, self._event, self._summary = EventFileWriter(str(log_dir)), Event, Summary

    def add_scalar(self, tag: str, value: float, step: int,
                   walltime: float | None = None) -> None:
        """One scalar ``value`` under ``tag`` at ``step``; ``walltime`` in epoch seconds
        (None: now)."""
        summary = self._summary(value=[self._summary.Value(tag=tag, simple_value=float(value))])
        self._writer.add_event(self._event(
            wall_time=time.time() if walltime is None else walltime, step=int(step),
            summary=summary))

    def flush(self) -> None:
        """Write what is queued to the event file."""
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self._writer.close()


class TelemetryConfig(BaseModel):
    """Where the trainer's step metrics go besides the bus (recipe block ``telemetry:``).

    Attributes:
        tensorboard: write TensorBoard event files under ``<run_dir>/tensorboard``.
        prometheus_port: serve ``/metrics`` at this port (0 = a free one, logged); None =
            no endpoint.
        prometheus_host: the address it binds (loopback; another one needs
            ``$RELAX_API_TOKEN``).
        wandb: ``auto`` (online with a W&B key, else offline), ``offline`` (into
            ``<run_dir>/wandb``), ``online`` or ``off``.
        wandb_project / wandb_entity: the W&B project and entity (team or user; None =
            the key's default).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    tensorboard: bool = True
    prometheus_port: int | None = Field(None, ge=0, le=65535)
    prometheus_host: str = "127.0.0.1"
    wandb: WandbMode = "auto"
    wandb_project: str = "relax"
    wandb_entity: str | None = None

    @field_validator("prometheus_host")
    @classmethod
    def _token_for_wide_bind(cls, host: str) -> str:
        check_bind(host, "telemetry.prometheus_host")
        return host


def has_wandb_key(environ: dict[str, str] | None = None, netrc_path: str | None = None) -> bool:
    """Whether a W&B key is configured: ``WANDB_API_KEY`` set, or an ``api.wandb.ai``
    machine in the netrc file (``NETRC`` or ``~/.netrc``)."""
    env = os.environ if environ is None else environ
    if env.get("WANDB_API_KEY"):
        return True
    path = Path(netrc_path or env.get("NETRC") or Path.home() / ".netrc")
    if not path.is_file():
        return False
    try:
        return netrc.netrc(path).authenticators("api.wandb.ai") is not None
    except (netrc.NetrcParseError, OSError):
        return False


def wandb_mode(mode: WandbMode, has_key: bool) -> str:
    """The W&B mode ``auto`` stands for (``online`` with a key, else ``offline``)."""
    if mode == "auto":
        return "online" if has_key else "offline"
    return mode


def _metrics_server(host: str, port: int, registry, token: str):
    """An HTTP server (not started) answering ``GET /metrics`` with ``registry`` in the
    Prometheus text format to requests that carry ``token`` (401/403, empty body, else)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            code = token_status(bearer(self.headers.get("Authorization")), token)
            if code == 200 and self.path.split("?", 1)[0] not in ("/", "/metrics"):
                code = 404
            body = generate_latest(registry) if code == 200 else b""
            self.send_response(code)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST if body else "text/plain")
            self.send_header("Content-Length", str(len(body)))
            if code == 401:
                self.send_header("WWW-Authenticate", "Bearer")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt, *args):  # no access log on stderr
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


class Telemetry:
    """TensorBoard writer, optional Prometheus endpoint and optional W&B run for step
    metrics.

    Args:
        run_dir: the run folder (``tensorboard/`` and ``wandb/`` go under it; created if
            needed).
        run: the run name (the W&B run's id and name).
        cfg: which sinks (:class:`TelemetryConfig`).

    Raises:
        OSError: the Prometheus port is in use.
        WideBindError: ``prometheus_host`` is beyond loopback without ``$RELAX_API_TOKEN``.
        wandb.errors.CommError: online W&B could not be reached.
    """

    def __init__(self, run_dir: str | Path, run: str, cfg: TelemetryConfig | None = None):
        cfg = cfg or TelemetryConfig()
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._tb = self._wandb = None
        if cfg.tensorboard:
            self._tb = ScalarWriter(self.run_dir / "tensorboard")
        self._gauges: dict[str, object] = {}
        self._server = self._thread = self._registry = None
        self.prometheus_port: int | None = None
        if cfg.prometheus_port is not None:
            from prometheus_client import CollectorRegistry

            check_bind(cfg.prometheus_host, "the Prometheus endpoint")
            self._registry = CollectorRegistry()
            self._server = _metrics_server(cfg.prometheus_host, cfg.prometheus_port,
                                           self._registry, endpoint_token(self.run_dir / "api_token"))
            self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                            name="relax-prometheus")
            self._thread.start()
            self.prometheus_port = self._server.server_port
        self.wandb_mode = wandb_mode(cfg.wandb, cfg.wandb == "auto" and has_wandb_key())
        if self.wandb_mode != "off":
            import wandb

            self._wandb = wandb.init(
                project=cfg.wandb_project, entity=cfg.wandb_entity, id=wandb_id(run), name=run,
                dir=str(self.run_dir), mode=self.wandb_mode, resume="allow",
                settings=wandb.Settings(silent=True, console="off", x_disable_stats=True))

    def _gauge(self, name: str):
        from prometheus_client import Gauge

        g = self._gauges.get(name)
        if g is None:
            g = Gauge(prometheus_name(name), f"relax metric {name}", registry=self._registry)
            self._gauges[name] = g
        return g

    def log_step(self, metrics: dict[str, float], step: int) -> int:
        """Write one step's metrics (``{name: value}``, units as in the names) at ``step``.

        Returns:
            the number of values written (non-finite or non-numeric ones are skipped).
        """
        written: dict[str, float] = {}
        for name, value in metrics.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                if not hasattr(value, "item"):  # a 0-d tensor / numpy scalar
                    continue
                value = value.item()
            value = float(value)
            if not math.isfinite(value):
                continue
            if self._tb is not None:
                self._tb.add_scalar(name, value, step)
            if self._registry is not None:
                self._gauge(name).set(value)
            written[name] = value
        if self._registry is not None:
            self._gauge("step").set(step)
        if self._tb is not None:
            self._tb.flush()
        if self._wandb is not None and written:
            self._wandb.log(written, step=step)
        return len(written)

    def close(self) -> None:
        """Flush and close the event file and the W&B run; stop the Prometheus endpoint."""
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=5)
            self._server = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


OWN_SINKS = ("trainer", "eval")
"""Components whose rows reach TensorBoard, Prometheus and W&B through their own
:class:`Telemetry` (the trainer's steps, the eval stage's held-out accuracy)."""


class StageBoard:
    """TensorBoard event files of every other stage's metric rows (the rollout's, the
    rewards', the aggregator's, the reference's), written by the run's driver, which reads
    ``<run>.metrics`` anyway: ``<run_dir>/tensorboard/stages`` (TensorBoard shows it as
    the run ``stages`` beside the trainer's), tag ``<component>/<name>`` (``rollout-0/
    gen_tokens_per_s``), step the row's policy_version (0 when it has none), wall time the
    row's ``ts``.

    Args:
        run_dir: the run folder.
    """

    def __init__(self, run_dir: str | Path):
        self._tb = ScalarWriter(Path(run_dir) / "tensorboard" / "stages")

    def add(self, rows: list[dict]) -> int:
        """Write metric rows (``{ts, component, name, value, policy_version}``; ``ts`` a
        datetime or epoch ms) but those of :data:`OWN_SINKS`; returns how many were
        written (non-finite values are skipped)."""
        n = 0
        for r in rows:
            value = r.get("value")
            if (r.get("component") in OWN_SINKS or value is None
                    or not math.isfinite(float(value))):
                continue
            ts = r.get("ts")
            wall = ts.timestamp() if hasattr(ts, "timestamp") else (ts or 0) / 1000 or None
            self._tb.add_scalar(f"{r['component']}/{r['name']}", float(value),
                                int(r.get("policy_version") or 0), walltime=wall)
            n += 1
        if n:
            self._tb.flush()
        return n

    def close(self) -> None:
        """Flush and close the event file."""
        self._tb.close()
