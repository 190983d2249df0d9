"""Tiny random BARTs for beam search parity: one whose outputs run to the
length limit, one with a raised eos logit so hypotheses end at mixed lengths
(and eos-driven rules such as min length and early stopping bind)."""
from __future__ import annotations

import random

import pytest

CNN_DEFAULTS = dict(num_beams=4, length_penalty=2.0, early_stopping=True, no_repeat_ngram_size=3,
                    min_length=12, max_length=30, forced_bos_token_id=0, forced_eos_token_id=2)


def make_beam_bart(out_dir: str, *, seed: int, eos_bias: float, **generation) -> str:
    import torch
    from transformers import BartForConditionalGeneration, GenerationConfig

    from encdec.testing import make_random_bart

    # init_std 0.2: outputs stay varied while logits stay small enough that
    # float32 noise in summed log-probs is ~1e-5.
    make_random_bart(out_dir, seed=seed, init_std=0.2, position_std=1.0)
    model = BartForConditionalGeneration.from_pretrained(out_dir)
    with torch.no_grad():
        model.final_logits_bias[0, 2] = eos_bias
    model.save_pretrained(out_dir)
    GenerationConfig(bos_token_id=0, eos_token_id=2, pad_token_id=1, decoder_start_token_id=2,
                     **generation).save_pretrained(out_dir)
    return out_dir


def mixed_prompts(n: int, seed: int) -> list[list[int]]:
    """Encoder token ids of mixed lengths (2..120 tokens)."""
    rng = random.Random(seed)
    lengths = [rng.choice((2, 5, 9, 17, 33, 64, 120)) for _ in range(n)]
    return [[0] + [rng.randrange(4, 990) for _ in range(m - 2)] + [2] for m in lengths]


@pytest.fixture(scope="session")
def beam_barts(tmp_path_factory) -> dict[str, str]:
    """``plain``: random weights; ``eosy``: eos logit raised; both carry
    bart-large-cnn's generation defaults (lengths scaled down)."""
    return {
        "plain": make_beam_bart(str(tmp_path_factory.mktemp("beam_plain")), seed=0, eos_bias=0.0,
                                **CNN_DEFAULTS),
        "eosy": make_beam_bart(str(tmp_path_factory.mktemp("beam_eosy")), seed=1, eos_bias=7.0,
                               **CNN_DEFAULTS),
    }
