"""The encoder budget's default: two of the model's longest encoder inputs per
step where steps run eagerly (CPU), none where CUDA graphs replay decodes
(docs/scheduler-budgets.md says what was measured)."""
from __future__ import annotations

from encdec import LLM, SamplingParams
from encdec.engine.arg_utils import EngineArgs


def test_default_is_two_longest_inputs_on_eager_steps_and_none_with_cuda_graphs():
    from encdec.engine.llm_engine import encoder_budget_for

    assert encoder_budget_for(EngineArgs(model="m"), 1500, cuda_graphs=False) == 3000
    assert encoder_budget_for(EngineArgs(model="m"), 1500, cuda_graphs=True) is None
    args = EngineArgs(model="m", max_num_encoder_input_tokens=700)
    assert encoder_budget_for(args, 1500, cuda_graphs=True) == encoder_budget_for(args, 1500, cuda_graphs=False) == 700


def test_whisper_default_admits_two_windows_a_step(ct2_dir, speech_clips):
    from encdec import TextPrompt

    prompts = [TextPrompt(prompt="<|startoftranscript|><|notimestamps|>", multi_modal_data={"audio": (w, 16000)})
               for w in speech_clips[2][:4]]
    llm = LLM(ct2_dir, kv_cache_memory=256 << 20, swap_space=0.05, num_threads=2)
    assert llm.llm_engine.scheduler_config.max_num_encoder_input_tokens == 3000
    sched = llm.llm_engine.scheduler
    schedule, admitted = sched.schedule, []

    def counted(*args, **kwargs):
        metas, out = schedule(*args, **kwargs)
        if out.num_prefill_groups:
            admitted.append(out.num_prefill_groups)
        return metas, out

    sched.schedule = counted
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert admitted == [2, 2]
