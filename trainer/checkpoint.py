"""Trainer checkpoints: model, optimizer, progress and ledger, written atomically.

Layout: ``<run_dir>/checkpoints/step_<policy_version:06d>/`` holding the model
(HF safetensors + config), ``optimizer.pt``, ``critic/`` (PPO's critic, when on),
``trainer_state.json`` (policy_version, input positions per partition, counters) and
``ledger.parquet``. A checkpoint is
written into a temporary folder and renamed into place, so a crash never leaves a
half-written one; only after the rename does the trainer commit its input offsets
(docs/architecture.md, section 3). The newest ``keep`` checkpoints are kept.

With a store (``trainer.checkpoint_store``: a folder or a ``pyarrow.fs`` URI,
:mod:`relax.streams.fsuri`) a checkpoint is built in the local temporary folder and then
uploaded to ``<store>/step_<policy_version:06d>/``, ``trainer_state.json`` last: a
checkpoint without it is incomplete and is never read (an object store has no rename).
Nothing stays on the trainer's disk, so a trainer restarted on another host, and the
driver's summary on its own host, read the same checkpoints: :func:`latest` downloads
the newest into ``<run_dir>/checkpoints/store/`` (``store-part/`` for some files only).
"""

from __future__ import annotations

import json
import shutil
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from relax.streams.fsuri import child_uri, open_uri, public_uri
from relax.trainer.ledger import Ledger

STATE_FILE = "trainer_state.json"
FINAL_MODEL = "final_model"
CRITIC_DIR = "critic"
"""PPO's critic (weights and optimizer state) in a checkpoint, and next to the final model."""


@dataclass
class TrainerState:
    """Progress saved with a checkpoint.

    Attributes:
        policy_version: optimizer steps applied.
        offsets: ``{topic: {partition: next offset to read}}`` of the trainer's input.
        counters: free-form cumulative counters (groups consumed, samples, seconds).
        metrics: the trainer's metric row of the step that reached ``policy_version``
            as it stood when the checkpoint was saved (its timings up to then): a
            trainer that resumes from the checkpoint writes it again, since a crash
            between the checkpoint and that row's flush would lose the step's metrics
            (a CI chaos run counted 7 of 8 steps so).
    """

    policy_version: int
    offsets: dict[str, dict[str, int]] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


def checkpoints_dir(run_dir: Path) -> Path:
    """``<run_dir>/checkpoints``."""
    return Path(run_dir) / "checkpoints"


