"""``LLMEngine``: requests in, one scheduled forward per ``step()``, outputs out.

    seq_group_metadata, scheduler_outputs = self.scheduler.schedule()
    output = self.model_runner.execute(seq_group_metadata, ...)
    return self._process_outputs(output, scheduler_outputs)
"""
from __future__ import annotations

import itertools
import logging
import os
import time
from typing import Any

import torch

from encdec.attention.selector import get_attn_backend
from encdec.beam_search.manager import BeamSearchManager
from encdec.beam_search.params import BeamSearchParams
from encdec.beam_search.rows import BeamRowParams
from encdec.config import ModelConfig, SchedulerConfig
from encdec.core.scheduler import Scheduler, SchedulerOutputs
from encdec.engine.arg_utils import EngineArgs
from encdec.engine.stop_checker import StopChecker
from encdec.inputs import InputPreprocessor, PromptType
from encdec.models.layers import pack_linears
from encdec.models.loader import iterate_weights, open_checkpoint
from encdec.models.registry import get_model_cls, get_model_module
from encdec.outputs import Detokenizer, RequestOutput
from encdec.sample.logits_processor import build_logitsprocs, resolve_logitsproc_class
from encdec.sampling_params import SamplingParams
from encdec.sequence import Sequence, SequenceGroup, SequenceStatus
from encdec.worker.cache_engine import CacheEngine, cache_block_bytes, default_kv_cache_bytes
from encdec.worker.enc_dec_model_runner import EncoderDecoderModelRunner, ModelRunnerOutput
from encdec.worker.host_allocator import retain_freed_memory
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


class _EngineConfig:
    """What logits processors see: ``scheduler_config`` and ``model_config``."""

    def __init__(self, scheduler_config: SchedulerConfig, model_config: ModelConfig, generation_config):
        self.scheduler_config = scheduler_config
        self.model_config = model_config
        self.generation_config = generation_config


