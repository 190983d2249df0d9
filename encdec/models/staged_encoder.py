"""An encoder pass that can stop between layers (and, for Whisper, between rows
of a layer) and go on in a later step.

Why: with an encoder budget (``max_num_encoder_input_tokens``) an input larger
than the budget used to run whole in one step, and every running request's
next token waited for it (a 30 s Whisper window is ~25 decode steps of tiny.en
on 2 cores). The scheduler now splits such a pass into pieces of at most the
budget's work (``encdec.core.encoder_split``); the worker runs one piece per
step (``encdec.worker.encoder_pieces``) through the three methods every model
has, which ``encode`` itself is made of:

    state = model.encoder_start(inputs, md)        embeddings (Whisper: the conv frontend)
    model.encoder_advance(state, layer, r0, r1)    rows r0:r1 of one layer
    out = model.encoder_finish(state)              the final norm -> (tokens, d_model)

A layer run whole is the same call ``encode`` makes, so a pass split by layers
is the unsplit pass's arithmetic exactly. Models whose layers can be split by
rows (``encoder_row_granule``) compute the layer's q/k/v for every row with its
first piece; each later piece attends its rows over them and runs the rest of
the layer on those rows only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class EncoderState:
    """One request's encoder pass between pieces (device tensors)."""

    h: torch.Tensor  # the hidden states entering the current layer
    md: Any = None  # token families: attention metadata of this request's encoder tokens
    biases: list | None = None  # T5: each layer's relative position bias
    qkv: torch.Tensor | None = None  # a layer split by rows: q/k/v of its every row
    out: torch.Tensor | None = None  # a layer split by rows: its output rows so far


def run_layers(model: Any, state: EncoderState) -> torch.Tensor:
    """Every layer whole, then the final norm: the unsplit pass."""
    for layer in range(model.num_encoder_layers):
        model.encoder_advance(state, layer, 0, state.h.shape[-2])
    return model.encoder_finish(state)
