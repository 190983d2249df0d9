"""Served vs offline throughput: ``encdec serve`` at 1, 16 and 200 concurrent streaming
clients against ``LLM.generate`` on the same requests and the same weights.

The requests (token-id encoder prompts, greedy, fixed output lengths with
``ignore_eos``) run once offline in this process, then through a server
subprocess on 127.0.0.1, whose clients are a few lines of asyncio here (no HTTP
library: the client must cost the shared CPU as little as possible). Time to
first token and request latency are measured at the client, from sending the
request to the first text chunk and to the end of the stream.

``--ray --replicas N`` also runs the same clients against ``encdec serve --ray``
(a local Ray cluster: N engine replicas of one torch thread behind the Ray Serve
ingress), to measure what the Ray path costs against one ``encdec serve``;
``--ingress serve haproxy`` runs it once behind each front door (Serve's Python
proxy, Serve's HAProxy ingress), in the same run.
``--disaggregate encoders=E,decoders=D`` does the same with the encoder passes on
E encoder workers, and prints what moved from them to the decoder engines: bytes
per request (against the cross K/V the engine makes of them) and the time a
transfer took (an encoder call's round trip less the encoder's own time).

Two kinds of load. Closed loop (``--concurrency``): each client sends its next
request when its last one ends, so the server runs saturated and every CPU-ms it
spends outside the engines comes out of their throughput. Open loop (``--load``,
``--rate``): the requests arrive as a seeded Poisson process at a fixed rate,
whatever is in flight, the same schedule for every server; at a rate below
capacity both servers keep up, and the overhead shows as latency and CPU. By
default the rates are 50% and 80% of the best closed-loop request rate of the
first server (``encdec serve``). A table at the end puts each server beside
``encdec serve`` at each load.

    python -m benchmarks.serve_bench [--requests 200] [--concurrency 1 16 200] [--model-dir DIR]
                                     [--ray --replicas 2] [--disaggregate encoders=1,decoders=1]
                                     [--ingress serve haproxy]
                                     [--load 0.5 0.8 | --rate R ...]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from .common import OtherCPUMonitor, timed, warmup_prompts


def make_workload(n: int, vocab: int, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    enc = [[rng.randrange(4, vocab - 1) for _ in range(rng.randint(16, 128))] for _ in range(n)]
    out = [rng.randint(8, 48) for _ in range(n)]
    return enc, out


def run_offline(model_dir: str, enc, out_lens, engine_opts: dict) -> tuple[list[list[int]], float]:
    from encdec import LLM, SamplingParams, TokensPrompt

    llm = LLM(model_dir, **engine_opts)
    prompts = [TokensPrompt(prompt_token_ids=e) for e in enc]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in out_lens]
    llm.generate(warmup_prompts(enc), params[:2], use_tqdm=False)  # warm-up
    outs, seconds = timed(llm.generate, prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], seconds


async def stream_one(port: int, body: dict) -> tuple[float, list[int], float]:
    """POST one streaming completion; (seconds to the first token, token ids, seconds in all)."""
    payload = json.dumps(body).encode()
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(payload), payload))
    await writer.drain()
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"server answered {status!r}: {await reader.read(2000)!r}")
    while (await reader.readline()) not in (b"\r\n", b""):
        pass  # headers
    ttft, ids, buf = None, [], b""
    while True:  # chunked transfer encoding of SSE lines
        size = int((await reader.readline()).strip() or b"0", 16)
        if size == 0:
            break
        buf += await reader.readexactly(size)
        await reader.readexactly(2)
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            data = event.removeprefix(b"data: ")
            if data == b"[DONE]":
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            for c in chunk["choices"]:
                toks = c["logprobs"]["tokens"]
                if toks and ttft is None:
                    ttft = time.perf_counter() - t0
                ids += [int(t.removeprefix("token_id:")) for t in toks]
    writer.close()
    return ttft or 0.0, ids, time.perf_counter() - t0


async def run_clients(port: int, enc, out_lens, concurrency: int) -> tuple[list[list[int]], list[tuple], float]:
    """``concurrency`` clients, each sending the next unsent request when its last finishes."""
    results: list = [None] * len(enc)
    todo = iter(range(len(enc)))

    async def client() -> None:
        for i in todo:
            results[i] = await stream_one(port, _body(enc, out_lens, i))

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    seconds = time.perf_counter() - t0
    return [r[1] for r in results], [(r[0], r[2]) for r in results], seconds


def _body(enc, out_lens, i: int) -> dict:
    return {"prompt": enc[i], "max_tokens": out_lens[i], "temperature": 0, "ignore_eos": True,
            "stream": True, "logprobs": 0, "return_tokens_as_token_ids": True}


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Send times (seconds from the start) of ``n`` requests arriving as a Poisson
    process of ``rate`` a second: exponential gaps from a seeded generator, so
    that every server compared is offered the very same schedule."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        times.append(t)
    return times


async def run_open_loop(port: int, enc, out_lens, arrivals: list[float]) -> tuple[list[list[int]], list[tuple], float]:
    """Open loop: request i is sent ``arrivals[i]`` seconds after the start, however
    many are still in flight (a closed loop's clients wait for their answers, so
    a slower server is offered less). TTFT and latency count from the scheduled
    send time, so a client late to send (its loop busy) is counted against the
    server too; seconds run from the start to the last answer."""
    results: list = [None] * len(enc)
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        due = t0 + arrivals[i]
        if due > time.perf_counter():
            await asyncio.sleep(due - time.perf_counter())
        lag = time.perf_counter() - due
        ttft, ids, total = await stream_one(port, _body(enc, out_lens, i))
        results[i] = (ttft + lag, ids, total + lag)

    await asyncio.gather(*(one(i) for i in range(len(enc))))
    seconds = time.perf_counter() - t0
    return [r[1] for r in results], [(r[0], r[2]) for r in results], seconds


def start_server(model_dir: str, engine_args: list[str]) -> tuple[subprocess.Popen, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "encdec.entrypoints.cli", "serve", model_dir,
                             "--port", str(port), "--log-level", "warning", *engine_args])
    deadline = time.monotonic() + 600  # --ray: a cluster to start first
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as c:
                c.sendall(b"GET /health HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")
                if b" 200 " in c.recv(100):
                    return proc, port
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not become healthy in 600 s")


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def ensure_model() -> str:
    """The benchmark's random 4-layer BART (d_model 256, vocab 16384), made once in the temp dir."""
    from encdec.testing import make_random_bart

    model_dir = os.path.join(tempfile.gettempdir(), "encdec_serve_bench_bart")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        make_random_bart(model_dir, vocab_size=16384, d_model=256, layers=4, heads=4, ffn=1024,
                         max_positions=512, init_std=0.02, position_std=0.02)
    return model_dir