class LLMEngine:
    def __init__(self, args: EngineArgs):
        self.args = args
        self.device = _resolve_device(args.device)
        if self.device.type == "cpu":
            retain_freed_memory()
            torch.set_num_threads(args.num_threads or int(os.environ.get("ENCDEC_NUM_THREADS", "0"))
                                  or torch.get_num_threads())
        ckpt = open_checkpoint(args.model)
        self.checkpoint = ckpt
        module = get_model_module(ckpt.architecture)
        self.model_module = module
        hf_config, gen_config = ckpt.hf_config, ckpt.generation_config
        self.hf_config, self.generation_config = hf_config, gen_config
        self.tokenizer = self._load_tokenizer(module, args.tokenizer or ckpt.path)
        self.dtype = _resolve_dtype(args.dtype, self.device, hf_config)
        max_dec = getattr(hf_config, "max_target_positions", None) or hf_config.max_position_embeddings
        max_enc = getattr(hf_config, "max_source_positions", None) or hf_config.max_position_embeddings
        if args.max_model_len is not None:
            if args.max_model_len > max_dec:
                raise ValueError(f"max_model_len={args.max_model_len} exceeds the model's "
                                 f"{max_dec} decoder positions")
            max_dec = args.max_model_len
        self.model_config = ModelConfig(
            model=args.model, tokenizer=args.tokenizer, dtype=str(self.dtype).removeprefix("torch."),
            seed=args.seed, architecture=ckpt.architecture, hf_config=hf_config,
            max_model_len=max_dec, max_encoder_len=max_enc, enforce_eager=args.enforce_eager)
        torch.manual_seed(args.seed)

        # Model.
        self.backend = get_attn_backend(args.attention_backend, self.device.type)
        model_cls = get_model_cls(ckpt.architecture)
        with torch.device("meta"):
            model = model_cls(hf_config, self.backend)
        model = model.to_empty(device="cpu").to(torch.float32)
        for buf in model.buffers():  # buffers a checkpoint may omit start at zero
            buf.zero_()
        model.load_weights(iterate_weights(ckpt))
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        num_packed = pack_linears(self.model)  # CPU float32: oneDNN, see encdec/models/layers.py
        logger.info("prepacked %d linear layers for oneDNN", num_packed)
        self.vocab_size = model.vocab_size

        # KV cache.
        cache_cfg = args.cache_config()
        block_bytes = cache_block_bytes(model.num_cache_layers, cache_cfg.block_size,
                                        model.num_kv_heads, model.head_size, self.dtype)
        kv_bytes = cache_cfg.kv_cache_memory or default_kv_cache_bytes(
            self.device, cache_cfg.gpu_memory_utilization)
        cache_cfg.num_gpu_blocks = kv_bytes // block_bytes
        if cache_cfg.num_gpu_blocks < 1:
            raise ValueError(f"kv_cache_memory={kv_bytes} bytes holds no KV block "
                             f"(one block is {block_bytes} bytes)")
        cache_cfg.num_cpu_blocks = int(cache_cfg.swap_space * _GiB) // block_bytes
        logger.info("KV cache: %d device blocks, %d CPU swap blocks of %d tokens (%.1f MiB each)",
                    cache_cfg.num_gpu_blocks, cache_cfg.num_cpu_blocks, cache_cfg.block_size,
                    block_bytes / 2**20)
        self.cache_config = cache_cfg
        self.scheduler_config = SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens or max(32768, max_dec + max_enc),
            max_num_seqs=args.max_num_seqs, max_model_len=max_dec, max_encoder_len=max_enc,
            preemption_mode=args.preemption(), policy=args.scheduling_policy)
        self.scheduler = Scheduler(self.scheduler_config, cache_cfg)
        self.cache_engine = CacheEngine(
            num_layers=model.num_cache_layers, num_kv_heads=model.num_kv_heads,
            head_size=model.head_size, block_size=cache_cfg.block_size,
            num_gpu_blocks=cache_cfg.num_gpu_blocks, num_cpu_blocks=cache_cfg.num_cpu_blocks,
            dtype=self.dtype, device=self.device, backend=self.backend)

        # Sampling.
        pin = self.device.type == "cuda"
        model_procs = list(getattr(module, "logits_processors", lambda: [])())
        user_procs = [resolve_logitsproc_class(p) for p in (args.logits_processors or [])]
        self.processor_classes = model_procs + user_procs
        self.processor_config = _EngineConfig(self.scheduler_config, self.model_config, gen_config)
        logitsprocs = build_logitsprocs(self.processor_config, self.device, pin, self.processor_classes)
        self.input_batch = InputBatch(max_num_reqs=args.max_num_seqs, vocab_size=self.vocab_size,
                                      device=self.device, logitsprocs=logitsprocs, is_pin_memory=pin)
        self.model_runner = EncoderDecoderModelRunner(self.model, self.backend, self.cache_engine,
                                                      self.input_batch, self.device)

        # Requests.
        dec_start = hf_config.decoder_start_token_id
        default_prompt = module.default_decoder_prompt(hf_config, gen_config, self.tokenizer)
        audio = getattr(module, "make_audio_processor", None)
        prepare = getattr(module, "prepare_decoder_prompt", None)
        self.input_preprocessor = InputPreprocessor(
            self.tokenizer, dec_start, lambda: list(default_prompt),
            audio(hf_config) if audio else None,
            (lambda ids: prepare(ids, gen_config)) if prepare else None)
        eos = gen_config.eos_token_id if gen_config.eos_token_id is not None else hf_config.eos_token_id
        self.eos_token_id = eos[0] if isinstance(eos, list) else eos
        self.detokenizer = Detokenizer(self.tokenizer)
        self.stop_checker = StopChecker(max_dec)
        self.seq_counter = itertools.count()
        self.request_counter = itertools.count()
        self.groups: dict[str, SequenceGroup] = {}
        self.beam_search = BeamSearchManager(self.scheduler.free_seq, self.seq_counter, self.tokenizer,
                                             self.scheduler.block_manager.fork)
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0

    @staticmethod
    def _load_tokenizer(module, path: str):
        loader = getattr(module, "load_tokenizer", None)
        if loader is not None:
            return loader(path)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)

    # -- requests ----------------------------------------------------------------
    def process_request(self, prompt: PromptType, params: SamplingParams | None, *,
                        truncation: bool = False) -> tuple[dict, SamplingParams]:
        """Validate and tokenize one request without touching engine state, so a
        bad request in a batch is refused before any of the batch is queued.
        ``truncation``: cut an encoder prompt longer than the model's positions as
        HF's ``tokenizer(truncation=True)`` does (its final eos kept) instead of refusing it."""
        if params is None:
            params = SamplingParams()
        if isinstance(params, BeamSearchParams):  # beam search: its rows run greedy params
            params = BeamRowParams.from_beam_params(params)
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        if params.bad_words:
            params = params.clone()
            params.update_from_tokenizer(self.tokenizer)
        params.verify_against(self.vocab_size)
        self.input_batch.logitsprocs.validate_params(params)
        inputs = self.input_preprocessor.process(prompt)
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
        bad = [t for t in inputs["encoder_prompt_token_ids"] + inputs["prompt_token_ids"]
               if not 0 <= t < self.vocab_size]
        if bad and "encoder_features" not in inputs:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary (size {self.vocab_size})")
        params = params.clone()
        params.update_from_generation_config({"eos_token_id": self.generation_config.eos_token_id},
                                             self.eos_token_id)
        if params.max_tokens is None or dec_len + params.max_tokens > cfg.max_model_len:
            params.max_tokens = cfg.max_model_len - dec_len
        return inputs, params

    def add_processed_request(self, request_id: str, inputs: dict, params: SamplingParams,
                              arrival_time: float | None = None, priority: int = 0) -> None:
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        block_size = self.cache_config.block_size
        seqs = []
        for i in range(params.best_of):
            seq = Sequence(next(self.seq_counter), inputs, block_size, self.eos_token_id)
            seq.data.sample_index = i
            seqs.append(seq)
        encoder_seq = Sequence(seqs[0].seq_id, inputs, block_size, from_decoder_prompt=False)
        group = SequenceGroup(request_id, seqs, arrival_time or time.time(), params,
                              encoder_seq=encoder_seq, priority=priority)
        self.groups[request_id] = group
        if self.beam_search.is_beam_group(group):
            self.beam_search.add_group(group)
        self.scheduler.add_seq_group(group)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        inputs, params = self.process_request(prompt, params)
        self.add_processed_request(request_id, inputs, params, arrival_time, priority)

    def abort_request(self, request_id: str | list[str]) -> None:
        for group in self.scheduler.abort_seq_group(request_id):
            self.groups.pop(group.request_id, None)
            self.beam_search.forget(group.request_id)

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
