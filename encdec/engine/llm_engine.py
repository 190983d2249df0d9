"""``LLMEngine``: requests in, one scheduled forward per ``step()``, outputs out.

    seq_group_metadata, scheduler_outputs = self.scheduler.schedule()
    output = self.model_runner.execute(seq_group_metadata, ...)
    return self._process_outputs(output, scheduler_outputs)
"""
from __future__ import annotations

import itertools
import logging
import numbers
import os
import time
from collections.abc import Iterable
from collections.abc import Sequence as Seq  # encdec.sequence.Sequence is the other one
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from encdec.attention.selector import get_attn_backend
from encdec.beam_search.manager import BeamSearchManager
from encdec.beam_search.params import BeamSearchParams
from encdec.beam_search.rows import BeamRowParams
from encdec.config import CacheConfig, ModelConfig, SchedulerConfig
from encdec.core.scheduler import Scheduler, SchedulerOutputs, SchedulerStats
from encdec.engine.arg_utils import EngineArgs
from encdec.engine.capacity import kv_blocks_needed
from encdec.engine.encoder_key import encoder_cache_key
from encdec.engine.stop_checker import StopChecker
from encdec.inputs import InputPreprocessor, PromptType, prompt_errors
from encdec.models.layers import pack_linears
from encdec.models.loader import iterate_weights, open_checkpoint
from encdec.models.registry import get_model_cls, get_model_module
from encdec.outputs import Detokenizer, RequestOutput
from encdec.sample.logits_processor import build_logitsprocs, resolve_logitsproc_class
from encdec.sampling_params import SamplingParams
from encdec.sequence import Sequence, SequenceGroup, SequenceStatus
from encdec.worker import huge_pages
from encdec.worker.cache_engine import (
    MAX_PREFAULT_BYTES,
    CacheEngine,
    cache_block_bytes,
    default_cpu_kv_cache_bytes,
    default_gpu_kv_cache_bytes,
    typical_decoder_len,
)
from encdec.worker.enc_dec_model_runner import EncoderDecoderModelRunner, ModelRunnerOutput
from encdec.worker.input_batch import InputBatch

logger = logging.getLogger("encdec")

_GiB = 1 << 30
_DTYPE = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16,
          "half": torch.float16, "bfloat16": torch.bfloat16}


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available here")
    return torch.device(device)


