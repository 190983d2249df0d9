"""SpeculativeConfig: vLLM's dict checked before anything loads (a ValueError or
TypeError naming the field), and the draft/target check from configs and
tokenizers alone (the drafts here have no weight files at all)."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from encdec.spec_decode import SpeculativeConfig, check_draft_compatible
from encdec.testing import make_random_bart, make_random_t5


def test_ngram_defaults_follow_vllm():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    c = SpeculativeConfig.from_dict('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4, '
                                    '"prompt_lookup_min": 2}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 2, 2, 4)
    assert SpeculativeConfig.from_dict(c) is c


def test_draft_model_and_its_spellings(tmp_path):
    c = SpeculativeConfig.from_dict({"model": tmp_path, "num_speculative_tokens": 1, "quantization": "int8"})
    assert (c.method, c.model, c.quantization) == ("draft_model", os.fspath(tmp_path), "int8")
    assert SpeculativeConfig.from_dict({"model": "ngram", "num_speculative_tokens": 2}).method == "ngram"


@pytest.mark.parametrize("spec, error, field", [
    ({"method": "ngram", "num_speculative_tokens": 0}, ValueError, "num_speculative_tokens must be >= 1"),
    ({"method": "ngram", "num_speculative_tokens": -2}, ValueError, "num_speculative_tokens must be >= 1"),
    ({"method": "ngram", "num_speculative_tokens": True}, TypeError, "num_speculative_tokens must be an int"),
    ({"method": "ngram", "num_speculative_tokens": 2.0}, TypeError, "num_speculative_tokens must be an int"),
    ({"method": "ngram"}, ValueError, "num_speculative_tokens is required"),
    ({"method": "medusa", "num_speculative_tokens": 2}, ValueError, "method must be one of"),
    ({"num_speculative_tokens": 2}, ValueError, "method is required"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     ValueError, "prompt_lookup_min \\(4\\) must be <= prompt_lookup_max \\(2\\)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, ValueError,
     "prompt_lookup_min must be >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, ValueError, "model applies to method"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, ValueError, "model is required"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "m", "prompt_lookup_max": 3}, ValueError,
     "prompt_lookup_max applies to method 'ngram'"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "m", "quantization": "fp8"}, ValueError,
     "quantization must be None or 'int8'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, ValueError,
     "unknown key\\(s\\) \\['draft_tensor_parallel_size'\\]"),
    ("{not json", ValueError, "not valid JSON"),
    ([1, 2], TypeError, "must be a dict"),
])
def test_bad_configs_name_the_field(spec, error, field):
    with pytest.raises(error, match=field) as e:
        SpeculativeConfig.from_dict(spec)
    assert "speculative_config" in str(e.value)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    target = make_random_bart(str(root / "target"), seed=0)
    draft = make_random_bart(str(root / "draft"), seed=1, layers=1, d_model=32, heads=2)
    small_vocab = make_random_bart(str(root / "small_vocab"), seed=1, vocab_size=600)
    t5 = make_random_t5(str(root / "t5"), seed=1)
    renamed = str(root / "renamed")  # the draft with one token of its tokenizer renamed: same size, other vocabulary
    shutil.copytree(draft, renamed)
    path = os.path.join(renamed, "tokenizer.json")
    with open(path) as f:
        tok = json.load(f)
    vocab = tok["model"]["vocab"]
    name = next(t for t, i in vocab.items() if i == 100)
    vocab["zzz_renamed"] = vocab.pop(name)
    with open(path, "w") as f:
        json.dump(tok, f)
    for d in (draft, small_vocab, t5, renamed):  # configs and tokenizers only: no weights to read
        for f in os.listdir(d):
            if f.endswith((".safetensors", ".bin")):
                os.remove(os.path.join(d, f))
    return {"target": target, "draft": draft, "small_vocab": small_vocab, "t5": t5, "renamed": renamed}


def test_a_draft_of_the_same_tokenizer_fits_without_weights(models):
    assert check_draft_compatible(models["target"], models["draft"]) is None  # raises when they differ
    assert check_draft_compatible(models["target"], models["target"]) is None  # the self-draft (int8)
    config = SpeculativeConfig.from_dict({"model": models["draft"], "num_speculative_tokens": 3})
    assert config.method == "draft_model" and config.check_draft(models["target"]) is None


@pytest.mark.parametrize("draft, message", [
    ("small_vocab", "vocabulary has 600 tokens, the target's 1000"),
    ("t5", "draft's .* is .*, the target's"),  # another family's tokenizer: other special ids
    ("renamed", "tokenizer differs from the target's"),
])
def test_a_draft_of_another_vocabulary_is_refused(models, draft, message):
    with pytest.raises(ValueError, match=message) as e:
        SpeculativeConfig.from_dict({"model": models[draft], "num_speculative_tokens": 2}).check_draft(
            models["target"])
    assert "speculative_config.model" in str(e.value)


def test_a_missing_draft_is_refused(models, tmp_path):
    with pytest.raises(ValueError, match="speculative_config.model: .*does not exist"):
        check_draft_compatible(models["target"], str(tmp_path / "nowhere" / "x" / "y"))


def test_a_text_draft_for_whisper_is_refused(models, ct2_dir):
    """Real tiny.en (CTranslate2): a BART draft cannot read its audio, nor can it draft for BART."""
    with pytest.raises(ValueError, match="the draft reads text while the target reads audio"):
        check_draft_compatible(ct2_dir, models["draft"])
    with pytest.raises(ValueError, match="the draft reads audio \\(Whisper\\) while the target reads text"):
        check_draft_compatible(models["target"], ct2_dir)
    check_draft_compatible(ct2_dir, ct2_dir)  # tiny.en's int8 self-draft
