"""Synthetic clips of a moving square: the video source of ``relax publish`` (issue 56).

``moving_square:SPLIT?size=N&seed=S[&frames=F&side=P&fps=R]`` draws ``size`` clips
(default 64) of ``frames`` frames (default 8) of ``side`` x ``side`` pixels (default
64) at ``fps`` frames per second (default 8): a square of a random colour and size on a
grey background moves in a straight line, 3 to 5 pixels a frame, ``left``, ``right``,
``up`` or ``down`` (the four equally often, in a seeded order). Each clip is encoded by
PyAV as H.264 in MP4 (yuv420p, one encoder thread, so a seed gives the same bytes) and
yielded as ``{"question": QUESTION, "answer": DIRECTION, "video": MP4 bytes}``: the
answer is only in the motion (the first frame alone does not tell it). ``train`` and
``test`` draw from different seeds (``test`` adds 1,000,003 to the seed).
"""

from __future__ import annotations

import io
import random
from collections.abc import Iterator

DIRECTIONS = ("left", "right", "up", "down")
QUESTION = ("Which way does the square move in the video: left, right, up or down? "
            "Reply with one word.")
TEST_SEED_OFFSET = 1_000_003
_STEP = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}


def draw_clip(rng: random.Random, direction: str, frames: int, side: int):
    """The frames of one clip: ``uint8 [frames, side, side, 3]`` (numpy, RGB).

    The square (side ``side // 5`` to ``side // 3`` pixels) moves ``speed`` (3 to 5)
    pixels a frame in ``direction``; its start is drawn so that it stays inside the
    frame throughout.

    Raises:
        ValueError: ``direction`` is not one of :data:`DIRECTIONS`, or the frame is too
            small for the square to move ``frames`` steps.
    """
    import numpy as np

    if direction not in _STEP:
        raise ValueError(f"direction {direction!r}: expected one of {DIRECTIONS}")
    sq = rng.randint(max(2, side // 5), max(2, side // 3))
    speed = rng.randint(3, 5)
    travel = speed * (frames - 1)
    if sq + travel > side:
        raise ValueError(f"a {side} x {side} frame is too small for {frames} frames of "
                         f"motion ({sq} px square, {speed} px a frame)")
    dx, dy = _STEP[direction]
    lo = [0 if d >= 0 else travel for d in (dx, dy)]
    hi = [side - sq - (travel if d > 0 else 0) for d in (dx, dy)]
    x0, y0 = rng.randint(lo[0], hi[0]), rng.randint(lo[1], hi[1])
    colour = [rng.randint(0, 80), rng.randint(0, 80), rng.randint(0, 80)]
    colour[rng.randrange(3)] = rng.randint(180, 255)
    out = np.full((frames, side, side, 3), 128, dtype=np.uint8)
    for t in range(frames):
        x, y = x0 + dx * speed * t, y0 + dy * speed * t
        out[t, y:y + sq, x:x + sq] = colour
    return out


def encode_mp4(frames, fps: int) -> bytes:
    """``uint8 [F, H, W, 3]`` RGB frames as H.264 in MP4 at ``fps`` frames/s (PyAV,
    yuv420p, near-lossless ``crf`` 10, one thread: deterministic bytes)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=fps,
                                options={"crf": "10", "preset": "veryfast", "threads": "1"})
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        for f in frames:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        out.mux(stream.encode(None))
    return buf.getvalue()


def clip_records(split: str, params: dict[str, str]) -> Iterator[dict]:
    """The records of ``moving_square:SPLIT?PARAMS`` (see the module docstring).

    Raises:
        ValueError: an unknown split, a non-integer or out-of-range parameter.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split {split!r}: expected train or test")
    try:
        size, seed = int(params.get("size", 64)), int(params.get("seed", 0))
        frames, side = int(params.get("frames", 8)), int(params.get("side", 64))
        fps = int(params.get("fps", 8))
    except ValueError:
        raise ValueError("size, seed, frames, side and fps must be integers") from None
    if size < 1 or frames < 2 or side < 16 or side % 2 or fps < 1:
        raise ValueError(f"need size >= 1, frames >= 2, an even side >= 16 and fps >= 1; got "
                         f"size={size} frames={frames} side={side} fps={fps}")
    rng = random.Random(seed + (TEST_SEED_OFFSET if split == "test" else 0))
    order = [DIRECTIONS[i % 4] for i in range(size)]
    rng.shuffle(order)
    for direction in order:
        video = encode_mp4(draw_clip(rng, direction, frames, side), fps)
        yield {"question": QUESTION, "answer": direction, "video": video}


__all__ = ["DIRECTIONS", "QUESTION", "clip_records", "draw_clip", "encode_mp4"]
