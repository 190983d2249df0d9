"""Speculative decoding: our engine with and without ``speculative_config``, same
weights, one process.

The copy workload: the BART trained by ``benchmarks.train_copy_model`` (extractive
summaries that copy marked sentences of a ~200-token synthetic document; random
weights never copy, so they would prove exactness, not speed). Held-out documents
are decoded greedily at each concurrency level (``--requests``: that many requests
per ``generate`` call, the same ``--docs`` documents every level), once without
speculation and once per ``ngram`` setting (``--k``, ``--lookup-max``,
``--lookup-min``). Each side has its own engine (built once, encoder cache off so
every request runs its encoder); the sides alternate within each of ``--repeats``
rounds; the best round and the median of per-round ratios are reported. Outputs must be token-identical to the side
without speculation.

    python -m benchmarks.spec_bench [--requests 1 8 64] [--k 3 5] [--repeats 3]
                                    [--admission waves continuous]
                                    [--model-dir DIR] [--threads N] [--no-spec]

``--admission``: ``waves`` decodes the documents in ``generate`` calls of
``--requests`` each (a wave drains before the next starts); ``continuous`` in one
call with at most ``--requests`` running, a request joining as one finishes (a
server with that many clients in flight). Both by default.

Prints the host ISA header, then per level and side: tok/s (generated tokens over
wall time), the ratio to no speculation, the acceptance rate (accepted over proposed
draft tokens, from ``LLMEngine.get_stats()``), the held-out exact match, and the CPU
other processes used meanwhile (the machine is shared). ``--no-spec`` times the side
without speculation alone (a smoke run of the harness).

``--whisper``: Whisper tiny.en and base (``--whisper-models``; base when its weights
packages are installed), sequential long-form on one file of ``--minutes`` built from
the shipped clips (``benchmarks.whisper_longform.build_file``, seed 0), float32 and
int8 (``--compute-types``), each side's end-to-end seconds, the ratio and the
acceptance; each file's text and tokens must be identical across sides.
``--method``: ``ngram`` (default) and/or ``draft_model`` (an int8 self-draft of the
target, ``{"method": "draft_model", "model": <target>, "quantization": "int8"}``);
``--draft-vocab-size``: one draft side per value, ``full`` (the whole LM head) or N
(``"draft_vocab_size": N``: the draft's head keeps the N lowest ids and the special
ones), so the acceptance each costs shows beside its speed.

    python -m benchmarks.spec_bench --whisper [--whisper-models tiny base]
        [--compute-types float32 int8] [--minutes 6] [--method ngram draft_model] [--k 3]
        [--draft-vocab-size full 8192 16384]

A workload is a ``Workload`` (prompts, sampling parameters, engine options, a label);
the timing loop knows nothing else about it (``decode``: how a batch runs, e.g.
``transcribe``), so another model family adds a workload and its command-line group
beside ``copy_workload`` and ``whisper_workload``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

from encdec.bench.common import OtherCPUMonitor, allocator_for_both_sides, isa_header

DEFAULT_MODEL_DIR = os.path.join(os.path.expanduser("~"), ".cache", "encdec", "copy_bart")
# LLMEngine.get_stats() fields read for acceptance (vLLM's spec_decode metric names).
DRAFT_FIELD = "spec_decode_num_draft_tokens"
ACCEPTED_FIELD = "spec_decode_num_accepted_tokens"


@dataclass
class Workload:
    """What a side decodes: ``batches`` of prompts (one ``generate`` call each, so
    a batch's size is the concurrency), their parameters, and engine options."""

    label: str
    batches: list[list[Any]]
    params: Any
    engine_options: dict[str, Any] = field(default_factory=dict)
    references: list[list[int]] | None = None  # expected outputs (token ids) per prompt, if known
    # (engine, batch, params) -> (outputs, tokens generated); None: ``generate`` with ``params``,
    # outputs the token ids (Whisper: ``transcribe``, outputs each file's text and tokens)
    decode: Callable[[Any, list[Any], Any], tuple[list[Any], int]] | None = None
    warm: list[Any] | None = None  # the untimed warm-up batch (default: the first batch)


@dataclass
class Side:
    """One engine configuration: ``spec`` is the ``speculative_config`` (None: off)."""

    name: str
    spec: dict[str, Any] | None


@dataclass
class Result:
    seconds: float
    tokens: int
    outputs: list[Any]  # per prompt: its token ids (Whisper: each file's text and tokens)
    drafted: int | None  # draft tokens proposed meanwhile (None: the engine does not say)
    accepted: int | None
    other_cpu: float
    rows: int | None = None  # rows verified with drafts meanwhile (None: the engine does not say)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def sides_for(ks: list[int], lookup_max: int, lookup_min: int, no_spec: bool,
              methods: tuple[str, ...] = ("ngram",), model_dir: str | None = None,
              draft_vocab_sizes: tuple[int | None, ...] = (None,)) -> list[Side]:
    """No speculation first, then one side per method and k (none with
    ``no_spec``). ``draft_model`` drafts with an int8 copy of the target itself
    (``model_dir``): the int8 self-draft, one side per ``draft_vocab_sizes``
    (None: the full LM head)."""
    sides = [Side("off", None)]
    if no_spec:
        return sides
    for method in methods:
        for k in ks:
            if method == "ngram":
                sides.append(Side(f"ngram k={k}", {"method": "ngram", "num_speculative_tokens": k,
                                                   "prompt_lookup_max": lookup_max, "prompt_lookup_min": lookup_min}))
            elif method == "draft_model":
                for n in draft_vocab_sizes:
                    spec = {"method": "draft_model", "model": model_dir, "num_speculative_tokens": k,
                            "quantization": "int8"}
                    if n is not None:
                        spec["draft_vocab_size"] = n
                    sides.append(Side(f"int8 draft k={k}" + ("" if n is None else f" V={n}"), spec))
            else:
                raise ValueError(f"--method: unknown {method!r} (ngram, draft_model)")
    return sides


