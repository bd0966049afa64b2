"""Token-budget micro-batches of whole groups, and their padded tensors.

A global batch (``batch_groups`` GRPO groups) is split into micro-batches whose
padded size ``rows x longest sequence`` stays under ``max_tokens_per_microbatch``
(a conservative bound: shared prompts make the real cost smaller);
a group is never split (a group larger than the budget is its own micro-batch).
Groups are packed longest first to waste little padding. The loss of each
micro-batch is normalised by the *global* token/sequence counts
(``relax.trainer.losses.aggregate``), so summing micro-batch gradients gives the
full-batch gradient whatever the split (public case C06).

Masks come from lengths, never from token values (public case C24: pad id ==
EOS id). With ``trainer.packing`` the back end lays a micro-batch's rows end to end in
one unpadded row instead (:func:`packed_row`); the budget still counts padded tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch


@dataclass
class MicroBatch:
    """Padded tensors of one micro-batch: B rows sharing U distinct prompts (the G rows
    of a GRPO group share theirs); P = longest prompt, R = longest response.

    The prompt of each group goes through the model once; its key/value cache is then
    shared by the group's responses (see ``relax.trainer.backends.torch_backend``).

    Attributes:
        prompt_ids: ``[U, P]`` int64 distinct prompts, left-padded with 0.
        prompt_mask: ``[U, P]`` int64, 1 on real prompt tokens (from lengths).
        prompt_of_row: ``[B]`` int64 index into the U prompts of each row.
        response_ids: ``[B, R]`` int64 response tokens, right-padded with 0 (also the
            targets: row b's token t is predicted from its prefix).
        response_mask: ``[B, R]`` int64, 1 on real response tokens (from lengths).
        loss_mask: ``[B, R]`` float32 train sample loss_mask, 0 on padding.
        advantages: ``[B, R]`` float32.
        rollout_logprobs: ``[B, R]`` float32 log-probs recorded by the rollout engine.
        ref_logprobs: ``[B, R]`` float32 or None.
        temperature: the sampling temperature (one per micro-batch; rows must agree).
        rollout_ids: ``B`` rollout ids, in row order.
        media: per distinct prompt, its ``media`` items (images and audio by reference),
            or None when no row has any.
        media_inputs: the model's inputs of ``media`` (``pixel_values`` ``[U, N, 3, H,
            W]``, ``input_features`` ``[clips, mel, frames]``, ...), filled in by the back
            end (:func:`relax.trainer.multimodal.media_inputs_of`) for the prompt pass.
        response_media_inputs: likewise for the response pass, row by row: the items a
            multi-turn environment returned (they stand in the response, loss_mask 0).
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    prompt_of_row: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    rollout_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor | None
    temperature: float
    rollout_ids: list[str]
    media: list[list[dict] | None] | None = None
    media_inputs: dict[str, torch.Tensor] | None = None
    response_media_inputs: dict[str, torch.Tensor] | None = None

    @property
    def targets(self) -> torch.Tensor:
        """``[B, R]`` the response tokens whose log-probs are computed."""
        return self.response_ids

    @property
    def padded_tokens(self) -> int:
        """Tokens the forward pass pays for: ``U x P + B x R``."""
        return int(self.prompt_ids.numel() + self.response_ids.numel())


@dataclass
class PackedRow:
    """A micro-batch's rows laid end to end in one row, no padding (``trainer.packing``).

    Row b of the micro-batch contributes its prompt then its response (``L_b = P_b + R_b``
    tokens); ``N = sum(L_b)``. Position ids restart at 0 for each row, which is how
    transformers' packed-sequence path (SDPA and eager masks from
    ``masking_utils.find_packed_sequence_indices``, flash-attention's ``cu_seqlens``)
    keeps attention inside each row when no attention mask and no cache are given.

    Attributes:
        input_ids: ``[1, N]`` int64 tokens.
        position_ids: ``[1, N]`` int64, ``0 .. L_b - 1`` per row.
        predict_at: ``[n]`` int64 index into N of the token whose hidden state predicts
            each real response token, in the row-major order of ``response_mask``'s ones
            (row b's response token t at ``start_b + P_b - 1 + t``).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    predict_at: torch.Tensor


def packed_row(mb: MicroBatch) -> PackedRow:
    """Pack ``mb``'s (prompt, response) rows into one :class:`PackedRow`, on the device of
    ``mb``'s tensors. Shared prompts are repeated in every row that has them (the packed
    forward computes ``sum(P_b + R_b)`` tokens against the padded path's ``U x P + B x
    R``)."""
    rows = mb.prompt_of_row
    p_mask = mb.prompt_mask[rows].bool()                       # [B, P] left-padded
    r_mask = mb.response_mask.bool()                           # [B, R] right-padded
    p_len, r_len = p_mask.sum(-1), r_mask.sum(-1)
    seq_len = p_len + r_len
    start = seq_len.cumsum(0) - seq_len                        # [B]
    n = int(seq_len.sum())
    p_pos = p_mask.long().cumsum(-1) - 1                       # 0.. on real prompt tokens
    r_pos = p_len[:, None] + torch.arange(r_mask.shape[1], device=r_mask.device)[None, :]
    dest = torch.cat([(start[:, None] + p_pos)[p_mask], (start[:, None] + r_pos)[r_mask]])
    ids = torch.zeros(n, dtype=torch.int64, device=r_mask.device)
    pos = torch.zeros_like(ids)
    ids[dest] = torch.cat([mb.prompt_ids[rows][p_mask], mb.response_ids[r_mask]])
    pos[dest] = torch.cat([p_pos[p_mask], r_pos[r_mask]])
    predict_at = (start[:, None] + r_pos - 1)[r_mask]
    return PackedRow(input_ids=ids[None], position_ids=pos[None], predict_at=predict_at)


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


def list_column(values: np.ndarray, lengths: np.ndarray, typ: pa.DataType) -> pa.Array:
    """A list column from flat ``values`` ``[sum(lengths)]`` and per-row ``lengths``
    ``[N]`` (int): row i holds the next ``lengths[i]`` values, as Arrow type ``typ``."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, typ))


