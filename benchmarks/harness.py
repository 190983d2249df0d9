"""What the comparison harnesses share: the mixed BART-style workload and HF's
padded batches (``make_workload``, ``padded``), our side (``run_ours``), the
CTranslate2 side on a converted copy of the same weights (``run_ct2``,
``ct2_source``) and how two runs' tokens agree (``agreement``). bart_bench,
bart_beams, families and gpu_bench import it; it imports none of them."""
from __future__ import annotations

import json
import os
import random
import time

from encdec.bench.common import timed, warmup_prompts


def make_workload(n: int, vocab: int, seed: int):
    rng = random.Random(seed)
    enc = [[rng.randrange(4, vocab - 1) for _ in range(rng.randint(32, 512))] for _ in range(n)]
    out = [rng.randint(8, 128) for _ in range(n)]
    return enc, out


def padded(chunk: list[list[int]], pad: int = 1):
    """(ids, attention mask) of a right-padded batch (BART's pad id 1), as HF takes them."""
    import torch

    width = max(map(len, chunk))
    ids = torch.full((len(chunk), width), pad, dtype=torch.long)
    mask = torch.zeros((len(chunk), width), dtype=torch.long)
    for r, e in enumerate(chunk):
        ids[r, :len(e)] = torch.tensor(e)
        mask[r, :len(e)] = 1
    return ids, mask


def ct2_source(model_dir: str) -> str:
    """CTranslate2's BART converter reads ``config.normalize_before``, which
    transformers 5 no longer sets: a twin directory (weights linked) says False
    (BART is post-norm)."""
    src = model_dir.rstrip("/") + "_ct2src"
    os.makedirs(src, exist_ok=True)
    for name in os.listdir(model_dir):
        if name != "config.json" and not os.path.exists(os.path.join(src, name)):
            os.symlink(os.path.join(os.path.abspath(model_dir), name), os.path.join(src, name))
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    config.setdefault("normalize_before", False)
    with open(os.path.join(src, "config.json"), "w") as f:
        json.dump(config, f)
    return src


def run_ct2(model_dir: str, enc, out_lens, batch: int, compute_type: str,
            prefix: tuple[str, ...] = ("<s>",)) -> tuple[int, float, list[list[int]]]:
    """CTranslate2 on the same weights (converted once beside them), padded
    batches of ``batch`` in input order forced to each batch's longest output, as
    HF; each target starts with ``prefix`` (BART's forced <s>; none for the other families)."""
    import ctranslate2
    import torch
    from ctranslate2.converters import TransformersConverter
    from transformers import AutoTokenizer

    ct2_dir = model_dir.rstrip("/") + "_ct2"
    if not os.path.exists(os.path.join(ct2_dir, "model.bin")):
        with open(os.path.join(model_dir, "config.json")) as f:
            bart = json.load(f).get("model_type") == "bart"
        TransformersConverter(ct2_source(model_dir) if bart else model_dir).convert(ct2_dir, force=True)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tr = ctranslate2.Translator(ct2_dir, device="cpu", compute_type=compute_type,
                                intra_threads=torch.get_num_threads())
    src = [tok.convert_ids_to_tokens(e) for e in enc]
    prefixes = [list(prefix)] * len(src)
    tr.translate_batch(src[:2], target_prefix=prefixes[:2], max_decoding_length=4, beam_size=1)  # warm-up
    tokens, useful = [], 0
    t0 = time.perf_counter()
    for i in range(0, len(src), batch):
        m = max(out_lens[i:i + batch]) + len(prefix)
        res = tr.translate_batch(src[i:i + batch], target_prefix=prefixes[i:i + batch],
                                 max_decoding_length=m, min_decoding_length=m, beam_size=1,
                                 max_batch_size=batch)
        tokens += [tok.convert_tokens_to_ids(r.hypotheses[0]) for r in res]
        useful += sum(out_lens[i:i + batch])
    return useful, time.perf_counter() - t0, tokens


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """The share of positions where two runs' tokens agree (each pair up to the shorter)."""
    pairs = [(x, y) for s, t in zip(a, b) for x, y in zip(s, t)]
    return sum(x == y for x, y in pairs) / max(len(pairs), 1)


def run_ours(model_dir: str, enc, out_lens, profile: bool, engine_kw: dict | None = None,
             tokens: list | None = None) -> tuple[int, float]:
    """Our run (``engine_kw``: LLM options); appends each request's tokens to ``tokens``."""
    from encdec import LLM, SamplingParams, TokensPrompt

    llm = LLM(model_dir, kv_cache_memory=3 << 30, swap_space=0.5, **(engine_kw or {}))
    prompts = [TokensPrompt(prompt_token_ids=e) for e in enc]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in out_lens]
    llm.generate(warmup_prompts(enc), params[:2], use_tqdm=False)
    runner = llm.llm_engine.model_runner
    sampler_time = [0.0]
    sample = runner.sampler

    def timed_sampler(logits, md):
        t0 = time.perf_counter()
        out = sample(logits, md)
        sampler_time[0] += time.perf_counter() - t0
        return out

    runner.sampler = timed_sampler
    if profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
    outs, seconds = timed(llm.generate, prompts, params, use_tqdm=False)
    if profile:
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
    assert all(len(o.outputs[0].token_ids) == n for o, n in zip(outs, out_lens))
    if tokens is not None:
        tokens += [list(o.outputs[0].token_ids) for o in outs]
    print(f"sampler: {sampler_time[0]:.2f} s = {100 * sampler_time[0] / seconds:.2f}% of the run "
          "(all greedy, no processors enabled)")
    return sum(out_lens), seconds
