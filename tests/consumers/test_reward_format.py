"""Format reward (consumers/reward/format.py): public case C15 (only the response is
scored) and the patterns. The stage-level C15 check is in test_reward_stage.py."""

import inspect

import pytest

from relax.consumers.reward.format import format_reward


def values(responses, **kw):
    return [s.value for s in format_reward(responses, [None] * len(responses),
                                           [{}] * len(responses), **kw)]


def test_c15_format_bonus_scores_the_response_only():
    # the prompt ends "... write the final answer inside \boxed{}." - it is never passed
    params = list(inspect.signature(format_reward).parameters)
    assert params[:3] == ["responses", "labels", "metadata"] and "prompt" not in " ".join(params)
    assert values(["So the total is 12."], bonus=0.1) == [0.0]
    assert values([r"So the total is \boxed{12}."], bonus=0.1) == [0.1]


@pytest.mark.parametrize("response,ok", [
    (r"\boxed{12}", True), (r"\boxed 12", True), (r"\boxed{\frac{1}{2}}", True),
    (r"\boxed{}", False), (r"\boxed{12", False), ("12", False),
    (r"<think>\boxed{3}</think> so 12", False), (r"<think>x</think> \boxed{12}", True)])
def test_c15_family_boxed_pattern(response, ok):
    assert values([response], bonus=0.1) == [0.1 if ok else 0.0]


@pytest.mark.parametrize("response,ok", [
    ("<think>reason</think> 12", True), ("reason</think>\n12", True),
    ("<think>reason</think>", False), ("no think at all", False),
    ("<think>a</think> b </think> c", False), ("</think> 1 <think>", False)])
def test_think_pattern(response, ok):
    assert values([response], pattern="think") == [1.0 if ok else 0.0]


def test_answer_tag_and_regex_patterns_and_errors():
    assert values(["<answer> 5 </answer>", "<answer></answer>", "5"],
                  pattern="answer_tag") == [1.0, 0.0, 0.0]
    assert values(["Final: 5", "5"], pattern="regex", regex=r"^Final: \d+$") == [1.0, 0.0]
    with pytest.raises(ValueError, match="valid: boxed, think, answer_tag, regex"):
        format_reward([], [], [], pattern="xml")
    with pytest.raises(ValueError, match="regex"):
        format_reward([], [], [], pattern="regex")


# ---- a list label (issue 57): any of its answers, as publish and `relax reward eval` write it

def test_a_list_label_changes_nothing():
    responses = ["</think> \\boxed{3}", "no box"]
    got = format_reward(responses, ['["3", "4"]'] * 2, [{}] * 2)
    assert [s.value for s in got] == values(responses) == [1.0, 0.0]
