"""LLMPredictor called in this process, as a Ray actor calls it: columns in,
columns out, bad rows named. No cluster here (tests/ray/test_cluster.py has one)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("ray.data")

from encdec import ExplicitEncoderDecoderPrompt, SamplingParams, TokensPrompt
from encdec.ray import LLMPredictor

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
SMALL = dict(kv_cache_memory=64 << 20, swap_space=0.05)
SPEECH = os.path.join(os.path.dirname(__file__), "..", "data", "speech")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def predictor(tiny_bart):
    return LLMPredictor(tiny_bart, params=GREEDY, **SMALL)


@pytest.fixture(scope="module")
def strict_predictor(tiny_bart):
    return LLMPredictor(tiny_bart, params=GREEDY, on_error="raise", **SMALL)


def test_generate_keeps_columns_and_matches_llm(predictor, bart_llm):
    batch = {"id": np.arange(4),
             "prompt": np.array(["The rain in spain", "hello world", "numbers 1 2 3", "Ada"]),
             "decoder_prompt": np.array([None, "Hi", [2, 0, 5], np.array([7, 8])], dtype=object)}
    out = predictor(batch)
    assert list(out) == ["id", "prompt", "decoder_prompt", "generated_text", "error"]
    assert list(out["error"]) == [None] * 4
    assert out["id"] is batch["id"] and len(out["generated_text"]) == 4
    want = bart_llm.generate([
        ExplicitEncoderDecoderPrompt(encoder_prompt="The rain in spain", decoder_prompt=None),
        ExplicitEncoderDecoderPrompt(encoder_prompt="hello world", decoder_prompt="Hi"),
        ExplicitEncoderDecoderPrompt(encoder_prompt="numbers 1 2 3",
                                     decoder_prompt=TokensPrompt(prompt_token_ids=[2, 0, 5])),
        ExplicitEncoderDecoderPrompt(encoder_prompt="Ada",
                                     decoder_prompt=TokensPrompt(prompt_token_ids=[7, 8]))],
        GREEDY, use_tqdm=False)
    assert list(out["generated_text"]) == [o.outputs[0].text for o in want]
    assert len(set(out["generated_text"])) > 1  # varied outputs: the comparison means something


def test_token_id_prompts_and_pandas_batches(predictor, bart_llm):
    pd = pytest.importorskip("pandas")
    ids = [[0, 50, 60, 70, 2], [0, 9, 2]]
    out = predictor(pd.DataFrame({"prompt": ids, "k": ["a", "b"]}))
    assert list(out.columns) == ["prompt", "k", "generated_text", "error"]
    want = bart_llm.generate([TokensPrompt(prompt_token_ids=i) for i in ids], GREEDY, use_tqdm=False)
    assert out["generated_text"].tolist() == [o.outputs[0].text for o in want]


def test_params_none_leaves_the_choice_to_the_engine(tiny_bart, monkeypatch):
    """No params: generate(prompts) without params, so the engine applies the
    checkpoint's defaults (which may be beam search)."""
    pred = LLMPredictor(tiny_bart, **SMALL)
    calls = []
    real = pred.llm.generate
    monkeypatch.setattr(pred.llm, "generate",
                        lambda *a, **k: calls.append((a, k)) or real(*a, **k))
    out = pred({"prompt": np.array(["The rain in spain", "hello"])})
    assert len(out["generated_text"]) == 2
    assert calls == [((["The rain in spain", "hello"],), {"use_tqdm": False})]


def test_empty_batch(predictor):
    out = predictor({"prompt": np.array([], dtype=object)})
    assert len(out["generated_text"]) == 0 and len(out["error"]) == 0


@pytest.mark.parametrize("batch, error, match", [
    ({"prompt": np.array(["x", None, "y"], dtype=object)}, TypeError, "row 1: 'prompt' must be text"),
    ({"prompt": np.array(["x", 3.5], dtype=object)}, TypeError, "row 1: 'prompt'"),
    ({"prompt": np.array(["x", "y"]), "decoder_prompt": np.array(["a", 7], dtype=object)},
     TypeError, "row 1: 'decoder_prompt'"),
    ({"text": np.array(["x"])}, ValueError, "reads a 'prompt' column; the batch has \\['text'\\]"),
    ({"prompt": np.array(["x"]), "generated_text": np.array(["old"])}, ValueError,
     "already has a 'generated_text' column"),
    ({"prompt": np.array(["x", ""])}, ValueError, "refused a batch of 2 rows.*empty"),
])
def test_bad_rows_fail_the_batch_with_on_error_raise(strict_predictor, batch, error, match):
    with pytest.raises(error, match=match):
        strict_predictor(batch)
    # The actor's engine keeps serving after a refused batch.
    assert len(strict_predictor({"prompt": np.array(["fine"])})["generated_text"]) == 1


def test_bad_rows_get_their_error_and_the_others_complete(predictor, bart_llm):
    good = ["The rain in spain", "hello world", "numbers 1 2 3", "Ada", "tokens", "memory pages"]
    cells = [good[0], None, good[1], "", good[2], 3.5, good[3], [0, 10**6, 2], good[4], good[5]]
    out = predictor({"id": np.arange(10), "prompt": np.array(cells, dtype=object)})
    want = [o.outputs[0].text for o in bart_llm.generate(good, GREEDY, use_tqdm=False)]
    bad = {1: "TypeError: 'prompt' must be text or a list of token ids, got NoneType None",
           3: "ValueError: the encoder prompt is empty", 5: "TypeError: 'prompt' must be text",
           7: "ValueError: "}
    texts = iter(want)
    for row in range(10):
        if row in bad:
            assert out["generated_text"][row] is None and out["error"][row].startswith(bad[row]), out["error"][row]
        else:
            assert out["error"][row] is None and out["generated_text"][row] == next(texts)
    assert "1000000" in out["error"][7] and not out["error"][7].startswith("ValueError: prompt 0")
    assert list(out["id"]) == list(range(10))


