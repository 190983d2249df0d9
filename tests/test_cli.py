"""The command line: `encdec generate` end to end on the tiny BART."""
from __future__ import annotations

import json

from encdec.entrypoints.cli import main


def test_generate_json(tiny_bart, capsys):
    rc = main(["generate", "--model", tiny_bart, "--kv-cache-memory", str(16 << 20), "--swap-space", "0.01",
               "--max-tokens", "5", "--json", "--quiet", "The rain in spain", "hello"])
    assert rc == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert [x["prompt"] for x in lines] == ["The rain in spain", "hello"]
    assert all(1 <= len(x["outputs"][0]["token_ids"]) <= 5 for x in lines)


def test_generate_bad_option_is_a_clear_error(tiny_bart, capsys):
    rc = main(["generate", "--model", tiny_bart, "--max-tokens", "0", "--quiet", "x"])
    assert rc == 2
    assert "max_tokens" in capsys.readouterr().err
