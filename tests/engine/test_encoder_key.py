"""The encoder cache's key: equal exactly when the encoder input is."""
from __future__ import annotations

import torch

from encdec.engine.encoder_key import encoder_cache_key


def _inputs(ids, features=None):
    out = {"encoder_prompt_token_ids": ids}
    if features is not None:
        out["encoder_features"] = features
    return out


def test_keys_follow_the_encoder_input():
    feats = torch.randn(128, 3000, generator=torch.Generator().manual_seed(0))
    key = encoder_cache_key(_inputs([1, 2], feats), "m")
    assert len(key) == 64 and int(key, 16) >= 0  # a 256-bit digest in hex
    assert encoder_cache_key(_inputs([1, 2], feats.clone()), "m") == key  # same bytes, another tensor
    changed = feats.clone()
    changed[127, 2999] += 1e-3
    others = {encoder_cache_key(_inputs([1, 2], changed), "m"),  # one feature
              encoder_cache_key(_inputs([1, 3], feats), "m"),  # an id
              encoder_cache_key(_inputs([1, 2], feats), "other model"),
              encoder_cache_key(_inputs([1, 2], feats.half()), "m"),  # dtype
              encoder_cache_key(_inputs([1, 2], feats.reshape(3000, 128)), "m"),  # shape
              encoder_cache_key(_inputs([1, 2]), "m")}  # no features
    assert key not in others and len(others) == 6
