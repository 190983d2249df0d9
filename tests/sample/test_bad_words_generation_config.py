"""A checkpoint's ``bad_words_ids`` (generation config) apply to every request,
as HF's ``generate`` applies them: one-token entries always, longer ones where
the decoder sequence ends with their prefix, an entry that is just eos dropped.
Greedy and beams, token-identical to HF on each prompt alone."""
from __future__ import annotations

import collections
import json
import os
import random

import pytest
import torch

from encdec import LLM, SamplingParams, TokensPrompt
from encdec.sampling_params import BeamSearchParams
from encdec.testing import make_random_bart

HF_KW = dict(do_sample=False, no_repeat_ngram_size=0, repetition_penalty=1.0, min_length=0, forced_bos_token_id=None,
             forced_eos_token_id=None, eos_token_id=2, pad_token_id=1, length_penalty=1.0, early_stopping=False)


def _prompts(n: int = 12) -> list[list[int]]:
    rng = random.Random(5)
    return [[0] + [rng.randrange(4, 1000) for _ in range(rng.randint(3, 30))] + [2] for _ in range(n)]


def _hf(path: str):
    from transformers import BartForConditionalGeneration

    return BartForConditionalGeneration.from_pretrained(path).eval()


def _hf_generate(hf, enc: list[int], prompt: list[int], max_new: int, beams: int = 1) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([enc]), decoder_input_ids=torch.tensor([prompt]), max_new_tokens=max_new,
                          num_beams=beams, attention_mask=torch.ones(1, len(enc), dtype=torch.long), **HF_KW)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def banned_checkpoint(tmp_path_factory) -> tuple[str, list[list[int]]]:
    """A random BART whose generation config bans the bigram and the token its
    greedy outputs use most (so the bans change outputs), and eos alone (dropped)."""
    path = make_random_bart(str(tmp_path_factory.mktemp("bad_words")), seed=3)
    hf = _hf(path)
    bigrams, tokens = collections.Counter(), collections.Counter()
    for enc in _prompts():
        out = _hf_generate(hf, enc, [2, 0], 16)
        bigrams.update(zip(out, out[1:]))
        tokens.update(out)
    (a, b), _ = bigrams.most_common(1)[0]
    single = next(t for t, _ in tokens.most_common() if t not in (a, b, 2))
    words = [[a, b], [single], [2]]
    with open(os.path.join(path, "generation_config.json")) as f:
        gen = json.load(f)
    gen["bad_words_ids"] = words
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(gen, f)
    return path, words


@pytest.mark.parametrize("beams", [1, 3], ids=["greedy", "beams3"])
def test_generation_config_bad_words_match_hf(banned_checkpoint, beams):
    path, ((a, b), (single,), _) = banned_checkpoint
    hf = _hf(path)
    assert hf.generation_config.bad_words_ids  # HF applies them too
    llm = LLM(path, kv_cache_memory=32 << 20)
    params = (BeamSearchParams(beams, 16, ignore_eos=False) if beams > 1
              else SamplingParams(temperature=0.0, max_tokens=16))
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in _prompts()], params, use_tqdm=False)
    for out, enc in zip(outs, _prompts()):
        ours = list(out.outputs[0].token_ids)
        assert ours == _hf_generate(hf, enc, list(out.prompt_token_ids), 16, beams), out.request_id
        seq = list(out.prompt_token_ids) + ours
        assert single not in ours and (a, b) not in set(zip(seq, seq[1:]))


def test_rows_banned_as_hf_bans_them():
    """Per row: one-token words always, eos alone never, a longer word's last
    token where the prompt + outputs end with its prefix (across the prompt's end too)."""
    from types import SimpleNamespace

    from encdec.sample.logits_processor.generation import BadWordsLogitsProcessor
    from encdec.sample.logits_processor.interface import BatchUpdate

    gen = SimpleNamespace(bad_words_ids=[[2], [7], [3, 4], [5, 6, 8]], eos_token_id=2)
    proc = BadWordsLogitsProcessor(SimpleNamespace(generation_config=gen), torch.device("cpu"), False)
    rows = [([0], [3]), ([0, 5], [6]), ([0, 5], []), ([3], [])]  # (prompt, outputs)
    params = SamplingParams()
    proc.update_state(BatchUpdate(batch_size=4, removed=[], moved=[],
                                  added=[(i, params, p, o) for i, (p, o) in enumerate(rows)]))
    banned = proc.apply(torch.zeros(4, 10)).isinf()
    assert [torch.nonzero(r).flatten().tolist() for r in banned] == [[4, 7], [7, 8], [7], [4, 7]]


def test_bad_words_that_are_not_token_id_lists_are_refused(tmp_path):
    path = make_random_bart(str(tmp_path / "m"), seed=0)
    with open(os.path.join(path, "generation_config.json")) as f:
        gen = json.load(f)
    gen["bad_words_ids"] = [[5], []]
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(gen, f)
    with pytest.raises(ValueError, match="bad_words_ids"):
        LLM(path, kv_cache_memory=16 << 20)
