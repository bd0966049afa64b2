"""Images, audio and video of a prompt: read, checked, and made ``media`` items
(``relax publish``).

A record names its media in three ways:

* a column given by ``MediaOptions.fields`` (``--image-field image``, ``--video-field``),
  whose value is one item or a list of items;
* OpenAI-style chat ``messages`` whose content is a list of parts: ``{"type": "text",
  "text": ...}``, ``{"type": "image", "image": ITEM}`` (or ``{"type": "image_url",
  "image_url": {"url": ITEM}}``), ``{"type": "audio", "audio": ITEM}`` (or
  ``{"type": "input_audio", "input_audio": {"data": ITEM}}``) and ``{"type": "video",
  "video": ITEM}`` (or ``{"type": "video_url", "video_url": {"url": ITEM}}``);

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
  than resampled silently);
* video (PyAV, :func:`check_video`): an MP4/MOV, Matroska/WebM or AVI container
  (:data:`VIDEO_CONTAINERS`) with one video stream in a codec of :data:`VIDEO_CODECS`,
  frames of at most :data:`MAX_VIDEO_PIXELS` (from the header), at most
  :data:`MAX_VIDEO_FPS` frames/s and :data:`MAX_VIDEO_SECONDS` s, every frame decodable
  and as many as the header announces (frames, or else a duration to within 1.5
  frames: a truncated file fails). Frames are then sampled
  by :func:`sample_frames` (``MediaOptions.video_fps``, ``video_max_frames``) and the item
  stores those frames and their timestamps, not the clip (the format is in
  :mod:`relax.schemas.media`).

An item of at most ``MediaOptions.inline_bytes`` travels inline (Arrow binary in the
row); a larger one goes to the blob store (:class:`~relax.streams.blobs.BlobStore`,
content-addressed) and the row keeps its URI.
"""

from __future__ import annotations

import hashlib
import io
import itertools
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
VIDEO_CONTAINERS = {"mov,mp4,m4a,3gp,3g2,mj2": "mp4/mov", "matroska,webm": "mkv/webm",
                    "avi": "avi"}
"""FFmpeg demuxer names accepted for video -> what the error message calls them."""
VIDEO_CODECS = ("h264", "hevc", "vp8", "vp9", "av1", "mpeg4", "mjpeg")
"""Video codecs accepted (FFmpeg decoder names)."""
MAX_VIDEO_PIXELS = 4096 * 4096
"""Largest video frame accepted (pixels), read from the stream header."""
MAX_VIDEO_FPS = 240.0
"""Highest frame rate accepted (frames/s)."""
MAX_VIDEO_SECONDS = 600.0
"""Longest clip accepted (seconds)."""
VIDEO_FPS = 2.0
"""Default sampling rate: frames taken per second of video."""
VIDEO_MAX_FRAMES = 32
"""Default most frames taken from one video."""


class MediaError(ValueError):
    """One media item cannot be used (names the field and what was expected)."""


@dataclass(frozen=True)
class MediaOptions:
    """How :func:`media_items` reads a record's media.

    Attributes:
        fields: input column -> kind (``image``, ``audio`` or ``video``).
        base_dir: folder that relative paths are taken from (the data file's folder);
            None: relative paths are refused.
        audio_rate: sample rate audio must have (Hz).
        video_fps: frames taken per second of video (see :func:`sample_frames`).
        video_max_frames: most frames taken from one video.
        inline_bytes: items up to this size travel inline; larger ones go to ``blobs``.
        blobs: the blob store for large items (None: a large item fails its row).
    """

    fields: tuple[tuple[str, str], ...] = ()
    base_dir: Path | None = None
    audio_rate: int = AUDIO_RATE
    video_fps: float = VIDEO_FPS
    video_max_frames: int = VIDEO_MAX_FRAMES
    inline_bytes: int = INLINE_BYTES
    blobs: BlobStore | None = None

    def __post_init__(self):
        if not self.video_fps > 0 or self.video_max_frames < 1:
            raise ValueError(f"video_fps must be > 0 and video_max_frames >= 1; got "
                             f"{self.video_fps} and {self.video_max_frames}")


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


