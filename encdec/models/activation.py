"""The activations a ``Linear`` applies to its output (fused into the matmul where
a kernel can): their names, and the in-place pass every path falls back to."""
from __future__ import annotations

import torch

FUSED_ACTIVATIONS = ("gelu", "relu")  # what Linear.forward_act fuses into the matmul (exact GELU, ReLU)


def apply_act_(out: torch.Tensor, act: str) -> torch.Tensor:
    """``out`` with ``act`` ("gelu": exact, erf; "relu"; "none") applied in place."""
    if act == "gelu":
        return torch.ops.aten.gelu_(out)
    return out.relu_() if act == "relu" else out
