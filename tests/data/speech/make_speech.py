"""Regenerate the spoken test sentences: one 16 kHz mono 16-bit WAV per line of
``sentences.txt``, synthesised with espeak-ng (``apt-get install espeak-ng``).

    python tests/data/speech/make_speech.py

Voices alternate between US and British English and the speaking rate varies a
little, so the set is not one voice at one speed. The ~3-minute long file is
built at test time by concatenating these (keeps the repository small).

``python tests/data/speech/make_speech.py --multilingual`` writes the
multilingual clips instead: ``m_<lang>_<i>.wav`` for the sentences of
``multilingual.txt`` (``<lang>|<text>`` per line: German, French, Spanish and
English), for language detection, transcription and translation tests.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import librosa
import numpy as np
import soundfile as sf

HERE = os.path.dirname(os.path.abspath(__file__))
VOICES = ("en-us", "en-gb", "en-us+m3", "en-gb+f2")


def synth(text: str, voice: str, speed: int, out_path: str) -> float:
    with tempfile.NamedTemporaryFile(suffix=".wav") as tmp:
        subprocess.run(["espeak-ng", "-v", voice, "-s", str(speed), "-w", tmp.name, text], check=True)
        audio, _ = librosa.load(tmp.name, sr=16000, mono=True)
    audio = np.concatenate([np.zeros(3200, np.float32), audio, np.zeros(3200, np.float32)])  # 0.2 s pads
    sf.write(out_path, audio, 16000, subtype="PCM_16")
    return len(audio) / 16000


def multilingual() -> None:
    with open(os.path.join(HERE, "multilingual.txt"), encoding="utf-8") as f:
        rows = [line.strip().split("|", 1) for line in f if line.strip()]
    total, count = 0.0, {}
    for lang, text in rows:
        i = count[lang] = count.get(lang, -1) + 1
        total += synth(text, lang, 140 + 10 * (i % 2), os.path.join(HERE, f"m_{lang}_{i}.wav"))
    print(f"wrote {len(rows)} files, {total:.1f} s of audio")


def main() -> None:
    if shutil.which("espeak-ng") is None:
        sys.exit("espeak-ng is not installed (apt-get install -y espeak-ng)")
    if "--multilingual" in sys.argv[1:]:
        multilingual()
        return
    with open(os.path.join(HERE, "sentences.txt")) as f:
        sentences = [line.strip() for line in f if line.strip()]
    total = 0.0
    for i, text in enumerate(sentences):
        total += synth(text, VOICES[i % len(VOICES)], 150 + 10 * (i % 3),
                       os.path.join(HERE, f"s{i:02d}.wav"))
    print(f"wrote {len(sentences)} files, {total:.1f} s of audio")


if __name__ == "__main__":
    main()
