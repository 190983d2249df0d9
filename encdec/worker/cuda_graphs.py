"""CUDA graphs for decode-only steps (vLLM's scheme for encoder/decoder models).

A decode step's launches (every layer's projections, the cache writes, the
paged-attention launches) are captured once per batch-size bucket after a
warm-up, and replayed: a step of ``n`` rows runs the smallest bucket ``b >= n``,
its inputs copied into the bucket's static buffers and padded::

    rows            0 .. n-1 real      n .. b-1 padding
    input_ids       the step's tokens  0
    positions       the step's         0
    slot_mapping    the step's slots   the pad slot (one block past the block
                                       manager's, never handed out)
    self groups     one per row        q_start stays at n: no rows, no launch work
    cross groups    the step's groups  (rows sharing a table, at most 16 each)
                    then empty ones

Padded rows compute garbage in rows nobody reads; the LM head takes real rows
only. Only the torch_native backend is captured: its decode metadata is plain
tensors of fixed shape once padded (the xFormers backend builds per-step bias
objects, torch_sdpa loops over sequences). Prefill-only steps and steps past
the largest bucket run eagerly; a step that mixes prefills with decodes runs
its prefills eagerly and its decode rows through a graph (the runner's
``_forward``). ``enforce_eager=True`` turns graphs off;
CPU never uses them.

Everything except ``capture`` and ``replay`` is plain tensor bookkeeping,
tested on CPU (tests/worker/test_cuda_graphs.py) by running the padded inputs
eagerly: exactly what a replay computes.
"""
from __future__ import annotations

import logging

import torch

from encdec.attention.backends.torch_native import MAX_GROUP_ROWS, PagedGroups, TorchNativeMetadata

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512  # rows; larger decode steps run eagerly (vLLM's default largest capture size)


def capture_sizes(max_num_seqs: int, max_size: int = MAX_CAPTURE_SIZE) -> list[int]:
    """Buckets as vLLM's: 1, 2, 4, multiples of 8 to 256, then of 16, up to the
    first that holds ``max_num_seqs`` rows (``max_size`` at most; a multiple of 16)."""
    top = min(max_num_seqs, max_size)
    candidates = [1, 2, 4] + list(range(8, min(max_size, 256) + 1, 8)) + list(range(272, max_size + 1, 16))
    return [s for s in candidates if s < top] + [next(s for s in candidates if s >= top)]


def graphs_wanted(device: torch.device, backend_name: str, enforce_eager: bool, *,
                  position_bias: bool = False) -> bool:
    """On by default on CUDA with the torch_native backend; never on CPU. Not for
    models with a position bias (T5): theirs is built in the forward from the
    step's host-side lengths, which a replay would not see change."""
    return device.type == "cuda" and backend_name == "torch_native" and not enforce_eager and not position_bias


def bucket_for(num_rows: int, sizes: list[int]) -> int | None:
    """The smallest bucket holding ``num_rows`` rows, None past the largest."""
    for s in sizes:
        if s >= num_rows:
            return s
    return None


def replayable(md: TorchNativeMetadata, self_width: int, cross_width: int) -> bool:
    """A decode-only step of one query row per sequence (the captured self groups'
    shape: not a prefill past prefix-cached tokens) whose tables fit the captured widths."""
    return (md.num_prefills == 0 and md.num_encoder_tokens == 0 and md.decode_self is not None
            and md.decode_self.max_q_len == 1 and md.decode_self.tables.shape[1] <= self_width
            and md.decode_cross.tables.shape[1] <= cross_width
            and md.decode_cross.max_q_len <= MAX_GROUP_ROWS)


