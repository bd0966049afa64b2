"""Masks from lengths, never from token values (trainer/masks.py): public case C24."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relax.trainer.masks import completion_mask, lengths_to_mask

PAD = EOS = 9


def test_c24_pad_equal_eos_keeps_the_terminating_eos():
    completion = torch.tensor([[5, 6, 9, 9, 9]])
    mask = completion_mask(torch.tensor([3]), completion.shape[1])
    assert mask.int().tolist() == [[1, 1, 1, 0, 0]]
    assert (completion != PAD).int().tolist() == [[1, 1, 0, 0, 0]]  # the typical wrong mask


def test_c24_prompt_attention_keeps_chat_markers_equal_to_pad():
    prompt = torch.tensor([[1, 9, 3]])
    attention = lengths_to_mask(torch.tensor([3]), prompt.shape[1], padding_side="left")
    assert attention.int().tolist() == [[1, 1, 1]]
    assert (prompt != PAD).int().tolist() == [[1, 0, 1]]  # the typical wrong mask


def test_left_and_right_padding():
    lengths = torch.tensor([0, 2, 4])
    assert lengths_to_mask(lengths, 4).int().tolist() == [[0, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
    assert lengths_to_mask(lengths, 4, padding_side="left").int().tolist() == [
        [0, 0, 0, 0], [0, 0, 1, 1], [1, 1, 1, 1]]


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 6), min_size=1, max_size=5))
def test_c24_family_mask_depends_on_lengths_only(lengths):
    width = 6
    lengths_t = torch.tensor(lengths)
    for side in ("right", "left"):
        mask = lengths_to_mask(lengths_t, width, padding_side=side)
        assert mask.sum(-1).tolist() == lengths
    # token ids are not an input: a row of all-pad/EOS ids gets the same mask
    assert completion_mask(lengths_t, width).tolist() == [
        [i < n for i in range(width)] for n in lengths]


@pytest.mark.parametrize("lengths, width", [([4], 3), ([-1], 3), ([[1]], 3)])
def test_bad_lengths_fail_loudly(lengths, width):
    with pytest.raises(ValueError):
        lengths_to_mask(torch.tensor(lengths), width)