def test_a_missing_column_is_every_rows_error(predictor):
    out = predictor({"text": np.array(["x", "y"])})
    assert list(out["generated_text"]) == [None, None]
    assert all("reads a 'prompt' column; the batch has ['text']" in e for e in out["error"])
    with pytest.raises(ValueError, match="already has a 'error' column"):
        predictor({"prompt": np.array(["x"]), "error": np.array([None])})


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(task="summarize"), ValueError, "task must be one of"),
    (dict(task="transcribe", params=GREEDY), ValueError, "transcribe_options"),
    (dict(transcribe_options={"language": "en"}), ValueError, "task='transcribe' only"),
    (dict(params=[GREEDY]), TypeError, "one params object"),
    (dict(params=SamplingParams(n=2, temperature=1.0)), ValueError, "2 completions per row"),
    (dict(num_threads=0), ValueError, "num_threads"),
    (dict(on_error="skip"), ValueError, "on_error must be one of"),
    (dict(task="transcribe", transcribe_options={"use_tqdm": True}), ValueError, "progress bars"),
    (dict(task="transcribe", transcribe_options={"bogus": 1}), TypeError, "transcribe_options"),
])
def test_bad_options_fail_before_loading(kwargs, error, match):
    with pytest.raises(error, match=match):
        LLMPredictor("/nonexistent/model", **kwargs)


@pytest.fixture(scope="module")
def whisper_predictor(ct2_dir):
    return LLMPredictor(ct2_dir, task="transcribe", num_threads=1, kv_cache_memory=128 << 20,
                        swap_space=0.05)


def test_audio_paths_and_bytes_give_the_same_transcript(whisper_predictor):
    paths = [os.path.join(SPEECH, f"s0{i}.wav") for i in range(2)]
    blobs = [Path(p).read_bytes() for p in paths]
    from_paths = whisper_predictor({"audio": np.array(paths, dtype=object)})
    from_bytes = whisper_predictor({"audio": np.array(blobs, dtype=object), "n": np.arange(2)})
    assert list(from_bytes["text"]) == list(from_paths["text"])
    assert list(from_bytes["language"]) == ["en", "en"]
    assert list(from_bytes["n"]) == [0, 1]
    assert "lazy dog" in from_paths["text"][0]  # "The quick brown fox jumps over the lazy dog."


BAD_AUDIO = [
    (b"\0not audio at all", ValueError, "'audio' bytes \\(17 bytes\\) cannot be decoded"),
    (b"not audio at all", ValueError, "'audio' bytes b'not audio at all' are text, not audio, and name no file"),
    ("/nonexistent/clip.wav", ValueError, "audio file '/nonexistent/clip.wav' does not exist"),
    (12, TypeError, "'audio' must be a path or the file's bytes"),
    (None, TypeError, "'audio' must be a path or the file's bytes, got NoneType"),
]


@pytest.fixture(scope="module")
def strict_whisper_predictor(ct2_dir):
    return LLMPredictor(ct2_dir, task="transcribe", num_threads=1, on_error="raise", kv_cache_memory=64 << 20,
                        swap_space=0.05)


@pytest.mark.parametrize("cell, error, match", BAD_AUDIO)
def test_bad_audio_rows_are_named(strict_whisper_predictor, whisper_predictor, cell, error, match):
    good = os.path.join(SPEECH, "s00.wav")
    with pytest.raises(error, match="row 1: " + match):
        strict_whisper_predictor({"audio": np.array([good, cell], dtype=object)})
    out = whisper_predictor({"audio": np.array([good, cell, good], dtype=object)})
    assert out["error"][0] is None and out["error"][2] is None and "lazy dog" in out["text"][2]
    assert out["text"][1] is None and out["language"][1] is None
    assert re.match(f"{error.__name__}: {match}", out["error"][1]), out["error"][1]


def test_a_column_of_paths_and_bytes_as_arrow_stores_it(whisper_predictor):
    """Arrow types a column mixing paths and bytes as binary: the paths arrive as bytes."""
    import pyarrow as pa

    paths = [os.path.join(SPEECH, f"s0{i}.wav") for i in range(2)]
    column = pa.array([Path(paths[0]).read_bytes(), paths[1]])
    assert column.type == pa.binary() and column[1].as_py() == paths[1].encode()
    mixed = whisper_predictor({"audio": column.to_numpy(zero_copy_only=False)})
    from_paths = whisper_predictor({"audio": np.array(paths, dtype=object)})
    assert list(mixed["text"]) == list(from_paths["text"]) and list(mixed["error"]) == [None, None]


def _run(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120, check=False)


def test_import_encdec_does_not_import_ray():
    res = _run("import sys, encdec; from encdec import LLM, SamplingParams; "
               "assert 'ray' not in sys.modules, 'ray imported'")
    assert res.returncode == 0, res.stderr


def test_missing_ray_names_the_extra():
    res = _run("import sys; sys.modules['ray'] = None; import encdec.ray")
    assert res.returncode != 0 and "pip install 'encdec[ray]'" in res.stderr, res.stderr