def sample_frames(timestamps: list[float], fps: float, max_frames: int) -> list[int]:
    """Which decoded frames to keep: indices into ``timestamps`` (seconds, ascending, of
    every frame of the clip).

    With ``D`` the last frame's time, the targets are ``k / fps`` for ``k = 0 ..
    floor(D * fps)``; when that is more than ``max_frames`` targets, ``max_frames``
    targets spread evenly from 0 to ``D`` instead (both ends included). Each target takes
    the frame nearest to it (the earlier one on a tie); a frame is taken once, so a clip
    with fewer frames per second than ``fps`` gives fewer frames. Returns ascending
    indices, at least one.
    """
    if not timestamps:
        raise ValueError("no frames to sample")
    import bisect

    last = timestamps[-1]
    n = int(last * fps + 1e-9) + 1
    if n > max_frames:
        n = max_frames
        targets = [last * k / (n - 1) for k in range(n)] if n > 1 else [0.0]
    else:
        targets = [k / fps for k in range(n)]
    out: list[int] = []
    for t in targets:
        j = bisect.bisect_left(timestamps, t)
        if j == len(timestamps) or (j > 0 and t - timestamps[j - 1] <= timestamps[j] - t):
            j -= 1
        if not out or out[-1] != j:
            out.append(j)
    return out


def _open_video(data: bytes, where: str):
    """(container, its video stream) after the header checks of :func:`check_video`."""
    import av

    try:
        container = av.open(io.BytesIO(data), mode="r")
    except av.error.EOFError:
        raise MediaError(f"{where}: truncated video: the file ({len(data)} bytes) ends "
                         "before its header or index does") from None
    except (av.FFmpegError, UnicodeDecodeError) as e:
        why = getattr(e, "strerror", None) or e
        if data[4:8] == b"ftyp":  # an MP4/MOV box header: the file starts as one
            raise MediaError(f"{where}: truncated or damaged mp4/mov video ({len(data)} "
                             f"bytes; e.g. its 'moov' index is missing): {why}") from None
        raise MediaError(f"{where}: not a video file ({len(data)} bytes): {why}") from None
    fmt = container.format.name
    if fmt not in VIDEO_CONTAINERS:
        container.close()
        raise MediaError(f"{where}: container {fmt!r}, expected "
                         f"{', '.join(VIDEO_CONTAINERS.values())}")
    if len(container.streams.video) != 1:
        container.close()
        raise MediaError(f"{where}: {len(container.streams.video)} video streams, expected 1")
    stream = container.streams.video[0]
    ctx = stream.codec_context
    codec, w, h = ctx.name, ctx.width, ctx.height
    rate = float(stream.average_rate or stream.guessed_rate or 0)
    problem = None
    if codec not in VIDEO_CODECS:
        problem = f"codec {codec!r}, expected one of {', '.join(VIDEO_CODECS)}"
    elif not w or not h or w * h > MAX_VIDEO_PIXELS:
        problem = f"frames of {w} x {h} pixels; expected 1 to {MAX_VIDEO_PIXELS} pixels"
    elif not 0 < rate <= MAX_VIDEO_FPS:
        problem = f"{rate:g} frames/s; expected more than 0 and at most {MAX_VIDEO_FPS:g}"
    elif container.duration and container.duration / 1e6 > MAX_VIDEO_SECONDS:
        problem = (f"{container.duration / 1e6:.1f} s long, over the {MAX_VIDEO_SECONDS:g} s "
                   "accepted")
    if problem:
        container.close()
        raise MediaError(f"{where}: {VIDEO_CONTAINERS[fmt]} video: {problem}")
    return container, stream


