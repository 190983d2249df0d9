"""max_num_encoder_input_tokens: the encoder tokens one step's admissions may
run. No step's encoder work is over it except a single oversize input, which
runs alone; nobody starves; priorities still order admission; encoder cache
hits cost nothing; outputs are token for token those of the unbudgeted engine."""
from __future__ import annotations

import random

import pytest

from encdec import LLM, SamplingParams, TokensPrompt
from encdec.config import CacheConfig, SchedulerConfig
from encdec.core.scheduler import Scheduler
from encdec.engine.arg_utils import EngineArgs
from encdec.sampling_params import SamplingParams as Params
from encdec.sequence import Sequence, SequenceGroup, SequenceStatus

BS = 4


def make_scheduler(budget: int | None, *, policy: str = "fcfs", num_gpu: int = 512) -> Scheduler:
    cache = CacheConfig(block_size=BS)
    cache.num_gpu_blocks, cache.num_cpu_blocks = num_gpu, 64
    cfg = SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=64, max_model_len=256, policy=policy,
                          max_num_encoder_input_tokens=budget)
    return Scheduler(cfg, cache)


_ids = iter(range(10**6))


def make_group(request_id: str, enc_len: int, *, arrival: float, priority: int = 0,
               key: str | None = None, max_tokens: int = 3) -> SequenceGroup:
    inputs = {"prompt_token_ids": [2], "encoder_prompt_token_ids": list(range(5, 5 + enc_len)),
              "prompt": None, "encoder_prompt": None}
    seq = Sequence(next(_ids), inputs, BS)
    encoder_seq = Sequence(seq.seq_id, inputs, BS, from_decoder_prompt=False)
    return SequenceGroup(request_id, [seq], arrival, Params(temperature=0, max_tokens=max_tokens),
                         encoder_seq=encoder_seq, encoder_cache_key=key, priority=priority)


def run_steps(sched: Scheduler, max_steps: int = 200) -> list[tuple[list[str], int]]:
    """Steps until all finish: (admitted request ids, encoder tokens run) per step.
    Each group finishes after 3 tokens (set by hand: no model, no stop checker)."""
    steps = []
    for _ in range(max_steps):
        if not sched.has_unfinished_seqs():
            return steps
        metas, out = sched.schedule()
        prefills = metas[: out.num_prefill_groups]
        steps.append(([m.request_id for m in prefills],
                      sum(m.encoder_seq_data.get_len() for m in prefills if not m.cross_kv_cached)))
        for s in out.scheduled_seq_groups:
            s.seq_group.update_num_computed_tokens(s.token_chunk_size)
            for seq in s.seq_group.get_seqs(SequenceStatus.RUNNING):
                seq.append_token_id(7)
                if seq.get_output_len() >= 3:
                    seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
        sched.free_finished_seq_groups()
    raise AssertionError("requests left after max_steps")


def test_no_step_over_budget_and_an_oversize_input_alone():
    sched = make_scheduler(100)
    lens = [40, 40, 40, 150, 30, 60, 60, 100, 10]
    for i, n in enumerate(lens):
        sched.add_seq_group(make_group(f"r{i}", n, arrival=float(i)))
    steps = run_steps(sched)
    admitted = [r for ids, _ in steps for r in ids]
    assert admitted == [f"r{i}" for i in range(len(lens))]  # fcfs order, nobody starved
    for ids, tokens in steps:
        assert tokens <= 100 or len(ids) == 1, (ids, tokens)
    assert (["r3"], 150) in steps  # the oversize input, alone
    assert [ids for ids, _ in steps if ids][:2] == [["r0", "r1"], ["r2"]]


def test_without_budget_everything_goes_at_once():
    sched = make_scheduler(None)
    for i in range(6):
        sched.add_seq_group(make_group(f"r{i}", 80, arrival=float(i)))
    steps = run_steps(sched)
    assert steps[0] == ([f"r{i}" for i in range(6)], 480)


def test_encoder_cache_hits_cost_nothing():
    sched = make_scheduler(100)
    for i in range(5):  # one document, five requests: one encoder pass
        sched.add_seq_group(make_group(f"same{i}", 90, arrival=float(i), key="doc"))
    sched.add_seq_group(make_group("other", 90, arrival=9.0, key="doc2"))
    steps = run_steps(sched)
    assert steps[0] == ([f"same{i}" for i in range(5)], 90)
    assert steps[1] == (["other"], 90)


def test_priorities_order_admission_within_the_budget():
    sched = make_scheduler(100, policy="priority")
    for i, prio in enumerate([5, 1, 3, 0]):
        sched.add_seq_group(make_group(f"p{prio}", 60, arrival=float(i), priority=prio))
    steps = run_steps(sched)
    assert [ids for ids, _ in steps if ids] == [["p0"], ["p1"], ["p3"], ["p5"]]


