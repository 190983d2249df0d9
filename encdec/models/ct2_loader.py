"""CTranslate2 Whisper checkpoints (faster-whisper's format) -> HF names and configs.

A CT2 model directory holds ``model.bin``, ``config.json`` (suppress ids,
language ids, alignment heads), ``vocabulary.txt`` (one token a line, timestamps
included) and usually ``tokenizer.json``. ``model.bin`` (binary version 6)::

    u32 version | str spec name | u32 revision | u32 num variables
    per variable: str name | u8 rank | rank x u32 dims | u8 dtype | u32 nbytes | bytes
    u32 num aliases | (str alias, str target) ...
    str = u16 length (counting a trailing NUL) | utf-8 bytes | NUL

CT2 fuses self-attention q/k/v into ``linear_0`` and cross-attention k/v into
``linear_1``; Whisper's ``k_proj`` has no bias, so CT2 stores zeros there, which
we drop. Quantized weights (int8/int16 with ``weight_scale``) are dequantized.
The layout map lives in ``ct2_layout`` so that the writer (tests' round trip)
and the reader share it.
"""
from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Iterator

import numpy as np
import torch

__all__ = ["is_ct2_whisper_dir", "load_ct2_whisper", "read_model_bin", "load_ct2_tokenizer",
           "generation_config_from_ct2"]

BINARY_VERSION = 6
# CT2 dtype id -> (numpy dtype used to read the bytes, CT2 name)
DTYPES = {0: ("float32", "float32"), 1: ("int8", "int8"), 2: ("int16", "int16"),
          3: ("int32", "int32"), 4: ("float16", "float16"), 5: ("uint16", "bfloat16")}
# Spec scalars: options CT2 stores with the weights. Each known one -> the values
# under which Whisper's architecture (what we run) holds; None: any value (heads,
# alignment heads, and ALiBi's modifiers, which mean nothing while ALiBi is off).
# Older converters omit the ALiBi modifiers; a scalar not listed here is refused.
SCALARS: dict[str, tuple[int, ...] | None] = {
    "decoder/activation": (3,),  # GELU
    "decoder/alibi": (0,),  # learned positions, no ALiBi
    "decoder/alibi_use_positive_positions": None,
    "decoder/scale_alibi": None,
    "decoder/alignment_heads": None,
    "decoder/alignment_layer": None,
    "decoder/num_heads": None,
    "decoder/pre_norm": (1,),
    "decoder/scale_embeddings": (0,),  # token embeddings not scaled by sqrt(d)
    "decoder/start_from_zero_embedding": (0,),
    "encoder/num_heads": None,
}


def is_ct2_whisper_dir(path: str | os.PathLike) -> bool:
    """True for a directory with a CT2 ``model.bin`` whose spec is Whisper (reads ~100 bytes)."""
    path = os.fspath(path)
    bin_path = os.path.join(path, "model.bin")
    if not os.path.isfile(bin_path) or not os.path.isfile(os.path.join(path, "config.json")):
        return False
    try:
        with open(bin_path, "rb") as f:
            head = f.read(64)
        (version,) = struct.unpack_from("<I", head, 0)
        (n,) = struct.unpack_from("<H", head, 4)
        return version == BINARY_VERSION and head[6: 6 + n - 1] == b"WhisperSpec"
    except struct.error:
        return False


class _Reader:
    def __init__(self, buf, path: str):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int):
        if self.pos + n > len(self.buf):
            raise ValueError(f"{self.path}: truncated at byte {self.pos} (needs {n} more bytes, "
                             f"file has {len(self.buf)})")
        start, self.pos = self.pos, self.pos + n
        return start

    def unpack(self, fmt: str):
        start = self.take(struct.calcsize(fmt))
        return struct.unpack_from(fmt, self.buf, start)[0]

    def string(self) -> str:
        n = self.unpack("<H")
        start = self.take(n)
        if n == 0 or self.buf[start + n - 1] != 0:
            raise ValueError(f"{self.path}: malformed string at byte {start}")
        return bytes(self.buf[start: start + n - 1]).decode("utf-8")


