"""The command line: `encdec generate` end to end on the tiny BART."""
from __future__ import annotations

import json

import pytest

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


def test_transcribe_says_why_an_input_is_not_an_audio_file(tmp_path, capsys):
    """A directory, a device and an empty file each get their own reason (not
    "no such file"), one line, exit 2, before the model loads."""
    empty = tmp_path / "empty.wav"
    empty.write_bytes(b"")
    cases = [
        (str(tmp_path), "is a directory"),
        ("/dev/null", "is not a regular file"),
        (str(empty), "is empty (0 bytes)"),
        (str(tmp_path / "nope.wav"), "no such file"),
    ]
    for path, message in cases:
        rc = main(["transcribe", path, "--model", str(tmp_path / "no-model"), "--no-progress"])
        out, err = capsys.readouterr()
        assert rc == 2 and out == "", path
        assert len(err.strip().splitlines()) == 1 and f"{path}: {message}" in err, err


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


# -- options defined once: EngineArgs and TranscribeOptions fields are the flags ----------

def _flags_in_help(command: str, capsys) -> str:
    import pytest

    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def _has_flag(text: str, name: str) -> bool:
    import re

    return re.search(rf"(?<![\w-])--{name.replace('_', '-')}(?![\w-])", text) is not None


def test_every_engine_option_is_a_flag_of_generate_transcribe_and_serve(capsys):
    import dataclasses

    from encdec.engine.arg_utils import EngineArgs
    from encdec.entrypoints.cli_options import ENGINE_NO_FLAG

    names = [f.name for f in dataclasses.fields(EngineArgs)]
    assert set(ENGINE_NO_FLAG) <= set(names) and all(len(why) > 20 for why in ENGINE_NO_FLAG.values())
    for command in ("generate", "transcribe", "serve"):
        text = _flags_in_help(command, capsys)
        missing = [n for n in names if n not in ENGINE_NO_FLAG and not _has_flag(text, n)]
        assert missing == [], (command, missing)
        assert "without CUDA graphs" in text  # --enforce-eager's help is its field comment


def test_every_transcribe_option_is_a_flag_of_transcribe(capsys):
    import dataclasses

    from encdec.entrypoints.transcribe_cli import TRANSCRIBE_NO_FLAG
    from encdec.transcription.options import TranscribeOptions

    names = [f.name for f in dataclasses.fields(TranscribeOptions)]
    assert set(TRANSCRIBE_NO_FLAG) <= set(names) and all(len(why) > 20 for why in TRANSCRIBE_NO_FLAG.values())
    text = _flags_in_help("transcribe", capsys)
    assert [n for n in names if n not in TRANSCRIBE_NO_FLAG and not _has_flag(text, n)] == []
    assert not any(_has_flag(text, n) for n in TRANSCRIBE_NO_FLAG)


def test_every_option_is_documented_by_its_field_comment():
    import dataclasses

    from encdec.engine.arg_utils import EngineArgs
    from encdec.entrypoints.cli_options import field_comments
    from encdec.transcription.options import TranscribeOptions

    for cls in (EngineArgs, TranscribeOptions):
        docs = field_comments(cls)
        assert [f.name for f in dataclasses.fields(cls) if len(docs.get(f.name, "")) < 8] == [], cls


def test_flags_parse_to_the_option_values():
    from encdec.entrypoints.cli import build_parser
    from encdec.entrypoints.cli_options import dataclass_values, engine_options
    from encdec.transcription.options import TranscribeOptions

    parser = build_parser()
    args = parser.parse_args(["generate", "--model", "m", "--max-num-seqs", "3", "--dtype", "float32",
                              "--no-enable-encoder-cache", "--enforce-eager", "--logits-processors", "a:B",
                              "c:D", "--", "x"])
    options = engine_options(args)
    assert options["model"] == "m" and options["max_num_seqs"] == 3 and options["dtype"] == "float32"
    assert options["enable_encoder_cache"] is False and options["enforce_eager"] is True
    assert options["logits_processors"] == ["a:B", "c:D"] and args.prompts == ["x"]
    # Unset flags keep EngineArgs's defaults.
    assert engine_options(parser.parse_args(["serve", "m"]))["swap_space"] == 4

    args = parser.parse_args(["transcribe", "a.wav", "--prompt", "Names.", "--temperature", "0,0.5",
                              "--compression-ratio-threshold", "none", "--no-condition-on-previous-text",
                              "--clip-timestamps", "0,10.5", "--mode", "independent"])
    values = dataclass_values(args, TranscribeOptions)
    assert values["initial_prompt"] == "Names." and values["temperature"] == (0.0, 0.5)
    assert values["compression_ratio_threshold"] is None and values["condition_on_previous_text"] is False
    assert values["clip_timestamps"] == (0.0, 10.5) and values["mode"] == "independent"
    assert values["log_prob_threshold"] == -1.0 and values["timestamps"] is None
    assert TranscribeOptions(**values).temperature == (0.0, 0.5)


def test_memory_sizes_parse_the_same_in_every_command(capsys):
    import pytest

    from encdec.entrypoints.cli import build_parser
    from encdec.entrypoints.cli_options import parse_memory_size

    sizes = {"512MiB": 512 << 20, "2GiB": 2 << 30, "2gib": 2 << 30, "1.5GB": 1_500_000_000,
             "64kB": 64_000, "16777216": 16 << 20, " 3 MiB ": 3 << 20, "100b": 100}
    for text, expected in sizes.items():
        assert parse_memory_size(text) == expected, text
    parser = build_parser()
    heads = {"generate": ["generate", "--model", "m"], "transcribe": ["transcribe", "a.wav"],
             "serve": ["serve", "m"]}
    for command, head in heads.items():
        for text, expected in sizes.items():
            assert parser.parse_args([*head, "--kv-cache-memory", text]).kv_cache_memory == expected, command
        for bad in ("lots", "1.5", "-1MiB", "MiB", "2 GiBs"):
            with pytest.raises(SystemExit) as e:
                parser.parse_args([*head, f"--kv-cache-memory={bad}"])
            assert e.value.code == 2
            err = capsys.readouterr().err
            assert f"expected a size like 512MiB, 2GiB or a byte count, got {bad!r}" in err, (command, err)


def test_llm_takes_engine_options_by_keyword_and_names_an_unknown_one(tiny_bart):
    import pytest

    from encdec import LLM

    with pytest.raises(TypeError, match="kv_cache_mem"):
        LLM(tiny_bart, kv_cache_mem=16 << 20)
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLM(tiny_bart, max_num_seqs=0)
    llm = LLM(tiny_bart, dtype="float32", kv_cache_memory=16 << 20, swap_space=0.01, max_num_seqs=4)
    assert llm.engine_args.kv_cache_memory == 16 << 20 and llm.engine_args.max_num_seqs == 4
    assert llm.llm_engine.cache_config.kv_cache_memory == 16 << 20


@pytest.mark.parametrize("flags", [["--ingress", "haproxy"], ["--replicas", "2"], ["--replica-cpus", "2"]])
def test_ray_flags_without_ray_are_refused(flags, capsys):
    rc = main(["serve", "some-model", *flags])
    assert rc == 2
    assert f"{flags[0]} take effect with --ray only" in capsys.readouterr().err