def test_a_stream_of_small_inputs_does_not_starve_an_oversize_one():
    sched = make_scheduler(50)
    sched.add_seq_group(make_group("big", 500, arrival=0.5))
    for i in range(4):
        sched.add_seq_group(make_group(f"s{i}", 20, arrival=float(i)))
    steps = run_steps(sched)
    first = {r: k for k, (ids, _) in enumerate(steps) for r in ids}
    assert steps[first["big"]] == (["big"], 500)
    assert first["big"] <= 2  # after s0 (arrived first), before the later small ones


@pytest.mark.parametrize("bad", [0, -3, 1.5, True, "64"])
def test_bad_budget_is_refused(bad):
    with pytest.raises(ValueError, match="max_num_encoder_input_tokens"):
        EngineArgs(model="m", max_num_encoder_input_tokens=bad)
    with pytest.raises(ValueError, match="max_num_encoder_input_tokens"):
        SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=1, max_model_len=8,
                        max_num_encoder_input_tokens=bad)


def test_cli_option():
    import argparse

    from encdec.entrypoints.cli import _add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    _add_engine_args(p)
    args = p.parse_args(["--model", "m", "--max-num-encoder-input-tokens", "3000"])
    assert engine_kwargs(args)["max_num_encoder_input_tokens"] == 3000


OFF = 10**9  # no budget in effect


def _engine_steps(llm: LLM, pieces: list | None = None) -> list[tuple[int, float]]:
    """Wraps the scheduler: (admitted groups, encoder work in whole-pass tokens)
    of every step: the prefills that run their encoder whole, plus the pieces of
    split passes (a split pass's prefill runs none of it; ``pieces`` collects them)."""
    sched = llm.llm_engine.scheduler
    schedule, seen, split = sched.schedule, [], set()

    def counted(*args, **kwargs):
        metas, out = schedule(*args, **kwargs)
        prefills = metas[: out.num_prefill_groups]
        split.update(p.request_id for p in out.encoder.pieces)  # passes run by pieces
        whole = sum(m.encoder_seq_data.get_len() for m in prefills
                    if not m.cross_kv_cached and m.request_id not in split)
        seen.append((len(prefills), whole + sum((p.stop - p.start) / p.layers for p in out.encoder.pieces)))
        if pieces is not None:
            pieces.extend(out.encoder.pieces)
        return metas, out

    sched.schedule = counted
    return seen


def _assert_all_free(llm: LLM) -> None:
    engine = llm.llm_engine
    assert engine.num_free_blocks()[0] == engine.cache_config.num_gpu_blocks


@pytest.mark.parametrize("budget", [64, 200])
def test_bart_budget_on_matches_off_token_for_token(tiny_bart, budget):
    rng = random.Random(1)
    prompts = [TokensPrompt(prompt_token_ids=[0] + [rng.randrange(4, 90) for _ in range(rng.randint(3, 90))] + [2])
               for _ in range(24)]
    prompts += prompts[:4]  # repeats: encoder cache hits
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(2, 20), ignore_eos=True) for _ in prompts]
    got = {}
    for on in (OFF, budget):
        llm = LLM(tiny_bart, device="cpu", max_num_seqs=8, kv_cache_memory=64 << 20,
                  max_num_encoder_input_tokens=on)
        steps = _engine_steps(llm)
        got[on] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        _assert_all_free(llm)
        if on != OFF:
            assert all(tokens <= on or n == 1 for n, tokens in steps), steps
            assert max(tokens for _, tokens in steps) > 0
    assert got[budget] == got[OFF]


def test_whisper_budget_of_one_window_matches_off(ct2_dir, speech_clips):
    from encdec import TextPrompt

    wavs = speech_clips[2][:4]
    prompts = [TextPrompt(prompt="<|startoftranscript|><|notimestamps|>", multi_modal_data={"audio": (w, 16000)})
               for w in wavs]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    got = {}
    for on in (OFF, 1500):
        llm = LLM(ct2_dir, kv_cache_memory=256 << 20, swap_space=0.05, num_threads=2,
                  max_num_encoder_input_tokens=on)
        steps = _engine_steps(llm)
        got[on] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        _assert_all_free(llm)
        admitting = [(n, t) for n, t in steps if n]
        if on == OFF:
            assert admitting[0][0] == len(wavs)
        else:
            assert admitting == [(1, 1500)] * len(wavs)  # one 30 s window per step
    assert got[1500] == got[OFF]


# -- a pass split across steps (encdec.core.encoder_split) ------------------------


def split_scheduler(budget: int, layers: int, granule: int | None) -> Scheduler:
    cache = CacheConfig(block_size=BS)
    cache.num_gpu_blocks, cache.num_cpu_blocks = 512, 64
    cfg = SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=64, max_model_len=256,
                          max_num_encoder_input_tokens=budget, encoder_layers=layers, encoder_row_granule=granule)
    return Scheduler(cfg, cache)


