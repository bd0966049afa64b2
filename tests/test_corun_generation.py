"""The co-run benchmark's summaries (``benchmarks/corun_generation.py``): per-call
figures of one role, and the medians per setting."""

from relax.benchmarks.corun_generation import medians, summary


def test_a_trainer_s_calls_give_ms_a_row_and_cores():
    calls = [{"s": 2.0, "rows": 10, "cpu_s": 1.9}, {"s": 4.0, "rows": 30, "cpu_s": 3.9}]
    assert summary(calls, "train") == {"calls": 2, "cpu_per_s": 0.967, "ms_per_row": 150.0}


def test_a_generator_s_calls_give_seconds_a_batch():
    calls = [{"s": 4.0, "rows": 0, "cpu_s": 4.0}, {"s": 5.0, "rows": 0, "cpu_s": 4.5}]
    assert summary(calls, "gen") == {"calls": 2, "cpu_per_s": 0.944, "s_per_batch": 4.5}


def test_medians_take_the_first_trainer_of_each_setting_and_skip_absent_roles():
    runs = [{"setting": "train", "train": {"ms_per_row": 170.0}},
            {"setting": "train", "train": {"ms_per_row": 180.0}},
            {"setting": "train", "train": {"ms_per_row": 200.0}},
            {"setting": "train+train", "train": {"ms_per_row": 190.0},
             "train2": {"ms_per_row": 500.0}},
            {"setting": "train+gen", "train": {"ms_per_row": 185.0}, "gen": {"s_per_batch": 4.2}},
            {"setting": "train+gen", "train": {"ms_per_row": 187.0}, "gen": {"s_per_batch": 4.0}}]
    assert medians(runs) == {"train:train": 180.0, "train+train:train": 190.0,
                             "train+gen:train": 186.0, "train+gen:gen": 4.1}