def _resolve_dtype(dtype: str, device: torch.device, hf_config: Any) -> torch.dtype:
    if dtype != "auto":
        return _DTYPE[dtype]
    if device.type == "cpu":
        return torch.float32
    ckpt = str(getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", "")).removeprefix("torch.")
    return torch.bfloat16 if ckpt == "bfloat16" else torch.float16


class SkipParameterInit(TorchFunctionMode):
    """Skip ``torch.nn.init`` while a model is built on the meta device: the
    checkpoint overwrites every weight, and meta-device init ops import
    torch._refs and sympy (measured: 1.6 s and +76 MiB RSS for a tiny BART).
    A torch function mode is local to the thread that enters it."""

    _SKIPPED = {torch.Tensor.normal_, torch.Tensor.uniform_, torch.nn.init.normal_,
                torch.nn.init.uniform_, torch.nn.init.trunc_normal_, torch.nn.init.kaiming_uniform_,
                torch.nn.init.kaiming_normal_, torch.nn.init.xavier_uniform_,
                torch.nn.init.xavier_normal_}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._SKIPPED:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


class _EngineConfig:
    """What logits processors see: ``scheduler_config`` and ``model_config``."""

    def __init__(self, scheduler_config: SchedulerConfig, model_config: ModelConfig, generation_config):
        self.scheduler_config = scheduler_config
        self.model_config = model_config
        self.generation_config = generation_config


@dataclass(frozen=True)
class EngineStats:
    num_running: int  # sequence groups running (on device)
    num_waiting: int  # sequence groups not yet admitted
    num_swapped: int  # sequence groups swapped out to CPU
    kv_cache_usage: float  # fraction of device KV blocks in use, 0..1
    num_preemptions: int  # since the engine started
    encoder_cache_queries: int  # requests that looked up a shared cross table, since start
    encoder_cache_hits: int  # of those, requests that reused one (no encoder pass)


class LLMEngine:
    """Requests in, one scheduled forward per ``step()``, outputs out.

    Not thread-safe: one thread drives an engine (``LLM`` serialises its
    callers with a lock). Building one changes no process-wide state: torch's
    threads, its global RNG and the allocator are the program's to set
    (``encdec.configure_cpu_runtime``); random sampling draws from the
    engine's own generator, seeded from ``EngineArgs.seed``.
    """

    def __init__(self, args: EngineArgs):
        self.args = args
        self.device = _resolve_device(args.device)
        self._init_model_config(args)
        self._init_model()
        self.cache_config = self._size_kv_cache(args)
        self._init_scheduler(args)
        self._init_sampling(args)
        self._init_input_processing()
        self.seq_counter = itertools.count()
        self._num_request_ids = 0  # next id new_request_id() gives
        self.groups: dict[str, SequenceGroup] = {}
        self.beam_search = BeamSearchManager(self.scheduler.free_seq, self.seq_counter, self.tokenizer,
                                             self.scheduler.block_manager.fork)
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        mc = self.model_config
        self._model_identity = f"{mc.architecture}\0{os.path.realpath(mc.model)}\0{mc.dtype}"

    @property
    def stats(self) -> SchedulerStats:
        """Live counters (encoder cache queries/hits/passes, preemptions, swaps,
        peak KV blocks): what a server's ``/metrics`` reports."""
        return self.scheduler.stats

    # -- construction steps, in order ------------------------------------------
    def _init_model_config(self, args: EngineArgs) -> None:
        """Checkpoint, tokenizer and the resolved lengths and dtype."""
        ckpt = open_checkpoint(args.model, tokenizer=args.tokenizer)
        self.checkpoint = ckpt
        self.model_module = get_model_module(ckpt.architecture)
        hf_config, self.generation_config = ckpt.hf_config, ckpt.generation_config
        self.hf_config = hf_config
        self.tokenizer = self._load_tokenizer(self.model_module, args.tokenizer or ckpt.path)
        self.dtype = _resolve_dtype(args.dtype, self.device, hf_config)
        max_dec = getattr(hf_config, "max_target_positions", None) or hf_config.max_position_embeddings
        max_enc = getattr(hf_config, "max_source_positions", None) or hf_config.max_position_embeddings
        if args.max_model_len is not None:
            if args.max_model_len > max_dec:
                raise ValueError(f"max_model_len={args.max_model_len} exceeds the model's "
                                 f"{max_dec} decoder positions")
            max_dec = args.max_model_len
            if not hasattr(self.model_module, "make_audio_processor"):
                # A text encoder's prompt is bounded by max_model_len too (as in vLLM);
                # an audio encoder's length is fixed by the model.
                max_enc = min(max_enc, args.max_model_len)
        self.model_config = ModelConfig(
            model=args.model, tokenizer=args.tokenizer, dtype=str(self.dtype).removeprefix("torch."),
            seed=args.seed, architecture=ckpt.architecture, hf_config=hf_config,
            max_model_len=max_dec, max_encoder_len=max_enc, enforce_eager=args.enforce_eager)

    def _init_model(self) -> None:
        """Build the model on the meta device, load the checkpoint, prepack linears."""
        ckpt = self.checkpoint
        self.backend = get_attn_backend(self.args.attention_backend, self.device.type)
        model_cls = get_model_cls(ckpt.architecture)
        with torch.device("meta"), SkipParameterInit():
            model = model_cls(self.hf_config, self.backend)
        model = model.to_empty(device="cpu").to(torch.float32)
        for buf in model.buffers():  # buffers a checkpoint may omit start at zero
            buf.zero_()
        model.load_weights(iterate_weights(ckpt))
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        huge_pages.move_parameters(self.model)  # CPU: decode steps stream the weights; see huge_pages
        num_packed = pack_linears(self.model)  # CPU float32: oneDNN, see encdec/models/layers.py
        logger.info("prepacked %d linear layers for oneDNN", num_packed)
        self.vocab_size = model.vocab_size

    def _size_kv_cache(self, args: EngineArgs) -> CacheConfig:
        """Number of device and swap blocks; refuses a cache that cannot hold one
        request of the longest kind (a ``max_model_len`` decoder sequence and
        a cross table for the longest encoder input)."""
        cfg = args.cache_config()
        model, mc = self.model, self.model_config
        block_bytes = cache_block_bytes(model.num_cache_layers, cfg.block_size,
                                        model.num_kv_heads, model.head_size, self.dtype)
        dec_blocks = -(-mc.max_model_len // cfg.block_size)
        cross_blocks = -(-mc.max_encoder_len // cfg.block_size)
        needed = dec_blocks + cross_blocks
        typical_request = (-(-typical_decoder_len(mc.max_model_len) // cfg.block_size)
                           + cross_blocks) * block_bytes
        # CPU: commit at start what the first requests write (see CacheEngine._prefault);
        # all of an explicitly sized cache up to 1 GiB, the first 16 typical requests'
        # worth of a default one, so that LLM() costs little more than its model.
        self.kv_prefault_bytes = MAX_PREFAULT_BYTES
        if cfg.kv_cache_memory is not None:
            kv_bytes = cfg.kv_cache_memory
        elif self.device.type == "cuda":
            kv_bytes = default_gpu_kv_cache_bytes(self.device, cfg.gpu_memory_utilization)
        else:
            kv_bytes = default_cpu_kv_cache_bytes(args.max_num_seqs * typical_request,
                                                  minimum=needed * block_bytes)
            self.kv_prefault_bytes = 16 * typical_request
        cfg.num_gpu_blocks = kv_bytes // block_bytes
        if cfg.num_gpu_blocks < 1:
            raise ValueError(f"kv_cache_memory={kv_bytes} bytes holds no KV block "
                             f"(one block is {block_bytes} bytes)")
        # Admission keeps the block manager's default watermark (1%) free, so the
        # longest request needs that on top (encdec.engine.capacity agrees).
        watermark = int(0.01 * cfg.num_gpu_blocks)
        needed += watermark
        if cfg.num_gpu_blocks < needed:
            raise ValueError(
                f"the KV cache holds {cfg.num_gpu_blocks} blocks ({kv_bytes} bytes, {block_bytes} bytes "
                f"per block of {cfg.block_size} tokens) but one request needs {needed} blocks "
                f"({needed * block_bytes} bytes): {dec_blocks} for a max_model_len={mc.max_model_len} "
                f"decoder sequence, {cross_blocks} for its cross-attention table of "
                f"{mc.max_encoder_len} encoder tokens and {watermark} kept free by admission (1% watermark); "
                f"raise kv_cache_memory or lower max_model_len")
        cfg.num_cpu_blocks = int(cfg.swap_space * _GiB) // block_bytes
        logger.info("KV cache: %d device blocks, %d CPU swap blocks of %d tokens (%.1f MiB each)",
                    cfg.num_gpu_blocks, cfg.num_cpu_blocks, cfg.block_size, block_bytes / 2**20)
        return cfg

    def _init_scheduler(self, args: EngineArgs) -> None:
        """The scheduler (block bookkeeping) and the cache engine (the KV tensors)."""
        mc, cache_cfg, model = self.model_config, self.cache_config, self.model
        one_request = mc.max_model_len + mc.max_encoder_len
        self.scheduler_config = SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens or max(32768, one_request),
            max_num_seqs=args.max_num_seqs, max_model_len=mc.max_model_len,
            max_encoder_len=mc.max_encoder_len, preemption_mode=args.preemption(),
            policy=args.scheduling_policy)
        self.cache_engine = CacheEngine(
            num_layers=model.num_cache_layers, num_kv_heads=model.num_kv_heads,
            head_size=model.head_size, block_size=cache_cfg.block_size,
            num_gpu_blocks=cache_cfg.num_gpu_blocks, num_cpu_blocks=cache_cfg.num_cpu_blocks,
            dtype=self.dtype, device=self.device, backend=self.backend,
            prefault_bytes=self.kv_prefault_bytes)
        cache_cfg.num_warm_gpu_blocks = self.cache_engine.num_warm_blocks
        self.scheduler = Scheduler(self.scheduler_config, cache_cfg)

    def _init_sampling(self, args: EngineArgs) -> None:
        """Logits processors, the persistent batch, the engine's generator and the runner."""
        pin = self.device.type == "cuda"
        model_procs = list(getattr(self.model_module, "logits_processors", lambda: [])())
        user_procs = [resolve_logitsproc_class(p) for p in (args.logits_processors or [])]
        self.processor_classes = model_procs + user_procs
        self.processor_config = _EngineConfig(self.scheduler_config, self.model_config,
                                              self.generation_config)
        logitsprocs = build_logitsprocs(self.processor_config, self.device, pin, self.processor_classes)
        self.input_batch = InputBatch(max_num_reqs=args.max_num_seqs, vocab_size=self.vocab_size,
                                      device=self.device, logitsprocs=logitsprocs, is_pin_memory=pin)
        # Unseeded random sampling draws from this, not torch's global RNG: two
        # engines (or an engine and the user's own torch code) do not disturb
        # each other, and an engine's unseeded outputs follow from its seed.
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(args.seed)
        self.model_runner = EncoderDecoderModelRunner(self.model, self.backend, self.cache_engine,
                                                      self.input_batch, self.device,
                                                      generator=self.generator)

    def _init_input_processing(self) -> None:
        """Prompt preprocessing, detokenizer and stop checks."""
        module, hf_config, gen_config = self.model_module, self.hf_config, self.generation_config
        default_prompt = module.default_decoder_prompt(hf_config, gen_config, self.tokenizer)
        audio = getattr(module, "make_audio_processor", None)
        prepare = getattr(module, "prepare_decoder_prompt", None)
        self.input_preprocessor = InputPreprocessor(
            self.tokenizer, hf_config.decoder_start_token_id, lambda: list(default_prompt),
            audio(hf_config) if audio else None,
            (lambda ids: prepare(ids, gen_config)) if prepare else None)
        eos = gen_config.eos_token_id if gen_config.eos_token_id is not None else hf_config.eos_token_id
        self.eos_token_id = eos[0] if isinstance(eos, list) else eos
        self.detokenizer = Detokenizer(self.tokenizer)
        self.stop_checker = StopChecker(self.model_config.max_model_len)

    @staticmethod
    def _load_tokenizer(module, path: str):
        loader = getattr(module, "load_tokenizer", None)
        if loader is not None:
            return loader(path)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)

    def new_request_id(self) -> str:
        """A request id not in use ("0", "1", ...), so callers keep no counter of
        their own and never collide with each other's ids."""
        while True:
            request_id = str(self._num_request_ids)
            self._num_request_ids += 1
            if request_id not in self.groups:
                return request_id

    # -- requests ----------------------------------------------------------------
    def process_requests(self, prompts: Seq[PromptType],
                         params_list: Seq[SamplingParams | None], *,
                         priority: Seq[int] | None = None,
                         truncation: bool = False) -> list[tuple[dict, SamplingParams]]:
        """Validate and tokenize a whole call without touching engine state: every
        check that can run before scheduling runs here, so one bad prompt refuses
        the call (the error names its index: "prompt 3: ...") before any of it is
        queued. The audio of all prompts becomes features in one batched call.
        ``truncation``: cut an encoder prompt longer than the model's positions as
        HF's ``tokenizer(truncation=True)`` does (its final eos kept) instead of refusing it.
        ``BeamSearchParams`` become the params of the beams' rows."""
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} sampling_params for {len(prompts)} prompts")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        return self._process(prompts, params_list, priority, indexed=True, truncation=truncation)

    def process_request(self, prompt: PromptType, params: SamplingParams | None, *,
                        priority: int = 0, truncation: bool = False) -> tuple[dict, SamplingParams]:
        """``process_requests`` for one prompt (errors carry no index)."""
        return self._process([prompt], [params], [priority], indexed=False, truncation=truncation)[0]

    def _process(self, prompts: Seq[PromptType], params_list: Seq[SamplingParams | None],
                 priority: Seq[int] | None, *, indexed: bool,
                 truncation: bool = False) -> list[tuple[dict, SamplingParams]]:
        checked: dict[int, SamplingParams] = {}  # id(user params) -> checked; a shared one is checked once
        for i, params in enumerate(params_list):
            with prompt_errors(i if indexed else None):
                if priority is not None:
                    self._check_priority(priority[i])
                if id(params) not in checked:
                    checked[id(params)] = self._check_params(params)
        # The tokenizer's defaults, except for Whisper, whose special tokens the
        # user gives (vLLM's rule; an added eos would end generation).
        kwargs = {"add_special_tokens": False} if self.hf_config.model_type == "whisper" else None
        preprocessor = self.input_preprocessor
        all_inputs = preprocessor.process_batch(prompts, tokenization_kwargs=kwargs) if indexed \
            else [preprocessor.process(prompts[0], tokenization_kwargs=kwargs)]
        out = []
        for i, (inputs, params) in enumerate(zip(all_inputs, params_list)):
            with prompt_errors(i if indexed else None):
                out.append(self._check_request(inputs, checked[id(params)], truncation=truncation))
        return out

    def _check_priority(self, priority: Any) -> None:
        if isinstance(priority, (bool, np.bool_)) or not isinstance(priority, numbers.Integral):
            raise TypeError(f"priority must be an int, got {type(priority).__name__} {priority!r}")
        if priority != 0 and self.scheduler_config.policy != "priority":
            # vLLM raises too, rather than ignore it.
            raise ValueError(f"got priority {priority} but priority scheduling is not enabled "
                             f"(scheduling_policy={self.scheduler_config.policy!r}); pass "
                             "scheduling_policy='priority' to LLM to use priorities")

    def _check_params(self, params: SamplingParams | None) -> SamplingParams:
        """The checks that need the model: token ids against the vocabulary,
        logits processors' own rules. Returns a private copy with the model's
        eos ids folded in."""
        if params is None:
            params = SamplingParams()
        if isinstance(params, BeamSearchParams):  # beam search: its rows run greedy params
            params = BeamRowParams.from_beam_params(params)
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        params = params.clone()
        if params.bad_words:
            params.update_from_tokenizer(self.tokenizer)
        params.verify_against(self.vocab_size)
        self.input_batch.logitsprocs.validate_params(params)
        params.update_from_generation_config({"eos_token_id": self.generation_config.eos_token_id},
                                             self.eos_token_id)
        return params

    def _check_request(self, inputs: dict, params: SamplingParams, *,
                       truncation: bool = False) -> tuple[dict, SamplingParams]:
        """Lengths, token ids and KV capacity of one processed prompt; returns the
        inputs (truncated if asked) and their own params with ``max_tokens`` fitted
        to the decoder's positions."""
        dec_len, enc_len = len(inputs["prompt_token_ids"]), len(inputs["encoder_prompt_token_ids"])
        cfg = self.model_config
        if enc_len > cfg.max_encoder_len and truncation and "encoder_features" not in inputs:
            ids, keep = inputs["encoder_prompt_token_ids"], cfg.max_encoder_len
            ids = ids[:keep - 1] + ids[-1:] if ids[-1] == self.eos_token_id else ids[:keep]
            inputs = {**inputs, "encoder_prompt_token_ids": ids}
            enc_len = len(ids)
        if enc_len > cfg.max_encoder_len:
            raise ValueError(f"encoder prompt is {enc_len} tokens, longer than the model's "
                             f"{cfg.max_encoder_len} encoder positions; pass truncation=True to cut it")
        if dec_len >= cfg.max_model_len:
            raise ValueError(f"decoder prompt is {dec_len} tokens; the model has {cfg.max_model_len} "
                             "decoder positions and needs room for at least one output token")
        far = [p for p in params.prompt_token_logprobs or () if not -dec_len <= p < dec_len]
        if far:
            raise ValueError(f"prompt_token_logprobs positions {far} are outside the {dec_len}-token decoder prompt")
        # Audio requests carry placeholder encoder ids; the decoder's are real.
        ids = inputs["prompt_token_ids"] if "encoder_features" in inputs \
            else inputs["encoder_prompt_token_ids"] + inputs["prompt_token_ids"]
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary (size {self.vocab_size})")
        params = params.clone()
        if params.max_tokens is None or dec_len + params.max_tokens > cfg.max_model_len:
            params.max_tokens = cfg.max_model_len - dec_len
        self._check_fits(dec_len, enc_len, params)
        return inputs, params

    def _check_fits(self, dec_len: int, enc_len: int, params: SamplingParams) -> None:
        """Refuse a request that could never finish in this KV cache, which the
        scheduler would otherwise end mid-run with an error and an empty or cut
        output (arithmetic in ``encdec.engine.capacity``)."""
        bm, bs, b = self.scheduler.block_manager, self.cache_config.block_size, params.best_of
        if b > self.scheduler_config.max_num_seqs:
            raise ValueError(f"best_of (or n) is {b}, more sequences than max_num_seqs="
                             f"{self.scheduler_config.max_num_seqs} can run at once; raise max_num_seqs")
        need = kv_blocks_needed(dec_len, enc_len, max_tokens=params.max_tokens, best_of=b,
                                block_size=bs, watermark_blocks=bm.watermark_blocks)
        if need.total > bm.num_total_gpu_blocks:
            raise ValueError(
                f"the request can never fit the KV cache: it needs up to {need.total} blocks of {bs} "
                f"tokens ({need.self_attention} for decoder self-attention: a {dec_len}-token prompt + "
                f"max_tokens={params.max_tokens}, best_of={b}; {need.cross_attention} for cross-attention "
                f"over {enc_len} encoder positions; {need.reserve} the scheduler keeps in reserve) but "
                f"the cache has {bm.num_total_gpu_blocks} blocks; lower max_tokens or raise kv_cache_memory")

    def add_processed_request(self, request_id: str, inputs: dict, params: SamplingParams,
                              arrival_time: float | None = None, priority: int = 0) -> None:
        """Queue what ``process_requests`` returned. Pass the same ``priority`` to
        both; it is checked here again before anything changes."""
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._check_priority(priority)
        block_size = self.cache_config.block_size
        seqs = []
        for i in range(params.best_of):
            seq = Sequence(next(self.seq_counter), inputs, block_size, self.eos_token_id)
            seq.data.sample_index = i
            seqs.append(seq)
        encoder_seq = Sequence(seqs[0].seq_id, inputs, block_size, from_decoder_prompt=False)
        key = encoder_cache_key(inputs, self._model_identity) if self.cache_config.enable_encoder_cache else None
        group = SequenceGroup(request_id, seqs, arrival_time or time.time(), params,
                              encoder_seq=encoder_seq, priority=priority, encoder_cache_key=key)
        self.groups[request_id] = group
        if self.beam_search.is_beam_group(group):
            self.beam_search.add_group(group)
        self.scheduler.add_seq_group(group)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        inputs, params = self.process_request(prompt, params, priority=priority)
        self.add_processed_request(request_id, inputs, params, arrival_time, priority)

    def abort_request(self, request_id: str | list[str]) -> list[str]:
        """Abort unfinished requests (unknown ids are ignored); returns the ids aborted."""
        aborted = []
        for group in self.scheduler.abort_seq_group(request_id):
            self.groups.pop(group.request_id, None)
            self.beam_search.forget(group.request_id)
            aborted.append(group.request_id)
        return aborted

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_seqs()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_seq_groups()

    # -- step --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduled forward; returns the requests that finished in it."""
        metas, sched = self.scheduler.schedule()
        output = self.model_runner.execute(
            metas, blocks_to_swap_in=sched.blocks_to_swap_in,
            blocks_to_swap_out=sched.blocks_to_swap_out, blocks_to_copy=sched.blocks_to_copy)
        return self._process_outputs(output, sched)

    def _process_outputs(self, output: ModelRunnerOutput, sched: SchedulerOutputs) -> list[RequestOutput]:
        now = time.time()
        for i, s in enumerate(sched.scheduled_seq_groups):
            s.seq_group.update_num_computed_tokens(s.token_chunk_size)
            if i < sched.num_prefill_groups:
                self.num_prompt_tokens += s.token_chunk_size + s.seq_group.encoder_seq.get_len()
                if s.seq_group.metrics.first_token_time is None:
                    s.seq_group.metrics.first_token_time = now
        seqs = {s.seq_id: (s, g.seq_group) for g in sched.scheduled_seq_groups
                for s in g.seq_group.get_seqs(SequenceStatus.RUNNING)}
        for sample in output.samples:
            seq, group = seqs[sample.seq_id]
            params = group.sampling_params
            seq.append_token_id(sample.token_id, sample.logprobs)
            added = self.detokenizer.decode_sequence_inplace(seq, params) if params.detokenize else 0
            self.stop_checker.maybe_stop_sequence(seq, added, params, self.eos_token_id)
            if seq.is_finished():
                self.scheduler.free_seq(seq)
        for request_id, lps in output.prompt_logprobs.items():
            group = self.groups.get(request_id)
            if group is not None and group.prompt_logprobs is None:
                group.prompt_logprobs = lps
        for request_id, lps in output.prompt_token_logprobs.items():
            group = self.groups.get(request_id)
            if group is not None and group.prompt_token_logprobs is None:
                group.prompt_token_logprobs = lps
        self.num_generated_tokens += len(output.samples)
        if output.beam_candidates:  # beam groups: tokens come from HF's beam rules, not sampling
            self.num_generated_tokens += sum(self.groups[r].num_seqs(SequenceStatus.RUNNING)
                                             for r in output.beam_candidates)
            self.beam_search.process(output.beam_candidates, self.groups)
        finished = [g for g in sched.ignored_seq_groups]
        finished += [s.seq_group for s in sched.scheduled_seq_groups if s.seq_group.is_finished()]
        self.scheduler.free_finished_seq_groups()
        outs = []
        for group in finished:
            group.metrics.finished_time = now
            self.groups.pop(group.request_id, None)
            outs.append(self.beam_search.make_output(group) if self.beam_search.is_beam_group(group)
                        else RequestOutput.from_seq_group(group))
        return outs

    def num_free_blocks(self) -> tuple[int, int]:
        bm = self.scheduler.block_manager
        return bm.get_num_free_gpu_blocks(), bm.get_num_free_cpu_blocks()

    # -- observation (servers, metrics) -----------------------------------------
    def get_stats(self) -> EngineStats:
        """Queue lengths and cache use now, for a server's /metrics."""
        sched, total = self.scheduler, self.cache_config.num_gpu_blocks
        free, _ = self.num_free_blocks()
        st = sched.stats
        return EngineStats(len(sched.running), len(sched.waiting), len(sched.swapped),
                           (total - free) / total if total else 0.0, st.num_preempted,
                           st.encoder_cache_queries, st.encoder_cache_hits)

    def get_partial_outputs(self, request_ids: Iterable[str]) -> dict[str, RequestOutput]:
        """What the given unfinished requests have produced so far (``step`` returns
        finished requests only); streaming servers read this after each step."""
        groups = self.groups
        return {rid: RequestOutput.from_seq_group(groups[rid]) for rid in request_ids if rid in groups}

    def get_request_progress(self) -> dict[str, tuple[int, float]]:
        """(output tokens so far, arrival time) of every unfinished request, for
        token-latency metrics."""
        return {rid: (sum(s.get_output_len() for s in g.get_seqs()), g.arrival_time)
                for rid, g in self.groups.items()}
