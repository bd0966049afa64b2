"""Bad input, end to end, through the real broker.

Publishing: every file of the corpus in ``tests/data/bad/`` (README.md there lists what
each should give), a 50 MB row and Parquet files of the wrong schema go through
``relax publish``: each bad row is counted and is a record of ``prompts.<x>.errors``
whose reason names its line; the good rows are published.

A live run (the tiny recipe, 3 steps) with bad messages produced straight onto its
topics and a second reward (weight 0) that fails row by row: each bad message is in
``<topic>.errors`` once per consumer group that read it, with a reason naming
``topic[partition]@offset`` and what was wrong (``<run>.weights`` announcements are
read group-less: each reader logs and skips them); each failed score is a row of
``<run>.rewards`` with its error; the run finishes and its books balance.

Run with ``-s`` to see the table of what went where.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from testdata import (
    MISBEHAVIOURS,
    prompt_rows,
    reward_rows,
    rollout_rows,
    tiny_recipe,
    train_sample_rows,
    weight_rows,
)

from relax.streams.read import read_reward_errors, read_table
from relax.producers.publish import AlreadyPublished, FieldNotFound, publish
from relax.schemas import SCHEMAS, topics
from relax.streams.client import BusConfig, ensure_topics, producer_kwargs, topic_partitions
from relax.streams.codec import encode

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("local_ray")]

CORPUS = Path(__file__).resolve().parents[1] / "data" / "bad"

# file -> (lines published, {bad line: what its reason says}, rows skipped as repeats)
EXPECTED = {
    "truncated.jsonl": ([1, 2, 3], {4: "not valid JSON: Unterminated string"}, 0),
    "malformed.jsonl": ([1, 8], {
        2: "not valid JSON: Expecting property name", 3: "not valid JSON: Expecting property name",
        4: "expected a JSON object, got list", 5: "expected a JSON object, got str",
        7: "not valid JSON: Extra data"}, 0),
    "invalid_utf8.jsonl": ([1, 6], {
        2: "invalid UTF-8 at byte 15", 3: "invalid UTF-8 at byte 40",
        4: "not valid JSON: Unexpected UTF-8 BOM", 5: "invalid UTF-8 at byte 16"}, 0),
    "wrong_types.jsonl": ([9, 10], {
        1: "field 'prompt': expected text or a list of chat messages, got int",
        2: "field 'prompt': expected text or a list of chat messages, got float",
        3: "field 'prompt' item 0: expected {role: str, content: str or a list of parts}, got \"What\"",
        4: "field 'prompt': expected text or a list of chat messages, got dict",
        5: "field 'prompt': expected text or a list of chat messages, got bool",
        6: "field 'prompt': expected text or a list of chat messages, got NoneType",
        7: "field 'prompt' item 0: expected {role: str, content: str or a list of parts}",
        8: "field 'answer': expected text, a number or a list of them, got dict",
        11: "field 'answer' (the label field) is null"}, 0),
    "empty_prompt.jsonl": ([1], {
        2: "field 'prompt': expected non-empty text, got an empty string",
        3: "field 'prompt': expected non-empty text, got an empty string",
        4: "field 'prompt': expected a non-empty text or message list, got []",
        5: "missing field 'prompt' (the prompt field); record has ['answer']",
        6: "missing field 'prompt' (the prompt field); record has ['answer', 'question']",
        7: "missing field 'answer' (the label field)",
        8: "missing field 'prompt' (the prompt field); record has []"}, 0),
    "duplicates.jsonl": ([1, 4, 5], {}, 3),
}

BIG_ROW_BYTES = 50 << 20


@pytest.fixture(scope="module")
def table():
    """Rows ``(input, where it went, outcome)`` the tests add; printed at the end (-s)."""
    rows: list[tuple[str, str, str]] = []
    yield rows
    if rows:
        head = ("input", "where it went", "outcome")
        print("\n\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
        for r in rows:
            print("| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in r) + " |")


def _short(text: str, n: int = 110) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def _lines(path: Path) -> list[bytes]:
    return path.read_bytes().split(b"\n")


def _published_and_errors(cfg: BusConfig, topic: str) -> tuple[list[dict], dict[int, dict]]:
    good = read_table(cfg, topic).to_pylist()
    errs = read_table(cfg, topics.errors_topic(topic)).to_pylist()
    by_line = {e["source_offset"]: e for e in errs}
    assert len(by_line) == len(errs), "one error record per bad line"
    return good, by_line


# ------------------------------------------------------------------ publishing


def test_publish_routes_every_bad_row_of_the_corpus(broker, unique, tmp_path, table):
    cfg = BusConfig(bootstrap_servers=broker)  # max_message_bytes: the 1 MiB default
    assert sorted(p.name for p in CORPUS.glob("*.jsonl")) == sorted(EXPECTED)
    for i, (name, (good_lines, bad, repeated)) in enumerate(sorted(EXPECTED.items())):
        src, topic = CORPUS / name, f"prompts.{unique}-{i}"
        r = publish(cfg, str(src), topic, prompt_field="prompt", label_field="answer",
                    partitions=1)
        outcome = f"published={r.published} errors={r.errors} repeated={r.repeated}"
        assert (r.published, r.errors, r.repeated) == (len(good_lines), len(bad), repeated), \
            (name, outcome)
        good, errs = _published_and_errors(cfg, topic)
        assert sorted(json.loads(g["metadata"])["line"] for g in good) == good_lines, name
        labels = {json.loads(g["metadata"])["line"]: g["label"] for g in good}
        assert name != "wrong_types.jsonl" or labels[9] == '["9"]', labels  # a list label
        assert sorted(errs) == sorted(bad), name
        raw = _lines(src)
        for line, words in bad.items():
            e = errs[line]
            assert e["source_topic"] == str(src) and e["stage"] == "publish", e
            assert e["error"].startswith(f"line {line}: ") and words in e["error"], e["error"]
            assert e["value"] == raw[line - 1], (name, line)
            table.append((f"{name} line {line}", f"prompts.<x>.errors: {_short(e['error'])}",
                          outcome))
        if repeated:
            table.append((f"{name} lines 2, 3, 6 (same prompt_id as line 1)",
                          "skipped (PublishResult.repeated; the CLI prints it), not an error",
                          outcome))
            with pytest.raises(AlreadyPublished, match="already holds 3 of the 3 prompt_ids"):
                publish(cfg, str(src), topic, prompt_field="prompt", label_field="answer")
            assert read_table(cfg, topic).num_rows == 3
            table.append((f"{name} published again", "refused: AlreadyPublished, nothing sent",
                          "raises; topic keeps 3 rows"))


def test_a_50_mb_row_is_rejected_naming_its_line_and_the_rows_around_it_go(broker, unique,
                                                                          tmp_path, table):
    """``max_message_bytes`` (BusConfig, default 1 MiB) is the largest message value relax
    produces; only media bytes may move to the blob store, so a prompt row that alone
    encodes over it is a bad row (its value in the error record cut to half the limit)."""
    cfg = BusConfig(bootstrap_servers=broker, blob_store=str(tmp_path / "blobs"))
    big = json.dumps({"prompt": "x" * BIG_ROW_BYTES, "answer": "1"}).encode()
    src = tmp_path / "big_row.jsonl"
    src.write_bytes(b"\n".join([json.dumps({"prompt": "What is 1 + 1?", "answer": "2"}).encode(),
                                big,
                                json.dumps({"prompt": "What is 2 + 2?", "answer": "4"}).encode()]))
    topic = f"prompts.{unique}"
    r = publish(cfg, str(src), topic, prompt_field="prompt", label_field="answer", partitions=1)
    assert (r.published, r.errors) == (2, 1)
    good, errs = _published_and_errors(cfg, topic)
    assert sorted(json.loads(g["metadata"])["line"] for g in good) == [1, 3]
    e = errs[2]
    limit = cfg.max_message_bytes
    assert e["error"].startswith("line 2: row encodes to ") and \
        f"over max_message_bytes={limit}" in e["error"], e["error"]
    assert f"(value truncated to its first {limit // 2} of {len(big)} bytes)" in e["error"]
    assert e["value"] == big[: limit // 2]
    table.append(("big_row.jsonl line 2 (a 50 MB prompt, made in the test)",
                  f"prompts.<x>.errors: {_short(e['error'], 140)}",
                  f"published={r.published} errors={r.errors}"))


def test_parquet_of_the_wrong_schema(broker, unique, tmp_path, table):
    cfg = BusConfig(bootstrap_servers=broker)
    # the prompt column holds integers: every row is a bad row, naming its row number
    ints = tmp_path / "int_prompt.parquet"
    pq.write_table(pa.table({"prompt": [1, 2, 3], "answer": ["1", "2", "3"]}), ints)
    topic = f"prompts.{unique}-int"
    r = publish(cfg, str(ints), topic, prompt_field="prompt", label_field="answer", partitions=1)
    assert (r.published, r.errors) == (0, 3)
    good, errs = _published_and_errors(cfg, topic)
    assert good == [] and sorted(errs) == [1, 2, 3]
    for line, e in errs.items():
        assert e["error"] == (f"line {line}: field 'prompt': expected text or a list of chat "
                              "messages, got int"), e["error"]
        assert json.loads(e["value"]) == {"prompt": line, "answer": str(line)}
    table.append(("int_prompt.parquet rows 1-3 (prompt: int64)",
                  f"prompts.<x>.errors x3: {errs[1]['error']}",
                  f"published={r.published} errors={r.errors} (the CLI exits 1)"))

    # no prompt column at all: a misspelled field, refused before anything is sent
    other = tmp_path / "no_prompt_column.parquet"
    pq.write_table(pa.table({"text": ["What is 1 + 1?"], "answer": ["2"]}), other)
    topic = f"prompts.{unique}-none"
    with pytest.raises(FieldNotFound) as exc:
        publish(cfg, str(other), topic, prompt_field="prompt", label_field="answer")
    assert exc.value.available == ["answer", "text"]
    assert topic_partitions(cfg, [topic, topics.errors_topic(topic)]) == {}
    table.append(("no_prompt_column.parquet (columns text, answer)",
                  "nowhere: publish raises FieldNotFound before sending anything",
                  _short(str(exc.value).replace(str(tmp_path), "<tmp>"), 140)))


# ------------------------------------------------------------------ a live run

LIVE_PROMPTS = [("What is 1 + 2?", "ok"), ("What is 2 + 5?", "ok"), ("What is 3 + 1?", "raise"),
                ("What is 4 + 4?", "nan"), ("What is 5 + 3?", "sleep"),
                ("What is 6 + 2?", "memory")]
"""The run's data set: the label tells :func:`testdata.misbehaving_reward` what to do."""

