"""SGLang engine client against a local HTTP server serving hand-written answers that
follow SGLang's source (see fixtures/sglang/README.md). No SGLang server runs here."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from fake_sglang import serve_json
from testdata import StubTokenizer

from relax.consumers.engines.base import Engine, SamplingParams
from relax.consumers.engines.sglang import (
    SGLangEngine,
    SGLangError,
    generate_request,
    parse_generate_response,
    sampling_params_json,
)
from relax.streams.weights.layout import build_manifest, manifest_rows, plan_buckets

FIXTURES = Path(__file__).parent / "fixtures" / "sglang"


def _fixture(name: str):
    return json.loads((FIXTURES / name).read_text())


class _Server:
    """A local HTTP server: ``routes[path] = (status, json body)``; records requests."""

    def __init__(self):
        self.routes: dict[str, tuple[int, object]] = {}
        self.requests: list[tuple[str, dict]] = []
        def answer(path: str, body: dict) -> tuple[int, object]:
            self.requests.append((path, body))
            return self.routes.get(path, (404, {"detail": "Not Found"}))

        self.httpd, self.url = serve_json(answer)

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = _Server()
    yield s
    s.close()


def test_module_imports_no_sglang():
    code = (
        "import sys, relax.consumers.engines.sglang as m; "
        "assert 'sglang' not in sys.modules, 'sglang imported'; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_generate_request_and_response(server):
    server.routes["/generate"] = (200, _fixture("generate_batch.json"))
    engine = SGLangEngine(server.url, StubTokenizer(eos=2), engine_id="sg-0")
    assert isinstance(engine, Engine)
    params = SamplingParams(
        max_new_tokens=4, temperature=0.7, top_p=0.9, top_k=0, stop=("\n\n",), seed=7
    )
    gens = engine.generate([[1, 2, 3], [1, 2]], params)
    path, body = server.requests[0]
    assert path == "/generate"
    assert body["input_ids"] == [[1, 2, 3], [1, 2]] and body["return_logprob"] is True
    assert body["sampling_params"][0] == {
        "max_new_tokens": 4,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": -1,
        "skip_special_tokens": True,
        "no_stop_trim": True,
        "stop": ["\n\n"],
        "sampling_seed": 7,
    }
    a, b = gens
    assert a.token_ids == [216, 37, 2] and a.finish_reason == "stop"
    assert a.logprobs == pytest.approx([-0.9164103, -0.0421352, -0.3307513])
    assert b.token_ids == [504, 3114, 314, 216] and b.finish_reason == "length"
    assert (a.policy_version_start, a.policy_version_end) == (3, 3)
    assert engine.policy_version == 3 and a.text == " 5"


def test_a_version_received_during_a_call_starts_its_generations_earlier(server):
    server.routes["/generate"] = (200, _fixture("generate_batch.json"))  # answers at v3
    engine = SGLangEngine(server.url, StubTokenizer(eos=2), policy_version=3)
    (a, _) = engine.generate([[1, 2, 3], [1, 2]], SamplingParams(max_new_tokens=4))
    assert (a.policy_version_start, a.policy_version_end) == (3, 3)
    engine = SGLangEngine(server.url, StubTokenizer(eos=2), policy_version=2)
    post = engine._post

    def post_while_updated(path, body):  # the subscriber installs v3 during the call
        engine._version = 3
        return post(path, body)

    engine._post = post_while_updated
    (a, _) = engine.generate([[1, 2, 3], [1, 2]], SamplingParams(max_new_tokens=4))
    assert (a.policy_version_start, a.policy_version_end) == (2, 3)


def test_abort_and_default_weight_version(server):
    server.routes["/generate"] = (200, _fixture("generate_abort.json"))
    engine = SGLangEngine(server.url, StubTokenizer(), policy_version=5)
    (g,) = engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    assert g.finish_reason == "abort" and g.policy_version_start == 5  # "default" -> known version


def test_malformed_answers_fail_clearly(server):
    good = _fixture("generate_batch.json")
    with pytest.raises(ValueError, match="answered 2 item"):
        parse_generate_response(good, 3, 0)
    bad = json.loads(json.dumps(good))
    del bad[1]["meta_info"]["output_token_logprobs"]
    with pytest.raises(ValueError, match="item 1: meta_info.output_token_logprobs missing"):
        parse_generate_response(bad, 2, 0)
    bad = json.loads(json.dumps(good))
    bad[0]["output_ids"] = [1, 2, 3]
    with pytest.raises(ValueError, match="item 0: output_ids"):
        parse_generate_response(bad, 2, 0)
    bad = json.loads(json.dumps(good))
    bad[0]["meta_info"]["finish_reason"] = {"type": "eos"}
    with pytest.raises(ValueError, match="finish_reason"):
        parse_generate_response(bad, 2, 0)
    server.routes["/generate"] = (500, {"detail": "CUDA out of memory"})
    with pytest.raises(SGLangError, match="HTTP 500.*out of memory"):
        SGLangEngine(server.url, StubTokenizer()).generate([[1]], SamplingParams())


def test_weight_update_requests_follow_relax_buckets(server):
    tensors = {
        "a": torch.zeros(256, dtype=torch.float32),
        "b": torch.zeros(64, dtype=torch.bfloat16),
        "c": torch.zeros(300, dtype=torch.float32),
    }
    manifest = build_manifest(tensors)
    ann = {
        "policy_version": 4,
        "manifest": manifest_rows(manifest),
        "bucket_bytes": 1400,
        "group_name": "run.weights.g2",
    }
    reqs = SGLangEngine.weight_update_requests(ann)
    buckets = plan_buckets(manifest, 1400)
    assert [r["names"] for r in reqs] == [[manifest[i].name for i in idx] for _, _, idx in buckets]
    assert [r["names"] for r in reqs] == [["a"], ["c", "b"]]
    assert reqs[1]["dtypes"] == ["float32", "bfloat16"] and reqs[1]["shapes"] == [[300], [64]]
    assert all(
        r["load_format"] == "flattened_bucket"
        and r["weight_version"] == "4"
        and r["group_name"] == "run.weights.g2"
        for r in reqs
    )
    assert [r["flush_cache"] for r in reqs] == [False, True]

    server.routes["/update_weights_from_distributed"] = (200, _fixture("update_weights_ok.json"))
    server.routes["/init_weights_update_group"] = (200, _fixture("update_weights_ok.json"))
    server.routes["/pause_generation"] = (200, {})
    server.routes["/continue_generation"] = (200, {})
    engine = SGLangEngine(server.url, StubTokenizer())
    engine.init_weights_update_group("10.0.0.5", 29600, 1, 3, "run.weights.g2", backend="nccl")
    assert engine.receive_weights(ann) == 4 and engine.policy_version == 4
    paths = [p for p, _ in server.requests]
    assert paths == [
        "/init_weights_update_group",
        "/pause_generation",
        "/update_weights_from_distributed",
        "/update_weights_from_distributed",
        "/continue_generation",
    ]
    assert server.requests[0][1] == {
        "master_address": "10.0.0.5",
        "master_port": 29600,
        "rank_offset": 1,
        "world_size": 3,
        "group_name": "run.weights.g2",
        "backend": "nccl",
    }
    assert server.requests[1][1] == {"mode": "retract"}  # SGLang's flush needs no running request
    server.routes["/update_weights_from_distributed"] = (
        200,
        _fixture("update_weights_failed.json"),
    )
    del server.requests[:]
    with pytest.raises(SGLangError, match="init_weights_update_group"):
        engine.receive_weights(ann, pause_mode="abort")
    assert [p for p, _ in server.requests] == [  # generation goes on after a failed update
        "/pause_generation", "/update_weights_from_distributed", "/continue_generation"]
    assert engine.policy_version == 4
    with pytest.raises(NotImplementedError):
        engine.update_weights({}, 5)


def test_request_helpers_are_pure():
    p = SamplingParams(max_new_tokens=3, top_k=5)
    assert sampling_params_json(p)["top_k"] == 5 and "stop" not in sampling_params_json(p)
    assert generate_request([[1]], p)["logprob_start_len"] == -1


def test_continued_joins_an_aborted_generation_and_keeps_each_token_s_version():
    from relax.consumers.engines.base import Generation
    from relax.consumers.engines.sglang import continued, token_versions

    first = Generation([5, 6], [-0.1, -0.2], "abort", 3, 3, text="ab")
    rest = Generation([7, 2], [-0.3, -0.4], "stop", 4, 4, text="c")
    g = continued(first, rest)
    assert (g.token_ids, g.logprobs, g.finish_reason) == ([5, 6, 7, 2], [-0.1, -0.2, -0.3, -0.4],
                                                         "stop")
    assert g.token_policy_versions == [3, 3, 4, 4] and g.text == "abc"
    assert (g.policy_version_start, g.policy_version_end) == (3, 4)
    # aborted before its first token: all of it is the new version's
    g = continued(Generation([], [], "abort", 3, 3), rest)
    assert g.token_policy_versions == [4, 4] and (g.policy_version_start, g.policy_version_end) \
        == (4, 4)
    # a part that spanned an update inside the server (retract): its tokens count from its
    # start, the oldest they can be; a second abort keeps the versions already known
    spanned = Generation([8, 9], [-0.5, -0.6], "abort", 4, 5)
    assert token_versions(spanned) == [4, 4]
    twice = continued(continued(first, spanned), Generation([2], [-0.7], "stop", 6, 6))
    assert twice.token_policy_versions == [3, 3, 4, 4, 6] and twice.meta["continued"] == 2


def test_requests_aborted_by_a_weight_update_are_continued_with_their_versions():
    """16 requests, a weight update paused in ``abort`` mode while they run (SGLang ends
    every running request with finish_reason abort): those are sent again after the update
    and joined, so none ends aborted; each token keeps the version that produced it (the
    fake server's log-probs tell). A request the server refuses, with no update during
    it, stays aborted and is sent once."""
    from fake_sglang import REFUSE, FakeSGLang, version_of

    fake = FakeSGLang(tick_s=0.01, hold_at=16 * 4)  # 4 tokens each: a pause finds them running
    try:
        engine = SGLangEngine(fake.url, StubTokenizer(eos=2), engine_id="sg-0")
        # prompt lengths 3..18: stops after 13 - len % 13 tokens, some before the update
        prompts = [[1] + [7] * (2 + i) for i in range(16)]
        gens = _generate_while_v1_arrives(fake, engine, prompts, 16 * 4, "abort")
        assert fake.pauses == ["abort"] and fake.aborted > 0
        assert fake.generate_calls == 2  # the batch, then its aborted requests together
        assert [g.finish_reason for g in gens] == ["stop"] * 16
        split = [g for g in gens if g.token_policy_versions is not None]
        assert len(split) == fake.aborted
        for p, g in zip(prompts, gens):
            assert len(g.token_ids) == 13 - len(p) % 13 and g.token_ids[-1] == 2
            truth = [version_of(lp) for lp in g.logprobs]
            if g.token_policy_versions is None:  # done before the pause
                assert truth == [0] * len(truth) and g.policy_version_end == 0
            else:
                assert g.token_policy_versions == truth and truth[0] == 0 and truth[-1] == 1
                assert (g.policy_version_start, g.policy_version_end) == (0, 1)
                assert g.text == StubTokenizer(eos=2).decode(g.token_ids, True)
        # an abort the server gives on its own is not a weight update's: not sent again
        (g,) = engine.generate([[REFUSE, 5, 6]], SamplingParams(max_new_tokens=4))
        assert g.finish_reason == "abort" and fake.generate_calls == 3
    finally:
        fake.close()



def test_an_abort_answered_with_the_new_version_keeps_its_tokens_at_the_old_one():
    """SGLang may answer a request that an ``abort`` pause ended after the update the pause
    was for (``weight_version`` the new one) and before :meth:`receive_weights` has
    recorded that version: the tokens it had are still the version before, so they carry
    it (a pause came during the call), and the continuation carries the new one. Made
    deterministic: the update's answer is held here until the aborted answer was read."""
    from fake_sglang import FakeSGLang, version_of

    fake = FakeSGLang(tick_s=0.01, hold_at=4 * 3, late_abort_answers=True)
    try:
        engine = SGLangEngine(fake.url, StubTokenizer(eos=2), engine_id="sg-0")
        waits, post, wait = [], engine._post, engine._wait_unpaused

        def counted_wait():
            waits.append(1)
            wait()

        def held_post(path, body):
            out = post(path, body)
            if path == "/update_weights_from_distributed":  # the answer was read: 2nd wait
                deadline = time.monotonic() + 30
                while len(waits) < 2 and time.monotonic() < deadline:
                    time.sleep(0.01)
            return out

        engine._wait_unpaused, engine._post = counted_wait, held_post
        prompts = [[1] + [7] * (2 + i) for i in range(4)]  # 13 - len % 13 tokens each: 10..7
        gens = _generate_while_v1_arrives(fake, engine, prompts, 4 * 3, "abort")
        assert len(waits) >= 2 and fake.aborted == 4
        for g in gens:
            truth = [version_of(lp) for lp in g.logprobs]
            assert truth[:3] == [0, 0, 0] and truth[-1] == 1 and g.finish_reason == "stop"
            assert g.token_policy_versions == truth
            assert (g.policy_version_start, g.policy_version_end) == (0, 1)
    finally:
        fake.close()

def _generate_while_v1_arrives(fake, engine, prompts=((1,) * 3, (1,) * 4), tokens: int = 4,
                               pause_mode: str = "retract") -> list:
    """``prompts`` generated (16 new tokens at most) while v1 is received with
    ``pause_mode``, once the fake server has made ``tokens`` tokens: their generations."""
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("gens", engine.generate(
        [list(p) for p in prompts], SamplingParams(max_new_tokens=16))))
    t.start()
    fake.wait_tokens(tokens)
    ann = {"policy_version": 1, "manifest": manifest_rows(build_manifest(
        {"w": torch.zeros(4)})), "bucket_bytes": 1 << 20, "group_name": "g"}
    assert engine.receive_weights(ann, pause_mode=pause_mode) == 1
    t.join(30)
    return out["gens"]


