from __future__ import annotations

import textwrap

import pytest
import torch

from encdec.sample.logits_processor import (
    ENTRY_POINT_GROUP,
    AdapterLogitsProcessor,
    LogitBiasLogitsProcessor,
    LogitsProcessors,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
    build_logitsprocs,
    resolve_logitsproc_class,
)
from encdec.sample.logits_processor.generation import (
    BadWordsLogitsProcessor,
    ForcedBOSEOSLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
)
from encdec.sample.sampler import Sampler
from encdec.sampling_params import SamplingParams
from encdec.worker.input_batch import InputBatch
from tests.sample.dummy_processor import DummyLogitsProcessor, WrappedPerReqLogitsProcessor
from tests.sample.reference import make_batch

VOCAB = 40
FQCN = "tests.sample.dummy_processor:DummyLogitsProcessor"


def test_builtins_split_by_argmax_invariance() -> None:
    procs = build_logitsprocs(None, "cpu", include_entry_points=False)
    # no checkpoint bad words here: that processor leaves argmax alone
    assert [type(p) for p in procs.argmax_invariant] == [MinPLogitsProcessor, BadWordsLogitsProcessor]
    assert {type(p) for p in procs.non_argmax_invariant} == {
        MinTokensLogitsProcessor, LogitBiasLogitsProcessor, NoRepeatNGramLogitsProcessor,
        ForcedBOSEOSLogitsProcessor}
    assert len(procs.all) == 6


def test_min_tokens_lifts_once_enough_outputs() -> None:
    params = SamplingParams(min_tokens=2, stop_token_ids=[5])
    params.update_from_generation_config({}, model_eos_token_id=2)
    out: list[int] = []
    ib = make_batch([params, SamplingParams()], [[1], [1]], [out, []], VOCAB)
    proc = ib.logitsprocs.get(MinTokensLogitsProcessor)
    masked = []
    for _ in range(4):
        ib.refresh_metadata()
        logits = proc.apply(torch.zeros(2, VOCAB))
        masked.append(sorted(torch.nonzero(logits[0] == float("-inf")).flatten().tolist()))
        assert not torch.isinf(logits[1]).any()
        out.append(9)  # the engine appends the sampled token
    assert masked == [[2, 5], [2, 5], [], []]


def test_ignore_eos_keeps_eos_out_of_min_tokens_mask() -> None:
    params = SamplingParams(min_tokens=3, ignore_eos=True)
    params.update_from_generation_config({"eos_token_id": [2, 3]}, model_eos_token_id=2)
    assert params.all_stop_token_ids == set()
    ib = make_batch([params], [[1]], [[]], VOCAB)
    md = ib.refresh_metadata()
    assert not torch.isinf(Sampler().apply_logits_processors(torch.zeros(1, VOCAB), md)).any()


def test_logit_bias_and_min_p_rows_follow_their_requests() -> None:
    rows = [SamplingParams(logit_bias={3: 2.0}), SamplingParams(), SamplingParams(min_p=0.5)]
    ib = make_batch(rows, [[1]] * 3, [[], [], []], VOCAB)
    ib.refresh_metadata()
    ib.remove_request("r0")  # r2 moves into row 0
    ib.refresh_metadata()
    bias = ib.logitsprocs.get(LogitBiasLogitsProcessor).apply(torch.zeros(2, VOCAB))
    assert not bias.any()
    logits = torch.zeros(2, VOCAB)
    logits[:, 7] = 3.0
    logits = ib.logitsprocs.get(MinPLogitsProcessor).apply(logits)
    assert torch.isinf(logits[0]).sum() == VOCAB - 1 and not torch.isinf(logits[1]).any()


@pytest.mark.parametrize("custom", [DummyLogitsProcessor, WrappedPerReqLogitsProcessor])
def test_target_token_processor_end_to_end(custom) -> None:
    rows = [SamplingParams(temperature=0.0, extra_args={"target_token": 17}),
            SamplingParams(seed=3, extra_args={"target_token": 4}),
            SamplingParams(temperature=0.0)]
    ib = make_batch(rows, [[1]] * 3, [[], [], []], VOCAB, custom=[custom])
    logits = torch.randn(3, VOCAB)
    out = Sampler()(logits.clone(), ib.refresh_metadata())
    assert out.sampled_token_ids[:, 0].tolist() == [17, 4, int(logits[2].argmax())]


@pytest.mark.parametrize("cls", [DummyLogitsProcessor, WrappedPerReqLogitsProcessor])
@pytest.mark.parametrize("bad", ["17", 1.5, -3, True])
def test_validate_params_rejects_bad_target_token(cls, bad) -> None:
    with pytest.raises(ValueError, match="target_token"):
        cls.validate_params(SamplingParams(extra_args={"target_token": bad}))
    cls.validate_params(SamplingParams(extra_args={"target_token": 3}))
    procs = LogitsProcessors([cls(None, torch.device("cpu"), False)])
    with pytest.raises(ValueError, match="target_token"):
        procs.validate_params(SamplingParams(extra_args={"target_token": bad}))


class BanPromptAndLastOutput(AdapterLogitsProcessor):
    """3-argument callable: sees the decoder prompt and the live outputs."""

    def new_req_logits_processor(self, params):
        def ban(prompt_ids, output_ids, logits):
            logits[prompt_ids] = float("-inf")
            if output_ids:
                logits[output_ids[-1]] = float("-inf")
            return logits
        return ban if params.extra_args else None


