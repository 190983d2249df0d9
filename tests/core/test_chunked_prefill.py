"""enable_chunked_prefill end to end: decoder prompts split under
max_num_batched_tokens across steps (beside running decodes) give token for
token what whole prefills give: BART, T5 decoder inputs, Whisper's conditioning
prompt; chunk sizes of 1 token, one that ends mid-block and larger; with beams
and n > 1 beside; preemption (swap and recompute) of a partly prefilled group;
with the prefix cache and async scheduling; every block back at the end."""
from __future__ import annotations

import random

import pytest

from encdec import LLM, SamplingParams, TokensPrompt
from encdec.engine.arg_utils import EngineArgs
from encdec.inputs import ExplicitEncoderDecoderPrompt
from encdec.sampling_params import BeamSearchParams
from tests.core.test_prefix_cache_engine import churn


def _prompt(enc: list[int], dec: list[int]) -> ExplicitEncoderDecoderPrompt:
    return ExplicitEncoderDecoderPrompt(encoder_prompt=TokensPrompt(prompt_token_ids=enc),
                                        decoder_prompt=TokensPrompt(prompt_token_ids=dec))


def long_prompts(num: int, seed: int = 0, bos: int = 2, lo: int = 20, hi: int = 70) -> list:
    """Encoder inputs of 10-40 tokens, decoder prompts of ``lo``-``hi`` tokens."""
    rng = random.Random(seed)
    return [_prompt([0] + [rng.randrange(4, 900) for _ in range(rng.randint(10, 40))] + [2],
                    [bos] + [rng.randrange(4, 900) for _ in range(rng.randint(lo, hi))]) for _ in range(num)]


def run(model: str, prompts, params, *, chunk: int | None, **options):
    """Tokens of every request, whether every block is back, and the engine."""
    extra = dict(enable_chunked_prefill=True, max_num_batched_tokens=chunk) if chunk else {}
    llm = LLM(model, device="cpu", kv_cache_memory=options.pop("kv_cache_memory", 64 << 20),
              swap_space=options.pop("swap_space", 0.05), **extra, **options)
    outs = llm.generate(prompts, params, use_tqdm=False)
    engine = llm.llm_engine
    bm = engine.scheduler.block_manager
    all_free = engine.num_free_blocks() == (bm.num_total_gpu_blocks, bm.num_total_cpu_blocks)
    return [[list(c.token_ids) for c in o.outputs] for o in outs], all_free, engine


def test_options_reach_the_scheduler_and_bad_values_are_refused():
    with pytest.raises(ValueError, match="enable_chunked_prefill"):
        EngineArgs(model="m", enable_chunked_prefill="yes")
    from encdec.engine.llm_engine import scheduler_config_for

    cfg = scheduler_config_for(EngineArgs(model="m", enable_chunked_prefill=True), 1024, 1024)
    assert cfg.enable_chunked_prefill and cfg.max_num_batched_tokens == 32768  # as without: the profile run's
    assert not scheduler_config_for(EngineArgs(model="m"), 1024, 1024).enable_chunked_prefill


@pytest.mark.parametrize("chunk", [1, 21, 40])  # 21: every chunk boundary mid-block (block_size 16)
def test_bart_chunked_equals_whole(tiny_bart, chunk):
    prompts = long_prompts(5 if chunk > 1 else 2)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    whole, free_whole, _ = run(tiny_bart, prompts, params, chunk=None)
    got, free, engine = run(tiny_bart, prompts, params, chunk=chunk)
    assert got == whole and free and free_whole
    # the prompts were split: more steps than whole prefills take
    assert engine.scheduler.num_steps > 10 + max(1, 70 // chunk)


def test_chunks_beside_decodes_beams_and_n(tiny_bart):
    """Short prompts decode (and beams search) while long ones are chunked; the
    step's budget holds: chunk tokens + one per decode row."""
    rng = random.Random(4)
    short = long_prompts(4, seed=5, lo=2, hi=6)
    prompts = [p for pair in zip(short, long_prompts(4, seed=6, lo=60, hi=90)) for p in pair]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(8, 20), ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              BeamSearchParams(3, 8, num_return_sequences=2),
              SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=10, ignore_eos=True)] * 2
    whole, _, _ = run(tiny_bart, prompts, params, chunk=None)
    got, free, engine = run(tiny_bart, prompts, params, chunk=12, max_num_seqs=16)
    assert got == whole and free