def test_requests_retracted_for_a_weight_update_span_both_versions():
    """``retract`` (what the ServerSubscriber uses): the server holds the running requests
    and continues them with the new weights; the answer has no boundary, so each spans
    ``(version before, version after)`` and its staleness counts from the older."""
    from fake_sglang import FakeSGLang

    fake = FakeSGLang(tick_s=0.01, hold_at=4)
    try:
        engine = SGLangEngine(fake.url, StubTokenizer(eos=2))
        out = {"gens": _generate_while_v1_arrives(fake, engine)}
        assert fake.pauses == ["retract"] and fake.aborted == 0 and fake.generate_calls == 1
        for g in out["gens"]:
            assert g.finish_reason == "stop" and g.token_policy_versions is None
            assert (g.policy_version_start, g.policy_version_end) == (0, 1)
    finally:
        fake.close()


def test_a_swap_back_to_an_older_version_marks_the_call_s_generations_as_the_lost_branch():
    """A restarted trainer counts versions again from its checkpoint: the server at v5 gets
    v1 while requests run (retracted, continued with v1). Their tokens span the dead
    trainer's branch: each generation is tagged v5 for all its tokens (so the restarted
    trainer, below v5, counts them stale; ``(1, 5)`` or ``(5, 1)`` would be admitted or
    refused by the schema), and the engine is at v1 after the call, not back at v5."""
    from fake_sglang import FakeSGLang

    fake = FakeSGLang(tick_s=0.01, hold_at=4)
    try:
        engine = SGLangEngine(fake.url, StubTokenizer(eos=2), policy_version=5)
        out = {"gens": _generate_while_v1_arrives(fake, engine)}
        assert fake.pauses == ["retract"]
        assert [(g.policy_version_start, g.policy_version_end) for g in out["gens"]] == [
            (5, 5), (5, 5)]
        assert engine.policy_version == 1
    finally:
        fake.close()
