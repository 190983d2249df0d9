"""``python -m benchmarks.spec_bench --whisper``: Whisper sequential long-form
with and without speculation, sides alternating in one process, outputs
(each file's text and tokens) required identical."""
from __future__ import annotations

import pytest

from benchmarks import spec_bench


def test_sides_per_method():
    sides = spec_bench.sides_for([2, 4], 3, 1, no_spec=False, methods=("ngram", "draft_model"), model_dir="/m")
    assert [s.name for s in sides] == ["off", "ngram k=2", "ngram k=4", "int8 draft k=2", "int8 draft k=4"]
    assert sides[3].spec == {"method": "draft_model", "model": "/m", "num_speculative_tokens": 2,
                             "quantization": "int8"}
    with pytest.raises(SystemExit):
        spec_bench.parse_args(["--whisper", "--method", "medusa"])


@pytest.mark.slow
def test_whisper_tiny_runs_and_sides_agree(ct2_dir, capsys):
    results = spec_bench.main(["--whisper", "--whisper-models", "tiny", "--compute-types", "float32",
                               "--minutes", "0.2", "--repeats", "1", "--k", "2", "--threads", "1"])
    (label, rounds), = results.items()
    off, on = rounds["off"][0], rounds["ngram k=2"][0]
    assert off.outputs == on.outputs and off.outputs[0][0].strip() and off.tokens == on.tokens > 0
    assert on.drafted is not None and off.drafted == 0
    out = capsys.readouterr().out
    assert "Whisper tiny float32, sequential long-form" in out and "acceptance" in out