def test_step_token_budget_holds(tiny_bart):
    from encdec.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineArgs(model=tiny_bart, device="cpu", kv_cache_memory=64 << 20,
                                  enable_chunked_prefill=True, max_num_batched_tokens=9))
    params = SamplingParams(temperature=0, max_tokens=15, ignore_eos=True)
    for i, p in enumerate(long_prompts(6, seed=8, lo=2, hi=60)):
        engine.add_request(f"r{i}", p, params)
    seen_partial = 0
    while engine.has_unfinished_requests():
        metas, sched = engine.scheduler.schedule()
        assert sched.num_batched_tokens <= 9
        seen_partial += sum(not m.do_sample for m in metas)
        engine._update(sched, engine.worker.execute_model(metas, sched).get_output())
    assert seen_partial > 0


def test_t5_decoder_inputs_chunked_equals_whole(tmp_path):
    from encdec.testing import make_random_t5

    model = make_random_t5(str(tmp_path / "t5"), seed=0)
    prompts = long_prompts(4, seed=2, bos=0)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    whole, _, _ = run(model, prompts, params, chunk=None)
    for chunk in (1, 19):
        got, free, _ = run(model, prompts[:2] if chunk == 1 else prompts, params, chunk=chunk)
        assert got == (whole[:2] if chunk == 1 else whole) and free


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preempting_a_partly_prefilled_group(tiny_bart, mode, monkeypatch):
    from encdec.core.scheduler import Scheduler

    partly = []
    original = Scheduler._preempt

    def spy(self, group, blocks):
        partly.append(group.seqs[0].data.is_prefilling() and group.seqs[0].data.get_num_computed_tokens() > 0)
        return original(self, group, blocks)

    prompts = long_prompts(10, seed=9, lo=60, hi=100)
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    small = dict(kv_cache_memory=3 << 18, max_num_seqs=10, preemption_mode=mode, swap_space=0.2)
    whole, _, _ = run(tiny_bart, prompts, params, chunk=None, **small)
    monkeypatch.setattr(Scheduler, "_preempt", spy)
    got, free, engine = run(tiny_bart, prompts, params, chunk=8, **small)
    assert got == whole and free
    assert any(partly), partly


def test_with_prefix_caching(tiny_bart):
    from tests.core.test_prefix_cache_engine import documents_x_prompts

    prompts = documents_x_prompts(3, 4, 40, seed=3)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    whole, _, _ = run(tiny_bart, prompts, params, chunk=None)
    for chunk in (7, 33):
        got, free, engine = run(tiny_bart, prompts, params, chunk=chunk, enable_prefix_caching=True)
        assert got == whole and free
        assert engine.scheduler.block_manager.prefix_cache_stats()[1] > 0


def test_with_async_scheduling(tiny_bart):
    prompts = long_prompts(5, seed=10)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    whole, _, _ = run(tiny_bart, prompts, params, chunk=None)
    got, free, engine = run(tiny_bart, prompts, params, chunk=13, async_scheduling=True)
    assert got == whole and free and engine.steps_planned_ahead > 0


def test_many_mixed_requests_with_aborts_leak_no_block(tiny_bart):
    from encdec.engine.llm_engine import LLMEngine

    rng = random.Random(11)
    engine = LLMEngine(EngineArgs(model=tiny_bart, device="cpu", kv_cache_memory=1 << 20, swap_space=0.05,
                                  max_num_seqs=16, enable_chunked_prefill=True, max_num_batched_tokens=20,
                                  enable_prefix_caching=True))
    churn(engine, long_prompts(12, seed=12, lo=2, hi=60), rng, step_chance=0.6)
    bm = engine.scheduler.block_manager
    assert engine.num_free_blocks() == (bm.num_total_gpu_blocks, bm.num_total_cpu_blocks)
    assert not bm.block_tables and not bm.cross_block_tables and not engine.scheduler._chunking


