"""A stand-in for an SGLang server's HTTP API that generates, pauses and updates weights,
for tests of the SGLang engine and the rollout stage on it. It is NOT SGLang (SGLang does
not run on the CPU machines relax is developed on); its answers have the shapes of
``tests/consumers/fixtures/sglang/`` (see the README there) and its pause modes follow
SGLang's ``/pause_generation``: ``abort`` ends every running request at once with
``finish_reason {"type": "abort"}`` and the tokens it had; ``retract`` / ``in_place`` hold
them until ``/continue_generation``, when they go on with the new weights. Requests that
arrive while paused wait for ``/continue_generation``.

Generation is scripted, one token per ``tick_s`` for every request of a batch: the token
at sequence position ``n`` (prompt + output so far) is ``EOS`` when ``n % stop_every == 0``
(then the request ends with ``stop``), else ``3 + n % 40``; its log-prob is
``-(version + 1) / 10``, so a test can read which weights produced every token
(:func:`version_of`). A prompt that starts with ``REFUSE`` is aborted at once (a request
the server refuses, not a weight update). With ``hold_at`` tokens generated, generation
stops until the next pause (a test's weight update then lands with requests running,
however slow the machine).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

EOS = 2
REFUSE = 0


def serve_json(answer) -> tuple[ThreadingHTTPServer, str]:
    """A JSON-over-HTTP server on a free loopback port, serving POSTs from a thread:
    ``answer(path, body) -> (status, payload)``. Returns the server (``shutdown()`` and
    ``server_close()`` it) and its URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
            status, payload = answer(self.path, body)
            raw = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"


def version_of(logprob: float) -> int:
    """The weight version that produced a token, from its scripted log-prob."""
    return round(-logprob * 10) - 1


class FakeSGLang:
    """The server; ``url`` is its address. Counters: ``tokens`` (generated so far),
    ``generate_calls``, ``aborted`` (requests ended by an ``abort`` pause),
    ``pauses`` (``/pause_generation`` modes in order). With ``late_abort_answers`` the
    answer to requests ended by an ``abort`` pause is made after the update that the pause
    was for (its ``weight_version`` the new one; their tokens are still the old one's)."""

    def __init__(self, tick_s: float = 0.01, hold_at: int | None = None, stop_every: int = 13,
                 late_abort_answers: bool = False):
        self.tick_s, self.hold_at, self.stop_every = tick_s, hold_at, stop_every
        self.late_abort_answers = late_abort_answers
        self.cond = threading.Condition()
        self.version = "default"
        self.paused: str | None = None
        self.tokens = self.generate_calls = self.aborted = 0
        self.pauses: list[str] = []
        self._aborts = 0  # abort pauses so far: a request running at one of them ends
        routes = {"/generate": self._generate, "/pause_generation": self._pause,
                  "/continue_generation": self._continue,
                  "/update_weights_from_distributed": self._update}

        def answer(path: str, body: dict) -> tuple[int, object]:
            route = routes.get(path)
            return (200, route(body)) if route else (404, {"detail": "Not Found"})

        self.httpd, self.url = serve_json(answer)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def wait_tokens(self, n: int, timeout_s: float = 60.0) -> None:
        """Block until ``n`` tokens were generated; TimeoutError after ``timeout_s``."""
        with self.cond:
            if not self.cond.wait_for(lambda: self.tokens >= n, timeout_s):
                raise TimeoutError(f"{self.tokens} tokens generated, not {n}, in {timeout_s}s")

    # --- endpoints
    def _pause(self, body: dict) -> dict:
        with self.cond:
            self.paused = body.get("mode", "abort")
            self.pauses.append(self.paused)
            self._aborts += self.paused == "abort"
            self.hold_at = None
            self.cond.notify_all()
        return {"success": True, "message": "paused"}

    def _continue(self, body: dict) -> dict:
        with self.cond:
            self.paused = None
            self.cond.notify_all()
        return {"success": True, "message": "continued"}

    def _update(self, body: dict) -> dict:
        with self.cond:
            if self.paused is None:  # SGLang's flush_cache fails while requests run
                return {"success": False, "message": "Cache not flushed because there are "
                        "pending requests: pause_generation first"}
            self.version = body.get("weight_version") or self.version
            self.cond.notify_all()
        return {"success": True, "message": "Succeeded to update parameter online."}

    def _generate(self, body: dict) -> list[dict]:
        with self.cond:
            self.generate_calls += 1
            self.cond.wait_for(lambda: self.paused is None)
            aborts = self._aborts
        reqs = [{"ids": list(ids), "out": [], "lps": [], "budget": sp["max_new_tokens"],
                 "finish": None} for ids, sp in zip(body["input_ids"], body["sampling_params"])]
        for r in reqs:
            r["version"] = self.version
            if r["ids"][0] == REFUSE:
                r["finish"] = {"type": "abort", "message": "Input is refused (test)"}
        while any(r["finish"] is None for r in reqs):
            time.sleep(self.tick_s)
            with self.cond:  # held while paused (retract, in_place) or at hold_at
                self.cond.wait_for(lambda: self._aborts != aborts or (
                    self.paused is None and (self.hold_at is None or self.tokens < self.hold_at)))
                if self._aborts != aborts:  # an abort pause came (even if continued since)
                    if self.late_abort_answers:
                        at_pause = self.version
                        self.cond.wait_for(lambda: self.version != at_pause, 30)
                    for r in reqs:
                        if r["finish"] is None:
                            r["finish"] = {"type": "abort", "message": "Abort by pause_generation"}
                            r["version"] = self.version
                            self.aborted += 1
                    break
                version = 0 if self.version == "default" else int(self.version)
                for r in reqs:
                    if r["finish"] is not None:
                        continue
                    n = len(r["ids"]) + len(r["out"]) + 1
                    tok = EOS if n % self.stop_every == 0 else 3 + n % 40
                    r["out"].append(tok)
                    r["lps"].append(-(version + 1) / 10)
                    self.tokens += 1
                    if tok == EOS:
                        r["finish"] = {"type": "stop", "matched": EOS}
                    elif len(r["out"]) >= r["budget"]:
                        r["finish"] = {"type": "length", "length": r["budget"]}
                    r["version"] = self.version  # when its answer is made
                self.cond.notify_all()
        with self.cond:
            return [{"text": "", "output_ids": r["out"], "meta_info": {
                "id": uuid.uuid4().hex, "finish_reason": r["finish"],
                "prompt_tokens": len(r["ids"]), "weight_version": r["version"],
                "completion_tokens": len(r["out"]), "cached_tokens": 0,
                "output_token_logprobs": [[lp, t, None] for lp, t in zip(r["lps"], r["out"])]}}
                for r in reqs]
