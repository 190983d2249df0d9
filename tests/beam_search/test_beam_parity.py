"""Beam search is HF's ``generate(num_beams=k)``, token for token and score for
score, for 30 mixed-length prompts run together in one ``generate`` call.

Half the prompts use the model's default decoder prompt ``[<DEC>, <BOS>]``,
half an explicit ``[<DEC>]`` (HF's own start). With forced BOS on, HF starts
from ``[<DEC>]`` for both; with it off, the default-prompt rows are compared
with HF given ``decoder_input_ids=[[2, 0]]``.
"""
from __future__ import annotations

import pytest
import torch

from encdec import ExplicitEncoderDecoderPrompt, TokensPrompt
from encdec.sampling_params import BeamSearchParams
from tests.beam_search.conftest import mixed_prompts

NUM_PROMPTS = 30
PAD = 1

# (model, k, length_penalty, early_stopping, no_repeat_ngram_size, min_length, max_length,
#  forced_bos, forced_eos, num_return_sequences)
CASES = [
    ("eosy", 4, 2.0, True, 3, 12, 30, 0, 2, 1),  # bart-large-cnn's defaults, lengths scaled
    ("plain", 4, 2.0, True, 3, 12, 30, 0, 2, 4),
    ("eosy", 1, 1.0, False, 0, 0, 20, None, None, 1),
    ("eosy", 2, 0.0, "never", 3, 6, 24, 0, None, 2),
    ("eosy", 5, -1.0, False, 0, 8, 25, None, 2, 5),
    ("eosy", 4, 1.0, "never", 3, 0, 20, 0, 2, 4),
    ("plain", 5, 2.0, True, 0, 0, 22, 0, 2, 1),
    ("eosy", 2, -1.0, True, 3, 0, 40, None, None, 1),
    ("eosy", 4, 0.0, False, 3, 15, 22, 0, 2, 4),
    ("eosy", 5, 1.0, False, 0, 10, 32, None, 2, 1),
]


@pytest.fixture(scope="module")
def engines(beam_barts):
    from transformers import BartForConditionalGeneration

    from encdec import LLM

    return {name: (LLM(path, kv_cache_memory=64 << 20, swap_space=0.05),
                   BartForConditionalGeneration.from_pretrained(path).eval())
            for name, path in beam_barts.items()}


def _hf_generate(hf, enc: list[int], decoder_prompt: list[int] | None,
                 case) -> tuple[list[list[int]], list[float]]:
    """HF's whole finished pool (num_return_sequences=k: the search itself does
    not depend on it), best first, and its scores (None for k=1: greedy search)."""
    _, k, lp, early, ngram, min_len, max_len, bos, eos, _ = case
    kwargs = dict(num_beams=k, length_penalty=lp, early_stopping=early, no_repeat_ngram_size=ngram,
                  min_length=min_len, max_length=max_len, forced_bos_token_id=bos,
                  forced_eos_token_id=eos, num_return_sequences=k, do_sample=False,
                  return_dict_in_generate=True, output_scores=True)
    if decoder_prompt is not None:
        kwargs["decoder_input_ids"] = torch.tensor([decoder_prompt])
    with torch.inference_mode():
        g = hf.generate(torch.tensor([enc]), **kwargs)
    seqs = [s.tolist() for s in g.sequences]
    scores = g.sequences_scores.tolist() if getattr(g, "sequences_scores", None) is not None else None
    return seqs, scores


def _our_params(case, prompt_len: int) -> BeamSearchParams:
    _, k, lp, early, ngram, min_len, max_len, bos, eos, nrs = case
    return BeamSearchParams(k, max_len - prompt_len, min_tokens=max(0, min_len - prompt_len),
                            length_penalty=lp, early_stopping=early, no_repeat_ngram_size=ngram,
                            num_return_sequences=nrs,
                            # HF's explicit None turns the checkpoint's forced token off: ours is False
                            forced_bos_token_id=False if bos is None else bos,
                            forced_eos_token_id=False if eos is None else eos)


