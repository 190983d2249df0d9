"""Decoder prefix cache: full self-attention blocks found again by content.

A decoder's self-attention K/V depend on the encoder output as well as on the
decoder tokens, so a block is keyed by the encoder input too. Block i of a
prompt is found by a chain hash::

    h(-1) = sha256("encdec-prefix" | encoder content key)
    h(i)  = sha256(h(i-1) | token ids of block i)       (only full blocks)

so equal hashes mean the same encoder input and the same decoder tokens up to
the block's end; a request without a content key (encoder cache off) is never
looked up nor registered.

The cache holds one reference of its own on each block it indexes; the block's
users hold the others. A registered block with no user left (reference count
1, the cache's) is cached-free: it keeps its K/V, stays findable, and is
counted as free (``num_evictable``), since ``make_room`` frees it, least
recently used first, when an allocation needs the room. Because a user of a
registered block never holds it alone (count >= 2), a write into it would
copy it first (copy-on-write, as forks do); the blocks registered are full
prompt blocks, which no later step writes. No torch here.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import TYPE_CHECKING

from encdec.block_manager.allocator import BlockAllocator

if TYPE_CHECKING:
    from encdec.sequence import Sequence, SequenceGroup

_ROOT = b"encdec-prefix\x00"


def block_hashes(key: str, token_ids: list[int], block_size: int) -> list[bytes]:
    """The chain hashes of the full blocks of ``token_ids`` under encoder key ``key``."""
    parent = hashlib.sha256(_ROOT + key.encode()).digest()
    out = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hashlib.sha256(parent + array("q", token_ids[start:start + block_size]).tobytes()).digest()
        out.append(parent)
    return out


def cacheable_tokens(seq_group: SequenceGroup, seq: Sequence) -> int:
    """Leading prompt tokens a prefill may skip (their hidden states are not
    computed): all but the last (its logits are sampled); none where prompt
    log-probs are asked (``prompt_logprobs``; ``prompt_token_logprobs`` on the
    first prefill: the runner reads them from a whole prefill's rows)."""
    params = seq_group.sampling_params
    if params is not None and (getattr(params, "prompt_logprobs", None) is not None
                               or (getattr(params, "prompt_token_logprobs", None) and seq.get_output_len() == 0)):
        return 0
    return seq.get_len() - 1


class PrefixCache:
    """The hash index of one device's registered blocks and their cached-free LRU."""

    def __init__(self, gpu: BlockAllocator, block_size: int) -> None:
        self.gpu = gpu
        self.block_size = block_size
        self.reset()

    def reset(self) -> None:
        """Nothing indexed (the allocator is reset by its owner)."""
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached-free blocks, oldest first
        self.num_queries = 0  # prompt tokens of requests looked up
        self.num_hits = 0  # of those, tokens found cached (their prefill skipped)
        self.num_evictions = 0  # cached-free blocks freed for room

    @property
    def num_evictable(self) -> int:
        """Cached-free blocks: free to any allocation (``make_room``)."""
        return len(self._lru)

    def is_registered(self, block: int) -> bool:
        return block in self._hash_of

    def lookup(self, key: str, token_ids: list[int], cacheable: int) -> tuple[list[bytes], list[int]]:
        """The prompt's full-block hashes, and the cached blocks of its longest
        cached prefix within its first ``cacheable`` tokens (``match``); counts
        the prompt's tokens as queried and the found ones as hits."""
        hashes = block_hashes(key, token_ids, self.block_size)
        blocks = self.match(hashes[: cacheable // self.block_size])
        self.num_queries += len(token_ids)
        self.num_hits += len(blocks) * self.block_size
        return hashes, blocks

    def register_all(self, table: list[int], hashes: list[bytes], start: int) -> None:
        """Register ``table``'s full blocks from index ``start`` (their K/V are
        written by this step's prefill)."""
        for i in range(start, len(hashes)):
            self.register(table[i], hashes[i])

    def register_computed(self, key: str, token_ids: list[int], table: list[int], num_tokens: int) -> None:
        """Register ``table``'s full blocks within the first ``num_tokens`` tokens
        (a prefill chunk: blocks whose K/V this step's chunk completes)."""
        for block, h in zip(table, block_hashes(key, token_ids[:num_tokens], self.block_size)):
            self.register(block, h)

    def match(self, hashes: list[bytes]) -> list[int]:
        """The blocks of the longest cached prefix of ``hashes``, each with one
        more reference (the caller's); cached-free ones are revived."""
        blocks = []
        for h in hashes:
            block = self._by_hash.get(h)
            if block is None:
                break
            self._lru.pop(block, None)
            self.gpu.incr_ref(block)
            blocks.append(block)
        return blocks

    def register(self, block: int, h: bytes) -> None:
        """Index ``block`` (whose K/V are, or are written this step, those of
        ``h``); the cache takes a reference. A hash already indexed keeps its block."""
        if h in self._by_hash or block in self._hash_of:
            return
        self._by_hash[h] = block
        self._hash_of[block] = h
        self.gpu.incr_ref(block)

    def unregister(self, block: int) -> None:
        """Forget ``block`` (its K/V were never written): the cache's reference goes."""
        h = self._hash_of.pop(block, None)
        if h is None:
            return
        del self._by_hash[h]
        self._lru.pop(block, None)
        self.gpu.free(block)

    def release(self, block: int) -> None:
        """A user's reference to a device block goes; a registered block left
        with only the cache's reference becomes cached-free (most recent last)."""
        self.gpu.free(block)
        if block in self._hash_of and self.gpu.get_ref_count(block) == 1:
            self._lru[block] = None

    def make_room(self, num_blocks: int) -> None:
        """Free cached-free blocks, least recently used first, until the
        allocator has ``num_blocks`` free below its mark (``CrossTables.make_room``
        says why below the mark)."""
        while self.gpu.get_num_free_warm_blocks() < num_blocks and self._lru:
            block, _ = self._lru.popitem(last=False)
            del self._by_hash[self._hash_of.pop(block)]
            self.num_evictions += 1
            self.gpu.free(block)
