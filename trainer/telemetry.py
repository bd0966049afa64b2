"""Step metrics to TensorBoard and Prometheus, for the trainer.

The bus (``<run>.metrics``) is the record of a run; this helper also exposes the
trainer's step metrics to the two tools people already watch:

* TensorBoard event files under ``run_dir`` (``torch.utils.tensorboard.SummaryWriter``;
  one scalar per metric name, x = step);
* a Prometheus scrape endpoint (``prometheus_client``) on 127.0.0.1:``prometheus_port``
  when a port is given: one gauge per metric, named ``relax_<name>`` with every
  character outside ``[a-zA-Z0-9_]`` replaced by ``_`` (``staleness_hist.2`` ->
  ``relax_staleness_hist_2``), plus ``relax_step``. The registry is private to the
  instance, so several may live in one process.

Values that are not finite numbers (None, NaN, inf, text) are skipped.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Self

_BAD = re.compile(r"[^a-zA-Z0-9_]")


def prometheus_name(name: str, prefix: str = "relax_") -> str:
    """A legal Prometheus metric name for a relax metric name."""
    return prefix + _BAD.sub("_", name)


class Telemetry:
    """TensorBoard writer + optional Prometheus endpoint for step metrics.

    Args:
        run_dir: folder for the TensorBoard event files (created if needed).
        prometheus_port: serve ``/metrics`` on 127.0.0.1 at this port (0 = a free
            port, see :attr:`prometheus_port`); None = no endpoint.

    Raises:
        OSError: the port is in use.
    """

    def __init__(self, run_dir: str | Path, prometheus_port: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._tb = SummaryWriter(log_dir=str(self.run_dir))
        self._gauges: dict[str, object] = {}
        self._server = self._thread = self._registry = None
        self.prometheus_port: int | None = None
        if prometheus_port is not None:
            from prometheus_client import CollectorRegistry, start_http_server

            self._registry = CollectorRegistry()
            self._server, self._thread = start_http_server(prometheus_port, addr="127.0.0.1",
                                                           registry=self._registry)
            self.prometheus_port = self._server.server_port

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
        n = 0
        for name, value in metrics.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                if not hasattr(value, "item"):  # a 0-d tensor / numpy scalar
                    continue
                value = value.item()
            value = float(value)
            if not math.isfinite(value):
                continue
            self._tb.add_scalar(name, value, step)
            if self._registry is not None:
                self._gauge(name).set(value)
            n += 1
        if self._registry is not None:
            self._gauge("step").set(step)
        self._tb.flush()
        return n

    def close(self) -> None:
        """Flush and close the event file; stop the Prometheus endpoint."""
        self._tb.close()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=5)
            self._server = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