def test_whisper_conditioning_prompt_chunked_equals_whole(ct2_dir, speech_clips):
    """A long previous-text prompt (Whisper's conditioning) and a long explicit
    decoder prompt, chunked mid-block and by single tokens."""
    from encdec import TextPrompt

    wav, prev = speech_clips[2][3], " ".join(speech_clips[1][4:10])
    prompts = [TextPrompt(prompt=f"<|startofprev|> {prev}<|startoftranscript|><|notimestamps|>",
                          multi_modal_data={"audio": (wav, 16000)}),
               TextPrompt(prompt=f"<|startoftranscript|><|en|><|transcribe|><|notimestamps|> {prev}",
                          multi_modal_data={"audio": (wav, 16000)})]
    params = SamplingParams(temperature=0.0, max_tokens=20)
    got = {}
    for chunk in (None, 1, 21):
        got[chunk], free, _ = run(ct2_dir, prompts, params, chunk=chunk, kv_cache_memory=256 << 20, num_threads=2)
        assert free
    assert got[1] == got[None] and got[21] == got[None]


def test_with_speculative_decoding(tiny_bart):
    """A group between chunks never speculates; decoding rows beside it do."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    rng = random.Random(13)
    body = [rng.randrange(4, 900) for _ in range(12)]
    prompts = [_prompt([0] + body * 3 + [2], [2] + body * (2 + i)) for i in range(4)]  # repeats: drafts found
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    whole, _, _ = run(tiny_bart, prompts, params, chunk=None)
    got, free, engine = run(tiny_bart, prompts, params, chunk=10, speculative_config=spec)
    assert got == whole and free
    assert engine.scheduler.stats.spec_draft_tokens > 0


@pytest.mark.parametrize("no_speech_threshold", [None, 0.6])
def test_whisper_long_form_chunked_equals_whole(ct2_dir, no_speech_threshold):
    """Long-form transcription: each later window is conditioned on the text
    before it (a <|startofprev|> prompt of up to 224 tokens), split in 7-token
    chunks. With a no-speech threshold a window's first attempt asks a prompt
    token's log-prob (P(no speech)), so it prefills whole: the same steps."""
    import glob
    import os

    import numpy as np
    import soundfile as sf

    speech = os.path.join(os.path.dirname(__file__), "..", "data", "speech")
    wavs = [sf.read(f, dtype="float32")[0] for f in sorted(glob.glob(os.path.join(speech, "s*.wav")))]
    gap = np.zeros(16000, np.float32)
    audio = np.concatenate([x for w in wavs[:16] for x in (w, gap)])[: 16000 * 75]
    got, steps = {}, {}
    for chunk in (None, 7):
        extra = dict(enable_chunked_prefill=True, max_num_batched_tokens=chunk) if chunk else {}
        llm = LLM(ct2_dir, kv_cache_memory=256 << 20, swap_space=0.1, num_threads=2, **extra)
        result, = llm.transcribe([(audio, 16000)], timestamps=True, no_speech_threshold=no_speech_threshold,
                                 use_tqdm=False)
        got[chunk] = [(s.start, s.end, s.text) for s in result.segments]
        engine = llm.llm_engine
        steps[chunk] = engine.scheduler.num_steps
        assert engine.num_free_blocks()[0] == engine.cache_config.num_gpu_blocks
    assert got[7] == got[None] and len(got[None]) > 3
    if no_speech_threshold is None:
        assert steps[7] > steps[None] + 10, steps  # the conditioned windows' prompts were split
    else:
        assert steps[7] == steps[None], steps
