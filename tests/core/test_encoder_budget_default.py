"""The encoder budget's default: none. A budget changes which requests share a
step, and so the float rounding of batched steps (M2M100's beam scores moved
1.2e-4 off HF's in its parity test with 2 x max_encoder_len on CPU), so it is
opt-in; docs/scheduler-budgets.md has the latency it buys."""
from __future__ import annotations

from encdec import LLM, SamplingParams
from encdec.engine.arg_utils import EngineArgs


def test_default_is_no_budget(ct2_dir, speech_clips):
    from encdec import TextPrompt

    assert EngineArgs(model="m").max_num_encoder_input_tokens is None
    prompts = [TextPrompt(prompt="<|startoftranscript|><|notimestamps|>", multi_modal_data={"audio": (w, 16000)})
               for w in speech_clips[2][:4]]
    llm = LLM(ct2_dir, kv_cache_memory=256 << 20, swap_space=0.05, num_threads=2)
    assert llm.llm_engine.scheduler_config.max_num_encoder_input_tokens is None
    sched = llm.llm_engine.scheduler
    schedule, admitted = sched.schedule, []

    def counted(*args, **kwargs):
        metas, out = schedule(*args, **kwargs)
        if out.num_prefill_groups:
            admitted.append(out.num_prefill_groups)
        return metas, out

    sched.schedule = counted
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert admitted == [4]  # every window in the first step
