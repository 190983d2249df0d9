"""The parity check every text encoder/decoder family passes: >= 30 mixed-length
prompts in one ``generate`` call, greedy and beam search with the checkpoint's
generation defaults, token-identical to HF ``generate`` on each prompt alone;
beam scores within 1e-4 (1e-5 relative)."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from encdec import ExplicitEncoderDecoderPrompt, TokensPrompt
from encdec.beam_search.defaults import with_overrides
from encdec.sampling_params import BeamSearchParams

WORDS = ("rain spain falls mainly plain quick brown fox jumps lazy dog encoder decoder "
         "summary token memory blocks pages batch requests numbers names text").split()
NUM_PROMPTS = 30


def make_llm(path: str, backend: str):
    """Our engine on ``backend`` ("torch_sdpa" or "xformers", its CPU reference path)."""
    from encdec import LLM

    if backend == "xformers":
        pytest.importorskip("xformers")
    return LLM(path, kv_cache_memory=64 << 20, swap_space=0.05, attention_backend=backend)


def mixed_prompts(tokenizer, *, seed: int, token_range: tuple[int, int],
                  decoder_prompts: list[list[int]] | None = None, n: int = NUM_PROMPTS,
                  lengths: tuple[int, ...] = (1, 2, 5, 9, 17, 33, 64, 120)) -> list:
    """Encoder prompts of texts through the tokenizer and raw ids in ``token_range``
    (of ``lengths``, at least one of each extreme); with ``decoder_prompts``, every other prompt is explicit with
    one of them (cycled), the rest use the model's default decoder prompt."""
    rng = random.Random(seed)
    lo, hi = token_range
    prompts = []
    for i in range(n):
        if i % 3 == 0:
            enc = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))
        else:
            m = lengths[0] if i == 1 else lengths[-1] if i == 2 else rng.choice(lengths)
            enc = TokensPrompt(prompt_token_ids=[rng.randrange(lo, hi) for _ in range(m)])
        if decoder_prompts and i % 2:
            dec = TokensPrompt(prompt_token_ids=decoder_prompts[(i // 2) % len(decoder_prompts)])
            prompts.append(ExplicitEncoderDecoderPrompt(encoder_prompt=enc, decoder_prompt=dec))
        else:
            prompts.append(enc)
    return prompts


def _hf_generate(hf, enc: list[int], dec: list[int], **kwargs):
    with torch.inference_mode():
        return hf.generate(torch.tensor([enc]), attention_mask=torch.ones(1, len(enc), dtype=torch.long),
                           decoder_input_ids=torch.tensor([dec]), return_dict_in_generate=True,
                           output_scores=True, **kwargs)


def _same_tokens(ours: list[int], hf: list[int], pad: int) -> bool:
    """HF pads the shorter returned sequences with <pad>."""
    return hf[:len(ours)] == ours and all(t == pad for t in hf[len(ours):])


def check_greedy(llm, hf, prompts: list, *, seed: int = 0) -> list:
    """Greedy with the checkpoint's defaults (forced tokens, bad words) and mixed
    ``max_tokens``, against HF ``generate(num_beams=1, max_new_tokens=...)``."""
    rng = random.Random(seed)
    defaults = llm.get_default_sampling_params()
    max_tokens = [rng.randint(1, 40) for _ in prompts]
    params = [with_overrides(defaults, beam_width=1, max_tokens=m, min_tokens=0) for m in max_tokens]
    outs = llm.generate(prompts, params, use_tqdm=False)
    eos = hf.generation_config.eos_token_id
    for out, m in zip(outs, max_tokens):
        ours = out.outputs[0].token_ids
        dec = list(out.prompt_token_ids)
        g = _hf_generate(hf, out.encoder_prompt_token_ids, dec, max_new_tokens=m, num_beams=1,
                         do_sample=False, min_length=0, min_new_tokens=0)
        ref = g.sequences[0, len(dec):].tolist()
        assert ours == ref, f"request {out.request_id} (decoder prompt {dec}): {ours} != {ref}"
        assert out.outputs[0].finish_reason == ("stop" if ours[-1] == eos else "length")
    long = [o.outputs[0].token_ids for o in outs if len(o.outputs[0].token_ids) >= 8]
    assert len(long) >= 8, "outputs too short to prove anything"
    assert len({tuple(t) for t in long}) >= len(long) - 2, "outputs do not vary"
    enc_lens = [len(o.encoder_prompt_token_ids) for o in outs]
    assert min(enc_lens) <= 3 and max(enc_lens) >= 100
    return outs


def _decoder_prompt_lens(llm, hf, prompts: list) -> list[int]:
    """Tokens of each prompt's decoder prompt as the engine runs it: an explicit
    ``TokensPrompt`` with the decoder start prepended unless it has it, else the
    model's default decoder prompt (read off a one-token request)."""
    from encdec import SamplingParams

    probe = llm.generate(TokensPrompt(prompt_token_ids=[5]), SamplingParams(temperature=0, max_tokens=1),
                         use_tqdm=False)[0]
    start = hf.generation_config.decoder_start_token_id
    lens = []
    for prompt in prompts:
        dec = prompt.get("decoder_prompt") if isinstance(prompt, dict) else None
        ids = None if dec is None else dec["prompt_token_ids"]
        lens.append(len(probe.prompt_token_ids) if ids is None else len(ids) + (ids[:1] != [start]))
    return lens


def assert_beams_match_hf(llm, hf, prompts: list) -> list:
    """Beam search with the checkpoint's defaults (beams, lengths, forced tokens),
    each length limit shifted by the request's decoder prompt as HF counts it."""
    defaults = llm.get_default_sampling_params()
    assert isinstance(defaults, BeamSearchParams) and defaults.beam_width > 1
    gen = hf.generation_config
    bos, pad = defaults.forced_bos_token_id, gen.pad_token_id
    lens = _decoder_prompt_lens(llm, hf, prompts)
    params = [dataclasses.replace(defaults, max_tokens=gen.max_length - n,
                                  min_tokens=max(0, (gen.min_length or 0) - n)) for n in lens]
    outs = llm.generate(prompts, params, use_tqdm=False)
    k = defaults.beam_width
    ties = 0
    for out, n in zip(outs, lens):
        dec = list(out.prompt_token_ids)
        assert len(dec) == n, (dec, n)
        # A forced first token in the prompt is one HF forces itself from the start token.
        hf_dec = dec[:1] if bos is not None and len(dec) == 2 and dec[1] == bos else dec
        g = _hf_generate(hf, out.encoder_prompt_token_ids, hf_dec, num_return_sequences=k)
        hf_seqs, hf_scores = [s.tolist() for s in g.sequences], g.sequences_scores.tolist()
        c = out.outputs[0]
        ours = dec + c.token_ids
        if not _same_tokens(ours, hf_seqs[0], pad):
            # Only an exact tie in HF's own scores may order hypotheses differently.
            same = [t for t, h in enumerate(hf_seqs) if _same_tokens(ours, h, pad)]
            assert same and hf_scores[same[0]] == hf_scores[0], (out.request_id, ours, hf_seqs, hf_scores)
            ties += 1
        assert c.score == pytest.approx(hf_scores[0], rel=1e-5, abs=1e-4), (out.request_id, c.score, hf_scores)
    assert ties <= 2
    distinct = len({tuple(o.outputs[0].token_ids) for o in outs})
    assert distinct >= 2 * len(outs) // 3, f"outputs do not vary: {distinct} distinct"
    return outs
