"""Engine configuration, built once by ``EngineArgs`` and passed explicitly.

Every config rejects values a user could get wrong with a ``ValueError`` naming
the field. Bookkeeping modules read these; nothing here imports torch.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class PreemptionMode(enum.Enum):
    SWAP = "swap"
    RECOMPUTE = "recompute"


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    # Tokens of one step: decoder + encoder tokens of its prefills; with chunked
    # prefill, decoder tokens of its prefill chunks and decodes (one per row).
    max_num_batched_tokens: int
    max_num_seqs: int  # decoder sequences running at once
    max_model_len: int  # longest decoder sequence (prompt + output)
    max_encoder_len: int | None = None  # longest encoder prompt; None = max_model_len
    preemption_mode: PreemptionMode | None = None  # None: swap (encoder/decoder default)
    policy: str = "fcfs"  # "fcfs" | "priority"
    # While sequences decode, admit waiting ones only once this many fit (or all
    # that wait): fewer, larger prefill steps. 1 admits whenever one fits.
    min_admission: int = 1
    # Encoder input tokens the waiting requests admitted in one step may run
    # through the encoder (encoder cache hits count 0), so a burst of arrivals
    # spreads its encoder passes over steps beside running decodes. A larger
    # input runs its pass in pieces across steps while others run
    # (encdec.core.encoder_split), else whole, alone in its step. None: no limit.
    max_num_encoder_input_tokens: int | None = None
    # Decoder prompts are split under max_num_batched_tokens across steps.
    enable_chunked_prefill: bool = False
    # The model's encoder, for splitting a pass larger than the encoder budget
    # across steps while others decode (encdec.core.encoder_split): its layers
    # (0: never split, such a pass runs whole, alone), and the rows of a layer a
    # piece may stop between (None: whole layers only).
    encoder_layers: int = 0
    encoder_row_granule: int | None = None

    def __post_init__(self) -> None:
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_model_len", self.max_model_len)
        _positive("min_admission", self.min_admission)
        if self.max_num_encoder_input_tokens is not None:
            _positive("max_num_encoder_input_tokens", self.max_num_encoder_input_tokens)
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")


@dataclass
class CacheConfig:
    block_size: int = 16  # token slots per KV block
    gpu_memory_utilization: float = 0.9  # fraction of device memory for KV (CUDA)
    swap_space: float = 4  # GiB of CPU memory for swapped-out KV blocks
    cache_dtype: str = "auto"
    kv_cache_memory: int | None = None  # bytes of device KV; overrides the fraction
    sliding_window: int | None = None
    enable_prefix_caching: bool = False
    enable_encoder_cache: bool = True  # share cross tables between equal encoder inputs
    # Set by the engine after sizing the cache.
    num_gpu_blocks: int | None = None
    num_cpu_blocks: int | None = None
    num_warm_gpu_blocks: int | None = None  # written at start (CPU prefault; all on CUDA)
    # bytes of the budget a CPU self-draft's bfloat16 copy of its rows' K/V may take (DraftKV);
    # the device blocks above hold the rest; 0: no copy
    draft_kv_bytes: int = 0

    def __post_init__(self) -> None:
        _positive("block_size", self.block_size)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")
        if self.kv_cache_memory is not None:
            _positive("kv_cache_memory", self.kv_cache_memory)


@dataclass(frozen=True)
class ModelConfig:
    model: str  # local directory or hub id
    tokenizer: str | None
    dtype: str  # resolved torch dtype name: "float32" | "float16" | "bfloat16"
    seed: int
    architecture: str  # e.g. "BartForConditionalGeneration"
    hf_config: Any = field(repr=False, default=None)
    max_model_len: int = 1024
    max_encoder_len: int = 1024
    # CUDA: decode steps run eagerly, not replayed from CUDA graphs; no effect on CPU.
    enforce_eager: bool = False
    generation_config: Any = field(repr=False, default=None)  # transformers GenerationConfig
    checkpoint_path: str | None = None  # the local directory ``model`` resolved to


QUANTIZATIONS = ("int8",)  # LoadConfig.quantization's values besides None (encdec.quantization runs them)


@dataclass(frozen=True)
class LoadConfig:
    """What the worker needs to put a model on a device (``EngineArgs.load_config()``)."""

    model: str  # local directory or hub id
    tokenizer: str | None  # None: the checkpoint's own
    dtype: str  # as asked: "auto" or a dtype name; the worker resolves it
    device: str  # "auto" | "cpu" | "cuda[:N]"
    seed: int
    max_model_len: int | None  # None: the model's decoder positions
    attention_backend: str | None  # None: the selector's choice for the device
    enforce_eager: bool  # CUDA: decode steps without CUDA graphs (no effect on CPU)
    quantization: str | None = None  # None or one of QUANTIZATIONS ("int8": int8 linears on CPU)
