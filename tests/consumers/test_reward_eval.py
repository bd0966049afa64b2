"""``relax reward eval``: a JSONL file scored offline through the worker pool."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from relax.infra.cli.app import app

GSM8K_TEST = Path("/work/shared/data/gsm8k/test.jsonl")


def _eval(*args):
    res = CliRunner().invoke(app, ["reward", "eval", *args])
    return res, res.output.strip().splitlines()


def test_eval_gsm8k_gold_solutions_on_the_real_test_split():
    if not GSM8K_TEST.is_file():
        pytest.skip(f"{GSM8K_TEST} not present")
    res, lines = _eval("gsm8k", str(GSM8K_TEST), "--response-field", "answer",
                       "--label-field", "answer", "--workers", "2")
    assert res.exit_code == 0, res.output
    assert lines[-1] == "scored=1319 mean=1.0 errors=0"
    assert "rows/s=" in lines[-2] and "rows=1319" in lines[-2]


def test_eval_math_with_options_metadata_and_errors(tmp_path):
    data = tmp_path / "d.jsonl"
    rows = [{"out": r"\boxed{2}", "gold": "2", "meta": {"k": 1}},
            {"out": r"\boxed{3}", "gold": "two", "meta": "{}"},
            {"out": r"</think>\boxed{2}", "gold": None, "meta": {}},
            {"out": r"no box", "gold": 5, "meta": {}}]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    res, lines = _eval("math", str(data), "--response-field", "out", "--label-field", "gold",
                       "--metadata-field", "meta", "-o", "no_answer=-1")
    assert res.exit_code == 0, res.output
    assert lines[-1] == "scored=3 mean=0.0 errors=0"  # (1 + 0 - 1) / 3
    assert "abstained=1" in lines[-2]
    res, lines = _eval("gsm8k", str(data), "--response-field", "out", "--label-field", "gold")
    # strict mode finds no "####": 0.0; "two" is no number: a row error; null label abstains
    assert lines[-1] == "scored=2 mean=0.0 errors=1"
    assert f"error: {data}: row 2: gsm8k label 'two' is not a number" in res.output
    # every row failed, none scored: exit 1 (the function does not work on this data)
    data.write_text(json.dumps(rows[1]) + "\n")
    res, lines = _eval("gsm8k", str(data), "--response-field", "out", "--label-field", "gold")
    assert res.exit_code == 1 and lines[-1] == "scored=0 mean=nan errors=1"
    # "-o mode=..." reaches the function; a bad option stops the start with the reason
    res, lines = _eval("gsm8k", str(data), "--response-field", "out", "-o", "mode=loose")
    assert res.exit_code == 1 and "unknown gsm8k mode 'loose'" in res.output


def test_eval_bad_input_names_the_line_and_field(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"out": "1"}\n{"resp": "2"}\n')
    res, _ = _eval("gsm8k", str(data), "--response-field", "out")
    assert res.exit_code == 1 and "d.jsonl:2: missing field(s) ['out']" in res.output
    data.write_text('{"out": "1", "m": [1]}\n')
    res, _ = _eval("gsm8k", str(data), "--response-field", "out", "--metadata-field", "m")
    assert res.exit_code == 1 and "row 1: m is not a JSON object" in res.output
    res, _ = _eval("gsm8k_strict", str(data), "--response-field", "out")
    assert res.exit_code == 2 and "valid: math" in res.output


# ---- a list label (issue 57): any of its answers, as publish and `relax reward eval` write it

@pytest.mark.parametrize("reward, values", [("math", (1, 1, 0)), ("gsm8k", (1, 1, 0)),
                                            ("dapo", (1, 1, -1))])
def test_eval_a_list_label_scores_any_of(tmp_path, reward, values):
    data = tmp_path / "d.jsonl"
    rows = [{"out": f"#### {n}\n\\boxed{{{n}}}\nAnswer: {n}", "gold": gold}
            for n, gold in ((4, ["3", "4"]), (3, [3, 4]), (5, ["3", "4"]))]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    res, lines = _eval(reward, str(data), "--response-field", "out", "--label-field", "gold",
                       "--workers", "1")
    assert res.exit_code == 0, res.output
    assert lines[-1] == f"scored=3 mean={round(sum(values) / 3, 4)} errors=0"
    data.write_text(json.dumps({"out": "1", "gold": [[1]]}) + "\n")
    res, _ = _eval(reward, str(data), "--response-field", "out", "--label-field", "gold")
    assert res.exit_code == 1
    assert "row 1: expected a list of texts and numbers, got a list holding [1]" in res.output
