"""mT5 and UMT5 as their checkpoints declare them (``MT5ForConditionalGeneration``,
``UMT5ForConditionalGeneration``), saved by HF's own classes: greedy and 4-beam
outputs token-identical to HF generate. mT5 is T5 v1.1's layout and is never
rescaled at the head; UMT5 has a relative position bias table in every layer."""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests.models.seq2seq_parity import assert_beams_match_hf, check_greedy, make_llm, mixed_prompts

LENGTHS = (1, 2, 5, 9, 17, 33, 64, 120, 150, 200)


def make_random_mt5(out_dir: str, *, arch: str, seed: int = 0, d_model: int = 64, d_kv: int = 12,
                    layers: int = 2, heads: int = 4, ffn: int = 128, bias_std: float = 10.0) -> str:
    """A tiny random ``arch`` ("mt5" | "umt5") saved with HF's ``save_pretrained``:
    gated GELU, its own ``lm_head`` (as google/mt5-* and umt5-* ship), every
    relative bias table strong (T5 has no other position signal). Tokenizer and
    generation config (4 beams, ``max_length`` 40) as ``make_random_t5``'s."""
    from transformers import (GenerationConfig, MT5Config, MT5ForConditionalGeneration, UMT5Config,
                              UMT5ForConditionalGeneration)

    from encdec.testing import make_random_t5

    make_random_t5(out_dir, style="t5-v1.1", seed=seed)  # the tokenizer and generation config
    generation = GenerationConfig.from_pretrained(out_dir)
    with open(os.path.join(out_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    os.remove(os.path.join(out_dir, "model.safetensors"))
    config_cls, model_cls = {"mt5": (MT5Config, MT5ForConditionalGeneration),
                             "umt5": (UMT5Config, UMT5ForConditionalGeneration)}[arch]
    cfg = config_cls(vocab_size=vocab, d_model=d_model, d_kv=d_kv, d_ff=ffn, num_layers=layers, num_heads=heads,
                     feed_forward_proj="gated-gelu", tie_word_embeddings=False, initializer_factor=5.0,
                     pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for stack in (model.encoder, model.decoder):
            for block in stack.block:
                attn = block.layer[0].SelfAttention
                if attn.has_relative_attention_bias:
                    attn.relative_attention_bias.weight.normal_(0, bias_std)
        model.lm_head.weight = torch.nn.Parameter(torch.randn(vocab, d_model) * d_model**-0.5)
    model.save_pretrained(out_dir)
    generation.save_pretrained(out_dir)  # save_pretrained wrote the model's default one
    return out_dir


@pytest.fixture(scope="module", params=["mt5", "umt5"])
def mt5_dir(request, tmp_path_factory) -> str:
    return make_random_mt5(str(tmp_path_factory.mktemp(request.param)), arch=request.param)


@pytest.fixture(scope="module")
def hf_mt5(mt5_dir):
    from transformers import AutoModelForSeq2SeqLM

    return AutoModelForSeq2SeqLM.from_pretrained(mt5_dir).eval()


@pytest.fixture(scope="module")
def mt5_llm(mt5_dir):
    return make_llm(mt5_dir, "torch_sdpa")


def _prompts(llm, seed: int) -> list:
    tok = llm.get_tokenizer()
    return mixed_prompts(tok, seed=seed, token_range=(3, len(tok)), lengths=LENGTHS,
                         decoder_prompts=[[0], [0, 300, 41], [17, 230]])


def test_checkpoint_is_what_it_declares(mt5_dir, mt5_llm, hf_mt5):
    with open(os.path.join(mt5_dir, "config.json")) as f:
        config = json.load(f)
    arch = {"mt5": "MT5ForConditionalGeneration", "umt5": "UMT5ForConditionalGeneration"}[config["model_type"]]
    assert config["architectures"] == [arch] and type(hf_mt5).__name__ == arch
    model = mt5_llm.llm_engine.model
    assert type(model).__name__ == arch
    assert model.output_scale is None and not model.fused_decode
    torch.testing.assert_close(model.lm_head.weight, hf_mt5.lm_head.weight, atol=0, rtol=0)
    if arch.startswith("UMT5"):  # every layer's own table, as HF's
        for ours, theirs in ((model.encoder, hf_mt5.encoder), (model.decoder, hf_mt5.decoder)):
            tables = [b.layer[0].SelfAttention.relative_attention_bias.weight for b in theirs.block]
            assert len(tables) == len(ours.relative_attention_bias) == 2 and not torch.equal(*tables)
            for table, mine in zip(tables, ours.relative_attention_bias):
                torch.testing.assert_close(mine.weight, table, atol=0, rtol=0)


def test_greedy_matches_hf_generate(mt5_llm, hf_mt5):
    outs = check_greedy(mt5_llm, hf_mt5, _prompts(mt5_llm, seed=0))
    assert max(len(o.encoder_prompt_token_ids) for o in outs) > 128  # past the largest bucket


def test_beam_search_matches_hf_generate(mt5_llm, hf_mt5):
    assert_beams_match_hf(mt5_llm, hf_mt5, _prompts(mt5_llm, seed=1))
