"""What a step leaves behind as text and ``RequestOutput``s, owned in one place.

The engine builds one ``OutputProcessor`` and hands the scheduler its two
deciders, which ``Scheduler.update`` applies each step:

    stop_checker  after each sampled token: its text, then whether the
                  sequence ends
    beams         each beam group's next beams, from the sampler's candidates
                  (HF's rules; a group's search state rides on the group)

and owns what they leave behind:

    text          a token that does not end its sequence may leave its text
                  owed (``StopChecker.check(defer_text=True)``, where no stop
                  string needs it); owed text is decoded here before any
                  output is made (``settle_text``), and by the stop checker,
                  whole, when a sequence ends. A batch job's request is decoded
                  once, at its end, not token by token
    outputs       ``make_output``: a finished group as a ``RequestOutput`` (a
                  beam group's from its finished hypotheses)
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from encdec.beam_search.manager import BeamSearchManager
from encdec.core.stop_checker import StopChecker
from encdec.outputs import Detokenizer, RequestOutput
from encdec.sampling_params import SamplingType
from encdec.sequence import SequenceGroup


class OutputProcessor:
    """``seq_ids``: the engine's source of decoder sequence ids (beam forks take
    theirs from it)."""

    def __init__(self, tokenizer: Any, *, max_model_len: int, eos_token_id: int | None,
                 seq_ids: Iterator[int]):
        self.stop_checker = StopChecker(max_model_len, detokenizer=Detokenizer(tokenizer),
                                        eos_token_id=eos_token_id)
        self.beams = BeamSearchManager(seq_ids, tokenizer)

    def make_output(self, group: SequenceGroup) -> RequestOutput:
        """A finished group's output (an aborted sequence's owed text decoded first)."""
        if group.sampling_params.sampling_type is SamplingType.BEAM:
            return self.beams.make_output(group)
        self._settle(group)
        return RequestOutput.from_seq_group(group)

    def partial_outputs(self, groups: Iterable[SequenceGroup]) -> dict[str, RequestOutput]:
        """What unfinished groups have produced so far, every token's text included."""
        out = {}
        for group in groups:
            self._settle(group)
            out[group.request_id] = RequestOutput.from_seq_group(group)
        return out

    def _settle(self, group: SequenceGroup) -> None:
        for seq in group.seqs:
            if seq.num_text_tokens < seq.get_output_len():
                self.stop_checker.settle_text(seq, group.sampling_params)
