"""Maths reward (consumers/reward/math.py): public cases C14, C17, C18, C20 (boxed
negative) as small families, and the math-verify equivalences."""

import pytest

from relax.consumers.reward import REWARD_FNS, load_reward_fn
from relax.consumers.reward.math import final_segment, find_last_boxed, last_boxed, math_reward


def score(response, label, **kw):
    [s] = math_reward([response], [label], [{}], **kw)
    return s.value


def test_c14_answer_marker_grades_final_segment():
    r = (r"Try \boxed{7}###Response wait, that fails \boxed{8}###Response so the result is "
         r"\boxed{12}")
    assert final_segment(r) == r" so the result is \boxed{12}"
    assert math_reward([r], ["12"], [{}])[0].details["extracted"] == "12"
    assert score(r, "12") == 1.0
    # the typical wrong output graded the second split piece (\boxed{8})
    assert score(r, "8") == 0.0


@pytest.mark.parametrize("marker", ["###Response", "</think>"])
@pytest.mark.parametrize("n_segments", [2, 3, 5])
def test_c14_family_last_marker_wins(marker, n_segments):
    answers = list(range(10, 10 + n_segments))
    r = marker.join(f" attempt {i}: \\boxed{{{a}}} " for i, a in enumerate(answers))
    assert score(r, str(answers[-1])) == 1.0
    for wrong in answers[:-1]:
        assert score(r, str(wrong)) == 0.0


def test_c14_mixed_markers_last_of_any_wins():
    r = r"<think>\boxed{1}</think> draft \boxed{2}###Response final \boxed{3}"
    assert score(r, "3") == 1.0
    r = r"###Response draft \boxed{2}<think>x</think> final \boxed{4}"
    assert score(r, "4") == 1.0


def test_c17_space_form_earlier_does_not_override_braced_box():
    r = r"Writing \boxed 3 here is only a placeholder. Final: \boxed{5}"
    assert last_boxed(r) == "5"
    assert score(r, "5") == 1.0
    assert score(r, "3") == 0.0


def test_c17_space_form_alone_is_a_box():
    # relax's rule (hendrycks convention): the space form counts as a box, its argument is
    # the next token; whichever box comes last wins.
    assert last_boxed(r"... so the answer is \boxed 5") == "5"
    assert score(r"... so the answer is \boxed 5", "5") == 1.0
    assert score(r"... so the answer is \boxed 5.", "5") == 1.0


@pytest.mark.parametrize("first,last,form", [(3, 5, "space-then-brace"), (8, 2, "brace-then-space"),
                                             (-1, 7, "space-then-brace"), (4, -6, "brace-then-space")])
def test_c17_family_last_box_of_either_form_wins(first, last, form):
    if form == "space-then-brace":
        r = f"Say \\boxed {first} as a placeholder, then \\boxed{{{last}}}"
    else:
        r = f"Draft \\boxed{{{first}}}, and finally \\boxed {last}"
    assert last_boxed(r) == str(last)
    assert score(r, str(last)) == 1.0
    assert score(r, str(first)) == 0.0


def test_c18_last_box_with_balanced_braces():
    r = r"First guess \boxed{2}, which fails the check; corrected: \boxed{\frac{3}{4}}"
    assert last_boxed(r) == r"\frac{3}{4}"
    assert score(r, r"\frac{3}{4}") == 1.0
    assert score(r, "0.75") == 1.0
    assert score(r, "2") == 0.0
    assert last_boxed(r"\boxed{\frac{1}{2}}") == r"\frac{1}{2}"


@pytest.mark.parametrize("content", [r"\frac{1}{2}", r"\sqrt{\frac{a}{b}}", r"{{x}}+1",
                                     r"\{1, 2\}", r"\left(\frac{1}{2}, 3\right)"])
def test_c18_family_nested_braces_survive(content):
    assert last_boxed(f"text \\boxed{{9}} more \\boxed{{{content}}} end") == content


def test_unclosed_last_box_gives_no_answer_not_an_earlier_box():
    r = r"First \boxed{2}, then the final \boxed{\frac{3}{4"
    found = find_last_boxed(r)
    assert found is not None and found[0] is None
    assert score(r, "2") == 0.0
    assert math_reward([r], ["2"], [{}])[0].details["extracted"] is None


def test_c20_boxed_negative_keeps_its_sign():
    assert score(r"The value is \boxed{-3.5}", "-3.5") == 1.0
    assert score(r"The value is \boxed{3.5}", "-3.5") == 0.0
    assert score(r"The value is \boxed{-12}", "12") == 0.0
    assert score(r"The value is \boxed{-12}", "-12") == 1.0


@pytest.mark.parametrize("answer,label,ok", [
    ("0.75", r"\frac{3}{4}", True), (r"\dfrac{1}{2}", "1/2", True), ("x=5", "5", True),
    ("12.0", "12", True), ("1,000", "1000", True), (r"\sqrt2", r"\sqrt{2}", True),
    ("1+x^2", "x^2+1", True), ("(1, 2)", "(1,2)", True), ("7", "8", False),
    (r"\pi", "3.14159", False), ("", "3", False)])
def test_math_verify_equivalence(answer, label, ok):
    assert score(f"so \\boxed{{{answer}}}", label) == (1.0 if ok else 0.0)


def test_boxed_label_and_no_box_and_no_label():
    assert score(r"\boxed{4}", r"$\boxed{4}$") == 1.0
    assert score("the answer is 4", "4") == 0.0  # no box: DeepScaleR format failure
    assert score("the answer is 4", "4", no_answer=-1.0) == -1.0
    assert score(r"\boxed{4}", "4", require_marker=True) == 0.0  # DeepScaleR: no </think>
    assert score(r"x</think>\boxed{4}", "4", require_marker=True) == 1.0
    [s] = math_reward([r"\boxed{4}"], [None], [{}])
    assert s.value is None and s.error is None  # abstain without a label


def test_registry_names_and_unknown_name_lists_valid_ones():
    assert load_reward_fn("math") is REWARD_FNS["math"] is REWARD_FNS["deepscaler"]
    with pytest.raises(ValueError, match="valid: math, deepscaler, dapo, gsm8k"):
        load_reward_fn("maths")
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        load_reward_fn("relax.consumers.reward.math:nope")
    with pytest.raises(ValueError, match="cannot import module"):
        load_reward_fn("relax.no_such_module:fn")
    assert load_reward_fn("relax.consumers.reward.math:math_reward") is math_reward
    assert math_reward([], [], []) == []


# ---- a list label (issue 57): any of its answers, as publish and `relax reward eval` write it

def test_a_list_label_is_any_of_its_answers():
    answers = ("3", "4", r"\frac{8}{2}", "5")
    assert [score(rf"\boxed{{{a}}}", '["3", "4"]') for a in answers] == [1.0, 1.0, 1.0, 0.0]
    # the text "3, 4" is one answer, the set {3, 4}; "[1, 2]" (no quotes) the interval
    assert [score(r"\boxed{3, 4}", "3, 4"), score(r"\boxed{3}", "3, 4")] == [1.0, 0.0]
    assert [score(r"\boxed{[1, 2]}", "[1, 2]"), score(r"\boxed{1}", "[1, 2]")] == [1.0, 0.0]