def _lists(col: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    offsets = arr.offsets.to_numpy()
    values = arr.values.to_numpy(zero_copy_only=False)
    return values[offsets[0]:offsets[-1]], offsets - offsets[0]


def collate(samples: pa.Table) -> MicroBatch:
    """Pad the rows of a ``train_samples`` table into a :class:`MicroBatch`; rows with
    identical prompt token ids (and the same media) share one prompt row.

    Raises:
        ValueError: rows with different temperatures (log-probs must use one T), or a
            row with an empty prompt or response.
    """
    temps = set(samples.column("temperature").to_pylist())
    if len(temps) != 1:
        raise ValueError(f"one micro-batch needs one sampling temperature, got {sorted(temps)}")
    b = samples.num_rows
    p_vals, p_off = _lists(samples.column("prompt_ids"))
    r_vals, r_off = _lists(samples.column("response_ids"))
    p_len, r_len = np.diff(p_off), np.diff(r_off)
    if (r_len == 0).any() or (p_len == 0).any():
        bad = int(np.argmax((r_len == 0) | (p_len == 0)))
        raise ValueError(f"row {bad} has an empty prompt or response")
    media = _media_keys(samples)
    index: dict[bytes, int] = {}
    prompt_of_row = np.zeros(b, np.int64)
    firsts = []
    for i in range(b):
        key = p_vals[p_off[i]:p_off[i + 1]].tobytes() + (media[i][0] if media else b"")
        if key not in index:
            index[key] = len(firsts)
            firsts.append(i)
        prompt_of_row[i] = index[key]
    P, R = int(p_len.max()), int(r_len.max())
    prompt_ids = np.zeros((len(firsts), P), np.int64)
    prompt_mask = np.zeros((len(firsts), P), np.int64)
    for u, i in enumerate(firsts):
        pl = p_len[i]
        prompt_ids[u, P - pl:] = p_vals[p_off[i]:p_off[i + 1]]
        prompt_mask[u, P - pl:] = 1
    response_ids = np.zeros((b, R), np.int64)
    valid = np.arange(R)[None, :] < r_len[:, None]
    response_ids[valid] = r_vals

    def per_token(name: str, dtype=np.float32) -> np.ndarray:
        vals, _ = _lists(samples.column(name))
        out = np.zeros((b, R), dtype)
        out[valid] = vals.astype(dtype)
        return out

    ref = None
    if samples.column("ref_logprobs").null_count < b:
        if samples.column("ref_logprobs").null_count:
            raise ValueError("ref_logprobs must be present on all rows of a micro-batch or none")
        ref = torch.from_numpy(per_token("ref_logprobs"))
    return MicroBatch(
        prompt_ids=torch.from_numpy(prompt_ids), prompt_mask=torch.from_numpy(prompt_mask),
        prompt_of_row=torch.from_numpy(prompt_of_row), response_ids=torch.from_numpy(response_ids),
        response_mask=torch.from_numpy(valid.astype(np.int64)),
        loss_mask=torch.from_numpy(per_token("loss_mask")),
        advantages=torch.from_numpy(per_token("advantages")),
        rollout_logprobs=torch.from_numpy(per_token("logprobs")), ref_logprobs=ref,
        temperature=float(temps.pop()), rollout_ids=samples.column("rollout_id").to_pylist(),
        media=[media[i][1] for i in firsts] if media else None)


def _media_keys(samples: pa.Table) -> list[tuple[bytes, list[dict] | None]] | None:
    """Per row, (a key of its media items, the items); None when no row has media."""
    if "media" not in samples.schema.names or samples.column("media").null_count == samples.num_rows:
        return None
    import hashlib

    out = []
    for items in samples.column("media").to_pylist():
        h = hashlib.sha256()
        for it in items or []:
            h.update((it["uri"] or "").encode() + b"\0" + (it["data"] or b"") + b"\0")
        out.append((h.digest(), items))
    return out


def micro_batches(groups: list[pa.Table], max_tokens: int) -> list[MicroBatch]:
    """Split a global batch (one table per group) into collated micro-batches."""
    lengths = []
    for g in groups:
        p = pc.list_value_length(g.column("prompt_ids")).to_numpy(zero_copy_only=False)
        r = pc.list_value_length(g.column("response_ids")).to_numpy(zero_copy_only=False)
        lengths.append((p + r).tolist())
    return [collate(pa.concat_tables([groups[i] for i in mb]))
            for mb in pack_groups(lengths, max_tokens)]


def _row_sums(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Per-row sums of a flattened list column (``offsets`` from :func:`_lists`)."""
    c = np.concatenate([[0.0], np.cumsum(values, dtype=np.float64)])
    return c[offsets[1:]] - c[offsets[:-1]]


def teacher_kl(groups: list[pa.Table]) -> float | None:
    """Mean over the loss tokens of the rows with teacher log-probs of ``logprobs -
    teacher_logprobs`` (nats/token): the k1 estimate of the reverse KL from the student
    (at sampling) to the teacher that on-policy distillation minimises; None when no row
    has teacher log-probs or no loss token."""
    total, tokens = 0.0, 0
    for g in groups:
        has = pc.is_valid(g.column("teacher_logprobs"))
        if not pc.any(has).as_py():
            continue
        t = g.filter(has)
        lp, _ = _lists(t.column("logprobs"))
        teacher, _ = _lists(t.column("teacher_logprobs"))
        mask, _ = _lists(t.column("loss_mask"))
        on = mask != 0
        total += float((lp[on].astype(np.float64) - teacher[on]).sum())
        tokens += int(on.sum())
    return total / tokens if tokens else None


def loss_counts(groups: list[pa.Table]) -> tuple[int, int]:
    """``(loss tokens, sequences with >= 1 loss token)`` of a whole global batch: the
    ``global_tokens`` / ``global_seqs`` its loss is normalised by."""
    tokens = seqs = 0
    for g in groups:
        sums = _row_sums(*_lists(g.column("loss_mask")))
        tokens += int(round(sums.sum()))
        seqs += int((sums > 0).sum())
    return tokens, seqs


def informative_rows(groups: list[pa.Table]) -> list[pa.Table]:
    """The rows of each group that can move the weights under a pure policy-gradient loss:
    some loss token with a non-zero advantage. Without a KL or entropy term in the loss,
    the other rows contribute exactly 0 to the loss and its gradient (every loss in
    ``POLICY_LOSSES`` is a multiple of the advantage), so leaving them out of the forward
    and backward changes nothing as long as the loss is normalised by the counts of the
    whole batch (:func:`loss_counts`). Groups left empty are dropped."""
    out = []
    for g in groups:
        adv, off = _lists(g.column("advantages"))
        mask, _ = _lists(g.column("loss_mask"))  # same offsets: one value per token
        keep = np.flatnonzero(_row_sums((adv != 0) & (mask != 0), off) > 0)
        if len(keep):
            out.append(g if len(keep) == g.num_rows else g.take(pa.array(keep)))
    return out


def split_groups(groups: list[pa.Table], n: int) -> list[list[pa.Table]]:
    """Deal the groups of a global batch to ``n`` data-parallel ranks, whole groups only,
    so that the ranks' token counts (prompt + response tokens of every row) are close:
    longest first, each to the rank with the fewest tokens so far (LPT greedy, within
    4/3 of the best split). Deterministic; each rank keeps the groups' original order.
    A rank gets no group when there are fewer groups than ranks.

    Raises:
        ValueError: ``n < 1``.
    """
    if n < 1:
        raise ValueError(f"split_groups needs n >= 1 ranks, got {n}")
    cost = [int(pc.sum(pc.list_value_length(g.column("prompt_ids"))).as_py() or 0)
            + int(pc.sum(pc.list_value_length(g.column("response_ids"))).as_py() or 0)
            for g in groups]
    load, share = [0] * n, [[] for _ in range(n)]
    for i in sorted(range(len(groups)), key=lambda i: (-cost[i], i)):
        r = min(range(n), key=lambda r: (load[r], r))
        load[r] += cost[i]
        share[r].append(i)
    return [[groups[i] for i in sorted(s)] for s in share]
