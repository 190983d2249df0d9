"""An encoder pass split across steps by the encoder budget. A part of
``Scheduler`` (through ``Admission``), kept apart so each file reads as one
concern. No torch here.

Why: a waiting request whose encoder input is larger than what is left of the
step's encoder budget (``max_num_encoder_input_tokens``) used to run its whole
encoder pass in one step while others decode, and their next token waited for
it. Now, while any group runs, such a pass runs a piece per step: rows x layers
of it (``EncoderPiece``), at most the budget's worth (``budget * layers`` units),
in whole layers, or for models that split a layer by rows in multiples of
``encoder_row_granule`` rows; never less than one such granule in a step that
had no other encoder work. The request stays first in the queue meanwhile (the
queue's order holds), and is admitted in the step after the piece that ends its
pass, so that its prefill (whose cross K/V projection over every encoder token
costs about a layer of the pass) is not in the same step as a piece. The worker
keeps the pass's state and then its output between steps
(``encdec.worker.encoder_pieces``). With nothing running, the budget protects
no one: the rest of the pass runs whole, with the prefill.
"""
from __future__ import annotations

from encdec.config import SchedulerConfig
from encdec.core.scheduler_outputs import EncoderPiece, EncoderWork
from encdec.sequence import SequenceGroup


class EncoderSplit:
    """Mixed into ``Scheduler``: ``scheduler_config`` is the scheduler's;
    ``_encoder_work`` collects this step's encoder work."""

    scheduler_config: SchedulerConfig
    _encoder_work: EncoderWork

    def _take_encoder_work(self) -> EncoderWork:
        """This step's encoder work, handed out once (a fresh record for the next)."""
        work, self._encoder_work = self._encoder_work, EncoderWork()
        return work

    def _encoder_left(self, group: SequenceGroup, tokens: int) -> float:
        """What the group's encoder pass has still to run, in whole-pass tokens
        (``tokens``: its encoder tokens to run, 0 when its cross K/V is cached)."""
        layers = self.scheduler_config.encoder_layers
        return tokens - group.encoder_units_done / layers if tokens and layers else tokens

    def _splits(self, group: SequenceGroup, left: float, budget: float | None, busy: bool) -> bool:
        """Whether the group's pass goes (on) in pieces this step: a budget, a model
        that splits, others running or admitted (``busy``), and a pass begun or
        over what is left of the budget. A pass run to its end waits no more."""
        if budget is None or not busy or not left or not self.scheduler_config.encoder_layers:
            return False
        return bool(group.encoder_units_done) or left > budget

    def _piece_units(self, group: SequenceGroup, tokens: int, budget: float, fresh: bool) -> int:
        """Units of the group's next piece within ``budget`` (whole-pass tokens
        left this step; ``fresh``: nothing spent it yet), at most what is left of
        the pass; 0: none this step."""
        cfg = self.scheduler_config
        granule = min(cfg.encoder_row_granule or tokens, tokens)
        units = max(0, int(budget * cfg.encoder_layers) // granule * granule)  # spent below 0: none
        if not units and fresh:
            units = granule  # one granule over the budget: the least a pass can move
        return min(units, tokens * cfg.encoder_layers - group.encoder_units_done)

    def _run_piece(self, group: SequenceGroup, units: int) -> None:
        """Record a piece of ``units`` of the group's pass in this step's work."""
        layers = self.scheduler_config.encoder_layers
        start = group.encoder_units_done
        enc = group.encoder_seq
        self._encoder_work.pieces.append(EncoderPiece(
            group.request_id, enc.data.prompt_token_ids, enc.inputs.get("encoder_features"),
            start, start + units, layers))
        self._encoder_work.tokens += units / layers
        group.encoder_units_done = start + units

    def _encoder_admitted(self, group: SequenceGroup, tokens: int) -> None:
        """The group is admitted with ``tokens`` encoder tokens to run: the rest
        of a split pass (only where nothing ran to split it further) as a piece
        of this step, whose output its prefill reads; an unsplit pass whole in
        the prefill; a pass run to its end (or one computed elsewhere) nothing."""
        done = group.encoder_units_done
        if done and tokens:  # nothing runs now (nobody to protect): the rest of the pass whole
            rest = tokens * self.scheduler_config.encoder_layers - done
            if rest:
                self._run_piece(group, rest)
        else:
            self._encoder_work.tokens += tokens
        group.encoder_units_done = 0  # a recomputed group's pass starts over