MISBEHAVE_TIMEOUT_S = 3.0
TWO_REWARDS = ('rewards=[{name: parity, fn: "testdata:parity_reward"}, '
               '{name: misbehave, fn: "testdata:misbehaving_reward", weight: 0, '
               f'timeout_s: {MISBEHAVE_TIMEOUT_S}}}]')
WAIT_S = 150.0
"""Deadline for every bad message and score to arrive where it should (seconds)."""

WRONG = {"prompts": "rollouts", "rollouts": "rewards", "rewards": "rollouts",
         "train_samples": "rewards", "weights": "rewards"}
"""The valid batch of another relax schema produced onto each topic."""

READERS = {"prompts": {"rollout/rollout-0/decode"},
           "rollouts": {"reward.parity/decode", "reward.misbehave/decode", "aggregate/decode"},
           "rewards": {"aggregate/decode"}, "train_samples": {"trainer/decode"}}
"""``stage`` of the error record each consumer group writes, by topic schema."""

AT_STEP_1 = ("rollouts", "rewards", "weights")
"""The topics whose bad messages go in at step 1 (prompts and train_samples: before)."""

REASONS = {"non-Arrow bytes": "undecodable bytes", "null value (tombstone)": "null value",
           "unknown relax-schema header": "unknown schema 'no_such_schema'"}
