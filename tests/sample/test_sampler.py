from __future__ import annotations

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import encdec.sample.sampler as sampler_mod
from encdec.sample.sampler import Sampler, compute_prompt_logprobs
from encdec.sampling_params import SamplingParams
from tests.sample.reference import (
    FakeTokenizer,
    make_batch,
    ref_filtered,
    ref_processed,
    ref_token,
)

VOCAB = 64


def _bad_words_params(**kw) -> SamplingParams:
    params = SamplingParams(bad_words=["foo", "bar baz"], **kw)
    params.update_from_tokenizer(FakeTokenizer())
    return params


CASES = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.6),
    "top_k": dict(top_k=5),
    "top_p": dict(top_p=0.7),
    "min_p": dict(min_p=0.3),
    "top_k_top_p": dict(top_k=10, top_p=0.5),
    "repetition": dict(repetition_penalty=1.7),
    "frequency": dict(frequency_penalty=0.9),
    "presence": dict(presence_penalty=-1.5),
    "logit_bias": dict(logit_bias={1: 8.0, 7: -3.0, 40: 2.5}),
    "allowed": dict(allowed_token_ids=[3, 5, 9, 11, 30]),
    "min_tokens": dict(min_tokens=50, max_tokens=60, stop_token_ids=[4, 6, 8]),
    "greedy_penalties": dict(temperature=0.0, repetition_penalty=2.0, frequency_penalty=1.0,
                             logit_bias={2: 3.0}),
    "combo": dict(temperature=0.9, top_k=12, top_p=0.8, min_p=0.05, repetition_penalty=1.3,
                  frequency_penalty=0.4, presence_penalty=0.3, logit_bias={5: 4.0},
                  min_tokens=40, max_tokens=64, stop_token_ids=[1, 2], logprobs=2),
}


def _random_batch(params: list[SamplingParams], seed: int):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 4))] for _ in params]
    outputs = [[rng.randrange(VOCAB) for _ in range(rng.randint(0, 12))] for _ in params]
    # Make the bad word "bar baz" due in some rows: output ends with "bar".
    outputs[0].append(FakeTokenizer().encode("bar")[0])
    logits = torch.randn(len(params), VOCAB) * 3
    return prompts, outputs, logits


def _assert_batch_matches_reference(params: list[SamplingParams], seed: int) -> None:
    prompts, outputs, logits = _random_batch(params, seed)
    ib = make_batch(params, prompts, outputs, VOCAB)
    md = ib.refresh_metadata()
    sampler = Sampler()
    processed = sampler.apply_logits_processors(logits.clone(), md)
    for i, p in enumerate(params):
        want = ref_processed(logits[i], p, prompts[i], outputs[i])
        torch.testing.assert_close(processed[i], want, rtol=1e-5, atol=1e-5)
    if not md.all_greedy:
        filtered = sampler.apply_sampling_filters(processed.clone(), md)
        for i, p in enumerate(params):
            if p.temperature >= 1e-5:
                want = ref_filtered(ref_processed(logits[i], p, prompts[i], outputs[i]), p)
                torch.testing.assert_close(filtered[i], want, rtol=1e-5, atol=1e-5)
    out = sampler(logits.clone(), md)
    assert out.sampled_token_ids.shape == (len(params), 1)
    for i, p in enumerate(params):
        token = int(out.sampled_token_ids[i, 0])
        if p.temperature < 1e-5 or p.seed is not None:
            assert token == ref_token(logits[i], p, prompts[i], outputs[i]), (i, p)
        else:  # unseeded: must at least be a token the filters kept
            x = ref_filtered(ref_processed(logits[i], p, prompts[i], outputs[i]), p)
            assert x[token] > float("-inf")


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("seed", [0, 1])
def test_each_parameter_matches_reference(name: str, seed: int) -> None:
    case = dict(CASES[name])
    seeded = SamplingParams(seed=100 + seed, **case) if case.get("temperature", 1.0) else None
    rows = [seeded or SamplingParams(**case),
            SamplingParams(seed=7, temperature=1.3),  # a plain random row beside it
            SamplingParams(temperature=0.0),  # and a greedy one
            SamplingParams(**case)]  # the same case, unseeded
    _assert_batch_matches_reference(rows, seed)


