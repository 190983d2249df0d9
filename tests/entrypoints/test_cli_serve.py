"""``encdec serve``'s command line (the server itself: the other tests here)."""
from __future__ import annotations

import pytest

from encdec.entrypoints.cli import main


def test_serve_help_lists_server_and_engine_options(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("MODEL", "--host", "--port", "--api-key", "--max-audio-mb", "--header-read-timeout",
                 "--body-read-timeout", "--body-timeout", "--kv-cache-memory",
                 "--max-num-seqs", "--dtype", "--block-size"):
        assert flag in out


def test_serve_bad_engine_option_is_a_clear_error_before_listening(tiny_bart, capsys):
    assert main(["serve", tiny_bart, "--max-num-seqs", "0", "--port", "1"]) == 2
    assert "max_num_seqs" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--header-read-timeout", "--body-read-timeout", "--body-timeout"])
def test_serve_timeouts_must_be_positive(flag, capsys):
    assert main(["serve", "/nonexistent", flag, "0", "--port", "1"]) == 2
    assert f"{flag} must be > 0 seconds" in capsys.readouterr().err
