"""Test helper: valid rollout rows (importable from tests via conftest's rootdir)."""

from __future__ import annotations


def rollout_rows(n: int, group_size: int = 4, tokens: int = 16, prompt_tokens: int = 8,
                 policy_version: int = 0) -> list[dict]:
    """``n`` valid ``rollouts`` rows: groups ``g0000, g0001, ...`` of ``group_size``."""
    rows = []
    for i in range(n):
        g = f"g{i // group_size:04d}"
        rows.append(dict(
            rollout_id=f"{g}/{i % group_size}", group_id=g, prompt_id=f"p{i // group_size}",
            dataset="test", sample_index=i % group_size, group_size=group_size,
            prompt_ids=list(range(prompt_tokens)), response_ids=[(i + j) % 1000 for j in range(tokens)],
            loss_mask=[1] * tokens, logprobs=[-0.25] * tokens, token_policy_versions=None,
            policy_version_start=policy_version, policy_version_end=policy_version,
            finish_reason="stop", turns=[{"role": "assistant", "start": 0, "end": tokens}],
            prompt_text="What is 1 + 1?", response_text="2", label="2", metadata="{}", media=None,
            temperature=1.0, top_p=1.0, top_k=0, engine_id="test", started_at=0, finished_at=0))
    return rows
