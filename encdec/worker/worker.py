"""``Worker``: one device's model, KV cache, persistent batch and step runner.

Everything that knows the device lives here, built in this order by the engine:

    Worker(load_config)           device, checkpoint -> ModelConfig, model + weights
    worker.init_cache(...)        KV sizing (the block manager's arithmetic), CacheEngine
    worker.init_batch(...)        logits processors, InputBatch, generator, model runner
    worker.execute_model(...)     one scheduled step, queued -> .get_output(): ModelRunnerOutput

A CUDA graph capture, a new weight format or a new device's KV sizing lands
here; the engine above sees only configs and ``execute_model``.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Collection
from dataclasses import replace
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from encdec.attention.selector import get_attn_backend
from encdec.block_manager.capacity import longest_request_blocks
from encdec.config import CacheConfig, LoadConfig, ModelConfig, SchedulerConfig
from encdec.core.scheduler_outputs import SchedulerOutputs
from encdec.models.layers import pack_linears
from encdec.models.loader import Checkpoint, iterate_weights, open_checkpoint
from encdec.models.registry import get_model_cls, get_model_hooks, get_model_module
from encdec.platform import huge_pages, precision
from encdec.sample.logits_processor import build_logitsprocs, resolve_logitsproc_class
from encdec.sampling_params import SamplingParams
from encdec.sequence import SequenceGroupMetadata
from encdec.spec_decode.draft_vocab import draft_vocab_ids, special_token_ids
from encdec import quantization
from encdec.worker.cache_engine import (
    MAX_PREFAULT_BYTES,
    CacheEngine,
    cache_block_bytes,
    default_cpu_kv_cache_bytes,
    explicit_prefault_bytes,
    profile_batch,
    profiled_kv_cache_bytes,
    typical_decoder_len,
)
from encdec.worker.cuda_graphs import DecodeGraphs, graphs_wanted
from encdec.worker.draft_kv import DraftKV, budget_with_copy, copy_budget
from encdec.worker.draft_model import DRAFT_KV_BYTES, DraftModel
from encdec.worker.enc_dec_model_runner import EncoderDecoderModelRunner, StepPlan
from encdec.worker.input_batch import InputBatch
from encdec.worker.step_output import AsyncModelRunnerOutput

logger = logging.getLogger("encdec")

_GiB = 1 << 30
_DTYPE = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16,
          "half": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available here")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device, hf_config: Any) -> torch.dtype:
    """``auto``: float32 on CPU (exact, and what our kernels run); the checkpoint's
    half type on CUDA (bfloat16 if it says so, else float16)."""
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


class ProcessorConfig:
    """What logits processors see: ``scheduler_config``, ``model_config`` and the
    checkpoint's ``generation_config``."""

    def __init__(self, scheduler_config: SchedulerConfig, model_config: ModelConfig, generation_config: Any):
        self.scheduler_config = scheduler_config
        self.model_config = model_config
        self.generation_config = generation_config


def _model_config(args: LoadConfig, ckpt: Checkpoint, dtype: torch.dtype) -> ModelConfig:
    """The checkpoint's lengths, capped by ``max_model_len`` (which may raise them
    for a family whose positions are relative: its module's ``LENGTH_UNBOUNDED``)."""
    hf_config = ckpt.hf_config
    max_dec = getattr(hf_config, "max_target_positions", None) or hf_config.max_position_embeddings
    max_enc = getattr(hf_config, "max_source_positions", None) or hf_config.max_position_embeddings
    if args.max_model_len is not None:
        unbounded = getattr(get_model_module(ckpt.architecture), "LENGTH_UNBOUNDED", False)
        if args.max_model_len > max_dec and not unbounded:
            raise ValueError(f"max_model_len={args.max_model_len} exceeds the model's "
                             f"{max_dec} decoder positions")
        max_dec = args.max_model_len
        if get_model_hooks(ckpt.architecture).make_audio_processor is None:
            # A text encoder's prompt is bounded by max_model_len too (as in vLLM);
            # an audio encoder's length is fixed by the model.
            max_enc = args.max_model_len if unbounded else min(max_enc, args.max_model_len)
    return ModelConfig(
        model=args.model, tokenizer=args.tokenizer, dtype=str(dtype).removeprefix("torch."),
        seed=args.seed, architecture=ckpt.architecture, hf_config=hf_config,
        max_model_len=max_dec, max_encoder_len=max_enc, enforce_eager=args.enforce_eager,
        generation_config=ckpt.generation_config, checkpoint_path=ckpt.path)


