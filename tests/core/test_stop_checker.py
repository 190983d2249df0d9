from __future__ import annotations

import pytest

from encdec.core.stop_checker import StopChecker
from encdec.sampling_params import SamplingParams
from encdec.sequence import SequenceStatus

EOS = 2


class FakeSeq:
    """The attributes StopChecker reads and writes, and nothing else."""

    def __init__(self, prompt_len: int = 2) -> None:
        self.prompt_len = prompt_len
        self.output: list[int] = []
        self.output_text = ""
        self.status = SequenceStatus.RUNNING
        self.stop_reason: int | str | None = None

    def get_output_len(self) -> int:
        return len(self.output)

    def get_len(self) -> int:
        return self.prompt_len + len(self.output)

    def get_last_token_id(self) -> int:
        return self.output[-1]


def _feed(checker: StopChecker, params: SamplingParams, pieces: list[tuple[int, str]],
          prompt_len: int = 2) -> tuple[FakeSeq, int]:
    """Append (token, text) pairs until the checker stops the sequence."""
    seq = FakeSeq(prompt_len)
    for step, (token, text) in enumerate(pieces, 1):
        seq.output.append(token)
        seq.output_text += text
        checker.maybe_stop_sequence(seq, len(text), params, EOS)
        if seq.status != SequenceStatus.RUNNING:
            return seq, step
    return seq, len(pieces)


WORDS = [(10, "Hello"), (11, " big"), (12, " world"), (13, "!"), (14, " Bye")]


def test_eos_stops_and_its_text_is_dropped() -> None:
    seq, step = _feed(StopChecker(100), SamplingParams(), WORDS[:2] + [(EOS, "</s>")] + WORDS[2:])
    assert (step, seq.status, seq.stop_reason) == (3, SequenceStatus.FINISHED_STOPPED, None)
    assert seq.output_text == "Hello big"


def test_ignore_eos_runs_on() -> None:
    seq, _ = _feed(StopChecker(100), SamplingParams(ignore_eos=True), [(EOS, "")] * 3)
    assert seq.status == SequenceStatus.RUNNING


def test_min_tokens_defers_every_stop() -> None:
    # eos at 1 and the stop string at 2 are ignored; the 3rd token may stop.
    params = SamplingParams(min_tokens=3, stop_token_ids=[11], stop=["Hello"])
    seq, step = _feed(StopChecker(100), params, [(EOS, ""), WORDS[0], WORDS[1], (EOS, "")])
    assert (step, seq.status, seq.stop_reason) == (3, SequenceStatus.FINISHED_STOPPED, 11)


@pytest.mark.parametrize("include, text", [(False, "Hello"), (True, "Hello big")])
def test_stop_token_id_sets_stop_reason(include: bool, text: str) -> None:
    params = SamplingParams(stop_token_ids=[11], include_stop_str_in_output=include)
    seq, step = _feed(StopChecker(100), params, WORDS)
    assert (step, seq.status, seq.stop_reason) == (2, SequenceStatus.FINISHED_STOPPED, 11)
    assert seq.output_text == text


@pytest.mark.parametrize("include, text", [(False, "Hello b"), (True, "Hello big w")])
def test_stop_string_across_tokens_truncates(include: bool, text: str) -> None:
    params = SamplingParams(stop=["nothing", "ig w"], include_stop_str_in_output=include)
    seq, step = _feed(StopChecker(100), params, WORDS)
    assert (step, seq.status, seq.stop_reason) == (3, SequenceStatus.FINISHED_STOPPED, "ig w")
    assert seq.output_text == text


def test_stop_string_search_skips_text_already_searched() -> None:
    assert StopChecker.check_stop_strings("STOP and more", 1, ["STOP"], False) is None
    assert StopChecker.check_stop_strings("xx STOP", 2, ["STOP"], False) == ("STOP", 3)
    assert StopChecker.check_stop_strings("xx STOP", 2, ["STOP"], True) == ("STOP", -1)
    assert StopChecker.check_stop_strings("xx STOPyz", 4, ["STOP"], True) == ("STOP", 7)


def test_max_tokens_caps_length() -> None:
    seq, step = _feed(StopChecker(100), SamplingParams(max_tokens=3), WORDS)
    assert (step, seq.status, seq.stop_reason) == (3, SequenceStatus.FINISHED_LENGTH_CAPPED, None)
    assert seq.output_text == "Hello big world"


def test_max_tokens_none_runs_to_max_model_len() -> None:
    seq, step = _feed(StopChecker(6), SamplingParams(max_tokens=None), WORDS * 3, prompt_len=2)
    assert (step, seq.status) == (4, SequenceStatus.FINISHED_LENGTH_CAPPED)