def run_split_steps(sched: Scheduler, max_steps: int = 300) -> list[tuple[list[str], float, list]]:
    """As ``run_steps``, each step's (admitted ids, encoder work in whole-pass
    tokens counted from the prefills and pieces, the pieces as (id, start, stop))."""
    steps, split = [], set()
    for _ in range(max_steps):
        if not sched.has_unfinished_seqs():
            return steps
        metas, out = sched.schedule()
        prefills = metas[: out.num_prefill_groups]
        pieces = out.encoder.pieces
        split.update(p.request_id for p in pieces)  # passes run by pieces
        work = sum(m.encoder_seq_data.get_len() for m in prefills if not m.cross_kv_cached
                   and m.request_id not in split) + sum((p.stop - p.start) / p.layers for p in pieces)
        assert work == pytest.approx(out.encoder.tokens)
        steps.append(([m.request_id for m in prefills], work, [(p.request_id, p.start, p.stop) for p in pieces]))
        for s in out.scheduled_seq_groups:
            s.seq_group.update_num_computed_tokens(s.token_chunk_size)
            for seq in s.seq_group.get_seqs(SequenceStatus.RUNNING):
                seq.append_token_id(7)
                if seq.get_output_len() >= s.seq_group.sampling_params.max_tokens:
                    seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
        sched.free_finished_seq_groups()
    raise AssertionError("requests left after max_steps")


def test_a_pass_over_the_budget_goes_a_layer_a_step_while_others_run():
    sched = split_scheduler(100, layers=4, granule=None)
    sched.add_seq_group(make_group("run", 20, arrival=0.0, max_tokens=30))
    sched.add_seq_group(make_group("big", 300, arrival=1.0))
    sched.add_seq_group(make_group("after", 20, arrival=2.0))
    steps = run_split_steps(sched)
    # 100 tokens x 4 layers = 400 units a step, in whole layers of 300 rows: one
    # layer a step (the first beside "run"'s 20: 80 left, 320 units)
    assert steps[0] == (["run"], 95, [("big", 0, 300)])
    assert [p for _, _, p in steps[1:4]] == [[("big", 300, 600)], [("big", 600, 900)], [("big", 900, 1200)]]
    # admitted in the step after its last piece (its prefill not beside a piece); the order holds
    assert [ids for ids, _, _ in steps[1:5]] == [[], [], [], ["big", "after"]]
    assert steps[4][1] == 20  # the split pass costs its prefill's step nothing
    assert all(work <= 100 for _, work, _ in steps)


def test_rows_of_a_layer_per_piece_and_a_pass_alone_runs_whole():
    sched = split_scheduler(40, layers=4, granule=50)
    sched.add_seq_group(make_group("run", 20, arrival=0.0, max_tokens=8))
    sched.add_seq_group(make_group("big", 300, arrival=1.0))
    steps = run_split_steps(sched)
    pieces = [p for _, _, ps in steps for p in ps]
    # beside "run"'s 20 tokens: 80 units -> 1 x 50 rows; then 160 units -> 3 x 50 rows a step
    assert pieces[:3] == [("big", 0, 50), ("big", 50, 200), ("big", 200, 350)]
    assert all(work <= 40 for _, work, _ in steps[1:8])
    # "run" finishes after 8 tokens; nothing runs then: the rest of the pass goes whole
    last = next(k for k, (ids, _, _) in enumerate(steps) if ids == ["big"])
    done = pieces[-2][2]
    assert steps[last][2] == [("big", done, 1200)] and steps[last][1] == (1200 - done) / 4
    assert all(p[1] % 50 == 0 and p[2] % 50 == 0 for p in pieces)


def test_a_granule_over_the_budget_moves_in_a_step_of_its_own():
    sched = split_scheduler(10, layers=2, granule=None)  # a layer of 100 rows = 50 tokens > 10
    sched.add_seq_group(make_group("run", 20, arrival=0.0, max_tokens=30))
    sched.add_seq_group(make_group("big", 100, arrival=1.0))
    sched.add_seq_group(make_group("small", 4, arrival=2.0))
    steps = run_split_steps(sched)
    assert steps[1][2] == [("big", 0, 100)] and steps[1][0] == []
    assert steps[2][2] == [("big", 100, 200)] and steps[2][0] == []  # its last piece
    assert steps[3][0] == ["big", "small"]
    assert max(work for _, work, _ in steps[1:]) == 50


def test_encoder_cache_hit_after_a_split_pass_costs_nothing():
    sched = split_scheduler(50, layers=3, granule=None)
    sched.add_seq_group(make_group("run", 20, arrival=0.0, max_tokens=30))
    sched.add_seq_group(make_group("a", 90, arrival=1.0, key="doc"))
    sched.add_seq_group(make_group("b", 90, arrival=2.0, key="doc"))
    steps = run_split_steps(sched)
    first = {r: k for k, (ids, _, _) in enumerate(steps) for r in ids}
    assert [p for _, _, ps in steps for p in ps] == [("a", 0, 90), ("a", 90, 180), ("a", 180, 270)]
    assert first["b"] == first["a"] and steps[first["a"]][1] == 0  # b reads a's cross table