WEIGHT_REASONS = {"non-Arrow bytes": "not an Arrow IPC stream",
                  "null value (tombstone)": "null value (a tombstone)",
                  "unknown relax-schema header": ("relax-schema header b'no_such_schema' is "
                                                  "not 'weights'"),
                  "a valid 'rewards' batch": "weights field 'policy_version'"}
"""What the rollout stage's log says of each bad message on ``<run>.weights``."""


def _valid_batches(dataset: str) -> dict[str, bytes]:
    """One valid message value of each schema produced onto a topic (ids ``injected-*``)."""
    rolls = rollout_rows(2, group_size=2, tokens=4)
    for r in rolls:
        r["group_id"] = "injected-" + r["group_id"]
        r["rollout_id"] = f"{r['group_id']}/{r['sample_index']}"
    rews = reward_rows(rolls, "injected", [1.0, 0.0])
    prompts = prompt_rows(1, dataset=dataset)
    prompts[0]["prompt_id"] = "injected"
    rows = {"prompts": prompts, "rollouts": rolls, "rewards": rews,
            "train_samples": train_sample_rows(rolls, rews), "weights": weight_rows(0)}
    return {n: encode(pa.RecordBatch.from_pylist(r, schema=SCHEMAS[n])) for n, r in rows.items()}


def _bad_messages(name: str, valid: dict[str, bytes]) -> list[tuple[str, bytes | None, list]]:
    """``(what, value, headers)`` of the four bad messages produced onto a ``name`` topic."""
    own = [("relax-schema", name.encode())]
    return [("non-Arrow bytes", b"\x00\x01 this is not an Arrow IPC stream", own),
            ("null value (tombstone)", None, own),
            ("unknown relax-schema header", valid[name], [("relax-schema", b"no_such_schema")]),
            (f"a valid '{WRONG[name]}' batch", valid[WRONG[name]], own)]


def _produce(cfg: BusConfig, topic: str, messages: list) -> list[int]:
    """Send ``(what, value, headers)`` to partition 0 with a raw kafka-python producer;
    returns their offsets."""
    from kafka import KafkaProducer

    kp = KafkaProducer(**producer_kwargs(cfg))
    try:
        futures = [kp.send(topic, value=v, key=f"bad-{i}".encode(), headers=h, partition=0)
                   for i, (_, v, h) in enumerate(messages)]
        return [f.get(timeout=30).offset for f in futures]
    finally:
        kp.close()