def check_video(data: bytes, where: str, fps: float = VIDEO_FPS,
                max_frames: int = VIDEO_MAX_FRAMES) -> bytes:
    """Decode a video fully and keep the frames :func:`sample_frames` picks: returns the
    stored item's bytes (a PNG of the frames stacked top to bottom, with their timestamps
    in seconds; :func:`relax.schemas.media.video_frames` reads it back).

    The clip is decoded twice (timestamps, then the chosen frames), so memory holds only
    the chosen frames.

    Raises:
        MediaError: not a container FFmpeg reads, a container or codec not accepted, no
            or several video streams, frames over :data:`MAX_VIDEO_PIXELS`, a frame rate
            over :data:`MAX_VIDEO_FPS`, over :data:`MAX_VIDEO_SECONDS`, a frame that does
            not decode, or fewer frames (or, where it gives no count, more than 1.5
            frames' time less) than the header announces (truncated).
    """
    import json

    import av
    from PIL import Image, PngImagePlugin

    from relax.schemas.media import VIDEO_INFO_KEY

    def decoded(container):
        try:
            yield from container.decode(video=0)
        except av.FFmpegError as e:
            raise MediaError(f"{where}: video does not decode: {e}") from None

    container, stream = _open_video(data, where)
    with container:
        fmt, codec, rate = (VIDEO_CONTAINERS[container.format.name], stream.codec_context.name,
                            float(stream.average_rate or stream.guessed_rate))
        announced, times, start = stream.frames, [], None
        length = (float(stream.duration * stream.time_base) if stream.duration
                  else (container.duration or 0) / 1e6)
        for frame in decoded(container):
            t = float(frame.time if frame.time is not None else len(times) / rate)
            start = t if start is None else start
            times.append(t - start)
            if times[-1] > MAX_VIDEO_SECONDS:
                raise MediaError(f"{where}: over the {MAX_VIDEO_SECONDS:g} s accepted")
    if not times:
        raise MediaError(f"{where}: truncated or damaged {fmt} video: no frame decodes")
    if announced and len(times) < announced:
        raise MediaError(f"{where}: truncated {fmt} video: {len(times)} of the {announced} "
                         "frames its header announces decode")
    if length and times[-1] + 1 / rate < length - 1.5 / rate:
        raise MediaError(f"{where}: truncated {fmt} video: its frames decode up to "
                         f"{times[-1] + 1 / rate:.3f} s of the {length:.3f} s its header "
                         "announces")
    back = next((i for i, (a, b) in enumerate(itertools.pairwise(times), 1) if b < a), None)
    if back is not None:
        raise MediaError(f"{where}: frame {back}'s timestamp goes back in time")
    keep = sample_frames(times, fps, max_frames)
    wanted, frames = set(keep), []
    container, stream = _open_video(data, where)
    with container:
        for i, frame in enumerate(decoded(container)):
            if i in wanted:
                frames.append(frame.to_image())
            if len(frames) == len(keep):
                break
    w, h = frames[0].size
    strip = Image.new("RGB", (w, h * len(frames)))
    for i, f in enumerate(frames):
        strip.paste(f.convert("RGB"), (0, i * h))
    info = {"frames": len(frames), "width": w, "height": h,
            "timestamps": [round(times[i], 6) for i in keep], "fps": rate,
            "codec": codec, "container": fmt}
    meta = PngImagePlugin.PngInfo()
    meta.add_text(VIDEO_INFO_KEY, json.dumps(info))
    out = io.BytesIO()
    strip.save(out, format="PNG", pnginfo=meta)
    return out.getvalue()


def media_item(kind: str, data: bytes, where: str, opts: MediaOptions, turn: int = 0) -> dict:
    """One ``media`` item (:data:`relax.schemas.v1.MEDIA_ITEM`) for checked bytes.

    Raises:
        MediaError: the item fails its check, or is over ``opts.inline_bytes`` with no
            blob store.
    """
    if kind == "video":
        data, mime = check_video(data, where, opts.video_fps, opts.video_max_frames), "image/png"
    else:
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
                             ("audio", "audio", None), ("audio", "input_audio", "data"),
                             ("video", "video", None), ("video", "video_url", "url")):
        if t == key:
            v = part.get(key)
            if inner is not None and isinstance(v, dict):
                v = v.get(inner)
            return kind, v
    raise MediaError(f"{where}: content part type {t!r}; expected text, image, image_url, "
                     "audio, input_audio, video or video_url")


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


__all__ = ["AUDIO_RATE", "INLINE_BYTES", "MAX_IMAGE_PIXELS", "MAX_VIDEO_FPS",
           "MAX_VIDEO_PIXELS", "MAX_VIDEO_SECONDS", "VIDEO_CODECS", "VIDEO_CONTAINERS",
           "VIDEO_FPS", "VIDEO_MAX_FRAMES", "MediaError", "MediaOptions", "check_audio",
           "check_image", "check_video", "field_items", "media_digest", "media_item",
           "message_content", "read_bytes", "sample_frames"]
