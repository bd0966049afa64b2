"""One input record as one prompts row (producers/prompt_rows.py): the label forms."""

import pytest

from relax.consumers.reward.base import label_answers, label_text
from relax.producers.prompt_rows import RowError, prompt_row


def _label(value):
    row = prompt_row({"q": "What is 1 + 2?", "a": value}, dataset="d", prompt_field="q",
                     label_field="a", source="s.jsonl", line=1, created_at_ms=0)
    return row["label"]


@pytest.mark.parametrize("value, text, answers", [
    ("3", "3", ["3"]),
    (3, "3", ["3"]),
    (2.5, "2.5", ["2.5"]),
    ("3, 4", "3, 4", ["3, 4"]),            # text: one answer
    ("[1, 2]", "[1, 2]", ["[1, 2]"]),      # text: one answer (an interval)
    (["3", "4"], '["3", "4"]', ["3", "4"]),  # a list: several answers, any-of
    ([3, "x"], '["3", "x"]', ["3", "x"]),
    ('["3", "4"]', '["3", "4"]', ["3", "4"]),  # the same list, given as its JSON text
])
def test_label_forms(value, text, answers):
    assert _label(value) == label_text(value) == text
    assert label_answers(text) == answers


@pytest.mark.parametrize("value, reason", [
    ({"v": 8}, "field 'a': expected text, a number or a list of them, got dict"),
    (True, "field 'a': expected text, a number or a list of them, got bool"),
    ([], "field 'a': expected a list of at least one answer, got []"),
    ([1, [2]], "field 'a': expected a list of texts and numbers, got a list holding [2]"),
    (None, "field 'a' (the label field) is null"),
])
def test_bad_labels_name_the_field(value, reason):
    with pytest.raises(RowError) as e:
        _label(value)
    assert str(e.value).startswith(reason)
