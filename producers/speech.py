"""Spoken arithmetic questions: the audio source of ``relax publish`` (issue 17).

``speech_arith:?size=N&seed=S[&max=M&ops=+-&voice=V]`` draws ``size`` questions ``a OP b``
with operands in ``0..max`` (default 9) and operators from ``ops`` (default ``+``, ``-``),
speaks each with Debian's ``espeak-ng`` ("what is seven plus five"; ``voice``: an espeak-ng
voice such as ``en+f3``, default espeak-ng's own: the same questions in another voice are
a held-out set of new clips), resamples the
22,050 Hz speech to 16 kHz (``soxr``, what Whisper-family feature extractors take) and
yields ``{"question": INSTRUCTION, "answer": "12", "audio": WAV bytes, "spoken": text}``:
the numbers are only in the audio. No audio is downloaded; espeak-ng's output is the
same for the same text and version, so a seed gives the same rows.
"""

from __future__ import annotations

import io
import random
import shutil
import subprocess
import tempfile
import wave
from collections.abc import Iterator
from pathlib import Path

RATE = 16_000
INSTRUCTION = "Listen to the question and reply with just the number."
OPS = {"+": ("plus", lambda a, b: a + b), "-": ("minus", lambda a, b: a - b),
       "*": ("times", lambda a, b: a * b)}


class SpeechError(RuntimeError):
    """espeak-ng is missing or fails (the source cannot be read at all)."""


def speak(text: str, rate: int = RATE, voice: str | None = None) -> bytes:
    """``text`` spoken by espeak-ng (``voice``: its ``-v`` option) as a mono 16-bit PCM
    WAV at ``rate`` Hz.

    Raises:
        SpeechError: espeak-ng is not installed or fails.
    """
    import numpy as np
    import soxr

    exe = shutil.which("espeak-ng")
    if exe is None:
        raise SpeechError("espeak-ng is not installed (Debian: apt-get install espeak-ng)")
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "s.wav"
        cmd = [exe, "-w", str(out)] + (["-v", voice] if voice else []) + [text]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise SpeechError(f"espeak-ng failed on {text!r}: {r.stderr.strip()[:200]}")
        with wave.open(str(out)) as w:
            src_rate = w.getframerate()
            pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    y = soxr.resample(pcm.astype(np.float32) / 32768.0, src_rate, rate)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(y, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes())
    return buf.getvalue()


def questions(size: int, seed: int, max_operand: int = 9, ops: str = "+-"
              ) -> list[tuple[str, str]]:
    """``size`` (spoken text, answer) pairs, the same for the same arguments.

    Raises:
        ValueError: an operator other than ``+``, ``-``, ``*``.
    """
    bad = set(ops) - set(OPS)
    if bad or not ops:
        raise ValueError(f"ops={ops!r}: expected some of {''.join(OPS)}")
    rng = random.Random(seed)
    out = []
    for _ in range(size):
        a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice(ops)
        word, fn = OPS[op]
        out.append((f"what is {a} {word} {b}", str(fn(a, b))))
    return out


def speech_records(query: dict[str, str]) -> Iterator[dict]:
    """The records of ``speech_arith:?QUERY`` (``size`` default 100, ``seed`` 0, ``max``
    9, ``ops`` ``+-``, ``voice`` espeak-ng's default).

    Raises:
        SpeechError: espeak-ng is missing or fails.
        ValueError: bad ``ops``.
    """
    pairs = questions(int(query.get("size", 100)), int(query.get("seed", 0)),
                      int(query.get("max", 9)), query.get("ops", "+-"))
    voice = query.get("voice")
    for spoken, answer in pairs:
        yield {"question": INSTRUCTION, "answer": answer, "audio": speak(spoken, voice=voice),
               "spoken": spoken}


__all__ = ["INSTRUCTION", "RATE", "SpeechError", "questions", "speak", "speech_records"]
