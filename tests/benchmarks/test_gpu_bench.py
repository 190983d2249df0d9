"""benchmarks.gpu_bench without a GPU: found by name, and refuses clearly."""
from __future__ import annotations

import pytest
import torch

from benchmarks import gpu_bench
from encdec import bench


def test_found_by_name():
    """``encdec bench gpu`` names the checkout module that runs it."""
    with pytest.raises(ValueError, match="python -m benchmarks.gpu_bench"):
        bench.run("gpu", [])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA host runs it")
def test_refuses_without_cuda():
    with pytest.raises(SystemExit, match="gpu_bench needs a CUDA GPU"):
        gpu_bench.main(["--quick"], prog="encdec bench gpu")


def test_unknown_part_is_refused(capsys):
    with pytest.raises(SystemExit):
        gpu_bench.main(["--parts", "bart,nope"])
    assert "unknown parts ['nope']" in capsys.readouterr().err


def test_each_part_runs_with_the_other_options():
    """Several parts run one process each (an engine's CUDA memory was not all
    returned in-process on an H100): every option but --parts reaches each."""
    argv = ["--parts", "bart,beams", "--quick", "--parts=whisper", "--workdir", "/tmp/x", "--profile"]
    assert gpu_bench._without_parts(argv) == ["--quick", "--workdir", "/tmp/x", "--profile"]


def test_same_transcript_compares_text_tokens_only():
    """tiny.en: eos 50256, decoder prompt 50257+. HF's row holds the prompt and,
    in a padded batch, eos padding; ours ends at its eos. The H100 check printed
    0/32 equal when ours kept its eos and HF's did not."""
    eos = 50256
    hf_row = [50257, 50362, 11, 22, 33, eos, eos, eos]
    assert gpu_bench.same_transcript([11, 22, 33, eos], hf_row, eos)
    assert gpu_bench.same_transcript([11, 22, 33], [50257, 50362, 11, 22, 33], eos)  # both cut at max tokens
    assert not gpu_bench.same_transcript([11, 22, eos], hf_row, eos)
    assert not gpu_bench.same_transcript([11, 22, 50300, 33, eos], hf_row, eos)  # a special token of ours counts


def test_step_clock_reads_the_engine(tiny_bart):
    """What the bench prints beside our rate: the timed run's steps, how many
    admitted requests, and each kind's time."""
    from encdec import LLM, SamplingParams

    llm = LLM(tiny_bart, device="cpu", kv_cache_memory=16 << 20, max_num_seqs=2)
    llm.generate(["warm"], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    clock = gpu_bench.StepClock(llm)
    outs = clock.run(lambda: llm.generate(["a", "b c", "d e f"], SamplingParams(max_tokens=3, min_tokens=3,
                                                                                temperature=0.0), use_tqdm=False))
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3, 3]
    assert "step" not in vars(llm.llm_engine)  # the engine's own step is back
    # 3 requests over 2 slots: two admitted at once, the third when one finishes; 3 tokens each
    assert len(clock.seconds) == 6 and all(t > 0 for t in clock.seconds.values())
    summary = clock.summary()
    assert summary.startswith("ours: 6 steps in ") and ", 2 admitting (" in summary and "4 decode-only (" in summary


def test_engine_options_parse_values():
    def error(msg):
        raise SystemExit(msg)

    assert gpu_bench.engine_options(["max_num_seqs=512", "gpu_memory_utilization=0.5", "enforce_eager=true",
                                     "attention_backend=torch_native"], error) == {
        "max_num_seqs": 512, "gpu_memory_utilization": 0.5, "enforce_eager": True, "attention_backend": "torch_native"}
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        gpu_bench.engine_options(["max_num_seqs"], error)
