"""``bart_bench --family t5|marian|m2m100``: our engine, HF ``generate`` and
CTranslate2 (when installed) on random weights at a public checkpoint's
dimensions, with bart_bench's mixed workload (encoder lengths 32..512, forced
output lengths 8..128, greedy), in one run.

Each side decodes from the family's own decoder start (T5 and Marian <pad>,
M2M100 </s>) with no forced first token; HF and CTranslate2 run padded batches
in input order, each until its longest request is done, and only each
request's own tokens count.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Callable

from encdec.bench.common import OtherCPUMonitor, load_label

from .harness import padded, run_ct2, run_ours


@dataclass(frozen=True)
class Family:
    checkpoint: str  # whose dimensions the random weights take
    make: Callable[[str], str]  # out_dir -> out_dir: save the random checkpoint
    pad: int  # the pad id HF's padded batches use


def _t5(d: str) -> str:
    from encdec.testing import make_random_t5

    return make_random_t5(d, vocab_size=32128, d_model=768, d_kv=64, layers=12, heads=12, ffn=3072)


def _marian(d: str) -> str:
    from encdec.testing import make_random_marian

    return make_random_marian(d, vocab_size=58101, d_model=512, layers=6, heads=8, ffn=2048, max_positions=512)


def _m2m100(d: str) -> str:
    from encdec.testing import make_random_m2m100

    return make_random_m2m100(d, vocab_size=128112, d_model=1024, layers=12, heads=16, ffn=4096,
                              max_positions=1024)


FAMILIES = {
    "t5": Family("t5-base (12+12 layers, d_model 768, 12 heads, ffn 3072, vocab 32128)", _t5, 0),
    "marian": Family("opus-mt-en-de (6+6 layers, d_model 512, 8 heads, ffn 2048, vocab 58101)", _marian, 58100),
    "m2m100": Family("m2m100_418M (12+12 layers, d_model 1024, 16 heads, ffn 4096, vocab 128112)", _m2m100, 1),
}


def family_checkpoint(family: str, model_dir: str | None) -> str:
    """``model_dir``, or the family's random checkpoint made once in the temp folder."""
    model_dir = model_dir or os.path.join(tempfile.gettempdir(), f"encdec_bench_{family}_base")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        FAMILIES[family].make(model_dir)
    return model_dir


def run_hf_family(model_dir: str, enc, out_lens, batch: int, pad: int) -> tuple[int, float]:
    """HF ``generate``, greedy, padded batches forced to their longest output."""
    import time

    import torch
    from transformers import AutoModelForSeq2SeqLM

    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir).eval()
    useful = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(enc), batch):
            ids, mask = padded(enc[i:i + batch], pad)
            m = max(out_lens[i:i + batch])
            g = model.generate(ids, attention_mask=mask, max_new_tokens=m, min_new_tokens=m, do_sample=False,
                               num_beams=1, forced_bos_token_id=None)
            assert g.shape[1] >= m
            useful += sum(out_lens[i:i + batch])
    return useful, time.perf_counter() - t0


def run_family_bench(family: str, model_dir: str, enc_out, *, hf_batch: int, skip_hf: bool,
                     compute_type: str = "float32") -> None:
    """Ours, HF's and CTranslate2's tokens/s on one family's ``model_dir``
    (``family_checkpoint``), and the ratios. ``compute_type`` "int8": ours with
    ``quantization="int8"`` and CTranslate2 int8 (HF stays float32)."""
    from encdec.engine.arg_utils import compute_type_options

    fam = FAMILIES[family]
    enc, out_lens = enc_out
    ct = "" if compute_type == "float32" else f" {compute_type}"
    print(f"family {family}: random weights at {fam.checkpoint}")
    with OtherCPUMonitor() as mon:
        useful, t_ours = run_ours(model_dir, enc, out_lens, False, compute_type_options(compute_type))
    ours = useful / t_ours
    print(f"{load_label(0)} encdec{ct}: {useful} tokens in {t_ours:.1f} s = {ours:.1f} tok/s; {mon.summary()}")
    if not skip_hf:
        with OtherCPUMonitor() as mon:
            useful_hf, t_hf = run_hf_family(model_dir, enc, out_lens, hf_batch, fam.pad)
        hf = useful_hf / t_hf
        print(f"HF generate (batches of {hf_batch}): {useful_hf} tokens in {t_hf:.1f} s = {hf:.1f} tok/s; "
              f"{mon.summary()}")
        print(f"ratio encdec{ct} / HF: {ours / hf:.2f}x" + (" (target >= 3)" if not ct else ""))
    try:
        with OtherCPUMonitor() as mon:
            useful_ct2, t_ct2, _ = run_ct2(model_dir, enc, out_lens, hf_batch, compute_type, prefix=())
    except ImportError:
        print("ctranslate2 not installed: its row skipped")
        return
    ct2 = useful_ct2 / t_ct2
    print(f"CTranslate2 {compute_type} (batches of {hf_batch}): {useful_ct2} tokens in {t_ct2:.1f} s = "
          f"{ct2:.1f} tok/s; {mon.summary()}")
    print(f"ratio encdec{ct} / CTranslate2{ct}: {ours / ct2:.2f}x (target >= 1.5)")