@pytest.mark.parametrize("name", list(CASES))
def test_each_parameter_alone(name: str) -> None:
    case = CASES[name]
    seed = {} if case.get("temperature", 1.0) == 0.0 else {"seed": 5}
    _assert_batch_matches_reference([SamplingParams(**case, **seed), SamplingParams(**case, **seed)], 3)


def test_bad_words_match_prefix_of_output() -> None:
    params = [_bad_words_params(temperature=0.0), _bad_words_params(seed=3)]
    _assert_batch_matches_reference(params, 4)
    tok = FakeTokenizer()
    foo, bar, baz = tok.encode("foo")[0], tok.encode("bar")[0], tok.encode("bar baz")[1]
    ib = make_batch([params[0]], [[1]], [[bar]], VOCAB)
    logits = torch.zeros(1, VOCAB)
    logits[0, baz] = 5.0
    processed = Sampler().apply_logits_processors(logits, ib.refresh_metadata())
    assert processed[0, baz] == float("-inf") and processed[0, foo] == float("-inf")
    ib = make_batch([params[0]], [[1]], [[2]], VOCAB)  # "bar" not last: "baz" allowed
    processed = Sampler().apply_logits_processors(torch.zeros(1, VOCAB), ib.refresh_metadata())
    assert processed[0, baz] == 0.0 and processed[0, foo] == float("-inf")


def test_logprobs_rank_from_raw_logits_and_sampled_first() -> None:
    logits = torch.randn(3, VOCAB)
    low = int(logits[0].argsort()[5])  # a token ranked near the bottom...
    params = [SamplingParams(temperature=0.0, logit_bias={low: 100.0}, logprobs=4),  # ...forced
              SamplingParams(temperature=0.0, logprobs=0), SamplingParams(seed=1)]
    ib = make_batch(params, [[1]] * 3, [[], [], []], VOCAB)
    out = Sampler()(logits.clone(), ib.refresh_metadata())
    lp = out.logprobs_tensors
    raw = logits.log_softmax(-1)
    assert lp.logprob_token_ids.shape == (3, 5) and lp.logprobs.shape == (3, 5)
    assert int(out.sampled_token_ids[0, 0]) == low
    for i in range(3):
        token = int(out.sampled_token_ids[i, 0])
        assert int(lp.logprob_token_ids[i, 0]) == token
        torch.testing.assert_close(lp.logprobs[i, 0], raw[i, token])
        assert int(lp.selected_token_ranks[i]) == int((raw[i] > raw[i, token]).sum()) + 1
        top = raw[i].topk(4)
        assert lp.logprob_token_ids[i, 1:].tolist() == top.indices.tolist()
        torch.testing.assert_close(lp.logprobs[i, 1:], top.values)
    assert int(lp.selected_token_ranks[0]) == VOCAB - 5
    assert int(lp.selected_token_ranks[1]) == 1


def test_prompt_logprobs_helper() -> None:
    logits = torch.randn(6, VOCAB)
    targets = torch.tensor([3, 1, 4, 1, 5, 9])
    lp = compute_prompt_logprobs(logits, targets, 2)
    raw = logits.log_softmax(-1)
    assert lp.logprob_token_ids[:, 0].tolist() == targets.tolist()
    torch.testing.assert_close(lp.logprobs[:, 0], raw[torch.arange(6), targets])
    torch.testing.assert_close(lp.logprobs[:, 1:], raw.topk(2).values)
    want_ranks = [(raw[i] > raw[i, t]).sum().item() + 1 for i, t in enumerate(targets.tolist())]
    assert lp.selected_token_ranks.tolist() == want_ranks