def read_model_bin(path: str | os.PathLike) -> tuple[str, int, dict[str, np.ndarray | torch.Tensor]]:
    """``model.bin`` -> (spec name, revision, {name: array}), aliases resolved.

    Arrays are zero-copy views over a read-only mmap (bfloat16 as torch tensors,
    since numpy has no bfloat16); callers copy what they keep.
    """
    path = os.fspath(path)
    with open(path, "rb") as f:
        try:
            buf = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
        except ValueError as e:  # empty file
            raise ValueError(f"{path}: empty file, not a CTranslate2 model ({e})") from None
    r = _Reader(buf, path)
    version = r.unpack("<I")
    if version != BINARY_VERSION:
        raise ValueError(f"{path}: CTranslate2 binary version {version} is not supported "
                         f"(expected {BINARY_VERSION}); is this a CTranslate2 model.bin?")
    spec, revision = r.string(), r.unpack("<I")
    variables: dict[str, np.ndarray | torch.Tensor] = {}
    for _ in range(r.unpack("<I")):
        name = r.string()
        dims = [r.unpack("<I") for _ in range(r.unpack("<B"))]
        dtype_id, nbytes = r.unpack("<B"), r.unpack("<I")
        if dtype_id not in DTYPES:
            raise ValueError(f"{path}: variable {name!r} has unknown dtype id {dtype_id}")
        np_dtype = np.dtype(DTYPES[dtype_id][0])
        count = int(np.prod(dims)) if dims else 1
        if count * np_dtype.itemsize != nbytes:
            raise ValueError(f"{path}: variable {name!r} has {nbytes} bytes, shape {dims} "
                             f"of {DTYPES[dtype_id][1]} needs {count * np_dtype.itemsize}")
        start = r.take(nbytes)
        arr = np.frombuffer(buf, dtype=np_dtype, count=count, offset=start).reshape(dims)
        if DTYPES[dtype_id][1] == "bfloat16":
            arr = torch.from_numpy(arr.copy()).view(torch.bfloat16)
        variables[name] = arr
    for _ in range(r.unpack("<I")):
        alias, target = r.string(), r.string()
        if target not in variables:
            raise ValueError(f"{path}: alias {alias!r} points at missing variable {target!r}")
        variables[alias] = variables[target]
    if r.pos != len(buf):
        raise ValueError(f"{path}: {len(buf) - r.pos} trailing bytes after the aliases")
    return spec, revision, variables


def _to_float(variables: dict, name: str) -> torch.Tensor:
    """float32 copy; int8/int16 weights divided by their ``weight_scale``."""
    v = variables[name]
    t = v if isinstance(v, torch.Tensor) else torch.from_numpy(np.array(v))
    if t.dtype in (torch.int8, torch.int16):
        scale_name = name.removesuffix("weight") + "weight_scale"
        if scale_name not in variables:
            raise ValueError(f"quantized variable {name!r} has no {scale_name!r}")
        scale = torch.from_numpy(np.array(variables[scale_name])).float()
        return t.float() / (scale[:, None] if scale.ndim == 1 else scale)
    return t.float()


def _read_config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def _read_vocabulary(path: str) -> list[str]:
    vocab_path = os.path.join(path, "vocabulary.txt")
    if os.path.isfile(vocab_path):
        with open(vocab_path, encoding="utf-8") as f:
            return f.read().split("\n")
    json_path = os.path.join(path, "vocabulary.json")
    if os.path.isfile(json_path):
        with open(json_path, encoding="utf-8") as f:
            return json.load(f)
    raise ValueError(f"{path}: no vocabulary.txt or vocabulary.json")


def load_ct2_whisper(path: str | os.PathLike):
    """A CT2 Whisper directory -> ``(WhisperConfig, GenerationConfig, iterator of (hf_name, float32 tensor))``.

    The iterator converts one tensor at a time so that large-v3 never needs two
    float32 copies of the model in memory.
    """
    path = os.fspath(path)
    if not is_ct2_whisper_dir(path):
        raise ValueError(f"{path} is not a CTranslate2 Whisper directory "
                         "(needs model.bin with spec WhisperSpec and config.json)")
    spec, _revision, variables = read_model_bin(os.path.join(path, "model.bin"))
    if spec != "WhisperSpec":
        raise ValueError(f"{path}: spec {spec!r} is not WhisperSpec")
    unknown = [n for n in variables if ct2_to_hf(n) is None and n not in SCALARS
               and not n.endswith("weight_scale")]
    if unknown:
        raise ValueError(f"{path}: variables this loader does not understand: {unknown[:5]}")
    for name, allowed in SCALARS.items():
        if allowed is not None and name in variables:
            value = int(np.asarray(variables[name]).reshape(-1)[0])
            if value not in allowed:
                raise ValueError(f"{path}: {name} = {value} is not Whisper's architecture "
                                 f"(this loader runs {name} in {list(allowed)})")
    shapes = {n: tuple(v.shape) for n, v in variables.items()}
    heads = {side: int(np.asarray(variables[f"{side}/num_heads"]).reshape(-1)[0]) for side in ("encoder", "decoder")}
    ct2_cfg = _read_config(path)
    vocab = _read_vocabulary(path)
    hf_config = whisper_config_from_shapes(shapes, heads, vocab, ct2_cfg)
    gen_config = generation_config_from_ct2(hf_config, ct2_cfg, vocab)

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for name in sorted(variables):
            target = ct2_to_hf(name)
            if target is None:
                continue
            if name == "decoder/projection/weight" and \
                    variables[name] is variables.get("decoder/embeddings/weight"):
                continue  # an alias: proj_out is tied to the embeddings
            tensor = _to_float(variables, name)
            yield from target(tensor)

    return hf_config, gen_config, weights()


