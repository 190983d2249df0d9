"""Plain per-row reference of the sampler, written for clarity, not speed, plus
helpers that drive a real ``InputBatch``."""
from __future__ import annotations

from collections import Counter

import torch

from encdec.sample.logits_processor import build_logitsprocs
from encdec.sampling_params import SamplingParams
from encdec.worker.input_batch import InputBatch

NEG_INF = float("-inf")


class FakeTokenizer:
    """Whitespace words; a word with its leading space is a different token."""

    vocab = {"foo": 10, " foo": 11, "bar": 12, " bar": 13, "baz": 14, " baz": 15}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        pieces = []
        for i, word in enumerate(text.split(" ")):
            if word:
                pieces.append(word if i == 0 else " " + word)
        return [self.vocab[p] for p in pieces]


def ref_processed(row: torch.Tensor, params: SamplingParams, prompt: list[int],
                  output: list[int]) -> torch.Tensor:
    """Steps 3-6 of the sampler on one row, token by token."""
    x = row.clone().float()
    vocab = x.numel()
    if params.allowed_token_ids is not None:
        for t in range(vocab):
            if t not in params.allowed_token_ids:
                x[t] = NEG_INF
    for word in params.bad_words_token_ids or []:
        prefix = word[:-1]
        if len(prefix) <= len(output) and output[len(output) - len(prefix):] == prefix:
            x[word[-1]] = NEG_INF
    if len(output) < params.min_tokens:
        for t in params.all_stop_token_ids:
            x[t] = NEG_INF
    for t, bias in (params.logit_bias or {}).items():
        x[t] += bias
    for t in set(prompt) | set(output):
        p = params.repetition_penalty
        x[t] = x[t] / p if x[t] > 0 else x[t] * p
    for t, count in Counter(output).items():
        x[t] -= params.frequency_penalty * count
        x[t] -= params.presence_penalty
    return x


def ref_filtered(x: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Steps 8-10 on one processed row of a random-sampling request."""
    x = x / params.temperature
    if params.min_p > 0:
        probs = x.softmax(-1)
        x = torch.where(probs < params.min_p * probs.max(), NEG_INF, x)
    if 0 < params.top_k < x.numel():
        kth = sorted(x.tolist(), reverse=True)[params.top_k - 1]
        x = torch.where(x < kth, NEG_INF, x)
    if params.top_p < 1.0:
        probs = x.softmax(-1)
        mass_before = 0.0
        keep = torch.zeros_like(x, dtype=torch.bool)
        for t in sorted(range(x.numel()), key=lambda t: -x[t].item()):
            keep[t] = mass_before < params.top_p
            mass_before += probs[t].item()
        x = torch.where(keep, x, NEG_INF)
    return x


def ref_token(row: torch.Tensor, params: SamplingParams, prompt: list[int],
              output: list[int]) -> int:
    """The token a greedy or seeded request must get, drawing ``u`` the way the
    sampler's inverse-CDF sampling does. The generator has made one draw per
    output token already (the batch fast-forwards it on add)."""
    x = ref_processed(row, params, prompt, output)
    if params.temperature < 1e-5:
        return int(x.argmax())
    probs = ref_filtered(x, params).softmax(-1)
    gen = torch.Generator().manual_seed(params.seed)
    for _ in range(len(output) + 1):
        u = float(torch.empty(1).uniform_(generator=gen))
    cdf = probs.cumsum(-1)
    target = (1.0 - u) * float(cdf[-1])
    return next(t for t in range(probs.numel()) if float(cdf[t]) >= target and float(probs[t]) > 0)


def make_batch(params: list[SamplingParams], prompts: list[list[int]], outputs: list[list[int]],
               vocab: int, custom=()) -> InputBatch:
    procs = build_logitsprocs(None, "cpu", custom_logitsprocs=custom, include_entry_points=False)
    ib = InputBatch(max_num_reqs=max(8, len(params)), vocab_size=vocab, device="cpu",
                    logitsprocs=procs)
    for i, (p, pr, out) in enumerate(zip(params, prompts, outputs)):
        ib.add_request(f"r{i}", p, pr, out)
    return ib
