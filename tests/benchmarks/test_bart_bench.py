"""bart_bench's option checks: a family run takes float32 or int8, and refuses
what it does not run before any model is built."""
from __future__ import annotations

import pytest

from benchmarks import bart_bench


@pytest.mark.parametrize("extra", [["--compute-type", "bfloat16"], ["--beams", "4"], ["--repeats", "2"]])
def test_a_family_run_refuses_what_it_does_not_run(extra, capsys):
    with pytest.raises(SystemExit) as exc:
        bart_bench.main(["--family", "t5", *extra])
    assert exc.value.code == 2
    assert "float32 or int8" in capsys.readouterr().err


def test_a_family_run_takes_int8(monkeypatch, tmp_path):
    import json

    from benchmarks import families

    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 1000}))
    monkeypatch.setenv("ENCDEC_NUM_THREADS", "1")  # main sets it; restored after the test
    monkeypatch.setattr(families, "family_checkpoint", lambda family, model_dir: str(tmp_path))
    seen = {}
    monkeypatch.setattr(families, "run_family_bench", lambda family, model_dir, enc_out, **kw: seen.update(
        family=family, requests=len(enc_out[0]), **kw))
    bart_bench.main(["--family", "m2m100", "--compute-type", "int8", "--requests", "3", "--skip-hf"])
    assert seen == {"family": "m2m100", "requests": 3, "hf_batch": 16, "skip_hf": True, "compute_type": "int8"}


def test_the_hf_side_generates_the_asked_lengths(tmp_path):
    """run_hf on a tiny random BART: every request gets exactly its output length."""
    import torch
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    cfg = BartConfig(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                     decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64)
    BartForConditionalGeneration(cfg).save_pretrained(tmp_path)
    enc = [[0, 5, 6, 7, 2], [0, 9, 2]]
    useful, seconds = bart_bench.run_hf(str(tmp_path), enc, [3, 5], batch=2)
    assert useful == 8 and seconds > 0
