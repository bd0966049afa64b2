"""Token-budget micro-batches of whole groups, and their padded tensors.

A global batch (``batch_groups`` GRPO groups) is split into micro-batches whose
padded size ``rows x longest sequence`` stays under ``max_tokens_per_microbatch``;
a group is never split (a group larger than the budget is its own micro-batch).
Groups are packed longest first to waste little padding. The loss of each
micro-batch is normalised by the *global* token/sequence counts
(``relax.trainer.losses.aggregate``), so summing micro-batch gradients gives the
full-batch gradient whatever the split (public case C06).

Masks come from lengths, never from token values (public case C24: pad id ==
EOS id).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch


@dataclass
class MicroBatch:
    """Padded tensors of one micro-batch (B rows, L = longest prompt + response,
    R = longest response).

    Attributes:
        input_ids: ``[B, L]`` int64 prompt then response tokens, right-padded with 0.
        attention_mask: ``[B, L]`` int64, 1 on real tokens (from lengths).
        response_index: ``[B, R]`` int64 position whose logits predict each response
            token (prompt_len - 1 + t); padded entries point at 0.
        targets: ``[B, R]`` int64 response token ids (0 on padding).
        loss_mask: ``[B, R]`` float32 train sample loss_mask, 0 on padding.
        advantages: ``[B, R]`` float32.
        rollout_logprobs: ``[B, R]`` float32 log-probs recorded by the rollout engine.
        ref_logprobs: ``[B, R]`` float32 or None.
        temperature: the sampling temperature (one per micro-batch; rows must agree).
        rollout_ids: ``B`` rollout ids, in row order.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_index: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    rollout_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor | None
    temperature: float
    rollout_ids: list[str]

    @property
    def padded_tokens(self) -> int:
        """``B x L``: the size the forward pass pays for (tokens)."""
        return int(self.input_ids.numel())


def pack_groups(group_lengths: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Assign whole groups to micro-batches under a padded-token budget.

    Args:
        group_lengths: per group, the total length (prompt + response, tokens) of each row.
        max_tokens: budget of ``rows x longest row`` per micro-batch (tokens).

    Returns:
        micro-batches as lists of group indices; every group appears exactly once.

    Raises:
        ValueError: for a non-positive budget or an empty group.
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens_per_microbatch must be > 0, got {max_tokens}")
    if any(not g for g in group_lengths):
        raise ValueError("every group needs at least one row")
    order = sorted(range(len(group_lengths)), key=lambda i: -max(group_lengths[i]))
    out: list[list[int]] = []
    cur: list[int] = []
    rows = longest = 0
    for i in order:
        n, m = len(group_lengths[i]), max(group_lengths[i])
        if cur and (rows + n) * max(longest, m) > max_tokens:
            out.append(cur)
            cur, rows, longest = [], 0, 0
        cur.append(i)
        rows += n
        longest = max(longest, m)
    if cur:
        out.append(cur)
    return out


def _lists(col: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    offsets = arr.offsets.to_numpy()
    values = arr.values.to_numpy(zero_copy_only=False)
    return values[offsets[0]:offsets[-1]], offsets - offsets[0]


def collate(samples: pa.Table) -> MicroBatch:
    """Pad the rows of a ``train_samples`` table into a :class:`MicroBatch`.

    Raises:
        ValueError: rows with different temperatures (log-probs must use one T), or a
            row with an empty response.
    """
    temps = set(samples.column("temperature").to_pylist())
    if len(temps) != 1:
        raise ValueError(f"one micro-batch needs one sampling temperature, got {sorted(temps)}")
    b = samples.num_rows
    p_vals, p_off = _lists(samples.column("prompt_ids"))
    r_vals, r_off = _lists(samples.column("response_ids"))
    p_len, r_len = np.diff(p_off), np.diff(r_off)
    if (r_len == 0).any():
        raise ValueError(f"row {int(np.argmax(r_len == 0))} has an empty response")
    total = p_len + r_len
    L, R = int(total.max()), int(r_len.max())
    input_ids = np.zeros((b, L), np.int64)
    attention = np.zeros((b, L), np.int64)
    resp_index = np.zeros((b, R), np.int64)
    targets = np.zeros((b, R), np.int64)
    valid = np.zeros((b, R), bool)
    for i in range(b):
        pl, rl = p_len[i], r_len[i]
        input_ids[i, :pl] = p_vals[p_off[i]:p_off[i + 1]]
        input_ids[i, pl:pl + rl] = r_vals[r_off[i]:r_off[i + 1]]
        attention[i, :pl + rl] = 1
        resp_index[i, :rl] = np.arange(pl - 1, pl - 1 + rl)
        targets[i, :rl] = r_vals[r_off[i]:r_off[i + 1]]
        valid[i, :rl] = True

    def per_token(name: str, dtype=np.float32) -> np.ndarray:
        vals, off = _lists(samples.column(name))
        out = np.zeros((b, R), dtype)
        out[valid] = vals.astype(dtype)
        return out

    ref = None
    if samples.column("ref_logprobs").null_count < b:
        if samples.column("ref_logprobs").null_count:
            raise ValueError("ref_logprobs must be present on all rows of a micro-batch or none")
        ref = torch.from_numpy(per_token("ref_logprobs"))
    return MicroBatch(
        input_ids=torch.from_numpy(input_ids), attention_mask=torch.from_numpy(attention),
        response_index=torch.from_numpy(resp_index), targets=torch.from_numpy(targets),
        loss_mask=torch.from_numpy(per_token("loss_mask")),
        advantages=torch.from_numpy(per_token("advantages")),
        rollout_logprobs=torch.from_numpy(per_token("logprobs")), ref_logprobs=ref,
        temperature=float(temps.pop()), rollout_ids=samples.column("rollout_id").to_pylist())


def micro_batches(groups: list[pa.Table], max_tokens: int) -> list[MicroBatch]:
    """Split a global batch (one table per group) into collated micro-batches."""
    lengths = []
    for g in groups:
        p = pc.list_value_length(g.column("prompt_ids")).to_numpy(zero_copy_only=False)
        r = pc.list_value_length(g.column("response_ids")).to_numpy(zero_copy_only=False)
        lengths.append((p + r).tolist())
    return [collate(pa.concat_tables([groups[i] for i in mb]))
            for mb in pack_groups(lengths, max_tokens)]
