"""``speculative_config.draft_vocab_size``: the draft's LM head keeps the rows of
the N lowest token ids and the ids the decoding rules need
(``spec_decode.draft_vocab``), gathered once (``worker.draft_head``). Its argmax
is the full head's argmax over that subset; greedy outputs stay exactly the
outputs without speculation (the target verifies every draft); bad values are
refused before any weight loads."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from encdec import LLM, SamplingParams
from encdec.spec_decode import SpeculativeConfig
from encdec.spec_decode.draft_vocab import draft_vocab_ids, special_token_ids
from encdec.worker.draft_head import DraftHead
from tests.spec_decode.test_engine_spec import FAMILIES, _all_free, _mixed_params, _prompts, _tokens


def _draft(model: str, k: int, n: int | None, **options) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k, "draft_vocab_size": n, **options}


def test_the_lowest_ids_and_the_special_ones_are_kept():
    assert draft_vocab_ids(None, 100, {99}) is None
    assert draft_vocab_ids(100, 100, set()) is None and draft_vocab_ids(500, 100, set()) is None
    assert draft_vocab_ids(10, 100, {0, 2}) == list(range(10))  # BART: its specials are low ids
    # Whisper-like: text ids, then end-of-text (90) and every special and timestamp after it
    assert draft_vocab_ids(10, 100, {90, 91, 95}) == list(range(10)) + list(range(90, 100))
    assert draft_vocab_ids(3, 20, {1, 19}) == [0, 1, 2, 19]  # Marian: <pad> last
    assert draft_vocab_ids(2, 3, {2}) is None  # every id: the full head


def test_special_ids_come_from_the_config_and_generation_config():
    hf = SimpleNamespace(eos_token_id=50256, pad_token_id=50256, bos_token_id=50256,
                         decoder_start_token_id=50257, forced_bos_token_id=None)
    gen = SimpleNamespace(eos_token_id=[50256, 3], no_timestamps_token_id=50362,
                          forced_decoder_ids=[[1, 50358], [2, None]], pad_token_id=True)
    assert special_token_ids(hf, gen, None) == {50256, 50257, 3, 50362, 50358}


@pytest.mark.parametrize("n, error, message", [
    (0, ValueError, "draft_vocab_size must be >= 1"),
    (-5, ValueError, "draft_vocab_size must be >= 1"),
    (True, TypeError, "draft_vocab_size must be an int"),
    (8192.0, TypeError, "draft_vocab_size must be an int"),
    ("8192", TypeError, "draft_vocab_size must be an int"),
])
def test_bad_sizes_name_the_field(n, error, message):
    with pytest.raises(error, match=message):
        SpeculativeConfig.from_dict(_draft("/nonexistent", 3, n))


def test_the_size_is_for_draft_models_only():
    with pytest.raises(ValueError, match="draft_vocab_size applies to method 'draft_model', not 'ngram'"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "draft_vocab_size": 100})
    assert SpeculativeConfig.from_dict(_draft("/m", 3, None)).draft_vocab_size is None
    assert SpeculativeConfig.from_dict(_draft("/m", 3, 10**9)).draft_vocab_size == 10**9  # the full head


def test_a_bad_size_stops_before_any_weight_loads(tmp_path):
    """The engine is never built: the path holds no checkpoint at all."""
    with pytest.raises(TypeError, match="draft_vocab_size"):
        LLM(str(tmp_path / "none"), speculative_config=_draft(str(tmp_path / "none"), 2, 3.5))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    path = FAMILIES[request.param](str(tmp_path_factory.mktemp(request.param)), seed=1)
    prompts, params = _prompts(10), _mixed_params(10)
    base = LLM(path, kv_cache_memory=16 << 20, enable_encoder_cache=False)
    return path, prompts, params, _tokens(base.generate(prompts, params, use_tqdm=False), params)


@pytest.mark.parametrize("kept", ["lowest", "scattered"])
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_the_reduced_head_s_argmax_is_the_full_head_s_over_the_subset(family, quantization, kept):
    """T5's input rescale, BART's and mBART's ``final_logits_bias``, tied and
    untied heads; float32 and int8 rows; a static ban (``apply_static``) on
    full-width logits, the kept ids copied there as a few runs (the lowest ids
    and the last) or scattered (every third id: one index copy)."""
    path = family[0]
    model = LLM(path, kv_cache_memory=16 << 20, quantization=quantization).llm_engine.worker.model
    ids = (draft_vocab_ids(300, model.vocab_size, {0, 1, 2, model.vocab_size - 1}) if kept == "lowest"
           else list(range(0, model.vocab_size, 3)))
    head = DraftHead(model, ids)
    hidden = torch.randn(7, head.head.in_features, generator=torch.Generator().manual_seed(3))
    idx = torch.tensor(ids)
    with torch.inference_mode():
        full = model.compute_logits(hidden).float()
        assert torch.allclose(head.logits(hidden), full[:, idx], rtol=1e-5, atol=1e-5)
        assert head.greedy(hidden, None) == idx[full[:, idx].argmax(-1)].tolist()
        banned = full[:, idx].argmax(-1)[0]

        def ban(logits: torch.Tensor) -> torch.Tensor:
            logits[:, idx[banned]] = float("-inf")
            return logits

        sub = full[:, idx].clone()
        sub[:, banned] = float("-inf")
        assert head.greedy(hidden, ban) == idx[sub.argmax(-1)].tolist()


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_greedy_with_a_reduced_draft_head_is_token_identical(family, quantization, k):
    path, prompts, params, want = family
    llm = LLM(path, kv_cache_memory=16 << 20, enable_encoder_cache=False,
              speculative_config=_draft(path, k, 300, quantization=quantization))
    assert llm.llm_engine.worker.model_runner.drafter.model.head is not None
    assert _tokens(llm.generate(prompts, params, use_tqdm=False), params) == want
    stats = llm.llm_engine.get_stats()
    assert stats.spec_decode_num_draft_tokens > 0
    assert _all_free(llm)


def test_whisper_tiny_en_transcribes_the_same_with_a_reduced_draft_head(ct2_dir, speech_clips):
    """Real tiny.en on a shipped clip, timestamps on (the timestamp tokens are
    kept ids), an int8 self-draft whose head keeps 8192 text ids: the same
    segments as without speculation, and most drafts kept."""
    from tests.spec_decode.test_spec_whisper import KW, _segments

    clips = [(speech_clips[2][i], 16000) for i in (0, 1)]
    want = _segments(LLM(str(ct2_dir), **KW).transcribe(clips, use_tqdm=False, timestamps=True))
    for k in (1, 5):
        llm = LLM(str(ct2_dir), **KW, speculative_config=_draft(str(ct2_dir), k, 8192, quantization="int8"))
        head = llm.llm_engine.worker.model_runner.drafter.model.head
        assert head.vocab_size == 8192 + 51864 - 50256  # the text ids, then end-of-text and every id after it
        assert _segments(llm.transcribe(clips, use_tqdm=False, timestamps=True)) == want
        stats = llm.llm_engine.get_stats()
        assert stats.spec_decode_num_accepted_tokens > stats.spec_decode_num_draft_tokens / 3
        assert _all_free(llm)


def test_greedy_is_exact_when_the_subset_misses_the_target_s_tokens(family):
    """A subset of 12 ids: nearly every draft is wrong, every output still the target's."""
    path = family[0]
    prompts, params = _prompts(4, seed=2), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = _tokens(LLM(path, kv_cache_memory=16 << 20).generate(prompts, params, use_tqdm=False))
    llm = LLM(path, kv_cache_memory=16 << 20, speculative_config=_draft(path, 3, 12, quantization="int8"))
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == want