class _Injected:
    """The bad messages of the live run: produced, then awaited where they should land."""

    def __init__(self, cfg: BusConfig, run: str, dataset: str):
        self.cfg, self.run, self.dataset = cfg, run, dataset
        self.valid = _valid_batches(dataset)
        self.sent: dict[str, list[tuple[str, int]]] = {}  # topic -> [(what, offset)]
        self.names: dict[str, str] = {}  # topic -> schema name

    def produce(self, name: str) -> None:
        topic = (topics.prompts_topic(self.dataset) if name == "prompts"
                 else topics.run_topic(self.run, name))
        messages = _bad_messages(name, self.valid)
        offsets = _produce(self.cfg, topic, messages)
        self.sent[topic] = [(what, o) for (what, _, _), o in zip(messages, offsets)]
        self.names[topic] = name

    def errors(self, topic: str) -> dict[tuple[int, str], list[dict]]:
        """``{(offset, stage): [error records]}`` of ``topic``'s partition 0."""
        out: dict[tuple[int, str], list[dict]] = {}
        for e in read_table(self.cfg, topics.errors_topic(topic)).to_pylist():
            if e["source_partition"] == 0:
                out.setdefault((e["source_offset"], e["stage"]), []).append(e)
        return out

    def weight_log_lines(self, run_dir: Path) -> dict[int, str]:
        """``{offset: line}``: the first line of the rollout stage's log that skips it."""
        log = run_dir / "logs" / "rollout-0.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        topic = topics.run_topic(self.run, topics.WEIGHTS)
        lines, out = text.splitlines(), {}
        for _, offset in self.sent.get(topic, []):
            key = f"skipping unusable announcement at {topic}[0]@{offset}:"
            hit = next((ln for ln in lines if key in ln), None)
            if hit is not None:
                out[offset] = hit
        return out

    def missing(self, run_dir: Path, epoch0_rollouts: list[str]) -> list[str]:
        """What has not arrived yet: error records, log lines, misbehave scores."""
        todo = []
        for topic, sent in self.sent.items():
            name = self.names[topic]
            if name == "weights":
                got = self.weight_log_lines(run_dir)
                todo += [f"{topic}@{o} skipped in rollout-0.log" for _, o in sent if o not in got]
                continue
            got = self.errors(topic)
            todo += [f"{topic}@{o} by {s}" for _, o in sent for s in READERS[name]
                     if (o, s) not in got]
        scored = {r["rollout_id"] for r in read_table(
            self.cfg, topics.run_topic(self.run, topics.REWARDS)).to_pylist()
            if r["reward_name"] == "misbehave"}
        todo += [f"misbehave score of {rid}" for rid in epoch0_rollouts if rid not in scored]
        return todo


