"""Find a checkpoint (local directory or hub id) and stream its weights.

Hugging Face checkpoints (safetensors or ``pytorch_model.bin``) and CTranslate2
Whisper directories (``model.bin``) are both read here, tensor by tensor, so a
model never needs two copies of its weights in memory.
"""
from __future__ import annotations

import glob
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Checkpoint:
    path: str  # local directory
    hf_config: Any  # transformers PretrainedConfig
    generation_config: Any  # transformers GenerationConfig
    architecture: str
    format: str  # "hf" | "ct2"


def resolve_model_path(model: str) -> str:
    """A local directory as is; anything else is a hub id, downloaded once."""
    if os.path.isdir(model):
        return model
    if os.path.exists(model):
        raise ValueError(f"model {model!r} is a file; give the checkpoint's directory")
    if model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise ValueError(f"model directory {model!r} does not exist")
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(
            model, allow_patterns=["*.json", "*.safetensors", "*.bin", "*.txt", "*.model"],
            ignore_patterns=["*onnx*", "*.msgpack", "*.h5", "*tflite*"],
        )
    except Exception as e:  # network, auth, unknown repo
        raise ValueError(f"cannot load model {model!r}: not a local directory and the hub "
                         f"download failed ({type(e).__name__}: {e})") from e


def open_checkpoint(model: str | os.PathLike, *, tokenizer: str | os.PathLike | None = None) -> Checkpoint:
    """Configs of ``model``; ``tokenizer`` (default: the checkpoint's own) is read
    only where the model module must complete the generation config from it
    (Whisper ids a checkpoint's generation config lacks)."""
    from transformers import AutoConfig

    from encdec.models import ct2_loader
    from encdec.models.registry import get_model_hooks

    path = resolve_model_path(os.fspath(model))
    if ct2_loader.is_ct2_whisper_dir(path):
        hf_config, gen_config, _ = ct2_loader.load_ct2_whisper(path)
        return Checkpoint(path, hf_config, gen_config, "WhisperForConditionalGeneration", "ct2")
    if not os.path.exists(os.path.join(path, "config.json")):
        raise ValueError(f"{path!r} has no config.json: not a Hugging Face or CTranslate2 checkpoint")
    hf_config = AutoConfig.from_pretrained(path)
    archs = getattr(hf_config, "architectures", None) or []
    arch = archs[0] if archs else type(hf_config).__name__.replace("Config", "ForConditionalGeneration")
    gen_config = load_generation_config(path)
    complete = get_model_hooks(arch).complete_generation_config
    if complete is not None:
        complete(hf_config, gen_config, os.fspath(tokenizer) if tokenizer is not None else path)
    return Checkpoint(path, hf_config, gen_config, arch, "hf")


def load_generation_config(path: str):
    """The generation config HF's ``from_pretrained`` gives the model:
    ``generation_config.json``, else the generation fields of ``config.json``."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(path)
    except OSError:
        return GenerationConfig.from_pretrained(path, config_file_name="config.json", _from_model_config=True)


def iterate_weights(ckpt: Checkpoint) -> Iterator[tuple[str, torch.Tensor]]:
    if ckpt.format == "ct2":
        from encdec.models import ct2_loader

        yield from ct2_loader.load_ct2_whisper(ckpt.path)[2]
        return
    files = sorted(glob.glob(os.path.join(ckpt.path, "*.safetensors")))
    if files:
        from safetensors import safe_open

        for f in files:
            with safe_open(f, framework="pt") as st:
                for name in st.keys():
                    yield name, st.get_tensor(name)
        return
    files = sorted(glob.glob(os.path.join(ckpt.path, "pytorch_model*.bin")))
    if not files:
        raise ValueError(f"{ckpt.path!r} has no *.safetensors or pytorch_model*.bin weights")
    for f in files:
        yield from torch.load(f, map_location="cpu", weights_only=True).items()
