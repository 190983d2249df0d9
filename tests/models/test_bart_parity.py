"""BART: greedy outputs token-identical to HF generate; logits within 1e-4."""
from __future__ import annotations

import random

import pytest
import torch

from encdec import ExplicitEncoderDecoderPrompt, SamplingParams, TextPrompt, TokensPrompt

WORDS = ("rain spain falls mainly plain quick brown fox jumps lazy dog encoder decoder "
         "summary token memory blocks pages batch requests numbers names text").split()


def hf_greedy(hf, enc_ids: list[int], dec_ids: list[int], max_new: int) -> list[int]:
    out = hf.generate(
        torch.tensor([enc_ids]), decoder_input_ids=torch.tensor([dec_ids]),
        attention_mask=torch.ones(1, len(enc_ids), dtype=torch.long),
        max_new_tokens=max_new, do_sample=False, num_beams=1, no_repeat_ngram_size=0,
        repetition_penalty=1.0, min_length=0, min_new_tokens=0, forced_bos_token_id=None,
        forced_eos_token_id=None, eos_token_id=2, pad_token_id=1)
    return out[0, len(dec_ids):].tolist()


def mixed_prompts(tokenizer, n: int = 28, seed: int = 0):
    """Every prompt form, encoder lengths 1..200, max_tokens 1..64."""
    rng = random.Random(seed)
    vocab = len(tokenizer)

    def text() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))

    def tokens(lo=1, hi=200) -> list[int]:
        return [rng.randrange(4, vocab - 1) for _ in range(rng.randint(lo, hi))]

    forms = [
        lambda: text(),
        lambda: TextPrompt(prompt=text()),
        lambda: TokensPrompt(prompt_token_ids=tokens()),
        lambda: ExplicitEncoderDecoderPrompt(encoder_prompt=text(), decoder_prompt=None),
        lambda: ExplicitEncoderDecoderPrompt(encoder_prompt=TokensPrompt(prompt_token_ids=tokens()),
                                             decoder_prompt=TokensPrompt(prompt_token_ids=[0] + tokens(1, 6))),
        lambda: ExplicitEncoderDecoderPrompt(encoder_prompt=TextPrompt(prompt=text()),
                                             decoder_prompt=" ".join(rng.choice(WORDS) for _ in range(3))),
        lambda: ExplicitEncoderDecoderPrompt(encoder_prompt=TokensPrompt(prompt_token_ids=tokens()),
                                             decoder_prompt=TokensPrompt(prompt_token_ids=[2, 0] + tokens(1, 4))),
    ]
    prompts = [forms[i % len(forms)]() for i in range(n)]
    prompts[0] = TokensPrompt(prompt_token_ids=[rng.randrange(4, vocab)])  # encoder length 1
    prompts[1] = TokensPrompt(prompt_token_ids=tokens(200, 200))  # encoder length 200
    max_tokens = [rng.randint(1, 64) for _ in range(n)]
    max_tokens[2], max_tokens[3] = 1, 64
    return prompts, max_tokens


@pytest.fixture(scope="module", params=["torch_sdpa", "xformers"])
def any_backend_llm(request, bart_llm, tiny_bart):
    """The session engine (torch SDPA), then one on the xFormers backend (its CPU reference path)."""
    if request.param == "torch_sdpa":
        return bart_llm
    pytest.importorskip("xformers")
    from encdec import LLM

    return LLM(tiny_bart, kv_cache_memory=64 << 20, swap_space=0.05, attention_backend="xformers")


def test_greedy_matches_hf_generate(any_backend_llm, hf_bart):
    bart_llm = any_backend_llm
    tok = bart_llm.get_tokenizer()
    prompts, max_tokens = mixed_prompts(tok)
    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in max_tokens]
    outs = bart_llm.generate(prompts, params, use_tqdm=False)
    assert len(outs) == len(prompts)
    enc_lens = set()
    for out, m in zip(outs, max_tokens):
        ours = out.outputs[0].token_ids
        enc_lens.add(len(out.encoder_prompt_token_ids))
        assert out.prompt_token_ids[0] == 2  # <DEC> first
        ref = hf_greedy(hf_bart, out.encoder_prompt_token_ids, out.prompt_token_ids, m)
        assert ours == ref, f"request {out.request_id}: {ours} != {ref}"
        assert out.outputs[0].finish_reason == ("stop" if ours[-1] == 2 else "length")
    assert min(enc_lens) == 1 and max(enc_lens) == 200
    # The test proves something only if outputs vary.
    long = [o.outputs[0].token_ids for o in outs if len(o.outputs[0].token_ids) >= 8]
    assert len(long) >= 10
    assert sum(len(set(t)) >= 3 for t in long) >= len(long) // 2
    assert len({tuple(t) for t in long}) >= len(long) - 2
    free_gpu, _ = bart_llm.llm_engine.num_free_blocks()
    assert free_gpu == bart_llm.llm_engine.cache_config.num_gpu_blocks