def test_a_live_run_routes_every_bad_message_and_every_failed_score(broker, tmp_path, table):
    from relax.infra.control.launch import train

    cfg = BusConfig(bootstrap_servers=broker)
    tag = uuid.uuid4().hex[:6]
    run, dataset = "bad" + tag, "bad-live-" + tag
    src = tmp_path / "live.jsonl"
    src.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in LIVE_PROMPTS))
    recipe = tiny_recipe(broker, tmp_path, run, TWO_REWARDS, f"data.dataset={dataset}",
                         f"data.source={src}", "data.partitions=1", "trainer.steps=3")
    assert recipe.advantage.rewards == {"parity": 1.0}  # misbehave: run, recorded, not counted
    assert [r.name for r in recipe.rewards] == ["parity", "misbehave"]

    # the prompts, then the bad prompt messages after them: the rollout stage reads its
    # prompt topic when it needs new groups, and a 3-step run may have started every
    # group it needs by step 1, so these go in before the run. So do the bad
    # train_samples: the trainer stops reading at its last step, and a fast trainer may
    # hold the samples of all 3 steps before step 1 is seen here (a CI run went red so).
    # The others go in at step 1: their readers read on until the run ends.
    prompts_topic = topics.prompts_topic(dataset)
    pub = publish(cfg, str(src), prompts_topic, prompt_field="question", label_field="answer",
                  partitions=1)
    assert (pub.published, pub.errors) == (len(LIVE_PROMPTS), 0)
    label_of = {r["prompt_id"]: r["label"] for r in read_table(cfg, prompts_topic).to_pylist()}
    epoch0 = [f"{pid}:0/{i}" for pid in label_of for i in range(recipe.rollout.group_size)]
    injected = _Injected(cfg, run, dataset)
    injected.produce("prompts")
    ensure_topics(cfg, {topics.run_topic(run, topics.TRAIN_SAMPLES): recipe.partitions})
    injected.produce("train_samples")

    waited: dict = {}

    def on_step(s: dict, run_dir: Path) -> None:
        if int(s["step"]) == 1:
            for name in AT_STEP_1:
                injected.produce(name)
        if int(s["step"]) == 2:
            # the run still needs step 3, so every stage is up; the launcher waits here
            # while the stages (their own processes) go on
            t0, deadline = time.monotonic(), time.monotonic() + WAIT_S
            while (todo := injected.missing(run_dir, epoch0)) and time.monotonic() < deadline:
                time.sleep(2.0)
            waited.update(seconds=round(time.monotonic() - t0, 1), missing=todo)

    lines: list[str] = []
    t0 = time.monotonic()
    s = train(recipe, say=lines.append, on_step=on_step, timeout_s=400)
    run_s = time.monotonic() - t0
    detail = json.dumps(s, default=str)[:2000] + "\n" + "\n".join(lines[-20:])
    assert waited and waited["missing"] == [], (waited, detail)

    # the run went on and its books balance
    assert s["steps"] == 3, detail
    assert s["balanced"] and s["unaccounted"] == 0 and s["unknown"] == 0, detail
    assert s["trained"] + s["stale"] + s["filtered"] + s["errors"] == s["sampled"] > 0, detail

    def anon(text: str) -> str:
        return text.replace(run, "<run>").replace(dataset, "<x>")

    outcome = "run went on: 3/3 steps, books balance"
    summary = (f"steps={s['steps']} sampled={s['sampled']} trained={s['trained']} "
               f"stale={s['stale']} filtered={s['filtered']} errors={s['errors']} "
               f"unaccounted={s['unaccounted']}")

    # every bad message: in <topic>.errors once per consumer group that read it
    for topic, sent in injected.sent.items():
        name = injected.names[topic]
        if name == "weights":
            continue
        got = injected.errors(topic)
        for i, (what, offset) in enumerate(sent):
            counts = []
            for stage in sorted(READERS[name]):
                records = got[(offset, stage)]
                for e in records:  # the rollout stage reads its prompts again each epoch
                    assert e["source_topic"] == topic, e
                    assert f"{topic}[0]@{offset}: " in e["error"], e["error"]
                    assert e["key"] == f"bad-{i}".encode(), e
                    want = REASONS.get(what) or f"got a '{WRONG[name]}' batch"
                    assert want in e["error"] and "expected" in e["error"], e["error"]
                counts.append(stage.removesuffix("/decode") +
                              (f" x{len(records)}" if len(records) > 1 else ""))
            when = "at step 1" if name in AT_STEP_1 else "before the run"
            where = (f"{topics.errors_topic(anon(topic))} by {', '.join(counts)}: "
                     f"{_short(anon(records[0]['error']), 130)}")
            table.append((f"{what} onto {anon(topic)} ({when})", where, outcome))
    # <run>.weights is read group-less by each announcement reader: logged and skipped
    wtopic = topics.run_topic(run, topics.WEIGHTS)
    logged = injected.weight_log_lines(Path(s["run_dir"]))
    for what, offset in injected.sent[wtopic]:
        line = logged[offset]
        assert "expected a 'weights' batch" in line, line
        assert WEIGHT_REASONS[what] in line, line
        where = ("not routed (group-less readers): rollout-0.log: "
                 f"{_short(anon(line[line.index('skipping'):]), 130)}")
        table.append((f"{what} onto <run>.weights (at step 1)", where, outcome))

    # the misbehaving reward: a row per rollout with its error; the others have values
    rewards = [r for r in read_table(cfg, topics.run_topic(run, topics.REWARDS)).to_pylist()
               if r["reward_name"] in ("parity", "misbehave")]
    parity = [r for r in rewards if r["reward_name"] == "parity"]
    assert parity and all(r["error"] is None and r["value"] in (0.0, 1.0) for r in parity)
    by_label: dict[str, list[dict]] = {}
    for r in rewards:
        if r["reward_name"] == "misbehave":
            by_label.setdefault(label_of[r["rollout_id"].split(":")[0]], []).append(r)
    assert set(by_label) == {"ok", *MISBEHAVIOURS}, sorted(by_label)
    want = {"raise": ["RuntimeError: misbehaving_reward raises on purpose"],
            "nan": ["reward value nan is not finite"],
            "sleep": [("timeout: the reward call on 1 row(s) ran past "
                       f"timeout_s={MISBEHAVE_TIMEOUT_S} (worker killed and replaced)")],
            "memory": ["memory limit (", "MemoryError"]}
    for label, rows in sorted(by_label.items()):
        if label == "ok":
            assert all(r["error"] is None and r["value"] in (0.0, 1.0) for r in rows), rows
            table.append((f"misbehave reward, {len(rows)} rows labelled ok",
                          "<run>.rewards: values, error null", outcome))
            continue
        assert len(rows) >= recipe.rollout.group_size, (label, rows)
        for r in rows:
            assert r["value"] is None and all(w in r["error"] for w in want[label]), r
        table.append((f"misbehave reward, {len(rows)} rows labelled {label}",
                      f"<run>.rewards rows, value null, error: {_short(rows[0]['error'], 110)}",
                      outcome))
    failed, total = read_reward_errors(cfg, topics.run_topic(run, topics.REWARDS))
    assert total == sum(len(v) for k, v in by_label.items() if k != "ok")
    assert {f["stage"] for f in failed} == {"reward.misbehave"}
    # weight 0: scored and on <run>.rewards, but no part of any trained sample's reward (the
    # injected train_samples batch under an unknown header is no row of the topic either)
    samples = read_table(cfg, topics.run_topic(run, topics.TRAIN_SAMPLES)).to_pylist()
    assert samples and all([n for n, _ in r["reward_components"]] == ["parity"] for r in samples)
    what = "the live run (tiny recipe, trainer.steps=3, rewards: parity, misbehave weight 0)"
    table.append((what, f"summary: {summary}", f"balanced={s['balanced']}"))
    print(f"\nlive run {run}: {run_s:.0f} s (waited {waited['seconds']} s at step 2 for every "
          f"bad message and score to land); {summary}")


