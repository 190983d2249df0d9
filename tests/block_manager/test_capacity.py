"""The entry check's block arithmetic, against the block manager it mirrors."""
from __future__ import annotations

import subprocess
import sys

import pytest

from encdec.block_manager.capacity import kv_blocks_needed


@pytest.mark.parametrize("dec, enc, max_tokens, best_of, watermark, want", [
    # one sequence: blocks(dec + max_tokens - 1) + cross (+ watermark for a recompute)
    (2, 4, 200, 1, 0, (14, 13, 1)),
    (2, 4, 15, 1, 0, (2, 1, 1)),  # 16 tokens: the 16th is sampled, never written
    (2, 4, 16, 1, 0, (3, 2, 1)),
    (2, 1500, 446, 1, 1, (123, 28, 94)),  # Whisper: 447 tokens + 1500 positions + watermark
    # several: shared full prompt blocks once, the rest per sequence, a spare each
    (32, 16, 17, 3, 0, (2 + 3 * 1 + 1 + 3, 5, 1)),
    (2, 4, 200, 3, 0, (43, 39, 1)),
    # partial shared prompt block: the first decode asks for a copy per sequence
    (20, 16, 2, 2, 0, (1 + 2 * 1 + 1 + 2 + 1, 4, 1)),
    (20, 16, 1, 2, 0, (2 + 1 + 2, 2, 1)),  # max_tokens=1: no decode step
])
def test_worst_case_blocks(dec, enc, max_tokens, best_of, watermark, want):
    need = kv_blocks_needed(dec, enc, max_tokens=max_tokens, best_of=best_of, block_size=16,
                            watermark_blocks=watermark)
    assert (need.total, need.self_attention, need.cross_attention) == want
    assert need.reserve == want[0] - want[1] - want[2]


def test_no_torch():
    code = "import sys, encdec.block_manager.capacity; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
