from __future__ import annotations

import pytest

from encdec.sampling_params import SamplingParams, SamplingType
from tests.sample.reference import FakeTokenizer


@pytest.mark.parametrize("kwargs, field", [
    (dict(n=0), "n"),
    (dict(n=2, best_of=1), "best_of"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.01), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=1.5), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(frequency_penalty=2.5), "frequency_penalty"),
    (dict(presence_penalty=-2.5), "presence_penalty"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens"),
    (dict(logprobs=-1), "logprobs"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(stop=["ok", ""]), "stop"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(bad_words=["  "]), "bad_words"),
])
def test_value_errors_name_the_field(kwargs, field) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert str(info.value).startswith(field + " "), str(info.value)
    value = next(iter(kwargs.values())) if field not in kwargs else kwargs[field]
    assert repr(value) in str(info.value) or str(value) in str(info.value)


def test_max_tokens_message_is_actionable() -> None:
    with pytest.raises(ValueError, match=r"^max_tokens must be >= 1, got 0$"):
        SamplingParams(max_tokens=0)


@pytest.mark.parametrize("kwargs, field", [
    (dict(n="2"), "n"),
    (dict(max_tokens=1.5), "max_tokens"),
    (dict(top_k=True), "top_k"),
    (dict(temperature="hot"), "temperature"),
    (dict(seed=1.0), "seed"),
    (dict(stop=[1]), "stop"),
    (dict(stop_token_ids="12"), "stop_token_ids"),
    (dict(stop_token_ids=[1.0]), "stop_token_ids"),
    (dict(logit_bias=[(1, 2.0)]), "logit_bias"),
    (dict(extra_args=["x"]), "extra_args"),
])
def test_type_errors_name_the_field(kwargs, field) -> None:
    with pytest.raises(TypeError, match=f"^{field} "):
        SamplingParams(**kwargs)


def test_positional_arguments_are_refused() -> None:
    with pytest.raises(TypeError):
        SamplingParams(2)  # type: ignore[misc]


def test_defaults_and_normalisation() -> None:
    p = SamplingParams(n=3, stop="END", logit_bias={"7": 250, 3: -1})
    assert p.best_of == 3 and p.max_tokens == 16 and p.stop == ["END"]
    assert p.stop_token_ids == [] and p.skip_special_tokens and p.detokenize
    assert p.logit_bias == {7: 100.0, 3: -1.0}
    assert p.output_text_buffer_length == 2
    assert SamplingParams(stop="END", include_stop_str_in_output=True).output_text_buffer_length == 0


def test_sampling_type_and_greedy_filters() -> None:
    assert SamplingParams(temperature=1e-6, seed=1).sampling_type is SamplingType.GREEDY
    assert SamplingParams().sampling_type is SamplingType.RANDOM
    assert SamplingParams(seed=0).sampling_type is SamplingType.RANDOM_SEED
    g = SamplingParams(temperature=0.0, top_p=0.5, top_k=4, min_p=0.3)
    assert (g.top_p, g.top_k, g.min_p) == (1.0, 0, 0.0)
    r = SamplingParams(top_p=0.5, top_k=4, min_p=0.3)
    assert (r.top_p, r.top_k, r.min_p) == (0.5, 4, 0.3)


def test_all_stop_token_ids_include_eos_unless_ignored() -> None:
    p = SamplingParams(stop_token_ids=[9])
    p.update_from_generation_config({"eos_token_id": [2, 50]}, model_eos_token_id=2)
    assert p.all_stop_token_ids == {2, 9, 50} and p.stop_token_ids == [9, 50]
    q = SamplingParams(stop_token_ids=[9], ignore_eos=True)
    q.update_from_generation_config({"eos_token_id": 2}, model_eos_token_id=2)
    assert q.all_stop_token_ids == {9}


@pytest.mark.parametrize("kwargs, field", [
    (dict(logit_bias={100: 1.0}), "logit_bias"),
    (dict(allowed_token_ids=[1, -1]), "allowed_token_ids"),
    (dict(stop_token_ids=[3, 64]), "stop_token_ids"),
    (dict(logprobs=65), "logprobs"),
])
def test_verify_against_vocab_names_the_field(kwargs, field) -> None:
    p = SamplingParams(**kwargs)
    with pytest.raises(ValueError, match=f"^{field} "):
        p.verify_against(64)
    SamplingParams(logit_bias={63: 1.0}, allowed_token_ids=[0, 63], stop_token_ids=[5],
                   logprobs=64).verify_against(64)


def test_bad_words_tokenized_with_and_without_space() -> None:
    p = SamplingParams(bad_words=["foo", "bar baz"])
    assert p.bad_words_token_ids is None
    p.update_from_tokenizer(FakeTokenizer())
    assert p.bad_words_token_ids == [[10], [11], [12, 15], [13, 15]]
    p.verify_against(16)
    with pytest.raises(ValueError, match="^bad_words "):
        p.verify_against(14)


def test_clone_is_deep() -> None:
    p = SamplingParams(stop=["a"], logit_bias={1: 1.0})
    c = p.clone()
    c.stop.append("b")
    c.logit_bias[2] = 2.0
    assert p.stop == ["a"] and p.logit_bias == {1: 1.0}
