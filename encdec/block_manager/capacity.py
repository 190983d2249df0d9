"""How many KV blocks a request may hold at once, by the block manager's and the
scheduler's own arithmetic, so the engine can refuse at entry a request that
could never finish (the scheduler would end it mid-run with an error), and the
worker can refuse a cache too small for the longest request.
Pure arithmetic on ints: no torch.
"""
from __future__ import annotations

from dataclasses import dataclass

# Fraction of device blocks admission keeps free so running groups can still grow.
WATERMARK = 0.01


def watermark_blocks(num_gpu_blocks: int, watermark: float = WATERMARK) -> int:
    """Blocks admission keeps free out of ``num_gpu_blocks``: what the engine's
    KV sizing and entry checks count on top of a request's own blocks."""
    return int(watermark * num_gpu_blocks)


@dataclass(frozen=True)
class KVNeed:
    total: int  # blocks the request may need at once, reserve included
    self_attention: int  # decoder self-attention blocks at the peak, all sequences
    cross_attention: int  # cross-attention blocks (one table per request)

    @property
    def reserve(self) -> int:
        """Blocks the scheduler's checks ask for beyond what the request holds."""
        return self.total - self.self_attention - self.cross_attention


def blocks(tokens: int, block_size: int) -> int:
    """Blocks that hold ``tokens`` token slots."""
    return -(-tokens // block_size)


def kv_blocks_needed(dec_len: int, enc_len: int, *, max_tokens: int, best_of: int,
                     block_size: int, watermark_blocks: int) -> KVNeed:
    """The worst case of one request (decoder prompt ``dec_len``, encoder length
    ``enc_len``, ``best_of`` sequences of up to ``max_tokens`` new tokens):

      self     the prompt's full blocks, shared by the best_of sequences, plus
               each sequence's own blocks up to prompt + max_tokens - 1 tokens
               (the last sampled token's KV is never written); the first
               decode step asks for a copy of a shared partial block per
               sequence (can_append_slots counts the last sharer too)
      cross    the encoder length, once per request
      reserve  a preempted group with one live sequence may be recomputed:
               prompt + outputs + cross must then leave the watermark free
               (can_allocate); a swapped group of several sequences resumes
               only with a spare block per sequence (can_swap_in)
    """
    cross, prompt_blocks = blocks(enc_len, block_size), blocks(dec_len, block_size)
    last = dec_len + max_tokens - 1
    if max_tokens == 1:  # the prefill samples every sequence; no decode step
        self_peak = prompt_blocks
    else:
        full = dec_len // block_size
        self_peak = full + best_of * (blocks(last, block_size) - full)
        if best_of > 1 and dec_len % block_size:
            self_peak = max(self_peak, prompt_blocks + best_of)
    spare = best_of if best_of > 1 else 0
    total = max(self_peak + cross + spare, blocks(last, block_size) + cross + watermark_blocks)
    return KVNeed(total, self_peak, cross)


def longest_request_blocks(max_model_len: int, max_encoder_len: int, block_size: int,
                           num_gpu_blocks: int) -> tuple[int, int, int]:
    """(self, cross, watermark) blocks one request of the longest kind holds in a
    cache of ``num_gpu_blocks``: a ``max_model_len`` decoder sequence, a cross
    table over ``max_encoder_len`` encoder tokens, and what admission keeps free."""
    return (blocks(max_model_len, block_size), blocks(max_encoder_len, block_size),
            watermark_blocks(num_gpu_blocks))
