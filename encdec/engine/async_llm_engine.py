"""``AsyncLLMEngine``: an ``LLMEngine`` driven by one background thread, fed from asyncio.

    event loop                      engine thread
    ----------                      -------------
    add_requests() --command-->     process_request (tokenize, audio features) + add
    abort()        --command-->     abort_request
    call_model(fn) --command-->     fn(model) between steps (word alignment), result back
    stream queue   <--outputs--     step(); finished + partial outputs, one callback per step

The thread owns the engine: nothing else touches it, so the engine needs no
locks and the event loop never waits for a step, a tokenization or a log-mel.
Outputs reach each request's ``asyncio.Queue`` through one
``loop.call_soon_threadsafe`` per step. ``RequestOutput``s are cumulative, so a
consumer that falls behind keeps only the newest (its deltas merge).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from encdec.engine.arg_utils import EngineArgs
from encdec.outputs import RequestOutput

logger = logging.getLogger("encdec")


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an unexpected error; no request can run."""


@dataclass
class AsyncRequest:
    """One request as the event loop submits it."""

    request_id: str
    prompt: Any  # a PromptType, as LLM.generate takes it
    params: Any  # SamplingParams
    priority: int = 0
    stream: bool = False  # deliver partial outputs after every step, not only the final one
    arrival_time: float = field(default_factory=time.time)  # seconds since the epoch
    processed: tuple | None = None  # (inputs, params) from process_request already: not processed again
    encoder_output: Any = None  # the encoder's output, computed elsewhere (LLMEngine.add_processed_request)


@dataclass
class StepStats:
    """What one engine step did, for ``/metrics`` (read on the engine thread)."""

    now: float  # seconds since the epoch, after the step
    num_running: int  # groups
    num_waiting: int
    num_swapped: int
    kv_cache_usage: float  # used device blocks / all device blocks, in [0, 1]
    num_preemptions: int  # since the engine was built
    prompt_tokens: int  # encoder + decoder prompt tokens prefilled in this step
    generation_tokens: int  # tokens sampled in this step
    first_token_latencies: list[float] = field(default_factory=list)  # seconds, requests that began
    inter_token_latencies: list[float] = field(default_factory=list)  # seconds, one per new token step
    finished: list[RequestOutput] = field(default_factory=list)
    num_aborted: int = 0  # unfinished requests aborted since the last stats
    encoder_cache_queries: int = 0  # since the engine was built
    encoder_cache_hits: int = 0  # since the engine was built
    prefix_cache_queries: int = 0  # decoder prompt tokens, since the engine was built
    prefix_cache_hits: int = 0  # of those, tokens found in the prefix cache
    spec_decode_num_draft_tokens: int = 0  # speculative decoding, since the engine was built
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_drafts: int = 0