def test_a_reward_that_fails_its_warm_up_fails_the_run_at_once_without_restarts(
        broker, local_ray, tmp_path):
    """It would fail the same way every time: the run ends at the first failure, naming the
    reward and what it must return, instead of after max_restarts restarts."""
    import time

    from relax.infra.control.launch import RunFailed, train
    from testdata import tiny_recipe

    run = "warm" + uuid.uuid4().hex[:6]
    recipe = tiny_recipe(broker, tmp_path, run,
                         'rewards=[{name: parity, fn: "testdata:per_row_reward"}]')
    t0 = time.monotonic()
    with pytest.raises(RunFailed) as e:
        train(recipe, say=lambda _: None, timeout_s=300)
    msg = str(e.value)
    assert "stage reward.parity cannot run as configured (not restarted)" in msg, msg
    assert "returned 1.0 for an empty batch; expected []" in msg, msg
    state = json.loads((tmp_path / run / "stages.json").read_text())["reward.parity"]
    assert state["restarts"] == 0 and "cannot run" in state["history"][-1], state
    assert time.monotonic() - t0 < 120


# ------------------------------------------------------------------ archive, replay, publish
# (relax archive / replay / publish on bad input, through the CLI: the exit code is the point)


def _cli(*args: str):
    from typer.testing import CliRunner

    from relax.infra.cli.app import app

    return CliRunner().invoke(app, list(args))


def _rollout_message(group: str, null_rollout_id: bool = False) -> bytes:
    """One ``rollouts`` message value: the 2 rows of ``group`` (the second one's
    rollout_id null, a non-nullable column, if ``null_rollout_id``)."""
    rows = rollout_rows(2, group_size=2, tokens=4)
    for r in rows:
        r["group_id"], r["rollout_id"] = group, f"{group}/{r['sample_index']}"
    if null_rollout_id:
        rows[1]["rollout_id"] = None
    return encode(pa.RecordBatch.from_pylist(rows, schema=SCHEMAS["rollouts"]))


def test_archive_routes_a_malformed_message_to_its_error_file_and_replay_says_so(
        broker, unique, tmp_path, table):
    import base64

    from relax.producers.archive import ERRORS_FILE, iter_archive, read_errors

    cfg = BusConfig(bootstrap_servers=broker)
    topic = topics.run_topic(unique, topics.ROLLOUTS)
    ensure_topics(cfg, {topic: 1})
    own = [("relax-schema", b"rollouts")]
    sent = [("g0", _rollout_message("g0"), own),
            ("a null rollout_id", _rollout_message("bad", null_rollout_id=True), own),
            ("g1", _rollout_message("g1"), own),
            ("non-Arrow bytes", b"\x00\x01 not Arrow", own),
            ("g2", _rollout_message("g2"), own)]
    offsets = _produce(cfg, topic, sent)
    out = tmp_path / "archive"
    res = _cli("archive", "--run", unique, "--out", str(out), "--bootstrap", broker)
    assert res.exit_code == 0, res.output
    last = res.stdout.strip().splitlines()[-1]
    assert last.startswith("archived rows=6 messages=3 files=1 errors=2 "), last
    assert f"2 messages could not be archived: see {out / ERRORS_FILE}" in res.stderr

    archived = pa.concat_tables(list(iter_archive(out, topic)))
    assert archived.column("rollout_id").to_pylist() == [
        f"{g}/{i}" for g in ("g0", "g1", "g2") for i in (0, 1)]
    assert set(archived.column("_offset").to_pylist()) == {offsets[0], offsets[2], offsets[4]}
    errs = read_errors(out)
    assert [(e["topic"], e["partition"], e["offset"]) for e in errs] == \
        [(topic, 0, offsets[1]), (topic, 0, offsets[3])]
    assert "cannot be stored as 'rollouts'" in errs[0]["reason"] and \
        "Column 'rollout_id' is declared non-nullable but contains nulls" in errs[0]["reason"]
    assert errs[1]["reason"].startswith("does not decode: DecodeError: not an Arrow IPC stream")
    for e, (_, value, _) in zip(errs, [sent[1], sent[3]]):
        assert base64.b64decode(e["value"]) == value and e["value_bytes"] == len(value)
        assert base64.b64decode(e["key"]) == b"bad-%d" % offsets.index(e["offset"])
    what = f"{topic}@{offsets[1]}: a null rollout_id (non-nullable), among 4 other messages"
    table.append((what, f"archive's {ERRORS_FILE}: {_short(errs[0]['reason'])}",
                  f"relax archive exit 0: {last.rsplit(' seconds=', 1)[0]}"))

    with open(out / ERRORS_FILE, "a") as f:  # a pass that died before its manifest
        f.write(json.dumps({**errs[0], "offset": 99}) + "\n")
    again = _cli("archive", "--run", unique, "--out", str(out), "--bootstrap", broker)
    assert again.exit_code == 0 and " errors=0 " in again.stdout, again.output
    assert read_errors(out) == errs  # each bad message listed once

    new = unique + "r"
    rep = _cli("replay", str(out), "--run", new, "--bootstrap", broker)
    assert rep.exit_code == 0, rep.output
    assert "left out 2 messages the archive could not hold" in rep.stderr, rep.stderr
    assert " left_out=2 " in rep.stdout and rep.stdout.startswith("replayed rows=6 messages=3 ")
    assert read_table(cfg, topics.run_topic(new, topics.ROLLOUTS)).num_rows == 6
    table.append(("relax replay of that archive", f"{new}.rollouts: the 6 good rows",
                  _short(rep.stderr.strip().splitlines()[-1])))