def test_adapter_three_argument_form_sees_prompt_and_live_outputs() -> None:
    out: list[int] = []
    rows = [SamplingParams(extra_args={"on": 1}), SamplingParams()]
    ib = make_batch(rows, [[3, 4], [3, 4]], [out, []], VOCAB, custom=[BanPromptAndLastOutput])
    proc = ib.logitsprocs.get(BanPromptAndLastOutput)
    ib.refresh_metadata()
    assert torch.isinf(proc.apply(torch.zeros(2, VOCAB))[0]).nonzero().flatten().tolist() == [3, 4]
    out.append(9)
    ib.refresh_metadata()
    logits = proc.apply(torch.zeros(2, VOCAB))
    assert torch.isinf(logits[0]).nonzero().flatten().tolist() == [3, 4, 9]
    assert not torch.isinf(logits[1]).any()


def test_resolve_by_fqcn_dotted_name_and_class() -> None:
    assert resolve_logitsproc_class(FQCN) is DummyLogitsProcessor
    assert resolve_logitsproc_class(FQCN.replace(":", ".")) is DummyLogitsProcessor
    assert resolve_logitsproc_class(DummyLogitsProcessor) is DummyLogitsProcessor


@pytest.mark.parametrize("spec, error, words", [
    ("no_such_module_xyz:Thing", ValueError, "cannot import"),
    ("tests.sample.dummy_processor:Nope", ValueError, "no attribute"),
    ("JustAName", ValueError, "fully-qualified"),
    ("builtins:dict", TypeError, "not a subclass of LogitsProcessor"),
    ("tests.sample.dummy_processor:_target_token", TypeError, "not a class"),
])
def test_resolve_errors_are_clear(spec, error, words) -> None:
    with pytest.raises(error, match=words):
        resolve_logitsproc_class(spec)


def test_instance_instead_of_class_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="not a class"):
        build_logitsprocs(None, "cpu", custom_logitsprocs=[DummyLogitsProcessor(None, "cpu", False)],
                          include_entry_points=False)


def _install_entry_point(tmp_path, monkeypatch, target: str) -> None:
    dist = tmp_path / "fake_encdec_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-encdec-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(textwrap.dedent(f"""\
        [{ENTRY_POINT_GROUP}]
        dummy = {target}
        """))
    monkeypatch.syspath_prepend(str(tmp_path))


def test_entry_points_are_always_loaded_once(tmp_path, monkeypatch) -> None:
    _install_entry_point(tmp_path, monkeypatch, FQCN)
    procs = build_logitsprocs(None, "cpu", custom_logitsprocs=[DummyLogitsProcessor, FQCN])
    assert sum(isinstance(p, DummyLogitsProcessor) for p in procs.all) == 1
    assert isinstance(build_logitsprocs(None, "cpu").get(DummyLogitsProcessor), DummyLogitsProcessor)


def test_entry_point_that_is_not_a_processor_is_refused(tmp_path, monkeypatch) -> None:
    _install_entry_point(tmp_path, monkeypatch, "builtins:dict")
    with pytest.raises(TypeError, match="entry point 'dummy'"):
        build_logitsprocs(None, "cpu")


def test_processor_config_exposes_max_num_seqs() -> None:
    seen = []

    class Probe(DummyLogitsProcessor):
        def __init__(self, config, device, is_pin_memory):
            super().__init__(config, device, is_pin_memory)
            seen.append(config.scheduler_config.max_num_seqs)

    build_logitsprocs(None, "cpu", custom_logitsprocs=[Probe], include_entry_points=False)
    from encdec.config import SchedulerConfig

    class Cfg:
        scheduler_config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=7, max_model_len=32)

    build_logitsprocs(Cfg(), "cpu", custom_logitsprocs=[Probe], include_entry_points=False)
    assert seen == [256, 7]
    with pytest.raises(TypeError, match="max_num_seqs"):
        build_logitsprocs(object(), "cpu", include_entry_points=False)


def test_allowed_token_ids_mask_moves_with_its_request() -> None:
    rows = [SamplingParams(), SamplingParams(allowed_token_ids=[7]),
            SamplingParams(temperature=0.0, allowed_token_ids=[5, 6])]
    ib = InputBatch(max_num_reqs=4, vocab_size=VOCAB, device="cpu")
    for i, p in enumerate(rows):
        ib.add_request(f"r{i}", p, [1], [])
    ib.refresh_metadata()
    ib.remove_request("r0")  # r2 moves to row 0
    md = ib.refresh_metadata()
    assert md.allowed_token_ids_mask.shape == (2, VOCAB)
    allowed = [(~md.allowed_token_ids_mask[i]).nonzero().flatten().tolist() for i in range(2)]
    assert allowed == [[5, 6], [7]]
    ib.remove_request("r1")
    ib.add_request("r3", SamplingParams(temperature=0.0), [1], [])  # takes r1's row
    md = ib.refresh_metadata()
    assert ib.req_ids == ["r2", "r3"] and not md.allowed_token_ids_mask[1].any()


def test_min_p_of_one_keeps_only_the_top_token() -> None:
    ib = make_batch([SamplingParams(min_p=1.0, seed=0)], [[1]], [[]], VOCAB)
    md = ib.refresh_metadata()
    logits = torch.randn(1, VOCAB)
    out = ib.logitsprocs.get(MinPLogitsProcessor).apply(logits.clone())
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [int(logits.argmax())]
    assert Sampler()(logits.clone(), md).sampled_token_ids.item() == int(logits.argmax())
