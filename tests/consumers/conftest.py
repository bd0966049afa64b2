"""Fixtures of the consumer tests."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Other test processes share the 2 cores: one intra-op thread avoids oversubscription."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