class DecodeBuffers:
    """Static inputs of the largest bucket; a bucket's graph reads their first rows."""

    def __init__(self, max_rows: int, self_width: int, cross_width: int, block_size: int,
                 pad_slot: int, device: torch.device):
        i32 = dict(dtype=torch.int32, device=device)
        self.max_rows, self.block_size, self.pad_slot = max_rows, block_size, pad_slot
        self.input_ids = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_rows,), pad_slot, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(max_rows, **i32)
        self.enc_lens = torch.ones(max_rows, **i32)
        pad_block = pad_slot // block_size
        self.self_tables = torch.full((max_rows, self_width), pad_block, **i32)
        self.cross_tables = torch.full((max_rows, cross_width), pad_block, **i32)
        self.self_q_start = torch.arange(max_rows + 1, **i32)
        self.cross_q_start = torch.arange(max_rows + 1, **i32)
        self.self_kv_lens = torch.ones(max_rows, **i32)
        self.cross_kv_lens = torch.ones(max_rows, **i32)

    def metadata(self, rows: int, *, max_kv_len: int, max_enc_len: int) -> TorchNativeMetadata:
        """A decode step of ``rows`` rows over views of the buffers: what a graph is captured with."""
        dev = self.input_ids.device
        empty = torch.zeros(1, dtype=torch.int32, device=dev)
        return TorchNativeMetadata(
            num_prefills=0, num_prefill_tokens=0, num_decode_tokens=rows,
            slot_mapping=self.slot_mapping[:rows], seq_lens=[max_kv_len] * rows,
            seq_lens_tensor=self.seq_lens[:rows], max_prefill_seq_len=0, max_decode_seq_len=max_kv_len,
            max_query_len=1, query_start_loc=empty, seq_start_loc=empty,
            context_lens_tensor=self.seq_lens[:rows], block_tables=self.self_tables[:rows],
            encoder_seq_lens=[max_enc_len] * rows, encoder_seq_lens_tensor=self.enc_lens[:rows],
            encoder_seq_start_loc=empty, max_encoder_seq_len=max_enc_len, num_encoder_tokens=0,
            cross_slot_mapping=self.slot_mapping[:0], cross_block_tables=self.cross_tables[:rows],
            block_size=self.block_size,
            # Fixed launch shapes: one group per row for self; up to one per row for
            # cross, each at most MAX_GROUP_ROWS rows (one query tile).
            decode_self=PagedGroups(self.self_tables[:rows], self.self_q_start[:rows + 1],
                                    self.self_kv_lens[:rows], 1, max_kv_len),
            decode_cross=PagedGroups(self.cross_tables[:rows], self.cross_q_start[:rows + 1],
                                     self.cross_kv_lens[:rows], MAX_GROUP_ROWS, max_enc_len))

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, md: TorchNativeMetadata,
             bucket: int) -> None:
        """Copy a decode step of ``n <= bucket`` rows into the buffers and pad rows n..bucket-1."""
        n = input_ids.shape[0]
        s, c = md.decode_self, md.decode_cross
        groups = c.kv_lens.shape[0]
        self.input_ids[:n].copy_(input_ids)
        self.input_ids[n:bucket].zero_()
        self.positions[:n].copy_(positions)
        self.positions[n:bucket].zero_()
        self.slot_mapping[:n].copy_(md.slot_mapping)
        self.slot_mapping[n:bucket].fill_(self.pad_slot)
        self.self_tables[:n, : s.tables.shape[1]].copy_(s.tables)
        self.self_q_start[: n + 1].copy_(s.q_start_loc)
        self.self_q_start[n + 1: bucket + 1].fill_(n)
        self.self_kv_lens[:n].copy_(s.kv_lens)
        self.self_kv_lens[n:bucket].zero_()
        self.cross_tables[:groups, : c.tables.shape[1]].copy_(c.tables)
        self.cross_q_start[: groups + 1].copy_(c.q_start_loc)
        self.cross_q_start[groups + 1: bucket + 1].fill_(n)
        self.cross_kv_lens[:groups].copy_(c.kv_lens)
        self.cross_kv_lens[groups:bucket].zero_()


class DecodeGraphs:
    """Captured decode steps by bucket; ``replay`` or decline (None) per step."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], *, max_num_seqs: int,
                 max_model_len: int, max_encoder_len: int, block_size: int, pad_slot: int,
                 device: torch.device):
        self.model, self.kv_caches = model, kv_caches
        self.sizes = capture_sizes(max_num_seqs)
        self.self_width = -(-max_model_len // block_size)
        self.cross_width = -(-max_encoder_len // block_size)
        self.max_model_len, self.max_encoder_len = max_model_len, max_encoder_len
        self.buffers = DecodeBuffers(self.sizes[-1], self.self_width, self.cross_width, block_size,
                                     pad_slot, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def bucket(self, md: TorchNativeMetadata, num_rows: int) -> int | None:
        """The bucket a step replays, or None to run it eagerly."""
        if not self.graphs or not replayable(md, self.self_width, self.cross_width):
            return None
        b = bucket_for(num_rows, self.sizes)
        return b if b in self.graphs else None

    def _run(self, bucket: int) -> torch.Tensor:
        md = self.buffers.metadata(bucket, max_kv_len=self.max_model_len, max_enc_len=self.max_encoder_len)
        return self.model(self.buffers.input_ids[:bucket], self.buffers.positions[:bucket], self.kv_caches, md)

    @torch.inference_mode()
    def capture(self, warmup: int = 2) -> DecodeGraphs:
        """Capture every bucket, largest first (its memory pool then serves the
        smaller ones), each after ``warmup`` eager runs (compilation, autotuning)."""
        if self.buffers.input_ids.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device; run with enforce_eager=True elsewhere")
        pool = None
        for b in reversed(self.sizes):
            for _ in range(warmup):
                self._run(b)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = self._run(b)
            pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode steps of %s rows", self.sizes)
        return self

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, md: TorchNativeMetadata,
               bucket: int) -> torch.Tensor:
        """The step's hidden states (n, d): its inputs copied in, the bucket's graph replayed."""
        self.buffers.fill(input_ids, positions, md, bucket)
        self.graphs[bucket].replay()
        return self.outputs[bucket][: input_ids.shape[0]]
