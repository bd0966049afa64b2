"""A reward computed by an HTTP service, with retries and exponential backoff.

Request: ``POST url`` with JSON
``{"responses": [...], "labels": [...], "metadata": [...]}`` (one batch). Labels go as
the ``label`` column holds them: a list label is the JSON text of an array of strings
(``'["3", "4"]'``); the built-in rewards score it any-of
(:func:`relax.consumers.reward.base.label_answers` reads it), and a service should too.
Response: JSON ``{"rewards": [float | null, ...]}`` (same length and order), optional
``"details": [{...}, ...]``.

A connection error, a timeout, HTTP 429 or any 5xx is retried up to ``retries``
times, waiting ``backoff_s * 2**attempt`` seconds (capped at ``max_backoff_s``)
before attempt ``attempt + 1``; other 4xx answers are the caller's fault and raise at
once. When every attempt failed the call raises, and the stage records null values
with the error text. Standard library only (``urllib``).
"""

from __future__ import annotations

import json
import time

from relax.consumers.reward.base import Score

RETRY_STATUS = frozenset({429, 500, 502, 503, 504})


class RemoteRewardError(RuntimeError):
    """The reward service failed (after retries) or answered something unusable."""


def post_json(url: str, payload: dict, *, timeout_s: float = 30.0, retries: int = 3,
              backoff_s: float = 0.5, max_backoff_s: float = 30.0,
              headers: dict[str, str] | None = None, sleep=time.sleep) -> dict:
    """POST ``payload`` as JSON and return the decoded JSON answer, retrying transient
    failures (module docstring).

    Args:
        url: service address (``http://host:port/path``).
        payload: JSON-serialisable request body.
        timeout_s: per-attempt socket timeout (seconds).
        retries: extra attempts after the first (0 = no retry).
        backoff_s / max_backoff_s: first wait and largest wait (seconds).
        headers: extra HTTP headers (e.g. an ``Authorization`` token).
        sleep: the wait function (tests pass a recorder).

    Raises:
        RemoteRewardError: with the last failure, after ``retries + 1`` attempts or at
            once for a non-retryable HTTP status or a non-JSON answer.
    """
    import http.client
    import urllib.error
    import urllib.request

    body = json.dumps(payload).encode()
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    last = ""
    for attempt in range(retries + 1):
        if attempt:
            sleep(min(max_backoff_s, backoff_s * 2 ** (attempt - 1)))
        req = urllib.request.Request(url, data=body, headers=hdrs, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            last = f"HTTP {e.code} {e.reason}"
            if e.code not in RETRY_STATUS:
                raise RemoteRewardError(f"reward service {url} answered {last} "
                                        f"(not retried)") from None
            continue
        except (urllib.error.URLError, http.client.HTTPException, TimeoutError,
                ConnectionError) as e:
            last = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
            continue
        try:
            return json.loads(raw)
        except ValueError:
            raise RemoteRewardError(f"reward service {url} answered non-JSON: {raw[:120]!r}") \
                from None
    raise RemoteRewardError(f"reward service {url} failed {retries + 1} attempt(s); last: {last}")


def remote_reward(responses: list[str], labels: list[str | None], metadata: list[dict], *,
                  url: str | None = None, timeout_s: float = 30.0, retries: int = 3,
                  backoff_s: float = 0.5, max_backoff_s: float = 30.0,
                  headers: dict[str, str] | None = None) -> list[Score]:
    """Score the batch with the service at ``url`` (module docstring for the protocol).

    Args:
        responses, labels, metadata: ``[N]`` each, sent as they are.
        url: service address (required).
        timeout_s, retries, backoff_s, max_backoff_s, headers: see :func:`post_json`.

    Returns:
        ``[N]`` :class:`Score` (details from the service's ``details`` list, if any).

    Raises:
        ValueError: without ``url``.
        RemoteRewardError: see :func:`post_json`, or when ``rewards`` is missing or has
            the wrong length.
    """
    if not url:
        raise ValueError("remote reward needs the option url=http://host:port/path")
    if not responses:
        return []
    answer = post_json(url, {"responses": responses, "labels": labels, "metadata": metadata},
                       timeout_s=timeout_s, retries=retries, backoff_s=backoff_s,
                       max_backoff_s=max_backoff_s, headers=headers)
    rewards = answer.get("rewards") if isinstance(answer, dict) else None
    if not isinstance(rewards, list) or len(rewards) != len(responses):
        raise RemoteRewardError(f"reward service {url} must answer {{'rewards': [...]}} with "
                                f"{len(responses)} values; got {str(answer)[:120]}")
    details = answer.get("details") or [{}] * len(rewards)
    return [Score(None if v is None else float(v), d if isinstance(d, dict) else {"detail": d})
            for v, d in zip(rewards, details)]