class _OpLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def test_all_greedy_batch_is_one_argmax() -> None:
    params = [SamplingParams(temperature=0.0) for _ in range(5)]
    ib = make_batch(params, [[2, 0]] * 5, [[1, 2, 3]] * 5, VOCAB)
    md = ib.refresh_metadata()
    logits = torch.randn(5, VOCAB)
    with _OpLog() as log:
        out = Sampler()(logits, md)
    assert out.sampled_token_ids[:, 0].tolist() == logits.argmax(-1).tolist()
    assert out.logprobs_tensors is None
    # Nothing but the argmax (and a free reshape) may touch the logits: torch's,
    # or the C kernel's (which torch sees as the `empty` for its output) on CPU.
    if sampler_mod.greedy_argmax(logits) is None:
        assert set(log.ops) <= {"argmax", "unsqueeze", "view"}, log.ops
        assert log.ops.count("argmax") == 1
    else:
        assert log.ops == ["empty", "unsqueeze"], log.ops


def test_all_greedy_row_with_nan_picks_what_torch_picks() -> None:
    """The C argmax declines a NaN row; torch's argmax then picks the NaN, as before."""
    params = [SamplingParams(temperature=0.0) for _ in range(3)]
    md = make_batch(params, [[2, 0]] * 3, [[1, 2, 3]] * 3, VOCAB).refresh_metadata()
    logits = torch.randn(3, VOCAB)
    logits[1, 5] = float("nan")
    out = Sampler()(logits, md)
    assert out.sampled_token_ids[:, 0].tolist() == logits.argmax(-1).tolist()
    assert out.sampled_token_ids[1, 0] == 5


@pytest.mark.skipif(sampler_mod.greedy_logprobs(torch.zeros(1, 16)) is None, reason="no greedy C kernel here")
def test_greedy_processed_logprob_of_the_token_alone_takes_one_pass(monkeypatch) -> None:
    """All greedy, ``logprobs=0`` processed (a Whisper transcription's every step):
    the C pass gives what the general path gives, with no vocab-wide log-softmax."""
    params = [SamplingParams(temperature=0.0, logprobs=0, logprobs_mode="processed_logprobs",
                             logit_bias={7: 9.0} if i == 1 else None) for i in range(4)]
    prompts, outputs, logits = _random_batch(params, 5)
    logits[2, 11] = logits[2, 40] = logits[2].max() + 1  # a tie: first index, rank 2
    ib = make_batch(params, prompts, outputs, VOCAB)
    with _OpLog() as log:
        fast = Sampler()(logits.clone(), ib.refresh_metadata())
    assert "_log_softmax" not in log.ops and "argmax" not in log.ops, log.ops
    monkeypatch.setattr(sampler_mod, "greedy_logprobs", lambda x: None)
    with _OpLog() as log:
        general = Sampler()(logits.clone(), ib.refresh_metadata())
    assert "_log_softmax" in log.ops  # the guard: the general path does the work
    assert fast.sampled_token_ids.tolist() == general.sampled_token_ids.tolist()
    assert int(fast.sampled_token_ids[1, 0]) == 7 and int(fast.sampled_token_ids[2, 0]) == 11
    a, b = fast.logprobs_tensors, general.logprobs_tensors
    assert a.logprob_token_ids.tolist() == b.logprob_token_ids.tolist()
    torch.testing.assert_close(a.logprobs, b.logprobs)
    assert a.selected_token_ranks.tolist() == b.selected_token_ranks.tolist() and int(a.selected_token_ranks[2]) == 2


def test_mixed_batch_does_real_work() -> None:
    # Guards the test above: the op log does see sampling work when there is some.
    ib = make_batch([SamplingParams(temperature=0.0), SamplingParams(top_p=0.9)],
                    [[1], [1]], [[], []], VOCAB)
    with _OpLog() as log:
        Sampler()(torch.randn(2, VOCAB), ib.refresh_metadata())
    assert "searchsorted" in log.ops and "sort" in log.ops, log.ops


