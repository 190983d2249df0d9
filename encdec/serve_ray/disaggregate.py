"""``--disaggregate encoders=E,decoders=D``: encoder passes on E encoder workers,
decoding on D engine replicas.

    Serve's proxy --> EngineReplica (DecoderEngine, the ingress)    x D
                              | process the request (tokens, log-mel) on its engine thread
                              | encoder cache holds the input's key?  yes: no transfer
                              | no: EncoderWorker.encode(ids, features) --> one of E workers
                              |     <-- encoder output, in the reply (Serve's gRPC call)
                              v
                            admit the request with its encoder output; decode as ever

An encoder worker sends the encoder output (encoder tokens x d_model), not the
cross K/V made of it (``2 x decoder layers x`` as many values): the decoder
engine projects it into its cross table at prefill (``encdec.worker.encoder_pass``).
Requests of one key in flight at once share one encoder call.

Faults: a call to an encoder worker that dies (or answers nothing within
``ENCODER_TIMEOUT`` seconds) is tried once more (Serve routes it to a live
worker, or to the one it starts in place of the dead one); a second failure
fails the request with a 503 naming the encoder worker (``EncoderWorkerLost``),
before the request reaches the engine, so the engine and its other requests go on.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

from encdec.engine.async_llm_engine import AsyncLLMEngine, AsyncRequest, EngineDeadError

ENCODER_TIMEOUT = 120.0  # seconds one encoder call may take, queueing and a restart included
# Requests an encoder worker encodes in one pass, at most: text, and audio (30 s windows).
# Why larger for text: a short prompt's pass is mostly fixed cost (random 4-layer BART,
# d_model 256, ~73 tokens, 2 threads, another process busy on a core: 8.1 ms a request
# alone, 6.4 in passes of 8, 3.3 of 32);
# a window is ~200 ms of tiny.en's encoder already, and the first in a pass waits for all.
ENCODER_BATCH, ENCODER_BATCH_AUDIO = 32, 8
# Seconds an encoder worker waits to fill a pass: none. A pass takes what queued while the
# last one ran (under load, full passes), and a lone request is not held back (a 2 ms wait
# was a quarter of the 8.8 ms a call spent outside the encoder, serve_bench at one client).
ENCODER_BATCH_WAIT = 0.0


class EncoderWorkerLost(EngineDeadError):
    """An encoder worker failed this request twice (the server answers 503)."""


@dataclasses.dataclass(frozen=True)
class Split:
    """``--disaggregate``'s counts, and what each encoder worker reserves when it
    differs from an engine replica (``--replica-cpus`` / ``--replica-gpus``)."""

    encoders: int  # encoder workers
    decoders: int  # decoder engine replicas
    encoder_cpus: float | None = None  # None: --replica-cpus
    encoder_gpus: float | None = None  # None: --replica-gpus


_SPEC = "'encoders=E,decoders=D' (counts >= 1; optional encoder_cpus=C, encoder_gpus=G)"


def parse_disaggregate(spec: str) -> Split:
    """``"encoders=E,decoders=D[,encoder_cpus=C][,encoder_gpus=G]"`` (any order) -> ``Split``."""
    fields: dict[str, float] = {}
    for part in str(spec).split(","):
        name, _, value = part.strip().partition("=")
        try:
            number = float(value)
        except ValueError:
            number = -1.0
        counts = name in ("encoders", "decoders")
        ok = (name in ("encoders", "decoders", "encoder_cpus", "encoder_gpus") and name not in fields
              and (number >= 1 and number == int(number) if counts else number >= 0))
        if not ok:
            raise ValueError(f"--disaggregate must be {_SPEC}, got {spec!r} (at {part.strip()!r})")
        fields[name] = int(number) if counts else number
    if not {"encoders", "decoders"} <= set(fields):
        raise ValueError(f"--disaggregate must be {_SPEC}, got {spec!r}")
    return Split(**fields)


@dataclasses.dataclass
class TransferStats:
    """What the decoder engine received from encoder workers, since it started."""

    requests: int = 0  # requests admitted with an encoder worker's output
    skipped: int = 0  # requests whose encoder output the encoder cache held (nothing moved)
    bytes: int = 0  # encoder output bytes received
    encode_seconds: float = 0.0  # the encoder workers' own time on those outputs
    round_trip_seconds: float = 0.0  # call to result; minus encode_seconds: queueing and transfer
    retries: int = 0  # calls tried again after an encoder worker failed


class DecoderEngine(AsyncLLMEngine):
    """An ``AsyncLLMEngine`` whose requests bring their encoder output from encoder
    workers (``encoders``, a Serve deployment handle, set before the first request)."""

    encoders: Any = None

    def __init__(self, engine: Any, **kwargs: Any):
        super().__init__(engine, **kwargs)
        self.transfers = TransferStats()
        self._pending: dict[str, asyncio.Future] = {}  # key -> its encoder output, being fetched

    async def add_requests(self, requests: list[AsyncRequest]) -> list[Any]:
        """Process every request on the engine thread (a bad one raises here, none
        queued) and, in the same pass, queue those whose encoder output the engine's
        encoder cache holds; fetch the others' from encoder workers, then queue them.
        One pass, not a call then an add: each waits for a step to end."""
        if self.encoders is None:
            return await super().add_requests(requests)
        iterators, deferred = await self._submit(requests)
        self.transfers.skipped += len(requests) - len(deferred)
        if not deferred:
            return iterators
        try:
            outputs = await asyncio.gather(*(self._encoder_output(inputs, key) for _, inputs, _, (key,) in deferred))
            await self._queue([dataclasses.replace(requests[i], processed=(inputs, params), encoder_output=out)
                               for (i, inputs, params, _), out in zip(deferred, outputs)])
        except BaseException:
            self._abort([r.request_id for r in requests])  # the queued ones too: all or none
            raise
        return iterators

    def _defer(self, engine: Any, inputs: dict) -> Any:
        """Requests whose encoder output the engine's cache lacks wait for an encoder worker's."""
        key = engine.encoder_key(inputs)
        return None if engine.holds_encoder_output(key) else (key,)

    async def _encoder_output(self, inputs: dict, key: str | None) -> Any:
        """One encoder call per key in flight; callers of the same key share it."""
        if key is not None and key in self._pending:
            return await asyncio.shield(self._pending[key])
        task = asyncio.ensure_future(self._call_encoder(inputs))
        if key is not None:
            self._pending[key] = task
            task.add_done_callback(lambda _: self._pending.pop(key, None))
        return await asyncio.shield(task)

    async def _call_encoder(self, inputs: dict) -> Any:
        item = (list(inputs["encoder_prompt_token_ids"]), inputs.get("encoder_features"))
        for attempt in (1, 2):
            start = time.perf_counter()
            try:
                output, encode_s = await asyncio.wait_for(self.encoders.encode.remote(item), ENCODER_TIMEOUT)
            except Exception as e:  # noqa: BLE001 - a lost worker is any of Ray's errors, or a timeout
                if attempt == 2:
                    raise EncoderWorkerLost(
                        f"the encoder worker serving this request failed ({type(e).__name__}), twice; "
                        "it is being replaced, retry the request") from e
                self.transfers.retries += 1
                continue
            t = self.transfers
            t.requests += 1
            t.bytes += output.numel() * output.element_size()
            t.encode_seconds += encode_s
            t.round_trip_seconds += time.perf_counter() - start
            return output
        raise AssertionError("unreachable")


class TransferCollector:
    """``TransferStats`` as Prometheus counters on the replica's ``/metrics``."""

    def __init__(self, stats: TransferStats, model_name: str):
        self.stats, self.model_name = stats, model_name

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        s = self.stats
        for name, doc, value in (
                ("encdec:encoder_transfer_requests", "Requests admitted with an encoder worker's output", s.requests),
                ("encdec:encoder_transfer_skipped", "Requests whose encoder output the encoder cache held",
                 s.skipped),
                ("encdec:encoder_transfer_bytes", "Encoder output bytes received from encoder workers", s.bytes),
                ("encdec:encoder_worker_encode_seconds", "Encoder workers' own time on those outputs",
                 s.encode_seconds),
                ("encdec:encoder_transfer_round_trip_seconds", "Encoder calls' time from call to result",
                 s.round_trip_seconds),
                ("encdec:encoder_transfer_retries", "Encoder calls tried again after a worker failed", s.retries)):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family


