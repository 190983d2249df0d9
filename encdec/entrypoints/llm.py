"""The offline API: ``LLM(model).generate(prompts, params)``."""
from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from encdec.engine.arg_utils import EngineArgs
from encdec.engine.llm_engine import LLMEngine
from encdec.inputs import PromptType, normalize_prompts
from encdec.outputs import RequestOutput
from encdec.sampling_params import SamplingParams


class LLM:
    """One engine behind a lock: ``generate`` and ``transcribe`` may be called
    from several threads; calls run one at a time, each with correct results.

    ``num_threads`` sets torch's threads for the whole process, as
    ``encdec.configure_cpu_runtime(num_threads=...)`` does (kept for the CLI);
    without it the process's settings are left alone. For full CPU speed call
    ``encdec.configure_cpu_runtime()`` once before building an ``LLM``.
    """

    def __init__(self, model: str | os.PathLike, *, tokenizer: str | None = None, dtype: str = "auto",
                 device: str = "auto", seed: int = 0, block_size: int = 16,
                 kv_cache_memory: int | None = None, gpu_memory_utilization: float = 0.9,
                 swap_space: float = 4, max_num_seqs: int = 256,
                 max_num_batched_tokens: int | None = None, max_model_len: int | None = None,
                 preemption_mode: str | None = None, logits_processors: list[Any] | None = None,
                 attention_backend: str | None = None, enforce_eager: bool = False,
                 scheduling_policy: str = "fcfs", num_threads: int | None = None):
        self.engine_args = EngineArgs(
            model=model, tokenizer=tokenizer, dtype=dtype, device=device, seed=seed,
            block_size=block_size, kv_cache_memory=kv_cache_memory,
            gpu_memory_utilization=gpu_memory_utilization, swap_space=swap_space,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, preemption_mode=preemption_mode,
            logits_processors=logits_processors, attention_backend=attention_backend,
            enforce_eager=enforce_eager, scheduling_policy=scheduling_policy,
            num_threads=num_threads)
        if num_threads is not None:
            from encdec.worker.cpu_runtime import configure_cpu_runtime

            configure_cpu_runtime(num_threads, retain_freed_memory=False)
        self.llm_engine = LLMEngine(self.engine_args)
        self._lock = threading.RLock()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    @contextlib.contextmanager
    def engine_lock(self) -> Iterator[LLMEngine]:
        """Hold the engine for a block of calls: code that drives ``llm_engine``
        itself (``add_request``/``step``) runs under the lock ``generate`` and
        ``transcribe`` take, so concurrent calls never share its steps. Reentrant."""
        with self._lock:
            yield self.llm_engine

    @property
    def _request_counter(self) -> int:
        """Deprecated (encdec.transcribe reads it until it uses its own driver):
        the number the engine's next request id will have."""
        return self.llm_engine._num_request_ids

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool = True, priority: list[int] | None = None) -> list[RequestOutput]:
        prompts = normalize_prompts(prompts)
        n = len(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * n
        else:
            params_list = list(sampling_params)
            if len(params_list) != n:
                raise ValueError(f"got {len(params_list)} sampling_params for {n} prompts")
        if priority is not None and len(priority) != n:
            raise ValueError(f"got {len(priority)} priorities for {n} prompts")
        with self._lock:
            bar = None
            if use_tqdm:
                from tqdm.auto import tqdm

                bar = tqdm(total=n, desc="Processed prompts", dynamic_ncols=True)
            engine = self.llm_engine
            start = time.perf_counter()
            in0, out0 = engine.num_prompt_tokens, engine.num_generated_tokens

            def progress(_: RequestOutput) -> None:
                dt = max(time.perf_counter() - start, 1e-6)
                bar.set_postfix_str(f"input: {(engine.num_prompt_tokens - in0) / dt:.1f} toks/s, "
                                    f"output: {(engine.num_generated_tokens - out0) / dt:.1f} toks/s")
                bar.update(1)

            try:
                return self._run(prompts, params_list, priority, progress if bar else None)
            finally:
                if bar is not None:
                    bar.close()

    def _process_all(self, prompts: list[PromptType],
                     params_list: list[SamplingParams | None]) -> list[tuple[dict, SamplingParams]]:
        """Validate the whole call before anything is queued: one bad prompt
        refuses it. (Becomes ``engine.process_requests(prompts, params_list)``.)"""
        engine = self.llm_engine
        return [engine.process_request(p, sp) for p, sp in zip(prompts, params_list)]

    def _run(self, prompts: list[PromptType], params_list: list[SamplingParams | None],
             priority: list[int] | None,
             on_finished: Callable[[RequestOutput], None] | None) -> list[RequestOutput]:
        """Queue the prompts and step the engine until they finish; ``on_finished``
        sees each output as it completes (progress bars). Call under the lock."""
        engine = self.llm_engine
        processed = self._process_all(prompts, params_list)
        ids = []
        for i, (inputs, params) in enumerate(processed):
            rid = engine.new_request_id()
            engine.add_processed_request(rid, inputs, params, priority=priority[i] if priority else 0)
            ids.append(rid)
        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        try:
            while len(done) < len(wanted) and engine.has_unfinished_requests():
                for out in engine.step():
                    if out.request_id in wanted:
                        done[out.request_id] = out
                        if on_finished is not None:
                            on_finished(out)
        except BaseException:
            # Leave the engine clean for the next call: drop what this call queued.
            engine.abort_request([i for i in ids if i not in done])
            raise
        return [done[i] for i in ids]

    def _generate(self, prompts: list[PromptType], params_list: list[SamplingParams | None],
                  priority: list[int] | None,
                  on_finished: Callable[[RequestOutput], None] | None) -> list[RequestOutput]:
        """Deprecated (encdec.transcribe calls it until it uses its own driver)."""
        with self._lock:
            return self._run(prompts, params_list, priority, on_finished)

    def transcribe(self, audio, *, language: str | None = None, task: str = "transcribe",
                   timestamps: bool = False, prompt: str | None = None,
                   sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
                   word_timestamps: bool = False, vad_filter: bool = False, vad_parameters: dict | None = None):
        from encdec.transcribe import transcribe

        with self._lock:  # the whole job: its requests never share steps with another call's
            return transcribe(self, audio, language=language, task=task, timestamps=timestamps,
                              prompt=prompt, sampling_params=sampling_params, use_tqdm=use_tqdm,
                              word_timestamps=word_timestamps, vad_filter=vad_filter,
                              vad_parameters=vad_parameters)
