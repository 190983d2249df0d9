"""Beam search's decisions: a beam request's beams are the decoder sequences
of its one ``SequenceGroup``; the scheduler asks for each step's decisions and
applies them (``Scheduler.update``).

The group is created with ``beam_width`` sequences sharing the decoder prompt's
blocks and the request's single cross-attention table; beam j's running score is
its sequence's ``cumulative_logprob`` (HF starts beams 1..k-1 at -1e9, so the
first step draws every candidate from beam 0). After each step
(``decide``), the new running beams are made from their parents:

    parent kept by one new beam    the sequence appends the token in place
    parent kept by m > 1 beams     m - 1 forks (block manager ``fork``: shared
                                   blocks, copy-on-write of the last one later)
    parent kept by none            freed

so a step copies at most one partly filled block per fork, never a beam's whole
KV. Finished hypotheses are copied out as token lists into a pool of the k
best (HF's ``beam_scores``), held on the group (``SequenceGroup.beam_state``);
when HF's stopping rules say so the group's sequences finish and
``make_output`` returns the pool, best first.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from encdec.beam_search.scorer import RequestScalars, beam_step
from encdec.core.outputs import BeamCandidates
from encdec.core.scheduler_outputs import BeamDecision, BeamUpdate
from encdec.outputs import CompletionOutput, RequestOutput
from encdec.sampling_params import BeamRowParams, SamplingType
from encdec.sequence import Sequence, SequenceGroup, SequenceStatus

_NEG = -1.0e9


@dataclass
class BeamCompletionOutput(CompletionOutput):
    score: float = 0.0  # HF's length-normalised score (sequences_scores)
    # sum of the tokens' log-probs, each step's row renormalised after the processors
    # (HF Whisper's _retrieve_avg_logprobs numerator; cumulative_logprob is not
    # renormalised); None unless BeamSearchParams.renormalized_logprob
    renormalized_logprob: float | None = None


@dataclass
class _Hypothesis:
    tokens: list[int]  # decoder prompt + generated ids
    cum_logprob: float
    renormalized_logprob: float | None
    finish_reason: str
    stop_reason: int | str | None


class _BeamState:
    """One request's search state beyond its running sequences."""

    def __init__(self, group: SequenceGroup, params: BeamRowParams, forced_bos_in_prompt: bool):
        self.params = params
        k = params.beam.beam_width
        prompt_len = len(group.prompt_token_ids)
        self.prompt_len = prompt_len
        # HF counts a forced BOS as generated; BART's default prompt holds it.
        self.hf_prompt_len = prompt_len - int(forced_bos_in_prompt)
        self.max_length = prompt_len + params.max_tokens  # engine caps max_tokens at entry
        self.pool_scores = torch.full((k,), _NEG, dtype=torch.float32)
        self.pool_finished = torch.zeros(k, dtype=torch.bool)
        self.pool: list[_Hypothesis | None] = [None] * k  # None: not a finished hypothesis
        self.improvable = True
        self.renormalized: dict[int, float] = {}  # seq_id -> its path's renormalised log-prob sum