def encoder_worker_class() -> type:
    """The encoder worker's deployment class (``serve.batch`` needs Ray Serve, imported here)."""
    from ray import serve

    class EncoderWorker:
        """The checkpoint's encoder (``encdec.worker.encoder_pass``); concurrent calls
        are batched, up to ``ENCODER_BATCH`` requests a pass (``ENCODER_BATCH_AUDIO`` windows)."""

        def __init__(self, args: Any) -> None:
            from encdec.entrypoints.openai.api_server import check_server_flags
            from encdec.platform.cpu_runtime import configure_cpu_runtime
            from encdec.worker.encoder_pass import EncoderPass

            _, engine_args = check_server_flags(args)
            configure_cpu_runtime(engine_args.num_threads)
            self.encoder = EncoderPass(engine_args)
            audio = getattr(self.encoder.worker.model_config.hf_config, "num_mel_bins", None) is not None
            self.encode.set_max_batch_size(ENCODER_BATCH_AUDIO if audio else ENCODER_BATCH)

        @serve.batch(max_batch_size=ENCODER_BATCH, batch_wait_timeout_s=ENCODER_BATCH_WAIT)
        async def encode(self, items: list[tuple[list[int], Any]]) -> list[tuple[Any, float]]:
            """(encoder token ids, features or None) -> (encoder output, seconds its batch took)."""
            start = time.perf_counter()
            outs = await asyncio.to_thread(self.encoder, items)
            took = time.perf_counter() - start
            return [(o, took) for o in outs]

    return EncoderWorker
