"""An encoder output computed elsewhere (``encdec.worker.encoder_pass``, what a
disaggregated server's encoder worker runs) and handed to the engine
(``add_processed_request(encoder_output=...)``) gives the tokens the engine's own
encoder pass gives: BART, T5 and Whisper, every request given one, some given one
(the rest run the encoder), and a repeated input that reads a cached cross table."""
from __future__ import annotations

import pytest

from encdec import LLM, SamplingParams, TextPrompt
from encdec.worker.encoder_pass import EncoderPass, encoder_transfer_bytes

DOCS = ["the quick brown fox jumps over the lazy dog", "rain in spain falls mainly on the plain",
        "paged attention keeps blocks of keys and values", "one two three four five six seven",
        "the quick brown fox jumps over the lazy dog"]  # the last repeats the first
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
KW = dict(kv_cache_memory=64 << 20, swap_space=0.01, num_threads=1)


def _run(llm: LLM, prompts: list, given: list[bool]) -> list[list[int]]:
    """Queue every prompt (those with ``given`` True with the encoder pass's output), step to the end."""
    engine = llm.llm_engine
    processed = [engine.process_request(p, GREEDY) for p in prompts]
    encoder = EncoderPass(engine.args)
    outputs = encoder([(inp["encoder_prompt_token_ids"], inp.get("encoder_features"))
                       for (inp, _), g in zip(processed, given) if g])
    outputs.reverse()
    if all(given):  # the engine's own encoder must not run
        engine.model.encode = lambda *a: pytest.fail("the engine ran its encoder")
    for i, ((inp, params), g) in enumerate(zip(processed, given)):
        engine.add_processed_request(f"r{i}", inp, params, encoder_output=outputs.pop() if g else None)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = list(out.outputs[0].token_ids)
    assert not engine.worker.model_runner.encoder_outputs  # each taken by its prefill
    return [done[f"r{i}"] for i in range(len(prompts))]


def _mismatches(path: str, prompts: list) -> list[list[bool]]:
    """The ``given`` patterns (every prompt brings its encoder output; every other
    one does) whose tokens differ from the engine running its own encoder."""
    want = [list(o.outputs[0].token_ids) for o in LLM(path, **KW).generate(prompts, GREEDY, use_tqdm=False)]
    n = len(prompts)
    return [given for given in ([True] * n, [i % 2 == 0 for i in range(n)])
            if _run(LLM(path, **KW), prompts, given) != want]


def test_bart_encoder_output_given(tiny_bart):
    assert _mismatches(tiny_bart, DOCS) == []


def test_t5_encoder_output_given(tmp_path):
    from encdec.testing import make_random_t5

    assert _mismatches(make_random_t5(str(tmp_path / "t5")), DOCS) == []


def test_whisper_encoder_output_given(ct2_dir, speech_clips):
    _, _, arrays = speech_clips
    prompts = [TextPrompt(prompt="<|startoftranscript|><|notimestamps|>", multi_modal_data={"audio": (a, 16000)})
               for a in arrays[:3]]
    assert _mismatches(str(ct2_dir), prompts) == []


def test_bad_encoder_output_is_refused_before_queueing(tiny_bart):
    import torch

    engine = LLM(tiny_bart, **KW).llm_engine
    inp, params = engine.process_request(DOCS[0], GREEDY)
    with pytest.raises(ValueError, match="encoder_output must have shape"):
        engine.add_processed_request("x", inp, params, encoder_output=torch.zeros(3, 5))
    assert not engine.has_unfinished_requests() and not engine.worker.model_runner.encoder_outputs


def test_abort_drops_a_given_encoder_output(tiny_bart):
    engine = LLM(tiny_bart, **KW).llm_engine
    inp, params = engine.process_request(DOCS[0], GREEDY)
    (out,) = EncoderPass(engine.args)([(inp["encoder_prompt_token_ids"], None)])
    engine.add_processed_request("x", inp, params, encoder_output=out)
    assert engine.abort_request("x") == ["x"]
    assert not engine.worker.model_runner.encoder_outputs


def test_transfer_bytes_encoder_output_is_smaller():
    from transformers import WhisperConfig

    cfg = WhisperConfig(d_model=1280, decoder_layers=4, decoder_attention_heads=20)  # large-v3-turbo
    out, kv = encoder_transfer_bytes(cfg, 1500, 2)
    assert (out, kv) == (1500 * 1280 * 2, 8 * 1500 * 1280 * 2)