def test_greedy_forces_filters_off() -> None:
    p = SamplingParams(temperature=0.0, top_p=0.1, top_k=3, min_p=0.9)
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    ib = make_batch([p], [[1]], [[]], VOCAB)
    md = ib.refresh_metadata()
    assert md.all_greedy and md.top_p is None and md.top_k is None and md.temperature is None


def test_half_precision_logits_are_sampled_in_float32(monkeypatch) -> None:
    seen = []
    real = sampler_mod.random_sample
    monkeypatch.setattr(sampler_mod, "random_sample", lambda p, g, *rest: seen.append(p.dtype) or real(p, g, *rest))
    ib = make_batch([SamplingParams(seed=1)], [[1]], [[]], VOCAB)
    out = Sampler()(torch.randn(1, VOCAB, dtype=torch.bfloat16), ib.refresh_metadata())
    assert seen == [torch.float32] and out.sampled_token_ids.dtype == torch.int64


def test_empty_batch() -> None:
    ib = make_batch([], [], [], VOCAB)
    out = Sampler()(torch.zeros(0, VOCAB), ib.refresh_metadata())
    assert out.sampled_token_ids.shape == (0, 1)


@pytest.mark.parametrize("raw_row", [False, True], ids=["processed-only", "mixed"])
def test_processed_logprobs_are_after_the_processors_before_temperature(raw_row: bool) -> None:
    """``logprobs_mode="processed_logprobs"`` rows report the log-softmax of the
    logits after the processors and penalties (here a bias and allowed ids), not
    divided by the temperature; a raw row in the same batch keeps the raw ones."""
    mode = dict(logprobs=3, logprobs_mode="processed_logprobs")
    params = [SamplingParams(temperature=0.0, logit_bias={7: 5.0}, **mode),
              SamplingParams(temperature=0.7, seed=2, allowed_token_ids=[3, 5, 9, 11], **mode)]
    if raw_row:
        params.insert(1, SamplingParams(temperature=0.0, logit_bias={7: 5.0}, logprobs=3))
    prompts, outputs, logits = _random_batch(params, 4)
    ib = make_batch(params, prompts, outputs, VOCAB)
    out = Sampler()(logits.clone(), ib.refresh_metadata())
    lp = out.logprobs_tensors
    for i, p in enumerate(params):
        base = logits[i] if p.logprobs_mode == "raw_logprobs" else ref_processed(logits[i], p, prompts[i], outputs[i])
        want = base.log_softmax(-1)
        token = int(out.sampled_token_ids[i, 0])
        torch.testing.assert_close(lp.logprobs[i, 0], want[token])
        torch.testing.assert_close(lp.logprobs[i, 1:], want.topk(3).values)
    assert torch.isinf(lp.logprobs[-1, 1:]).sum() == 0 and int(out.sampled_token_ids[-1, 0]) in (3, 5, 9, 11)
    with pytest.raises(ValueError, match="logprobs_mode"):
        SamplingParams(logprobs_mode="processed")


def test_random_sample_draws_from_probs_and_never_a_zero(monkeypatch) -> None:
    """Inverse-CDF sampling: frequencies follow ``probs`` (a 4-sigma band over
    20000 draws) and a zero-probability token is never drawn, wherever the
    zeros sit (first, between, last) and whatever the uniform: u -> 0 reaches
    the last nonzero token, u -> 1 the first."""
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.0, 0.3, 0.2, 0.0]] * 4)
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(7)
    for _ in range(5000):
        counts += torch.bincount(sampler_mod.random_sample(probs.clone(), {}, gen), minlength=7)
    assert counts[probs[0] == 0].sum() == 0
    n, p = counts.sum(), probs[0]
    assert torch.all((counts - n * p).abs() <= 4 * (n * p * (1 - p)).sqrt()), counts.tolist()
    for u, token in ((0.0, 5), (1.0 - 2 ** -24, 1)):  # the extremes uniform_ can return
        monkeypatch.setattr(torch.Tensor, "uniform_", lambda self, *a, u=u, **k: self.fill_(u))
        assert sampler_mod.random_sample(probs[:1].clone(), {}, None).tolist() == [token]
