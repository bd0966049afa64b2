"""DAPO reward (consumers/reward/dapo.py): public case C16a (windows never cut off an
answer inside the 300-character budget) as a family, both modes, +1/-1."""

import pytest

from relax.consumers.reward.dapo import ANSWER_BUDGET_CHARS, dapo_reward, extract_dapo_answer

C16A_TAIL = ("  I verified this by substituting back into both equations and every check "
             "passes cleanly, done.")


def score(response, label, **kw):
    [s] = dapo_reward([response], [label], [{}], **kw)
    return s.value


def test_c16a_strict_box_answer_106_chars_from_the_end():
    assert len(C16A_TAIL) == 96
    r = "Let x be the number. " * 20 + r"\boxed{34}" + C16A_TAIL
    assert len(r) - r.rindex(r"\boxed{") == 106
    assert extract_dapo_answer(r, strict_box=True) == "34"
    assert score(r, "34", strict_box=True) == 1.0
    # the typical wrong output: a last-100 window starts inside the box, finds no opener
    assert r"\boxed{" not in r[-100:]
    assert score(r, "35", strict_box=True) == -1.0


@pytest.mark.parametrize("tail_chars", [0, 50, 95, 100, 150, 200, 280])
def test_c16a_family_any_box_starting_inside_the_budget_is_read(tail_chars):
    box = r"\boxed{\frac{12}{5}}"
    r = "some reasoning " * 40 + box + ("x" * tail_chars)
    assert len(r) - r.rindex(r"\boxed{") <= ANSWER_BUDGET_CHARS
    assert score(r, r"\frac{12}{5}", strict_box=True) == 1.0
    assert score(r, "2.4", strict_box=True) == 1.0


def test_box_starting_before_the_budget_is_outside_it():
    r = "reasoning " + r"\boxed{34}" + "x" * ANSWER_BUDGET_CHARS
    assert extract_dapo_answer(r, strict_box=True) is None
    assert score(r, "34", strict_box=True) == -1.0
    assert score(r, "34", strict_box=True, budget_chars=400) == 1.0


def test_answer_line_mode():
    assert score("work...\nAnswer: 34", "34") == 1.0
    assert score("work...\nAnswer: $\\frac{3}{4}$", "0.75") == 1.0
    assert score("work...\nAnswer: 35", "34") == -1.0
    assert score("work... the result is 34", "34") == -1.0  # no Answer: line
    assert score("Answer: 12\nno wait\nANSWER: 34.", "34") == 1.0  # the last line counts
    assert score("Answer: 34\n" + "y" * 400, "34") == -1.0  # starts outside the budget
    # a line starting inside the budget is read whole, even with text after it
    r = "x" * 500 + "\nAnswer: 1234567\n" + "z" * 270
    assert len(r) - r.rindex("Answer:") <= ANSWER_BUDGET_CHARS
    assert extract_dapo_answer(r) == "1234567"
    assert score(r, "1234567") == 1.0


def test_no_label_abstains_and_values_are_plus_minus_one():
    out = dapo_reward(["Answer: 1", "Answer: 2", "Answer: 3"], ["1", "1", None], [{}] * 3)
    assert [s.value for s in out] == [1.0, -1.0, None]
    assert out[0].details == {"pred": "1", "acc": True}


# ---- a list label (issue 57): any of its answers, as publish and `relax reward eval` write it

def test_a_list_label_is_any_of_its_answers():
    assert [score(f"So.\nAnswer: {a}", '["3", "4"]') for a in ("3", "4", "5")] == \
        [1.0, 1.0, -1.0]
    assert score("So.\nAnswer: 3", "3, 4") == -1.0  # one answer, the set {3, 4}
