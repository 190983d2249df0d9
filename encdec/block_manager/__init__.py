"""KV-cache block bookkeeping: self- and cross-attention block tables on the
GPU and in CPU swap space. Pure Python; never imports torch."""
from __future__ import annotations

from encdec.block_manager.manager import AllocStatus, BlockSpaceManager

__all__ = ["AllocStatus", "BlockSpaceManager"]