def test_replay_twice_into_one_run_refuses_unless_append(broker, unique, tmp_path, table):
    from testdata import produce_run

    from relax.producers.archive import archive_run

    cfg = BusConfig(bootstrap_servers=broker)
    written = produce_run(cfg, unique, steps=1)
    out = tmp_path / "archive"
    archive_run(cfg, unique, out)
    new = unique + "r"
    rollouts = topics.run_topic(new, topics.ROLLOUTS)
    first = _cli("replay", str(out), "--run", new, "--bootstrap", broker)
    assert first.exit_code == 0, first.output
    n = written[topics.run_topic(unique, topics.ROLLOUTS)]
    assert read_table(cfg, rollouts).num_rows == n

    second = _cli("replay", str(out), "--run", new, "--bootstrap", broker)
    assert second.exit_code == 2, second.output
    assert not second.stdout and second.stderr.count("\n") == 1, second.output
    holding = sorted(t for t, rows in written.items() if rows)
    first_topic = new + holding[0][len(unique):]
    rows = written[holding[0]]
    assert second.stderr.startswith(
        f"error: topic {first_topic} already holds {rows} rows (and {len(holding) - 1} more of "
        "the run's topics hold rows)"), second.stderr
    assert "pass --append to add them anyway" in second.stderr
    assert read_table(cfg, rollouts).num_rows == n  # nothing sent
    table.append((f"relax replay of one archive into {new} a second time",
                  "refused before sending: exit 2", _short(second.stderr.strip(), 160)))

    third = _cli("replay", str(out), "--run", new, "--append", "--bootstrap", broker)
    assert third.exit_code == 0, third.output
    assert read_table(cfg, rollouts).num_rows == 2 * n
    table.append(("... with --append", f"{rollouts}: {2 * n} rows (twice {n})", "exit 0"))


@pytest.mark.parametrize("content", [b"", b"\n\n  \n"], ids=["empty", "blank-lines"])
def test_publish_of_a_source_with_no_rows_exits_1(broker, unique, tmp_path, table, content):
    src = tmp_path / "empty.jsonl"
    src.write_bytes(content)
    topic = f"prompts.{unique}"
    res = _cli("publish", str(src), "--topic", topic, "--bootstrap", broker)
    assert res.exit_code == 1, res.output
    assert not res.stdout.strip(), res.output
    last = res.stderr.strip().splitlines()[-1]
    assert last == f"error: {src} held no rows (an empty file or data set); nothing was published"
    cfg = BusConfig(bootstrap_servers=broker)
    assert topic_partitions(cfg, [topic, topics.errors_topic(topic)]) == {}  # nothing made
    table.append((f"relax publish of a file holding {content!r}", "nowhere, no topic made",
                  f"exit 1: {_short(last.replace(str(tmp_path), '<tmp>'))}"))


# ------------------------------------------------------------------ a reward that fails every row
# (issue 52: a run whose counted reward fails every row ends at once, in one line, exit 1)

FAIL_EVERY_ROW = {
    "raise": ("", (), "ValueError: failing_reward raises on purpose"),
    "yes": ("", (), "reward value 'yes' is not a number"),
    "hang": (", max_records: 1, workers: 2", ("stuck.failed_groups=2",),
             "timeout: the reward call on 1 row(s) ran past timeout_s=1.0 (worker killed"),
}
"""``testdata.failing_reward``'s ``how`` -> more keys of the reward, the run's extra
overrides, and the first error the line names. A hanging row costs ``timeout_s`` and a
new worker, alone after its call failed (5 to 10 s on 2 busy cores), and a poll's counts
come when all its rows are done: polls of one message, 2 workers, and 2 groups (8 rows)
rather than the default 16. (A poll of many hanging rows writes nothing for minutes: the
``stuck.unscored_s`` test below.)"""
FAIL_WITHIN_S = 90.0
"""Longest time from the run's first metric (its stages are up) to the exit (seconds)."""


