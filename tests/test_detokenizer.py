"""The incremental detokenizer's Rust fast path (the tokenizer's own Rust
conversions, bound once) gives the text transformers' wrappers give, token by
token, for every special-token setting; classes that override the conversions
keep the wrappers."""
from __future__ import annotations

import random

import pytest

from encdec.outputs import Detokenizer
from encdec.sampling_params import SamplingParams
from encdec.sequence import Sequence


class _Wrapped:
    """The same tokenizer seen through a proxy: not a TokenizersBackend, so the
    detokenizer takes the wrappers' path."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def _texts(detok: Detokenizer, ids: list[int], params: SamplingParams) -> list[str]:
    inputs = {"prompt_token_ids": [0], "encoder_prompt_token_ids": [0], "prompt": None, "encoder_prompt": None}
    seq = Sequence(0, inputs, 16)
    texts = []
    for i in ids:
        seq.append_token_id(i)
        detok.decode_sequence_inplace(seq, params)
        texts.append(seq.output_text)
    return texts


def _tokenizers(tiny_bart, whisper_tiny_hf_dir):
    from transformers import AutoTokenizer

    yield "bart", AutoTokenizer.from_pretrained(tiny_bart)
    yield "whisper tiny.en", AutoTokenizer.from_pretrained(whisper_tiny_hf_dir)


@pytest.mark.parametrize("skip_special,spaces", [(True, True), (False, True), (False, False)])
def test_rust_fast_path_matches_the_wrappers(tiny_bart, whisper_tiny_hf_dir, skip_special, spaces):
    params = SamplingParams(skip_special_tokens=skip_special, spaces_between_special_tokens=spaces)
    for name, tok in _tokenizers(tiny_bart, whisper_tiny_hf_dir):
        fast, slow = Detokenizer(tok), Detokenizer(_Wrapped(tok))
        assert fast._id_to_token is not None and slow._id_to_token is None, name
        rng = random.Random(0)
        special = sorted(tok.all_special_ids)
        ids = [rng.choice(special) if rng.random() < 0.1 else rng.randrange(len(tok)) for _ in range(300)]
        assert _texts(fast, ids, params) == _texts(slow, ids, params), name
        if skip_special:  # and, whole, what HF's decode gives
            assert _texts(fast, ids, params)[-1] == tok.decode(ids, skip_special_tokens=True), name


@pytest.mark.parametrize("skip_special,spaces", [(True, True), (False, True), (False, False)])
def test_owed_text_decoded_whole_equals_token_by_token(tiny_bart, whisper_tiny_hf_dir, skip_special, spaces):
    """``decode_owed`` decodes a whole output in one call when it ends cleanly;
    cut anywhere, the text equals the token-by-token text, and decoding goes on
    token by token after it as it would have."""
    params = SamplingParams(skip_special_tokens=skip_special, spaces_between_special_tokens=spaces)
    inputs = {"prompt_token_ids": [0], "encoder_prompt_token_ids": [0], "prompt": None, "encoder_prompt": None}
    for name, tok in _tokenizers(tiny_bart, whisper_tiny_hf_dir):
        detok = Detokenizer(tok)
        rng = random.Random(1)
        special = sorted(tok.all_special_ids)
        for trial in range(40):
            ids = [rng.choice(special) if rng.random() < 0.1 else rng.randrange(len(tok))
                   for _ in range(rng.randint(2, 40))]
            stepped = _texts(detok, ids, params)
            cut = rng.randint(2, len(ids))
            seq = Sequence(0, inputs, 16)
            for i in ids[:cut]:
                seq.append_token_id(i)
            detok.decode_owed(seq, params)
            assert seq.output_text == stepped[cut - 1], (name, trial, cut)
            for i in ids[cut:]:
                seq.append_token_id(i)
                detok.decode_sequence_inplace(seq, params)
            assert seq.output_text == stepped[-1], (name, trial)