def copy_workload(model_dir: str, docs: int, concurrency: int, max_tokens: int | None = None,
                  continuous: bool = False) -> Workload:
    """Held-out documents of the copy model's task (its manifest says which task and
    seed), greedy, in ``generate`` calls of ``concurrency`` requests (waves: each
    call's batch drains before the next starts), or, ``continuous``, in one call
    with at most ``concurrency`` running (``max_num_seqs``): a request joins as one
    finishes, as a server with that many clients in flight sees them."""
    from encdec import SamplingParams, TokensPrompt
    from encdec.bench.copy_model import held_out, read_manifest, source_ids, task_from_manifest

    manifest = read_manifest(model_dir)
    if manifest is None:
        raise ValueError(f"--model-dir {model_dir} holds no copy model (no manifest); "
                         f"make one with: python -m benchmarks.train_copy_model --out {model_dir}")
    task = task_from_manifest(manifest)
    examples = held_out(task, docs, manifest["options"]["seed"])
    prompts = [TokensPrompt(prompt_token_ids=source_ids(d)) for d, _ in examples]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens or task.max_summary_len())
    if continuous:
        batches, how = [prompts], f"{concurrency} in flight, continuous admission"
    else:
        batches = [prompts[i:i + concurrency] for i in range(0, len(prompts), concurrency)]
        how = f"{concurrency} concurrent, in waves"
    return Workload(f"copy BART, {docs} held-out documents, {how}", batches, params,
                    dict(max_num_seqs=max(concurrency, 1), enable_encoder_cache=False),
                    references=[s + [2] for _, s in examples])


def whisper_workload(label: str, model_dir: str, wav: Any, warm: Any, quantization: str | None) -> Workload:
    """Sequential long-form transcription of one file (timestamps, previous-text
    prompts, temperature fallback), as ``benchmarks.whisper_longform`` runs it;
    the encoder cache is off, so every round runs every window's encoder."""
    options: dict[str, Any] = dict(enable_encoder_cache=False)
    if quantization is not None:
        options["quantization"] = quantization
    return Workload(f"Whisper {label} {quantization or 'float32'}, sequential long-form, "
                    f"{len(wav) / 16000:.0f} s of audio", [[(wav, 16000)]], None, options,
                    decode=_transcribe, warm=[(warm, 16000)])


def _transcribe(llm, batch: list[Any], params: Any) -> tuple[list[tuple[str, list[int]]], int]:
    """Each file's (text, every segment's tokens): sides must agree on both."""
    outs = []
    for t in llm.transcribe(batch, use_tqdm=False):
        outs.append((t.text, [tok for seg in t.segments for tok in seg.tokens]))
    return outs, sum(len(toks) for _, toks in outs)


def whisper_runs(args: argparse.Namespace) -> tuple[dict[str, dict[str, list[Result]]], list[str]]:
    """``--whisper``: each model (tiny.en, base when its packages are installed)
    and compute type, sides alternating on one long file built from the shipped clips."""
    from benchmarks.whisper_longform import build_file, load_clips, model_dirs
    from encdec.bench.common import SPEECH

    clips, texts = load_clips(SPEECH)
    wav = build_file(clips, texts, 0, args.minutes)[0]
    warm = build_file(clips, texts, 1000, 0.5)[0]  # not part of the timed file
    results, lines = {}, []
    for name in args.whisper_models:
        try:
            model_dir = next(iter(model_dirs([name]).values()))
        except (ImportError, SystemExit, OSError) as e:  # base: its weights packages may be absent
            lines.append(f"Whisper {name}: skipped ({e})")
            continue
        sides = sides_for(args.k, args.lookup_max, args.lookup_min, args.no_spec, tuple(args.method), model_dir,
                          tuple(args.draft_vocab_size))
        for quant in args.compute_types:
            work = whisper_workload(name, model_dir, wav, warm, None if quant == "float32" else quant)
            print(work.label, flush=True)
            results[work.label] = compare(model_dir, work, sides, args.repeats, args.threads)
            lines += report(work, sides, results[work.label])
    return results, lines


