"""relax publish: real GSM8K file, bad rows to the errors topic, duplicates, other sources."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax.streams.read import read_table
from relax.producers.publish import AlreadyPublished, prompt_id, publish
from relax.producers.sources import SourceError
from relax.schemas import topics
from relax.streams.client import BusConfig, topic_partitions

GSM8K_TEST = Path("/work/shared/data/gsm8k/test.jsonl")


def test_publish_gsm8k_test_file_with_the_cli(broker, unique):
    if not GSM8K_TEST.exists():
        pytest.skip(f"{GSM8K_TEST} is absent")
    from typer.testing import CliRunner

    from relax.infra.cli.app import app

    topic = f"prompts.{unique}"
    args = ["publish", str(GSM8K_TEST), "--topic", topic, "--prompt-field", "question",
            "--label-field", "answer", "--bootstrap", broker]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert res.output.strip().splitlines()[-1] == \
        f"published=1319 errors=0 topic={topic} partitions=4"
    cfg = BusConfig(bootstrap_servers=broker)
    assert topic_partitions(cfg, [topic, topics.errors_topic(topic)]) == \
        {topic: 4, topics.errors_topic(topic): 1}
    rows = read_table(cfg, topic).to_pylist()
    assert len(rows) == 1319
    lines = [json.loads(x) for x in GSM8K_TEST.read_text().splitlines()]
    by_line = {json.loads(r["metadata"])["line"]: r for r in rows}
    assert sorted(by_line) == list(range(1, 1320))
    first = by_line[1]
    assert first["prompt"] == lines[0]["question"] and first["label"] == lines[0]["answer"]
    assert first["dataset"] == unique and first["messages"] is None
    assert first["prompt_id"] == prompt_id(lines[0]["question"], None, lines[0]["answer"])
    assert len({r["prompt_id"] for r in rows}) == 1319

    again = CliRunner().invoke(app, args)  # same data again: refused, nothing sent
    assert again.exit_code == 1
    assert "already holds 1319 of the 1319 prompt_ids" in again.output
    assert "--force" in again.output
    assert read_table(cfg, topic).num_rows == 1319


def _jsonl(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_bad_rows_go_to_errors_topic_with_line_numbers_and_good_rows_go(broker, unique,
                                                                       tmp_path):
    cfg = BusConfig(bootstrap_servers=broker, max_message_bytes=64 * 1024)
    big = json.dumps({"q": "x" * 100_000, "a": "1"}).encode()
    lines = [
        json.dumps({"q": "What is 2 + 2?", "a": "4", "level": 1}).encode(),   # 1 good
        json.dumps({"a": "5"}).encode(),                                      # 2 missing field
        json.dumps({"q": 42, "a": "6"}).encode(),                             # 3 wrong type
        b'{"q": "caf\xe9 au lait?", "a": "7"}',                               # 4 invalid UTF-8
        big,                                                                  # 5 oversize
        b"",                                                                  # 6 blank: skipped
        b"{not json",                                                         # 7 not JSON
        json.dumps({"q": "What is 3 + 3?", "a": 6}).encode(),                 # 8 good (number label)
        json.dumps({"q": [{"role": "user", "content": "Hi?"}], "a": "hi"}).encode(),  # 9 good chat
        json.dumps({"q": "What is 4 + 4?", "a": None}).encode(),              # 10 null label
        b'{"q": "What is 5 + 5?", "a": NaN}',                                 # 11 NaN label
    ]
    src = _jsonl(tmp_path / "bad.jsonl", lines)
    topic = f"prompts.{unique}"
    r = publish(cfg, str(src), topic, prompt_field="q", label_field="a", partitions=2)
    assert (r.published, r.errors, r.partitions) == (3, 7, 2)
    assert r.summary() == f"published=3 errors=7 topic={topic} partitions=2"

    good = read_table(cfg, topic).to_pylist()
    assert sorted(json.loads(g["metadata"])["line"] for g in good) == [1, 8, 9]
    by_line = {json.loads(g["metadata"])["line"]: g for g in good}
    assert json.loads(by_line[1]["metadata"]) == {"source": str(src), "line": 1,
                                                  "fields": {"level": 1}}
    assert by_line[8]["label"] == "6"
    assert by_line[9]["messages"] == [{"role": "user", "content": "Hi?"}]
    assert by_line[9]["prompt"] == "Hi?"

    errs = {e["source_offset"]: e for e in read_table(cfg, topics.errors_topic(topic)).to_pylist()}
    assert sorted(errs) == [2, 3, 4, 5, 7, 10, 11]
    for line, e in errs.items():
        assert e["source_topic"] == str(src) and e["stage"] == "publish"
        assert e["error"].startswith(f"line {line}: ")
        if line != 5:
            assert e["value"] == lines[line - 1]
    assert "missing field 'q'" in errs[2]["error"]
    assert "expected text or a list of chat messages, got int" in errs[3]["error"]
    assert "invalid UTF-8" in errs[4]["error"]
    assert "over max_message_bytes=65536" in errs[5]["error"]
    assert "truncated" in errs[5]["error"] and errs[5]["value"] == big[:32 * 1024]
    assert "not valid JSON" in errs[7]["error"]
    assert "field 'a' (the label field) is null" in errs[10]["error"]
    assert "field 'a' (the label field) is null" in errs[11]["error"]

    with pytest.raises(AlreadyPublished, match="already holds 3 of the 3 prompt_ids"):
        publish(cfg, str(src), topic, prompt_field="q", label_field="a")
    assert read_table(cfg, topic).num_rows == 3
    forced = publish(cfg, str(src), topic, prompt_field="q", label_field="a", force=True)
    assert (forced.published, forced.duplicates, forced.partitions) == (3, 3, 2)
    assert read_table(cfg, topic).num_rows == 6


def test_csv_parquet_and_datasets_folder_give_the_same_prompt_ids(broker, unique, tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    cfg = BusConfig(bootstrap_servers=broker)
    recs = [{"question": "What is 1 + 1?", "answer": "2"},
            {"question": "Name a prime, please", "answer": "7"},
            {"question": "Line one\nline two", "answer": "3"}]
    (tmp_path / "p.csv").write_text(
        'question,answer\n"What is 1 + 1?",2\n"Name a prime, please",7\n'
        '"Line one\nline two",3\nonly-one-column\n')
    pq.write_table(pa.Table.from_pylist(recs), tmp_path / "p.parquet")
    datasets.Dataset.from_list(recs).save_to_disk(str(tmp_path / "hfds"))
    want = sorted(prompt_id(r["question"], None, r["answer"]) for r in recs)
    for i, src in enumerate(["p.csv", "p.parquet", "hfds"]):
        topic = f"prompts.{unique}-{i}"
        r = publish(cfg, str(tmp_path / src), topic, prompt_field="question",
                    label_field="answer", partitions=1)
        rows = read_table(cfg, topic).to_pylist()
        assert sorted(x["prompt_id"] for x in rows) == want, src
        if src == "p.csv":  # the short last row: missing label value
            assert (r.published, r.errors) == (3, 1)
            err = read_table(cfg, topics.errors_topic(topic)).to_pylist()[0]
            assert err["source_offset"] == 6 and "missing field 'answer'" in err["error"]
            lines = {json.loads(x["metadata"])["line"] for x in rows}
            assert lines == {2, 3, 4}
        else:
            assert (r.published, r.errors) == (3, 0)


def test_reasoning_gym_source(broker, unique):
    cfg = BusConfig(bootstrap_servers=broker)
    topic = f"prompts.{unique}"
    r = publish(cfg, "reasoning_gym:basic_arithmetic?size=5&seed=7", topic, partitions=1)
    assert (r.published, r.errors) == (5, 0)
    rows = sorted(read_table(cfg, topic).to_pylist(), key=lambda x: json.loads(x["metadata"])["index"])
    import reasoning_gym

    ds = reasoning_gym.create_dataset("basic_arithmetic", size=5, seed=7)
    for i, (row, entry) in enumerate(zip(rows, ds)):
        meta = json.loads(row["metadata"])
        assert meta["source"] == "reasoning_gym" and meta["task"] == "basic_arithmetic"
        assert (meta["index"], meta["seed"], meta["size"]) == (i, 7, 5)
        assert meta["entry"]["question"] == entry["question"] == row["prompt"]
        assert row["label"] == entry["answer"]
        assert ds.score_answer(answer=row["label"], entry=meta["entry"]) == 1.0
    with pytest.raises(SourceError, match="reasoning-gym task 'no_such_task'"):
        publish(cfg, "reasoning_gym:no_such_task?size=2", topic)


def test_hf_hub_source_fails_clearly_when_it_cannot_be_loaded(broker, unique):
    cfg = BusConfig(bootstrap_servers=broker)
    with pytest.raises(SourceError) as e:
        publish(cfg, "hf://relax-test-missing-org/no-such-dataset:test", f"prompts.{unique}")
    msg = str(e.value)
    assert "'relax-test-missing-org/no-such-dataset'" in msg and "split 'test'" in msg
    assert "local folder or JSONL/Parquet file" in msg


def _publish_cli(*args):
    from typer.testing import CliRunner

    from relax.infra.cli.app import app

    return CliRunner().invoke(app, ["publish", *map(str, args)])


def test_cli_exits_1_with_one_line_when_every_row_fails(broker, unique, tmp_path):
    src = _jsonl(tmp_path / "all_bad.jsonl", [json.dumps({"q": i, "a": "1"}).encode()
                                               for i in range(17)])
    topic = f"prompts.{unique}"
    res = _publish_cli(src, "--topic", topic, "--prompt-field", "q", "--label-field", "a",
                       "--bootstrap", broker)
    assert res.exit_code == 1, res.output
    assert not res.stdout.strip(), res.output
    last = res.stderr.strip().splitlines()[-1]  # after the progress bar's lines
    assert last.startswith("error: no row was published: all 17 rows failed"), last
    assert "line 1: field 'q': expected text or a list of chat messages, got int" in last
    assert f"relax errors {topic}" in last
    cfg = BusConfig(bootstrap_servers=broker)
    assert read_table(cfg, topics.errors_topic(topic)).num_rows == 17  # still recorded


def test_cli_partial_failure_exits_0_and_counts_the_errors(broker, unique, tmp_path):
    src = _jsonl(tmp_path / "some_bad.jsonl", [json.dumps({"q": "What is 1 + 1?"}).encode(),
                                               json.dumps({"q": 5}).encode()])
    topic = f"prompts.{unique}"
    res = _publish_cli(src, "--topic", topic, "--prompt-field", "q", "--bootstrap", broker)
    assert res.exit_code == 0, res.output
    assert res.stdout.strip().splitlines()[-1] == f"published=1 errors=1 topic={topic} partitions=4"
    assert f"1 row failed: see `relax errors {topic}`" in res.stderr


@pytest.mark.parametrize("option", ["--prompt-field", "--label-field"])
def test_cli_misspelled_field_fails_at_once_naming_the_fields(broker, unique, tmp_path, option):
    src = _jsonl(tmp_path / "gsm.jsonl", [json.dumps({"question": f"What is {i} + 1?",
                                                      "answer": str(i + 1)}).encode()
                                          for i in range(5)])
    topic = f"prompts.{unique}"
    fields = {"--prompt-field": "question", "--label-field": "answer"}
    fields[option] = "questoin"
    res = _publish_cli(src, "--topic", topic, "--prompt-field", fields["--prompt-field"],
                       "--label-field", fields["--label-field"], "--bootstrap", broker)
    assert res.exit_code == 1, res.output
    assert not res.stdout.strip(), res.output
    msg = res.stderr.strip().splitlines()[-1]
    assert msg.startswith("error: ") and "sending" not in res.stderr, res.stderr
    assert f"{option} 'questoin'" in msg and "'answer', 'question'" in msg, msg
    cfg = BusConfig(bootstrap_servers=broker)
    assert topic_partitions(cfg, [topic, topics.errors_topic(topic)]) == {}  # nothing sent


def test_missing_field_raises_before_anything_is_sent(broker, unique, tmp_path):
    from relax.producers.publish import FieldNotFound

    lines = [json.dumps({"q": "What is 2 + 2?", "a": "4"}).encode()] * 3
    src = _jsonl(tmp_path / "x.jsonl", [b"{not json"] + lines)
    cfg = BusConfig(bootstrap_servers=broker)
    with pytest.raises(FieldNotFound) as e:
        publish(cfg, str(src), f"prompts.{unique}", prompt_field="q", label_field="answer")
    assert e.value.field == "answer" and e.value.available == ["a", "q"]
    assert isinstance(e.value, SourceError)
    # a field some records lack is a per-row error, not a missing field
    mixed = _jsonl(tmp_path / "mixed.jsonl", [json.dumps({"a": "1"}).encode()] + lines[:1])
    r = publish(cfg, str(mixed), f"prompts.{unique}", prompt_field="q", label_field="a")
    assert (r.published, r.errors) == (1, 1)
