"""A step's text may be left owed (decoded when read, or whole at the end:
StopChecker.check(defer_text=True)); what callers read must not lag: partial
outputs carry every token's text, final outputs equal token-by-token decoding."""
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
    assert eng.scheduler.get_seq_group("r") is None


def test_text_decoded_at_the_end_equals_text_decoded_each_step(tiny_bart):
    """The same requests, their text decoded whole at the end (nobody read it
    before) and token by token (a partial output read after every step)."""
    llm = LLM(tiny_bart, device="cpu", kv_cache_memory=16 << 20)
    eng = llm.llm_engine
    prompts = ["the quick brown fox jumps", "over the lazy dog", "a b c d e f g", "hello world"]
    kinds = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
             SamplingParams(temperature=0.0, max_tokens=24, skip_special_tokens=False),
             SamplingParams(temperature=0.0, max_tokens=24, skip_special_tokens=False,
                            spaces_between_special_tokens=False, ignore_eos=True),
             SamplingParams(temperature=0.0, max_tokens=24)]
    whole = [o.outputs[0] for o in llm.generate(prompts, kinds, use_tqdm=False)]
    for i, (p, k) in enumerate(zip(prompts, kinds)):
        eng.add_request(f"s{i}", p, k)
    stepped = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            stepped[out.request_id] = out.outputs[0]
        eng.get_partial_outputs([f"s{i}" for i in range(len(prompts))])
    assert [stepped[f"s{i}"].text for i in range(len(prompts))] == [w.text for w in whole]
    assert [stepped[f"s{i}"].token_ids for i in range(len(prompts))] == [w.token_ids for w in whole]
    assert any(w.text for w in whole)