def _spec_counts(llm) -> tuple[int | None, int | None, int | None]:
    stats = llm.llm_engine.get_stats()
    return (getattr(stats, DRAFT_FIELD, None), getattr(stats, ACCEPTED_FIELD, None),
            getattr(stats, "spec_decode_num_drafts", None))


def _diff(after: int | None, before: int | None) -> int | None:
    return None if after is None or before is None else after - before


def run_side(llm, work: Workload) -> Result:
    """Decodes every batch of ``work`` on ``llm``, timed as a whole."""
    d0, a0, r0 = _spec_counts(llm)
    outputs: list[list[int]] = []
    with OtherCPUMonitor() as mon:
        t0 = time.perf_counter()
        tokens = 0
        for batch in work.batches:
            outs, n = (work.decode or _generate)(llm, batch, work.params)
            outputs += outs
            tokens += n
        seconds = time.perf_counter() - t0
    d1, a1, r1 = _spec_counts(llm)
    return Result(seconds, tokens, outputs, _diff(d1, d0), _diff(a1, a0), mon.mean(), _diff(r1, r0))


def _generate(llm, batch: list[Any], params: Any) -> tuple[list[list[int]], int]:
    outs = [list(o.outputs[0].token_ids) for o in llm.generate(batch, params, use_tqdm=False)]
    return outs, sum(map(len, outs))


def build_engine(model_dir: str, side: Side, work: Workload, threads: int | None):
    from encdec import LLM

    options = dict(work.engine_options, num_threads=threads, kv_cache_memory=256 << 20, swap_space=0.25)
    if side.spec is not None:
        options["speculative_config"] = side.spec
    return LLM(model_dir, **options)


def compare(model_dir: str, work: Workload, sides: list[Side], repeats: int,
            threads: int | None) -> dict[str, list[Result]]:
    """Every round's result per side (sides alternate within a round, after one
    untimed warm-up batch each); raises SystemExit if any side's outputs differ from
    the first side's."""
    engines = {s.name: build_engine(model_dir, s, work, threads) for s in sides}
    for s in sides:
        (work.decode or _generate)(engines[s.name], work.warm or work.batches[0], work.params)
    rounds: dict[str, list[Result]] = {s.name: [] for s in sides}
    for r in range(repeats):
        for s in sides:
            res = run_side(engines[s.name], work)
            print(f"  round {r + 1} {s.name:>10}: {res.tok_s:8.1f} tok/s ({res.tokens} tokens in "
                  f"{res.seconds:.2f} s){_acceptance(res) if s.spec else ''}; other processes' CPU "
                  f"{res.other_cpu:.0f}%", flush=True)
            rounds[s.name].append(res)
            if res.outputs != rounds[sides[0].name][0].outputs:
                raise SystemExit(f"{work.label}: outputs with {s.name} differ from {sides[0].name}")
    return rounds


def best_of(results: list[Result]) -> Result:
    return min(results, key=lambda r: r.seconds)


def round_ratios(base: list[Result], side: list[Result]) -> list[float]:
    """Speed-up of ``side`` over ``base`` within each round (the two ran back to
    back, so under much the same load from other processes)."""
    return [b.seconds / s.seconds for b, s in zip(base, side)]


def _acceptance(res: Result) -> str:
    if res.drafted is None or res.accepted is None:
        return ""
    rate = res.accepted / res.drafted if res.drafted else 0.0
    length = f", mean accepted length {1 + res.accepted / res.rows:.2f}" if res.rows else ""
    return f", acceptance {rate:.1%} ({res.accepted}/{res.drafted} drafts){length}"


def report(work: Workload, sides: list[Side], rounds: dict[str, list[Result]]) -> list[str]:
    """Summary lines: best tok/s per side, its ratio to the first side's best and the
    median of the per-round ratios (robust to a quiet moment favouring one side on a
    shared host), acceptance, and the held-out exact match (outputs are identical)."""
    base = best_of(rounds[sides[0].name])
    lines = [work.label + ":"]
    for s in sides:
        res = best_of(rounds[s.name])
        acc = _acceptance(res) if s.spec is not None else ""
        if s.spec is not None and res.drafted is None:
            acc = f", acceptance not reported (get_stats has no {DRAFT_FIELD})"
        med = statistics.median(round_ratios(rounds[sides[0].name], rounds[s.name]))
        lines.append(f"  {s.name:>10}: {res.seconds:7.2f} s, {res.tok_s:8.1f} tok/s (other CPU "
                     f"{res.other_cpu:.0f}%), best/best {base.seconds / res.seconds:5.2f}x, "
                     f"median per round {med:5.2f}x{acc}")
    if work.references is not None:
        hits = sum(o == ref for o, ref in zip(base.outputs, work.references))
        lines.append(f"  held-out exact match: {hits}/{len(work.references)}; outputs identical across sides: yes")
    return lines