def test_max_model_len_applies_even_below_min_tokens() -> None:
    seq, step = _feed(StopChecker(4), SamplingParams(min_tokens=10, max_tokens=20), WORDS)
    assert (step, seq.status) == (2, SequenceStatus.FINISHED_LENGTH_CAPPED)


def test_stop_wins_over_length_on_the_same_token() -> None:
    seq, step = _feed(StopChecker(100), SamplingParams(max_tokens=2), [WORDS[0], (EOS, "")])
    assert (step, seq.status) == (2, SequenceStatus.FINISHED_STOPPED)


def test_token_past_the_tokenizer_stops() -> None:
    checker = StopChecker(100, get_tokenizer_len=lambda: 12)
    seq, step = _feed(checker, SamplingParams(), WORDS)
    assert (step, seq.status, seq.stop_reason) == (3, SequenceStatus.FINISHED_STOPPED, 12)


# -- text left owed (check(defer_text=True)), decoded when read or at the end ----------


class FakeDetok:
    """Appends each owed token's text from a table (the counter the real one
    keeps on the sequence); counts the tokens it decoded."""

    def __init__(self, texts: dict[int, str]) -> None:
        self.texts, self.calls = texts, 0

    def decode_owed(self, seq, params, upto: int | None = None) -> None:
        end = len(seq.output) if upto is None else upto
        while seq.num_text_tokens < end:
            self._next(seq)

    def decode_sequence_inplace(self, seq, params) -> int:
        self.decode_owed(seq, params, len(seq.output) - 1)
        return self._next(seq)

    def _next(self, seq) -> int:
        self.calls += 1
        text = self.texts[seq.output[seq.num_text_tokens]]
        seq.num_text_tokens += 1
        seq.output_text += text
        return len(text)


class FakeSeqWithStatus(FakeSeq):
    def __init__(self) -> None:
        super().__init__()
        self.num_text_tokens = 0

    def is_finished(self) -> bool:
        return SequenceStatus.is_finished(self.status)


def _run(params: SamplingParams, tokens: list[int], defer: bool) -> tuple[FakeSeqWithStatus, int]:
    """Append and check each token (the engine's order); returns the sequence and
    the most tokens whose text was owed at once."""
    texts = {t: s for t, s in WORDS} | {EOS: "</s>"}
    detok = FakeDetok(texts)
    checker = StopChecker(100, detokenizer=detok, eos_token_id=EOS)
    seq = FakeSeqWithStatus()
    most_owed = 0
    for token in tokens:
        seq.output.append(token)
        checker.check(seq, params, defer_text=defer)
        most_owed = max(most_owed, len(seq.output) - seq.num_text_tokens)
        if seq.is_finished():
            break
    checker.settle_text(seq, params)
    return seq, most_owed


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(stop_token_ids=[12]),
                                    SamplingParams(stop_token_ids=[12], include_stop_str_in_output=True),
                                    SamplingParams(max_tokens=3), SamplingParams(ignore_eos=True, max_tokens=4),
                                    SamplingParams(stop=[" wor"])],
                         ids=["eos", "stop_id", "stop_id_kept", "max_tokens", "ignore_eos", "stop_string"])
def test_deferred_text_ends_as_immediate_text(params: SamplingParams) -> None:
    tokens = [10, 11, 12, EOS, 13, 14]
    now, _ = _run(params, tokens, defer=False)
    later, owed = _run(params, tokens, defer=True)
    assert (later.output_text, later.status, later.stop_reason) == (now.output_text, now.status, now.stop_reason)
    assert later.num_text_tokens == len(later.output)  # a finished sequence owes no text
    # Text waits only where no stop string needs it.
    assert (owed > 0) == (not params.stop)


def test_a_finishing_token_settles_the_whole_text() -> None:
    detok = FakeDetok({10: "Hello", 11: " world", EOS: "</s>"})
    checker = StopChecker(100, detokenizer=detok, eos_token_id=EOS)
    seq = FakeSeqWithStatus()
    for token in (10, 11):
        seq.output.append(token)
        checker.check(seq, SamplingParams(), defer_text=True)
    assert (seq.output_text, detok.calls) == ("", 0)  # owed
    seq.output.append(EOS)
    checker.check(seq, SamplingParams(), defer_text=True)
    assert seq.status == SequenceStatus.FINISHED_STOPPED
    assert (seq.output_text, detok.calls, seq.num_text_tokens) == ("Hello world", 3, 3)  # eos text trimmed
