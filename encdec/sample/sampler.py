"""Turning one step's logits into one token per row (vLLM V1's sampler, seed 003)."""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import torch
from torch import nn

from encdec.kernels.cpu.greedy_cpu import greedy_argmax, greedy_logprobs
from encdec.platform.device_tensors import to_device
from encdec.sample.metadata import SamplingMetadata
from encdec.structured_output.bitmask import apply_bitmask

_SAMPLING_EPS = 1e-5  # temperature below this = greedy (matches SamplingParams)


@dataclass
class LogprobsTensors:
    logprob_token_ids: torch.Tensor  # (num_rows, k + 1) int64: chosen token, then the top k
    logprobs: torch.Tensor  # (num_rows, k + 1) float32, raw or processed (the row's logprobs_mode)
    selected_token_ranks: torch.Tensor  # (num_rows,) int64, 1-based rank of the chosen token


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # (num_reqs, 1) int64, one token per row (V1 shape)
    logprobs_tensors: LogprobsTensors | None  # None unless some row asked for logprobs
    # (len(logprob_rows), vocab) float32: those rows' log-probs after the processors
    # (beam search scores these, as HF does); None when no rows were given
    processed_logprobs: torch.Tensor | None = None


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    return logits.log_softmax(dim=-1, dtype=torch.float32)  # (num_rows, vocab)


def gather_logprobs(logprobs: torch.Tensor, num_logprobs: int,
                    token_ids: torch.Tensor) -> LogprobsTensors:
    """The chosen token's logprob and rank, then the ``num_logprobs`` best."""
    token_ids = token_ids.long().unsqueeze(-1)  # (num_rows, 1)
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)  # (num_rows, k)
    token_logprobs = logprobs.gather(-1, token_ids)  # (num_rows, 1)
    # Rank = how many tokens are at least as likely (ties share the worse rank).
    ranks = (logprobs >= token_logprobs).sum(-1)  # (num_rows,)
    return LogprobsTensors(
        torch.cat((token_ids, top_ids), dim=1),
        torch.cat((token_logprobs, top_logprobs), dim=1),
        ranks,
    )


def compute_prompt_logprobs(logits: torch.Tensor, target_token_ids: torch.Tensor,
                            num_logprobs: int) -> LogprobsTensors:
    """Prompt logprobs: ``logits`` (num_positions, vocab) predict the decoder-prompt
    tokens ``target_token_ids`` (num_positions,), i.e. the prompt shifted by one.
    Raw logits, no processors, as vLLM does."""
    return gather_logprobs(compute_logprobs(logits), num_logprobs, target_token_ids)