def _vocab_size(text: str) -> int | None:
    """``--draft-vocab-size``'s values: "full" (None) or an int >= 1."""
    if text == "full":
        return None
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be 'full' or an int >= 1, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be 'full' or an int >= 1, got {n}")
    return n


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.spec_bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=DEFAULT_MODEL_DIR,
                    help="the copy model (benchmarks.train_copy_model's --out; default %(default)s)")
    ap.add_argument("--requests", type=int, nargs="+", default=[1, 8, 64], help="concurrency levels")
    ap.add_argument("--admission", nargs="+", default=["waves", "continuous"], choices=("waves", "continuous"),
                    help="waves: generate calls of --requests prompts each, each drained before the next; "
                         "continuous: one call, at most --requests running, a request joining as one finishes")
    ap.add_argument("--k", type=int, nargs="+", default=[3, 5], help="num_speculative_tokens per side")
    ap.add_argument("--lookup-max", type=int, default=4, help="prompt_lookup_max")
    ap.add_argument("--lookup-min", type=int, default=1, help="prompt_lookup_min")
    ap.add_argument("--docs", type=int, default=128, help="held-out documents decoded per side and round")
    ap.add_argument("--repeats", type=int, default=3, help="rounds; the best per side is reported")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: as configured)")
    ap.add_argument("--max-tokens", type=int, default=None, help="default: the task's longest summary")
    ap.add_argument("--no-spec", action="store_true", help="time the side without speculation only")
    ap.add_argument("--method", nargs="+", default=["ngram"], choices=("ngram", "draft_model"),
                    help="speculation methods (draft_model: an int8 self-draft of the target)")
    ap.add_argument("--draft-vocab-size", nargs="+", type=_vocab_size, default=[None], metavar="full|N",
                    help="draft_model: one side per value, the draft's LM head restricted to N ids "
                         "(speculative_config.draft_vocab_size) or full (default)")
    ap.add_argument("--whisper", action="store_true",
                    help="Whisper sequential long-form instead of the copy model")
    ap.add_argument("--whisper-models", nargs="+", default=["tiny", "base"], choices=("tiny", "base"))
    ap.add_argument("--compute-types", nargs="+", default=["float32", "int8"], choices=("float32", "int8"),
                    help="--whisper: the target's precision (int8: quantization='int8')")
    ap.add_argument("--minutes", type=float, default=6.0, help="--whisper: length of the long file")
    args = ap.parse_args(argv)
    for name in ("requests", "k"):
        if any(v < 1 for v in getattr(args, name)):
            ap.error(f"--{name} values must be >= 1, got {getattr(args, name)}")
    for name in ("docs", "repeats", "lookup_max", "lookup_min"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.lookup_min > args.lookup_max:
        ap.error(f"--lookup-min ({args.lookup_min}) must be <= --lookup-max ({args.lookup_max})")
    return args


def main(argv: list[str] | None = None) -> dict[Any, dict[str, list[Result]]]:
    args = parse_args(argv)
    import torch

    print(isa_header())
    print(f"threads {args.threads or torch.get_num_threads()}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, "
          f"{allocator_for_both_sides()}", flush=True)
    if args.whisper:
        results, lines = whisper_runs(args)
        print(f"\n{args.repeats} rounds per side:")
        print("\n".join(lines))
        return results
    sides = sides_for(args.k, args.lookup_max, args.lookup_min, args.no_spec, tuple(args.method), args.model_dir,
                      tuple(args.draft_vocab_size))
    results: dict[tuple[int, str], dict[str, list[Result]]] = {}
    lines: list[str] = []
    for c in args.requests:
        for admission in args.admission:
            if admission == "continuous" and c >= args.docs:
                continue  # one wave: the same run
            work = copy_workload(args.model_dir, args.docs, c, args.max_tokens, admission == "continuous")
            print(work.label, flush=True)
            results[(c, admission)] = compare(args.model_dir, work, sides, args.repeats, args.threads)
            lines += report(work, sides, results[(c, admission)])
    print(f"\n{args.repeats} rounds per side:")
    print("\n".join(lines))
    return results


if __name__ == "__main__":
    main()