class BeamSearchManager:
    """The scheduler calls ``start`` (a beam group enters its queues) and
    ``decide`` (each step's decisions, which it applies); the output side calls
    ``make_output`` (finished). Holds no request: each group's state rides on
    the group, and goes with it. ``seq_counter``: the engine's source of
    decoder seq ids, for the forks it decides."""

    def __init__(self, seq_counter: Iterator[int], tokenizer: Any):
        self._seq_counter = seq_counter
        self._tokenizer = tokenizer

    def start(self, group: SequenceGroup) -> None:
        params: BeamRowParams = group.sampling_params
        assert params.sampling_type is SamplingType.BEAM
        for seq in group.get_seqs()[1:]:
            seq.data.cumulative_logprob = _NEG
        bos = params.beam.forced_bos_token_id
        prompt = group.prompt_token_ids
        forced_bos_in_prompt = bos is not None and len(prompt) == 2 and prompt[1] == bos
        group.beam_state = _BeamState(group, params, forced_bos_in_prompt)

    # -- one step ----------------------------------------------------------------
    def decide(self, candidates: dict[str, BeamCandidates],
               groups: dict[str, SequenceGroup]) -> list[BeamDecision]:
        """This step's beams of each group in ``candidates``; changes no sequence
        (only the groups' search states)."""
        buckets: dict[tuple[int, int], list[str]] = {}
        for request_id, cand in candidates.items():
            state = groups[request_id].beam_state
            key = (state.params.beam.beam_width, len(cand.scores))
            buckets.setdefault(key, []).append(request_id)
        return [d for ids in buckets.values() for d in self._process_bucket(ids, candidates, groups)]

    def _process_bucket(self, ids: list[str], candidates: dict[str, BeamCandidates],
                        groups: dict[str, SequenceGroup]) -> list[BeamDecision]:
        scalars, ends, reasons = [], [], []
        for request_id in ids:
            group, cand = groups[request_id], candidates[request_id]
            state = group.beam_state
            seqs = group.get_seqs(SequenceStatus.RUNNING)
            cur_len = seqs[0].get_len()
            beam = state.params.beam
            # One beam is HF's greedy search (generate(num_beams=1)): stop at the first end.
            early = True if beam.beam_width == 1 else beam.early_stopping
            scalars.append(RequestScalars(cur_len, state.hf_prompt_len, state.max_length,
                                          beam.length_penalty, early))
            why = [self._end_reason(state, seqs[p], t, cur_len) for p, t in zip(cand.parents, cand.tokens)]
            reasons.append(why)
            ends.append([w is not None for w in why])
        states = [groups[i].beam_state for i in ids]
        step = beam_step(
            scalars, torch.tensor([candidates[i].scores for i in ids], dtype=torch.float32),
            torch.tensor(ends, dtype=torch.bool), torch.stack([s.pool_scores for s in states]),
            torch.stack([s.pool_finished for s in states]), torch.tensor([s.improvable for s in states]))
        running, running_scores = step.running.tolist(), step.running_scores.tolist()
        pool_from, done = step.pool_from.tolist(), step.done.tolist()
        decisions = []
        for r, request_id in enumerate(ids):
            state, group, cand = states[r], groups[request_id], candidates[request_id]
            seqs = group.get_seqs(SequenceStatus.RUNNING)
            k = len(state.pool)
            state.pool_scores = step.pool_scores[r].clone()
            state.pool_finished = step.pool_finished[r].clone()
            # Only finished entries hold a hypothesis; the rest are HF's -1e9 placeholders.
            state.pool = [None if not finished else state.pool[i] if i < k
                          else self._hypothesis(state, seqs, cand, i - k, reasons[r][i - k])
                          for i, finished in zip(pool_from[r], state.pool_finished.tolist())]
            state.improvable = bool(step.improvable[r])
            decisions.append(BeamDecision(request_id, finished=True) if done[r]
                             else self._advance(state, request_id, seqs, cand, running[r], running_scores[r]))
        return decisions

    def _end_reason(self, state: _BeamState, parent: Sequence, token: int,
                    cur_len: int) -> tuple[str, int | str | None] | None:
        """HF's stopping criteria for one candidate: eos / stop token, stop string, max length."""
        params = state.params
        if token in params.all_stop_token_ids:
            return "stop", (token if token in params.stop_token_ids else None)
        if params.stop:
            text = self._tokenizer.decode(parent.get_output_token_ids() + [token],
                                          skip_special_tokens=params.skip_special_tokens)
            for stop in params.stop:
                if text.endswith(stop):
                    return "stop", stop
        if cur_len + 1 >= state.max_length:
            return "length", None
        return None

    @staticmethod
    def _renormalized(state: _BeamState, seqs: list[Sequence], cand: BeamCandidates, c: int) -> float | None:
        """Candidate ``c``'s path sum of renormalised log-probs (its parent's plus its
        token's); None when the request did not ask for it."""
        if cand.token_logprobs is None:
            return None
        return state.renormalized.get(seqs[cand.parents[c]].seq_id, 0.0) + cand.token_logprobs[c]

    def _hypothesis(self, state: _BeamState, seqs: list[Sequence], cand: BeamCandidates, c: int,
                    reason: tuple[str, int | str | None]) -> _Hypothesis:
        return _Hypothesis(seqs[cand.parents[c]].get_token_ids() + [cand.tokens[c]], cand.scores[c],
                           self._renormalized(state, seqs, cand, c), reason[0], reason[1])

    def _advance(self, state: _BeamState, request_id: str, seqs: list[Sequence],
                 cand: BeamCandidates, chosen: list[int], scores: list[float]) -> BeamDecision:
        """The group's new running beams (candidates ``chosen``), in order: the
        first beam made from a parent keeps its sequence, the others fork it."""
        beams: list[BeamUpdate] = []
        claimed: set[int] = set()
        for c, score in zip(chosen, scores):
            parent = seqs[cand.parents[c]]
            seq_id = next(self._seq_counter) if parent.seq_id in claimed else parent.seq_id
            claimed.add(parent.seq_id)
            beams.append(BeamUpdate(parent.seq_id, seq_id, cand.tokens[c], score))
        state.renormalized = {b.seq_id: self._renormalized(state, seqs, cand, c)
                              for b, c in zip(beams, chosen)}
        return BeamDecision(request_id, finished=False, beams=beams,
                            dropped=[s.seq_id for s in seqs if s.seq_id not in claimed])

    # -- results -----------------------------------------------------------------
    def make_output(self, group: SequenceGroup) -> RequestOutput:
        state = group.beam_state
        if state is None or group.error is not None:
            return RequestOutput.from_seq_group(group)
        params = state.params
        scores = state.pool_scores.tolist()
        outputs = []
        for i, hyp in enumerate(state.pool[: params.beam.num_return_sequences]):
            if hyp is None:
                continue
            generated = hyp.tokens[state.prompt_len:]
            text = self._tokenizer.decode(generated, skip_special_tokens=params.skip_special_tokens)
            if isinstance(hyp.stop_reason, str) and not params.include_stop_str_in_output:
                text = text[: len(text) - len(hyp.stop_reason)]
            outputs.append(BeamCompletionOutput(
                index=i, text=text, token_ids=generated, cumulative_logprob=hyp.cum_logprob,
                logprobs=None, finish_reason=hyp.finish_reason, stop_reason=hyp.stop_reason,
                score=scores[i], renormalized_logprob=hyp.renormalized_logprob))
        base = RequestOutput.from_seq_group(group)
        base.outputs = outputs
        return base
