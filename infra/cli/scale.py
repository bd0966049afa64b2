"""``relax scale RUN --instances N`` (or ``--add-engine URL`` / ``--remove-engine URL`` on
engine sglang): the client side of the run's control API (:mod:`relax.infra.control.scale_api`),
found through ``<run_dir>/api.json``."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from relax.infra.control.scaling import DONE


class ApiClient:
    """Authorised requests to the API of the run in ``run_dir``.

    Raises:
        FileNotFoundError: the run folder has no ``api.json`` (not running, or the API
            is off), or no token (``$RELAX_API_TOKEN`` unset and no ``api_token`` file).
    """

    def __init__(self, run_dir: Path):
        info = json.loads((run_dir / "api.json").read_text())
        token = os.environ.get("RELAX_API_TOKEN") or Path(info["token_file"]).read_text().strip()
        self.http = httpx.Client(base_url=info["url"], timeout=30.0,
                                 headers={"Authorization": f"Bearer {token}"})

    def get(self, path: str):
        """``GET path`` as JSON.

        Raises:
            httpx.HTTPStatusError: the API refused (the message holds its reason)."""
        r = self.http.get(path)
        r.raise_for_status()
        return r.json()

    def post(self, path: str, body: dict | None = None):
        """``POST path`` with a JSON ``body``; the answer as JSON (raises like :meth:`get`)."""
        r = self.http.post(path, json=body or {})
        if r.status_code >= 400:
            raise httpx.HTTPStatusError(f"{r.status_code} {r.json().get('detail', r.text)}",
                                        request=r.request, response=r)
        return r.json()


def scale_to(run_dir: Path, instances: int, wait: bool = True, timeout_s: float = 300.0,
             say: Callable[[str], None] = print) -> dict:
    """Ask the run for ``instances`` rollout instances; with ``wait``, follow the
    operation until it is ACTIVE, FAILED or CANCELLED. Returns the operation.

    Raises:
        TimeoutError: ``wait`` and not done within ``timeout_s``.
        httpx.HTTPStatusError: refused (409: another operation runs; 422: bad count).
    """
    api = ApiClient(run_dir)
    now = len(api.get("/rollout/engines"))
    if instances == now:
        say(f"the run has {now} rollout instances already")
        return {"state": "ACTIVE", "instances": now}
    path = "/rollout/scale_out" if instances > now else "/rollout/scale_in"
    op = api.post(path, {"instances": abs(instances - now)})
    say(f"operation {op['id']}: {now} -> {op['instances']} instances, {op['state']}")
    return follow(api, op, wait, timeout_s, say)


def scale_servers(run_dir: Path, urls: list[str], add: bool, wait: bool = True,
                  timeout_s: float = 300.0, say: Callable[[str], None] = print) -> dict:
    """Engine sglang: add a rollout instance for each SGLang server of ``urls`` (``add``)
    or remove the instances of those servers (the newest first); with ``wait``, follow
    the operation to its end. Returns the operation.

    Raises:
        TimeoutError: ``wait`` and not done within ``timeout_s``.
        httpx.HTTPStatusError: refused (409: another operation runs; 422: the run's
            engine is not sglang, a server added twice, not the newest removed).
    """
    api = ApiClient(run_dir)
    op = api.post("/rollout/scale_out" if add else "/rollout/scale_in", {"engine_urls": urls})
    say(f"operation {op['id']}: {op['from_instances']} -> {op['instances']} instances "
        f"({', '.join(op['engine_urls'])}), {op['state']}")
    return follow(api, op, wait, timeout_s, say)


def follow(api: ApiClient, op: dict, wait: bool, timeout_s: float,
           say: Callable[[str], None]) -> dict:
    """With ``wait``, poll operation ``op`` until it is done, saying each new state; the
    operation as last read.

    Raises:
        TimeoutError: not done within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    seen = op["state"]
    while wait and op["state"] not in DONE:
        if time.monotonic() > deadline:
            raise TimeoutError(f"operation {op['id']} still {op['state']} after {timeout_s:.0f}s")
        time.sleep(1.0)
        op = api.get(f"/rollout/operations/{op['id']}")
        if op["state"] != seen:
            seen = op["state"]
            say(f"operation {op['id']}: {seen}" + (f" ({op['error']})" if op["error"] else ""))
    return op
