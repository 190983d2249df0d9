"""An encoder pass over the encoder budget split across steps while others
decode (``encdec.core.encoder_split``, ``encdec.worker.encoder_pieces``, the
models' staged encoder): the staged encoder is ``encode``'s arithmetic exactly
(BART-shaped and T5 by layers, Whisper by rows of a layer, float32 and int8);
engines with small budgets give the unbudgeted engine's tokens on BART, T5
(chunked prefill, beams and n > 1 beside) and Whisper tiny.en, with every step's
encoder work within the budget; an abort mid-pass leaves no state and no block."""
from __future__ import annotations

import random

import pytest
import torch

from encdec import LLM, SamplingParams, TextPrompt, TokensPrompt
from encdec.sampling_params import BeamSearchParams
from encdec.worker.encoder_pieces import encoder_metadata

OFF = 10**9


def _staged(model, inputs: dict, md, granule: int) -> torch.Tensor:
    """The pass in pieces of ``granule`` rows (whole layers where the model has no row granule)."""
    state = model.encoder_start(inputs, md)
    rows = state.h.shape[-2]
    for layer in range(model.num_encoder_layers):
        for r0 in range(0, rows, granule if model.encoder_row_granule else rows):
            model.encoder_advance(state, layer, r0, min(rows, r0 + (granule if model.encoder_row_granule else rows)))
    return model.encoder_finish(state)


@pytest.mark.parametrize("family", ["bart", "t5", "m2m100"])
def test_token_families_staged_encoder_is_encode_exactly(tmp_path, family):
    import encdec.testing as t

    make = {"bart": t.make_random_bart, "t5": t.make_random_t5, "m2m100": t.make_random_m2m100}[family]
    llm = LLM(make(str(tmp_path / family)), kv_cache_memory=16 << 20, num_threads=1)
    worker = llm.llm_engine.worker
    model, ids = worker.model, [[0] + list(range(5, 60)) + [2], [0, 7, 9, 2]]
    with torch.inference_mode():
        for one in ids:
            inputs = model.build_encoder_inputs([one], [None], worker.device)
            md = encoder_metadata(worker.backend, [len(one)], worker.device)
            whole = model.encode(inputs["encoder_input_ids"], inputs["encoder_positions"], md)
            assert torch.equal(_staged(model, inputs, md, 1), whole)


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_whisper_rows_of_a_layer_are_its_whole_pass_exactly(ct2_dir, speech_clips, quantization):
    from encdec.kernels.cpu.build import cpu_isa

    llm = LLM(ct2_dir, kv_cache_memory=64 << 20, num_threads=2, quantization=quantization)
    worker = llm.llm_engine.worker
    model = worker.model
    feats = llm.llm_engine.process_request(
        TextPrompt(prompt="<|startoftranscript|>", multi_modal_data={"audio": (speech_clips[2][0], 16000)}),
        None)[0]["encoder_features"]
    with torch.inference_mode():
        inputs = model.build_encoder_inputs([[0] * 1500], [feats], worker.device)
        whole = model.encode(inputs["encoder_features"]).flatten(0, 1)
        for granule in (150, 450, 1500):
            assert torch.equal(_staged(model, inputs, None, granule), whole), (granule, cpu_isa())


def _steps(engine, pieces: list) -> list[tuple[int, float]]:
    """Wraps the scheduler: each step's (running groups, encoder work in whole-pass
    tokens from its prefills and pieces); ``pieces`` collects the pieces."""
    sched = engine.scheduler
    schedule, seen, split = sched.schedule, [], set()

    def counted(*args, **kwargs):
        running = len(sched.running)
        metas, out = schedule(*args, **kwargs)
        split.update(p.request_id for p in out.encoder.pieces)  # passes run by pieces
        whole = sum(m.encoder_seq_data.get_len() for m in metas[: out.num_prefill_groups]
                    if not m.cross_kv_cached and m.request_id not in split)
        seen.append((running, whole + sum((p.stop - p.start) / p.layers for p in out.encoder.pieces)))
        pieces.extend(out.encoder.pieces)
        return metas, out

    sched.schedule = counted
    return seen


def _arrive_and_run(engine, first: list, later: list, after: int) -> dict[str, list[int]]:
    """Queue ``first`` [(id, prompt, params)], step ``after`` times, queue ``later``, run to the end."""
    done: dict[str, list[int]] = {}

    def step() -> None:
        for out in engine.step():
            done[out.request_id] = [list(o.token_ids) for o in out.outputs]

    for rid, prompt, params in first:
        engine.add_request(rid, prompt, params)
    for _ in range(after):
        step()
    for rid, prompt, params in later:
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished_requests():
        step()
    return done


def _assert_clean(engine) -> None:
    runner = engine.worker.model_runner
    assert not runner.encoder_pieces.partial and not runner.encoder_outputs
    assert engine.num_free_blocks()[0] == engine.cache_config.num_gpu_blocks


def _doc(rng: random.Random, n: int) -> TokensPrompt:
    return TokensPrompt(prompt_token_ids=[0] + [rng.randrange(4, 90) for _ in range(n)] + [2])


