"""The helper-threads benchmark's summary (``benchmarks/helper_threads.py``): per-triple
ratios against the call alone, and each context's median call."""

import pytest

from relax.benchmarks.helper_threads import ratios


def _triple(k: int, alone: float, inproc: float, outproc: float) -> list[dict]:
    return [{"triple": k, "context": c, "s": s}
            for c, s in (("alone", alone), ("inproc", inproc), ("outproc", outproc))]


def test_ratios_pair_each_call_with_the_call_alone_of_its_own_triple():
    # the VM speeds up 2x between the triples; each triple's ratios stay what they were
    calls = _triple(0, 4.0, 4.4, 4.0) + _triple(1, 2.0, 2.1, 1.9) + _triple(2, 8.0, 8.4, 8.8)
    assert ratios(calls) == {"alone_s": 4.0, "inproc_s": 4.4, "outproc_s": 4.0,
                             "inproc_over_alone": 1.05, "outproc_over_alone": 1.0}


def test_a_triple_without_its_call_alone_is_an_error():
    calls = _triple(0, 4.0, 4.4, 4.0)[1:]
    with pytest.raises(KeyError):
        ratios(calls)
