"""The copy task and its trained BART (``encdec.bench.copy_task``/``copy_model``,
``benchmarks.train_copy_model``): summaries are the marked sentences, a seed fixes the
data and the weights, a matching manifest is reused, and the saved tokenizer and
checkpoint load in our engine."""
from __future__ import annotations

import dataclasses
import pytest

from encdec.bench import copy_model
from encdec.bench.copy_model import TrainOptions, task_at, train_and_save
from encdec.bench.copy_task import MARKER, PERIOD, CopyTask, make_examples, vocabulary

TINY_TASK = CopyTask(num_words=40, sentences=(4, 6), words=(3, 5), marked=(1, 2))
TINY = TrainOptions(task=TINY_TASK, steps=3, batch=4, warmup=1, d_model=32, layers=1, heads=2, ffn=64, threads=1)


def test_a_summary_is_the_marked_sentences_in_order():
    words = vocabulary(TINY_TASK.num_words)
    period, marker = words.index(PERIOD), words.index(MARKER)
    for doc, summary in make_examples(TINY_TASK, 50, seed=3):
        sentences, cur = [], []
        for t in doc:
            cur.append(t)
            if t == period:
                sentences.append(cur)
                cur = []
        assert not cur and TINY_TASK.sentences[0] <= len(sentences) <= TINY_TASK.sentences[1]
        marked = [s for s in sentences if s[0] == marker]
        assert TINY_TASK.marked[0] <= len(marked) <= TINY_TASK.marked[1]
        assert summary == [t for s in marked for t in s]
        assert len(doc) + 2 <= TINY_TASK.max_source_len() and len(summary) + 1 <= TINY_TASK.max_summary_len()


def test_the_same_seed_gives_the_same_examples_and_another_seed_others():
    assert make_examples(TINY_TASK, 5, seed=1) == make_examples(TINY_TASK, 5, seed=1)
    assert make_examples(TINY_TASK, 5, seed=1) != make_examples(TINY_TASK, 5, seed=2)
    assert vocabulary(40) == vocabulary(40) and len(set(vocabulary(1000))) == len(vocabulary(1000))


@pytest.mark.parametrize("bad, field", [(dict(sentences=(3, 2)), "sentences"), (dict(words=(0, 4)), "words"),
                                        (dict(marked=(1, 9)), "marked"), (dict(num_words=3), "num_words")])
def test_a_bad_task_is_a_value_error_naming_the_field(bad, field):
    with pytest.raises(ValueError, match=f"CopyTask.{field}"):
        CopyTask(**{**dataclasses.asdict(TINY_TASK), **bad})


@pytest.mark.parametrize("bad, field", [(dict(steps=0), "steps"), (dict(d_model=33), "d_model"),
                                        (dict(curriculum=1.5), "curriculum"), (dict(lr=0.0), "lr")])
def test_bad_training_options_are_value_errors_naming_the_field(bad, field):
    with pytest.raises(ValueError, match=f"TrainOptions.{field}"):
        dataclasses.replace(TINY, **bad)


def test_documents_grow_to_full_length_over_the_curriculum():
    opts = dataclasses.replace(TINY, task=CopyTask(sentences=(16, 28)), steps=100, curriculum=0.5)
    tops = [task_at(opts, s).sentences[1] for s in range(100)]
    assert tops[0] < 10 and tops == sorted(tops) and tops[50:] == [28] * 50
    assert task_at(opts, 99) == opts.task
    assert task_at(dataclasses.replace(opts, curriculum=0.0), 0) == opts.task
    assert all(task_at(opts, s).sentences[0] >= opts.task.marked[1] for s in range(100))


def test_a_longer_run_with_the_same_decay_repeats_the_shorter_run_s_rates():
    from encdec.bench.copy_model import _lr_at

    short, long = TrainOptions(steps=300, decay_steps=None), TrainOptions(steps=600, decay_steps=300)
    assert [_lr_at(short, s) for s in range(300)] == [_lr_at(long, s) for s in range(300)]
    assert _lr_at(long, 599) == pytest.approx(short.lr / 10) and _lr_at(short, 0) < _lr_at(short, 60)
    with pytest.raises(ValueError, match="TrainOptions.decay_steps"):
        TrainOptions(decay_steps=10)


def test_training_is_deterministic_and_a_matching_manifest_is_reused(tmp_path, monkeypatch):
    first = train_and_save(str(tmp_path / "a"), TINY, eval_count=4, log=None)
    second = train_and_save(str(tmp_path / "b"), TINY, eval_count=4, log=None)
    other = train_and_save(str(tmp_path / "c"), dataclasses.replace(TINY, seed=1), eval_count=4, log=None)
    assert first["weights_sha256"] == second["weights_sha256"] != other["weights_sha256"]

    def no_training(*args, **kwargs):
        raise AssertionError("trained again although the manifest matches")

    monkeypatch.setattr(copy_model, "train", no_training)
    logged = []
    assert train_and_save(str(tmp_path / "a"), TINY, eval_count=4, log=logged.append) == first
    assert "reusing" in logged[0]
    with pytest.raises(AssertionError, match="trained again"):  # other options: not reused
        train_and_save(str(tmp_path / "a"), dataclasses.replace(TINY, steps=4), eval_count=4, log=None)


def test_two_threads_train_the_same_weights_twice(tmp_path):
    """The default trains on two threads: at the default dims (ops large enough
    to be split between threads) two runs give the same weights."""
    opts = dataclasses.replace(TrainOptions(), steps=3, threads=2)
    first = train_and_save(str(tmp_path / "a"), opts, eval_count=2, log=None)
    second = train_and_save(str(tmp_path / "b"), opts, eval_count=2, log=None)
    assert first["weights_sha256"] == second["weights_sha256"]


def test_the_saved_tokenizer_reads_a_document_as_its_token_ids(tmp_path):
    from transformers import AutoTokenizer

    copy_model.save_tokenizer(str(tmp_path), TINY_TASK)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    words = vocabulary(TINY_TASK.num_words)
    doc, summary = make_examples(TINY_TASK, 1, seed=0)[0]
    assert tok(" ".join(words[t] for t in doc))["input_ids"] == copy_model.source_ids(doc)
    assert tok.decode(summary) == " ".join(words[t] for t in summary)
    assert (tok.bos_token_id, tok.pad_token_id, tok.eos_token_id) == (0, 1, 2) and len(tok) == len(words)


def test_the_train_script_checks_our_engine_against_hf(tmp_path, capsys):
    """The script's --verify path on a tiny model: our LLM's greedy tokens equal HF
    generate's (untrained weights run to the length limit, which must agree too)."""
    from benchmarks import train_copy_model

    out = str(tmp_path / "m")
    manifest = train_copy_model.main(["--out", out, "--steps", "2", "--eval", "4", "--verify"], base=TINY)
    assert manifest["options"]["steps"] == 2 and manifest["options"]["d_model"] == TINY.d_model
    printed = capsys.readouterr().out
    assert "identical greedy tokens" in printed and "held-out exact match" in printed
    opts = train_copy_model.options_from(train_copy_model.build_parser().parse_args(["--seed", "5"]))
    assert opts == dataclasses.replace(TrainOptions(), seed=5)
