"""Images and audio in ``relax publish`` (issue 17, data in): every item decoded before it
is sent, bad ones fail their row only, large ones go to the blob store."""

from __future__ import annotations

import io
import json
import struct
import wave
import zlib
from pathlib import Path

import pytest
from PIL import Image

from relax.producers.media import (
    MediaError,
    MediaOptions,
    check_audio,
    check_image,
    message_content,
    read_bytes,
)
from relax.producers.publish import prompt_row, publish
from relax.schemas import topics
from relax.schemas.media import MEDIA_MARK, split_marked
from relax.streams.blobs import BlobStore
from relax.streams.client import BusConfig
from relax.streams.read import read_table


def png(w: int = 8, h: int = 8, noise: bool = False) -> bytes:
    """A real PNG; with ``noise`` (random pixels) it does not compress."""
    import numpy as np

    arr = (np.random.default_rng(0).integers(0, 256, (h, w, 3)) if noise
           else np.full((h, w, 3), (200, 30, 30))).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def png_header_only(w: int, h: int) -> bytes:
    """A PNG whose IHDR says ``w`` x ``h`` (no pixel data): what a 20k x 20k upload
    looks like to a reader that checks the size before decoding."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def wav(frames: int = 1600, rate: int = 16_000) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"\x01\x00" * frames)
    return buf.getvalue()


def test_images_are_decoded_whole_and_their_size_checked_from_the_header():
    assert check_image(png(), "field 'image'") == "image/png"
    good = png(64, 64, noise=True)
    with pytest.raises(MediaError, match=r"field 'image': PNG image of 64 x 64 does not decode"):
        check_image(good[: len(good) // 2], "field 'image'")
    with pytest.raises(MediaError, match=r"image of 9000 x 9000 pixels, over the 67108864"):
        check_image(png_header_only(9000, 9000), "field 'image'")
    with pytest.raises(MediaError, match=r"image over the 67108864 pixels accepted \(Image "
                       r"size \(400000000 pixels\)"):
        check_image(png_header_only(20_000, 20_000), "field 'image'")
    with pytest.raises(MediaError, match=r"field 'x': not an image \(5 bytes\)"):
        check_image(b"hello", "field 'x'")


def test_audio_must_be_a_non_empty_wav_at_the_rate_asked_for():
    assert check_audio(wav(), "a", 16_000) == "audio/wav"
    with pytest.raises(MediaError, match=r"a: empty audio \(0 frames\)"):
        check_audio(wav(0), "a", 16_000)
    with pytest.raises(MediaError, match=r"a: sample rate 8000 Hz, expected 16000 Hz"):
        check_audio(wav(rate=8000), "a", 16_000)
    with pytest.raises(MediaError, match=r"a: not a PCM WAV file \(4 bytes\)"):
        check_audio(b"RIFF", "a", 16_000)


def test_media_values_are_bytes_paths_in_the_data_folder_or_uris(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(b"A")
    assert read_bytes("img/a.png", "f", tmp_path) == b"A"
    assert read_bytes((tmp_path / "img" / "a.png").as_uri(), "f", None) == b"A"
    assert read_bytes({"bytes": b"B", "path": None}, "f", None) == b"B"  # a datasets Image
    assert read_bytes({"bytes": None, "path": "img/a.png"}, "f", tmp_path) == b"A"
    with pytest.raises(MediaError, match=r"f: '../x.png' leaves the data folder"):
        read_bytes("../x.png", "f", tmp_path / "img")
    with pytest.raises(MediaError, match=r"f: 'http://e.org/x.png' is a web URL"):
        read_bytes("http://e.org/x.png", "f", tmp_path)
    with pytest.raises(MediaError, match=r"f: cannot read 'img/none.png'"):
        read_bytes("img/none.png", "f", tmp_path)


def test_message_parts_keep_the_media_in_place_and_round_trip(tmp_path):
    (tmp_path / "a.png").write_bytes(png())
    parts = [{"type": "text", "text": "Look: "}, {"type": "image", "image": "a.png"},
             {"type": "text", "text": " and listen "},
             {"type": "input_audio", "input_audio": {"data": wav(), "format": "wav"}}]
    text, items = message_content(parts, "m", MediaOptions(base_dir=tmp_path))
    assert text == "Look: <relax:image> and listen <relax:audio>"
    assert [(i["kind"], i["mime"], i["turn"]) for i in items] == [("image", "image/png", 0),
                                                                  ("audio", "audio/wav", 0)]
    assert split_marked(text) == [("text", "Look: "), ("image", ""),
                                  ("text", " and listen "), ("audio", "")]
    assert MEDIA_MARK.format(kind="image") == "<relax:image>"
    with pytest.raises(MediaError, match=r"m part 0: content part type 'file'"):
        message_content([{"type": "file", "file": "v.pdf"}], "m", MediaOptions())


def test_the_same_question_about_two_images_is_two_prompts():
    opts = MediaOptions(fields=(("image", "image"),))
    rows = [prompt_row({"q": "what shape?", "a": "circle", "image": img}, dataset="d",
                       prompt_field="q", label_field="a", source="s", line=1,
                       created_at_ms=0, media=opts) for img in (png(8, 8), png(9, 9))]
    assert rows[0]["prompt_id"] != rows[1]["prompt_id"]
    text = prompt_row({"q": "what shape?", "a": "circle"}, dataset="d", prompt_field="q",
                      label_field="a", source="s", line=1, created_at_ms=0)
    assert text["media"] is None and text["prompt_id"] not in {r["prompt_id"] for r in rows}


def test_easy_vqa_publishes_with_its_images_and_bad_media_rows_go_to_errors(
        broker, unique, tmp_path):
    """Real easy-vqa questions and PNGs, plus one row of each bad kind: truncated PNG,
    empty audio, a 20k x 20k image, a missing file. Good rows carry the exact bytes
    inline; a 1 MB image goes to the blob store and the row keeps its URI."""
    from relax.producers.sources import read_source

    vqa = [r.record for r in read_source("easy_vqa:test?size=6&seed=1")]
    assert all(Path(r["image"]).exists() and r["answer"] for r in vqa)
    media_dir = tmp_path / "media"
    media_dir.mkdir()
    good_png = png(64, 64, noise=True)
    (media_dir / "cut.png").write_bytes(good_png[: len(good_png) // 2])
    (media_dir / "huge.png").write_bytes(png_header_only(20_000, 20_000))
    (media_dir / "big.png").write_bytes(png(600, 600, noise=True))
    (media_dir / "say.wav").write_bytes(wav())
    (media_dir / "empty.wav").write_bytes(wav(0))
    records = [{"q": r["question"], "a": r["answer"], "image": r["image"], "audio": None}
               for r in vqa]
    records += [{"q": "cut?", "a": "no", "image": "media/cut.png", "audio": None},       # 7
                {"q": "huge?", "a": "no", "image": "media/huge.png", "audio": None},     # 8
                {"q": "quiet?", "a": "no", "image": None, "audio": "media/empty.wav"},   # 9
                {"q": "gone?", "a": "no", "image": "media/none.png", "audio": None},     # 10
                {"q": "big?", "a": "yes", "image": "media/big.png",
                 "audio": "media/say.wav"}]                                              # 11
    src = tmp_path / "vqa.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = BusConfig(bootstrap_servers=broker)
    topic = f"prompts.{unique}"
    store = BlobStore(tmp_path / "blobs")
    r = publish(cfg, str(src), topic, prompt_field="q", label_field="a",
                media=MediaOptions(fields=(("image", "image"), ("audio", "audio")),
                                   blobs=store))
    assert (r.published, r.errors) == (7, 4), r

    rows = {json.loads(x["metadata"])["line"]: x for x in read_table(cfg, topic).to_pylist()}
    assert sorted(rows) == [1, 2, 3, 4, 5, 6, 11]
    for line, rec in enumerate(vqa, 1):
        (item,) = rows[line]["media"]
        assert item == {"kind": "image", "uri": None, "data": Path(rec["image"]).read_bytes(),
                        "mime": "image/png", "turn": 0}
        assert rows[line]["prompt"] == rec["question"] and rows[line]["label"] == rec["answer"]
    big, say = rows[11]["media"]
    assert big["data"] is None and big["uri"].startswith(store.root_uri)
    assert BlobStore.get(big["uri"]) == (media_dir / "big.png").read_bytes()
    assert say == {"kind": "audio", "uri": None, "data": wav(), "mime": "audio/wav", "turn": 0}
    assert "image" not in json.loads(rows[11]["metadata"])["fields"]

    errs = {e["source_offset"]: e["error"]
            for e in read_table(cfg, topics.errors_topic(topic)).to_pylist()}
    assert sorted(errs) == [7, 8, 9, 10], errs
    assert "line 7: field 'image': PNG image of 64 x 64 does not decode" in errs[7]
    assert "line 8: field 'image': image over the 67108864 pixels accepted" in errs[8]
    assert "line 9: field 'audio': empty audio" in errs[9]
    assert "line 10: field 'image': cannot read 'media/none.png'" in errs[10]


def test_cli_publishes_chat_messages_with_image_parts(broker, unique, tmp_path):
    from typer.testing import CliRunner

    from relax.infra.cli.app import app

    (tmp_path / "a.png").write_bytes(png())
    msg = [{"role": "user", "content": [{"type": "image", "image": "a.png"},
                                        {"type": "text", "text": "What colour?"}]}]
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": msg, "a": "red"}) + "\n")
    topic = f"prompts.{unique}"
    res = CliRunner().invoke(app, ["publish", str(tmp_path / "chat.jsonl"), "--topic", topic,
                                   "--prompt-field", "messages", "--label-field", "a",
                                   "--bootstrap", broker])
    assert res.exit_code == 0, res.output
    (row,) = read_table(BusConfig(bootstrap_servers=broker), topic).to_pylist()
    assert row["messages"] == [{"role": "user", "content": "<relax:image>What colour?"}]
    assert row["media"][0]["data"] == png() and row["media"][0]["kind"] == "image"


def test_spoken_arithmetic_is_synthesised_and_published_as_16khz_wav(broker, unique):
    """``speech_arith:`` speaks each question with espeak-ng (the numbers are only in the
    audio) and ``--audio-field audio`` publishes it: 16 kHz PCM, ~1-2 s, not silence."""
    import shutil

    import numpy as np
    from typer.testing import CliRunner

    from relax.infra.cli.app import app
    from relax.producers.speech import INSTRUCTION, questions

    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (.ci/run installs it: apt-get install espeak-ng)")
    topic = f"prompts.{unique}"
    res = CliRunner().invoke(app, ["publish", "speech_arith:?size=4&seed=3", "--topic", topic,
                                   "--prompt-field", "question", "--label-field", "answer",
                                   "--audio-field", "audio", "--bootstrap", broker])
    assert res.exit_code == 0, res.output
    rows = sorted(read_table(BusConfig(bootstrap_servers=broker), topic).to_pylist(),
                  key=lambda r: json.loads(r["metadata"])["line"])
    want = questions(4, 3)
    assert [(json.loads(r["metadata"])["fields"]["spoken"], r["label"]) for r in rows] == want
    assert {r["prompt"] for r in rows} == {INSTRUCTION} and len({r["prompt_id"] for r in rows}) == 4
    for r in rows:
        (item,) = r["media"]
        assert (item["kind"], item["mime"]) == ("audio", "audio/wav")
        with wave.open(io.BytesIO(item["data"])) as w:
            assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (16_000, 1, 2)
            pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2") / 32768.0
        assert 0.5 < len(pcm) / 16_000 < 4.0 and float(np.sqrt((pcm ** 2).mean())) > 0.01


def test_spoken_questions_are_the_same_for_a_seed_and_check_their_operators():
    from relax.producers.speech import questions

    assert questions(5, 1) == questions(5, 1) != questions(5, 2)
    assert all(str(eval(q.replace("what is ", "").replace("plus", "+").replace("minus", "-")))
               == a for q, a in questions(20, 0))
    with pytest.raises(ValueError, match=r"ops='/': expected some of \+-\*"):
        questions(1, 0, ops="/")
