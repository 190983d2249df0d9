"""The measurement behind ``platform.precision``: the engine end to end, float32
against a reduced dtype, on a small random model of a real checkpoint's shape.

What must hold: the figure is what a user of that dtype gets, not what one
kernel does. A reduced dtype changes more than the matmuls: the float32 C
kernels (the fused decode step, paged and dense attention) decline other
dtypes and their callers take torch's paths, so a dtype whose matmul is twice
as fast can still decode slower. Hence the probe runs the engine itself (load,
prepack, schedule, encode, decode, sample) on the workload it serves:
encoder prompts of a few hundred tokens, then greedy decoding, where decode
steps take most of the time as in transcription and summarization.

The model: BART, Whisper tiny's widths (d_model 384, 6 heads of 64, ffn 1536)
and a Whisper/BART-sized vocabulary (the LM head is a large share of a decode
step), 2 encoder and 2 decoder layers, random weights from a fixed seed, saved
in a temporary folder as a Hugging Face checkpoint (safetensors and a
word-level tokenizer; no download, no ``transformers`` model class).

It runs in a process of its own (``python -m encdec.platform.precision_probe``,
started by ``platform.precision``): the engines it builds are the engine that
asks for the check, so the check's module does not import them, and the
caller's process keeps its memory and threads.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

from encdec.engine.arg_utils import EngineArgs
from encdec.engine.llm_engine import LLMEngine
from encdec.sampling_params import SamplingParams

D_MODEL, HEADS, FFN, LAYERS, VOCAB, POSITIONS = 384, 6, 1536, 2, 32768, 512
# The timed workload: prompts x encoder tokens, greedy tokens each (end of text ignored).
PROMPTS, PROMPT_LEN, NEW_TOKENS = 8, 200, 32
ROUNDS = (1, 3)  # timed rounds: at least the first, up to the last while the ratio is near 1
DECISIVE = (2 / 3, 1.5)  # a ratio outside this after one round is the answer
_SPECIAL = ("<s>", "<pad>", "</s>", "<unk>")  # BART's ids 0..3


def _bart_weights(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random weights under HF BART's parameter names (``lm_head`` tied to ``shared``)."""
    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    def norm(prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}.weight": torch.ones(D_MODEL), f"{prefix}.bias": torch.zeros(D_MODEL)}

    def linear(prefix: str, n_in: int, n_out: int) -> dict[str, torch.Tensor]:
        return {f"{prefix}.weight": normal(n_out, n_in), f"{prefix}.bias": torch.zeros(n_out)}

    def attention(prefix: str) -> dict[str, torch.Tensor]:
        return {k: v for proj in ("q", "k", "v", "out")
                for k, v in linear(f"{prefix}.{proj}_proj", D_MODEL, D_MODEL).items()}

    out = {"model.shared.weight": normal(VOCAB, D_MODEL), "final_logits_bias": torch.zeros(1, VOCAB)}
    for stack in ("encoder", "decoder"):
        out[f"model.{stack}.embed_positions.weight"] = normal(POSITIONS + 2, D_MODEL)
        out.update(norm(f"model.{stack}.layernorm_embedding"))
        for i in range(LAYERS):
            layer = f"model.{stack}.layers.{i}"
            out.update(attention(f"{layer}.self_attn"), **norm(f"{layer}.self_attn_layer_norm"))
            if stack == "decoder":
                out.update(attention(f"{layer}.encoder_attn"), **norm(f"{layer}.encoder_attn_layer_norm"))
            out.update(linear(f"{layer}.fc1", D_MODEL, FFN), **linear(f"{layer}.fc2", FFN, D_MODEL))
            out.update(norm(f"{layer}.final_layer_norm"))
    return out


def write_checkpoint(folder: str, *, seed: int = 0) -> str:
    """The probe's model saved in ``folder`` as a Hugging Face BART checkpoint."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    config = {
        "architectures": ["BartForConditionalGeneration"], "model_type": "bart", "vocab_size": VOCAB,
        "d_model": D_MODEL, "encoder_layers": LAYERS, "decoder_layers": LAYERS,
        "encoder_attention_heads": HEADS, "decoder_attention_heads": HEADS,
        "encoder_ffn_dim": FFN, "decoder_ffn_dim": FFN, "max_position_embeddings": POSITIONS,
        "activation_function": "gelu", "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2,
        "decoder_start_token_id": 2, "forced_bos_token_id": None, "forced_eos_token_id": None,
    }
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    save_file(_bart_weights(torch.Generator().manual_seed(seed)), os.path.join(folder, "model.safetensors"))
    vocab = {tok: i for i, tok in enumerate(_SPECIAL)}
    vocab.update((f"t{i}", i) for i in range(len(_SPECIAL), VOCAB))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            pad_token="<pad>").save_pretrained(folder)
    return folder


def _engine(folder: str, dtype: torch.dtype) -> LLMEngine:
    args = EngineArgs(folder, dtype=str(dtype).removeprefix("torch."), device="cpu", kv_cache_memory=32 << 20,
                      swap_space=0.01, max_num_seqs=PROMPTS, enable_encoder_cache=False)
    # check_precision=False: this engine is the measurement the check would wait for.
    return LLMEngine(args, check_precision=False)


def _generate(engine: LLMEngine, prompts: list[dict], params: SamplingParams) -> float:
    """Seconds for ``engine`` to run ``prompts`` to the end."""
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"probe-{i}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - t0


def time_ratio(dtype: torch.dtype) -> float:
    """``dtype``'s wall time over float32's for the workload above (``PROMPTS``), on
    torch's current thread count: one warm-up each, then rounds alternating the
    two, medians."""
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(len(_SPECIAL), VOCAB, (PROMPT_LEN,), generator=gen).tolist()}
               for _ in range(PROMPTS)]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False)
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, detokenize=False)
    with tempfile.TemporaryDirectory(prefix="encdec-precision-") as folder:
        write_checkpoint(folder)
        engines = {dt: _engine(folder, dt) for dt in (torch.float32, dtype)}
        times: dict[torch.dtype, list[float]] = {dt: [] for dt in engines}
        for engine in engines.values():  # first calls: oneDNN primitives, kernel loads, pages
            _generate(engine, prompts[:2], warm)
        ratio = 1.0
        for i in range(ROUNDS[1]):
            for dt, engine in engines.items():
                times[dt].append(_generate(engine, prompts, params))
            ratio = statistics.median(times[dtype]) / statistics.median(times[torch.float32])
            if i + 1 >= ROUNDS[0] and not DECISIVE[0] < ratio < DECISIVE[1]:
                break
    return ratio


def main(argv: list[str] | None = None) -> None:
    """``python -m encdec.platform.precision_probe bfloat16 --threads 2``: prints the
    ratio (``platform.precision`` runs this in a child process)."""
    ap = argparse.ArgumentParser(description="dtype's engine time over float32's on this CPU")
    ap.add_argument("dtype", choices=("bfloat16", "float16"))
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(time_ratio(getattr(torch, args.dtype)))


if __name__ == "__main__":
    main()
