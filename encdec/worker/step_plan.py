"""What the model runner packs for a step and runs later: ``ModelInput`` (one
packed forward) and ``StepPlan`` (a step packed on the host, not yet run:
the engine plans step N+1 while step N runs on the device)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from encdec.attention.backends.abstract import AttentionMetadata
from encdec.core.scheduler_outputs import SchedulerOutputs
from encdec.platform.device_tensors import to_device
from encdec.sequence import SequenceGroupMetadata
from encdec.worker.prefill_rows import SampledRow


@dataclass
class ModelInput:
    """One step's packed model inputs, built by ``prepare`` (scheduler -> model)."""

    input_ids: torch.Tensor  # (num_tokens,) int64 decoder tokens: prefill sequences', then one per decode
    positions: torch.Tensor  # (num_tokens,) int64 decoder position of each token
    attn_metadata: AttentionMetadata  # where each sequence's tokens and KV live; shared by all layers
    encoder_inputs: dict[str, Any]  # keyword args of the model's encoder for the step's prefills; {} if none
    sampled_rows: list[SampledRow]  # every sequence sampled this step, prefills first
    # (index in input_ids, its sequence's data) of rows scheduled ahead: their input
    # token is the one the step before samples, written in by ``run`` once appended
    owed: list[tuple[int, Any]]
    # speculative decoding: (seq_id, index of its first draft row, its drafts) per speculating row
    drafts: list[tuple[int, int, list[int]]] = field(default_factory=list)

    def fill_owed(self) -> None:
        if self.owed:
            index = to_device([i for i, _ in self.owed], torch.long, self.input_ids.device)
            tokens = to_device([sd.get_last_token_id() for _, sd in self.owed], torch.long, self.input_ids.device)
            self.input_ids.index_copy_(0, index, tokens)


@dataclass
class StepPlan:
    """A step packed on the host, not yet run (``plan``, then ``run``): the
    engine plans step N+1 while step N runs on the device (async scheduling)."""

    metas: list[SequenceGroupMetadata]
    sched: SchedulerOutputs
    parts: list[ModelInput]  # one packed step, or (prefills, decode rows: a graph's or the CPU's fused step)
    bucket: int | None  # the CUDA graph the (last) part replays; None: eager
    small: bool  # a small CPU decode step: one thread
    blocks_moved: bool = False  # the step's swaps and copies done while planning (a draft model reads the cache)
    # parts[0] only runs its prefills' encoder and writes their cross K/V; parts[1] holds every row,
    # those prefills as decode rows (admits_as_decodes)
    admitted: bool = False

    @property
    def decode_offset(self) -> int:
        """Where the last part's rows start in the step's hidden states."""
        return len(self.parts[0].input_ids) if len(self.parts) == 2 and not self.admitted else 0


# A split step's prefills run on one thread where their tokens x d_model^2 is at most
# this: each op's parallel region then costs more than its work (under
# OMP_WAIT_POLICY=PASSIVE every region wakes the sleeping workers). Measured (the
# copy-task BART, d_model 128, 60-token documents, AMD EPYC AVX-512, 2 threads): a
# prefill step of 1 document 2.3 -> 1.9 ms on one thread, 3 documents 4.2 -> 3.2 ms,
# 64 documents 36 -> 32 ms (4M to 63M); Whisper's window (1500 x 384^2, 221M) and a
# bart-base document (768^2 a token) are compute-bound: two threads.
ONE_THREAD_PREFILL_WORK = 1 << 23


def splits_admission(device: torch.device, model: Any, metas: list[SequenceGroupMetadata], n: int,
                     drafts: dict[int, list[int]] | None, max_rows: int) -> bool:
    """Whether a CPU step that admits requests (its first ``n`` metas) beside
    decoding ones runs as two parts: its prefills op by op, then its decode
    rows (and drafts) as the one C call of a decode-only step
    (``fuses_decode_steps``), at most ``max_rows`` of them. Packed as one, every
    row ran op by op: under continuous admission (requests finishing and joining
    every few steps) nearly every step is such a step."""
    if device.type != "cpu" or not 0 < n < len(metas):
        return False
    fuses = getattr(model, "fuses_decode_steps", None)
    if fuses is None or not fuses():
        return False
    return _decode_rows(metas, n, drafts) <= max_rows


def _decode_rows(metas: list[SequenceGroupMetadata], n: int, drafts: dict[int, list[int]] | None) -> int:
    """Query rows of a step's decoding sequences (its metas past the first ``n``) and their drafts."""
    return sum(len(m.seq_data) for m in metas[n:]) + sum(map(len, (drafts or {}).values()))


def one_thread_prefills(inp: ModelInput, d_model: int | None) -> bool:
    """Whether a split step's prefill part (``inp``) runs on one thread
    (``ONE_THREAD_PREFILL_WORK``); False where the model's width is unknown."""
    md = inp.attn_metadata
    return bool(d_model) and (md.num_encoder_tokens + md.num_prefill_tokens) * d_model ** 2 <= ONE_THREAD_PREFILL_WORK


# The longest decoder prompt a prefill may have to ride the fused decode step's C
# call (admits_as_decodes): BART's (decoder start, bos), T5's and Marian's (one
# token), Whisper's task prompt (3-4 tokens). A longer one (Whisper's previous text,
# up to 224 tokens) is a prefill the C call's few-row loops were not made for.
ADMIT_MAX_PROMPT = 8


def admits_as_decodes(model: Any, metas: list[SequenceGroupMetadata], n: int,
                      drafts: dict[int, list[int]] | None, max_rows: int) -> bool:
    """Whether a split step's prefills (its first ``n`` metas) join its decode
    rows and ``drafts`` in the one C call (at most ``max_rows`` in all): each is one sequence with a short decoder prompt
    (``ADMIT_MAX_PROMPT``), whose pass through the decoder is then a decode
    sequence's query rows from position 0, causal among themselves, once its
    cross K/V is in the cache (``write_cross_kv``). Run op by op, the prefills
    read every decoder weight a second time in the step. A prefill asking for
    its prompt's log-probs, past cached tokens or in chunks, or whose positions
    count its tokens (``admits_prompt``) runs op by op."""
    if not hasattr(model, "write_cross_kv"):
        return False
    rows = _decode_rows(metas, n, drafts)
    for m in metas[:n]:
        if len(m.seq_data) != 1 or not m.do_sample or m.sampling_params.prompt_logprobs is not None:
            return False
        sd = next(iter(m.seq_data.values()))
        p = sd.get_len()
        if (p > ADMIT_MAX_PROMPT or m.token_chunk_size != p or sd.get_num_computed_tokens()
                or not model.admits_prompt(sd.get_token_ids())):
            return False
        rows += p
    return rows <= max_rows
