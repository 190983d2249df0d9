"""Speech -> text for whole files of any length (``LLM.transcribe`` delegates here).

Long audio is cut into windows of at most 30 s, and the windows of ALL inputs
go to the engine at once, so a batch of short files and one long file keep the
batch full. openai/whisper instead seeks each next window to the last timestamp
it decoded, which makes a file's windows sequential (one request in flight per
file). We fix the windows from the audio alone, cutting each at the quietest
100 ms of its last 5 s so that cuts fall between words, and trade the seek's
boundary refinement for batching. With ``timestamps=True`` segments come from the
timestamp tokens, offset by the window start; without, each window is one
segment. Multilingual models with ``language=None`` first detect each input's
language from its first window (one step over the language tokens).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from encdec.audio import N_SAMPLES, SAMPLE_RATE, load_audio

TIME_PRECISION = 0.02  # seconds per timestamp token
SEARCH_SAMPLES = 5 * SAMPLE_RATE  # window cuts are placed in the last 5 s of a window
SILENCE_PEAK = 1e-4  # a window whose |sample| never exceeds this is digital silence


@dataclass
class Segment:
    start: float  # seconds from the start of the input
    end: float
    text: str


@dataclass
class Transcription:
    text: str
    segments: list[Segment] = field(default_factory=list)
    language: str | None = None


def _as_inputs(audio: Any) -> list[Any]:
    """One input (path, (array, sr), 1-D array) or a list of them -> a list."""
    if isinstance(audio, (str, os.PathLike, np.ndarray)) or (
            isinstance(audio, tuple) and len(audio) == 2 and isinstance(audio[1], (int, np.integer))):
        return [audio]
    if isinstance(audio, (list, tuple)):
        if not audio:
            raise ValueError("audio is an empty list: give at least one input")
        return list(audio)
    if hasattr(audio, "shape"):  # a torch tensor
        return [audio]
    raise ValueError(f"audio must be a path, an (array, sample_rate) tuple, a 1-D array, "
                     f"or a list of those; got {type(audio).__name__}")


def _windows(wav: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """(start sample, samples) per window of at most 30 s. A window that does not
    reach the end is cut at the quietest 100 ms of its last 5 s, so that cuts
    fall between words; windows of digital silence after the first are dropped
    (Whisper hallucinates on them)."""
    out: list[tuple[int, np.ndarray]] = []
    start = 0
    while start < len(wav) or not out:
        end = min(start + N_SAMPLES, len(wav))
        if end < len(wav):
            end = start + _quietest_cut(wav[start + N_SAMPLES - SEARCH_SAMPLES: start + N_SAMPLES],
                                        N_SAMPLES - SEARCH_SAMPLES)
        chunk = wav[start:end]
        if not out or np.abs(chunk).max() > SILENCE_PEAK:
            out.append((start, chunk))
        start = end
    return out


def _quietest_cut(tail: np.ndarray, base: int) -> int:
    """Offset (from the window start) of the middle of the quietest 100 ms frame in ``tail``."""
    frame, hop = SAMPLE_RATE // 10, SAMPLE_RATE // 50
    n = (len(tail) - frame) // hop + 1
    idx = np.arange(frame)[None, :] + hop * np.arange(n)[:, None]  # (n, frame)
    energy = np.square(tail[idx]).mean(axis=1)
    best = int(np.argmin(energy[::-1]))  # ties -> the latest frame, for the longest window
    return base + hop * (n - 1 - best) + frame // 2


def _engine_parts(llm: Any):
    engine = getattr(llm, "llm_engine", None)
    if engine is None or not hasattr(engine, "generation_config"):
        raise ValueError("transcribe needs an encdec LLM (with llm_engine) running a Whisper model")
    gc = engine.generation_config
    if getattr(gc, "no_timestamps_token_id", None) is None:
        raise ValueError(f"transcribe needs a Whisper model; this LLM runs "
                         f"{getattr(engine.hf_config, 'model_type', '?')}")
    return engine, engine.hf_config, gc, llm.get_tokenizer()


def _prompt(window: np.ndarray, dec_ids: list[int]) -> dict:
    return {"encoder_prompt": {"prompt": "", "multi_modal_data": {"audio": (window, SAMPLE_RATE)}},
            "decoder_prompt": {"prompt_token_ids": dec_ids}}


def _run(llm: Any, prompts: list[dict], params: Any, seconds: list[float], use_tqdm: bool) -> list[Any]:
    """Decode every window in one engine run; the bar counts audio seconds done
    and the real-time factor."""
    if not use_tqdm:
        return llm._generate(prompts, [params] * len(prompts), None, None)
    from tqdm.auto import tqdm

    total = round(sum(seconds), 1)
    bar = tqdm(total=total, desc="Transcribed audio", unit="s", dynamic_ncols=True)
    start = time.perf_counter()
    first_id = llm._request_counter  # ids are consecutive integers from here
    done = [0.0]

    def progress(out: Any) -> None:
        sec = seconds[int(out.request_id) - first_id]
        done[0] += sec
        bar.n = min(round(done[0], 1), total)  # no float drift past the total
        bar.refresh()
        rtf = (time.perf_counter() - start) / max(done[0], 1e-9)
        bar.set_postfix_str(f"RTF {rtf:.3f} ({1 / max(rtf, 1e-9):.1f}x real time)")

    try:
        return llm._generate(prompts, [params] * len(prompts), None, progress)
    finally:
        bar.close()


def _detect_languages(llm, firsts: list[np.ndarray], gc) -> list[str]:
    """One greedy step on ``<|startoftranscript|>`` restricted to language tokens."""
    from encdec.sampling_params import SamplingParams

    lang_to_id = gc.lang_to_id
    params = SamplingParams(temperature=0.0, max_tokens=1, allowed_token_ids=sorted(lang_to_id.values()))
    outs = _run(llm, [_prompt(w, [gc.decoder_start_token_id]) for w in firsts], params,
                [len(w) / SAMPLE_RATE for w in firsts], use_tqdm=False)
    by_id = {v: k[2:-2] for k, v in lang_to_id.items()}
    return [by_id[o.outputs[0].token_ids[0]] for o in outs]


def _segments(tokens: list[int], offset: float, window_end: float, ts_begin: int, eot: int,
              tokenizer, timestamps: bool) -> list[Segment]:
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    if not timestamps:
        text = decode([t for t in tokens if t < eot])
        return [Segment(offset, window_end, text)] if text.strip() else []
    segs: list[Segment] = []
    start: float | None = None
    text_ids: list[int] = []
    for t in tokens:
        if t >= ts_begin:
            time_s = min(offset + (t - ts_begin) * TIME_PRECISION, window_end)
            if start is None:
                start = time_s
            else:
                if text_ids:
                    segs.append(Segment(start, max(time_s, start), decode(text_ids)))
                start, text_ids = (time_s if not text_ids else None), []
        elif t < eot:
            if start is None:  # text before any timestamp: starts where the last ended
                start = segs[-1].end if segs else offset
            text_ids.append(t)
    if text_ids:  # an unclosed segment runs to the window end
        segs.append(Segment(start if start is not None else offset, window_end, decode(text_ids)))
    return [s for s in segs if s.text.strip()]


def transcribe(llm: Any, audio: Any, *, language: str | None = None, task: str = "transcribe",
               timestamps: bool = False, prompt: str | None = None, sampling_params: Any = None,
               use_tqdm: bool = True) -> list[Transcription]:
    """One ``Transcription`` per input; see the module docstring for windowing."""
    from encdec.models.whisper import default_decoder_prompt, language_token
    from encdec.sampling_params import SamplingParams

    engine, hf_config, gc, tokenizer = _engine_parts(llm)
    inputs = _as_inputs(audio)
    wavs = []
    for i, a in enumerate(inputs):
        try:
            wavs.append(load_audio(a))
        except ValueError as e:
            raise ValueError(f"audio input {i}: {e}") from None
    if prompt is not None and not isinstance(prompt, str):
        raise ValueError(f"prompt must be a str, got {type(prompt).__name__}")
    default_decoder_prompt(hf_config, gc, language=language, task=task)  # validates options early
    windows = [_windows(w) for w in wavs]
    multilingual = bool(getattr(gc, "is_multilingual", False))
    if not multilingual:
        languages = ["en"] * len(wavs)
    elif language is None:
        languages = _detect_languages(llm, [ws[0][1] for ws in windows], gc)
    else:
        token = language_token(gc, language)
        languages = [next(k[2:-2] for k, v in gc.lang_to_id.items() if v == token)] * len(wavs)
    prev: list[int] = []
    if prompt:
        # HF get_prompt_ids: <|startofprev|> + " text", keeping at most max_length // 2 - 1 tokens.
        text_ids = tokenizer.encode(" " + prompt.strip(), add_special_tokens=False)
        prev = [gc.prev_sot_token_id] + text_ids[-(hf_config.max_target_positions // 2 - 1):]
    # Greedy, up to the decoder's 448 positions, as HF generate (vLLM's default max_tokens is 16).
    params = sampling_params or SamplingParams(temperature=0.0, max_tokens=None)
    prompts, seconds, where = [], [], []
    for i, ws in enumerate(windows):
        dec = prev + default_decoder_prompt(hf_config, gc, language=languages[i] if multilingual else None,
                                            task=task, timestamps=timestamps)
        for start, chunk in ws:
            prompts.append(_prompt(chunk, dec))
            seconds.append(len(chunk) / SAMPLE_RATE)
            where.append((i, start / SAMPLE_RATE))
    outs = _run(llm, prompts, params, seconds, use_tqdm)
    ts_begin, eot = gc.no_timestamps_token_id + 1, gc.eos_token_id
    results = [Transcription("", [], languages[i]) for i in range(len(wavs))]
    for out, (i, offset), dur in zip(outs, where, seconds):
        segs = _segments(out.outputs[0].token_ids, offset, offset + dur, ts_begin, eot, tokenizer, timestamps)
        results[i].segments += segs
    for r in results:
        r.text = "".join(s.text for s in r.segments).strip()
        for s in r.segments:
            s.text = s.text.strip()
    return results


# ---- output formats ----

def _clock(seconds: float, sep: str) -> str:
    ms = int(round(seconds * 1000))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def to_txt(t: Transcription) -> str:
    return t.text + "\n"


def to_json(t: Transcription) -> str:
    return json.dumps(asdict(t), ensure_ascii=False, indent=2) + "\n"


def to_srt(t: Transcription) -> str:
    blocks = [f"{i}\n{_clock(s.start, ',')} --> {_clock(s.end, ',')}\n{s.text}\n"
              for i, s in enumerate(t.segments, 1)]
    return "\n".join(blocks)


def to_vtt(t: Transcription) -> str:
    blocks = [f"{_clock(s.start, '.')} --> {_clock(s.end, '.')}\n{s.text}\n" for s in t.segments]
    return "WEBVTT\n\n" + "\n".join(blocks)


FORMATS = {"txt": to_txt, "json": to_json, "srt": to_srt, "vtt": to_vtt}


def format_transcription(t: Transcription, fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {sorted(FORMATS)}, got {fmt!r}")
    return FORMATS[fmt](t)
