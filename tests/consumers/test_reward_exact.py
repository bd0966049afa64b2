"""The short-answer reward (easy-vqa words, spoken-arithmetic numbers)."""

from __future__ import annotations

import pytest

from relax.consumers.reward import load_reward_fn
from relax.consumers.reward.exact import exact_reward


def _values(responses, labels, **kw):
    return [None if s is None else s.value for s in exact_reward(responses, labels, [{}] * len(responses), **kw)]


def test_first_word_matches_after_normalising_case_and_punctuation():
    assert _values(["Circle.", "circle or triangle", "a circle", "Yes, it is", "12", "-3"],
                   ["circle", "circle", "circle", "yes", "12", "-3"]) == [1, 1, 0, 1, 1, 1]
    assert _values(["teal"], [None]) == [None]
    assert _values(["dark blue shape"], ["dark blue"]) == [1]  # a two-word label


def test_full_and_contains_modes():
    assert _values(["circle", "circle please"], ["circle"] * 2, mode="full") == [1, 0]
    assert _values(["it is a circle", "circles"], ["circle"] * 2, mode="contains") == [1, 0]
    with pytest.raises(ValueError, match="exact reward mode 'fuzzy'; valid: first_word, full"):
        exact_reward(["x"], ["x"], [{}], mode="fuzzy")
    assert load_reward_fn("exact") is exact_reward


# ---- a list label (issue 57): any of its answers, as publish and `relax reward eval` write it

def test_a_list_label_is_any_of_its_answers():
    labels = ['["circle", "round"]'] * 3
    assert _values(["Round.", "circle, I think", "square"], labels) == [1.0, 1.0, 0.0]
    assert _values(["it is round"] * 2, labels[:2], mode="contains") == [1.0, 1.0]
    assert _values(["circle"], ["circle, round"], mode="full") == [0.0]  # text: one answer
