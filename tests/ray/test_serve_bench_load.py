"""serve_bench's open loop (``--load``/``--rate``), which the Ray path's overhead
"at the same load" is measured with: the arrival schedule is a seeded Poisson
process that every server is offered identically, and requests go out on
schedule whatever is still in flight (a closed loop would wait for answers).
No Ray: a few-line loopback HTTP server stands in for ``encdec serve``."""
from __future__ import annotations

import asyncio
import json
import statistics
import time

import pytest

from encdec.bench.serve_bench import poisson_arrivals, run_open_loop


def test_poisson_arrivals_are_seeded_and_at_the_rate():
    a = poisson_arrivals(20000, 50.0, seed=3)
    assert a == poisson_arrivals(20000, 50.0, seed=3)  # every server gets this very schedule
    assert a != poisson_arrivals(20000, 50.0, seed=4)
    gaps = [y - x for x, y in zip([0.0, *a], a)]
    assert all(g > 0 for g in gaps)
    assert statistics.mean(gaps) == pytest.approx(1 / 50, rel=0.03)
    # exponential gaps: the standard deviation equals the mean (a fixed-interval schedule would give 0)
    assert statistics.pstdev(gaps) == pytest.approx(1 / 50, rel=0.05)


@pytest.mark.parametrize("n, rate", [(0, 1.0), (5, 0.0), (5, -2.0), (5, float("nan"))])
def test_poisson_arrivals_refuses_bad_arguments(n, rate):
    with pytest.raises(ValueError, match="n must|rate must"):
        poisson_arrivals(n, rate, seed=0)


async def _server(n: int, seen: list[tuple[float, int]]):
    """A streaming completion server that answers no request before all ``n``
    have arrived; each answer streams the request's ``max_tokens`` as its ids."""
    all_in = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readline()
        length = 0
        while (line := await reader.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        body = json.loads(await reader.readexactly(length))
        seen.append((time.perf_counter(), body["max_tokens"]))
        if len(seen) == n:
            all_in.set()
        await all_in.wait()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for data in (json.dumps({"choices": [{"logprobs": {"tokens": [f"token_id:{body['max_tokens']}"]}}]}),
                     "[DONE]"):
            event = f"data: {data}\n\n".encode()
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def test_open_loop_sends_on_schedule_without_waiting_for_answers():
    n = 12
    arrivals = poisson_arrivals(n, 200.0, seed=1)
    enc, out_lens = [[5, 6, 7]] * n, list(range(1, n + 1))
    seen: list[tuple[float, int]] = []

    async def main():
        server = await _server(n, seen)
        port = server.sockets[0].getsockname()[1]
        async with server:
            t0 = time.perf_counter()
            result = await asyncio.wait_for(run_open_loop(port, enc, out_lens, arrivals), 60)
        return t0, result

    t0, (ids, times, seconds) = asyncio.run(main())
    # every request was answered only once all had arrived: none waited for an earlier answer
    assert ids == [[k] for k in out_lens]
    assert sorted(k for _, k in seen) == out_lens
    for at, k in seen:  # none went out before its scheduled time (t0 is taken just before the start)
        assert at - t0 >= arrivals[k - 1] - 1e-3
    # latency counts from the scheduled time: the first request waited for the last to arrive
    assert times[0][1] >= arrivals[-1] - arrivals[0] - 1e-3
    assert all(0 <= ttft <= total for ttft, total in times) and seconds >= arrivals[-1]


@pytest.mark.parametrize("argv", [["--load", "0.5", "0"], ["--rate", "-3"], ["--load", "nan"]])
def test_bad_open_loop_flags_fail_before_any_server_starts(argv, capsys):
    from encdec.bench.serve_bench import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert "values must be > 0" in capsys.readouterr().err
