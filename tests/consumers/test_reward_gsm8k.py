"""GSM8K reward (consumers/reward/gsm8k.py): public cases C16b and C20 as families,
flexible-mode number forms, label forms, and the real GSM8K test split."""

import json
import re
from pathlib import Path

import pytest

from relax.consumers.reward.gsm8k import extract_number, gsm8k_reward, label_number

GSM8K_TEST = Path("/work/shared/data/gsm8k/test.jsonl")


def score(response, label, **kw):
    [s] = gsm8k_reward([response], [label], [{}], **kw)
    return s.value


def test_c16b_marker_followed_by_350_chars():
    tail = ("After that I double-checked every step carefully. " * 8)[:350]
    assert len(tail) == 350
    assert score("2+40=42\n#### 42\n" + tail, "42") == 1.0


@pytest.mark.parametrize("tail_chars", [0, 100, 299, 301, 350, 2000])
def test_c16b_family_no_tail_window(tail_chars):
    r = "Step 1: 2+40=42.\n#### 42\n" + ("The end. " * 300)[:tail_chars]
    assert score(r, "42") == 1.0
    assert score(r, "43") == 0.0


@pytest.mark.parametrize("response,label,expected", [
    ("#### -12", "-12", 1.0), ("#### 12", "-12", 0.0), ("#### -12", "12", 0.0),
    ("#### +12", "12", 1.0)])
def test_c20_sign_survives_strict(response, label, expected):
    assert score(response, label) == expected


@pytest.mark.parametrize("value", [-12, -3.5, -0.25, -1000, 7])
def test_c20_family_signs_in_both_modes(value):
    text = f"{value:,}" if isinstance(value, int) else str(value)
    neg = f"{-value:,}" if isinstance(value, int) else str(-value)
    assert score(f"so\n#### {text}", str(value)) == 1.0
    assert score(f"so\n#### {neg}", str(value)) == 0.0
    assert score(f"The answer is {text}.", str(value), mode="flexible") == 1.0
    assert score(f"The answer is {neg}.", str(value), mode="flexible") == 0.0


@pytest.mark.parametrize("response,label", [
    ("The total is $1,234.50.", "1234.5"), ("It costs $18 in all", "18"),
    ("We get 1,000,000 grains", "1000000"), ("a loss of -$5 overall", "-5"),
    ("so 3-5 more, which is 5", "5"), ("take .5 of it: .5", "0.5"), ("10:30 -> 30", "30"),
    ("2+40=42", "42"), ("x = 18.00", "18"), ("values 12,13,14", "14"),
    ("\u22127 degrees", "-7")])
def test_flexible_last_number_forms(response, label):
    assert score(response, label, mode="flexible") == 1.0


def test_strict_needs_the_marker_and_flexible_does_not():
    assert score("The answer is 42.", "42") == 0.0
    assert score("The answer is 42.", "42", mode="flexible") == 1.0
    assert extract_number("no numbers here", "flexible") is None
    with pytest.raises(ValueError, match="valid: strict, flexible"):
        extract_number("1", "loose")


def test_label_forms():
    sol = "She makes 9 * 2 = $<<9*2=18>>18 every day.\n#### 18"
    assert label_number(sol) == 18
    assert label_number("1,000") == 1000
    assert label_number(" -3.5 ") == -3.5
    assert score("#### 1000", "1,000") == 1.0
    assert score("#### 18", sol) == 1.0
    [bad] = gsm8k_reward(["#### 3"], ["three"], [{}])
    assert bad.value is None and "not a number" in bad.error
    [none] = gsm8k_reward(["#### 3"], [None], [{}])
    assert none.value is None and none.error is None


def _gsm8k_rows():
    if not GSM8K_TEST.is_file():
        pytest.skip(f"{GSM8K_TEST} not present")
    return [json.loads(line) for line in GSM8K_TEST.open()]


def test_real_gsm8k_gold_solutions_score_one_and_changed_answers_zero():
    rows = _gsm8k_rows()
    assert len(rows) == 1319
    sols = [r["answer"] for r in rows]
    assert [s.value for s in gsm8k_reward(sols, sols, [{}] * len(sols))] == [1.0] * 1319
    assert [s.value for s in gsm8k_reward(sols, sols, [{}] * len(sols), mode="flexible")] \
        == [1.0] * 1319

    def bump(sol):  # change the final number: N -> N+1
        head, _, final = sol.rpartition("####")
        n = int(final.strip().replace(",", "")) + 1
        return f"{head}#### {n}"

    changed = [bump(s) for s in sols]
    assert [s.value for s in gsm8k_reward(changed, sols, [{}] * 1319)] == [0.0] * 1319
    # against a bare-number label too
    finals = [re.sub(r"[,\s]", "", s.rpartition("####")[2]) for s in sols]
    assert [s.value for s in gsm8k_reward(changed, finals, [{}] * 1319)] == [0.0] * 1319
    assert [s.value for s in gsm8k_reward(sols, finals, [{}] * 1319)] == [1.0] * 1319


# ---- a list label (issue 57): any of its answers, as publish and `relax reward eval` write it

def test_a_list_label_is_any_of_its_numbers():
    assert [score(f"#### {n}", '["3", "4"]') for n in (3, 4, 5)] == [1.0, 1.0, 0.0]
    [s] = gsm8k_reward(["#### 4"], ['["3", "4"]'], [{}])
    assert s.details == {"extracted": "4", "label": ["3", "4"]}
    # the text "3, 4" is one label and no number: a per-row error, as is a list item
    for label, named in (("3, 4", "'3, 4'"), ('["3", "three"]', "'three'")):
        [s] = gsm8k_reward(["#### 3"], [label], [{}])
        assert s.value is None and f"gsm8k label {named} is not a number" in s.error
