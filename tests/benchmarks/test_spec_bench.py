"""benchmarks/spec_bench: its options are checked before anything loads, it refuses a
directory that holds no copy model, and a run on a tiny copy model times every side,
checks outputs are identical and reports acceptance from the engine's counters."""
from __future__ import annotations

import dataclasses

import pytest

from benchmarks import spec_bench
from encdec.bench.copy_model import TrainOptions, train_and_save
from encdec.bench.copy_task import CopyTask

TINY = TrainOptions(task=CopyTask(num_words=40, sentences=(4, 6), words=(3, 5), marked=(1, 2)), steps=2, batch=4,
                    warmup=1, d_model=32, layers=1, heads=2, ffn=64, threads=1)


@pytest.fixture(scope="module")
def tiny_copy_model(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("copy") / "m")
    train_and_save(out, TINY, eval_count=2, log=None)
    return out


def test_defaults_are_the_issue_s_levels_and_ks():
    args = spec_bench.parse_args([])
    assert (args.requests, args.k, args.no_spec) == ([1, 8, 64], [3, 5], False)
    assert args.model_dir == spec_bench.DEFAULT_MODEL_DIR and 1 <= args.lookup_min <= args.lookup_max


@pytest.mark.parametrize("argv, message", [(["--requests", "0"], "--requests"), (["--k", "3", "0"], "--k"),
                                           (["--repeats", "0"], "--repeats"),
                                           (["--lookup-min", "4", "--lookup-max", "3"], "--lookup-min")])
def test_bad_options_stop_before_anything_loads(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        spec_bench.parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_sides_are_off_then_one_ngram_side_per_k():
    sides = spec_bench.sides_for([3, 5], 4, 1, no_spec=False)
    assert [s.name for s in sides] == ["off", "ngram k=3", "ngram k=5"] and sides[0].spec is None
    assert sides[2].spec == {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4,
                             "prompt_lookup_min": 1}
    assert [s.name for s in spec_bench.sides_for([3], 4, 1, no_spec=True)] == ["off"]


def test_a_directory_without_a_copy_model_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--model-dir .* holds no copy model"):
        spec_bench.copy_workload(str(tmp_path), docs=4, concurrency=2)


def test_the_workload_splits_held_out_documents_by_concurrency(tiny_copy_model):
    work = spec_bench.copy_workload(tiny_copy_model, docs=5, concurrency=2)
    assert [len(b) for b in work.batches] == [2, 2, 1] and len(work.references) == 5
    assert work.engine_options == {"max_num_seqs": 2, "enable_encoder_cache": False}
    assert work.params.temperature == 0.0 and work.params.max_tokens == TINY.task.max_summary_len()


def test_a_no_spec_run_times_the_side_without_speculation_only(tiny_copy_model, capsys):
    results = spec_bench.main(["--model-dir", tiny_copy_model, "--no-spec", "--requests", "1", "3",
                               "--docs", "3", "--repeats", "1", "--threads", "1"])
    # 3 of 3 documents in flight is one wave: no continuous run of its own
    assert sorted(results) == [(1, "continuous"), (1, "waves"), (3, "waves")]
    assert all(list(r) == ["off"] for r in results.values())
    outs = [r["off"][0].outputs for r in results.values()]
    assert outs[0] == outs[1] == outs[2]  # neither concurrency nor admission changes a token
    assert all(r["off"][0].tokens > 0 and len(r["off"]) == 1 for r in results.values())
    out = capsys.readouterr().out
    assert "host ISA:" in out and "held-out exact match" in out and "ngram" not in out


def test_a_spec_run_reports_acceptance_and_identical_outputs(tiny_copy_model, capsys):
    results = spec_bench.main(["--model-dir", tiny_copy_model, "--requests", "2", "--k", "1", "3",
                               "--docs", "4", "--repeats", "2", "--threads", "1", "--admission", "waves"])
    sides = {name: spec_bench.best_of(rounds) for name, rounds in results[(2, "waves")].items()}
    assert list(sides) == ["off", "ngram k=1", "ngram k=3"]
    for name in ("ngram k=1", "ngram k=3"):
        assert sides[name].outputs == sides["off"].outputs
        assert sides[name].drafted is not None and 0 <= sides[name].accepted <= sides[name].drafted
    assert sides["ngram k=3"].drafted > 0  # the tiny model repeats itself, so drafts are proposed
    out = capsys.readouterr().out
    assert "acceptance" in out and "median per round" in out


def test_continuous_admission_is_one_call_capped_at_the_concurrency(tiny_copy_model):
    work = spec_bench.copy_workload(tiny_copy_model, 5, 2, continuous=True)
    assert [len(b) for b in work.batches] == [5] and work.engine_options["max_num_seqs"] == 2
    assert "2 in flight, continuous admission" in work.label


def test_round_ratios_pair_each_round():
    def r(seconds):
        return spec_bench.Result(seconds, 10, [], None, None, 0.0)

    assert spec_bench.round_ratios([r(2.0), r(4.0)], [r(1.0), r(1.0)]) == [2.0, 4.0]
    assert spec_bench.best_of([r(3.0), r(1.5), r(2.0)]).seconds == 1.5


def test_different_outputs_stop_the_benchmark(tiny_copy_model, monkeypatch):
    """A side whose tokens differ from the side without speculation is an error, not a figure."""
    real = spec_bench.run_side

    def one_token_off(llm, work):
        res = real(llm, work)
        if llm.engine_args.speculative_config is not None:
            res = dataclasses.replace(res, outputs=[o[:-1] for o in res.outputs])
        return res

    monkeypatch.setattr(spec_bench, "run_side", one_token_off)
    work = spec_bench.copy_workload(tiny_copy_model, docs=2, concurrency=2)
    with pytest.raises(SystemExit, match="outputs with ngram k=2 differ"):
        spec_bench.compare(tiny_copy_model, work, spec_bench.sides_for([2], 3, 1, no_spec=False), 1, 1)


def test_the_admission_bench_times_both_sides_and_restores_the_rule(tiny_copy_model, capsys):
    from benchmarks import admission_bench
    from encdec.worker import enc_dec_model_runner

    rule = enc_dec_model_runner.admits_as_decodes
    results = admission_bench.main(["--model-dir", tiny_copy_model, "--in-flight", "2", "--docs", "6",
                                    "--repeats", "1", "--threads", "1"])
    assert set(results[2]) == {"op by op", "admitted"} and all(s > 0 for s in results[2].values())
    assert "outputs identical" in capsys.readouterr().out
    assert enc_dec_model_runner.admits_as_decodes is rule
