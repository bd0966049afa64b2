"""GenRM judge (consumers/reward/genrm.py): verdict parser, prompt template and the
engine plumbing with a fake engine implementing the Engine protocol; then the real HF
engine with the random-weight ``tiny-llama`` through the worker pool (plumbing and
parser only: its verdicts are noise)."""

import re

import pytest

from relax.consumers.engines.base import Engine, Generation, SamplingParams
from relax.consumers.reward.genrm import (
    DEFAULT_TEMPLATE,
    encode_prompt,
    judge,
    judge_prompt,
    parse_verdict,
)


@pytest.mark.parametrize("text,verdict", [
    ("Verdict: CORRECT", True), ("Verdict: INCORRECT", False), ("verdict - correct", True),
    ("**Verdict:** **INCORRECT**", False), ("Final verdict: [[CORRECT]]", True),
    ("Judgement: wrong", False), ("Judgment = Yes", True),
    ("CORRECT. The student's answer matches.", True),
    ("INCORRECT. The correct answer is 6, not 5.", False),
    ("Not correct; the correct answer is 6", False),
    ("The student's answer is incorrect; the correct value is 6.", False),
    ("The two answers are equivalent.", True), ("They are not equivalent.", False),
    ("The answers are the same.", True), ("The answers are different.", False),
    ("Yes", True), ("No.", False),
    ("<think>Maybe correct? No, wrong.</think>\nVerdict: CORRECT", True),
    ("<think>looks right</think> Incorrect", False),
    ("Verdict: CORRECT\nOn reflection...\nVerdict: INCORRECT", False),
    ("It is correct... no wait, wrong", None), ("I cannot tell.", None), ("", None),
    ("Verdict: maybe", None),
    ("The student's final answer is 3/4, which is not equal to 0.75.", False),
    ("The answers are equal.", True), ("It doesn't match the reference.", False),
    ("The answer matches the reference.", True), ("isn't correct", False),
    ("The student's final answer is 12.", None)])
def test_parse_verdict_family(text, verdict):
    assert parse_verdict(text) is verdict


def test_template_fills_label_and_final_answer_tail():
    p = judge_prompt(DEFAULT_TEMPLATE, "42", "<think>long 41 reasoning</think> It is \\boxed{42}")
    assert "Reference answer: 42" in p and "Student answer: It is \\boxed{42}" in p
    assert "41" not in p  # only the final segment after </think>
    long = judge_prompt("{label}|{answer}", "1", "x" * 5000 + "END", max_answer_chars=100)
    assert long.endswith("END") and len(long.split("|", 1)[1]) == 100
    with pytest.raises(KeyError):
        judge_prompt("{question} {answer}", "1", "2")


class CharTokenizer:
    """One token per character; a chat template that wraps the user turn."""

    chat_template = "fake"

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert not tokenize and add_generation_prompt
        return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages) + "<bot>"

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


class FakeJudgeEngine:
    """An Engine that reads the judge prompt and answers by comparing the two answers
    (or with a fixed reply), recording what it was asked."""

    engine_id = "fake-judge"

    def __init__(self, reply=None, text_in_generation=True):
        self.reply, self.text_in_generation = reply, text_in_generation
        self.calls: list[tuple[list[str], SamplingParams]] = []

    @property
    def policy_version(self) -> int:
        return 0

    def update_weights(self, named_tensors, policy_version):
        raise AssertionError("a judge never gets weights")

    def generate(self, prompts, params):
        texts = ["".join(chr(i) for i in p) for p in prompts]
        self.calls.append((texts, params))
        out = []
        for t in texts:
            if self.reply is not None:
                reply = self.reply
            else:
                ref = re.search(r"Reference answer: (.*)\n", t).group(1)
                ans = re.search(r"Student answer: (.*)\n", t).group(1)
                reply = "Verdict: CORRECT" if ref.strip() in ans else "Verdict: INCORRECT"
            ids = [ord(c) for c in reply]
            out.append(Generation(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop",
                                  policy_version_start=0, policy_version_end=0,
                                  text=reply if self.text_in_generation else ""))
        return out


def test_judge_plumbing_with_a_fake_engine():
    eng, tok = FakeJudgeEngine(), CharTokenizer()
    assert isinstance(eng, Engine)
    out = judge(eng, tok, ["so it is 12", "<think>12</think> so 13", "whatever"],
                ["12", "12", None])
    assert [s.value for s in out] == [1.0, 0.0, None]
    assert out[0].details == {"verdict": "correct", "judge": "Verdict: CORRECT"}
    assert out[2].details == {"reason": "no label"}
    [(texts, params)] = eng.calls
    assert len(texts) == 2  # the unlabelled row is not sent
    assert texts[0].startswith("<user>") and texts[0].endswith("</user><bot>")
    assert params.top_k == 1 and params.max_new_tokens == 32
    assert encode_prompt(tok, "ab")[-5:] == [ord(c) for c in "<bot>"]


def test_judge_unreadable_verdict_abstains_and_decodes_when_text_is_empty():
    out = judge(FakeJudgeEngine(reply="hmm, hard to say", text_in_generation=False),
                CharTokenizer(), ["1"], ["1"])
    assert out[0].value is None and out[0].details["verdict"] is None
    assert out[0].details["judge"] == "hmm, hard to say"


def test_judge_custom_template_and_params():
    eng = FakeJudgeEngine(reply="INCORRECT")
    params = SamplingParams(max_new_tokens=4, temperature=0.5, seed=3)
    out = judge(eng, CharTokenizer(), ["7"], ["8"], template="Is {answer} == {label}?",
                params=params)
    assert out[0].value == 0.0
    assert "Is 7 == 8?" in eng.calls[0][0][0] and eng.calls[0][1] is params


def test_genrm_tiny_llama_through_the_worker_pool():
    pytest.importorskip("relax.consumers.engines.hf")
    from relax.consumers.reward.pool import RewardPool

    opts = {"model": "tiny-llama", "max_new_tokens": 6}
    with RewardPool("genrm", opts, workers=1, timeout_s=120, batch_rows=8) as pool:
        res = pool.score(["the answer is 12", "I think 7", "no label here"], ["12", "8", None],
                         [{}, {}, {}])
    assert [r.error for r in res] == [None, None, None]
    assert res[2].value is None and res[2].details == {"reason": "no label"}
    for r in res[:2]:
        assert isinstance(r.details["judge"], str)
        verdict = parse_verdict(r.details["judge"])
        assert r.value == (None if verdict is None else float(verdict))
        assert r.details["verdict"] == {None: None, True: "correct", False: "incorrect"}[verdict]


# ---- a list label (issue 57): any of its answers, as publish and `relax reward eval` write it

def test_a_list_label_is_shown_to_the_judge_as_any_of():
    p = judge_prompt(DEFAULT_TEMPLATE, '["3", "4"]', "so \\boxed{4}")
    assert "Reference answer: 3 or 4 (any one of these is correct)\n" in p
    assert judge_prompt("{label}", "3, 4", "x") == "3, 4"  # text: one answer, as it is
