"""Video in ``relax publish`` (issue 56): each clip decoded and checked (PyAV), frames
sampled by ``fps`` / ``max_frames`` and stored with their timestamps; a bad clip fails
its row only; the ``moving_square`` source's answers are in the motion."""

from __future__ import annotations

import io
import json
import random
import wave

import numpy as np
import pytest

from relax.producers.media import MediaError, MediaOptions, check_video, sample_frames
from relax.producers.moving_square import draw_clip, encode_mp4
from relax.producers.publish import publish
from relax.producers.sources import SourceError, read_source
from relax.schemas import topics
from relax.schemas.media import video_frames
from relax.streams.blobs import BlobStore
from relax.streams.read import read_table


def clip(direction: str = "right", seed: int = 0, frames: int = 8, side: int = 64, fps: int = 8):
    """(RGB frames ``uint8 [F, side, side, 3]``, their MP4 bytes)."""
    arr = draw_clip(random.Random(seed), direction, frames, side)
    return arr, encode_mp4(arr, fps)


def encode(arr, fmt: str, codec: str, fps: int = 8) -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as out:
        s = out.add_stream(codec, rate=fps)
        s.width, s.height, s.pix_fmt = arr.shape[2], arr.shape[1], "yuv420p"
        for f in arr:
            out.mux(s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        out.mux(s.encode(None))
    return buf.getvalue()


def square_centre(frame) -> tuple[float, float]:
    """(x, y) centre of the coloured (non-grey) pixels of one decoded frame."""
    a = np.asarray(frame, dtype=np.int16)
    ys, xs = np.nonzero(a.max(axis=2) - a.min(axis=2) > 60)
    assert len(xs) > 4, "no square in the frame"
    return float(xs.mean()), float(ys.mean())


def motion(frames) -> str:
    """left/right/up/down from the square's centre in the first and last frame."""
    (x0, y0), (x1, y1) = square_centre(frames[0]), square_centre(frames[-1])
    dx, dy = x1 - x0, y1 - y0
    assert max(abs(dx), abs(dy)) > 8 and min(abs(dx), abs(dy)) < 1.5, (dx, dy)
    if abs(dx) > abs(dy):
        return "right" if dx > 0 else "left"
    return "down" if dy > 0 else "up"


def test_sample_frames_rule():
    at30 = [i / 30 for i in range(300)]  # 10 s at 30 frames/s
    assert sample_frames(at30, fps=2, max_frames=32) == list(range(0, 300, 15))  # 20 frames
    # over max_frames: spread evenly from the first to the last frame
    assert sample_frames(at30, fps=2, max_frames=4) == [0, 100, 199, 299]
    assert sample_frames(at30, fps=2, max_frames=1) == [0]
    # a clip slower than fps: each frame once
    assert sample_frames([0.0, 0.5, 1.0], fps=10, max_frames=32) == [0, 1, 2]
    # a tie takes the earlier frame: target 0.4375 between 0.375 and 0.5
    assert sample_frames([k / 8 for k in range(8)], fps=8, max_frames=3) == [0, 3, 7]


def test_decode_samples_frames_with_their_timestamps():
    arr, mp4 = clip("down", seed=3)
    for fps, max_frames, want in ((8, 8, list(range(8))), (2, 32, [0, 4]), (8, 3, [0, 3, 7])):
        frames, ts, info = video_frames(check_video(mp4, "field 'video'", fps, max_frames))
        assert ts == [k / 8 for k in want]
        assert len(frames) == len(want) and frames[0].size == (64, 64)
        assert (info["codec"], info["container"], info["fps"]) == ("h264", "mp4/mov", 8.0)
        for f, k in zip(frames, want):  # the frame decoded is the frame drawn at that time
            err = np.abs(np.asarray(f, dtype=np.int16) - arr[k]).mean()
            assert err < 4, (k, err)
    # other containers and codecs PyAV writes here
    for fmt, codec, name in (("matroska", "libvpx-vp9", "mkv/webm"), ("avi", "mpeg4", "avi")):
        _, ts, info = video_frames(check_video(encode(arr, fmt, codec), "v", 4, 32))
        assert (ts, info["container"]) == ([0.0, 0.25, 0.5, 0.75], name)


def test_truncated_and_wrong_container_fail_with_the_reason():
    arr, mp4 = clip()
    wav = io.BytesIO()
    with wave.open(wav, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16_000)
        w.writeframes(b"\0\0" * 1600)
    cases = [(mp4[: len(mp4) // 2], "field 'video': truncated or damaged mp4/mov video"),
             (mp4[:-100], "field 'video': truncated or damaged mp4/mov video: no frame"),
             (mp4[:-200], "field 'video': truncated video: the file .* ends before its"),
             (encode(arr, "matroska", "libvpx-vp9")[:-100], "truncated mkv/webm video"),
             (wav.getvalue(), "field 'video': container 'wav', expected mp4/mov"),
             (b"\0" * 1000, "field 'video': not a video file")]
    for data, reason in cases:
        with pytest.raises(MediaError, match=reason):
            check_video(data, "field 'video'")


def test_moving_square_answers_are_in_the_motion():
    """Decoded frames (not the generator's labels) show the motion the answer names;
    the first frame alone does not (the square starts anywhere along its path)."""
    rows = [r.record for r in read_source("moving_square:train?size=16&seed=5")]
    assert sorted(r["answer"] for r in rows) == sorted(["left", "right", "up", "down"] * 4)
    for r in rows:
        frames, ts, _ = video_frames(check_video(r["video"], "video", fps=8, max_frames=8))
        assert len(frames) == 8 and ts[-1] == 7 / 8
        assert motion(frames) == r["answer"]
    again = [r.record["video"] for r in read_source("moving_square:train?size=16&seed=5")]
    assert again == [r["video"] for r in rows]  # a seed gives the same clips
    test = [r.record["video"] for r in read_source("moving_square:test?size=16&seed=5")]
    assert not set(test) & set(again)
    with pytest.raises(SourceError, match="expected moving_square:train"):
        list(read_source("moving_square:dev?size=2"))


def test_publish_video_rows_through_the_broker(bus, unique, tmp_path):
    """Good clips (a column, a chat part, one over inline_bytes to the blob store) are
    published as sampled frames with timestamps; a truncated clip and a PNG given as a
    video fail their rows only, to the error topic, naming the field."""
    (tmp_path / "clips").mkdir()
    _, right = clip("right", 1)
    _, up = clip("up", 2)
    _, big = clip("left", 4, frames=16, side=256)  # its 4 frames' PNG: ~4 kB
    (tmp_path / "clips" / "right.mp4").write_bytes(right)
    (tmp_path / "clips" / "cut.mp4").write_bytes(right[: len(right) // 2])
    from PIL import Image

    png = io.BytesIO()
    Image.new("RGB", (8, 8)).save(png, format="PNG")
    (tmp_path / "clips" / "still.png").write_bytes(png.getvalue())
    (tmp_path / "clips" / "big.mp4").write_bytes(big)
    chat = [{"role": "user", "content": [{"type": "video", "video": "clips/up.mp4"},
                                         {"type": "text", "text": "Which way?"}]}]
    (tmp_path / "clips" / "up.mp4").write_bytes(up)
    records = [{"q": "Which way?", "a": "right", "video": "clips/right.mp4"},  # 1
               {"q": chat, "a": "up", "video": None},                          # 2
               {"q": "Which way?", "a": "no", "video": "clips/cut.mp4"},       # 3
               {"q": "Which way?", "a": "no", "video": "clips/still.png"},     # 4
               {"q": "Which way?", "a": "left", "video": "clips/big.mp4"}]     # 5
    src = tmp_path / "v.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    topic = f"prompts.{unique}"
    store = BlobStore(tmp_path / "blobs")
    opts = MediaOptions(fields=(("video", "video"),), video_fps=4, video_max_frames=4,
                        inline_bytes=3000, blobs=store)
    r = publish(bus, str(src), topic, prompt_field="q", label_field="a", media=opts)
    assert (r.published, r.errors) == (3, 2), r

    rows = {json.loads(x["metadata"])["line"]: x for x in read_table(bus, topic).to_pylist()}
    assert sorted(rows) == [1, 2, 5]
    assert rows[2]["messages"] == [{"role": "user", "content": "<relax:video>Which way?"}]
    for line in (1, 2):
        (item,) = rows[line]["media"]
        assert (item["kind"], item["mime"], item["uri"]) == ("video", "image/png", None)
        frames, ts, _ = video_frames(item["data"])
        assert ts == [0.0, 0.25, 0.5, 0.75] and motion(frames) == rows[line]["label"]
    (item,) = rows[5]["media"]
    assert item["data"] is None and item["uri"].startswith(store.root_uri)
    frames, ts, _ = video_frames(BlobStore.get(item["uri"]))
    assert ts == [0.0, 0.625, 1.25, 1.875] and motion(frames) == "left"
    assert frames[0].size == (256, 256)

    errs = {e["source_offset"]: e["error"]
            for e in read_table(bus, topics.errors_topic(topic)).to_pylist()}
    assert sorted(errs) == [3, 4], errs
    assert "line 3: field 'video': truncated or damaged mp4/mov video" in errs[3]
    assert "line 4: field 'video': container 'png_pipe', expected mp4/mov" in errs[4]


def test_cli_publishes_moving_square_with_video_field(bus, unique):
    from typer.testing import CliRunner

    from relax.infra.cli.app import app

    topic = f"prompts.{unique}"
    res = CliRunner().invoke(app, ["publish", "moving_square:train?size=4&seed=1", "--topic",
                                   topic, "--prompt-field", "question", "--label-field",
                                   "answer", "--video-field", "video", "--video-fps", "8",
                                   "--video-max-frames", "3",
                                   "--bootstrap", bus.bootstrap_servers])
    assert res.exit_code == 0, res.output
    rows = read_table(bus, topic).to_pylist()
    assert len(rows) == 4 and len({r["prompt_id"] for r in rows}) == 4
    for r in rows:
        frames, ts, _ = video_frames(r["media"][0]["data"])
        assert ts == [0.0, 0.375, 0.875] and motion(frames) == r["label"]
        assert "video" not in json.loads(r["metadata"])["fields"]


def test_video_rows_are_refused_by_a_model_without_video_not_dropped():
    """A video row keeps its clip's place (a video part), and a model whose processor takes
    no video (here: none) fails the row with a reason instead of training on its text
    alone. The families that take video: tests/trainer/test_families.py."""
    from relax.trainer.multimodal import chat_with_media, media_inputs

    _, mp4 = clip()
    item = {"kind": "video", "uri": None, "data": check_video(mp4, "v"), "mime": "image/png",
            "turn": 0}
    msgs = [{"role": "user", "content": "<relax:video>Which way?"}]
    assert chat_with_media(msgs, [item])[0]["content"] == [
        {"type": "video"}, {"type": "text", "text": "Which way?"}]
    with pytest.raises(ValueError, match=r"1 video items; the model's processor \(NoneType\) "
                                         "takes no video"):
        media_inputs(None, [item])

