"""min_admission: while sequences decode, waiting requests go in only once that
many fit, so steps that admit (eager on CUDA, where decode steps replay graphs)
are fewer and larger. Outputs stay the same; the default is 1 on CPU and
max_num_seqs // 8 where CUDA graphs run."""
from __future__ import annotations

import random

import pytest

from encdec import LLM, SamplingParams, TokensPrompt
from encdec.engine.arg_utils import EngineArgs
from encdec.engine.llm_engine import min_admission_for


def test_default_is_one_without_cuda_graphs_and_an_eighth_of_the_slots_with_them():
    args = EngineArgs(model="m", max_num_seqs=256)
    assert min_admission_for(args, cuda_graphs=False) == 1
    assert min_admission_for(args, cuda_graphs=True) == 32
    assert min_admission_for(EngineArgs(model="m", max_num_seqs=4), cuda_graphs=True) == 1
    assert min_admission_for(EngineArgs(model="m", min_admission=5), cuda_graphs=True) == 5


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "8"])
def test_bad_min_admission_is_refused(bad):
    with pytest.raises(ValueError, match="min_admission"):
        EngineArgs(model="m", min_admission=bad)


def _run(tiny_bart: str, min_admission: int | None):
    rng = random.Random(0)
    prompts = [TokensPrompt(prompt_token_ids=[0] + [rng.randrange(4, 90) for _ in range(rng.randint(3, 30))] + [2])
               for _ in range(48)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(2, 24), ignore_eos=True) for _ in prompts]
    llm = LLM(tiny_bart, device="cpu", max_num_seqs=8, min_admission=min_admission, kv_cache_memory=64 << 20)
    engine = llm.llm_engine
    admitting, total = [0], [0]
    schedule = engine.scheduler.schedule

    def counted():
        metas, out = schedule()
        total[0] += 1
        admitting[0] += out.num_prefill_groups > 0
        return metas, out

    engine.scheduler.schedule = counted
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert engine.scheduler_config.min_admission == (min_admission or 1)
    all_free = engine.num_free_blocks()[0] == engine.cache_config.num_gpu_blocks
    return [list(o.outputs[0].token_ids) for o in outs], admitting[0], total[0], all_free


def test_fewer_admitting_steps_and_the_same_tokens(tiny_bart):
    base, admitting_1, steps_1, all_free_1 = _run(tiny_bart, None)
    batched, admitting_4, steps_4, all_free_4 = _run(tiny_bart, 4)
    print(f"steps that admitted: {admitting_1}/{steps_1} at min_admission=1, {admitting_4}/{steps_4} at 4")
    assert batched == base
    assert admitting_4 * 2 <= admitting_1
    assert all_free_1 and all_free_4  # every block back