def apply_bad_words(logits: torch.Tensor, bad_words: dict[int, list[list[int]]],
                    output_token_ids: list[list[int]]) -> None:
    """Ban a bad word's last token where the output ends with the word's prefix.
    The matching is list bookkeeping on the few rows that have bad words; the
    ban is one tensor write."""
    rows: list[int] = []
    cols: list[int] = []
    for row, words in bad_words.items():
        out = output_token_ids[row]
        for word in words:
            n = len(word) - 1
            if n == 0 or (n <= len(out) and out[-n:] == word[:-1]):
                rows.append(row)
                cols.append(word[-1])
    if rows:
        logits[rows, cols] = float("-inf")


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """vLLM's definitions: repetition over decoder prompt and output (divide
    positive logits, multiply negative ones); frequency and presence over the
    output only (OpenAI's)."""
    num_reqs, vocab = logits.shape
    outs = md.output_token_ids
    lens = to_device([len(o) for o in outs], torch.long, logits.device)  # (num_reqs,)
    cols = to_device(list(chain.from_iterable(outs)), torch.long, logits.device)
    rows = torch.repeat_interleave(torch.arange(num_reqs, device=logits.device), lens, output_size=len(cols))
    counts = logits.new_zeros(num_reqs, vocab)  # (num_reqs, vocab) output token counts
    counts.index_put_((rows, cols), torch.ones_like(cols, dtype=logits.dtype), accumulate=True)
    output_mask = counts > 0
    seen = output_mask.clone()
    if md.prompt_token_ids is not None:  # padding (= vocab) lands in a spare column
        prompt_mask = torch.zeros(num_reqs, vocab + 1, dtype=torch.bool, device=logits.device)
        prompt_mask.scatter_(1, md.prompt_token_ids, True)
        seen |= prompt_mask[:, :vocab]
    rep = md.repetition_penalties.unsqueeze(1)  # (num_reqs, 1)
    penalties = torch.where(seen, rep, 1.0)  # (num_reqs, vocab)
    logits = torch.where(logits > 0, logits / penalties, logits * penalties)
    logits -= md.frequency_penalties.unsqueeze(1) * counts
    logits -= md.presence_penalties.unsqueeze(1) * output_mask
    return logits


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None,
                      p: torch.Tensor | None) -> torch.Tensor:
    """Mask all but the ``k`` best tokens, then all but the smallest set whose
    probability reaches ``p``. Rows with ``k == vocab`` / ``p == 1`` are untouched."""
    if k is None and p is None:
        return logits
    if p is None:
        # topk is much cheaper than a full sort when only k is used.
        off = k == logits.shape[1]  # (num_reqs,)
        k = k.masked_fill(off, 1)
        top = logits.topk(int(k.max()), dim=-1).values  # (num_reqs, max_k)
        threshold = top.gather(1, (k - 1).unsqueeze(1))  # (num_reqs, 1)
        threshold.masked_fill_(off.unsqueeze(1), float("-inf"))
        return logits.masked_fill_(logits < threshold, float("-inf"))
    logits_sort, logits_idx = logits.sort(dim=-1)  # ascending, (num_reqs, vocab)
    if k is not None:
        kth = logits_sort.gather(1, (logits.shape[1] - k).unsqueeze(1))  # (num_reqs, 1)
        logits_sort.masked_fill_(logits_sort < kth, float("-inf"))
    cum = logits_sort.softmax(dim=-1).cumsum(dim=-1)  # (num_reqs, vocab), ascending mass
    drop = cum <= 1 - p.unsqueeze(1)
    drop[:, -1] = False  # the best token always stays
    logits_sort.masked_fill_(drop, float("-inf"))
    return logits.scatter_(-1, logits_idx, logits_sort)


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator],
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """Inverse-CDF sampling: one uniform ``u`` per row, the first token whose
    cumulative probability reaches ``(1 - u)`` of the row's total. A zero-
    probability token adds nothing to the cumulative sum, so it is never chosen,
    and nothing syncs with the host. Seeded rows draw their ``u`` from their own
    generator (one draw per sampled token), so their tokens do not depend on the
    rest of the batch; the others from ``generator`` (the engine's; None =
    torch's global one).

    Hand-written in place of vLLM's exponential race (``argmax(probs / q)``,
    ``q ~ Exp(1)``), measured: torch draws exponentials at ~20 ns an element on
    this CPU, 1.05 ms per row of Whisper's 51865 tokens, drawn for every row of
    a batch that had one sampling row (11 ms a step at 9 rows, 6% of a long
    Whisper run with fallback retries); cumsum and searchsorted take 0.05 ms a row."""
    u = torch.empty(probs.shape[0], 1, dtype=probs.dtype, device=probs.device)  # (num_reqs, 1)
    if len(generators) != probs.shape[0]:
        u.uniform_(generator=generator)
    for row, gen in generators.items():  # one draw per seeded row
        u[row].uniform_(generator=gen)
    cdf = probs.cumsum(dim=-1)  # (num_reqs, vocab)
    target = (1.0 - u).mul_(cdf[:, -1:])  # in (0, total]: never before the first nonzero token
    return torch.searchsorted(cdf, target).squeeze(1).clamp_(max=probs.shape[1] - 1)


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum, as ``logits.argmax(-1)``: the C kernel on CPU
    where it applies (``greedy_argmax``), torch's otherwise."""
    tok = greedy_argmax(logits)
    return logits.argmax(dim=-1) if tok is None else tok


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The tokens a greedy row no processor acts on samples (float32 logits,
    first maximum): what speculative decoding compares draft tokens with."""
    return _argmax(logits.float())


class Sampler(nn.Module):
    """Samples one token per row. Steps, in order:

    1. raw logprobs (log_softmax of the model's logits), if any row asks for them
    2. logits to float32 (edited in place from here on)
    3. allowed_token_ids: mask every other token
    4. bad words: ban the last token of a word whose prefix ends the output
    5. non-argmax-invariant processors (min-tokens, logit bias, custom)
    6. repetition, frequency and presence penalties
    6a. structured outputs: each constrained row's grammar mask (``token_bitmask``)
    6b. log-softmax of rows with logprobs_mode="processed_logprobs" (their reported logprobs)
    7. greedy rows: argmax; if every row is greedy, stop here
    8. temperature
    9. argmax-invariant processors (min-p, custom)
    10. top-k, then top-p
    11. softmax and inverse-CDF sampling (per-row generators for seeded rows)
    12. logprobs of the sampled token (rank among the reported ones) and the top k

    An all-greedy batch with no logprobs, penalties, allowed ids or bad words
    costs steps 2, 5 (no-ops for idle processors) and one argmax. An all-greedy
    batch that reports only the chosen token's processed log-prob (``logprobs=0``,
    a Whisper transcription's every step) takes 6b, 7 and 12 in one pass on CPU
    (``greedy_cpu``), no vocab-wide log-softmax written.
    """

    def __init__(self, generator: torch.Generator | None = None):
        super().__init__()
        self.generator = generator  # unseeded rows draw from it; None = torch's global RNG

    def forward(self, logits: torch.Tensor, sampling_metadata: SamplingMetadata, *,
                logprob_rows: torch.Tensor | slice | None = None) -> SamplerOutput:
        """``logprob_rows``: rows that become float32 log-probs before step 3 (HF's
        beam search applies its processors to log-probs) and are returned, processed,
        as ``processed_logprobs``; their sampled tokens are meaningless. A slice (a
        run of rows in order) is read through views: when it covers the whole
        batch, no row is copied and none is sampled."""
        md = sampling_metadata
        num_logprobs, rows = md.max_num_logprobs, md.processed_logprobs_rows
        # (num_reqs, vocab): the log-probs each row's `logprobs` reports; raw ones
        # only when some row reports them
        reported = compute_logprobs(logits) if num_logprobs is not None and md.raw_logprobs else None
        logits = logits.to(torch.float32)  # (num_reqs, vocab)
        whole = isinstance(logprob_rows, slice) and logprob_rows.indices(len(logits))[:2] == (0, len(logits))
        if whole:
            logits = compute_logprobs(logits)
        elif isinstance(logprob_rows, slice):
            logits[logprob_rows] = compute_logprobs(logits[logprob_rows])
        elif logprob_rows is not None:
            logits[logprob_rows] = compute_logprobs(logits.index_select(0, logprob_rows))
        logits = self.apply_logits_processors(logits, md)
        if reported is None and rows is not None and num_logprobs == 0 and md.all_greedy and logprob_rows is None:
            fast = greedy_logprobs(logits)  # steps 6b, 7 and 12 at once (class docstring)
            if fast is not None:
                tok, lp, rank = fast
                return SamplerOutput(tok.unsqueeze(-1), LogprobsTensors(tok.unsqueeze(-1), lp.unsqueeze(-1), rank))
        if rows is not None:  # logprobs_mode="processed_logprobs": before temperature edits the logits
            if reported is None:  # no raw rows: one pass over every row (the others report nothing)
                reported = compute_logprobs(logits)
            else:
                reported.index_copy_(0, rows, compute_logprobs(logits.index_select(0, rows)))
        processed = None
        if isinstance(logprob_rows, slice):  # sampling may edit logits in place: a view only if it cannot
            processed = logits[logprob_rows] if md.all_greedy else logits[logprob_rows].clone()
        elif logprob_rows is not None:
            processed = logits.index_select(0, logprob_rows)
        if whole:  # beams alone: their sampled tokens are not read
            sampled = torch.zeros(len(logits), dtype=torch.long, device=logits.device)
        else:
            sampled = self.sample(logits, md)  # (num_reqs,)
        logprobs = None
        if reported is not None:
            logprobs = gather_logprobs(reported, num_logprobs, sampled)
        return SamplerOutput(sampled.unsqueeze(-1), logprobs, processed)

    def apply_logits_processors(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Steps 3-6a: everything that may change the argmax."""
        if md.allowed_token_ids_mask is not None:
            logits.masked_fill_(md.allowed_token_ids_mask, float("-inf"))
        if md.bad_words_token_ids:
            apply_bad_words(logits, md.bad_words_token_ids, md.output_token_ids)
        for proc in md.logitsprocs.non_argmax_invariant:
            logits = proc.apply(logits)
        if not md.no_penalties:
            logits = apply_penalties(logits, md)
        if md.token_bitmask is not None:
            apply_bitmask(logits, md.token_bitmask)
        return logits

    def apply_sampling_filters(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Steps 8-10, for rows that sample randomly."""
        temp = md.temperature
        if not md.all_random:  # greedy rows hold 0; keep them finite
            temp = torch.where(temp < _SAMPLING_EPS, 1.0, temp)
        logits.div_(temp.unsqueeze(1))
        for proc in md.logitsprocs.argmax_invariant:
            logits = proc.apply(logits)
        return apply_top_k_top_p(logits, md.top_k, md.top_p)

    def sample(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Steps 7-11; returns (num_reqs,) int64."""
        if md.all_greedy:  # an empty batch is both all-greedy and all-random
            return _argmax(logits)  # (num_reqs,)
        greedy = None if md.all_random else _argmax(logits)  # (num_reqs,)
        logits = self.apply_sampling_filters(logits, md)
        probs = logits.softmax(dim=-1, dtype=torch.float32)  # (num_reqs, vocab)
        sampled = random_sample(probs, md.generators, self.generator)
        if greedy is None:
            return sampled
        return torch.where(md.temperature < _SAMPLING_EPS, greedy, sampled)
