"""A step's results on their way to the host.

``EncoderDecoderModelRunner.execute`` returns once the step's kernels are
queued, as an ``AsyncModelRunnerOutput`` (vLLM V1's name); its ``get_output``
waits for them (first: the sampled tokens' copy to the host) and returns the
typed ``ModelRunnerOutput``. Between the two the caller's host work that needs
none of this step's results runs while a GPU computes.

Also here: the prompt log-probs a prefill asks for, read from the step's hidden
states (``prefill_spans``: where each prefill's rows are).
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from encdec.core.outputs import ModelRunnerOutput, SampledTokens, SingleTokens
from encdec.platform.device_tensors import to_device
from encdec.sample.beam_candidates import BeamRows, select_candidates
from encdec.sample.draft_logprobs import DraftLogprobs
from encdec.sample.sampler import LogprobsTensors, SamplerOutput, compute_prompt_logprobs
from encdec.sequence import Logprob, SequenceGroupMetadata
from encdec.worker.draft_rows import accept


class AskedPosition(NamedTuple):
    """A decoder-prompt position a prefill asks raw log-probs at (SamplingParams.prompt_token_logprobs)."""

    request_id: str
    position: int  # as the request named it (may be negative)
    hidden_index: int  # its row in the step's packed hidden states
    token_ids: list[int]


def prefill_spans(metas: list[SequenceGroupMetadata]) -> Iterator[tuple[SequenceGroupMetadata, Any, int]]:
    """(meta, its first sequence's data, its first row in the step's hidden
    states) per prefill: ``prepare`` packs them first, in order, each whole."""
    start = 0
    for m in metas:
        if not m.is_prompt:
            break
        sd = next(iter(m.seq_data.values()))
        yield m, sd, start
        start += sd.get_len()


def asked_prompt_positions(metas: list[SequenceGroupMetadata]) -> list[AskedPosition]:
    out: list[AskedPosition] = []
    for m, sd, start in prefill_spans(metas):
        asked = m.sampling_params.prompt_token_logprobs
        if asked and sd.get_output_len() == 0:  # not again after a recompute
            n = sd.get_prompt_len()
            out += [AskedPosition(m.request_id, p, start + p % n, ids) for p, ids in asked.items()]
    return out


def prompt_token_logprobs(logits: torch.Tensor,
                          asked: list[AskedPosition]) -> dict[str, dict[int, dict[int, float]]]:
    """Raw log-softmax of each asked row (no processor has touched these rows)."""
    out: dict[str, dict[int, dict[int, float]]] = {}
    if not asked:
        return out
    lps = logits.log_softmax(dim=-1, dtype=torch.float32)
    for row, a in enumerate(asked):
        vals = lps[row, a.token_ids].tolist()
        out.setdefault(a.request_id, {})[a.position] = dict(zip(a.token_ids, vals))
    return out


def prompt_logprobs(model: torch.nn.Module, device: torch.device, metas: list[SequenceGroupMetadata],
                    hidden: torch.Tensor) -> dict[str, list[dict[int, Logprob] | None]]:
    """Decoder-prompt logprobs for prefills that ask: position i's hidden
    state scores prompt token i + 1; the first token has none (None)."""
    out: dict[str, list[dict[int, Logprob] | None]] = {}
    for m, sd, start in prefill_spans(metas):
        k = m.sampling_params.prompt_logprobs
        n_prompt = sd.get_prompt_len()
        if k is not None and sd.get_output_len() == 0:  # not again after a recompute
            targets = to_device(sd.prompt_token_ids[1:], torch.long, device)
            logits = model.compute_logits(hidden[start: start + n_prompt - 1]).float()
            lp = compute_prompt_logprobs(logits, targets, k)
            ids, vals = lp.logprob_token_ids.tolist(), lp.logprobs.tolist()
            ranks = lp.selected_token_ranks.tolist()
            rows: list[dict[int, Logprob] | None] = [None]
            for r in range(n_prompt - 1):
                d = {ids[r][0]: Logprob(vals[r][0], rank=ranks[r])}
                for j in range(1, 1 + k):
                    d.setdefault(ids[r][j], Logprob(vals[r][j], rank=j))
                rows.append(d)
            out[m.request_id] = rows
    return out


def logprob_dicts(tensors: LogprobsTensors | None, wanted: list[int | None]) -> list[dict[int, Logprob]] | None:
    """Per row: the sampled token first, then that request's own top-k."""
    if tensors is None:
        return None
    ids = tensors.logprob_token_ids.tolist()
    vals = tensors.logprobs.tolist()
    ranks = tensors.selected_token_ranks.tolist()
    out = []
    for r, k in enumerate(wanted):
        d = {ids[r][0]: Logprob(vals[r][0], rank=ranks[r])}
        for j in range(1, 1 + (k or 0)):
            d.setdefault(ids[r][j], Logprob(vals[r][j], rank=j))
        out.append(d)
    return out


