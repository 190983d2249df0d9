"""Beam search throughput (``python -m benchmarks.bart_bench --beams K``): encdec
vs HF ``generate(num_beams=K)`` in padded batches, and CTranslate2
``beam_size=K`` on a converted copy when ``ctranslate2`` is installed.

Each request's output length is forced as in the greedy benchmark (ours:
``ignore_eos`` with ``max_tokens``; HF and CTranslate2: min = max new tokens per
batch, so a batch runs to its longest request). Useful tokens are each request's
own best hypothesis length, whoever computes more.
"""
from __future__ import annotations

import os
import time

from encdec.bench.common import OtherCPUMonitor, timed, warmup_prompts

from .harness import ct2_source, padded


def run_ours_beams(model_dir: str, enc, out_lens, beams: int) -> tuple[int, float]:
    from encdec import LLM, TokensPrompt
    from encdec.sampling_params import BeamSearchParams

    llm = LLM(model_dir, kv_cache_memory=3 << 30, swap_space=0.5)
    prompts = [TokensPrompt(prompt_token_ids=e) for e in enc]
    params = [BeamSearchParams(beams, n, ignore_eos=True) for n in out_lens]
    llm.generate(warmup_prompts(enc), params[:2], use_tqdm=False)  # warm-up
    outs, seconds = timed(llm.generate, prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == n for o, n in zip(outs, out_lens))
    return sum(out_lens), seconds


def run_hf_beams(model_dir: str, enc, out_lens, batch: int, beams: int) -> tuple[int, float]:
    import torch
    from transformers import BartForConditionalGeneration

    model = BartForConditionalGeneration.from_pretrained(model_dir).eval()
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(enc), batch):
            ids, mask = padded(enc[i:i + batch])
            m = max(out_lens[i:i + batch])
            model.generate(ids, attention_mask=mask, max_new_tokens=m, min_new_tokens=m, do_sample=False,
                           num_beams=beams, decoder_start_token_id=2, forced_bos_token_id=0,
                           no_repeat_ngram_size=0, early_stopping=False)
    return sum(out_lens), time.perf_counter() - t0


def run_ct2_beams(model_dir: str, enc, out_lens, batch: int, beams: int) -> tuple[int, float] | None:
    try:
        import ctranslate2
    except ImportError:
        return None
    import torch
    from transformers import AutoTokenizer

    ct2_dir = model_dir.rstrip("/") + "_ct2"
    if not os.path.exists(os.path.join(ct2_dir, "model.bin")):
        ctranslate2.converters.TransformersConverter(ct2_source(model_dir)).convert(ct2_dir, force=True)
    tok = AutoTokenizer.from_pretrained(model_dir)
    translator = ctranslate2.Translator(ct2_dir, device="cpu", inter_threads=1,
                                       intra_threads=torch.get_num_threads())
    sources = [tok.convert_ids_to_tokens(e) for e in enc]
    t0 = time.perf_counter()
    for i in range(0, len(enc), batch):
        m = max(out_lens[i:i + batch])
        translator.translate_batch(sources[i:i + batch], beam_size=beams, max_decoding_length=m,
                                   min_decoding_length=m, max_batch_size=batch)
    return sum(out_lens), time.perf_counter() - t0


def run_beam_bench(model_dir: str, enc, out_lens, *, beams: int, hf_batch: int, skip_hf: bool) -> None:
    with OtherCPUMonitor() as mon:
        useful, t_ours = run_ours_beams(model_dir, enc, out_lens, beams)
    ours = useful / t_ours
    print(f"encdec beams={beams}: {useful} tokens in {t_ours:.1f} s = {ours:.1f} tok/s; {mon.summary()}")
    if skip_hf:
        return
    with OtherCPUMonitor() as mon:
        useful, t_hf = run_hf_beams(model_dir, enc, out_lens, hf_batch, beams)
    hf = useful / t_hf
    print(f"HF generate num_beams={beams} (batches of {hf_batch}): {useful} tokens in {t_hf:.1f} s = "
          f"{hf:.1f} tok/s; {mon.summary()}")
    with OtherCPUMonitor() as mon:
        ct2 = run_ct2_beams(model_dir, enc, out_lens, hf_batch, beams)
    if ct2 is None:
        print("CTranslate2: not installed (pip install ctranslate2)")
    else:
        ct2_rate = ct2[0] / ct2[1]
        print(f"CTranslate2 beam_size={beams} (batches of {hf_batch}): {ct2[0]} tokens in {ct2[1]:.1f} s = "
              f"{ct2_rate:.1f} tok/s; {mon.summary()}")
    print(f"ratio encdec / HF: {ours / hf:.2f}x" + (f"; encdec / CTranslate2: {ours / ct2_rate:.2f}x"
                                                   if ct2 is not None else ""))
