"""Speculative decoding at BART-large dims: our engine greedy without and with a
6-layer draft model, same target weights, one process, sides alternating.

    python -m benchmarks.spec_gpu [--dims large|tiny] [--device cuda|cpu] [--requests 256]
        [--k 3] [--rounds 3] [--quick] [--workdir DIR] [--dtype float32]
    python -m benchmarks.gpu_bench --parts spec [--quick]     (the same run, in gpu_check.sh)

The target is a random BART (``--dims large``: 12+12 layers, d_model 1024, 16
heads, ffn 4096, vocab 50265: ``gpu_bench.bart_large_dir``'s checkpoint). The
draft is written from it (``write_draft``): the target's embeddings, encoder,
LM head and its FIRST 6 decoder layers, saved as a checkpoint of its own with
6 decoder layers and the same tokenizer. A draft with random weights of its own
would almost never propose the target's token, so its acceptance would measure
nothing; a truncated copy shares the target's embeddings and the start of its
residual stream and so agrees with it often enough to time speculation. Random
weights still decide nothing about real acceptance: the ratio is what the
engine does with the acceptance it got, which this prints beside it.

Each side has its own engine (a fixed ``kv_cache_memory``, encoder cache off,
so every request runs its encoder); the speculating side has
``speculative_config={"method": "draft_model", "model": DRAFT, "num_speculative_tokens": k}``.
Each side first decodes a whole workload of the timed size drawn from another
seed, untimed; then per round the sides run back to back on the same requests
(greedy, each its own forced length: ``ignore_eos``). Every round's tokens must
equal the first side's first round: the run ends with SystemExit after its
summary where they do not. float32 by default: there greedy decoding is exact
(the project's parity rule), while in half precision the sides' different
batch shapes (a verify step has 1 + k rows per request) round differently and
may flip a near tie (this checkpoint's margins: docs/benchmarks.md). Prints per
round each side's tok/s and engine steps, then ``spec_bench``'s summary (best of the
rounds, best/best and median per-round ratios, acceptance from
``LLMEngine.get_stats()``) and one ``spec:`` line that ``gpu_check.sh`` collects.

At BART-large dims the random target's greedy output settles on one repeated
token within a few (init std 0.02, as ``make_random_bart`` warns), so the draft
agrees nearly always: the ratio is what a speculating step costs at full
acceptance (each verify keeps k + 1 tokens), an upper bound for k, not a
forecast for real text. ``--dims tiny`` (d_model 64, 4+4 layers, a 2-layer
draft, an init whose drafts are partly rejected) runs the same code on CPU in
seconds: the test of this harness.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import tempfile
from dataclasses import dataclass, field
from typing import Any

from .gpu_timing import StepClock, engine_options
from .spec_bench import Result, Side, Workload, best_of, report, round_ratios, run_side

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class Dims:
    """A random target's shape, its draft's decoder depth, and the workload's lengths."""

    vocab: int
    d_model: int
    layers: int  # encoder and decoder layers each
    heads: int
    ffn: int
    max_positions: int
    draft_layers: int  # the target's first decoder layers the draft keeps
    enc_lens: tuple[int, int]  # encoder input tokens per request, inclusive range
    out_lens: tuple[int, int]  # output tokens per request (forced), inclusive range
    kv_cache_memory: int  # bytes per engine (the draft's own pool comes on top)


DIMS = {
    # BART-large, gpu_bench's mixed encoder lengths; 16 GiB holds 256 such requests'
    # K/V (about 9.5 GiB in float32), so the cache never limits the batch.
    "large": Dims(50265, 1024, 12, 16, 4096, 1024, 6, (32, 512), (64, 128), 16 << 30),
    "tiny": Dims(1000, 64, 4, 4, 128, 256, 2, (8, 48), (8, 24), 64 << 20),
}


@dataclass
class SpecOptions:
    """How a run goes: its size, k, and where it runs."""

    requests: int = 256
    k: int = 3  # num_speculative_tokens
    rounds: int = 3
    device: str = "cuda"
    dtype: str = "float16"
    seed: int = 0
    engine: dict[str, Any] = field(default_factory=dict)  # more LLM options, both sides


def tiny_target_dir(root: str) -> str:
    """``--dims tiny``'s target. Not BART-large's init (std 0.02), whose greedy
    output repeats one token so that the draft agrees every time, nor the tests'
    usual 0.5, where a truncated draft never agrees: std 0.06 (positions 0.3)
    has drafts kept and rejected (KV rolled back) in the same run
    (docs/benchmarks.md)."""
    from encdec.testing import make_random_bart

    d = DIMS["tiny"]
    path = os.path.join(root, "bart_tiny_random")
    if not os.path.exists(os.path.join(path, CONFIG)):
        make_random_bart(path, vocab_size=d.vocab, d_model=d.d_model, layers=d.layers, heads=d.heads, ffn=d.ffn,
                         max_positions=d.max_positions, init_std=0.06, position_std=0.3)
    return path