@dataclass
class AsyncModelRunnerOutput:
    """One step whose kernels are queued; ``get_output`` waits for them."""

    model: torch.nn.Module | None  # the LM head of the prompt logprobs; None: nothing ran
    device: torch.device | None
    metas: list[SequenceGroupMetadata]
    seq_ids: list[int]  # per sampled row, in the persistent batch's order
    wanted_logprobs: list[int | None]  # per sampled row: its request's `logprobs`
    sampler_output: SamplerOutput | None  # None: nothing ran
    beam_rows: BeamRows | None  # where the beam groups' rows are; None: no beam group
    hidden: torch.Tensor | None  # (num_tokens, hidden) the step's hidden states
    prompt_token_logprobs: dict[str, dict[int, dict[int, float]]]  # already on the host
    # speculative decoding: (seq_id, its drafts) per speculating row, and the
    # target's greedy token at each draft row (in that order)
    drafts: list[tuple[int, list[int]]] = field(default_factory=list)
    draft_targets: torch.Tensor | None = None
    sampled_kept: dict[int, list[int]] = field(default_factory=dict)  # rows that sample: verified already
    num_sampled_kept: int = 0
    draft_logprobs: DraftLogprobs | None = None  # the speculating rows' positions, when some row asks log-probs

    @torch.inference_mode()
    def get_output(self) -> ModelRunnerOutput:
        out = self.sampler_output
        if out is None:
            return ModelRunnerOutput(samples=[])
        beam = self.beam_rows
        candidates = select_candidates(beam, out.processed_logprobs) if beam else {}
        beam_seqs = beam.seq_ids if beam else ()
        sampled = out.sampled_token_ids.view(len(self.seq_ids), -1)[:, 0].tolist()
        lp = logprob_dicts(out.logprobs_tensors, self.wanted_logprobs)
        if self.drafts:
            return self._verified(sampled, lp, candidates)
        if lp is None and not beam_seqs:  # the common step: columns, no object per row
            samples, single = [], SingleTokens(self.seq_ids, sampled)
        else:
            samples, single = [SampledTokens(seq_id, [tok], [lp[r]] if lp else [])
                               for r, (seq_id, tok) in enumerate(zip(self.seq_ids, sampled))
                               if seq_id not in beam_seqs], None
        return ModelRunnerOutput(samples=samples, single=single,
                                 prompt_logprobs=prompt_logprobs(self.model, self.device, self.metas, self.hidden),
                                 prompt_token_logprobs=self.prompt_token_logprobs, beam_candidates=candidates)

    def _verified(self, sampled: list[int], lp: list | None, candidates: dict) -> ModelRunnerOutput:
        """A step with drafts: each speculating row appends the tokens it keeps
        (``draft_rows.accept``), the others their sampled token."""
        first = dict(zip(self.seq_ids, sampled))
        kept, num_kept = accept(self.drafts, first, self.draft_targets.tolist(), self.sampled_kept)
        kept.update(self.sampled_kept)
        num_kept += self.num_sampled_kept
        kept_lps = self._kept_logprobs(kept)
        beam_seqs = self.beam_rows.seq_ids if self.beam_rows else ()
        samples = [SampledTokens(seq_id, kept[seq_id], kept_lps.get(seq_id, [])) if seq_id in kept
                   else SampledTokens(seq_id, [tok], [lp[r]] if lp else [])
                   for r, (seq_id, tok) in enumerate(zip(self.seq_ids, sampled)) if seq_id not in beam_seqs]
        return ModelRunnerOutput(samples=samples, prompt_logprobs=prompt_logprobs(self.model, self.device, self.metas,
                                                                                  self.hidden),
                                 prompt_token_logprobs=self.prompt_token_logprobs, beam_candidates=candidates,
                                 num_draft_tokens=sum(len(d) for _, d in self.drafts), num_accepted_tokens=num_kept,
                                 num_drafts=sum(1 for _, d in self.drafts if d))

    def _kept_logprobs(self, kept: dict[int, list[int]]) -> dict[int, list[dict[int, Logprob]]]:
        """seq_id -> per kept token what the sampler would report for it, for
        the speculating rows whose request asks log-probs."""
        wanted = dict(zip(self.seq_ids, self.wanted_logprobs))
        dl = self.draft_logprobs
        asking = {sid: toks for sid, toks in kept.items() if wanted.get(sid) is not None}
        if dl is None or not asking:
            return {}
        owners, tensors = dl.gather(asking)
        out: dict[int, list[dict[int, Logprob]]] = {}
        for sid, d in zip(owners, logprob_dicts(tensors, [wanted[sid] for sid in owners])):
            out.setdefault(sid, []).append(d)
        return out

    @classmethod
    def empty(cls) -> AsyncModelRunnerOutput:
        """A step with nothing to run."""
        return cls(None, None, [], [], [], None, None, None, {})
