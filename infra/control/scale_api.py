"""The run's control API over HTTP (FastAPI, served by ``relax train`` beside the run).

Every route needs ``Authorization: Bearer <token>`` (401 without it, 403 with another
token, both with an empty body); the rule is :mod:`relax.streams.http_token`'s: the token
is ``$RELAX_API_TOKEN`` when set, else the run's ``<run_dir>/api_token`` (mode 600), and a
bind beyond loopback without ``$RELAX_API_TOKEN`` is refused. ``<run_dir>/api.json`` says
where the API listens. The OpenAPI schema is at ``/openapi.json`` and ``/docs`` without a
token (the public schema of this module, nothing of the run).

    GET  /status                        run, trainer policy_version, stages
    GET  /rollout/engines               the rollout instances and their state
    POST /rollout/scale_out {"instances": n}   n more rollout instances
    POST /rollout/scale_in  {"instances": n}   n fewer
    POST /rollout/scale_out {"engine_urls": [...]}  engine sglang: an instance per server
    POST /rollout/scale_in  {"engine_urls": [...]}  the instances of the newest servers
    GET  /rollout/operations/{id}       one operation (states: relax.infra.control.scaling)
    POST /rollout/operations/{id}/cancel

A scale request answers 202 with its operation at once; the operation then moves on
in the run's watching loop. On engine ``sglang`` each instance drives one SGLang server
the user runs (``rollout.sglang_urls``): such a run scales by ``engine_urls`` (a new
instance's server joins the weight broadcast before it samples:
:class:`relax.streams.weights.server.ServerSubscriber`), any other by ``instances``; the other
form is refused with 422.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path

from fastapi import Depends, FastAPI, HTTPException, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from relax.infra.control.scaling import RolloutScaler, ScaleConflict, ScaleError, moved_servers
from relax.streams.http_token import bearer, check_bind, endpoint_token, token_status


class ScaleRequest(BaseModel):
    """How many rollout instances to add (scale_out) or remove (scale_in), or on engine
    ``sglang`` which servers."""

    model_config = ConfigDict(extra="forbid")
    instances: int | None = Field(None, ge=1, description="instances to add or remove")
    engine_urls: list[str] | None = Field(
        None, description="engine sglang: SGLang servers (http://host:port) to add an "
                          "instance for, or whose instances to remove (the newest first)")


def api_token(run_dir: Path) -> str:
    """``$RELAX_API_TOKEN``, else the run's token in ``<run_dir>/api_token`` (made when
    absent; :func:`relax.streams.http_token.endpoint_token`)."""
    return endpoint_token(run_dir / "api_token")


class _Refused(Exception):
    """A request without the right token (answered with its status and no body)."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


def build_app(scaler: RolloutScaler, token: str, status_of: Callable[[], dict],
              engines_of: Callable[[], list[dict]]) -> FastAPI:
    """The API over ``scaler``; ``status_of()`` / ``engines_of()`` give the run's state
    (read from the watching loop's latest snapshot, never from Ray in a request)."""
    app = FastAPI(title="relax run control", version="1",
                  description="Scale a live run's rollout instances; "
                              "see relax.infra.control.scaling.")

    @app.exception_handler(_Refused)
    def refused(request: Request, e: _Refused) -> Response:
        return Response(status_code=e.code, headers={"WWW-Authenticate": "Bearer"})

    def authorised(request: Request) -> None:
        code = token_status(bearer(request.headers.get("authorization")), token)
        if code != 200:
            raise _Refused(code)

    def scale(req: ScaleRequest, sign: int) -> dict:
        if (req.instances is None) == (req.engine_urls is None):
            raise HTTPException(422, "give instances (how many to add or remove) or "
                                     "engine_urls (SGLang servers), one of them")
        try:
            if req.engine_urls is not None:
                n, urls = moved_servers(scaler.base_engine_urls(), req.engine_urls, sign)
                return scaler.request(n, urls).public()
            return scaler.request(scaler.base() + sign * req.instances).public()
        except ScaleError as e:
            raise HTTPException(422, str(e)) from None
        except ScaleConflict as e:
            raise HTTPException(409, str(e)) from None

    deps = [Depends(authorised)]

    @app.get("/status", dependencies=deps)
    def get_status() -> dict:
        return status_of()

    @app.get("/rollout/engines", dependencies=deps)
    def get_engines() -> list[dict]:
        return engines_of()

    @app.post("/rollout/scale_out", dependencies=deps, status_code=202)
    def scale_out(req: ScaleRequest) -> dict:
        return scale(req, +1)

    @app.post("/rollout/scale_in", dependencies=deps, status_code=202)
    def scale_in(req: ScaleRequest) -> dict:
        return scale(req, -1)

    @app.get("/rollout/operations/{op_id}", dependencies=deps)
    def get_operation(op_id: str) -> dict:
        op = scaler.ops.get(op_id)
        if op is None:
            raise HTTPException(404, f"no operation {op_id}")
        return op.public()

    @app.post("/rollout/operations/{op_id}/cancel", dependencies=deps)
    def cancel(op_id: str) -> dict:
        if op_id not in scaler.ops:
            raise HTTPException(404, f"no operation {op_id}")
        try:
            return scaler.cancel(op_id).public()
        except ScaleConflict as e:
            raise HTTPException(409, str(e)) from None

    return app


class ApiServer:
    """``app`` served by uvicorn in a daemon thread on ``host:port`` (0 = a free port);
    :attr:`url` once started. Writes ``<run_dir>/api.json``."""

    def __init__(self, app: FastAPI, run_dir: Path, host: str = "127.0.0.1", port: int = 0):
        import socket

        import uvicorn

        check_bind(host, "the control API")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        self.url = f"http://{host}:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True, name="relax-api")
        self.thread.start()
        (run_dir / "api.json").write_text(json.dumps(
            {"url": self.url, "token_file": None if os.environ.get("RELAX_API_TOKEN")
             else str(run_dir / "api_token")}))

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)


def serve_run_api(recipe, run_dir: Path, controller, watch) -> ApiServer:
    """Serve the control API of a live run: a :class:`RolloutScaler` over ``controller``
    that ``watch`` (the run's :class:`relax.infra.control.run_watch.RunWatch`) drives, on
    ``recipe.api``'s address. The caller closes the server."""
    from relax.infra.recipe.specs import stage_specs

    ro = recipe.rollout

    def apply(n: int, urls: list[str] | None) -> list[str]:
        update = {"instances": n} if urls is None else {"instances": n, "sglang_urls": urls}
        scaled = recipe.model_copy(update={"rollout": ro.model_copy(update=update)})
        specs = [s for s in stage_specs(scaled, run_dir) if s.kind == "rollout"]
        return controller.replace_stages("rollout", specs)

    servers = (list(ro.sglang_urls) or [ro.sglang_url] * ro.instances
               if ro.engine == "sglang" else None)
    watch.scaler = RolloutScaler(ro.instances, recipe.data.partitions, apply,
                                 engine_urls=servers)
    watch.control()  # the first snapshot, before the API answers
    app = build_app(watch.scaler, api_token(run_dir), lambda: watch.snapshot["status"],
                    lambda: watch.snapshot["engines"])
    return ApiServer(app, run_dir, recipe.api.host, recipe.api.port)
