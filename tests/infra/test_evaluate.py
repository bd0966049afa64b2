"""Held-out evaluation of audio prompts (``infra/offline/evaluate.py``): spoken questions share one
instruction text, so the held-out rows are told apart by their audio, and they are decoded
with their audio through the model's processor, as the rollout stage renders them."""

from __future__ import annotations

import shutil

import pytest

from relax.infra.offline.evaluate import eval_rows, greedy_accuracy, prompt_key, source_keys
from relax.producers.media import MediaOptions

AUDIO = MediaOptions(fields=(("audio", "audio"),))


@pytest.fixture(autouse=True)
def _needs_espeak():
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (.ci/run installs it: apt-get install espeak-ng)")


def test_spoken_eval_rows_are_kept_apart_by_their_audio():
    train = "speech_arith:?size=6&seed=1&max=2&ops=+"
    keys = source_keys(train, prompt_field="question", label_field="answer", media=AUDIO)
    assert 1 < len(keys) <= 6 and len({k[0] for k in keys}) == 1  # one text, several clips
    # the same questions: every one is a training clip, so too few are left
    with pytest.raises(ValueError, match="has only 0 usable prompts not in the training "
                                         "data .6 rows are training prompts"):
        eval_rows(train, 1, prompt_field="question", label_field="answer", exclude=keys,
                  media=AUDIO)
    # the same questions in another voice: new clips, all of them held out
    other = "speech_arith:?size=6&seed=1&max=2&ops=+&voice=en+f3"
    rows = eval_rows(other, len(keys), prompt_field="question", label_field="answer",
                     exclude=keys, media=AUDIO)
    assert len(rows) == len(keys) and all(len(r["media"]) == 1 for r in rows)
    assert not {prompt_key(r) for r in rows} & keys


def test_greedy_accuracy_decodes_with_the_audio():
    rows = eval_rows("speech_arith:?size=3&seed=5&max=3&ops=+", 3, prompt_field="question",
                     label_field="answer", media=AUDIO)
    r = greedy_accuracy("tiny-audio", rows, reward_fn="exact",
                        reward_options={"mode": "first_word"}, max_new_tokens=3, batch_size=2)
    assert r.n == 3 and 0 <= r.correct <= 3 and len(r.examples) == 3
    assert [e["label"] for e in r.examples] == [row["label"] for row in rows]
    with pytest.raises(ValueError, match="takes no images or audio"):
        greedy_accuracy("tiny-llama", rows, reward_fn="exact", reward_options={})
