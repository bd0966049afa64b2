"""A web page of a run (``relax dashboard``): the monitor's snapshot, with charts.

Standard library only (``http.server``); the page (``infra/observe/static/dashboard.html``)
draws its charts as inline SVG with its own few lines of JavaScript, so it works
on machines without internet access.

Behind a token, like every endpoint of relax (:mod:`relax.streams.http_token`): the token
is ``$RELAX_API_TOKEN``, else a random one made at start; it binds 127.0.0.1 unless told
otherwise, and another address needs ``$RELAX_API_TOKEN``. A request carries the token as
``Authorization: Bearer <token>``, or (a browser) once as ``?token=<token>`` in the page's
URL (:attr:`Dashboard.login_url`, which ``relax dashboard`` prints), after which the
page's cookie (HttpOnly, SameSite=Strict) carries it. Without it: 401, empty body; with
another one: 403, empty body.

Routes:

* ``GET /`` - the page; it fetches ``/api/snapshot`` every few seconds.
* ``GET /api/snapshot`` - the latest :meth:`relax.infra.observe.monitor.Monitor.refresh`
  snapshot as JSON (with ``history`` of lag and rates, ``interval_s``, and
  ``error`` = the last bus error text or null).

One background thread reads the bus every ``interval_s`` seconds, however many
browsers are open; requests only copy the latest snapshot.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from http.cookies import CookieError, SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from urllib.parse import parse_qs, urlencode

from relax.streams.client import BusConfig
from relax.streams.http_token import ENV, bearer, check_bind, endpoint_token, token_status

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
COOKIE = "relax_token"


def page_html() -> bytes:
    """The dashboard page (UTF-8 HTML with inline CSS and JavaScript)."""
    return resources.files("relax.infra.observe").joinpath("static/dashboard.html").read_bytes()


class Dashboard:
    """The dashboard server for one run.

    Args:
        cfg: bus settings. run: run name.
        port: TCP port (0 = a free one; see :attr:`url`).
        interval_s: seconds between bus reads (and the page's refresh period).
        host: the address to bind (another than loopback needs ``$RELAX_API_TOKEN``).

    Raises:
        WideBindError: ``host`` is beyond loopback and ``$RELAX_API_TOKEN`` is unset.
    """

    def __init__(self, cfg: BusConfig, run: str, port: int = 0, interval_s: float = 2.0,
                 host: str = HOST):
        from relax.infra.observe.monitor import Monitor

        check_bind(host, "the dashboard")
        self.host = host
        self.token = endpoint_token()
        self.monitor = Monitor(cfg, run)
        self.interval_s = interval_s
        self._snap: dict = {"run": run, "ts": None, "pending": True}
        self._error: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._page = page_html()
        self._server = ThreadingHTTPServer((host, port), self._handler())
        self._server.daemon_threads = True
        self._threads: list[threading.Thread] = []

    @property
    def url(self) -> str:
        """``http://HOST:PORT/`` (requests need the token)."""
        return f"http://{self.host}:{self._server.server_address[1]}/"

    @property
    def login_url(self) -> str:
        """:attr:`url` with ``?token=``: opened in a browser, it sets the token's cookie."""
        return self.url + "?" + urlencode({"token": self.token})

    def snapshot_json(self) -> bytes:
        """The latest snapshot as JSON bytes."""
        with self._lock:
            snap = dict(self._snap, interval_s=self.interval_s, error=self._error)
        return json.dumps(snap).encode()

    def refresh(self) -> None:
        """Read the bus once and keep the snapshot (a Kafka error is kept as ``error``
        and the previous snapshot stays)."""
        from kafka.errors import KafkaError

        try:
            snap = self.monitor.refresh()
        except (KafkaError, TimeoutError, OSError) as e:
            log.warning("dashboard refresh failed: %s", e)
            with self._lock:
                self._error = f"{type(e).__name__}: {e}"
            return
        with self._lock:
            self._snap, self._error = snap, None

    def _loop(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            self.refresh()
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - t0)))

    def start(self) -> str:
        """Start the refresh and HTTP threads; returns :attr:`url`."""
        for target in (self._loop, self._server.serve_forever):
            t = threading.Thread(target=target, daemon=True, name=f"dashboard-{target.__name__}")
            t.start()
            self._threads.append(t)
        return self.url

    def stop(self) -> None:
        """Stop serving and close the monitor's Kafka client."""
        self._stop.set()
        self._server.shutdown()
        self._server.server_close()
        for t in self._threads:
            t.join(timeout=10)
        self.monitor.close()

    def _handler(self):
        dash = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                path, _, query = self.path.partition("?")
                from_query = parse_qs(query).get("token", [None])[0]
                code = token_status(from_query or bearer(self.headers.get("Authorization"))
                                    or self._cookie(), dash.token)
                if code != 200:
                    self._send(code, "text/plain", b"")
                elif path in ("/", "/index.html"):
                    self._send(200, "text/html; charset=utf-8", dash._page,
                               set_cookie=from_query is not None)
                elif path == "/api/snapshot":
                    self._send(200, "application/json", dash.snapshot_json())
                else:
                    self._send(404, "text/plain; charset=utf-8", b"not found\n")

            def _cookie(self) -> str | None:
                try:
                    morsel = SimpleCookie(self.headers.get("Cookie") or "").get(COOKIE)
                except CookieError:  # a malformed header: no token
                    return None
                return morsel.value if morsel else None

            def _send(self, code: int, ctype: str, body: bytes, set_cookie: bool = False) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                if code == 401:
                    self.send_header("WWW-Authenticate", "Bearer")
                if set_cookie:
                    self.send_header("Set-Cookie", f"{COOKIE}={dash.token}; Path=/; HttpOnly; "
                                                   "SameSite=Strict")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, fmt, *args):
                log.debug("dashboard: " + fmt, *args)

        return Handler


def serve(cfg: BusConfig, run: str, port: int = 8765, interval_s: float = 2.0,
          host: str = HOST) -> None:
    """Serve the dashboard until SIGINT (Ctrl-C) or SIGTERM; prints its URL with the token
    (a generated one; ``$RELAX_API_TOKEN`` is not printed).

    Raises:
        WideBindError: ``host`` is beyond loopback and ``$RELAX_API_TOKEN`` is unset.
    """
    from relax.producers.archive import stop_on_signals

    d = Dashboard(cfg, run, port, interval_s, host)
    stop = stop_on_signals()
    d.start()
    shown = d.url + "?token=$RELAX_API_TOKEN" if os.environ.get(ENV) else d.login_url
    print(f"dashboard of run {run}: {shown}  (Ctrl-C to stop)", flush=True)
    try:
        stop.wait()
    finally:
        d.stop()