def _dropped(key: str, keep: int) -> bool:
    """Whether ``key`` is a parameter of a decoder layer past the first ``keep``."""
    m = re.search(r"(?:^|\.)decoder\.layers\.(\d+)\.", key)
    return m is not None and int(m.group(1)) >= keep


def write_draft(target: str, decoder_layers: int, out: str | None = None) -> str:
    """A draft checkpoint made of ``target``'s first ``decoder_layers`` decoder
    layers and everything else it has (embeddings, encoder, LM head, tokenizer
    and generation config), at ``out`` (default: beside the target). Its
    config is written last, so an interrupted write is redone, not reused."""
    from safetensors.torch import load_file, save_file

    out = out or f"{target.rstrip('/')}_draft{decoder_layers}"
    if os.path.exists(os.path.join(out, CONFIG)):
        return out
    with open(os.path.join(target, CONFIG)) as f:
        config = json.load(f)
    have = config.get("decoder_layers")
    if not isinstance(have, int) or not 1 <= decoder_layers < have:
        raise ValueError(f"decoder_layers must be in [1, {have}) for a draft of {target} "
                         f"({have} decoder layers), got {decoder_layers}")
    shards = sorted(f for f in os.listdir(target) if f.endswith(".safetensors"))
    if not shards:
        raise ValueError(f"{target} holds no .safetensors weights to write a draft from")
    os.makedirs(out, exist_ok=True)
    for name in shards:
        tensors = load_file(os.path.join(target, name))
        save_file({k: v for k, v in tensors.items() if not _dropped(k, decoder_layers)},
                  os.path.join(out, name), metadata={"format": "pt"})
    if os.path.exists(os.path.join(target, INDEX)):
        with open(os.path.join(target, INDEX)) as f:
            index = json.load(f)
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not _dropped(k, decoder_layers)}
        with open(os.path.join(out, INDEX), "w") as f:
            json.dump(index, f)
    for name in os.listdir(target):  # tokenizer files, generation config
        if name not in (CONFIG, INDEX) and not name.endswith(".safetensors"):
            shutil.copy(os.path.join(target, name), out)
    config["decoder_layers"] = decoder_layers
    with open(os.path.join(out, CONFIG), "w") as f:
        json.dump(config, f, indent=2)
    return out


def workload(dims: Dims, n: int, seed: int) -> Workload:
    """``n`` greedy requests: random encoder inputs, each forced to its own length."""
    from encdec import SamplingParams, TokensPrompt

    rng = random.Random(seed)
    prompts, params = [], []
    for _ in range(n):
        enc = [rng.randrange(4, dims.vocab - 1) for _ in range(rng.randint(*dims.enc_lens))]
        prompts.append(TokensPrompt(prompt_token_ids=enc))
        params.append(SamplingParams(temperature=0.0, max_tokens=rng.randint(*dims.out_lens), ignore_eos=True))
    return Workload(f"{n} requests, greedy", [prompts], params)


def build_engine(model: str, spec: dict[str, Any] | None, dims: Dims, opts: SpecOptions) -> Any:
    """One side's engine. ``kv_cache_memory`` is fixed rather than profiled: on
    CUDA the profiled size is the engine's whole ``gpu_memory_utilization``
    share, sized before the draft loads, and the draft's own pool (the
    target's block count at the draft's depth: half the target's cache here)
    would not fit beside it, nor would two engines in one process."""
    from encdec import LLM

    options: dict[str, Any] = dict(device=opts.device, dtype=opts.dtype, kv_cache_memory=dims.kv_cache_memory,
                                   swap_space=1, enable_encoder_cache=False, max_num_seqs=min(opts.requests, 256))
    options.update(opts.engine)
    if spec is not None:
        options["speculative_config"] = spec
    return LLM(model, **options)


def first_difference(base: list[list[int]], other: list[list[int]], what: str) -> str | None:
    """None where ``other`` holds ``base``'s tokens, else which request and output position differ first."""
    for i, (a, b) in enumerate(zip(base, other)):
        if a != b:
            at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return (f"{what}: request {i}'s tokens differ from speculation off at output position {at} "
                    f"({a[at:at + 4]} against {b[at:at + 4]})")
    if len(base) != len(other):
        return f"{what}: {len(other)} outputs against {len(base)}"
    return None


@dataclass
class SidesRun:
    sides: list[Side]  # off first
    rounds: dict[str, list[Result]]  # per side, each round's result
    backend: str  # the attention backend's name
    differs: str | None  # the first difference from the first side's first round; None: identical