@pytest.mark.parametrize("budget", [8, 30])
def test_bart_split_passes_match_unbudgeted(tiny_bart, budget):
    rng = random.Random(3)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    first = [(f"run{i}", _doc(rng, 10), greedy) for i in range(3)]
    later = [(f"doc{i}", _doc(rng, 80 + 7 * i), SamplingParams(temperature=0, max_tokens=6 + i, ignore_eos=True))
             for i in range(5)]
    later.append(("beam", _doc(rng, 70), BeamSearchParams(2, 5, num_return_sequences=2)))
    later.append(("n2", _doc(rng, 75), SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=5, ignore_eos=True)))
    got, pieces = {}, []
    for on in (OFF, budget):
        engine = LLM(tiny_bart, max_num_seqs=16, kv_cache_memory=64 << 20, num_threads=1,
                     max_num_encoder_input_tokens=on).llm_engine
        steps = _steps(engine, pieces if on != OFF else [])
        got[on] = _arrive_and_run(engine, first, later, after=2)
        _assert_clean(engine)
    assert got[budget] == got[OFF]
    assert pieces and {p.request_id for p in pieces} >= {"doc0", "beam", "n2"}
    # within the budget, or one layer of one pass (the least a split pass moves), or alone
    limit = max(budget, max(p.rows / p.layers for p in pieces))
    assert all(work <= limit or running == 0 for running, work in steps), steps
    assert any(running and work > budget for running, work in steps) == (limit > budget)


def test_t5_split_passes_with_chunked_prefill_match(tmp_path):
    from encdec.testing import make_random_t5

    path = make_random_t5(str(tmp_path / "t5"))
    rng = random.Random(5)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    first = [(f"run{i}", _doc(rng, 8), greedy) for i in range(2)]
    later = [(f"doc{i}", {"encoder_prompt": _doc(rng, 60 + i), "decoder_prompt": _doc(rng, 9)}, greedy)
             for i in range(3)]
    got, pieces = {}, []
    for on in (OFF, 12):
        engine = LLM(path, kv_cache_memory=64 << 20, num_threads=1, enable_chunked_prefill=True,
                     max_num_batched_tokens=8, max_num_encoder_input_tokens=on).llm_engine
        _steps(engine, pieces if on != OFF else [])
        got[on] = _arrive_and_run(engine, first, later, after=1)
        _assert_clean(engine)
    assert got[12] == got[OFF] and pieces


def _whisper(wav) -> TextPrompt:
    return TextPrompt(prompt="<|startoftranscript|><|notimestamps|>", multi_modal_data={"audio": (wav, 16000)})


def test_whisper_rows_split_matches_unbudgeted(ct2_dir, speech_clips):
    wavs = speech_clips[2]
    stream = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    first = [(f"s{i}", _whisper(wavs[i]), stream) for i in range(2)]
    later = [(f"u{i}", _whisper(wavs[2 + i]), SamplingParams(temperature=0.0, max_tokens=8)) for i in range(3)]
    got, pieces = {}, []
    for on in (OFF, 150):
        engine = LLM(ct2_dir, kv_cache_memory=256 << 20, swap_space=0.05, num_threads=2,
                     max_num_encoder_input_tokens=on).llm_engine
        steps = _steps(engine, pieces if on != OFF else [])
        got[on] = _arrive_and_run(engine, first, later, after=3)
        _assert_clean(engine)
        if on != OFF:
            assert all(work <= 150 or running == 0 for running, work in steps[3:]), steps
    assert got[150] == got[OFF]
    assert {p.request_id for p in pieces} >= {"u0", "u1"}
    assert all(p.start % 150 == 0 and p.stop % 150 == 0 for p in pieces)
    assert any(p.start % 1500 for p in pieces)  # pieces that start inside a layer


def test_abort_mid_pass_leaves_no_state_and_no_block(tiny_bart):
    rng = random.Random(7)
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    engine = LLM(tiny_bart, kv_cache_memory=64 << 20, num_threads=1, max_num_encoder_input_tokens=4).llm_engine
    partial = engine.worker.model_runner.encoder_pieces.partial
    engine.add_request("run", _doc(rng, 10), greedy)
    engine.step()
    engine.add_request("big", _doc(rng, 90), greedy)
    engine.add_request("next", _doc(rng, 12), greedy)
    engine.step()
    assert "big" in partial
    assert engine.abort_request("big") == ["big"]
    assert not partial
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step())
    assert set(done) == {"run", "next"}
    _assert_clean(engine)


