"""Images and audio of a prompt: read, checked, and made ``media`` items (``relax publish``).

A record names its media in three ways:

* a column given by ``MediaOptions.fields`` (``--image-field image``), whose value is
  one item or a list of items;
* OpenAI-style chat ``messages`` whose content is a list of parts: ``{"type": "text",
  "text": ...}``, ``{"type": "image", "image": ITEM}`` (or ``{"type": "image_url",
  "image_url": {"url": ITEM}}``) and ``{"type": "audio", "audio": ITEM}`` (or
  ``{"type": "input_audio", "input_audio": {"data": ITEM}}``);

where ITEM is the bytes themselves (Parquet/``datasets`` binary, or a ``datasets``
Image/Audio value ``{"bytes": ..., "path": ...}``), a path (relative ones are taken from
the data file's folder and may not leave it) or a ``pyarrow.fs`` URI (``file://``,
``s3://``). In a message the media's place in the text is kept as :data:`MEDIA_MARK`
(``<relax:image>``, ``<relax:audio>``): the rollout turns the content back into parts in
that order, so the model's own processor renders its placeholders.

Every item is decoded before it is published, so a bad one fails its row (the row goes
to the error topic naming the field and what was wrong) and never reaches a stage:

* images (PIL): a format PIL reads, at most :data:`MAX_IMAGE_PIXELS` pixels (the size is
  read from the header, before any decoding), the whole file decodable (a truncated PNG
  fails);
* audio: WAV (PCM), at least one frame, at ``MediaOptions.audio_rate`` Hz (16 kHz is
  what Whisper-family feature extractors take; a file at another rate is refused rather
  than resampled silently).

An item of at most ``MediaOptions.inline_bytes`` travels inline (Arrow binary in the
row); a larger one goes to the blob store (:class:`~relax.streams.blobs.BlobStore`,
content-addressed) and the row keeps its URI.
"""

from __future__ import annotations

import hashlib
import io
import warnings
import wave
from dataclasses import dataclass
from pathlib import Path

from relax.schemas.media import MEDIA_MARK
from relax.streams.blobs import BlobStore

MAX_IMAGE_PIXELS = 8192 * 8192
"""Largest image accepted (pixels; 64 Mpx): a 20k x 20k image is refused from its header."""
INLINE_BYTES = 256 * 1024
"""Default: items up to this many bytes travel inline in the row."""
AUDIO_RATE = 16_000
"""Default sample rate (Hz) audio must have."""


class MediaError(ValueError):
    """One media item cannot be used (names the field and what was expected)."""


@dataclass(frozen=True)
class MediaOptions:
    """How :func:`media_items` reads a record's media.

    Attributes:
        fields: input column -> kind (``image`` or ``audio``).
        base_dir: folder that relative paths are taken from (the data file's folder);
            None: relative paths are refused.
        audio_rate: sample rate audio must have (Hz).
        inline_bytes: items up to this size travel inline; larger ones go to ``blobs``.
        blobs: the blob store for large items (None: a large item fails its row).
    """

    fields: tuple[tuple[str, str], ...] = ()
    base_dir: Path | None = None
    audio_rate: int = AUDIO_RATE
    inline_bytes: int = INLINE_BYTES
    blobs: BlobStore | None = None


def read_bytes(value, where: str, base_dir: Path | None) -> bytes:
    """The bytes of one media value (see the module docstring for the forms).

    Raises:
        MediaError: an unknown form, a missing file, or a relative path that leaves
            ``base_dir``.
    """
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, dict):
        if value.get("bytes") is not None:
            return bytes(value["bytes"])
        if value.get("path"):
            return read_bytes(value["path"], where, base_dir)
        raise MediaError(f"{where}: expected bytes, a path or a URI; got a dict with keys "
                         f"{sorted(value)} and no 'bytes' or 'path'")
    if not isinstance(value, str) or not value:
        raise MediaError(f"{where}: expected bytes, a path or a URI; got "
                         f"{type(value).__name__}")
    if "://" in value:
        from relax.streams.fsuri import open_uri

        if value.split("://", 1)[0] in ("http", "https"):
            raise MediaError(f"{where}: {value[:80]!r} is a web URL; relax does not download "
                             "media: give a path inside the data folder or a pyarrow.fs URI")
        try:
            fs, path = open_uri(value)
            with fs.open_input_stream(path) as f:
                return f.read()
        except (OSError, ValueError) as e:
            raise MediaError(f"{where}: cannot read {value[:80]!r}: {e}") from None
    path = Path(value)
    if not path.is_absolute():
        if base_dir is None:
            raise MediaError(f"{where}: relative path {value!r} but the source has no folder")
        path = (base_dir / path).resolve()
        if not path.is_relative_to(base_dir.resolve()):
            raise MediaError(f"{where}: {value!r} leaves the data folder {base_dir}")
    try:
        return path.read_bytes()
    except OSError as e:
        raise MediaError(f"{where}: cannot read {value!r}: {e.strerror or e}") from None