@pytest.mark.parametrize("how", list(FAIL_EVERY_ROW))
def test_a_reward_that_fails_every_row_ends_the_run_in_one_line(broker, tmp_path, table, how):
    import re

    from typer.testing import CliRunner

    from relax.infra.cli.app import app

    keys, extra, first = FAIL_EVERY_ROW[how]
    run = f"fail{how}" + uuid.uuid4().hex[:6]
    reward = ('rewards=[{name: bad, fn: "testdata:failing_reward", timeout_s: 1, '
              f'options: {{how: "{how}"}}{keys}}}]')  # quoted: YAML reads a bare yes as true
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "tiny_ci.yaml"
    t0 = time.monotonic()
    res = CliRunner().invoke(app, ["train", str(recipe), f"bootstrap_servers={broker}",
                                   f"run_root={tmp_path}", f"run={run}", reward, *extra,
                                   "--timeout-s", "300"])
    took = time.monotonic() - t0
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), (res.output,
                                                                          res.exception)
    err = res.stderr.strip()
    assert err.count("\n") == 0, err  # one line
    groups = 2 if extra else 16
    m = re.fullmatch(rf"error: run {run}: reward 'bad' failed 100% of its rows in the last "
                     rf"(\d+) groups \((\d+)/(\d+)\); first: (.*); the run cannot train "
                     rf"\(at step 0 of 3; `relax errors {run}\.rewards` lists the failed "
                     rf"rows\)", err)
    assert m, err
    n, failed, rows = int(m[1]), int(m[2]), int(m[3])
    assert failed == rows >= groups * 4 and n == rows // 4 and n >= groups, err
    assert m[4].startswith(first), err
    metrics = read_table(BusConfig(bootstrap_servers=broker), topics.run_topic(run, topics.METRICS))
    up_s = time.time() - min(metrics.column("ts").to_pylist()).timestamp()
    assert up_s < FAIL_WITHIN_S, (up_s, err)
    assert "step " not in res.stdout  # it never trained
    table.append((f"a counted reward that fails every row ({how}), tiny run",
                  _short(err.replace(run, "<run>"), 150),
                  f"relax train exit 1 after {took:.0f} s ({up_s:.0f} s from its first metric)"))


def test_a_reward_that_fails_some_rows_does_not_end_the_run(broker, tmp_path, table):
    """About 30 % of the counted reward's rows fail ("yes"), with the check on the last 2
    groups only: those rollouts are dropped, the others train, the run ends."""
    from relax.infra.control.launch import train

    run = "failsome" + uuid.uuid4().hex[:6]
    reward = ('rewards=[{name: flaky, fn: "testdata:failing_reward", '
              'options: {how: some}}]')
    recipe = tiny_recipe(broker, tmp_path, run, reward, "stuck.failed_groups=2",
                         "trainer.steps=6")  # 12 groups or more: past the window
    s = train(recipe, say=lambda _: None, timeout_s=400)
    assert s["steps"] == 6 and s["balanced"], s
    rows = read_table(BusConfig(bootstrap_servers=broker),
                      topics.run_topic(run, topics.REWARDS)).to_pylist()
    failed = [r for r in rows if r["error"] is not None]
    assert len(rows) >= 8 * recipe.rollout.group_size, len(rows)  # past the 2-group window
    assert 0.1 < len(failed) / len(rows) < 0.6, (len(failed), len(rows))
    assert all("reward value 'yes' is not a number" in r["error"] for r in failed)
    assert s["errors"] > 0 and s["trained"] > 0, s  # dropped as error_reward; the rest trained
    what = (f"a counted reward that fails {len(failed)} of {len(rows)} rows, tiny run "
            "(stuck.failed_groups=2)")
    table.append((what, "those rollouts dropped (error_reward)",
                  f"run went on: 6/6 steps, trained={s['trained']} errors={s['errors']}"))


def test_a_reward_that_hangs_in_its_first_poll_ends_the_run_after_unscored_s(
        broker, tmp_path, table):
    """A hanging reward with a long timeout_s writes no count for minutes (its first poll:
    the call, then each row alone, each ``timeout_s``): the groups that wait for it end
    the run after ``stuck.unscored_s``, in one line."""
    import re

    from typer.testing import CliRunner

    from relax.infra.cli.app import app

    run = "failwait" + uuid.uuid4().hex[:6]
    reward = ('rewards=[{name: bad, fn: "testdata:failing_reward", timeout_s: 20, '
              'options: {how: hang}}]')
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "tiny_ci.yaml"
    t0 = time.monotonic()
    res = CliRunner().invoke(app, ["train", str(recipe), f"bootstrap_servers={broker}",
                                   f"run_root={tmp_path}", f"run={run}", reward,
                                   "stuck.unscored_s=20", "stuck.failed_groups=null",
                                   "--timeout-s", "300"])
    took = time.monotonic() - t0
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), (res.output,
                                                                          res.exception)
    err = res.stderr.strip()
    assert err.count("\n") == 0, err
    m = re.fullmatch(rf"error: run {run}: reward 'bad' scored no row for (\d+)s while groups "
                     r"sampled after its last scored row waited; it wrote no row since \(a "
                     r"call may take timeout_s=20s, then each row alone as long\); the run "
                     rf"cannot train \(at step 0 of 3; `relax errors {run}\.rewards` lists "
                     r"the failed rows\)", err)
    assert m and 20 <= int(m[1]) < 40, err
    metrics = read_table(BusConfig(bootstrap_servers=broker), topics.run_topic(run, topics.METRICS))
    up_s = time.time() - min(metrics.column("ts").to_pylist()).timestamp()
    assert up_s < FAIL_WITHIN_S, (up_s, err)
    table.append(("a counted reward that hangs (timeout_s 20, stuck.unscored_s 20), tiny run",
                  _short(err.replace(run, "<run>"), 150),
                  f"relax train exit 1 after {took:.0f} s ({up_s:.0f} s from its first metric)"))
