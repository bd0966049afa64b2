"""``benchmarks/memory.py``: Qwen2.5's shapes, the memory sampling of a try's whole process
tree (oom_score_adj 1000 first), the kill at the memory floor, and the summary keys."""

import sys

import pytest

from relax.benchmarks import memory

ALLOC = ("import sys, time; b = bytearray(300 << 20); b[::4096] = b'x' * len(b[::4096]); "
         "open(sys.argv[1], 'w').write(open('/proc/self/oom_score_adj').read()); "
         "time.sleep(float(sys.argv[2]))")


@pytest.mark.parametrize("size, params", [("0.5b", 494_032_768), ("1.5b", 1_543_714_304),
                                          ("3b", 3_085_938_688), ("7b", 7_615_616_512)])
def test_the_sizes_have_qwen25s_parameter_counts(size, params):
    assert memory.n_params(size) == params


def test_measure_sums_the_tree_and_the_child_asks_to_be_killed_first(tmp_path):
    adj = tmp_path / "adj"
    # a shell whose child allocates: the grandchild's memory counts
    cmd = ["sh", "-c", f'"{sys.executable}" -c "$0" "$1" 1.5; true', ALLOC, str(adj)]
    m = memory.measure(cmd, tmp_path / "log", timeout_s=60)
    assert m["rc"] == 0 and m["killed"] is None, m
    assert 0.29 <= m["peak_rss_gb"] < 1.0 and m["processes"] >= 2, m
    assert m["hwm_sum_gb"] >= m["peak_rss_gb"]
    assert adj.read_text().strip() == "1000"


def test_a_try_is_killed_at_the_memory_floor_and_at_its_timeout(tmp_path, monkeypatch):
    cmd = [sys.executable, "-c", ALLOC, str(tmp_path / "adj"), "60"]
    m = memory.measure(cmd, tmp_path / "log", timeout_s=2)
    assert m["killed"] == "timeout" and m["wall_s"] < 30, m
    monkeypatch.setattr(memory, "FLOOR_GIB", 1e6)  # never that much available
    m = memory.measure(cmd, tmp_path / "log", timeout_s=60)
    assert m["killed"] == "memory_floor" and m["rc"] != 0 and m["wall_s"] < 30, m
    monkeypatch.undo()
    # it held almost nothing of what was there at its start: others took the memory
    # (its own peak set here: how much it allocated before the kill is a race)
    rec = {**m, "why": "memory_floor", "peak_rss_gb": 0.3}
    assert memory.crowded_out({**rec, "available_gib_before": 50.0})
    assert not memory.crowded_out({**rec, "available_gib_before": 2.0})


def test_summary_gives_the_largest_fitting_size_and_the_ratio_at_equal_size():
    params = {"0.5b": 5, "1.5b": 15, "3b": 30, "7b": 70}
    tries = {"lora_ckpt": {
        "relax": {"0.5b": {"fits": True, "peak_rss_gb": 2.0},
                  "1.5b": {"fits": True, "peak_rss_gb": 5.0},
                  "3b": {"fits": False, "peak_rss_gb": 20.0, "why": "memory_floor"}},
        "trl": {"0.5b": {"fits": True, "peak_rss_gb": 4.0},
                "1.5b": {"fits": False, "peak_rss_gb": 21.0}}}}
    d = memory.summarise(tries, params, 10.0)
    assert d["largest_params_relax"] == {"lora_ckpt": 15}
    assert d["largest_params_trl"] == {"lora_ckpt": 5}
    c = d["configs"]["lora_ckpt"]
    assert c["peak_rss_over_trl"] == {"0.5b": 0.5}
    assert c["peak_rss_gb"] == {"relax": {"0.5b": 2.0, "1.5b": 5.0}, "trl": {"0.5b": 4.0}}


def test_results_md_renders_every_try_and_the_largest_sizes():
    from relax.benchmarks import results_md

    tries = {"lora_ckpt": {"relax": {"0.5b": {"fits": True, "peak_rss_gb": 2.0},
                                     "1.5b": {"fits": None, "peak_rss_gb": 1.0,
                                              "why": "crowded out"}},
                           "trl": {"0.5b": {"fits": True, "peak_rss_gb": 4.0}}}}
    d = memory.summarise(tries, {"0.5b": 494_032_768, "1.5b": 1_543_714_304,
                                 "3b": 3_085_938_688, "7b": 7_615_616_512}, 1.0)
    headline, lines = results_md.memory(d)
    assert headline == "lora_ckpt: relax 0.49B / TRL 0.49B"
    text = "\n".join(lines)
    assert "| lora_ckpt | relax | 0.5b | 0.494 | yes | 2 |" in text
    assert "unknown (crowded out)" in text and "| 0.5 |" in text
