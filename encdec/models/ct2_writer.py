"""Writers for the CTranslate2 Whisper format: HF tensors -> ``model.bin`` (the
round-trip tests) and a CT2 directory -> an HF checkpoint directory (so that
``transformers`` loads the very same weights in parity tests and benchmarks)."""
from __future__ import annotations

import os
import struct

import numpy as np
import torch

__all__ = ["hf_to_ct2", "save_as_hf", "write_model_bin"]

from encdec.models.ct2_loader import (
    BINARY_VERSION, DTYPES, load_ct2_tokenizer, load_ct2_whisper,
)


def save_as_hf(path_ct2: str | os.PathLike, out_dir: str | os.PathLike) -> str:
    """Write an HF checkpoint directory with the same weights, so that
    ``transformers`` can load them for parity tests."""
    from safetensors.torch import save_file
    from transformers import WhisperFeatureExtractor, WhisperProcessor

    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    hf_config, gen_config, weights = load_ct2_whisper(path_ct2)
    tensors = {name: t.contiguous() for name, t in weights}
    tensors.pop("proj_out.weight", None)  # tied to model.decoder.embed_tokens.weight
    hf_config.architectures = ["WhisperForConditionalGeneration"]
    hf_config.save_pretrained(out_dir)
    gen_config.save_pretrained(out_dir)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    fe = WhisperFeatureExtractor(feature_size=hf_config.num_mel_bins)
    WhisperProcessor(feature_extractor=fe, tokenizer=load_ct2_tokenizer(path_ct2)).save_pretrained(out_dir)
    fe.save_pretrained(out_dir)  # preprocessor_config.json, for loaders that look for it alone
    return out_dir


def hf_to_ct2(state_dict: dict[str, torch.Tensor], hf_config) -> dict[str, np.ndarray | str]:
    """HF Whisper tensors -> CT2 variables (as the CT2 converter lays them out, with
    float16 weights and ``decoder/projection/weight`` aliased to the embeddings).
    The inverse of the reader, for round-trip tests and for writing CT2 files."""
    sd = {k.removeprefix("model."): v.detach().float() for k, v in state_dict.items()}
    f16 = lambda t: t.to(torch.float16).numpy()  # noqa: E731
    out: dict[str, np.ndarray | str] = {}

    def lin(dst: str, srcs: list[str]) -> None:
        out[f"{dst}/weight"] = f16(torch.cat([sd[f"{s}.weight"] for s in srcs]))
        out[f"{dst}/bias"] = f16(torch.cat([sd.get(f"{s}.bias", torch.zeros(sd[f"{s}.weight"].shape[0]))
                                            for s in srcs]))

    def ln(dst: str, src: str) -> None:
        out[f"{dst}/gamma"], out[f"{dst}/beta"] = f16(sd[f"{src}.weight"]), f16(sd[f"{src}.bias"])

    for side, n, nh in (("encoder", hf_config.encoder_layers, hf_config.encoder_attention_heads),
                        ("decoder", hf_config.decoder_layers, hf_config.decoder_attention_heads)):
        out[f"{side}/position_encodings/encodings"] = f16(sd[f"{side}.embed_positions.weight"])
        ln(f"{side}/layer_norm", f"{side}.layer_norm")
        out[f"{side}/num_heads"] = np.array(nh, dtype=np.int16)
        for i in range(n):
            src, dst = f"{side}.layers.{i}", f"{side}/layer_{i}"
            a = f"{src}.self_attn"
            lin(f"{dst}/self_attention/linear_0", [f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj"])
            lin(f"{dst}/self_attention/linear_1", [f"{a}.out_proj"])
            ln(f"{dst}/self_attention/layer_norm", f"{src}.self_attn_layer_norm")
            if side == "decoder":
                c = f"{src}.encoder_attn"
                lin(f"{dst}/attention/linear_0", [f"{c}.q_proj"])
                lin(f"{dst}/attention/linear_1", [f"{c}.k_proj", f"{c}.v_proj"])
                lin(f"{dst}/attention/linear_2", [f"{c}.out_proj"])
                ln(f"{dst}/attention/layer_norm", f"{src}.encoder_attn_layer_norm")
            lin(f"{dst}/ffn/linear_0", [f"{src}.fc1"])
            lin(f"{dst}/ffn/linear_1", [f"{src}.fc2"])
            ln(f"{dst}/ffn/layer_norm", f"{src}.final_layer_norm")
    for k in ("conv1", "conv2"):
        out[f"encoder/{k}/weight"] = f16(sd[f"encoder.{k}.weight"])
        out[f"encoder/{k}/bias"] = f16(sd[f"encoder.{k}.bias"])
    out["decoder/embeddings/weight"] = f16(sd["decoder.embed_tokens.weight"])
    out["decoder/projection/weight"] = "decoder/embeddings/weight"  # alias: tied
    out["decoder/activation"] = np.array(3, dtype=np.int8)  # GELU
    out["decoder/pre_norm"] = np.array(1, dtype=np.int8)
    out["decoder/scale_embeddings"] = np.array(0, dtype=np.int8)
    return out


def write_model_bin(path: str | os.PathLike, variables: dict[str, np.ndarray | str],
                    spec: str = "WhisperSpec", revision: int = 3) -> None:
    """Serialize as CT2 does: sorted variables, then aliases (string values)."""
    ids = {np.dtype(v[0]).name: k for k, v in DTYPES.items() if v[1] != "bfloat16"}

    def string(s: str) -> bytes:
        b = s.encode("utf-8")
        return struct.pack("<H", len(b) + 1) + b + b"\0"

    real = sorted((k, v) for k, v in variables.items() if not isinstance(v, str))
    aliases = sorted((k, v) for k, v in variables.items() if isinstance(v, str))
    with open(path, "wb") as f:
        f.write(struct.pack("<I", BINARY_VERSION) + string(spec) + struct.pack("<II", revision, len(real)))
        for name, arr in real:
            arr = np.asarray(arr)
            arr = arr if arr.flags.c_contiguous else arr.copy()  # (ascontiguousarray makes 0-d 1-d)
            f.write(string(name) + struct.pack("<B", arr.ndim) + struct.pack(f"<{arr.ndim}I", *arr.shape))
            f.write(struct.pack("<BI", ids[arr.dtype.name], arr.nbytes) + arr.tobytes())
        f.write(struct.pack("<I", len(aliases)))
        for alias, target in aliases:
            f.write(string(alias) + string(target))
