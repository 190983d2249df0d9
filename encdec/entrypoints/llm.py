"""The offline API: ``LLM(model).generate(prompts, params)``."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from encdec.beam_search.params import BeamSearchOutput, BeamSearchSequence
from encdec.engine.arg_utils import EngineArgs
from encdec.engine.llm_engine import LLMEngine
from encdec.inputs import PromptType, normalize_prompts, prompt_errors
from encdec.outputs import RequestOutput
from encdec.param_checks import check_priority
from encdec.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from encdec.transcription.options import TranscribeOptions


def _with_truncation(params_list: list) -> list:
    """``generate(..., truncation=True)``: each params that sets no
    ``truncate_prompt_tokens`` gets -1 (the model's encoder positions) cut on
    the "right" (HF's tokenizer default); a params shared by several prompts
    stays shared (one copy)."""
    copies: dict[int, Any] = {}
    for p in params_list:
        if id(p) not in copies:
            if p is None:  # the processor's default params
                copies[id(p)] = SamplingParams(truncate_prompt_tokens=-1, truncation_side="right")
            elif isinstance(p, (SamplingParams, BeamSearchParams)) and p.truncate_prompt_tokens is None:
                copies[id(p)] = dataclasses.replace(p, truncate_prompt_tokens=-1, truncation_side="right")
            else:  # its own truncation, or a wrong type the processor refuses
                copies[id(p)] = p
    return [copies[id(p)] for p in params_list]


class LLM:
    """One engine behind a lock: ``generate`` and ``transcribe`` may be called
    from several threads; calls run one at a time, each with correct results.

    ``num_threads`` sets torch's threads for the whole process, as
    ``encdec.configure_cpu_runtime(num_threads=...)`` does (kept for the CLI);
    without it the process's settings are left alone. For full CPU speed call
    ``encdec.configure_cpu_runtime()`` once before building an ``LLM``.
    """

    def __init__(self, model: str | os.PathLike, **options: Any):
        """``options``: the fields of ``EngineArgs`` (documented there), e.g.
        ``LLM(model, dtype="float32", kv_cache_memory=512 << 20)``; an unknown one
        is a TypeError naming it."""
        self.engine_args = EngineArgs(model, **options)
        num_threads = self.engine_args.num_threads
        if num_threads is not None:
            from encdec.platform.cpu_runtime import configure_cpu_runtime

            configure_cpu_runtime(num_threads, retain_freed_memory=False)
        self.llm_engine = LLMEngine(self.engine_args)
        if self.llm_engine.worker.device.type == "cpu":
            from encdec.platform.cpu_runtime import warn_if_openmp_spins

            warn_if_openmp_spins()
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

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | BeamSearchParams
                 | Sequence[SamplingParams | BeamSearchParams] | None = None,
                 *, use_tqdm: bool = True, priority: list[int] | None = None,
                 truncation: bool = False) -> list[RequestOutput]:
        """``sampling_params=None``: the checkpoint's defaults (``get_default_sampling_params``).
        With ``BeamSearchParams`` each output's ``outputs`` are its
        ``num_return_sequences`` best hypotheses, best first. An encoder prompt
        longer than the model's positions is a ValueError unless its params set
        ``truncate_prompt_tokens``; ``truncation=True`` sets it where they do not,
        cutting as HF's ``tokenizer(truncation=True)`` (the first tokens, the final
        eos kept). ``priority``: one per prompt, under ``scheduling_policy="priority"``."""
        prompts = normalize_prompts(prompts)
        n = len(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, (SamplingParams, BeamSearchParams)):
            params_list = [sampling_params] * n
        else:
            params_list = list(sampling_params)
            if len(params_list) != n:
                raise ValueError(f"got {len(params_list)} sampling_params for {n} prompts")
        if priority is not None:
            priority = self._checked_priorities(priority, n)
        if not isinstance(truncation, bool):
            raise TypeError(f"truncation must be a bool, got {type(truncation).__name__} {truncation!r}")
        if truncation:
            params_list = _with_truncation(params_list)
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

    def _checked_priorities(self, priority: Sequence[int], n: int) -> list[int]:
        """One priority per prompt, each checked now, so a bad one refuses the
        whole call before anything is queued ("prompt 1: ...")."""
        if isinstance(priority, (str, bytes, dict)) or not hasattr(priority, "__len__"):
            raise TypeError(f"priority must be a list of ints, one per prompt, got {type(priority).__name__}")
        if len(priority) != n:
            raise ValueError(f"got {len(priority)} priorities for {n} prompts")
        policy = self.llm_engine.scheduler_config.policy
        checked = []
        for i, p in enumerate(priority):
            with prompt_errors(i):
                checked.append(check_priority(p, policy))
        return checked

    def _run(self, prompts: list[PromptType], params_list: list[SamplingParams | None],
             priority: list[int] | None,
             on_finished: Callable[[RequestOutput], None] | None) -> list[RequestOutput]:
        """Queue the prompts and step the engine until they finish; ``on_finished``
        sees each output as it completes (progress bars). Call under the lock."""
        engine = self.llm_engine
        # One bad prompt refuses the whole call before anything is queued.
        processed = engine.process_requests(prompts, params_list)
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

    # -- beam search (issue 11) -----------------------------------------------------
    def get_default_sampling_params(self) -> SamplingParams | BeamSearchParams:
        """The checkpoint's generation defaults, as HF's ``generate`` applies them:
        ``BeamSearchParams`` when they ask for beams, else ``SamplingParams``."""
        from encdec.beam_search.defaults import default_params
        from encdec.models.registry import get_model_hooks

        engine = self.llm_engine
        hooks = get_model_hooks(engine.model_config.architecture)
        prompt = hooks.default_decoder_prompt(engine.hf_config, engine.generation_config, engine.tokenizer)
        return default_params(engine.generation_config, len(prompt))

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    *, use_tqdm: bool = False, truncation: bool = False) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search``: every hypothesis of the final pool, best first,
        with ``tokens`` = decoder prompt + generated ids and HF's ``score``.
        ``truncation`` as ``generate``'s."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be BeamSearchParams, got {type(params).__name__}")
        params = dataclasses.replace(params, num_return_sequences=params.beam_width)
        outs = self.generate(prompts, params, use_tqdm=use_tqdm, truncation=truncation)
        return [BeamSearchOutput([
            BeamSearchSequence(tokens=list(out.prompt_token_ids) + c.token_ids, text=c.text,
                               cum_logprob=c.cumulative_logprob, score=c.score,
                               finish_reason=c.finish_reason, stop_reason=c.stop_reason)
            for c in out.outputs]) for out in outs]

    # -- translation (issue 31) ----------------------------------------------------
    def translate(self, texts: str | Sequence[str],
                  sampling_params: SamplingParams | BeamSearchParams
                  | Sequence[SamplingParams | BeamSearchParams] | None = None, *,
                  src_lang: str | None = None, tgt_lang: str | None = None,
                  use_tqdm: bool = True, truncation: bool = False) -> list[RequestOutput]:
        """``generate`` with the control-token prompts of this checkpoint's family
        (``encdec.translation``): NLLB/M2M100 and mBART-50 ``<src> text </s>`` with
        the decoder prompt ``[</s>, <tgt>]`` and the target forced as HF's
        ``forced_bos_token_id`` (beam scores as HF's), mBART cc25's trailing codes,
        Marian's ``>>tgt<<``, T5's ``translate X to Y:`` prefix. ``sampling_params=None``:
        the checkpoint's defaults. ``truncation`` as ``generate``'s (an input longer
        than the model's positions keeps its first tokens and its closing </s>). A
        family without languages, a language code the tokenizer does not know, or
        ``texts`` other than a str or list of str is a ValueError/TypeError."""
        from encdec.translation import translation_prompts, with_forced_bos

        engine = self.llm_engine
        plan = translation_prompts(texts, hf_config=engine.hf_config, tokenizer=engine.tokenizer,
                                   src_lang=src_lang, tgt_lang=tgt_lang)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, (SamplingParams, BeamSearchParams)):
            params = with_forced_bos(sampling_params, plan.forced_bos_token_id)
        elif isinstance(sampling_params, (list, tuple)):
            params = [with_forced_bos(p, plan.forced_bos_token_id) for p in sampling_params]
        else:
            raise TypeError("sampling_params must be SamplingParams, BeamSearchParams or a list of them, got "
                            f"{type(sampling_params).__name__}")
        return self.generate(plan.prompts, params, use_tqdm=use_tqdm, truncation=truncation)

    def transcribe(self, audio, options: TranscribeOptions | None = None, *, use_tqdm: bool = True,
                   **option_kwargs: Any):
        """Speech to text, one ``Transcription`` per input of ``audio`` (one input or a
        list): faster-whisper's options, as a ``TranscribeOptions`` or as its fields
        by keyword (``prompt`` is the older name of ``initial_prompt``)."""
        from encdec.transcription.offline import transcribe

        with self._lock:  # the whole job: its requests never share steps with another call's
            return transcribe(self, audio, options, use_tqdm=use_tqdm, **option_kwargs)

    def transcribe_stream(self, chunks, options: TranscribeOptions | None = None, *, sample_rate: int = 16000,
                          partial_every: float = 1.0, **option_kwargs: Any):
        """Live transcription offline: a generator of ``StreamSegment``s (partial text
        two passes agree on, then each turn's final text) over an iterator of audio
        chunks (1-D float arrays or PCM16 bytes at ``sample_rate``, 16 or 24 kHz; a
        ``None`` chunk ends a turn). Options as ``transcribe``'s, checked here, before
        the first chunk is read (``encdec.transcription.stream``)."""
        from encdec.transcription.offline import resolve_options
        from encdec.transcription.live import LiveSession
        from encdec.transcription.stream import transcribe_stream

        _, options = resolve_options(self, options, **option_kwargs)
        LiveSession(sample_rate, partial_every=partial_every)  # refuses a bad rate or cadence now
        return transcribe_stream(self, chunks, options, sample_rate=sample_rate, partial_every=partial_every)
