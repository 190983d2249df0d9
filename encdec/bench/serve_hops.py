"""Where ``encdec serve --ray``'s time goes, hop by hop, for one client.

Two requests, one at a time: an echo (``GET /v1/models``: no engine work, so
its time is the path's own cost per request) and a streamed completion
(token-id prompt, greedy, ``--max-tokens`` tokens with ``ignore_eos``), through:

    app       encdec serve's app called in this process (``run_asgi``): no HTTP, no Ray
    http      one ``encdec serve`` process over HTTP on 127.0.0.1
    ray http  the Ray path: Serve's HTTP proxy -> the engine replica (the ingress)
    haproxy   the Ray path behind Serve's HAProxy ingress: HAProxy -> the replica's own
              HTTP server (with ``--ingress serve haproxy``, each in the same run)

A hop's cost is the difference of medians.

    python -m benchmarks.serve_hops [--requests 30] [--max-tokens 32] [--disaggregate encoders=1,decoders=1]
                                    [--ingress serve haproxy]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import tempfile
import time

SCOPE = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
         "path": "/v1/completions", "raw_path": b"/v1/completions", "root_path": "", "query_string": b"",
         "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80), "extensions": {}}


def _body(prompt: list[int], max_tokens: int) -> bytes:
    return json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                       "stream": True, "logprobs": 0, "return_tokens_as_token_ids": True}).encode()


def _scope(body: bytes) -> dict:
    return dict(SCOPE, headers=[(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())])


def _server_args(model_dir: str, extra: list[str]) -> argparse.Namespace:
    from encdec.entrypoints.openai.cli_args import add_server_args

    p = argparse.ArgumentParser()
    add_server_args(p)
    return p.parse_args([model_dir, "--num-threads", "1", "--kv-cache-memory", str(256 << 20),
                         "--swap-space", "0.1", *extra])


async def _time_app(model_dir: str, bodies: list[bytes]) -> tuple[list[float], list[int]]:
    """(seconds, message lists) per request through the app in this process."""
    from encdec.entrypoints.openai.api_server import app_from_args
    from encdec.entrypoints.openai.asgi_relay import body_receive, run_asgi

    app = app_from_args(_server_args(model_dir, []))
    async with app.router.lifespan_context(app):
        out = [await _one_relay(lambda b: run_asgi(app, _scope(b), body_receive(b), "local"), b) for b in bodies]
    return [t for t, _ in out], [n for _, n in out]


async def _one_relay(call, body: bytes) -> tuple[float, int]:
    t0, lists = time.perf_counter(), 0
    async for _ in call(body):
        lists += 1
    return time.perf_counter() - t0, lists


def _time_http(port: int, bodies: list[bytes]) -> tuple[list[float], list[float]]:
    """(echo seconds, stream seconds) per request."""
    from encdec.bench.serve_bench import stream_one

    async def echo() -> float:
        t0 = time.perf_counter()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: hops\r\nConnection: close\r\n\r\n")
        await writer.drain()
        if b" 200 " not in await reader.readline():
            raise RuntimeError("GET /v1/models failed")
        await reader.read()
        writer.close()
        return time.perf_counter() - t0

    async def run() -> tuple[list[float], list[float]]:
        echoes = [await echo() for _ in bodies]
        return echoes, [(await stream_one(port, json.loads(b)))[2] for b in bodies]

    return asyncio.run(run())


def _time_ray(model_dir: str, bodies: list[bytes], disaggregate: str | None,
              ingress: str = "serve") -> tuple[list, list]:
    """(echo seconds, stream seconds) through ``ingress`` on a local 2-CPU cluster."""
    import ray
    from ray import serve

    from encdec.serve_ray import APP_NAME, build, start_serve

    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False, configure_logging=False,
             _temp_dir=tempfile.mkdtemp(prefix="encdec-hops-"))
    port = _free_port()
    try:
        start_serve("127.0.0.1", port, ingress)
        config = {"model": model_dir, "num_threads": 1, "kv_cache_memory": 256 << 20, "swap_space": 0.1}
        config.update({"disaggregate": disaggregate, "replica_cpus": 0.5} if disaggregate else {"replicas": 1})
        serve.run(build(config), name=APP_NAME, route_prefix="/")
        _wait_ok(port)
        return _time_http(port, bodies)
    finally:
        serve.shutdown()
        ray.shutdown()


def _wait_ok(port: int, seconds: float = 120) -> None:
    """Until ``GET /v1/models`` answers 200 (HAProxy learns of a replica up to a second
    after Serve reports the app running)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
                c.sendall(b"GET /v1/models HTTP/1.1\r\nHost: hops\r\nConnection: close\r\n\r\n")
                if b" 200 " in c.recv(100):
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the Ray path did not answer GET /v1/models in {seconds} s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> None:
    import random

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--model-dir", default=None, help="default: serve_bench's random BART")
    ap.add_argument("--disaggregate", default=None, metavar="encoders=E,decoders=D")
    ap.add_argument("--ingress", nargs="+", choices=["serve", "haproxy"], default=["serve"],
                    help="the Ray path's front door(s), each measured in turn")
    args = ap.parse_args(argv)
    from encdec.bench.serve_bench import ensure_model, start_server

    model_dir = args.model_dir or ensure_model()
    rng = random.Random(0)
    bodies = [_body([rng.randrange(4, 1000) for _ in range(rng.randint(16, 128))], args.max_tokens)
              for _ in range(args.requests + 2)]
    app_s, app_lists = asyncio.run(_time_app(model_dir, bodies))
    proc, port = start_server(model_dir, ["--num-threads", "1", "--kv-cache-memory", str(256 << 20)])
    try:
        http_echo, http_s = _time_http(port, bodies)
    finally:
        proc.terminate()
        proc.wait(60)
    med = lambda xs: 1000 * statistics.median(xs[2:])  # noqa: E731 - the first two warm up
    split = f" ({args.disaggregate})" if args.disaggregate else ""
    for ingress in args.ingress:
        ray_echo, ray_s = _time_ray(model_dir, bodies, args.disaggregate, ingress)
        name = "ray http" if ingress == "serve" else ingress
        print(f"{args.requests} requests one at a time, medians (ms): echo: http {med(http_echo):.2f}, "
              f"{name} {med(ray_echo):.2f}; stream of {args.max_tokens} tokens: app {med(app_s):.1f} "
              f"({statistics.median(app_lists[2:]):.0f} message lists), http {med(http_s):.1f}, "
              f"{name} {med(ray_s):.1f}{split}")
        print(f"per request: HTTP server {med(http_s) - med(app_s):+.1f}; the Ray path's own cost (echo, "
              f"{name}) {med(ray_echo) - med(http_echo):+.2f}; stream through Ray vs encdec serve "
              f"{med(ray_s) - med(http_s):+.1f} ({100 * (med(ray_s) / med(http_s) - 1):+.0f}%); "
              f"host load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
