"""Remote reward (consumers/reward/remote.py) against a real local HTTP server that
fails the first N requests: retries with exponential backoff, no retry on 4xx."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from relax.consumers.reward.remote import RemoteRewardError, post_json, remote_reward


class FlakyService:
    """An HTTP reward service: the first ``fail_first`` POSTs get ``fail_status``; then
    each response scores 1.0 if it equals its label. Records every request body."""

    def __init__(self, fail_first=0, fail_status=503, answer=None):
        self.fail_first, self.fail_status, self.answer = fail_first, fail_status, answer
        self.requests: list[dict] = []
        svc = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                svc.requests.append(body)
                if len(svc.requests) <= svc.fail_first:
                    self.send_response(svc.fail_status)
                    self.end_headers()
                    return
                ans = svc.answer if svc.answer is not None else {
                    "rewards": [1.0 if r == lab else 0.0
                                for r, lab in zip(body["responses"], body["labels"])],
                    "details": [{"len": len(r)} for r in body["responses"]]}
                data = json.dumps(ans).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("fail_first,status", [(0, 503), (1, 503), (3, 500), (2, 429)])
def test_retries_transient_failures_with_exponential_backoff(fail_first, status):
    waits = []
    with FlakyService(fail_first, status) as svc:
        ans = post_json(svc.url, {"responses": ["a", "b"], "labels": ["a", "x"], "metadata": [{}, {}]},
                        retries=3, backoff_s=0.01, sleep=waits.append)
    assert ans["rewards"] == [1.0, 0.0]
    assert len(svc.requests) == fail_first + 1
    assert waits == [0.01 * 2 ** i for i in range(fail_first)]


def test_gives_up_after_retries_and_does_not_retry_client_errors():
    waits = []
    with FlakyService(fail_first=10) as svc, \
            pytest.raises(RemoteRewardError, match=r"failed 3 attempt\(s\); last: HTTP 503"):
        post_json(svc.url, {}, retries=2, backoff_s=0.01, sleep=waits.append)
    assert len(svc.requests) == 3 and waits == [0.01, 0.02]
    with FlakyService(fail_first=10, fail_status=400) as svc, \
            pytest.raises(RemoteRewardError, match="HTTP 400.*not retried"):
        post_json(svc.url, {}, retries=5, sleep=waits.append)
    assert len(svc.requests) == 1


def test_connection_refused_is_retried_then_reported():
    with FlakyService() as svc:
        url = svc.url
    waits = []
    with pytest.raises(RemoteRewardError, match="failed 2 attempt"):
        post_json(url, {}, retries=1, backoff_s=0.01, timeout_s=2, sleep=waits.append)
    assert waits == [0.01]


def test_remote_reward_real_sleeps_and_scores():
    with FlakyService(fail_first=2) as svc:
        out = remote_reward(["4", "5", "6"], ["4", "4", None], [{"k": 1}, {}, {}], url=svc.url,
                            backoff_s=0.01)
        assert svc.requests[-1] == {"responses": ["4", "5", "6"], "labels": ["4", "4", None],
                                    "metadata": [{"k": 1}, {}, {}]}
    assert [s.value for s in out] == [1.0, 0.0, 0.0]
    assert out[1].details == {"len": 1}


def test_bad_answers_and_missing_url():
    with FlakyService(answer={"rewards": [1.0]}) as svc, \
            pytest.raises(RemoteRewardError, match="with 2 values"):
        remote_reward(["a", "b"], [None, None], [{}, {}], url=svc.url)
    with pytest.raises(ValueError, match="url="):
        remote_reward([], [], [])
    assert remote_reward([], [], [], url="http://127.0.0.1:9/") == []


# ---- a list label (issue 57): any of its answers, as publish and `relax reward eval` write it

def test_a_list_label_is_sent_as_its_json_text():
    with FlakyService() as svc:
        remote_reward(["4"], ['["3", "4"]'], [{}], url=svc.url)
        assert svc.requests[-1]["labels"] == ['["3", "4"]']