def main(argv: list[str] | None = None, *, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 200])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-dir", default=None,
                    help="a checkpoint (default: a random 4-layer BART, d_model 256, vocab 16384)")
    ap.add_argument("--ray", action="store_true", help="also through encdec serve --ray (the serve-ray extra)")
    ap.add_argument("--replicas", type=int, default=2, help="engine replicas with --ray")
    ap.add_argument("--disaggregate", default=None, metavar="encoders=E,decoders=D",
                    help="also through encdec serve --ray --disaggregate (encoder workers + decoder engines)")
    ap.add_argument("--disaggregate-threads", type=int, default=os.cpu_count() or 1, metavar="N",
                    help="torch threads of the disaggregated decoder engine and of each encoder worker (default: "
                         "every CPU: the decoder engine is the one engine, as encdec serve's; encoder passes come "
                         "between its steps)")
    ap.add_argument("--no-encoder-cache", action="store_true",
                    help="every server and offline without the encoder cache, so that each run's requests (the "
                         "same in every run) run their encoder again; disaggregated: on an encoder worker")
    ap.add_argument("--ingress", nargs="+", choices=["serve", "haproxy"], default=["serve"],
                    help="the Ray servers' front door(s): each one given is a server of its own in the run "
                         "(Serve's Python proxy, Serve's HAProxy ingress)")
    ap.add_argument("--rate", type=float, nargs="*", default=None, metavar="R",
                    help="open-loop runs at R requests/s each (Poisson arrivals, seeded; the same schedule "
                         "for every server); default: --load of encdec serve's best closed-loop rate")
    ap.add_argument("--load", type=float, nargs="*", default=[0.5, 0.8], metavar="F",
                    help="open-loop runs at these fractions of encdec serve's best closed-loop request rate")
    ap.add_argument("--per-process", action="store_true",
                    help="print each server process's CPU seconds in each run (with --ray: proxy, replicas, ...)")
    args = ap.parse_args(argv)
    for flag, values in (("--rate", args.rate or []), ("--load", args.load)):
        if not all(v > 0 for v in values):  # checked before any server starts
            ap.error(f"{flag} values must be > 0, got {values}")

    model_dir = args.model_dir or ensure_model()
    with open(os.path.join(model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    enc, out_lens = make_workload(args.requests, vocab, args.seed)
    total = sum(out_lens)
    opts = dict(kv_cache_memory=1 << 30, swap_space=0.5, max_num_seqs=256,
                enable_encoder_cache=not args.no_encoder_cache)
    print(f"workload: {args.requests} requests, encoder tokens {sum(map(len, enc))}, output tokens "
          f"{total}, greedy, ignore_eos; model {model_dir}; {os.cpu_count()} CPUs; encoder cache "
          f"{'off' if args.no_encoder_cache else 'on (runs after the first find every encoder output cached)'}")

    with OtherCPUMonitor() as mon:
        ref, seconds = run_offline(model_dir, enc, out_lens, opts)
    offline = total / seconds
    print(f"offline LLM.generate: {total} tokens in {seconds:.2f} s = {offline:.1f} tok/s; {mon.summary()}")

    engine = ["--kv-cache-memory", str(opts["kv_cache_memory"]), "--swap-space", str(opts["swap_space"]),
              "--max-num-seqs", str(opts["max_num_seqs"])]
    engine += ["--no-enable-encoder-cache"] if args.no_encoder_cache else []
    servers = [("encdec serve", engine)]
    for ingress in args.ingress:
        # the label names a non-default front door; the flag goes to every Ray server
        door = ([], "") if ingress == "serve" else (["--ingress", ingress], f" --ingress {ingress}")
        if args.ray:
            servers.append((f"encdec serve --ray --replicas {args.replicas}{door[1]}",
                            [*engine, "--ray", "--replicas", str(args.replicas), "--num-threads", "1", *door[0]]))
        if args.disaggregate:
            threads = str(args.disaggregate_threads)
            servers.append((f"encdec serve --ray --disaggregate {args.disaggregate} --num-threads {threads}{door[1]}",
                            [*engine, "--ray", "--disaggregate", args.disaggregate, "--num-threads", threads,
                             *door[0]]))
    rows: list[Measured] = []
    rates = [(r, "given") for r in args.rate] if args.rate else None
    for label, flags in servers:
        measured, rates = bench_server(label, model_dir, flags, enc, out_lens, ref, offline, args.concurrency,
                                       rates, args.load, args.seed, args.per_process)
        rows += measured
    print_summary(rows)


@dataclass
class Measured:
    """One run of the workload through one server."""
    label: str  # the server
    mode: str  # "16 clients" (closed loop) or "open loop ..." (the offered rate)
    tokens_per_s: float
    requests_per_s: float
    ttft: tuple[float, float]  # p50, p99 seconds
    latency: tuple[float, float]
    cpu_seconds: float  # the server's processes (with --ray: the cluster's)
    cpu_percent: float  # of one core, over the run
    requests: int


def bench_server(label: str, model_dir: str, flags: list[str], enc, out_lens, ref, offline: float,
                 concurrency: list[int], rates: list[tuple[float, str]] | None, load: list[float],
                 seed: int, per_process: bool = False) -> tuple[list[Measured], list[tuple[float, str]]]:
    """Each concurrency (closed loop), then each offered rate (open loop, seeded
    Poisson arrivals), through a server started with ``flags``; its CPU counts the
    processes it started (with --ray: the cluster's). ``rates`` None: ``load``
    fractions of this server's best closed-loop request rate, returned for the
    servers that follow (each server compared is offered the same schedule)."""
    import psutil

    proc, port = start_server(model_dir, flags)
    try:
        asyncio.run(run_clients(port, enc[:2], out_lens[:2], 2))  # warm-up
        server = psutil.Process(proc.pid)
        rows = [_measure(label, f"{c} clients", server, run_clients(port, enc, out_lens, c), out_lens, ref, offline,
                         per_process) for c in concurrency]
        if rates is None:
            best = max((r.requests_per_s for r in rows), default=0.0)
            rates = [(f * best, f"{100 * f:.0f}% of {label}'s max") for f in load] if best else []
        for rate, why in rates:
            arrivals = poisson_arrivals(len(enc), rate, seed)
            rows.append(_measure(label, f"open loop {rate:.1f} req/s ({why})", server,
                                 run_open_loop(port, enc, out_lens, arrivals), out_lens, ref, offline,
                                 per_process))
        if "--disaggregate" in flags:
            from encdec.bench.ray_bench import print_transfers

            print_transfers(port, model_dir, label)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return rows, rates


def _measure(label: str, mode: str, server, clients, out_lens, ref, offline: float,
             per_process: bool = False) -> Measured:
    """Run the ``clients`` coroutine against the server and print what it gave."""
    total = sum(out_lens)
    before = _cpu_by_process(server)
    with OtherCPUMonitor() as mon:
        ids, times, seconds = asyncio.run(clients)
    after = _cpu_by_process(server)
    spent = {f"{name} [{pid}]": cpu - before.get(pid, ("", 0.0))[1] for pid, (name, cpu) in after.items()}
    cpu = sum(spent.values())
    same = sum(a == b for a, b in zip(ids, ref))
    ttfts, latency = [t[0] for t in times], [t[1] for t in times]
    m = Measured(label, mode, total / seconds, len(ids) / seconds, (statistics.median(ttfts), pct(ttfts, 0.99)),
                 (statistics.median(latency), pct(latency, 0.99)), cpu, 100 * cpu / seconds, len(ids))
    print(f"{label}, {mode}: {total} tokens in {seconds:.2f} s = {m.tokens_per_s:.1f} tok/s "
          f"({100 * m.tokens_per_s / offline:.0f}% of offline); TTFT p50 {1000 * m.ttft[0]:.0f} ms, "
          f"p99 {1000 * m.ttft[1]:.0f} ms; latency p50 {1000 * m.latency[0]:.0f} ms, "
          f"p99 {1000 * m.latency[1]:.0f} ms; {same}/{len(ref)} token-identical to offline; "
          f"server CPU {m.cpu_percent:.0f}% ({1000 * cpu / len(ids):.1f} ms a request), the rest of the "
          f"machine {mon.mean():.0f}% (100% = one core)", flush=True)
    if per_process:
        print("  CPU s by process: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(spent.items(), key=lambda kv: -kv[1])
                                               if v >= 0.01), flush=True)
    return m


def print_summary(rows: list[Measured]) -> None:
    """Each server against the first (``encdec serve``), mode by mode, as a table:
    closed loop (saturation: every CPU-ms a server spends is taken from its
    engines) and open loop (the same offered load: the overhead shows as latency
    and CPU)."""
    base = {r.mode: r for r in rows if r.label == rows[0].label}

    def vs(a: float, b: float) -> str:
        return f" ({100 * (a / b - 1):+.0f}%)" if b and not own else ""

    print("\n| load | server | tok/s | TTFT p50 / p99 ms | latency p50 / p99 ms | server CPU | CPU ms a request |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        b = base.get(r.mode, r)
        own = b is r
        print(f"| {r.mode} | {r.label} | {r.tokens_per_s:.0f}{vs(r.tokens_per_s, b.tokens_per_s)} "
              f"| {1000 * r.ttft[0]:.0f} / {1000 * r.ttft[1]:.0f} "
              f"| {1000 * r.latency[0]:.0f}{vs(r.latency[0], b.latency[0])} / {1000 * r.latency[1]:.0f}"
              f"{vs(r.latency[1], b.latency[1])} | {r.cpu_percent:.0f}% "
              f"| {1000 * r.cpu_seconds / r.requests:.1f}{vs(r.cpu_seconds, b.cpu_seconds)} |", flush=True)


def _tree_cpu(proc) -> float:
    """User + system CPU seconds of ``proc`` and its live descendants."""
    return sum(cpu for _, cpu in _cpu_by_process(proc).values())


def _cpu_by_process(proc) -> dict[int, tuple[str, float]]:
    """pid -> (name, user + system CPU seconds) of ``proc`` and its live
    descendants; a Ray worker is named by its actor class (``ray::ProxyActor``:
    Ray retitles a worker with each call, so a run's share is taken by pid)."""
    import psutil

    seconds: dict[int, tuple[str, float]] = {}
    for p in [proc, *proc.children(recursive=True)]:
        try:
            cmd = p.cmdline()
            name = cmd[0].split(".")[0] if cmd and cmd[0].startswith("ray::") else p.name()
            seconds[p.pid] = (name, sum(p.cpu_times()[:2]))
        except psutil.Error:  # exited meanwhile
            pass
    return seconds