def generation_config_from_ct2(hf_config, ct2_cfg: dict, vocab: list[str]):
    """The ``GenerationConfig`` HF ships for the same checkpoint (openai/whisper-*),
    rebuilt from CT2's config.json and the vocabulary."""
    from transformers import GenerationConfig

    from encdec.models.whisper_tokens import WhisperSpecialTokens, special_token_ids

    gc = GenerationConfig(
        alignment_heads=[list(h) for h in ct2_cfg.get("alignment_heads") or []],
        begin_suppress_tokens=list(ct2_cfg.get("suppress_ids_begin") or []),
        suppress_tokens=list(ct2_cfg.get("suppress_ids") or []),
        max_initial_timestamp_index=50, max_length=hf_config.max_target_positions, return_timestamps=False,
    )
    tokens = WhisperSpecialTokens.resolve(hf_config, gc, special_token_ids(vocab))
    tokens.fill(gc)
    gc.bos_token_id = gc.pad_token_id = tokens.eot
    gc.forced_decoder_ids = [[1, None], [2, tokens.transcribe]] if tokens.is_multilingual \
        else [[1, tokens.no_timestamps]]
    return gc


def load_ct2_tokenizer(path: str | os.PathLike):
    """HF ``WhisperTokenizer`` from the directory's ``tokenizer.json``, with the
    vocabulary's timestamp tokens (``<|0.00|>`` ...) added as special tokens when
    the file lacks them, so every id the model can emit decodes."""
    from tokenizers import AddedToken
    from transformers import WhisperTokenizer

    path = os.fspath(path)
    tok_file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok_file):
        raise ValueError(f"{path}: no tokenizer.json; pass tokenizer=<an HF Whisper tokenizer id or dir>")
    tok = WhisperTokenizer(tokenizer_file=tok_file, pad_token="<|endoftext|>",
                           unk_token="<|endoftext|>", bos_token="<|endoftext|>",
                           eos_token="<|endoftext|>")
    # Name every special token (tokenizer.json's and the timestamps) as an
    # additional special token, so that ``all_special_ids`` lists them all.
    vocab = _read_vocabulary(path)
    specials = [AddedToken(t.content, special=True, normalized=False)
                for _, t in sorted(tok.added_tokens_decoder.items())
                if t.special and t.content != "<|endoftext|>"]
    missing = [t for t in vocab[len(tok):] if t]
    if missing and not all(t.startswith("<|") and t.endswith("|>") for t in missing):
        raise ValueError(f"{path}: vocabulary.txt has {len(missing)} tokens past tokenizer.json "
                         "that are not <|...|> special tokens")
    specials += [AddedToken(t, special=True, normalized=False) for t in missing]
    tok.add_special_tokens({"additional_special_tokens": specials})
    return tok


# ---- name layout (shared by reader and writer) ----

_LN = {"gamma": "weight", "beta": "bias"}
_FFN = {"linear_0": "fc1", "linear_1": "fc2", "layer_norm": "final_layer_norm"}


def _split(names: list[str | None]):
    """Fused tensor -> equal row chunks under ``names`` (None: a zero bias to drop)."""
    def out(t: torch.Tensor):
        for name, part in zip(names, t.chunk(len(names), dim=0)):
            if name is not None:
                yield name, part.contiguous()
    return out


def _one(name: str):
    return lambda t: iter([(name, t)])


