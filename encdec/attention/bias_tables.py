"""The packed forms of a ``PositionBias`` the C kernels read, shared by the models
(the fused decode step) and the backends without either importing the other.

Both rely on T5's bias depending only on ``key - query``; both are memoized on the
bias object (one layer stack, one step), so each is built once for all layers.
"""
from __future__ import annotations

import torch

from encdec.attention.backends.abstract import PositionBias


def distance_table(bias: PositionBias, max_len: int) -> torch.Tensor:  # (H, max_len) float32
    """The paged kernel's ``position_bias``: ``[h, d]`` = the bias of a key d
    positions before its query. One query at ``max_len - 1`` over keys
    ``max_len - 1 .. 0`` serves every row of the step."""
    def make() -> torch.Tensor:
        keys = torch.arange(max_len - 1, -1, -1, device=bias.device)
        return bias.compute(keys[:1], keys)[:, 0].contiguous()
    return bias._memo(("distance", max_len), make)


def offset_table(bias: PositionBias, n: int) -> torch.Tensor:  # (H, 2n - 1) float32
    """The dense kernel's ``offset_bias`` for one sequence of ``n`` tokens over
    each other: ``[h, o]`` = the bias of a key ``o - (n - 1)`` positions after its query."""
    def make() -> torch.Tensor:
        keys = torch.arange(2 * n - 1, device=bias.device)
        return bias.compute(keys[n - 1: n], keys)[:, 0].contiguous()
    return bias._memo(("offsets", n), make)
