"""BeamSearchParams validation, and the CLI's defaults-then-flags rule."""
from __future__ import annotations

import json

import pytest

from encdec.beam_search.defaults import with_overrides
from encdec.sampling_params import BeamSearchParams, SamplingParams


def test_importable_from_the_package():
    import encdec

    assert encdec.BeamSearchParams is BeamSearchParams


@pytest.mark.parametrize("kwargs, field", [
    (dict(beam_width=0), "beam_width"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens"),
    (dict(num_return_sequences=5), "num_return_sequences"),
    (dict(num_return_sequences=0), "num_return_sequences"),
    (dict(no_repeat_ngram_size=-1), "no_repeat_ngram_size"),
    (dict(early_stopping="always"), "early_stopping"),
    (dict(early_stopping=1), "early_stopping"),
    (dict(temperature=0.7), "temperature"),
    (dict(stop=[""]), "stop"),
])
def test_bad_values_name_the_field(kwargs, field):
    args = {"beam_width": 4, "max_tokens": 16, **kwargs}
    with pytest.raises(ValueError, match=field):
        BeamSearchParams(args.pop("beam_width"), args.pop("max_tokens"), **args)


@pytest.mark.parametrize("kwargs, field", [
    (dict(beam_width=2.0), "beam_width"), (dict(length_penalty="2"), "length_penalty"),
    (dict(ignore_eos=1), "ignore_eos"), (dict(stop_token_ids=["2"]), "stop_token_ids"),
])
def test_wrong_types_are_type_errors(kwargs, field):
    args = {"beam_width": 4, "max_tokens": 16, **kwargs}
    with pytest.raises(TypeError, match=field):
        BeamSearchParams(args.pop("beam_width"), args.pop("max_tokens"), **args)


def test_temperature_zero_and_hf_options_are_accepted():
    p = BeamSearchParams(4, 142, min_tokens=56, length_penalty=-1, early_stopping="never",
                         no_repeat_ngram_size=3, num_return_sequences=4, stop="x", temperature=0.0)
    assert p.stop == ["x"] and p.stop_token_ids == []


def test_sampling_params_no_repeat_ngram_size():
    assert SamplingParams(no_repeat_ngram_size=3).no_repeat_ngram_size == 3
    with pytest.raises(ValueError, match="no_repeat_ngram_size"):
        SamplingParams(no_repeat_ngram_size=-1)
    with pytest.raises(TypeError, match="no_repeat_ngram_size"):
        SamplingParams(no_repeat_ngram_size=1.5)


CNN = BeamSearchParams(4, 140, min_tokens=54, length_penalty=2.0, early_stopping=True, no_repeat_ngram_size=3,
                       forced_bos_token_id=0, forced_eos_token_id=2)


def test_overrides_keep_beam_defaults():
    assert with_overrides(CNN) == CNN
    p = with_overrides(CNN, beam_width=2, length_penalty=0.5, max_tokens=20)
    assert (p.beam_width, p.length_penalty, p.max_tokens, p.min_tokens, p.forced_eos_token_id) == \
        (2, 0.5, 20, 20, 2)


def test_overrides_switch_to_sampling():
    p = with_overrides(CNN, beam_width=1)
    assert isinstance(p, SamplingParams) and p.temperature == 0.0 and p.no_repeat_ngram_size == 3
    assert p.extra_args == {"forced_bos_token_id": 0, "forced_eos_token_id": 2}
    assert isinstance(with_overrides(CNN, temperature=0.8), SamplingParams)
    with pytest.raises(ValueError, match="top_k"):
        with_overrides(CNN, beam_width=4, top_k=5)
    with pytest.raises(ValueError, match="length_penalty"):
        with_overrides(SamplingParams(temperature=0), length_penalty=2.0)
    beam = with_overrides(SamplingParams(temperature=0, max_tokens=9), beam_width=3)
    assert beam == BeamSearchParams(3, 9)


def test_cli_generate_uses_checkpoint_beam_defaults(tmp_path, capsys):
    from encdec import LLM, TokensPrompt
    from encdec.entrypoints.cli import main
    from tests.beam_search.conftest import make_beam_bart

    path = make_beam_bart(str(tmp_path), seed=1, eos_bias=7.0, num_beams=3, length_penalty=2.0,
                          early_stopping=True, no_repeat_ngram_size=3, max_length=24)
    engine = ["--model", path, "--kv-cache-memory", str(16 << 20), "--swap-space", "0.01",
              "--quiet", "--json"]
    assert main(["generate", *engine, "The rain in spain", "hello"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    llm = LLM(path, kv_cache_memory=16 << 20, swap_space=0.01)
    expect = llm.generate(["The rain in spain", "hello"], use_tqdm=False)
    assert [x["outputs"][0]["token_ids"] for x in lines] == [o.outputs[0].token_ids for o in expect]
    assert all("score" in x["outputs"][0] for x in lines)
    assert main(["generate", *engine, "--beam-width", "2", "--length-penalty", "0.5",
                 "--no-repeat-ngram-size", "0", "hello"]) == 0
    line = json.loads(capsys.readouterr().out)
    want = llm.generate(TokensPrompt(prompt_token_ids=llm.get_tokenizer().encode("hello")),
                        BeamSearchParams(2, 22, length_penalty=0.5, early_stopping=True), use_tqdm=False)
    assert line["outputs"][0]["token_ids"] == want[0].outputs[0].token_ids
    assert main(["generate", *engine, "--beam-width", "2", "--temperature", "0.5", "x"]) == 2
    assert "temperature" in capsys.readouterr().err