def test_default_and_explicit_decoder_prompts(bart_llm):
    tok = bart_llm.get_tokenizer()
    outs = bart_llm.generate(
        ["The rain in spain falls mainly on the",
         ExplicitEncoderDecoderPrompt(encoder_prompt=TextPrompt(prompt="The rain in spain"),
                                      decoder_prompt=TokensPrompt(prompt_token_ids=[2, 0, 51, 178, 2])),
         ExplicitEncoderDecoderPrompt(encoder_prompt="The rain",
                                      decoder_prompt=TokensPrompt(prompt_token_ids=[0, 51]))],
        SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert outs[0].prompt_token_ids == [2, 0]
    assert outs[0].encoder_prompt_token_ids == tok("The rain in spain falls mainly on the").input_ids
    assert outs[0].encoder_prompt == "The rain in spain falls mainly on the"
    assert outs[1].prompt_token_ids == [2, 0, 51, 178, 2]
    assert outs[2].prompt_token_ids == [2, 0, 51]


class _Recorder(torch.nn.Module):
    def __init__(self, sampler, batch):
        super().__init__()
        self.sampler, self.batch, self.calls = sampler, batch, []

    def forward(self, logits, md):
        self.calls.append((list(self.batch.req_ids), logits.detach().clone()))
        return self.sampler(logits, md)


@pytest.mark.parametrize("backend", ["torch_sdpa", "xformers"])
def test_prefill_and_decode_logits_match_hf(tmp_path, backend):
    """On weights at BART's own init scale (logits of order 1), where 1e-4 is a
    meaningful float32 tolerance."""
    from transformers import BartForConditionalGeneration

    from encdec import LLM
    from encdec.testing import make_random_bart

    path = make_random_bart(str(tmp_path), seed=3, init_std=0.02, position_std=0.02)
    hf_bart = BartForConditionalGeneration.from_pretrained(path).eval()
    if backend == "xformers":
        pytest.importorskip("xformers")
    llm = LLM(path, kv_cache_memory=16 << 20, swap_space=0.01, attention_backend=backend)
    assert llm.llm_engine.worker.backend.get_name() == backend
    runner = llm.llm_engine.worker.model_runner
    rec = _Recorder(runner.sampler, runner.input_batch)
    runner.sampler = rec
    prompts = ["The rain in spain falls", "A quick brown fox " * 8,
               TokensPrompt(prompt_token_ids=list(range(5, 120)))]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)
    per_seq: dict[str, list[torch.Tensor]] = {}
    for ids, logits in rec.calls:
        for row, sid in enumerate(ids):
            per_seq.setdefault(sid, []).append(logits[row])
    seq_ids = sorted(per_seq, key=int)
    assert len(seq_ids) == 3
    for sid, out in zip(seq_ids, outs):
        dec = out.prompt_token_ids + out.outputs[0].token_ids[:-1]
        with torch.no_grad():
            ref = hf_bart(input_ids=torch.tensor([out.encoder_prompt_token_ids]),
                          decoder_input_ids=torch.tensor([dec])).logits[0]
        ours = torch.stack(per_seq[sid])  # step 0 is prefill, the rest decode
        expect = ref[len(out.prompt_token_ids) - 1:]
        torch.testing.assert_close(ours, expect, atol=1e-4, rtol=1e-4)


def test_continuous_batching_admits_as_others_finish(tiny_bart):
    from encdec import LLM

    llm = LLM(tiny_bart, kv_cache_memory=16 << 20, swap_space=0.01, max_num_seqs=4)
    rng = random.Random(1)
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(4, 900) for _ in range(rng.randint(1, 150))])
               for _ in range(16)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(2, 40), ignore_eos=True)
              for _ in range(16)]
    sched = llm.llm_engine.scheduler
    running_sizes = []
    orig = sched.schedule

    def spy():
        out = orig()
        running_sizes.append(sum(g.num_seqs() for g in sched.running))
        return out

    sched.schedule = spy
    outs = llm.generate(prompts, params, use_tqdm=False)
    sched.schedule = orig
    assert max(running_sizes) == 4
    steps = sorted(sched.stats.admitted_at_step[o.request_id] for o in outs)
    assert steps[:4] == [steps[0]] * 4  # the first four start together
    assert len(set(steps)) > 4  # the rest join one by one as others finish
    for p, sp, out in zip(prompts, params, outs):
        alone = llm.generate(p, sp, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids
        assert len(out.outputs[0].token_ids) == sp.max_tokens
    free_gpu, _ = llm.llm_engine.num_free_blocks()
    assert free_gpu == llm.llm_engine.cache_config.num_gpu_blocks