def save(run_dir: Path, backend, state: TrainerState, ledger: Ledger, keep: int = 2,
         store: str | None = None, critic=None) -> Path | str:
    """Write a checkpoint for ``state.policy_version`` into ``<run_dir>/checkpoints`` or,
    with ``store``, upload it there; keep the newest ``keep``. With ``critic`` (a
    :class:`relax.trainer.critic.Critic`) its weights and optimizer state go in
    ``critic/``.

    Returns:
        the checkpoint's folder (local) or its URI (store, without credentials).

    Raises:
        OSError: the store refused a write (pyarrow's error, with the path).
    """
    root = checkpoints_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{state.policy_version:06d}"
    tmp = root / f".tmp-{final.name}-{uuid.uuid4().hex[:6]}"
    backend.save(tmp)
    if critic is not None:
        critic.save(tmp / CRITIC_DIR)
    ledger.save(tmp / "ledger.parquet")
    marker = json.dumps(asdict(state))
    if store is not None:
        try:
            return _upload(tmp, store, final.name, marker, keep)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    (tmp / STATE_FILE).write_text(marker)
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    for old in sorted(root.glob("step_*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _upload(folder: Path, store: str, name: str, marker: str, keep: int) -> str:
    """``folder``'s files to ``<store>/<name>/``, then :data:`STATE_FILE` (``marker``);
    delete all but the newest ``keep`` complete checkpoints there."""
    uri = upload_folder(folder, store, name)
    fs, base = open_uri(store)
    with fs.open_output_stream(f"{base}/{name}/{STATE_FILE}") as f:
        f.write(marker.encode())
    for old in _complete(fs, base)[:-keep]:
        fs.delete_dir(f"{base}/{old}")
    return uri


def _complete(fs, base: str) -> list[str]:
    """Names of the complete checkpoints under ``base`` (``step_*`` with a state file),
    oldest first."""
    import pyarrow.fs as pafs

    if fs.get_file_info(base).type == pafs.FileType.NotFound:
        return []
    names = sorted(i.base_name for i in fs.get_file_info(pafs.FileSelector(base))
                   if i.type == pafs.FileType.Directory and i.base_name.startswith("step_"))
    return [n for n in names
            if fs.get_file_info(f"{base}/{n}/{STATE_FILE}").type == pafs.FileType.File]


def latest(run_dir: Path, store: str | None = None,
           files: tuple[str, ...] | None = None) -> Path | None:
    """The newest complete checkpoint folder, or None. With ``store``: the newest one
    there, downloaded (only ``files`` of it when given) into
    ``<run_dir>/checkpoints/store[-part]/<name>``.

    Raises:
        OSError: the store cannot be read.
    """
    if store is not None:
        fs, base = open_uri(store)
        names = _complete(fs, base)
        if not names:
            return None
        into = checkpoints_dir(run_dir) / ("store" if files is None else "store-part") / names[-1]
        return download(store, names[-1], into, files)
    root = checkpoints_dir(run_dir)
    done = sorted(p for p in root.glob("step_*") if (p / STATE_FILE).exists()) \
        if root.exists() else []
    return done[-1] if done else None


def upload_folder(folder: Path, store: str, name: str) -> str:
    """Copy local ``folder`` to ``<store>/<name>/`` (replacing what was there); returns
    its URI without credentials. For the final model.

    Raises:
        OSError: the store refused a write.
    """
    import pyarrow.fs as pafs

    fs, base = open_uri(store)
    dest = f"{base}/{name}"
    if fs.get_file_info(dest).type != pafs.FileType.NotFound:
        fs.delete_dir(dest)
    fs.create_dir(dest, recursive=True)
    pafs.copy_files(str(Path(folder).resolve()), dest, source_filesystem=pafs.LocalFileSystem(),
                    destination_filesystem=fs)
    return child_uri(public_uri(store), name)


def download(store: str, name: str, into: Path,
             files: tuple[str, ...] | None = None) -> Path | None:
    """``<store>/<name>/`` (only ``files`` of it when given) into local folder ``into``
    (replaced); None when the store has no ``name``.

    Raises:
        OSError: the store cannot be read.
    """
    import pyarrow.fs as pafs

    fs, base = open_uri(store)
    src = f"{base}/{name}"
    if fs.get_file_info(src).type == pafs.FileType.NotFound:
        return None
    into = Path(into)
    if into.exists():
        shutil.rmtree(into)
    into.mkdir(parents=True)
    local = pafs.LocalFileSystem()
    if files is None:
        pafs.copy_files(src, str(into.resolve()), source_filesystem=fs,
                        destination_filesystem=local)
    else:
        for f in files:
            pafs.copy_files(f"{src}/{f}", str((into / f).resolve()), source_filesystem=fs,
                            destination_filesystem=local)
    return into


def load(folder: Path, backend, critic=None) -> tuple[TrainerState, Ledger]:
    """Restore the back end (and ``critic``, from ``critic/``) from ``folder``; returns the
    saved state and ledger.

    Raises:
        FileNotFoundError: ``critic`` is given and the checkpoint has none."""
    backend.load(folder)
    if critic is not None:
        critic.load(folder / CRITIC_DIR)
    state = TrainerState(**json.loads((folder / STATE_FILE).read_text()))
    return state, Ledger.load(folder / "ledger.parquet")