def check_image(data: bytes, where: str) -> str:
    """Decode an image fully; returns its MIME type.

    Raises:
        MediaError: not an image PIL reads, over :data:`MAX_IMAGE_PIXELS`, or not decodable
            to its end (a truncated file).
    """
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():  # PIL warns over 89 Mpx, raises over 179 Mpx
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))  # reads the header only
    except Image.DecompressionBombError as e:
        raise MediaError(f"{where}: image over the {MAX_IMAGE_PIXELS} pixels accepted ({e})"
                         ) from None
    except (UnidentifiedImageError, OSError) as e:
        raise MediaError(f"{where}: not an image ({len(data)} bytes): {e}") from None
    w, h = img.size
    if w * h > MAX_IMAGE_PIXELS:
        raise MediaError(f"{where}: image of {w} x {h} pixels, over the {MAX_IMAGE_PIXELS} "
                         "pixels accepted")
    try:
        img.load()
    except (OSError, SyntaxError, ValueError) as e:
        raise MediaError(f"{where}: {img.format} image of {w} x {h} does not decode: {e}"
                         ) from None
    return Image.MIME.get(img.format, "application/octet-stream")


def check_audio(data: bytes, where: str, rate: int) -> str:
    """Check a WAV (PCM) clip: at least one frame at ``rate`` Hz; returns ``audio/wav``.

    Raises:
        MediaError: not a PCM WAV file, no frame, or another sample rate.
    """
    try:
        with wave.open(io.BytesIO(data)) as w:
            frames, got = w.getnframes(), w.getframerate()
    except (wave.Error, EOFError) as e:
        raise MediaError(f"{where}: not a PCM WAV file ({len(data)} bytes): {e}; convert "
                         f"it first (e.g. ffmpeg -i IN -ar {rate} -ac 1 OUT.wav)") from None
    if frames == 0:
        raise MediaError(f"{where}: empty audio (0 frames)")
    if got != rate:
        raise MediaError(f"{where}: sample rate {got} Hz, expected {rate} Hz "
                         f"(resample first, e.g. ffmpeg -i IN -ar {rate} OUT.wav)")
    return "audio/wav"


def media_item(kind: str, data: bytes, where: str, opts: MediaOptions, turn: int = 0) -> dict:
    """One ``media`` item (:data:`relax.schemas.v1.MEDIA_ITEM`) for checked bytes.

    Raises:
        MediaError: the item fails its check, or is over ``opts.inline_bytes`` with no
            blob store.
    """
    mime = (check_image(data, where) if kind == "image"
            else check_audio(data, where, opts.audio_rate))
    if len(data) <= opts.inline_bytes:
        return {"kind": kind, "uri": None, "data": data, "mime": mime, "turn": turn}
    if opts.blobs is None:
        raise MediaError(f"{where}: {len(data)} bytes, over the {opts.inline_bytes} that "
                         "travel inline, and no blob store was given (--blobs URI)")
    return {"kind": kind, "uri": opts.blobs.put(data), "data": None, "mime": mime, "turn": turn}


def field_items(record: dict, opts: MediaOptions) -> list[dict]:
    """The media items of ``opts.fields`` in ``record`` (a column may hold one value or a
    list; a null column has none).

    Raises:
        MediaError: a missing column or a bad item (named ``field 'image' item 1``).
    """
    out = []
    for field, kind in opts.fields:
        if field not in record:
            raise MediaError(f"missing field {field!r} (the {kind} field); record has "
                             f"{sorted(record)[:10]}")
        values = record[field]
        if values is None:
            continue
        values = values if isinstance(values, list) else [values]
        for i, v in enumerate(values):
            where = f"field {field!r}" + (f" item {i}" if len(values) > 1 else "")
            out.append(media_item(kind, read_bytes(v, where, opts.base_dir), where, opts))
    return out


def _part_value(part: dict, where: str):
    """(kind, value) of a media content part, or None for a text part."""
    t = part.get("type")
    if t == "text":
        return None
    for kind, key, inner in (("image", "image", None), ("image", "image_url", "url"),
                             ("audio", "audio", None), ("audio", "input_audio", "data")):
        if t == key:
            v = part.get(key)
            if inner is not None and isinstance(v, dict):
                v = v.get(inner)
            return kind, v
    raise MediaError(f"{where}: content part type {t!r}; expected text, image, image_url, "
                     "audio or input_audio")


def message_content(parts: list, where: str, opts: MediaOptions) -> tuple[str, list[dict]]:
    """A message's content parts as (text with :data:`MEDIA_MARK` where each media part
    stood, the media items in order).

    Raises:
        MediaError: a part that is not a dict, an unknown type, or a bad item.
    """
    text, items = [], []
    for j, part in enumerate(parts):
        pw = f"{where} part {j}"
        if not isinstance(part, dict):
            raise MediaError(f"{pw}: expected a {{type: ...}} dict, got {type(part).__name__}")
        kv = _part_value(part, pw)
        if kv is None:
            if not isinstance(part.get("text"), str):
                raise MediaError(f"{pw}: a text part needs 'text' (a string)")
            text.append(part["text"])
            continue
        kind, value = kv
        items.append(media_item(kind, read_bytes(value, pw, opts.base_dir), pw, opts))
        text.append(MEDIA_MARK.format(kind=kind))
    return "".join(text), items


def media_digest(items: list[dict]) -> list[str]:
    """sha256 of each item's bytes (a blob's URI already ends with it): what makes two
    prompts with the same text and different images two prompt_ids."""
    return [it["uri"].rsplit("/", 1)[-1] if it["uri"] else hashlib.sha256(it["data"]).hexdigest()
            for it in items]


__all__ = ["AUDIO_RATE", "INLINE_BYTES", "MAX_IMAGE_PIXELS", "MediaError",
           "MediaOptions", "check_audio", "check_image", "field_items", "media_digest",
           "media_item", "message_content", "read_bytes"]
