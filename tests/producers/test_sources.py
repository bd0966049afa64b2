

def test_human_eval_source_reads_the_164_tasks():
    from relax.producers.sources import read_source, source_kind

    assert source_kind("human_eval") == "human_eval"
    rows = list(read_source("human_eval"))
    assert len(rows) == 164 and rows[0].line == 1
    assert set(rows[0].record) == {"task_id", "prompt", "entry_point", "canonical_solution", "test"}
    assert rows[0].record["task_id"] == "HumanEval/0"