class AsyncLLMEngine:
    def __init__(self, engine: Any, *, on_step: Callable[[StepStats], None] | None = None):
        self.engine = engine
        # fixed once the engine is built: readable from any thread
        self.tokenizer = engine.tokenizer
        self.hf_config, self.generation_config = engine.hf_config, engine.generation_config
        self.on_step = on_step  # called on the engine thread after every step
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue] = {}  # request id -> outputs (loop side)
        self._streamed: set[str] = set()  # engine side: requests that want partial outputs
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._num_aborted = 0  # engine thread: aborts not yet reported in StepStats
        self.error: BaseException | None = None  # why the engine thread died
        self._calls: set[concurrent.futures.Future] = set()  # call_model results not yet set

    @classmethod
    def from_engine_args(cls, args: EngineArgs, **kwargs: Any) -> AsyncLLMEngine:
        from encdec.engine.llm_engine import LLMEngine

        return cls(LLMEngine(args), **kwargs)

    # -- lifecycle ---------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the engine thread; outputs are delivered on ``loop``."""
        if self._thread is not None:
            raise RuntimeError("AsyncLLMEngine.start() was already called")
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="encdec-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop after the requests in flight finish (or ``timeout`` seconds)."""
        self._stopping = True
        self._commands.put(("wake", None, None))
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def scheduling_policy(self) -> str:
        """``"fcfs"`` or ``"priority"``: callers that rank their requests (the realtime
        sessions) need it, since fcfs refuses any ``priority`` but 0."""
        return self.engine.scheduler_config.policy

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # -- requests (event loop) ---------------------------------------------------
    async def add_requests(self, requests: list[AsyncRequest]) -> list[AsyncIterator[RequestOutput]]:
        """Validate and queue all requests, or none: the first bad one raises its
        ``ValueError``/``TypeError`` here, before anything is queued."""
        return (await self._submit(requests))[0]

    async def _submit(self, requests: list[AsyncRequest]) -> tuple[list[AsyncIterator[RequestOutput]], list[tuple]]:
        """``add_requests``, also returning what ``_defer`` held back on the engine
        thread: (index, inputs, params, its answer) per request registered (its
        iterator is returned) but not queued; the caller queues them (``_queue``)."""
        self._check_alive()
        queues = [asyncio.Queue() for _ in requests]
        for r in requests:
            if r.request_id in self._streams:
                raise ValueError(f"request id {r.request_id!r} is already in use")
        await self._compile_grammars(requests)
        # Registered before the engine sees them: outputs may come before the add is done.
        self._streams.update((r.request_id, q) for r, q in zip(requests, queues))
        try:
            deferred = await self._queue(requests)
        except BaseException:
            for r in requests:
                self._streams.pop(r.request_id, None)
            raise
        return [self._iterate(r.request_id, q) for r, q in zip(requests, queues)], deferred

    async def _queue(self, requests: list[AsyncRequest]) -> list[tuple]:
        """One "add" command for those of ``requests`` whose streams are registered (one
        aborted since is dropped); returns the deferred (``_submit``)."""
        requests = [r for r in requests if r.request_id in self._streams]
        if not requests:
            return []
        done = asyncio.get_running_loop().create_future()
        self._commands.put(("add", requests, done))
        try:
            return await done
        except BaseException:
            if not done.done():  # cancelled while the engine thread adds: abort what it adds
                self._commands.put(("abort", [r.request_id for r in requests], None))
            raise

    def _defer(self, engine: Any, inputs: dict) -> Any:
        """Engine thread, once all of a submission's requests are processed: a truthy
        answer holds a request back from the queue (``_submit`` returns it). None here."""
        return None

    async def _compile_grammars(self, requests: list[AsyncRequest]) -> None:
        """Structured outputs' new grammars compile here, off the engine thread
        (the compiler is thread-safe and caches them), so no step waits on one;
        the engine thread's processor then finds them cached. A constraint the
        compiler refuses raises its ``ValueError`` here, before anything is queued."""
        manager = self.engine.processor.structured_outputs
        for so in {id(c): c for r in requests if (c := getattr(r.params, "structured_outputs", None))}.values():
            await asyncio.to_thread(manager.compile, so)

    async def generate(self, prompt: Any, params: Any, request_id: str, *, priority: int = 0,
                       stream: bool = True) -> AsyncIterator[RequestOutput]:
        """vLLM's shape: one request, its outputs as they come."""
        (it,) = await self.add_requests([AsyncRequest(request_id, prompt, params, priority, stream)])
        async for out in it:
            yield out

    def call_model(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(model)`` run on the engine thread between steps; blocks the calling
        thread (never the event loop's) until it returns, and returns its result
        or raises its error. Work that needs the model (a transcription job's word
        alignment) goes through here, so only the engine thread touches the model."""
        self._check_alive()
        if self._loop is not None and self._loop.is_running() and _on_loop(self._loop):
            raise RuntimeError("call_model blocks: call it off the event loop (asyncio.to_thread)")
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.add(done)
        self._commands.put(("call", fn, done))
        try:
            return done.result()
        finally:
            self._calls.discard(done)

    async def abort(self, request_id: str | list[str]) -> None:
        """Abort requests (finished or unknown ids are ignored); frees their blocks."""
        self._abort([request_id] if isinstance(request_id, str) else list(request_id))

    def _abort(self, request_ids: list[str]) -> None:
        live = [rid for rid in request_ids if self._streams.pop(rid, None) is not None]
        if live:
            self._commands.put(("abort", live, None))

    async def _iterate(self, request_id: str, q: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                item = await q.get()
                while not q.empty():  # outputs are cumulative: a late reader keeps the newest
                    item = q.get_nowait()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:  # the consumer left (client gone, cancelled): free the request
                self._abort([request_id])

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped: {self.error!r}")
        if self._thread is None or self._stopping:
            raise EngineDeadError("the engine is not running (not started, or shutting down)")

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Loop side: hand each output to its request's queue."""
        for out in outputs:
            q = self._streams.get(out.request_id)
            if q is None:
                continue  # aborted meanwhile
            if out.finished:
                del self._streams[out.request_id]
            q.put_nowait(out)

    def _fail_all(self, error: BaseException) -> None:
        for call in list(self._calls):
            if not call.done():
                call.set_exception(EngineDeadError(f"the engine stopped: {error!r}"))
        streams, self._streams = self._streams, {}
        for q in streams.values():
            q.put_nowait(EngineDeadError(f"the engine stopped: {error!r}"))

    # -- engine thread -------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        last_tokens: dict[str, tuple[int, float]] = {}  # request -> (output tokens, when)
        try:
            while True:
                idle = not engine.has_unfinished_requests()
                if idle and self._stopping:
                    return
                self._take_commands(block=idle)
                if not engine.has_unfinished_requests():
                    if self._num_aborted and self.on_step is not None:  # gauges drop to 0 now
                        self.on_step(self._stats(engine, [], engine.num_prompt_tokens,
                                                 engine.num_generated_tokens, last_tokens))
                    continue
                prompt0, gen0 = engine.num_prompt_tokens, engine.num_generated_tokens
                finished = engine.step()
                for out in finished:
                    self._streamed.discard(out.request_id)
                outputs = finished + list(engine.get_partial_outputs(self._streamed).values())
                if outputs:
                    self._loop.call_soon_threadsafe(self._deliver, outputs)
                if self.on_step is not None:
                    self.on_step(self._stats(engine, finished, prompt0, gen0, last_tokens))
        except BaseException as e:  # noqa: BLE001 - the thread must report whatever killed it
            logger.exception("engine thread died")
            self.error = e
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._fail_all, e)

    def _take_commands(self, *, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(*cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, kind: str, payload: Any, done: asyncio.Future | None) -> None:
        engine = self.engine
        if kind == "call":
            try:
                done.set_result(payload(engine.model))
            except Exception as e:  # noqa: BLE001 - the caller's error, raised in the caller's thread
                done.set_exception(e)
            return
        if kind == "abort":
            self._num_aborted += len(engine.abort_request(payload))
            self._streamed.difference_update(payload)
            return
        if kind != "add":
            return
        try:
            processed = [r.processed or engine.process_request(r.prompt, r.params) for r in payload]
        except Exception as e:  # noqa: BLE001 - a bad request is its caller's error, not the engine's
            self._loop.call_soon_threadsafe(_settle, done, e)
            return
        added, deferred = [], []
        try:
            for i, (r, (inputs, params)) in enumerate(zip(payload, processed)):
                if r.processed is None and (why := self._defer(engine, inputs)):
                    deferred.append((i, inputs, params, why))
                    continue
                engine.add_processed_request(r.request_id, inputs, params, arrival_time=r.arrival_time,
                                             priority=r.priority, encoder_output=r.encoder_output)
                added.append(r)
        except (ValueError, TypeError) as e:  # e.g. a priority the scheduling policy refuses
            engine.abort_request([r.request_id for r in added])
            self._loop.call_soon_threadsafe(_settle, done, e)
            return
        self._streamed.update(r.request_id for r in added if r.stream)
        self._loop.call_soon_threadsafe(_settle, done, None, deferred)

    def _stats(self, engine: Any, finished: list[RequestOutput], prompt0: int, gen0: int,
               last_tokens: dict[str, tuple[int, float]]) -> StepStats:
        now = time.time()
        es = engine.get_stats()
        stats = StepStats(now, es.num_running, es.num_waiting, es.num_swapped, es.kv_cache_usage,
                          es.num_preemptions,
                          engine.num_prompt_tokens - prompt0, engine.num_generated_tokens - gen0,
                          finished=finished, num_aborted=self._num_aborted,
                          encoder_cache_queries=es.encoder_cache_queries,
                          encoder_cache_hits=es.encoder_cache_hits,
                          prefix_cache_queries=es.prefix_cache_queries, prefix_cache_hits=es.prefix_cache_hits,
                          spec_decode_num_draft_tokens=es.spec_decode_num_draft_tokens,
                          spec_decode_num_accepted_tokens=es.spec_decode_num_accepted_tokens,
                          spec_decode_num_drafts=es.spec_decode_num_drafts)
        self._num_aborted = 0
        progress = engine.get_request_progress()
        counts = {rid: n for rid, (n, _) in progress.items()}
        for out in finished:
            counts[out.request_id] = sum(len(c.token_ids) for c in out.outputs)
        for rid, n in counts.items():
            before, when = last_tokens.get(rid, (0, 0.0))
            if n > before:
                if before == 0:
                    arrival = progress[rid][1] if rid in progress else None
                    arrival = arrival if arrival is not None else _arrival(finished, rid)
                    stats.first_token_latencies.append(now - arrival)
                else:
                    stats.inter_token_latencies.append(now - when)
                last_tokens[rid] = (n, now)
        for rid in [r for r in last_tokens if r not in counts]:
            del last_tokens[rid]
        for out in finished:
            last_tokens.pop(out.request_id, None)
        return stats


async def final_output(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    """The last (finished) output of a request's stream."""
    out = None
    async for out in stream:
        pass
    return out


def _arrival(finished: list[RequestOutput], request_id: str) -> float:
    out = next(o for o in finished if o.request_id == request_id)
    return out.metrics.arrival_time


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def _settle(done: asyncio.Future, error: BaseException | None, result: Any = None) -> None:
    if done.done():
        return
    if error is None:
        done.set_result(result)
    else:
        done.set_exception(error)
