"""What preempting one Whisper-tiny request by swapping costs: bytes moved and
the time of a swap-out + swap-in round trip through ``CacheEngine``.

Whisper-tiny's decoder: 4 layers, 6 heads, head_dim 64. Its cross cache holds
1500 encoder positions = 94 blocks of 16; a transcript adds a few self blocks.
The block pairs come from ``BlockSpaceManager.swap_out``/``swap_in`` on a real
group, so they have the layout the engine produces (the cross table is one run
on both sides); a scattered layout (every block its own run) is the worst case.

    python -m benchmarks.swap_bench [--device cpu|cuda] [--dtype float32|float16]
                                    [--self-blocks 4] [--runs 15] [--threads 1]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from encdec.attention.selector import get_attn_backend
from encdec.block_manager import BlockSpaceManager
from encdec.sequence import Sequence, SequenceGroup, SequenceStatus
from encdec.worker.cache_engine import CacheEngine, block_runs

from .common import OtherCPUMonitor

LAYERS, HEADS, HEAD_DIM, BLOCK = 4, 6, 64, 16
ENCODER_LEN = 1500  # 30 s of audio after the conv stem


def whisper_group(decoder_len: int) -> SequenceGroup:
    inputs = {"prompt_token_ids": [0] * decoder_len, "encoder_prompt_token_ids": [0] * ENCODER_LEN,
              "prompt": None, "encoder_prompt": None}
    seq = Sequence(0, inputs, BLOCK)
    encoder_seq = Sequence(0, inputs, BLOCK, from_decoder_prompt=False)
    return SequenceGroup("bench", [seq], 0.0, encoder_seq=encoder_seq)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(cache: CacheEngine, plan, device: torch.device, runs: int) -> list[float]:
    """Seconds per round trip; ``plan()`` yields (swap-out pairs, swap-in pairs)."""
    times = []
    for i in range(runs + 2):  # two warm-ups
        out_pairs, in_pairs = plan()
        sync(device)
        t0 = time.perf_counter()
        cache.swap_out(out_pairs)
        cache.swap_in(in_pairs)
        sync(device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None, *, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: float16 on CUDA, float32 on CPU")
    ap.add_argument("--self-blocks", type=int, default=4, help="decoder self blocks (16 tokens each)")
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads for torch (shared machine)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("float16" if device.type == "cuda" else "float32"))

    group = whisper_group(args.self_blocks * BLOCK)
    num_cross = -(-ENCODER_LEN // BLOCK)
    per_request = num_cross + args.self_blocks
    num_blocks = 3 * per_request
    bm = BlockSpaceManager(BLOCK, num_blocks, num_blocks, watermark=0.0)
    cache = CacheEngine(num_layers=LAYERS, num_kv_heads=HEADS, head_size=HEAD_DIM, block_size=BLOCK,
                        num_gpu_blocks=num_blocks, num_cpu_blocks=num_blocks, dtype=dtype, device=device,
                        backend=get_attn_backend(None, device.type))
    for layer in cache.gpu_cache + cache.cpu_cache:  # touch every page: no first-touch faults timed
        layer.fill_(1)
    bm.allocate(group)
    group.seqs[0].status = SequenceStatus.RUNNING

    def engine_layout():
        """What the scheduler asks for: BlockSpaceManager's own pairs."""
        out_pairs = bm.swap_out(group)
        group.seqs[0].status = SequenceStatus.SWAPPED
        in_pairs = bm.swap_in(group)
        group.seqs[0].status = SequenceStatus.RUNNING
        return out_pairs, in_pairs

    rng = random.Random(0)

    def scattered():
        """Worst case: no two blocks adjacent on either side."""
        src = rng.sample(range(0, num_blocks, 2), per_request)
        dst = rng.sample(range(1, num_blocks, 2), per_request)
        return list(zip(src, dst)), list(zip(dst, src))

    out_pairs, in_pairs = engine_layout()
    bytes_one_way = cache.bytes_moved(len(out_pairs))
    print(f"device {device} ({torch.get_num_threads()} CPU threads), {dtype}, "
          f"CPU swap area pinned: {cache.pin_memory}")
    print(f"Whisper-tiny request: {num_cross} cross + {args.self_blocks} self blocks of {BLOCK} tokens, "
          f"{cache.bytes_per_block / 1024:.0f} KiB per block (all {LAYERS} layers, K and V)")
    print(f"bytes moved per swapped request: {bytes_one_way:,} out + {bytes_one_way:,} in "
          f"= {2 * bytes_one_way / 2**20:.1f} MiB per round trip")
    print(f"engine layout: {len(block_runs(out_pairs))} runs out, {len(block_runs(in_pairs))} runs in "
          f"(a run = consecutive blocks on both sides, one copy per layer and K/V)")
    with OtherCPUMonitor() as mon:
        for name, plan in (("engine layout", engine_layout), ("scattered", scattered)):
            times = measure(cache, plan, device, args.runs)
            med = statistics.median(times)
            print(f"  {name:>13}: round trip median {med * 1e3:.2f} ms "
                  f"(min {min(times) * 1e3:.2f}, max {max(times) * 1e3:.2f}; {args.runs} runs) "
                  f"= {2 * bytes_one_way / med / 1e9:.2f} GB/s")
    print(mon.summary())


if __name__ == "__main__":
    main()
