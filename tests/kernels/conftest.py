"""The kernel tests run on one intra-op thread unless a test asks for more: the
machine's cores are shared."""
from __future__ import annotations

import torch

torch.set_num_threads(1)
