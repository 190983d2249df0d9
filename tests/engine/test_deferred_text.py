"""A step's text is decoded while the next step's kernels run (StopChecker.flush_text);
what callers read must not lag: partial outputs carry every token's text."""
from __future__ import annotations

from encdec import LLM, SamplingParams


def test_partial_outputs_carry_the_last_steps_text(tiny_bart):
    llm = LLM(tiny_bart, device="cpu", kv_cache_memory=16 << 20)
    eng = llm.llm_engine
    prompt = "the quick brown fox jumps"
    steps = 6
    eng.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True))
    partial = []
    for _ in range(steps - 1):
        assert eng.step() == []
        partial.append(eng.get_partial_outputs(["r"])["r"].outputs[0])
    final = eng.step()[0].outputs[0]
    # The same request cut at k tokens: its last token is decoded at once (it ends the sequence).
    cut = [o.outputs[0] for o in llm.generate([prompt] * (steps - 1),
                                              [SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True)
                                               for k in range(1, steps)], use_tqdm=False)]
    assert [p.token_ids for p in partial] == [c.token_ids for c in cut]
    assert [p.text for p in partial] == [c.text for c in cut]
    assert final.text.startswith(partial[-1].text) and any(p.text for p in partial)
    assert eng.output_processor.stop_checker._pending_text == []
