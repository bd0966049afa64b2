"""Where a chat message's images and audio stood in its text: ``<relax:image>`` marks.

A prompt row's ``messages`` hold text only (``schemas/v1.py`` ``MESSAGE``); a media
part of an input message becomes :data:`MEDIA_MARK` in the text and an item in the row's
``media`` list, in the same order (``relax publish``: :mod:`relax.producers.media`).
:func:`split_marked` gives the parts back, for the model's processor to render
(:mod:`relax.trainer.multimodal`).
"""

from __future__ import annotations

import re

KINDS = ("image", "audio")
"""Media kinds a mark can name."""
MEDIA_MARK = "<relax:{kind}>"
"""Where a media part stood in a chat message's text (``<relax:image>``)."""
_MARKS = re.compile("(" + "|".join(re.escape(MEDIA_MARK.format(kind=k)) for k in KINDS) + ")")


def split_marked(text: str) -> list[tuple[str, str]]:
    """Inverse of ``relax.producers.media.message_content``'s text: ``[("text", s) | ("image", "") |
    ("audio", "")]`` in order (empty text pieces dropped)."""
    out: list[tuple[str, str]] = []
    for piece in _MARKS.split(text):
        kind = next((k for k in KINDS if piece == MEDIA_MARK.format(kind=k)), None)
        if kind is not None:
            out.append((kind, ""))
        elif piece:
            out.append(("text", piece))
    return out


__all__ = ["KINDS", "MEDIA_MARK", "split_marked"]
