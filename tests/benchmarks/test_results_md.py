"""``benchmarks/RESULTS.md`` is rendered from ``benchmarks/results/*.json``
(``benchmarks/results_md.py``): the committed file is the render of the committed
results, every file stands beside its machine, date and commit, and a file no benchmark
knows is listed, not dropped."""

import json

import pytest

from relax.benchmarks import results_md
from relax.benchmarks.harness import write_result


def test_the_committed_results_md_is_the_render_of_the_committed_results():
    assert results_md.OUT.read_text() == results_md.render(), (
        "benchmarks/RESULTS.md is stale: run python -m relax.benchmarks.results_md")
    assert results_md.OUT.read_text().count("\n") < 300


def test_a_result_is_rendered_beside_its_machine_date_and_commit(tmp_path):
    doc = {"settings": {"calls": 3},
           "floor": {"calls": 3, "min_ms": 20.0, "median_ms": 25.5, "max_ms": 40.0},
           "humaneval": {"calls": 3, "min_ms": 100.0, "median_ms": 120.25, "max_ms": 150.0}}
    path = write_result(tmp_path / "sandbox_cost.json", doc)
    machine = json.loads(path.read_text())["machine"]
    assert machine["cpus"] >= 1 and len(machine["date"]) == 16 and len(machine["load"]) == 3
    prov = results_md.provenance({"machine": machine})
    assert prov["machine"].startswith(f"{machine['cpus']} CPUs, {machine['cpu']}")
    assert f"load {machine['load'][0]}" in prov["machine"]
    (tmp_path / "mystery.json").write_text("{}")
    text = results_md.render(tmp_path)
    assert (f"`results/sandbox_cost.json`: {prov['machine']}, {machine['date']}, "
            f"commit {machine['commit']}.") in text
    assert "| humaneval | 3 | 100 | 120 | 150 |" in text
    assert "median 25.5 ms (floor), 120.25 ms (HumanEval)" in text
    assert "## Files no benchmark here renders" in text and "- `mystery.json`" in text
    assert "No results yet: `python benchmarks/chaos.py`." in text


def test_a_result_without_a_figure_its_benchmark_reads_names_the_file(tmp_path):
    (tmp_path / "chaos.json").write_text(json.dumps({"runs": 3}))
    with pytest.raises(KeyError, match="chaos.json: chaos.py's figures lack 'finished'"):
        results_md.render(tmp_path)


def test_provenance_falls_back_to_the_document_and_says_what_is_unknown():
    assert results_md.provenance({"commit": "abc1234", "date": "2026-12-01"}) == {
        "machine": "not recorded", "date": "2026-12-01", "commit": "abc1234", "note": ""}
    assert results_md.provenance({"machine": {
        "cpus": 2, "gpu": "NVIDIA H200", "date": "2026-12-04 10:11:12", "load": [3.5, 2, 1],
        "commit": "def5678+", "note": "on a borrowed machine"}}) == {
        "machine": "2 CPUs, NVIDIA H200, load 3.5", "date": "2026-12-04 10:11",
        "commit": "def5678+", "note": "on a borrowed machine"}
