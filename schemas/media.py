"""Where a chat message's images, audio and video stood in its text (``<relax:image>``
marks), and how a video item's sampled frames are stored.

A prompt row's ``messages`` hold text only (``schemas/v1.py`` ``MESSAGE``); a media
part of an input message becomes :data:`MEDIA_MARK` in the text and an item in the row's
``media`` list, in the same order (``relax publish``: :mod:`relax.producers.media`).
:func:`split_marked` gives the parts back, for the model's processor to render
(:mod:`relax.trainer.multimodal`).

A ``video`` item (``kind`` = ``video``) holds the frames ``relax publish`` sampled from
the clip, not the clip: one PNG (``mime`` ``image/png``) of the frames stacked top to
bottom (each ``height`` rows), with a ``tEXt`` chunk :data:`VIDEO_INFO_KEY` holding the
JSON ``{"frames", "width", "height", "timestamps" (seconds from the clip's first frame),
"fps" (the clip's), "codec", "container"}``. :func:`video_frames` reads it back.
"""

from __future__ import annotations

import re

KINDS = ("image", "audio", "video")
"""Media kinds a mark can name."""
MEDIA_MARK = "<relax:{kind}>"
"""Where a media part stood in a chat message's text (``<relax:image>``)."""
_MARKS = re.compile("(" + "|".join(re.escape(MEDIA_MARK.format(kind=k)) for k in KINDS) + ")")


def split_marked(text: str) -> list[tuple[str, str]]:
    """Inverse of ``relax.producers.media.message_content``'s text: ``[("text", s) |
    ("image", "") | ("audio", "") | ("video", "")]`` in order (empty text pieces dropped)."""
    out: list[tuple[str, str]] = []
    for piece in _MARKS.split(text):
        kind = next((k for k in KINDS if piece == MEDIA_MARK.format(kind=k)), None)
        if kind is not None:
            out.append((kind, ""))
        elif piece:
            out.append(("text", piece))
    return out


VIDEO_INFO_KEY = "relax:video"
"""PNG text chunk of a video item's frame strip that holds its JSON description."""


def video_frames(data: bytes) -> tuple[list, list[float], dict]:
    """A stored video item's frames: (``F`` PIL RGB images of ``width`` x ``height``,
    ``F`` timestamps in seconds, the whole JSON description).

    Raises:
        ValueError: the bytes are not a frame strip written by ``relax publish`` (no
            :data:`VIDEO_INFO_KEY` chunk, or a strip whose height is not
            ``frames * height``).
    """
    import io
    import json

    from PIL import Image

    img = Image.open(io.BytesIO(data))
    raw = getattr(img, "text", {}).get(VIDEO_INFO_KEY)
    if raw is None:
        raise ValueError(f"not a video frame strip: no {VIDEO_INFO_KEY!r} PNG text chunk")
    info = json.loads(raw)
    n, w, h = info["frames"], info["width"], info["height"]
    if img.size != (w, n * h):
        raise ValueError(f"frame strip of {img.size[0]} x {img.size[1]} pixels, expected "
                         f"{w} x {n * h} ({n} frames of {w} x {h})")
    img = img.convert("RGB")
    return [img.crop((0, i * h, w, (i + 1) * h)) for i in range(n)], info["timestamps"], info


__all__ = ["KINDS", "MEDIA_MARK", "VIDEO_INFO_KEY", "split_marked", "video_frames"]