def ct2_to_hf(name: str):
    """CT2 variable name -> function(tensor) yielding (hf_name, tensor), or None if unknown."""
    parts = name.split("/")
    side = parts[0]
    fixed = {
        "encoder/conv1/weight": "model.encoder.conv1.weight", "encoder/conv1/bias": "model.encoder.conv1.bias",
        "encoder/conv2/weight": "model.encoder.conv2.weight", "encoder/conv2/bias": "model.encoder.conv2.bias",
        "encoder/position_encodings/encodings": "model.encoder.embed_positions.weight",
        "decoder/position_encodings/encodings": "model.decoder.embed_positions.weight",
        "decoder/embeddings/weight": "model.decoder.embed_tokens.weight",
        "decoder/projection/weight": "proj_out.weight",
    }
    if name in fixed:
        return _one(fixed[name])
    if side not in ("encoder", "decoder"):
        return None
    if len(parts) == 3 and parts[1] == "layer_norm" and parts[2] in _LN:
        return _one(f"model.{side}.layer_norm.{_LN[parts[2]]}")
    if len(parts) != 5 or not parts[1].startswith("layer_") or not parts[1][6:].isdigit():
        return None
    i, block, sub, leaf = parts[1][6:], parts[2], parts[3], parts[4]
    pre = f"model.{side}.layers.{i}"
    if leaf in _LN and sub == "layer_norm":
        ln = {"self_attention": "self_attn_layer_norm", "attention": "encoder_attn_layer_norm",
              "ffn": "final_layer_norm"}.get(block)
        if ln is None or (block == "attention" and side == "encoder"):
            return None
        return _one(f"{pre}.{ln}.{_LN[leaf]}")
    if leaf not in ("weight", "bias"):
        return None
    if block == "ffn" and sub in ("linear_0", "linear_1"):
        return _one(f"{pre}.{_FFN[sub]}.{leaf}")
    if block == "self_attention":
        if sub == "linear_0":
            names = [f"{pre}.self_attn.{p}.{leaf}" for p in ("q_proj", "k_proj", "v_proj")]
            if leaf == "bias":
                names[1] = None
            return _split(names)
        if sub == "linear_1":
            return _one(f"{pre}.self_attn.out_proj.{leaf}")
    if block == "attention" and side == "decoder":
        if sub == "linear_0":
            return _one(f"{pre}.encoder_attn.q_proj.{leaf}")
        if sub == "linear_1":
            names = [f"{pre}.encoder_attn.k_proj.{leaf}", f"{pre}.encoder_attn.v_proj.{leaf}"]
            if leaf == "bias":
                names[0] = None
            return _split(names)
        if sub == "linear_2":
            return _one(f"{pre}.encoder_attn.out_proj.{leaf}")
    return None


def whisper_config_from_shapes(shapes: dict[str, tuple], heads: dict[str, int], vocab: list[str],
                               ct2_cfg: dict):
    """A ``WhisperConfig`` from the tensor shapes: CT2 stores no hyperparameters."""
    from transformers import WhisperConfig

    def count(side: str) -> int:
        return len({n.split("/")[1] for n in shapes
                    if n.startswith(f"{side}/layer_") and n.split("/")[1][6:].isdigit()})

    vocab_size, d_model = shapes["decoder/embeddings/weight"]
    from encdec.models.whisper_tokens import special_token_ids

    ids = special_token_ids(vocab)
    eot, sot = ids["<|endoftext|>"], ids["<|startoftranscript|>"]
    return WhisperConfig(
        vocab_size=vocab_size, num_mel_bins=shapes["encoder/conv1/weight"][1], d_model=d_model,
        encoder_layers=count("encoder"), decoder_layers=count("decoder"),
        encoder_attention_heads=heads["encoder"], decoder_attention_heads=heads["decoder"],
        encoder_ffn_dim=shapes["encoder/layer_0/ffn/linear_0/weight"][0],
        decoder_ffn_dim=shapes["decoder/layer_0/ffn/linear_0/weight"][0],
        max_source_positions=shapes["encoder/position_encodings/encodings"][0],
        max_target_positions=shapes["decoder/position_encodings/encodings"][0],
        pad_token_id=eot, bos_token_id=eot, eos_token_id=eot, decoder_start_token_id=sot,
        begin_suppress_tokens=list(ct2_cfg.get("suppress_ids_begin") or []),
        suppress_tokens=list(ct2_cfg.get("suppress_ids") or []),
        tie_word_embeddings=True,
    )