def _same_tokens(ours: list[int], hf: list[int]) -> bool:
    """HF pads the shorter returned sequences with <pad>."""
    return hf[:len(ours)] == ours and all(t == PAD for t in hf[len(ours):])


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_beam_search_matches_hf(engines, case):
    name, k, lp, early, ngram, min_len, max_len, bos, eos, nrs = case
    llm, hf = engines[name]
    encs = mixed_prompts(NUM_PROMPTS, seed=k * 100 + max_len)
    prompts, params = [], []
    for i, enc in enumerate(encs):
        if i % 2:  # explicit decoder prompt [<DEC>]: HF's start
            prompts.append(ExplicitEncoderDecoderPrompt(encoder_prompt=TokensPrompt(prompt_token_ids=enc),
                                                        decoder_prompt=TokensPrompt(prompt_token_ids=[2])))
            params.append(_our_params(case, 1))
        else:  # the default [<DEC>, <BOS>]
            prompts.append(TokensPrompt(prompt_token_ids=enc))
            params.append(_our_params(case, 2))
    outs = llm.generate(prompts, params, use_tqdm=False)
    ties = 0
    for i, (enc, out) in enumerate(zip(encs, outs)):
        hf_prompt = None if i % 2 or bos is not None else [2, 0]
        hf_seqs, hf_scores = _hf_generate(hf, enc, hf_prompt, case)
        assert len(out.outputs) == nrs, (i, out)
        for j, c in enumerate(out.outputs):
            ours = list(out.prompt_token_ids) + c.token_ids
            if k == 1:  # HF runs greedy search: no sequence scores
                assert _same_tokens(ours, hf_seqs[j]), (i, ours, hf_seqs[j])
                continue
            if not _same_tokens(ours, hf_seqs[j]):
                # Only an exact tie in HF's own scores may order hypotheses differently:
                # ours must be in HF's pool with exactly the score of HF's rank j.
                same = [t for t, h in enumerate(hf_seqs) if _same_tokens(ours, h)]
                assert same and hf_scores[same[0]] == hf_scores[j], (i, j, ours, hf_seqs, hf_scores)
                ties += 1
            # Scores of ~40 summed float32 log-probs (times the length when
            # length_penalty < 0): compare to 1e-4 or 1e-5 relative, whichever is looser.
            assert c.score == pytest.approx(hf_scores[j], rel=1e-5, abs=1e-4), (i, j, c.score, hf_scores[j])
    reasons = [c.finish_reason for out in outs for c in out.outputs]
    lengths = {len(c.token_ids) for out in outs for c in out.outputs}
    print(f"{name} k={k}: {ties} tied hypotheses ordered differently; "
          f"{reasons.count('stop')} of {len(reasons)} end in eos; lengths {sorted(lengths)}")
    if name == "eosy":  # the eos-driven rules (min length, early stopping, pool) were exercised
        assert "stop" in reasons and len(lengths) > 2


def test_stop_token_ids_are_extra_eos_ids(engines):
    """A stop token is one more eos id for HF (``eos_token_id=[2, t]``): it ends a
    hypothesis, and the candidates per step grow to (1 + #eos) x k."""
    llm, hf = engines["plain"]
    encs = mixed_prompts(12, seed=9)
    prompts = [TokensPrompt(prompt_token_ids=e) for e in encs]
    off = dict(forced_bos_token_id=False, forced_eos_token_id=False)  # HF below: None (off)
    free = llm.generate(prompts, BeamSearchParams(3, 20, **off), use_tqdm=False)
    stops = [out.outputs[0].token_ids[4] for out in free]  # a token each best hypothesis makes
    outs = llm.generate(prompts, [BeamSearchParams(3, 20, stop_token_ids=[t], **off) for t in stops],
                        use_tqdm=False)
    assert sum(o.outputs[0].token_ids[-1] == t for o, t in zip(outs, stops)) >= 6
    for enc, out, stop in zip(encs, outs, stops):
        with torch.inference_mode():
            g = hf.generate(torch.tensor([enc]), num_beams=3, max_length=22, eos_token_id=[2, stop],
                            decoder_input_ids=torch.tensor([[2, 0]]), forced_bos_token_id=None,
                            forced_eos_token_id=None, min_length=0, no_repeat_ngram_size=0,
                            length_penalty=1.0, early_stopping=False,
                            return_dict_in_generate=True, output_scores=True)
        c = out.outputs[0]
        assert _same_tokens([2, 0] + c.token_ids, g.sequences[0].tolist())
        assert c.score == pytest.approx(g.sequences_scores[0].item(), rel=1e-5, abs=1e-4)
        if c.token_ids[-1] == stop:
            assert c.finish_reason == "stop" and c.stop_reason == stop
