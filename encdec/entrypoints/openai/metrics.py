"""``/metrics``: Prometheus metrics under vLLM's names, so vLLM dashboards work unchanged.

Every server owns its ``CollectorRegistry`` (no process-global state), and the
engine thread records into it after each step (``record_step``); prometheus
metrics are thread-safe. Engine requests are counted: a completion with a list
of prompts is one request per prompt, a transcription one per 30 s window.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from encdec.engine.async_llm_engine import StepStats

CONTENT_TYPE = CONTENT_TYPE_LATEST

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0, 10.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                50.0, 60.0, 120.0, 240.0, 480.0, 960.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry(auto_describe=True)
        labels, r = ["model_name"], self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.swapped = gauge("vllm:num_requests_swapped", "Requests swapped out to CPU.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage: 1 means all blocks in use.")
        self.preemptions = counter("vllm:num_preemptions", "Preemptions since start.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefilled prompt tokens (encoder + decoder).")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens.")
        success = Counter("vllm:request_success", "Finished requests by finish reason.",
                          ["model_name", "finished_reason"], registry=r)
        self.success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Arrival to first token.", _TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between a request's tokens.",
                             _ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to finish.", _E2E_BUCKETS)
        self.audio_seconds = counter("encdec:audio_seconds_transcribed",
                                     "Seconds of audio transcribed or translated.")
        # Counters the engine keeps as running totals (StepStats field -> counter): each
        # step adds what its total grew by since the last.
        self.totals = {name: counter(metric, text) for name, metric, text in (
            ("encoder_cache_queries", "encdec:encoder_cache_queries",
             "Requests that looked up a shared encoder pass."),
            ("encoder_cache_hits", "encdec:encoder_cache_hits",
             "Requests that reused an encoder pass (no encoder run)."),
            ("prefix_cache_queries", "vllm:prefix_cache_queries",
             "Decoder prompt tokens looked up in the prefix cache."),
            ("prefix_cache_hits", "vllm:prefix_cache_hits",
             "Decoder prompt tokens found in the prefix cache (prefill skipped)."),
            ("spec_decode_num_draft_tokens", "vllm:spec_decode_num_draft_tokens",
             "Draft tokens verified (speculative decoding)."),
            ("spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens",
             "Draft tokens verified and kept (speculative decoding)."),
            ("spec_decode_num_drafts", "vllm:spec_decode_num_drafts",
             "Rows verified with draft tokens (speculative decoding)."))}
        self._counted = dict.fromkeys(self.totals, 0)  # each total already counted
        self._num_preemptions = 0

    def record_step(self, stats: StepStats) -> None:
        """Engine thread, after each step."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.swapped.set(stats.num_swapped)
        self.kv_usage.set(stats.kv_cache_usage)
        if stats.num_preemptions > self._num_preemptions:
            self.preemptions.inc(stats.num_preemptions - self._num_preemptions)
            self._num_preemptions = stats.num_preemptions
        for name, total in self.totals.items():
            value = getattr(stats, name)
            total.inc(value - self._counted[name])
            self._counted[name] = value
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generation_tokens.inc(stats.generation_tokens)
        for v in stats.first_token_latencies:
            self.ttft.observe(v)
        for v in stats.inter_token_latencies:
            self.itl.observe(v)
        if stats.num_aborted:
            self.success["abort"].inc(stats.num_aborted)
        for out in stats.finished:
            reason = "error" if out.error else (out.outputs[0].finish_reason if out.outputs else None)
            self.success[reason if reason in self.success else "stop"].inc()
            if out.metrics is not None:
                self.e2e.observe(stats.now - out.metrics.arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)
