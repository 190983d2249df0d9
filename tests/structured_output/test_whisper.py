"""Whisper tiny.en (real weights): the constraint holds the text of each decoded
piece of a window (its segment), timestamps and the other special tokens pass
as the model's rules decide; unconstrained transcripts do not change."""
from __future__ import annotations

import re

import pytest

pytest.importorskip("xgrammar")

from encdec import StructuredOutputsParams  # noqa: E402
from encdec.transcription import TranscribeOptions  # noqa: E402

DIGITS = r" ?[0-9]+([.:][0-9]+)?\.?"
COMMANDS = [" Please remember to turn off the lights.", " Please send me the report.", " Can you tell me the way?"]
# clip index in tests/data/speech -> the command it says (sentences.txt lines 4, 22, 12)
SAYS = {3: 0, 21: 1, 11: 2}


@pytest.fixture(scope="module")
def whisper(ct2_dir):
    from encdec import LLM

    return LLM(str(ct2_dir), kv_cache_memory=256 << 20, swap_space=0.05)


def test_digits_regex_on_speech_with_numbers(whisper, speech_clips):
    _, _, wavs = speech_clips
    clips = [wavs[5], wavs[27]]  # "... at seven thirty ...", "He runs five miles ..."
    free = [t.text for t in whisper.transcribe(clips, use_tqdm=False)]
    for beam_size in (1, 4):
        outs = whisper.transcribe(clips, use_tqdm=False, beam_size=beam_size,
                                  structured_outputs=StructuredOutputsParams(regex=DIGITS))
        for t in outs:
            assert t.segments and all(re.fullmatch(DIGITS, s.text) or re.fullmatch(DIGITS, " " + s.text.strip())
                                      for s in t.segments), [s.text for s in t.segments]
    assert [t.text for t in whisper.transcribe(clips, use_tqdm=False)] == free  # unchanged after


@pytest.mark.parametrize("mode", ["sequential", "independent"])
def test_command_choice_picks_the_spoken_command(whisper, speech_clips, mode):
    _, _, wavs = speech_clips
    options = TranscribeOptions(mode=mode, structured_outputs=StructuredOutputsParams(choice=COMMANDS))
    outs = whisper.transcribe([wavs[i] for i in SAYS], options, use_tqdm=False)
    assert [t.text.strip() for t in outs] == [COMMANDS[c].strip() for c in SAYS.values()]


def test_options_refuse_two_constraints():
    from encdec import SamplingParams

    with pytest.raises(ValueError, match="structured_outputs given twice"):
        TranscribeOptions(structured_outputs={"regex": "a"},
                          sampling_params=SamplingParams(structured_outputs={"regex": "b"}))
    with pytest.raises(TypeError, match="structured_outputs must be StructuredOutputsParams"):
        TranscribeOptions(structured_outputs="[0-9]+")
