"""A draft's LM head restricted to a subset of the vocabulary
(``speculative_config.draft_vocab_size``; ``spec_decode.draft_vocab`` picks the ids).

The head's rows of those ids are gathered once, at load, into one contiguous
matrix run the way the model's own head runs (int8 panels for an int8 draft,
float32 otherwise), so a draft step streams a fraction of the head's bytes.
Its argmax maps back to the full vocabulary's ids. The processors'
row-independent bans (``apply_static``) see full-width logits: the subset's
values scattered into a row of -inf.

What must hold: the reduced head's logits are the full head's at those ids
(per-output-channel int8 rows are their own quantization, and activations are
quantized per row, so gathering changes no value); ``DraftHead`` checks this
once at load on random rows and refuses a model whose head it cannot mirror.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from encdec import quantization
from encdec.models.layers import Linear


def head_parts(model: nn.Module) -> tuple[Linear, torch.Tensor | None, float | None]:
    """The model's LM head, the bias added to its output (BART's
    ``final_logits_bias``) and the scale its input takes first (T5's
    ``output_scale``): what each family's ``compute_logits`` applies."""
    head = getattr(model, "proj_out", None)
    if head is None:
        head = getattr(model, "lm_head", None)
    if not isinstance(head, Linear):
        raise ValueError(f"speculative_config.draft_vocab_size: {type(model).__name__} has no LM head to restrict")
    bias = getattr(model, "final_logits_bias", None)
    return head, None if bias is None else bias[0], getattr(model, "output_scale", None)


def _gathered(head: Linear, ids: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    """A ``Linear`` of ``head``'s rows ``ids`` (and ``bias``'s entries there),
    run as ``head`` runs. An int8 head's rows are requantized from their
    dequantized values, which gives back the same int8 rows (each row's
    largest value is 127 of its scale); its scales are then copied exactly."""
    sub = Linear(head.in_features, len(ids), bias=bias is not None or head.bias is not None)
    w = head.weight.detach()[ids]  # (n, d_model)
    if head.quant_method is not None:
        w = w.float() * head.weight_scale[ids, None]
    sub.weight = nn.Parameter(w.contiguous(), requires_grad=False)
    if sub.bias is not None:
        b = torch.zeros(len(ids)) if head.bias is None else head.bias.detach()[ids].float()
        sub.bias = nn.Parameter(b if bias is None else b + bias[ids].float(), requires_grad=False)
    if head.quant_method is not None:
        sub.quantize_int8(head.quant_method.path)
        sub.weight_scale.copy_(head.weight_scale[ids])
    else:
        sub.widened = head.widened
        if head.packed is not None:
            sub.pack()
    return sub


# Runs of consecutive kept ids copied as slices into full-width logits (Whisper's: two).
MAX_RUNS = 16


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """``ids`` (ascending) as runs of consecutive ids: (first id, past the last, index of the first in ``ids``)."""
    runs: list[tuple[int, int, int]] = []
    for j, i in enumerate(ids):
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1, runs[-1][2])
        else:
            runs.append((i, i + 1, j))
    return runs


def row_argmax(logits: torch.Tensor) -> list[int]:
    """Each row's argmax (the first of equal maxima, a NaN first, as torch's).
    On CPU numpy's: vectorised, ~4 us over Whisper's 51 864 logits against
    torch's ~45 us, once per draft step."""
    if logits.device.type == "cpu":
        return logits.numpy().argmax(-1).tolist()
    return logits.argmax(dim=-1).tolist()


class DraftHead(nn.Module):
    """The LM head of ``model`` at ``ids`` (ascending token ids)."""

    def __init__(self, model: nn.Module, ids: list[int]):
        super().__init__()
        head, bias, self.input_scale = head_parts(model)
        self.full_size = head.out_features
        self.vocab_size = len(ids)  # quantization.place_decode_panels: the LM head is the Linear this wide
        self.id_list = list(ids)
        self.runs = _runs(self.id_list)
        self.register_buffer("ids", torch.tensor(ids, dtype=torch.long, device=head.weight.device))
        self.head = _gathered(head, self.ids, bias)
        quantization.place_decode_panels(self)  # int8: its panels on huge pages, as the full head's
        self._check(model)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(rows, d_model) -> (rows, len(ids)) float32: the full head's logits at ``ids``."""
        if self.input_scale is not None:
            hidden = hidden * self.input_scale
        return self.head(hidden).float()

    def greedy(self, hidden: torch.Tensor, apply_static: Callable[[torch.Tensor], torch.Tensor] | None) -> list[int]:
        """Each row's argmax over the subset, as full-vocabulary ids; with
        ``apply_static``, over the subset less what it bans."""
        sub = self.logits(hidden)
        if apply_static is None:
            return [self.id_list[i] for i in row_argmax(sub)]
        full = torch.full((sub.shape[0], self.full_size), float("-inf"), device=sub.device)
        if len(self.runs) <= MAX_RUNS:  # a slice copy a run: index_copy_ took ~75 us over 34 376 ids
            for start, stop, src in self.runs:
                full[:, start:stop] = sub[:, src:src + stop - start]
        else:
            full.index_copy_(1, self.ids, sub)
        return row_argmax(apply_static(full))

    @torch.inference_mode()
    def _check(self, model: nn.Module) -> None:
        gen = torch.Generator().manual_seed(0)
        w = self.head.weight
        dtype = w.dtype if w.is_floating_point() and not self.head.widened else torch.float32
        hidden = torch.randn(2, self.head.in_features, generator=gen).to(self.ids.device, dtype)
        want = model.compute_logits(hidden).float()[:, self.ids]
        got = self.logits(hidden)
        tol = 1e-4 * float(want.abs().max()) + 1e-6
        if got.shape != want.shape or float((got - want).abs().max()) > tol:
            raise ValueError(f"speculative_config.draft_vocab_size: {type(model).__name__}'s LM head "
                             "is not one this engine can restrict (its logits at the kept ids differ)")
