"""A CPU draft's proposals in C calls (``worker/draft_step.py``): on Whisper
tiny.en (real weights, shipped clips) an int8 self-draft proposes every round
there, with the drafts the general path proposes (its full head and a reduced
one, run in C in two stages: an int4 pass, its best candidates in int8) from
the same bfloat16 cross K/V, and the transcripts are those without
speculation; from the int8 cross copy it reads by default, the drafts may
round differently, never the transcripts; the processors' static part becomes
the head's banned columns, or sends the proposal the general path where it
does more than ban."""
from __future__ import annotations

import pytest
import torch

from encdec import LLM
from encdec.worker import draft_kv, draft_model, draft_step
from tests.spec_decode.test_spec_whisper import KW, _all_free, _segments


def _run(model_dir: str, clips: list, spec: dict | None, monkeypatch, fused: bool,
         cross_int8: bool = False) -> tuple[list, list, int]:
    """The segments, every proposal's drafts in order, and how many the C path
    made (with the int8 head's two stages: int4 pass, int8 candidates)."""
    proposals, made, copies = [], [], []
    real_propose, real_fused = draft_model.DraftModel.propose_rows, draft_step.FusedDraft.propose
    real_choose = draft_kv.DraftKV.choose_cross_int8

    def choose(self, wanted: bool) -> None:
        real_choose(self, wanted and want_int8)
        copies.append(self.cross_int8)

    def propose(self, rows, apply_static=None):
        out = real_propose(self, rows, apply_static)
        proposals.append(sorted((len(r.token_ids), out[r.seq_id]) for r in rows))
        return out

    def fused_propose(self, *args, **kw):
        out = real_fused(self, *args, **kw)
        made.append(out is not None and self.steps.head.packed4 is not None)
        return out

    want_int8 = cross_int8
    with monkeypatch.context() as m:
        m.setattr(draft_kv.DraftKV, "choose_cross_int8", choose)
        m.setattr(draft_model.DraftModel, "propose_rows", propose)
        m.setattr(draft_step.FusedDraft, "propose", fused_propose)
        if not fused:
            m.setattr(draft_step.FusedDraft, "build", classmethod(lambda cls, model, head: None))
        llm = LLM(model_dir, **KW, speculative_config=spec)
        segments = _segments(llm.transcribe(clips, use_tqdm=False, timestamps=True))
        assert _all_free(llm)
    assert copies == [cross_int8]
    return segments, proposals, sum(made)


@pytest.mark.parametrize("vocab", [None, 4000], ids=["full head", "reduced head"])
def test_whisper_self_draft_proposes_in_c_as_the_general_path_does(ct2_dir, speech_clips, vocab, monkeypatch):
    from encdec.kernels.cpu import decoder_step_cpu, small_linear_int8_cpu

    if not (decoder_step_cpu.available() and small_linear_int8_cpu.vnni_available()):
        pytest.skip("int8 layers run in the fused step only with a C build and VNNI")
    clips = [(a, 16000) for a in speech_clips[2][:2]]
    spec = {"method": "draft_model", "model": str(ct2_dir), "quantization": "int8", "num_speculative_tokens": 4}
    if vocab is not None:
        spec["draft_vocab_size"] = vocab
    want = _segments(LLM(str(ct2_dir), **KW).transcribe(clips, use_tqdm=False, timestamps=True))
    got, proposals, made = _run(str(ct2_dir), clips, spec, monkeypatch, fused=True)
    general, general_proposals, none = _run(str(ct2_dir), clips, spec, monkeypatch, fused=False)
    assert got == general == want
    assert made == len(proposals) > 2 and none == 0
    assert proposals == general_proposals
    # The default: the C path reads an int8 copy of the cross K/V; the transcripts cannot change.
    got8, proposals8, made8 = _run(str(ct2_dir), clips, spec, monkeypatch, fused=True, cross_int8=True)
    assert got8 == want and made8 == len(proposals8) > 2


def _ban(ids: list[int], value: float = float("-inf")):
    def apply_static(logits: torch.Tensor) -> torch.Tensor:
        logits[:, ids] = value
        return logits
    return apply_static


def test_the_static_part_becomes_banned_columns():
    assert draft_step.static_bans(None, 10, None) == []
    assert draft_step.static_bans(_ban([2, 7]), 10, None) == [2, 7]
    # a reduced head (ids 1, 2, 5, 7): columns of the banned ids among them
    assert draft_step.static_bans(_ban([2, 7, 8]), 10, torch.tensor([1, 2, 5, 7])) == [1, 3]
    assert draft_step.static_bans(_ban([3], value=-5.0), 10, None) is None  # more than a ban: the general path
