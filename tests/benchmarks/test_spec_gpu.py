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


def test_differing_tokens_stop_the_run_naming_the_first():
    spec_gpu.check_identical([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]], "same")
    with pytest.raises(SystemExit, match=r"spec: round 2 x: request 1's tokens differ .* at output position 1"):
        spec_gpu.check_identical([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 7, 6]], "round 2 x")
    with pytest.raises(SystemExit, match="position 2"):
        spec_gpu.check_identical([[1, 2, 3]], [[1, 2]], "short")


def test_options():
    args = spec_gpu.parse_args(["--quick"])
    assert (args.dims, args.device, args.dtype, args.requests, args.rounds, args.k) == (
        "large", "cuda", "float16", 64, 2, 3)
    assert spec_gpu.parse_args(["--device", "cpu"]).dtype == "float32"
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
