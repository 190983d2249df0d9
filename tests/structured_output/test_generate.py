"""Done-when 1 on every text family: each constraint kind holds on every
output (greedy, seeded sampling, every returned beam of 4), a constraint that
accepts everything changes no token, constrained and unconstrained requests
mix in one call, and a bad constraint is refused before anything is queued."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

pytest.importorskip("xgrammar")

from encdec import BeamSearchParams, SamplingParams, StructuredOutputsParams
from tests.structured_output.conftest import CHOICES, GRAMMAR, PY_GRAMMAR, REGEX, SCHEMA, prompts

N = 8  # outputs per mode in the default run; the slow test below asks for 64


def _check_json(outputs) -> None:
    for out in outputs:
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text), SCHEMA)


def _json_modes(llm, n: int) -> int:
    """How many outputs validated (greedy, sampled, every returned beam)."""
    so = StructuredOutputsParams(json=SCHEMA)
    greedy = llm.generate(prompts(n), SamplingParams(temperature=0, max_tokens=120, structured_outputs=so))
    _check_json([o.outputs[0] for o in greedy])
    sampled = llm.generate(prompts(n), [SamplingParams(temperature=1.0, seed=i, max_tokens=120, structured_outputs=so)
                                        for i in range(n)])
    _check_json([o.outputs[0] for o in sampled])
    beams = llm.generate(prompts(max(1, n // 4)), BeamSearchParams(4, max_tokens=120, num_return_sequences=4,
                                                                   structured_outputs=so))
    returned = [c for o in beams for c in o.outputs]
    assert len(returned) == 4 * max(1, n // 4)
    _check_json(returned)
    return len(greedy) + len(sampled) + len(returned)


def test_json_schema_greedy_sampled_beams(family_llm):
    assert _json_modes(family_llm, N) == 2 * N + 4 * max(1, N // 4)


@pytest.mark.slow
def test_json_schema_64_outputs(family_llm):
    assert _json_modes(family_llm, 64) == 2 * 64 + 4 * 16


def test_regex_choice_grammar(family_llm):
    cases = [(StructuredOutputsParams(regex=REGEX), lambda t: re.fullmatch(REGEX, t)),
             (StructuredOutputsParams(choice=CHOICES), lambda t: t in CHOICES),
             (StructuredOutputsParams(grammar=GRAMMAR), lambda t: re.fullmatch(PY_GRAMMAR, t))]
    for so, ok in cases:
        outs = family_llm.generate(prompts(N), [SamplingParams(temperature=t, seed=i, max_tokens=40,
                                                               structured_outputs=so)
                                                for i, t in enumerate([0.0, 1.0] * (N // 2))])
        for o in outs:
            assert o.outputs[0].finish_reason == "stop" and ok(o.outputs[0].text), (so, o.outputs[0].text)
        beams = family_llm.generate(prompts(2), BeamSearchParams(4, max_tokens=40, num_return_sequences=4,
                                                                 structured_outputs=so))
        for c in (c for o in beams for c in o.outputs):
            assert c.finish_reason == "stop" and ok(c.text), (so, c.text)


def _plain_token_ids(tokenizer, vocab: int) -> list[int]:
    """Ordinary tokens (printable ASCII text, not special) and eos: what both runs may sample."""
    special = set(tokenizer.all_special_ids)
    ids = [i for i in range(min(vocab, len(tokenizer))) if i not in special
           and (t := tokenizer.decode([i])).strip() and t.isascii() and t.isprintable()]
    return ids + [tokenizer.eos_token_id]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_accept_all_constraint_changes_no_token(tiny_bart_llm, temperature):
    llm = tiny_bart_llm
    allowed = _plain_token_ids(llm.get_tokenizer(), llm.llm_engine.worker.vocab_size)
    base = dict(temperature=temperature, seed=7, max_tokens=24, allowed_token_ids=allowed)
    free = llm.generate(prompts(6), SamplingParams(**base))
    held = llm.generate(prompts(6), SamplingParams(**base, structured_outputs=StructuredOutputsParams(
        regex=r"[\s\S]*")))
    assert [o.outputs[0].token_ids for o in held] == [o.outputs[0].token_ids for o in free]


def test_mixed_batch_in_one_call(tiny_bart_llm):
    llm = tiny_bart_llm
    ps = prompts(6)
    alone = llm.generate(ps[1:2], SamplingParams(temperature=0, max_tokens=20))[0].outputs[0].token_ids
    params = [SamplingParams(temperature=0, max_tokens=120, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
              SamplingParams(temperature=0, max_tokens=20),
              BeamSearchParams(4, max_tokens=40, num_return_sequences=2,
                               structured_outputs=StructuredOutputsParams(choice=CHOICES)),
              SamplingParams(temperature=1.0, seed=3, max_tokens=40,
                             structured_outputs=StructuredOutputsParams(regex=REGEX)),
              BeamSearchParams(2, max_tokens=20),
              SamplingParams(temperature=0, n=2, best_of=2, max_tokens=40,
                             structured_outputs=StructuredOutputsParams(grammar=GRAMMAR))]
    outs = llm.generate(ps, params)
    jsonschema.validate(json.loads(outs[0].outputs[0].text), SCHEMA)
    assert outs[1].outputs[0].token_ids == alone
    assert len(outs[2].outputs) == 2 and all(c.text in CHOICES for c in outs[2].outputs)
    assert re.fullmatch(REGEX, outs[3].outputs[0].text)
    assert len(outs[4].outputs) == 1
    assert len(outs[5].outputs) == 2 and all(re.fullmatch(PY_GRAMMAR, c.text) for c in outs[5].outputs)


@pytest.mark.parametrize("bad, field", [
    (dict(regex="(ab"), "structured_outputs.regex"),
    (dict(json={"type": "nonsense"}), "structured_outputs.json"),
    (dict(grammar="root ::= undefined_rule"), "structured_outputs.grammar"),
    (dict(grammar="start: NAME"), "structured_outputs.grammar"),
    (dict(json=SCHEMA, whitespace_pattern=r"[ ]?"), "structured_outputs.whitespace_pattern"),
])
def test_bad_constraint_refused_before_queueing(tiny_bart_llm, bad, field):
    llm = tiny_bart_llm
    engine = llm.llm_engine
    free = engine.num_free_blocks()
    good = SamplingParams(temperature=0, max_tokens=8)
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.generate(prompts(3), [good, SamplingParams(structured_outputs=StructuredOutputsParams(**bad)), good])
    assert engine.get_num_unfinished_requests() == 0
    assert engine.num_free_blocks() == free
    assert len(llm.generate(prompts(1), good)[0].outputs[0].token_ids) > 0  # still serves


def test_two_constraints_or_none_refused():
    with pytest.raises(ValueError, match="exactly one of"):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a", choice=["b"]))
    with pytest.raises(ValueError, match="exactly one of"):
        BeamSearchParams(2, structured_outputs={})


@pytest.fixture(scope="module")
def wide_t5_llm(tmp_path_factory):
    """T5 whose head is 28 tokens wider than its tokenizer (t5-small: 32128 logits, 32100 tokens)."""
    from transformers import T5ForConditionalGeneration

    from tests.structured_output.conftest import make_checkpoint, make_llm

    path = make_checkpoint("t5", str(tmp_path_factory.mktemp("wide_t5")))
    model = T5ForConditionalGeneration.from_pretrained(path)
    model.resize_token_embeddings(model.config.vocab_size + 28)
    model.save_pretrained(path)
    return make_llm(path)


def test_logits_wider_than_the_tokenizer(wide_t5_llm):
    tokenizer_size = len(wide_t5_llm.get_tokenizer())
    assert wide_t5_llm.llm_engine.worker.vocab_size == tokenizer_size + 28
    outs = wide_t5_llm.generate(prompts(N), [SamplingParams(temperature=1.0, seed=i, max_tokens=120,
                                                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
                                             for i in range(N)])
    _check_json([o.outputs[0] for o in outs])
    assert all(t < tokenizer_size for o in outs for t in o.outputs[0].token_ids)
