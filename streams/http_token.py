"""The token rule of every HTTP endpoint of relax: the run's control API
(:mod:`relax.infra.control.scale_api`), the dashboard (:mod:`relax.infra.observe.dashboard`) and the
trainer's Prometheus endpoint (:mod:`relax.trainer.telemetry`).

* **The token** is ``$RELAX_API_TOKEN`` when set; else the one in the run's token file
  (``<run_dir>/api_token``: created with a random token, mode 600, when absent, and kept
  when present, so the processes of one run share it); else (no file, e.g. ``relax
  dashboard``) a random one for the process.
* **Every request carries it**, ``Authorization: Bearer <token>`` (the dashboard's page also
  takes it once as ``?token=`` and then from a cookie). Without it: 401 with an empty body;
  with another token: 403, empty body.
* **Loopback by default**: endpoints bind 127.0.0.1; binding any other address needs
  ``$RELAX_API_TOKEN`` (a token that clients elsewhere are given on purpose), and without
  it the endpoint refuses to start (:class:`WideBindError`, one line).
"""

from __future__ import annotations

import ipaddress
import os
import secrets
from pathlib import Path

ENV = "RELAX_API_TOKEN"
"""Environment variable holding the token (required for a bind beyond loopback)."""


class WideBindError(ValueError):
    """An endpoint was asked to bind a non-loopback address without ``$RELAX_API_TOKEN``."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is this machine's loopback only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: not known to be loopback
        return False


def check_bind(host: str, what: str) -> None:
    """Refuse to serve ``what`` on a non-loopback ``host`` without ``$RELAX_API_TOKEN``.

    Raises:
        WideBindError: ``host`` is not loopback and the variable is unset or empty.
    """
    if not is_loopback(host) and not os.environ.get(ENV):
        raise WideBindError(f"{what}: binding {host} (beyond loopback) needs ${ENV} set to the "
                            "token its clients will send; set it, or bind 127.0.0.1")


def endpoint_token(token_file: Path | None = None) -> str:
    """The token (module docstring): ``$RELAX_API_TOKEN``, else ``token_file``'s (created
    with a random token, mode 600, when absent), else a random one.

    Raises:
        OSError: ``token_file``'s folder is missing or not writable.
    """
    token = os.environ.get(ENV)
    if token:
        return token
    if token_file is None:
        return secrets.token_urlsafe(24)
    token_file = Path(token_file)
    token = secrets.token_urlsafe(24)
    draft = token_file.with_name(f".{token_file.name}.{os.getpid()}")
    with os.fdopen(os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write(token)
    try:
        os.link(draft, token_file)  # whole or not at all, and never over another's
    except FileExistsError:  # another process of the run made it
        token = token_file.read_text().strip()
    finally:
        draft.unlink()
    return token


def bearer(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header value (None without one)."""
    if header and header[:7].lower() == "bearer ":
        return header[7:].strip()
    return None


def token_status(presented: str | None, token: str) -> int:
    """HTTP status of a request that presents ``presented``: 200 (right token), 401 (none)
    or 403 (another one); compared in constant time."""
    if not presented:
        return 401
    return 200 if secrets.compare_digest(presented.encode(), token.encode()) else 403
