"""``EngineArgs``: the user's options, checked once, turned into frozen configs.

The fields are the options ``LLM`` takes and every command line offers
(``entrypoints.cli_options``): a field's comment is its documentation and its
``--help`` text, its metadata the command line's ``choices`` (and ``unit``:
"bytes" takes sizes like 512MiB), so an option is written once, here.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from encdec.config import QUANTIZATIONS, CacheConfig, LoadConfig, PreemptionMode
from encdec.spec_decode import SpeculativeConfig

_DTYPES = ("auto", "float32", "float16", "bfloat16", "half", "float")
# faster-whisper's / CTranslate2's compute_type -> our engine options (CPU)
COMPUTE_TYPES = {"float32": {"dtype": "float32"}, "bfloat16": {"dtype": "bfloat16"},
                 "int8": {"quantization": "int8"}}
# ... and the options a compute type sets where the caller left them "auto": int8
# keeps its K/V in bfloat16 (a decode step streams half the cross K/V bytes;
# WER measured equal, README), kv_cache_dtype="float32" keeps them float32.
COMPUTE_TYPE_DEFAULTS = {"int8": {"kv_cache_dtype": "bfloat16"}}


def compute_type_options(compute_type: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """``options`` (engine options; default none) with faster-whisper's
    ``compute_type`` applied; ValueError for an unknown one or one that
    contradicts ``dtype``/``quantization`` already set there."""
    if compute_type not in COMPUTE_TYPES:
        raise ValueError(f"compute_type must be one of {tuple(COMPUTE_TYPES)}, got {compute_type!r}")
    out = dict(options or {})
    for key, value in COMPUTE_TYPES[compute_type].items():
        if out.get(key) not in (None, "auto", value):
            raise ValueError(f"compute_type={compute_type!r} contradicts {key}={out[key]!r}")
        out[key] = value
    for key, value in COMPUTE_TYPE_DEFAULTS.get(compute_type, {}).items():
        if out.get(key) in (None, "auto"):
            out[key] = value
    return out


def speculative_config_of(spec: Any, async_scheduling: bool | None, model: str) -> SpeculativeConfig:
    """``EngineArgs.speculative_config`` checked, a draft against ``model`` too
    (configs and tokenizers: before any weight loads), and not with async
    scheduling (a step's drafts need the step before's tokens)."""
    config = SpeculativeConfig.from_dict(spec)
    if async_scheduling:
        raise ValueError("speculative_config and async_scheduling=True cannot be combined yet: "
                         "a step's drafts are proposed from the tokens of the step before")
    config.check_draft(model)
    return config


@dataclass
class EngineArgs:
    """The engine's options, as ``LLM(model, **options)`` takes them; each field's
    comment documents it (and is its ``--help`` text)."""

    model: str  # HF hub id or local checkpoint directory (a pathlib.Path is accepted)
    tokenizer: str | None = None  # tokenizer directory or hub id; default: the checkpoint's own
    # Weights and activations; auto: float32 on CPU; on CUDA bfloat16 for a bfloat16
    # checkpoint, else float16.
    dtype: str = field(default="auto", metadata={"choices": _DTYPES})
    # CPU, opt-in: int8 linears (weights per output channel, activations quantized on the
    # fly; encoder, decoder and LM head); default None: the weights as dtype says.
    quantization: str | None = field(default=None, metadata={"choices": QUANTIZATIONS})
    # KV cache type; auto: the model's dtype. bfloat16 also under float32 weights on CPU
    # (torch_sdpa backend: the C decode kernels widen it; half the bytes a decode step
    # reads), and compute_type int8's default.
    kv_cache_dtype: str = field(default="auto", metadata={"choices": ("auto", "float32", "bfloat16", "float16")})
    device: str = "auto"  # auto | cpu | cuda[:N]
    seed: int = 0  # seeds the engine's generator: unseeded random sampling follows from it
    block_size: int = 16  # token slots per KV block
    # Bytes of KV cache (on the command line also 512MiB, 2GiB, 1.5GB); default: sized
    # from gpu_memory_utilization on CUDA, from max_num_seqs and free memory on CPU.
    kv_cache_memory: int | None = field(default=None, metadata={"unit": "bytes"})
    gpu_memory_utilization: float = 0.9  # CUDA: the fraction of device memory for the KV cache
    swap_space: float = 4  # GiB of CPU memory for the KV blocks of preempted (swapped-out) requests
    max_num_seqs: int = 256  # decoder sequences running at once
    max_num_batched_tokens: int | None = None  # tokens of one step's prefills; default: max(32768, one request)
    max_model_len: int | None = None  # longest decoder sequence; default: the model's decoder positions
    # While sequences decode, admit waiting ones only once this many fit (fewer,
    # larger prefill steps); default: max_num_seqs // 8 where CUDA graphs replay
    # decode steps (a step with prefills runs eagerly), else 1 (whenever one fits).
    min_admission: int | None = None
    # Encoder input tokens the requests admitted in one step may run through the
    # encoder (encoder cache hits count 0; vLLM's name): a burst of arrivals has its
    # encoder passes spread over steps while running requests keep decoding. An input
    # larger than this runs its pass a piece a step (by layers; Whisper by rows of a
    # layer) while others run. Default None: no limit (serving Whisper on CPU: 375,
    # a layer of a 30 s window a step; docs/scheduler-budgets.md).
    max_num_encoder_input_tokens: int | None = None
    # What a preempted request gives up: swap (its KV blocks go to CPU) or recompute; default: swap.
    preemption_mode: str | None = field(default=None, metadata={"choices": ("swap", "recompute")})
    # Admission order: fcfs, or priority (generate(..., priority=[...]), smallest number first).
    scheduling_policy: str = field(default="fcfs", metadata={"choices": ("fcfs", "priority")})
    logits_processors: list[Any] | None = None  # custom logits processors: pkg.module:Class (or classes)
    # Attention implementation; default: torch_native on CUDA, torch_sdpa on CPU.
    attention_backend: str | None = field(default=None,
                                          metadata={"choices": ("torch_sdpa", "torch_native", "xformers")})
    enforce_eager: bool = False  # CUDA: run decode steps eagerly, without CUDA graphs (no effect on CPU)
    # Requests with the same encoder input share one encoder pass and cross-attention table.
    enable_encoder_cache: bool = True
    # Decoder prompt blocks are kept and reused by later requests with the same encoder
    # input and the same leading decoder tokens (n > 1, repeated requests, several
    # prompts over one document, Whisper's temperature fallback): those tokens' prefill
    # is skipped. Needs the encoder cache (its content key).
    enable_prefix_caching: bool = False
    # Decoder prompts longer than what is left of a step's max_num_batched_tokens
    # (after the running decodes, one token each) are prefilled over several steps
    # beside the decodes (vLLM's name); the budget then counts decoder tokens only
    # (the encoder's: max_num_encoder_input_tokens), so set it to split (e.g. 256; its
    # default, max(32768, one request), sizes the CUDA profile run's step as without
    # chunks). Beam search, n/best_of > 1 and prompt log-prob requests prefill whole.
    enable_chunked_prefill: bool = False
    # Schedule and pack step N+1 on the host while step N runs on the device, so
    # the device does not wait for the host between steps; default: on for CUDA
    # (a CPU step is synchronous: nothing to overlap), off on CPU.
    async_scheduling: bool | None = None
    # Speculative decoding, vLLM's dict (or its JSON): {"method": "ngram",
    # "num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": m}
    # (encdec.spec_decode.SpeculativeConfig); checked here, before anything loads.
    speculative_config: dict[str, Any] | str | SpeculativeConfig | None = field(default=None,
                                                                                metadata={"form": "json"})
    # CPU threads for torch, set process-wide by LLM (configure_cpu_runtime; LLMEngine
    # never changes process state); default: leave the process's setting.
    num_threads: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.model, os.PathLike):
            self.model = os.fspath(self.model)
        if isinstance(self.tokenizer, os.PathLike):
            self.tokenizer = os.fspath(self.tokenizer)
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a hub id or a local directory, got {self.model!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(f"quantization must be None or {' or '.join(map(repr, QUANTIZATIONS))}, "
                             f"got {self.quantization!r}")
        if self.kv_cache_dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"kv_cache_dtype must be auto, float32, bfloat16 or float16, got {self.kv_cache_dtype!r}")
        if self.device != "auto" and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.preemption_mode not in (None, "swap", "recompute"):
            raise ValueError(f"preemption_mode must be 'swap' or 'recompute', got {self.preemption_mode!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.num_threads is not None and (isinstance(self.num_threads, bool)
                                             or not isinstance(self.num_threads, int) or self.num_threads < 1):
            raise ValueError(f"num_threads must be a positive int or None, got {self.num_threads!r}")
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs!r}")
        if self.min_admission is not None and (isinstance(self.min_admission, bool)
                                               or not isinstance(self.min_admission, int) or self.min_admission < 1):
            raise ValueError(f"min_admission must be a positive int or None, got {self.min_admission!r}")
        if self.max_num_encoder_input_tokens is not None and (
                isinstance(self.max_num_encoder_input_tokens, bool)
                or not isinstance(self.max_num_encoder_input_tokens, int) or self.max_num_encoder_input_tokens < 1):
            raise ValueError("max_num_encoder_input_tokens must be a positive int or None, "
                             f"got {self.max_num_encoder_input_tokens!r}")
        if not isinstance(self.enable_chunked_prefill, bool):
            raise ValueError(f"enable_chunked_prefill must be True or False, got {self.enable_chunked_prefill!r}")
        if self.enable_prefix_caching and not self.enable_encoder_cache:
            raise ValueError("enable_prefix_caching needs enable_encoder_cache: a decoder block is "
                             "found again by its encoder input's content key")
        if self.speculative_config is not None:
            self.speculative_config = speculative_config_of(self.speculative_config, self.async_scheduling,
                                                           self.model)
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be True, False or None, got {self.async_scheduling!r}")
        # Cache options are validated by CacheConfig itself.
        self.cache_config()

    def cache_config(self) -> CacheConfig:
        return CacheConfig(
            block_size=self.block_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            swap_space=self.swap_space,
            cache_dtype=self.kv_cache_dtype,
            kv_cache_memory=self.kv_cache_memory,
            enable_encoder_cache=self.enable_encoder_cache,
            enable_prefix_caching=self.enable_prefix_caching,
        )

    def load_config(self) -> LoadConfig:
        return LoadConfig(
            model=self.model, tokenizer=self.tokenizer, dtype=self.dtype, device=self.device,
            seed=self.seed, max_model_len=self.max_model_len,
            attention_backend=self.attention_backend, enforce_eager=self.enforce_eager,
            quantization=self.quantization,
        )

    def preemption(self) -> PreemptionMode | None:
        return PreemptionMode(self.preemption_mode) if self.preemption_mode else None
