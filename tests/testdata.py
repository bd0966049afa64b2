"""Test helper: valid rollout rows (importable from tests via conftest's rootdir)."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from relax.schemas.metric_names import REWARD_WEIGHT_PREFIX, STALENESS_HIST_PREFIX


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


# --- rows of every per-run topic (archive/replay, monitor and dashboard tests) ---


def alternating_rewards(rollouts: list[dict], name: str = "gsm8k") -> list[dict]:
    """``rewards`` rows (via :func:`reward_rows`): 1.0 for even sample_index, else 0.0."""
    return reward_rows(rollouts, name, [1.0 if r["sample_index"] % 2 == 0 else 0.0
                                        for r in rollouts])


def ref_logprob_rows(rollouts: list[dict]) -> list[dict]:
    """One valid ``ref_logprobs`` row per rollout (same length as its response_ids)."""
    return [dict(rollout_id=r["rollout_id"], group_id=r["group_id"],
                 ref_logprobs=[-0.5] * len(r["response_ids"]), ref_policy_version=0)
            for r in rollouts]


def train_sample_rows(rollouts: list[dict], rewards: list[dict]) -> list[dict]:
    """One valid ``train_samples`` row per rollout, its reward from ``rewards`` (same order)."""
    out = []
    for r, w in zip(rollouts, rewards):
        n = len(r["response_ids"])
        out.append(dict(
            rollout_id=r["rollout_id"], group_id=r["group_id"], prompt_id=r["prompt_id"],
            dataset=r["dataset"], sample_index=r["sample_index"], group_size=r["group_size"],
            prompt_ids=r["prompt_ids"], response_ids=r["response_ids"], loss_mask=r["loss_mask"],
            logprobs=r["logprobs"], ref_logprobs=[-0.5] * n,
            advantages=[w["value"] - 0.5] * n, reward=w["value"],
            reward_components=[(w["reward_name"], w["value"])], token_policy_versions=None,
            policy_version_start=r["policy_version_start"],
            policy_version_end=r["policy_version_end"], finish_reason=r["finish_reason"],
            temperature=1.0, top_p=1.0, top_k=0, drop_reason=None, finished_at=0))
    return out


def weight_rows(policy_version: int) -> list[dict]:
    """One valid ``weights`` announcement (two tensors, checkpoint transport)."""
    manifest = [dict(name="w", shape=[4, 4], dtype="float32", offset=0, nbytes=64),
                dict(name="b", shape=[4], dtype="float32", offset=64, nbytes=16)]
    return [dict(policy_version=policy_version, manifest=manifest, total_bytes=80,
                 bucket_bytes=1 << 20, checksum="sha256:00", transport="checkpoint",
                 rendezvous=None, group_name="relax-weights",
                 checkpoint_uri=f"/tmp/ckpt/{policy_version}", published_at=0)]


def trainer_metric_rows(policy_version: int, reward_mean: float, accuracy: float,
                        staleness_counts: dict[int, int], step_s: float = 2.0,
                        data_wait_s: float = 0.5, ts_ms: int = 0) -> list[dict]:
    """The ``metrics`` rows the trainer writes for one optimizer step (names from
    ``relax.schemas.metric_names``)."""
    from relax.schemas import metric_names as mn

    values = {mn.STEP_S: step_s, mn.DATA_WAIT_S: data_wait_s, mn.TRAIN_S: step_s - data_wait_s,
              mn.LOSS: 0.1, mn.REWARD_MEAN: reward_mean, mn.ACCURACY: accuracy,
              mn.SAMPLES_TRAINED: sum(staleness_counts.values()),
              mn.BUSY_FRAC: 1.0 - data_wait_s / step_s}
    values.update({mn.staleness_hist_name(k): v for k, v in staleness_counts.items()})
    return [dict(ts=ts_ms, component="trainer", name=k, value=float(v),
                 policy_version=policy_version) for k, v in values.items()]


def produce_run(cfg, run: str, steps: int = 3, groups_per_step: int = 2, group_size: int = 4,
                partitions: int = 2) -> dict[str, int]:
    """Write a short synthetic run onto the bus: for each step, rollouts (policy_version
    = step), rewards, ref and teacher logprobs, train_samples, a weights announcement and trainer
    metrics, then a reward change (attach ``format`` after the last step) and one error
    record in ``<run>.rollouts.errors``. Creates every per-run
    topic (``partitions`` each, errors topics 1). Returns ``{topic: rows written}``."""
    import pyarrow as pa

    from relax.schemas import SCHEMAS, topics, validate
    from relax.streams.client import ensure_topics
    from relax.streams.errors import error_row
    from relax.streams.producer import BatchProducer

    names = {n: topics.run_topic(run, n) for n in topics.RUN_TOPICS}
    ensure_topics(cfg, {**{t: partitions for t in names.values()},
                        **{topics.errors_topic(t): 1 for t in names.values()}})
    p = BatchProducer(cfg, producer_id=f"synthetic-{run}")
    written: dict[str, int] = {}

    def send(name: str, rows: list[dict]) -> None:
        batch = pa.RecordBatch.from_pylist(rows, schema=SCHEMAS[name])
        validate(batch, name)
        p.send(names[name], batch, key=b"trainer" if name == "progress" else None)
        written[names[name]] = written.get(names[name], 0) + len(rows)

    for step in range(steps):
        rolls = rollout_rows(groups_per_step * group_size, group_size=group_size, tokens=8,
                             policy_version=step)
        for r in rolls:  # distinct groups per step
            r["group_id"] = f"s{step}-{r['group_id']}"
            r["rollout_id"] = f"{r['group_id']}/{r['sample_index']}"
        rews = alternating_rewards(rolls)
        send("rollouts", rolls)
        send("rewards", rews)
        send("ref_logprobs", ref_logprob_rows(rolls))
        send("teacher_logprobs", [dict(rollout_id=r["rollout_id"], group_id=r["group_id"],
                                       teacher_logprobs=[-0.75] * len(r["response_ids"]),
                                       teacher_model="teacher") for r in rolls])
        send("train_samples", train_sample_rows(rolls, rews))
        send("weights", weight_rows(step + 1))
        acc = sum(1 for w in rews if w["value"] > 0) / len(rews)
        send("metrics", trainer_metric_rows(step + 1, reward_mean=0.2 + 0.1 * step,
                                            accuracy=acc, staleness_counts={0: 6, 1: 2 + step},
                                            ts_ms=1_700_000_000_000 + step * 1000))
        send("progress", [dict(ts=1_700_000_000_000 + step * 1000, policy_version=step + 1,
                               groups_consumed=(step + 1) * groups_per_step,
                               groups_needed=(steps - step - 1) * groups_per_step)])
    send("reward_changes", [dict(ts=1_700_000_000_000, action="attach", reward_name="format",
                                 weight=0.2, from_policy_version=steps + 1)])
    p.send_errors(names["rollouts"], [error_row(
        source_topic=names["rollouts"], source_partition=0, source_offset=0, stage="test/decode",
        error="DecodeError: synthetic", key=b"s0-g0000", value=b"\x00garbage")])
    written[topics.errors_topic(names["rollouts"])] = 1
    p.flush()
    p.close()
    return written


def reward_rows(rollouts: list[dict], name: str, values: list[float | None],
                errors: list[str | None] | None = None) -> list[dict]:
    """``rewards`` rows for the given rollout rows (one value each)."""
    errors = errors or [None] * len(rollouts)
    return [dict(rollout_id=r["rollout_id"], group_id=r["group_id"], reward_name=name, value=v,
                 details="{}", error=e, elapsed_s=0.01)
            for r, v, e in zip(rollouts, values, errors)]


# --- prompts, and a scripted model/tokenizer for engine tests (rollout, engines) ---


def prompt_rows(n: int, dataset: str = "test", messages: bool = False) -> list[dict]:
    """``n`` valid ``prompts`` rows ``What is i + 1?`` with prompt_ids ``p0000, ...``."""
    return [dict(prompt_id=f"p{i:04d}", dataset=dataset, prompt=f"What is {i} + 1?",
                 messages=[{"role": "user", "content": f"What is {i} + 1?"}] if messages else None,
                 label=str(i + 1), metadata="{}", media=None, created_at=0) for i in range(n)]


class StubTokenizer:
    """A tokenizer over ``vocab`` ids: id ``i`` decodes to ``chr(ord('a') + i % 26)``;
    ``eos``/``pad`` ids as given (for masks and finish-reason tests)."""

    def __init__(self, eos: int = 2, pad: int | None = None):
        self.eos_token_id = eos
        self.pad_token_id = eos if pad is None else pad
        self.eos_token = "<eos>"

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(chr(ord("a") + int(i) % 26) for i in ids
                       if not (skip_special_tokens and int(i) == self.eos_token_id))


def scripted_lm(scripts: dict[int, list[int]] | list[int], vocab: int = 16, eos: int | None = None):
    """A causal LM (torch module) whose next token is scripted: for a prompt of length
    ``P`` (its attention-mask sum at prefill), after ``k`` sampled tokens it puts logit 30
    on ``script[k]`` (the last entry repeats), 0 elsewhere. ``scripts`` maps ``P`` -> script
    (or one script for all). Records every ``attention_mask`` it gets in ``.masks``.
    ``generation_config.eos_token_id = eos`` (e.g. an end-of-turn id). For
    :class:`relax.consumers.engines.hf.HFEngine` single-call tests."""
    from types import SimpleNamespace

    import torch

    class ScriptedLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.dummy = torch.nn.Parameter(torch.zeros(1))
            self.generation_config = SimpleNamespace(eos_token_id=eos)
            self.masks: list = []
            self._p: list[int] = []

        def forward(self, input_ids, attention_mask, position_ids, past_key_values=None,
                    use_cache=True, logits_to_keep=1):
            self.masks.append(attention_mask.clone())
            if input_ids.shape[1] > 1 or not self._p:
                self._p = attention_mask.sum(dim=1).tolist()
            logits = torch.zeros(input_ids.shape[0], 1, vocab)
            for b, pos in enumerate(position_ids[:, -1].tolist()):
                script = scripts if isinstance(scripts, list) else scripts[self._p[b]]
                k = pos + 1 - self._p[b]
                logits[b, 0, script[min(k, len(script) - 1)]] = 30.0
            return SimpleNamespace(logits=logits + 0 * self.dummy, past_key_values=past_key_values)

    return ScriptedLM()


class ScriptedEngine:
    """A rollout engine that answers each generate call with the next scripted text (+ the
    tokenizer's end-of-turn token; cut at ``max_new_tokens`` as ``length``), for every
    prompt of the call: multi-turn tests without a model."""

    def __init__(self, tokenizer, turns: list[str], version: int = 0):
        self.tokenizer, self.turns, self.calls, self.media = tokenizer, list(turns), [], []
        self.engine_id, self.policy_version = "scripted", version
        self.stop_token_ids = frozenset({tokenizer.eos_token_id})

    def generate(self, prompts, params, media=None):
        from relax.consumers.engines.base import Generation

        self.calls.append((prompts, params))
        self.media.append(media)
        text = self.turns.pop(0)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        reason = "stop" if len(ids) < params.max_new_tokens else "length"
        ids = (
            ids + [self.tokenizer.eos_token_id]
            if reason == "stop"
            else ids[: params.max_new_tokens]
        )
        return [
            Generation(
                token_ids=ids,
                logprobs=[-0.5] * len(ids),
                finish_reason=reason,
                policy_version_start=self.policy_version,
                policy_version_end=self.policy_version,
                text=self.tokenizer.decode(ids, skip_special_tokens=True),
            )
            for _ in prompts
        ]

    def update_weights(self, named_tensors, policy_version):
        raise NotImplementedError


def train_sample_table(n_groups: int, group_size: int = 4, prompt_len=(3, 6),
                       response_len=(2, 7), seed: int = 0, vocab: int = 200,
                       policy_version: int = 0):
    """A ``train_samples`` table of ``n_groups`` groups (the rows of a group share their
    prompt) with random lengths, tokens, log-probs and advantages (every row trainable)."""
    import random

    import pyarrow as pa

    from relax.schemas.v1 import TRAIN_SAMPLES

    rnd = random.Random(seed)
    rows = []
    for g in range(n_groups):
        gid = f"g{g:04d}"
        prompt = [rnd.randrange(3, vocab) for _ in range(rnd.randint(*prompt_len))]
        for i in range(group_size):
            r = rnd.randint(*response_len)
            adv = rnd.uniform(-1, 1)
            rows.append(dict(
                rollout_id=f"{gid}/{i}", group_id=gid, prompt_id=f"p{g}", dataset="test",
                sample_index=i, group_size=group_size,
                prompt_ids=list(prompt),
                response_ids=[rnd.randrange(3, vocab) for _ in range(r)],
                loss_mask=[1] * r, logprobs=[-rnd.uniform(0.5, 3) for _ in range(r)],
                ref_logprobs=None, advantages=[adv] * r, reward=float(adv > 0),
                reward_components=[("correct", float(adv > 0))], token_policy_versions=None,
                policy_version_start=policy_version, policy_version_end=policy_version,
                finish_reason="stop", temperature=1.0, top_p=1.0, top_k=0, drop_reason=None,
                finished_at=0))
    return pa.Table.from_pylist(rows, schema=TRAIN_SAMPLES)


RECIPES = __import__("pathlib").Path(__file__).resolve().parents[1] / "recipes"


def s3_uri(endpoint: str, path: str) -> str:
    """A ``pyarrow.fs`` URI of ``bucket/prefix`` on the S3 server at ``host:port`` (plain
    HTTP; the bucket is made on first write)."""
    return f"s3://{path}?endpoint_override={endpoint}&scheme=http&allow_bucket_creation=true"


def tiny_recipe(broker: str, run_root, run: str, *overrides: str):
    """recipes/tiny_ci.yaml on ``broker``, writing under ``run_root``, as run ``run``."""
    from relax.infra.recipe.recipe import load_recipe

    return load_recipe(RECIPES / "tiny_ci.yaml", [f"bootstrap_servers={broker}",
                                                  f"run_root={run_root}", f"run={run}",
                                                  PARITY_REWARD, *overrides])


def parity_reward(responses, labels, metadata, **options):
    """A test reward with variance on any text (even a random model's): 1.0 when the
    response has an even number of characters. Loaded as ``testdata:parity_reward``."""
    return [1.0 if len(r) % 2 == 0 else 0.0 for r in responses]


def per_row_reward(responses, labels, metadata, **options):
    """The usual mistake: one value for the call, not a list (fails its warm-up call)."""
    return 1.0


def bonus_reward(responses, labels, metadata, **options):
    """A test reward of 1.0 on every response (attached live by tests: a group that counts
    it with weight w has every reward raised by exactly w). Loaded as
    ``testdata:bonus_reward``."""
    return [1.0 for _ in responses]


PARITY_REWARD = 'rewards=[{name: parity, fn: "testdata:parity_reward"}]'
"""A recipe override that scores the tiny run with :func:`parity_reward` (tests put
``tests/`` on PYTHONPATH so the stage processes can import it)."""


MISBEHAVIOURS = ("raise", "nan", "sleep", "memory")
"""Labels on which :func:`misbehaving_reward` fails, each its own way."""


def misbehaving_reward(responses, labels, metadata, **options):
    """A test reward that fails on purpose, row by row, as the row's label says: ``raise``
    raises, ``nan`` returns NaN, ``sleep`` sleeps 600 s (past any ``timeout_s``: the pool
    kills the worker), ``memory`` asks for 10 GiB (past the worker's address-space limit,
    ``RLIMIT_AS``: a MemoryError at once, nothing is touched); any other label scores
    like :func:`parity_reward`. The same row fails the same way when retried alone.
    Loaded as ``testdata:misbehaving_reward``."""
    import time

    out = []
    for response, label in zip(responses, labels):
        if label == "raise":
            raise RuntimeError(f"misbehaving_reward raises on purpose (response {response!r})")
        if label == "sleep":
            time.sleep(600)
        if label == "memory":
            bytearray(10 << 30)
        out.append(float("nan") if label == "nan" else float(len(response) % 2 == 0))
    return out


FAILING_WAYS = ("raise", "yes", "hang", "some")
"""The ways :func:`failing_reward` fails rows."""


def failing_reward(responses, labels, metadata, how: str = "raise", **options):
    """A test reward that fails rows one way (option ``how``): ``raise`` raises a
    ValueError, ``yes`` returns the string "yes" for each row (not a number), ``hang``
    sleeps 600 s (past any ``timeout_s``: the pool kills the worker): every row fails.
    ``some`` returns "yes" for about 30 % of the rows (by a CRC of the response) and
    scores the others like :func:`parity_reward`. An empty batch (the pool's warm-up
    call) gets ``[]``, so the stage starts. Loaded as ``testdata:failing_reward``."""
    import time
    import zlib

    if how not in FAILING_WAYS:
        raise ValueError(f"failing_reward: how must be one of {FAILING_WAYS}, got {how!r}")
    if not responses:
        return []
    if how == "raise":
        raise ValueError(f"failing_reward raises on purpose ({len(responses)} rows)")
    if how == "hang":
        time.sleep(600)
    if how == "some":
        return ["yes" if zlib.crc32(r.encode()) % 10 < 3 else float(len(r) % 2 == 0)
                for r in responses]
    return ["yes" for _ in responses]


# --- README.md's metrics table --------------------------------------------------------

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_metric_names() -> set[str]:
    """The backquoted names in the first column of README.md's "## Metrics" table
    (``staleness_hist.<k>``, ``reward_weight.<name>`` stay patterns)."""
    text = README.read_text().split("## Metrics", 1)[1].split("\n## ", 1)[0]
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("| `"):
            names.update(re.findall(r"`([^`]+)`", line.split("|")[1]))
    return names


def documented(name: str, names: set[str]) -> bool:
    """Whether metric ``name`` is in the table (a staleness histogram bin or a reward
    weight by its pattern)."""
    if name.startswith(STALENESS_HIST_PREFIX):
        return f"{STALENESS_HIST_PREFIX}<k>" in names
    if name.startswith(REWARD_WEIGHT_PREFIX):
        return f"{REWARD_WEIGHT_PREFIX}<name>" in names
    return name in names


class PictureEnv:
    """A multi-turn test environment for image models: answers the model's first turn
    with a 64 x 64 picture (a PIL image: a square of a colour set by ``seed``) and a
    question about it; ends at the second turn with reward 1.0. Loaded as
    ``testdata:PictureEnv``."""

    def __init__(self, seed: int = 0):
        self.seed, self.turns = seed, 0

    def reset(self, prompt_row):
        return None

    def step(self, text):
        from PIL import Image, ImageDraw

        self.turns += 1
        if self.turns > 1:
            return None, True, 1.0
        img = Image.new("RGB", (64, 64), "white")
        colour = (37 * self.seed % 256, 200, 90)
        ImageDraw.Draw(img).rectangle((16, 16, 48, 48), fill=colour)
        return {"role": "user", "content": [{"type": "image", "image": img},
                                            {"type": "text", "text": "What colour is it?"}]}, \
            False, None


@contextmanager
def kill_when(ready: Callable[[], bool], pids: Callable[[], list[int]], poll_s: float = 0.02,
              sig: int = signal.SIGKILL, then: Callable[[], None] | None = None):
    """While the block runs, a thread sends ``sig`` (SIGKILL; SIGSTOP freezes) to
    ``pids()`` as soon as ``ready()`` holds (polled every ``poll_s`` seconds), then calls
    ``then()`` if given; yields the list it fills with ``(pid, UTC time of the signal)``.
    Kill tests key on a file the stage writes (a checkpoint), not on the driver's step
    events: those come seconds late, after a fast trainer's next steps."""
    killed: list[tuple[int, datetime]] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set() and not ready():
            time.sleep(poll_s)
        if not stop.is_set():
            for pid in pids():
                killed.append((pid, datetime.now(timezone.utc)))
                os.kill(pid, sig)
            if then is not None:
                then()

    killer = threading.Thread(target=watch, name="kill-when", daemon=True)
    killer.start()
    try:
        yield killed
    finally:
        stop.set()
        killer.join()


def tiny_model(family: str = "llama", layers: int = 3, **config):
    """A random fp32 causal LM of ``family`` (``llama`` or ``qwen2``) built from its
    transformers config class: the tiny trunk (``TINY_CONFIG``), ``layers`` decoder layers,
    a 256-token vocabulary (what :func:`train_sample_table` draws from), fixed seed;
    ``config`` overrides config fields."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from relax.trainer.model_store import TINY_CONFIG

    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM),
                             "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[family]
    config = config_cls(vocab_size=256, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                        **{**TINY_CONFIG, "num_hidden_layers": layers, **config})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        return model_cls(config).to(torch.float32)


def policy_grads(backend, mbs) -> tuple[float, dict]:
    """``(loss, {parameter name: gradient})`` of the micro-batches' summed policy loss
    under ``backend`` (a torch back end), as its step computes them."""
    from relax.trainer.losses.aggregate import mask_counts
    from relax.trainer.losses.registry import compute_policy_loss

    backend.optimizer.zero_grad(set_to_none=True)
    counts = [mask_counts(mb.loss_mask) for mb in mbs]
    tokens, seqs = sum(c[0] for c in counts), sum(c[1] for c in counts)
    total = 0.0
    for mb in mbs:
        lp, _ = backend.logprobs(mb)
        loss, _ = compute_policy_loss(backend.cfg.loss, lp, mb.rollout_logprobs, mb.advantages,
                                      mb.loss_mask, global_tokens=tokens, global_seqs=seqs)
        loss.backward()
        total += float(loss.detach())
    return total, {n: p.grad.clone() for n, p in backend.model.named_parameters()
                   if p.grad is not None}


def assert_on_policy(s: dict, broker: str, run: str, steps: int, batch_groups: int,
                     group_size: int) -> None:
    """A finished sync or colocated run (summary ``s``) trained strictly on-policy: the
    ledger's counts are the summary's, every trained row has staleness 0 and was sampled
    by the weights it was trained at, each version 0..steps-1 sampled at most one step's
    groups, and every version 0..steps was announced."""
    from collections import Counter

    from relax.streams.client import BusConfig
    from relax.streams.read import read_table
    from relax.trainer import checkpoint
    from relax.trainer.ledger import Ledger

    ledger = Ledger.load(checkpoint.latest(Path(s["run_dir"])) / "ledger.parquet")
    assert ledger.counts() == {"trained": s["trained"], "stale": s["stale"],
                               "filtered": s["filtered"], "error": s["errors"]}, s
    trained = {rid: (v, st) for rid, (o, v, st) in ledger.items() if o == "trained"}
    assert trained and all(st == 0 for _, st in trained.values()), trained

    bus = BusConfig(bootstrap_servers=broker)
    samples = {r["rollout_id"]: r for r in read_table(bus, f"{run}.train_samples").to_pylist()}
    assert set(trained) <= set(samples)
    for rid, (version, _) in trained.items():  # sampled with the weights it was trained at
        r = samples[rid]
        assert r["policy_version_start"] == r["policy_version_end"] == version, (rid, r, version)
    # each step's rows were sampled by the weights of the step before: versions 0..steps-1,
    # one step's groups each (a filtered row leaves its step short, never another's long)
    per_version = Counter(v for v, _ in trained.values())
    assert set(per_version) == set(range(steps)), per_version
    assert all(n <= batch_groups * group_size for n in per_version.values()), per_version
    weights = read_table(bus, f"{run}.weights").column("policy_version").to_pylist()
    assert sorted(set(weights)) == list(range(steps + 1)), weights