class Worker:
    def __init__(self, args: LoadConfig, *, check_precision: bool = True):
        """``check_precision=False`` only for ``platform.precision``'s own probe engines."""
        self.load_config = args
        self.device = resolve_device(args.device)
        self.checkpoint = open_checkpoint(args.model, tokenizer=args.tokenizer)
        self.dtype = resolve_dtype(args.dtype, self.device, self.checkpoint.hf_config)
        if check_precision:  # bfloat16/float16 on CPU only where faster than float32
            precision.check_cpu_dtype(self.device, self.dtype)
        quantization.check_quantization(args.quantization, self.device, self.dtype)
        self.model_config = _model_config(args, self.checkpoint, self.dtype)
        self.backend = get_attn_backend(args.attention_backend, self.device.type, dtype=self.dtype)
        self.model = self._load_model()
        self.vocab_size: int = self.model.vocab_size

    def _load_model(self) -> torch.nn.Module:
        """Build the model on the meta device, load the checkpoint, prepack linears."""
        ckpt = self.checkpoint
        model_cls = get_model_cls(ckpt.architecture)
        with torch.device("meta"), SkipParameterInit():
            model = model_cls(ckpt.hf_config, self.backend)
        model = model.to_empty(device="cpu").to(torch.float32)
        for buf in model.buffers():  # buffers a checkpoint may omit start at zero
            buf.zero_()
        model.load_weights(iterate_weights(ckpt))
        model = model.to(device=self.device, dtype=self.dtype).eval()
        quantization.quantize(model, self.load_config.quantization)  # opt-in int8 linears (CPU)
        quantization.float32_logits(model, self.dtype, self.device)  # bfloat16 on CPU: logits not rounded to it
        huge_pages.move_parameters(model)  # CPU: decode steps stream the weights; see huge_pages
        quantization.place_decode_panels(model)  # int8: the panels decode steps stream, likewise
        num_packed = pack_linears(model)  # CPU float32/bfloat16: oneDNN, see encdec/models/layers.py
        logger.info("prepacked %d linear layers for oneDNN", num_packed)
        return model

    # -- KV cache ------------------------------------------------------------------
    def init_cache(self, cfg: CacheConfig, max_num_seqs: int, *,
                   max_num_batched_tokens: int | None = None, draft: Worker | None = None) -> CacheConfig:
        """Size the KV cache (device and swap blocks) and allocate it. Refuses a
        cache that cannot hold one request of the longest kind: a ``max_model_len``
        decoder sequence, a cross table for the longest encoder input and the
        block manager's admission watermark. ``draft``: a draft model loaded
        (``load_draft``): its weights count, and a block costs its own pool's
        bytes too (a self-draft's: none; on CPU its K/V copy takes a third, ``copy_budget``)."""
        model, mc = self.model, self.model_config
        kv_dtype = quantization.kv_cache_dtype(cfg.cache_dtype, self.dtype, self.device, self.backend.get_name())
        block_bytes = cache_block_bytes(model.num_cache_layers, cfg.block_size,
                                        model.num_kv_heads, model.head_size, kv_dtype)
        block_bytes += self._draft_block_bytes(draft, cfg)  # a block of each pool
        # a CPU self-draft's bfloat16 copy of its rows' K/V (DraftKV) is in the budget; a default one holds both
        copies = draft is not None and self.is_self_draft(draft) and DraftKV.pays(self.device, kv_dtype)
        kv_bytes, prefault_bytes = self._kv_bytes(cfg, max_num_seqs, budget_with_copy(block_bytes) if copies
                                                  else block_bytes, max_num_batched_tokens,
                                                  () if draft is None else (draft.model,))
        cfg.draft_kv_bytes = copy_budget(kv_bytes, DRAFT_KV_BYTES) if copies else 0
        copy = f", less {cfg.draft_kv_bytes} for the self-draft's bfloat16 K/V copy" if cfg.draft_kv_bytes else ""
        cfg.num_gpu_blocks = (kv_bytes - cfg.draft_kv_bytes) // block_bytes
        if cfg.num_gpu_blocks < 1:
            raise ValueError(f"kv_cache_memory={kv_bytes} bytes holds no KV block{copy} "
                             f"(one block is {block_bytes} bytes)")
        dec_blocks, cross_blocks, watermark = longest_request_blocks(
            mc.max_model_len, mc.max_encoder_len, cfg.block_size, cfg.num_gpu_blocks)
        needed = dec_blocks + cross_blocks + watermark
        if cfg.num_gpu_blocks < needed:
            raise ValueError(
                f"the KV cache holds {cfg.num_gpu_blocks} blocks ({kv_bytes} bytes{copy}, {block_bytes} bytes "
                f"per block of {cfg.block_size} tokens) but one request needs {needed} blocks "
                f"({needed * block_bytes} bytes): {dec_blocks} for a max_model_len={mc.max_model_len} "
                f"decoder sequence, {cross_blocks} for its cross-attention table of "
                f"{mc.max_encoder_len} encoder tokens and {watermark} kept free by admission (1% watermark); "
                f"raise kv_cache_memory or lower max_model_len")
        cfg.num_cpu_blocks = int(cfg.swap_space * _GiB) // block_bytes
        # CUDA graphs: padded rows of a replayed decode step write to one block
        # past the block manager's (cuda_graphs.py).
        self.use_cuda_graphs = graphs_wanted(
            self.device, self.backend.get_name(), self.load_config.enforce_eager,
            position_bias=getattr(mc.hf_config, "relative_attention_num_buckets", None) is not None)
        pad_blocks = 1 if self.use_cuda_graphs else 0
        logger.info("KV cache: %d device blocks, %d CPU swap blocks of %d tokens (%.1f MiB each)",
                    cfg.num_gpu_blocks, cfg.num_cpu_blocks, cfg.block_size, block_bytes / 2**20)
        self.cache_engine = CacheEngine(
            num_layers=model.num_cache_layers, num_kv_heads=model.num_kv_heads,
            head_size=model.head_size, block_size=cfg.block_size,
            num_gpu_blocks=cfg.num_gpu_blocks + pad_blocks, num_cpu_blocks=cfg.num_cpu_blocks,
            dtype=kv_dtype, device=self.device, backend=self.backend, prefault_bytes=prefault_bytes)
        cfg.num_warm_gpu_blocks = min(self.cache_engine.num_warm_blocks, cfg.num_gpu_blocks)
        return cfg

    def _kv_bytes(self, cfg: CacheConfig, max_num_seqs: int, block_bytes: int,
                  max_num_batched_tokens: int | None, others: tuple = ()) -> tuple[int, int]:
        """(cache bytes, bytes to prefault). CPU commits at start what the first
        requests write (see CacheEngine._prefault): all of an explicitly sized
        cache (``explicit_prefault_bytes``: the user chose to spend that memory),
        the first 16 typical requests' worth of a default one, up to 1 GiB, so
        that LLM() with defaults costs little more than its model."""
        mc = self.model_config
        if cfg.kv_cache_memory is not None:
            return cfg.kv_cache_memory, explicit_prefault_bytes(cfg.kv_cache_memory)
        if self.device.type == "cuda":
            return self._profiled_cuda_kv_bytes(cfg, max_num_seqs, max_num_batched_tokens, others), MAX_PREFAULT_BYTES
        dec_blocks, cross_blocks, _ = longest_request_blocks(mc.max_model_len, mc.max_encoder_len,
                                                             cfg.block_size, 0)
        typical_request = (-(-typical_decoder_len(mc.max_model_len) // cfg.block_size)
                           + cross_blocks) * block_bytes
        kv_bytes = default_cpu_kv_cache_bytes(max_num_seqs * typical_request,
                                              minimum=(dec_blocks + cross_blocks) * block_bytes)
        return kv_bytes, min(16 * typical_request, MAX_PREFAULT_BYTES)

    def _profiled_cuda_kv_bytes(self, cfg: CacheConfig, max_num_seqs: int,
                                max_num_batched_tokens: int | None, others: tuple = ()) -> int:
        """Profile the largest prefill step (``max_num_batched_tokens``; None: the
        scheduler's default budget), then size the cache as vLLM does
        (``profiled_kv_cache_bytes``); ``others``: models beside this one (a
        draft), whose weights count too."""
        mc, dev = self.model_config, self.device
        budget = max_num_batched_tokens or max(32768, mc.max_model_len + mc.max_encoder_len)
        dec, enc = profile_batch(budget, max_num_seqs, mc.max_model_len, mc.max_encoder_len)
        weights = sum(t.numel() * t.element_size() for m in (self.model, *others)
                      for t in (*m.parameters(), *m.buffers()))
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)  # weights, and any other engine's cache in this process
        self.profile_forward(dec, enc, cfg.block_size)
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - before
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)
        non_torch = max(0, total - free - torch.cuda.memory_reserved(dev))
        kv = profiled_kv_cache_bytes(
            total=total, gpu_memory_utilization=cfg.gpu_memory_utilization, weights=weights,
            peak_activations=peak, non_torch=non_torch, free=free,
            profiled=f"{len(dec)} prefills, {sum(dec)} decoder and {sum(enc)} encoder tokens")
        logger.info("KV sizing: %.2f GiB total, weights %.2f GiB, peak activations %.2f GiB, "
                    "outside torch %.2f GiB -> KV cache %.2f GiB", total / _GiB, weights / _GiB,
                    peak / _GiB, non_torch / _GiB, kv / _GiB)
        return kv

    def profile_forward(self, dec_lens: list[int], enc_lens: list[int], block_size: int) -> torch.Tensor:
        """One prefill forward of sequences of ``dec_lens`` decoder and ``enc_lens``
        encoder tokens (zeros; Whisper: silent features) over a one-block cache
        that every write lands in: the activations of that step, nothing else.
        Returns the LM head's logits of each sequence's last token."""
        model, dev, n = self.model, self.device, len(dec_lens)
        shape = self.backend.get_kv_cache_shape(1, block_size, model.num_kv_heads, model.head_size)
        caches = [torch.zeros(shape, dtype=self.dtype, device=dev) for _ in range(model.num_cache_layers)]
        i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=dev)  # noqa: E731
        q_start, e_start = [0], [0]
        for d, e in zip(dec_lens, enc_lens):
            q_start.append(q_start[-1] + d)
            e_start.append(e_start[-1] + e)
        tables = torch.zeros(n, 1, dtype=torch.int32, device=dev)
        md = self.backend.make_metadata(
            num_prefills=n, num_prefill_tokens=q_start[-1], num_decode_tokens=0,
            slot_mapping=torch.arange(q_start[-1], device=dev) % block_size,
            seq_lens=list(dec_lens), seq_lens_tensor=i32(dec_lens), max_prefill_seq_len=max(dec_lens),
            max_decode_seq_len=0, max_query_len=max(dec_lens), query_start_loc=i32(q_start),
            seq_start_loc=i32(q_start), context_lens_tensor=i32([0] * n), block_tables=tables,
            encoder_seq_lens=list(enc_lens), encoder_seq_lens_tensor=i32(enc_lens),
            encoder_seq_start_loc=i32(e_start), max_encoder_seq_len=max(enc_lens),
            num_encoder_tokens=e_start[-1], cross_slot_mapping=torch.arange(e_start[-1], device=dev) % block_size,
            cross_block_tables=tables, block_size=block_size,
            block_tables_list=[[0]] * n, cross_block_tables_list=[[0]] * n)
        mels = getattr(model, "num_mel_bins", None)
        features = ([torch.zeros(mels, model.n_frames)] * n if mels else [None] * n)
        enc_kwargs = model.build_encoder_inputs([[0] * e for e in enc_lens], features, dev)
        positions = torch.cat([torch.arange(d, device=dev) for d in dec_lens])
        with torch.inference_mode():
            hidden = model(torch.zeros(q_start[-1], dtype=torch.long, device=dev), positions, caches, md,
                           **enc_kwargs)
            return model.compute_logits(hidden[torch.tensor(q_start[1:], device=dev) - 1])

    # -- persistent batch and runner ---------------------------------------------------
    def load_draft(self, spec: Any) -> Worker:
        """The ``draft_model`` method's draft (``spec``: the engine's
        ``SpeculativeConfig``) loaded with this worker's options (device, dtype,
        backend) and ``spec.quantization``, before this worker sizes its cache
        (``init_cache(draft=...)``: the draft's weights and pool count there).
        ``compat.check_draft_compatible`` ran before any weight loaded."""
        cfg = replace(self.load_config, model=spec.model, tokenizer=None, quantization=spec.quantization,
                      max_model_len=self.model_config.max_model_len)
        try:
            return Worker(cfg)
        except ValueError as e:
            raise ValueError(f"speculative_config.model: {e}") from e

    def is_self_draft(self, draft: Worker) -> bool:
        """A draft of this worker's own checkpoint: it shares this worker's cache."""
        return os.path.realpath(draft.checkpoint.path) == os.path.realpath(self.checkpoint.path)

    def _draft_block_bytes(self, draft: Worker | None, cfg: CacheConfig) -> int:
        """Bytes a block costs in a draft's own pool (0: none, or a self-draft)."""
        if draft is None or self.is_self_draft(draft):
            return 0
        m = draft.model
        return cache_block_bytes(m.num_cache_layers, cfg.block_size, m.num_kv_heads, m.head_size,
                                 self._draft_kv_dtype(draft, cfg))

    @staticmethod
    def _draft_kv_dtype(draft: Worker, cfg: CacheConfig) -> torch.dtype:
        return quantization.kv_cache_dtype(cfg.cache_dtype, draft.dtype, draft.device, draft.backend.get_name())

    def draft_model(self, draft: Worker, cache_config: CacheConfig, draft_vocab_size: int | None = None) -> DraftModel:
        """The proposer over ``draft`` (``load_draft``), once this worker's cache
        is allocated: a self-draft shares it; any other draft gets a pool of its
        own with this cache's blocks (``init_cache`` sized both). ``draft_vocab_size``:
        its LM head's subset (``spec_decode.draft_vocab``)."""
        tc = self.cache_engine
        dc = draft.model_config
        ids = draft_vocab_ids(draft_vocab_size, draft.vocab_size, special_token_ids(dc.hf_config, dc.generation_config))
        if self.is_self_draft(draft):
            return DraftModel(draft.model, draft.backend, draft.device, tc.block_size, target_cache=tc, head_ids=ids,
                              copy_bytes=cache_config.draft_kv_bytes)
        m = draft.model
        own = CacheEngine(
            num_layers=m.num_cache_layers, num_kv_heads=m.num_kv_heads, head_size=m.head_size,
            block_size=tc.block_size, num_gpu_blocks=tc.gpu_cache[0].shape[1],
            num_cpu_blocks=cache_config.num_cpu_blocks, device=draft.device, backend=draft.backend,
            dtype=self._draft_kv_dtype(draft, cache_config))
        return DraftModel(m, draft.backend, draft.device, tc.block_size, target_cache=tc, own_cache=own, head_ids=ids)

    def init_batch(self, scheduler_config: SchedulerConfig, logits_processors: list[Any] | None,
                   seed: int) -> None:
        """Logits processors (the model's, then the user's), the persistent batch,
        the engine's generator and the model runner."""
        pin = self.device.type == "cuda"
        hooks = get_model_hooks(self.model_config.architecture)
        model_procs = list(hooks.logits_processors()) if hooks.logits_processors is not None else []
        user_procs = [resolve_logitsproc_class(p) for p in (logits_processors or [])]
        self.processor_classes = model_procs + user_procs
        self.processor_config = ProcessorConfig(scheduler_config, self.model_config,
                                                self.model_config.generation_config)
        logitsprocs = build_logitsprocs(self.processor_config, self.device, pin, self.processor_classes)
        self.input_batch = InputBatch(max_num_reqs=scheduler_config.max_num_seqs, vocab_size=self.vocab_size,
                                      device=self.device, logitsprocs=logitsprocs, is_pin_memory=pin)
        # Unseeded random sampling draws from this, not torch's global RNG: two
        # engines (or an engine and the user's own torch code) do not disturb
        # each other, and an engine's unseeded outputs follow from its seed.
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self.model_runner = EncoderDecoderModelRunner(self.model, self.backend, self.cache_engine,
                                                      self.input_batch, self.device,
                                                      generator=self.generator)
        if self.use_cuda_graphs:
            mc, bs = self.model_config, self.cache_engine.block_size
            self.model_runner.graphs = DecodeGraphs(
                self.model, self.cache_engine.gpu_cache, max_num_seqs=scheduler_config.max_num_seqs,
                max_model_len=mc.max_model_len, max_encoder_len=mc.max_encoder_len, block_size=bs,
                pad_slot=(self.cache_engine.gpu_cache[0].shape[1] - 1) * bs, device=self.device).capture()

    def validate_params(self, params: SamplingParams) -> None:
        """The logits processors' own checks of a request's params (ValueError)."""
        self.input_batch.logitsprocs.validate_params(params)

    def execute_model(self, metas: list[SequenceGroupMetadata], sched: SchedulerOutputs) -> AsyncModelRunnerOutput:
        """The step, returned once its kernels are queued; ``get_output()`` waits
        for them (``EncoderDecoderModelRunner.execute``)."""
        return self.model_runner.execute(metas, sched)

    def plan_step(self, metas: list[SequenceGroupMetadata], sched: SchedulerOutputs,
                  ahead: Collection[int]) -> StepPlan:
        """Pack a step on the host while the one before it runs (async scheduling);
        ``ahead``: the running step's sequences, whose tokens ``run_step`` writes in."""
        return self.model_runner.plan(metas, sched, ahead)

    def run_step(self, plan: StepPlan) -> AsyncModelRunnerOutput:
        """Queue a step ``plan_step`` packed, once the step before it was applied."""
        return self.model_runner.run(plan)
