"""benchmarks/spec_gpu (gpu_bench's ``spec`` part) on CPU at tiny dims: the draft
it writes is the target's first decoder layers, a run times both sides, checks
their tokens are identical and prints the ratio and the acceptance."""
from __future__ import annotations

import json
import os
import re

import pytest
import torch

from benchmarks import gpu_bench, spec_gpu


def test_the_spec_part_runs_on_cpu_at_tiny_dims(tmp_path, capsys):
    line = spec_gpu.main(["--dims", "tiny", "--device", "cpu", "--requests", "8", "--rounds", "2",
                          "--workdir", str(tmp_path)])
    out = capsys.readouterr().out
    assert line in out and line.startswith("spec: encdec (") and line.endswith("outputs identical")
    assert re.search(r"ratio \d+\.\d\dx \(median per round \d+\.\d\dx\)", line)
    acc = re.search(r"acceptance \d+\.\d% \((\d+)/(\d+) drafts\)", line)
    assert acc, line
    kept, drafted = int(acc.group(1)), int(acc.group(2))
    # The tiny init is chosen so that drafts are both kept and rejected (KV rolled back).
    assert 0 < kept < drafted, line
    for r in (1, 2):
        for side in ("off", "draft k=3"):
            assert re.search(rf"round {r} +{side}: +\d+\.\d tok/s \(\d+ tokens", out), (r, side)
    assert "2-layer draft k=3" in line and "8 requests" in line and "float32 on cpu" in line


def test_cuda_s_default_backend_runs_it_too(tmp_path, capsys):
    """torch_native, the CUDA default (its Triton paged kernel under TRITON_INTERPRET=1,
    which tests/conftest.py sets on CPU): the draft's own pool and the verify
    step's 1 + k causal rows go through the kernel a GPU runs."""
    line = spec_gpu.main(["--dims", "tiny", "--device", "cpu", "--requests", "4", "--rounds", "1",
                          "--workdir", str(tmp_path), "--engine", "attention_backend=torch_native"])
    assert line.startswith("spec: encdec (torch_native)") and line.endswith("outputs identical")
    kept, drafted = map(int, re.search(r"\((\d+)/(\d+) drafts\)", line).groups())
    assert 0 < kept < drafted, line


def test_the_draft_is_the_target_s_first_decoder_layers(tmp_path):
    from safetensors.torch import load_file

    from encdec.testing import make_random_bart

    target = make_random_bart(str(tmp_path / "t"), layers=3)
    draft = spec_gpu.write_draft(target, 1)
    assert draft == str(tmp_path / "t") + "_draft1"
    with open(os.path.join(draft, "config.json")) as f:
        config = json.load(f)
    assert (config["decoder_layers"], config["encoder_layers"]) == (1, 3)
    t, d = load_file(os.path.join(target, "model.safetensors")), load_file(os.path.join(draft, "model.safetensors"))
    gone = {k for k in t if re.search(r"decoder\.layers\.[12]\.", k)}
    assert gone and set(d) == set(t) - gone
    assert all(torch.equal(d[k], t[k]) for k in d)
    assert {"tokenizer.json", "generation_config.json"} <= set(os.listdir(draft))
    assert spec_gpu.write_draft(target, 1) == draft  # written once


@pytest.mark.parametrize("layers", [0, 3])
def test_a_draft_as_deep_as_its_target_is_refused(tmp_path, layers):
    from encdec.testing import make_random_bart

    target = make_random_bart(str(tmp_path / "t"), layers=3)
    with pytest.raises(ValueError, match=r"decoder_layers must be in \[1, 3\)"):
        spec_gpu.write_draft(target, layers)
    assert not os.path.exists(str(tmp_path / "t") + f"_draft{layers}")


def test_the_first_difference_is_named():
    assert spec_gpu.first_difference([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]], "same") is None
    diff = spec_gpu.first_difference([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 7, 6]], "round 2 x")
    assert diff == ("round 2 x: request 1's tokens differ from speculation off at output position 1 "
                    "([5, 6] against [7, 6])")
    assert "position 2" in spec_gpu.first_difference([[1, 2, 3]], [[1, 2]], "short")


def test_a_run_whose_tokens_differ_prints_its_line_then_fails(tmp_path, capsys, monkeypatch):
    """The speculating side's tokens altered: the rounds finish, the spec: line says so, the run fails."""
    real, calls = spec_gpu.run_side, []

    def altered(llm, work):  # sides alternate, off first (warm-ups, then rounds): every second call speculates
        res = real(llm, work)
        calls.append(llm)
        if len(calls) % 2 == 0:
            res.outputs[3] = res.outputs[3][:-1] + [res.outputs[3][-1] + 1]
        return res

    monkeypatch.setattr(spec_gpu, "run_side", altered)
    with pytest.raises(SystemExit, match=r"spec: round 1 draft k=3: request 3's tokens differ"):
        spec_gpu.main(["--dims", "tiny", "--device", "cpu", "--requests", "4", "--rounds", "2",
                       "--workdir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "round 2  draft k=3" in out
    assert re.search(r"^spec: .*ratio .*OUTPUTS DIFFER \(round 1 draft k=3: request 3", out, re.M)


def test_options():
    args = spec_gpu.parse_args(["--quick"])
    assert (args.dims, args.device, args.dtype, args.requests, args.rounds, args.k) == (
        "large", "cuda", "float32", 64, 2, 3)
    assert spec_gpu.DIMS["large"].draft_layers == 6 and spec_gpu.DIMS["large"].layers == 12


@pytest.mark.parametrize("argv", [["--k", "0"], ["--requests", "0"], ["--rounds", "0"]])
def test_bad_options_stop_before_anything_loads(argv, capsys):
    with pytest.raises(SystemExit):
        spec_gpu.parse_args(argv)
    assert "must be >= 1" in capsys.readouterr().err


def test_gpu_bench_has_the_spec_part(capsys):
    assert "spec" in gpu_bench.PARTS
    with pytest.raises(SystemExit):
        gpu_bench.main(["--parts", "spec", "--spec-k", "0"])
    assert "--spec-k must be >= 1, got 256 and 0" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA host runs it")
def test_cuda_is_refused_without_a_gpu():
    with pytest.raises(SystemExit, match="--dims tiny --device cpu"):
        spec_gpu.main(["--dims", "tiny", "--requests", "1"])


def test_gpu_bench_passes_its_options_to_the_spec_part(tmp_path, monkeypatch, capsys):
    """``gpu_bench --parts spec`` (CUDA's presence faked, the run recorded): the
    bart part's checkpoint is the target, and the options reach the run."""
    seen = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a faked GPU")
    monkeypatch.setattr(gpu_bench, "bart_large_dir", lambda root: os.path.join(root, "large"))
    monkeypatch.setattr(gpu_bench, "spec_part", lambda target, dims, opts: seen.update(t=target, d=dims, o=opts))
    gpu_bench.main(["--parts", "spec", "--quick", "--spec-k", "5", "--workdir", str(tmp_path),
                    "--engine", "max_num_seqs=32"])
    assert seen["t"] == os.path.join(str(tmp_path), "large") and seen["d"] == "large"
    assert seen["o"] == spec_gpu.SpecOptions(64, 5, 2, "cuda", "float32", 0, {"max_num_seqs": 32})
    assert "GPU: a faked GPU" in capsys.readouterr().out