@pytest.mark.parametrize("mode", ["async", "priority", "swap", "recompute", "speculative"])
def test_split_passes_under_async_priority_preemption_and_speculation(tiny_bart, mode):
    """Split passes beside async scheduling (steps planned ahead run their pieces
    at planning), the priority policy, preemption (a small cache: groups swapped
    or recomputed; a recomputed group's pass starts over) and speculation: the
    unbudgeted engine's tokens, nothing left behind."""
    rng = random.Random(11)
    greedy = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    first = [(f"run{i}", _doc(rng, 12), greedy) for i in range(4)]
    later = [(f"doc{i}", _doc(rng, 85), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
             for i in range(4)]
    extra = {"async": dict(async_scheduling=True), "priority": dict(scheduling_policy="priority"),
             "swap": dict(kv_cache_memory=1 << 19, preemption_mode="swap", swap_space=0.2),
             "recompute": dict(kv_cache_memory=1 << 19, preemption_mode="recompute", swap_space=0.2),
             "speculative": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3})}[mode]
    got, pieces = {}, []
    for on in (OFF, 10):
        engine = LLM(tiny_bart, **{"kv_cache_memory": 64 << 20, "num_threads": 1, "max_num_encoder_input_tokens": on,
                                   **extra}).llm_engine
        _steps(engine, pieces if on != OFF else [])
        got[on] = _arrive_and_run(engine, first, later, after=2)
        _assert_clean(engine)
        if mode == "async" and on != OFF:
            assert engine.steps_planned_ahead > 0
        if mode in ("swap", "recompute") and on != OFF:
            assert engine.scheduler.stats.num_preempted > 0
    assert got[10] == got[OFF] and pieces


def test_a_thousand_mixed_requests_with_aborts_under_every_budget_leak_nothing(tiny_bart):
    """Issue 53's churn: 1000 requests (greedy, sampled n = 2; documents x prompts
    sharing prefixes), aborts among them, with split encoder passes, chunked
    prefill and the prefix cache all on: every block free, no pass state left."""
    from tests.core.test_prefix_cache_engine import churn, documents_x_prompts

    engine = LLM(tiny_bart, kv_cache_memory=2 << 20, swap_space=0.05, max_num_seqs=16, num_threads=1,
                 enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=24,
                 max_num_encoder_input_tokens=6).llm_engine
    pieces: list = []
    _steps(engine, pieces)
    churn(engine, documents_x_prompts(5, 6, 18, seed=12), random.Random(13), step_chance=0.5, count=1000)
    bm = engine.scheduler.block_manager
    assert pieces and bm.prefix_cache_stats()[1] > 0
    assert engine.num_free_blocks() == (bm.num_total_gpu_blocks, bm.num_total_cpu_blocks)
    assert not bm.block_tables and not bm.cross_block_tables
    _assert_clean(engine)


def test_an_output_computed_elsewhere_is_neither_counted_nor_split(tiny_bart):
    """A request that brings its encoder output (an encoder worker's) costs the
    encoder budget nothing and runs no piece; its tokens are the engine's own."""
    from encdec.worker.encoder_pass import EncoderPass

    rng = random.Random(17)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    run, doc = _doc(rng, 10), _doc(rng, 90)
    want = [list(o.outputs[0].token_ids) for o in
            LLM(tiny_bart, kv_cache_memory=64 << 20, num_threads=1).generate([run, doc], greedy, use_tqdm=False)]
    engine = LLM(tiny_bart, kv_cache_memory=64 << 20, num_threads=1, max_num_encoder_input_tokens=4).llm_engine
    sched, work = engine.scheduler, []
    schedule = sched.schedule

    def counted(*args, **kwargs):
        metas, out = schedule(*args, **kwargs)
        work.append((out.encoder.tokens, out.encoder.pieces))
        return metas, out

    sched.schedule = counted
    inp, params = engine.process_request(doc, greedy)
    (out,) = EncoderPass(engine.args)([(inp["encoder_prompt_token_ids"], None)])
    engine.add_request("run", run, greedy)
    engine.step()
    engine.add_processed_request("doc", inp, params, encoder_output=out)
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, list(o.outputs[0].token_ids)) for o in engine.step())
    assert [done["run"], done["doc"]] == want
    # "run" alone ran its pass whole (nobody to protect); "doc" brought its output: 0 work, no piece
    assert work[0] == (12, []) and all(w == (0, []) for w in work[1:])
    _assert_clean(engine)


def test_whisper_long_form_of_two_files_with_split_passes_matches(ct2_dir, speech_clips):
    """Two long files transcribed together (each window conditioned on the text
    before it): one file's windows decode while the other's arrive, so their
    passes go in pieces; the segments are the unbudgeted engine's."""
    import numpy as np

    wavs, gap = speech_clips[2], np.zeros(16000, np.float32)
    files = [np.concatenate([x for w in wavs[a:a + 8] for x in (w, gap)])[: 16000 * 45] for a in (0, 8)]
    got, pieces = {}, []
    for on in (OFF, 150):
        llm = LLM(ct2_dir, kv_cache_memory=256 << 20, swap_space=0.1, num_threads=2, max_num_encoder_input_tokens=on)
        _steps(llm.llm_engine, pieces if on != OFF else [])
        results = llm.transcribe([(f, 16000) for f in files], timestamps=True, use_tqdm=False)
        got[on] = [[(s.start, s.end, s.text) for s in r.segments] for r in results]
        _assert_clean(llm.llm_engine)
    assert got[150] == got[OFF] and all(len(g) > 2 for g in got[OFF])
    assert pieces
