"""A CPU draft's proposal without the model's forward: each of its greedy
steps is one C call (``decoder_step_cpu.DraftSteps``: the embedding, the
fused decoder layers, the final norm, the LM head, the bans and the argmax),
and the rows' inputs advance inside the kernel's own arrays.

Why: a draft step of Whisper base spent ~0.5 ms of its ~4 ms in Python (the
model's module calls, new tensors, the attention metadata rebuilt, the head's
own call and parallel region), and the drafts are a third of a speculating
run. Here a step costs one call and a list of tokens.

Where it applies: a model that offers its parts (``draft_step_parts``:
Whisper), on CPU, a proposal whose rows feed one token each (a self-draft,
or an own pool that holds every token's K/V but the last), an LM head the
kernel runs (int8 panels beside int8 layers, float32 panels beside float32
ones; no input scale), and processors whose row-independent part only bans
tokens (``static_bans``). Anything else takes ``DraftModel``'s general path.

An int8 head runs in two stages (``decoder_step_cpu.DraftHeadWeights.packed4``,
draft_head4.h): every column from an int4 copy made here (half the bytes of
the step's largest stream), its best 32 columns a row again in int8, the
argmax over those. Measured on Whisper base (AVX-512 Zen 4, 2 threads, a
quiet host, medians): the head alone 1.10 -> 0.60 ms, a one-row draft step
with 1500 cross slots 3.08-3.39 -> 2.62-2.92 ms (the two read by turns);
``benchmarks.spec_bench --whisper`` (base float32, int8 self-draft, k 12,
6 minutes, four runs each by turns) 1.25-1.32x -> 1.29-1.37x best/best
(medians 1.28 -> 1.36x), the same 778 of 827 drafts accepted; the token was
the int8 head's in every one of the 1187 draft steps of an 8-minute file.
The copy costs 13 MB and ~0.4 s at load for base.

What must hold: the drafts are the general path's up to the final
LayerNorm's float32 rounding (the C one sums in double), so a near tie may
go either way, and the two-stage head's are the int8 head's whenever the
int8 winner is among its candidates; the target verifies every draft, so
either changes how many are kept, never a token.
"""
from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import numpy as np
import torch

from encdec.kernels.cpu import small_linear_int4
from encdec.kernels.cpu.decoder_step_cpu import DraftHeadWeights, DraftSteps
from encdec.worker.draft_head import DraftHead, head_parts


def _head_weights(model: torch.nn.Module, head: DraftHead | None) -> DraftHeadWeights | None:
    """The draft's LM head (or its reduced one) as the kernel runs it, or None."""
    if head is not None:
        lin, bias, scale, ids = head.head, None, head.input_scale, head.ids
    else:
        try:
            lin, bias, scale = head_parts(model)
        except ValueError:
            return None
        ids = None
    if scale is not None or lin.widened or lin.weight.device.type != "cpu":
        return None
    if lin.bias is not None:
        bias = lin.bias if bias is None else lin.bias + bias
    bias = None if bias is None else bias.detach().float().contiguous()
    if lin.quant_method is not None:
        if not lin.int8_small_rows:
            return None
        packed, rows = lin.int8_panel_weight(), lin.weight.detach()
        # the two-stage head (draft_head4.h): its int4 copy made here, once a draft
        packed4 = small_linear_int4.from_int8(packed) if rows.dtype == torch.int8 else None
        if packed4 is None or not rows.is_contiguous():
            return DraftHeadWeights(lin.out_features, packed=packed, bias=bias, ids=ids)
        return DraftHeadWeights(lin.out_features, packed=packed, packed4=packed4, rows8=rows, bias=bias, ids=ids)
    if not lin.small_rows:
        return None
    return DraftHeadWeights(lin.out_features, panels=lin.panel_weight(), bias=bias, ids=ids)


def static_bans(apply_static: Callable[[torch.Tensor], Any] | None, vocab: int,
                ids: torch.Tensor | None) -> list[int] | None:
    """The head columns the processors' row-independent part bans: the
    entries it sets to -inf in a zero row (of ids ``ids`` for a reduced head);
    None where it changes any other entry (more than a ban: the general path)."""
    if apply_static is None:
        return []
    row = torch.zeros(1, vocab)
    got = apply_static(row)
    values = (row if got is None else got)[0].numpy()
    banned = np.isneginf(values)
    if np.count_nonzero(values) != np.count_nonzero(banned):  # a finite change somewhere
        return None
    if ids is not None:
        banned = banned[ids.numpy()]
    return np.flatnonzero(banned).tolist()


class FusedDraft:
    """A draft model's proposals in C calls (the module docstring)."""

    def __init__(self, steps: DraftSteps, width: int, ids: torch.Tensor | None):
        self.steps, self.width, self.ids = steps, width, ids  # width: the full logits' (what apply_static edits)

    @classmethod
    def build(cls, model: torch.nn.Module, head: DraftHead | None) -> FusedDraft | None:
        """For ``model`` (and its reduced ``head``), or None where this path does not apply."""
        parts = getattr(model, "draft_step_parts", None)
        parts = parts() if parts is not None else None
        if parts is None:
            return None
        weights, tok_embed, pos_embed, norm = parts
        head_weights = _head_weights(model, head)
        if head_weights is None or not DraftSteps.fits(weights, tok_embed, pos_embed, norm, head_weights):
            return None
        width = head.full_size if head is not None else head_weights.n
        return cls(DraftSteps(weights, tok_embed, pos_embed, norm, head_weights), width, head_weights.ids)

    def propose(self, rows: list[Any], kv_caches: list[torch.Tensor], self_tables: list[list[int]],
                cross_tables: list[list[int]], apply_static: Callable[[torch.Tensor], Any] | None,
                stops: dict[int, Collection[int]], *, cross_i8: bool = False) -> dict[int, list[int]] | None:
        """``rows`` (``DraftRow``s, their last token each the input) drafting up
        to ``k`` tokens each, ending after a stop token; their tables in
        ``kv_caches`` (``cross_i8``: cross blocks of int8 records, ``DraftKV``).
        None, nothing run, where the kernel declines them."""
        bans = static_bans(apply_static, self.width, self.ids)
        if bans is None or not self.steps.start(
                kv_caches, [r.token_ids[-1] for r in rows], [len(r.token_ids) - 1 for r in rows], self_tables,
                cross_tables, [len(r.meta.encoder_seq_data.prompt_token_ids) for r in rows], bans,
                [r.k for r in rows], cross_i8=cross_i8):
            return None
        out: dict[int, list[int]] = {r.seq_id: [] for r in rows}
        live = list(rows)
        while live:
            for r, tok in zip(live, self.steps.step()):
                out[r.seq_id].append(tok)
            keep = [i for i, r in enumerate(live)
                    if len(out[r.seq_id]) < r.k and out[r.seq_id][-1] not in stops[r.seq_id]]
            if len(keep) < len(live):
                live = [live[i] for i in keep]
                self.steps.keep(keep)
        return out