def run_sides(target: str, draft: str, dims: Dims, opts: SpecOptions) -> SidesRun:
    """Each side's engine, its warm-up, then ``opts.rounds`` rounds, sides back
    to back; every round's tokens compared with the first side's first round.
    A difference does not stop the run: a GPU lease still gets its timings."""
    sides = [Side("off", None), Side(f"draft k={opts.k}", {"method": "draft_model", "model": draft,
                                                          "num_speculative_tokens": opts.k})]
    engines = {s.name: build_engine(target, s.spec, dims, opts) for s in sides}
    work, warm = workload(dims, opts.requests, opts.seed), workload(dims, opts.requests, opts.seed + 1)
    for s in sides:
        run_side(engines[s.name], warm)
    rounds: dict[str, list[Result]] = {s.name: [] for s in sides}
    differs = None
    for r in range(opts.rounds):
        for s in sides:
            llm = engines[s.name]
            clock = StepClock(llm)
            res = clock.run(lambda: run_side(llm, work))
            rounds[s.name].append(res)
            print(f"  round {r + 1} {s.name:>10}: {res.tok_s:9.1f} tok/s ({res.tokens} tokens in {res.seconds:.2f} s); "
                  f"{clock.summary()}", flush=True)
            differs = differs or first_difference(rounds[sides[0].name][0].outputs, res.outputs,
                                                  f"round {r + 1} {s.name}")
    return SidesRun(sides, rounds, engines["off"].llm_engine.worker.backend.get_name(), differs)


def summary_line(run: SidesRun, dims_name: str, opts: SpecOptions) -> str:
    """The one ``spec:`` line: both sides' best tok/s, the ratio, acceptance, identity."""
    base, spec = run.rounds[run.sides[0].name], run.rounds[run.sides[1].name]
    off, on = best_of(base), best_of(spec)
    median = statistics.median(round_ratios(base, spec))
    drafted, accepted = on.drafted, on.accepted
    acc = ("acceptance not reported" if drafted is None or accepted is None else
           f"acceptance {accepted / drafted if drafted else 0.0:.1%} ({accepted}/{drafted} drafts)")
    same = "outputs identical" if run.differs is None else f"OUTPUTS DIFFER ({run.differs})"
    return (f"spec: encdec ({run.backend}) {off.tok_s:.1f} tok/s off, {on.tok_s:.1f} tok/s with a "
            f"{DIMS[dims_name].draft_layers}-layer draft k={opts.k}, ratio {off.seconds / on.seconds:.2f}x "
            f"(median per round {median:.2f}x), {acc}; BART-{dims_name} dims, random, {opts.requests} requests, "
            f"{off.tokens} output tokens, {opts.dtype} on {opts.device}, {same}")


def spec_part(target: str, dims_name: str, opts: SpecOptions) -> str:
    """The whole run on ``target`` (a random BART of ``DIMS[dims_name]``): the
    draft written beside it, rounds printed, ``spec_bench``'s summary, then the
    ``spec:`` line, printed and returned; SystemExit after it if any round's
    tokens differed."""
    dims = DIMS[dims_name]
    draft = write_draft(target, dims.draft_layers)
    run = run_sides(target, draft, dims, opts)
    work = workload(dims, opts.requests, opts.seed)
    work.label = f"BART-{dims_name} dims, {work.label}, {opts.rounds} rounds"
    print("\n".join(report(work, run.sides, run.rounds)), flush=True)
    line = summary_line(run, dims_name, opts)
    print(line, flush=True)
    if run.differs is not None:
        raise SystemExit(f"spec: {run.differs}")
    return line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.spec_gpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dims", default="large", choices=sorted(DIMS))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--dtype", default="float32", choices=("float16", "bfloat16", "float32"),
                    help="float32 by default, where greedy tokens must be identical; in half precision the "
                         "sides' different batch shapes may flip a near tie")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="64 requests, 2 rounds (gpu_check.sh)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default=None, help="where random checkpoints are written (default: a temp dir)")
    ap.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE", help="an LLM option, both sides")
    args = ap.parse_args(argv)
    for name in ("requests", "k", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.quick:
        args.requests, args.rounds = min(args.requests, 64), min(args.rounds, 2)
    args.engine = engine_options(args.engine, ap.error)
    return args


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("spec_gpu --device cuda needs a CUDA GPU; --dims tiny --device cpu runs it here")
    root = args.workdir or os.path.join(tempfile.gettempdir(), "encdec_gpu_bench")
    os.makedirs(root, exist_ok=True)
    if args.dims == "large":
        from .gpu_bench import bart_large_dir  # the bench's BART-large checkpoint, shared with its bart part

        target = bart_large_dir(root)
    else:
        target = tiny_target_dir(root)
    opts = SpecOptions(args.requests, args.k, args.rounds, args.device, args.dtype, args.seed, args.engine)
    return spec_part(target, args.dims, opts)


if __name__ == "__main__":
    main()
