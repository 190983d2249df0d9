"""``EngineArgs``: the user's options, checked once, turned into frozen configs."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from encdec.config import CacheConfig, PreemptionMode

_DTYPES = ("auto", "float32", "float16", "bfloat16", "half", "float")


@dataclass
class EngineArgs:
    model: str  # hub id or local directory (a pathlib.Path is accepted)
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    block_size: int = 16
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    swap_space: float = 4
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    preemption_mode: str | None = None
    scheduling_policy: str = "fcfs"
    logits_processors: list[Any] | None = None
    attention_backend: str | None = None
    enforce_eager: bool = False
    # Requests with the same encoder input share one cross-attention table and
    # one encoder pass (API.md "Encoder cache").
    enable_encoder_cache: bool = True
    # CPU torch threads, process-wide: applied by ``LLM`` (configure_cpu_runtime);
    # LLMEngine itself never changes process state. None = leave as is.
    num_threads: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.model, os.PathLike):
            self.model = os.fspath(self.model)
        if isinstance(self.tokenizer, os.PathLike):
            self.tokenizer = os.fspath(self.tokenizer)
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a hub id or a local directory, got {self.model!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
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
        # Cache options are validated by CacheConfig itself.
        self.cache_config()

    def cache_config(self) -> CacheConfig:
        return CacheConfig(
            block_size=self.block_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            swap_space=self.swap_space,
            kv_cache_memory=self.kv_cache_memory,
            enable_encoder_cache=self.enable_encoder_cache,
        )

    def preemption(self) -> PreemptionMode | None:
        return PreemptionMode(self.preemption_mode) if self.preemption_mode else None
