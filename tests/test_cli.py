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


def test_generate_missing_input_file_is_one_line_exit_2(tiny_bart, tmp_path, capsys):
    rc = main(["generate", "--model", tiny_bart, "--quiet", "--input-file", str(tmp_path / "nope.txt")])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert err.strip().splitlines() == [
        f"encdec generate: error: cannot read --input-file {str(tmp_path / 'nope.txt')!r}: "
        "No such file or directory"]


def test_generate_request_that_never_fits_exits_nonzero_without_output(tiny_bart, capsys):
    # 40 blocks of 16 tokens; n=3 x 200 tokens needs 43.
    rc = main(["generate", "--model", tiny_bart, "--kv-cache-memory", str(40 * 2 * 2 * 16 * 64 * 4),
               "--swap-space", "0.01", "--n", "3", "--temperature", "1.0", "--max-tokens", "200",
               "--ignore-eos", "--quiet", "first", "second"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert "can never fit the KV cache" in err and "cache has 40 blocks" in err
    assert len(err.strip().splitlines()) == 1


def test_transcribe_bad_options_fail_before_any_work(tmp_path, capsys):
    """Checked before the model loads (no --model needed to see them)."""
    import os

    clip = os.path.join(os.path.dirname(__file__), "data", "speech", "s00.wav")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cases = [
        (["--output-dir", str(blocker / "sub")], "cannot write to --output-dir"),
        (["--output-dir", str(blocker)], "cannot write to --output-dir"),
        (["--num-threads", "-2"], "--num-threads must be >= 1, got -2"),
        (["--num-threads", "0"], "--num-threads must be >= 1, got 0"),
    ]
    for extra, message in cases:
        rc = main(["transcribe", clip, "--model", str(tmp_path / "no-model"), "--no-progress", *extra])
        out, err = capsys.readouterr()
        assert rc == 2 and out == "", extra
        assert len(err.strip().splitlines()) == 1 and message in err, err


def test_transcribe_request_that_never_fits_exits_nonzero_without_output(ct2_dir, capsys):
    """A 100-block cache cannot hold one 30 s window (94 cross blocks + 28 for
    448 decoder positions): an error on stderr, no blank transcript, exit 2."""
    import os

    clip = os.path.join(os.path.dirname(__file__), "data", "speech", "s00.wav")
    rc = main(["transcribe", clip, "--model", str(ct2_dir), "--kv-cache-memory", str(100 * 196608),
               "--swap-space", "0.1", "--num-threads", "1", "--no-progress"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert "100 blocks" in err and len(err.strip().splitlines()) == 1
