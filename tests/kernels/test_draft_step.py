"""A draft's whole greedy step in one C call (``decoder_step_cpu.DraftSteps``,
draft_step.h), per ISA build in the ids, float32 and int8 (layers and head),
float32 and bfloat16 caches: each row's token is the argmax, banned columns
aside, of a float64 reference of the head over the final LayerNorm of the
layers' output (the layers' step itself is ``decode_step``, tested on its own;
here it runs on the same inputs and its K/V writes must be the draft step's);
the rows advance in place (their token the next input, one position further;
``keep`` drops rows); what the kernel cannot run is declined before anything
is written."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from encdec.kernels.cpu import build, cross_i8, decoder_step_cpu, small_linear_int8_cpu
from encdec.kernels.cpu.decoder_step_cpu import DraftHeadWeights, DraftSteps
from encdec.models.layers import Linear
from encdec.testing import jitter_layer_norms

pytestmark = pytest.mark.skipif(not decoder_step_cpu.available(), reason="no C compiler here")

D, HEADS, FFN, BS, ENC, BLOCKS, VOCAB, POSITIONS = 64, 4, 128, 16, 23, 48, 300, 40
BANNED = [5, 17, 250]


class Draft:
    """Two Whisper decoder layers, embeddings, a final norm and a head (int8:
    layers and head quantized), three rows with random cache history."""

    def __init__(self, int8: bool, cache_dtype: torch.dtype):
        from encdec.models.whisper import WhisperDecoderLayer
        from encdec.attention.backends.torch_sdpa import TorchSDPABackend

        torch.manual_seed(0)
        cfg = SimpleNamespace(d_model=D, decoder_attention_heads=HEADS, decoder_ffn_dim=FFN)
        self.layers = [WhisperDecoderLayer(cfg, TorchSDPABackend) for _ in range(2)]
        jitter_layer_norms(self.layers)
        self.norm = torch.nn.LayerNorm(D)
        torch.nn.init.normal_(self.norm.weight, 1.0, 0.2)
        torch.nn.init.normal_(self.norm.bias, 0.0, 0.2)
        self.tok, self.pos = torch.randn(VOCAB, D), torch.randn(POSITIONS, D) * 0.3
        self.lm = Linear(D, VOCAB)
        with torch.no_grad():
            self.lm.weight.mul_(4)
        if int8:
            for layer in self.layers:
                for lin in decoder_step_cpu.decoder_linears(layer):
                    lin.quantize_int8("onednn")
            self.lm.quantize_int8("onednn")
            self.head = DraftHeadWeights(VOCAB, packed=self.lm.int8_panel_weight(), bias=self.lm.bias.detach())
        else:
            self.head = DraftHeadWeights(VOCAB, panels=self.lm.panel_weight(), bias=self.lm.bias.detach())
        self.weights = decoder_step_cpu.decoder_weights(self.layers)
        assert self.weights is not None and (self.weights.int8_table is not None) == int8
        g = torch.Generator().manual_seed(3)
        perm = torch.randperm(BLOCKS, generator=g).tolist()
        self.positions = [4, BS - 1, 9]  # the second crosses a block in its second step
        self.tables = [[perm.pop() for _ in range((p + 3) // BS + 1)] for p in self.positions]
        self.cross = [[perm.pop() for _ in range(-(-ENC // BS))] for _ in self.positions]
        self.caches = [(torch.randn(2, BLOCKS, BS, HEADS, D // HEADS, generator=g) * 0.5).to(cache_dtype)
                       for _ in self.layers]
        self.tokens = [7, 123, 299]

    def steps(self) -> DraftSteps:
        assert DraftSteps.fits(self.weights, self.tok, self.pos, self.norm, self.head)
        return DraftSteps(self.weights, self.tok, self.pos, self.norm, self.head)

    def reference(self, tokens, positions, rows, caches, isa):
        """Each row's logits in float64 (banned at -inf) after the layers' step
        (``decode_step``, writing its K/V into ``caches``)."""
        h = self.tok[tokens] + self.pos[positions]
        i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
        tables = [self.tables[r] for r in rows]
        width = max(map(len, tables))
        slots = torch.tensor([t[p // BS] * BS + p % BS for t, p in zip(tables, positions)])
        assert decoder_step_cpu.decode_step(
            h, self.weights, caches, slots, i32([t + [0] * (width - len(t)) for t in tables]),
            i32([p + 1 for p in positions]), i32([self.cross[r] for r in rows]), i32([ENC] * len(rows)),
            isa=isa) is h
        x = torch.nn.functional.layer_norm(h.double(), (D,), self.norm.weight.double(), self.norm.bias.double(),
                                           self.norm.eps)
        if self.head.packed is None:
            logits = x @ self.lm.weight.double().T + self.lm.bias.double()
        else:  # the kernel's input: the norm's float32 rows, quantized per row
            x32 = x.float()
            scale = x32.abs().amax(1, keepdim=True) / 127
            q = torch.round(x32 / scale).double()
            logits = q @ self.lm.weight.double().T * scale.double() * self.lm.weight_scale.double()
            logits = logits + self.lm.bias.double()
        logits[:, BANNED] = float("-inf")
        return logits


def _check(draft, steps, got, tokens, positions, rows, caches, isa):
    want = draft.reference(tokens, positions, rows, caches, isa)
    logits = torch.from_numpy(steps.last_logits().copy()).double()
    torch.testing.assert_close(logits, want, atol=2e-3, rtol=1e-3)
    top2 = want.topk(2, dim=1).values
    assert bool((top2[:, 0] - top2[:, 1] > 1e-2).all())  # clear maxima: the argmax is the reference's
    assert got == want.argmax(1).tolist()


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=["f32-cache", "bf16-cache"])
@pytest.mark.parametrize("int8", [False, True], ids=["float32", "int8"])
@pytest.mark.parametrize("isa", build.host_isas())  # each build this CPU runs, "none" = portable
@torch.inference_mode()
def test_draft_steps_match_the_layers_step_and_a_float64_head(isa, int8, cache_dtype, monkeypatch):
    monkeypatch.setenv(build.ISA_ENV, isa)
    if int8 and not small_linear_int8_cpu.vnni_available(isa):
        pytest.skip(f"int8 layers run in the step on a vector path with its VNNI only, not on {isa} here")
    draft = Draft(int8, cache_dtype)
    steps = draft.steps()
    caches = [c.clone() for c in draft.caches]
    ref_caches = [c.clone() for c in draft.caches]
    assert steps.start(caches, draft.tokens, draft.positions, draft.tables, draft.cross, [ENC] * 3, BANNED,
                       [3, 2, 1], isa=isa)
    got = steps.step()
    _check(draft, steps, got, draft.tokens, draft.positions, [0, 1, 2], ref_caches, isa)
    steps.keep([0, 1])  # the third row's one step is done
    second = steps.step()
    positions = [p + 1 for p in draft.positions[:2]]
    _check(draft, steps, second, got[:2], positions, [0, 1], ref_caches, isa)
    for a, b in zip(caches, ref_caches):  # the K/V written where and as the layers' step writes them
        assert torch.equal(a, b)
    steps.keep([0])
    third = steps.step()
    _check(draft, steps, third, second[:1], [p + 2 for p in draft.positions[:1]], [0], ref_caches, isa)
    with pytest.raises(RuntimeError, match="past the steps"):
        steps.step()


@torch.inference_mode()
def test_what_the_kernel_cannot_run_is_declined_before_anything_is_written():
    draft = Draft(False, torch.float32)
    steps = draft.steps()
    caches = [c.clone() for c in draft.caches]
    args = dict(tokens=draft.tokens, positions=draft.positions, self_tables=draft.tables, cross_tables=draft.cross,
                cross_lens=[ENC] * 3, banned=BANNED, steps=[1, 1, 1])
    bad = [dict(steps=[1, 1, 9]),  # past the third row's table
           dict(positions=[4, BS - 1, POSITIONS]),  # past the position embedding
           dict(tokens=[7, 123, VOCAB]),  # past the token embedding
           dict(banned=[VOCAB]),  # past the head
           dict(cross_lens=[ENC, ENC, 2 * BS + 1]),  # past the cross table
           dict(self_tables=[draft.tables[0], [BLOCKS] * 2, draft.tables[2]]),  # a block the caches lack
           dict(steps=[1, 0, 1])]
    for change in bad:
        assert not steps.start(caches, **{**args, **change}), change
    assert not steps.start(caches[:1], **args)  # one cache for two layers
    assert not steps.start([c.transpose(1, 2) for c in caches], **args)  # another layout
    assert all(torch.equal(a, b) for a, b in zip(caches, draft.caches))
    with pytest.raises(RuntimeError, match="no rows started"):
        steps.step()
    assert steps.start(caches, **args)
    with pytest.raises(ValueError, match="ascending indices"):
        steps.keep([1, 0])
    # Kinds the kernel does not run: a head of the other kind than the layers', another width.
    head8 = Linear(D, VOCAB)
    head8.quantize_int8("onednn")
    assert not DraftSteps.fits(draft.weights, draft.tok, draft.pos, draft.norm,
                               DraftHeadWeights(VOCAB, packed=head8.int8_panel_weight()))
    assert not DraftSteps.fits(draft.weights, draft.tok[:, :32].contiguous(), draft.pos, draft.norm, draft.head)
    assert not DraftSteps.fits(None, draft.tok, draft.pos, draft.norm, draft.head)
    with pytest.raises(ValueError, match="DraftSteps.fits"):
        DraftSteps(draft.weights, draft.tok, draft.pos, draft.norm,
                   DraftHeadWeights(VOCAB, packed=head8.int8_panel_weight()))
    assert not DraftSteps.fits(draft.weights, draft.tok, draft.pos, draft.norm,
                               DraftHeadWeights(VOCAB + 1, panels=draft.lm.panel_weight()))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=["f32-cache", "bf16-cache"])
@pytest.mark.parametrize("isa", build.host_isas())
@torch.inference_mode()
def test_int8_cross_records_are_read_as_their_dequantized_values(isa, cache_dtype, monkeypatch):
    """A self-draft's int8 cross copy (``cross_i8``): the step's logits are a
    float64 head over the layers' step on float32 caches whose cross blocks
    hold the records' dequantized values; its self K/V writes are those of
    the layers' step (rounded as the cache's dtype)."""
    monkeypatch.setenv(build.ISA_ENV, isa)
    draft = Draft(False, cache_dtype)
    steps = draft.steps()
    caches = [c.clone() for c in draft.caches]
    cross = torch.tensor(sorted({b for t in draft.cross for b in t}))
    ref_caches = [c.float() for c in draft.caches]
    for c, ref in zip(caches, ref_caches):
        src = torch.randn_like(ref) * 0.5  # the target's float32 cross K/V the copy quantizes
        cross_i8.write_blocks(src, cross, c, cross)
        ref[:, cross] = cross_i8.read_blocks(c, cross)
        assert (ref[:, cross] - src[:, cross]).abs().max() <= src.abs().max() / 254 + 1e-6
    assert steps.start(caches, draft.tokens, draft.positions, draft.tables, draft.cross, [ENC] * 3, BANNED,
                       [2, 2, 2], cross_i8=True, isa=isa)
    got = steps.step()
    want = draft.reference(draft.tokens, draft.positions, [0, 1, 2], ref_caches, isa)
    logits = torch.from_numpy(steps.last_logits().copy()).double()
    # bfloat16: the new slot's K/V are read rounded here, unrounded in the reference
    tol = 1e-4 if cache_dtype == torch.float32 else 5e-3  # measured: 1.4e-6 and 1.1e-3
    torch.testing.assert_close(logits, want, atol=tol, rtol=1e-3)
    top2 = want.topk(2, dim=1).values
    assert bool((top2[:, 0] - top2[:, 1] > 2 * tol).all())
    assert got == want.argmax(1).tolist()
    selfb = torch.tensor(sorted({b for t in draft.tables for b in t}))
    for a, b in zip(caches, ref_caches):  # a later layer's K/V follow the cross attention's float rounding
        torch.testing.assert_close(a[:, selfb].float(), b[:, selfb].to(cache_dtype).float(), atol=1e-2, rtol=1e-2)
    assert torch.equal(caches[0][:, selfb], ref_caches[0][:, selfb].to(cache_dtype))  # the first layer's: exact
    # Read as floats, the same records are other values: the flag is what makes them int8.
    assert steps.start(caches, draft.tokens, draft.positions, draft.tables, draft.cross, [ENC] * 3, BANNED,
                       [1, 1, 1], isa=isa)
    steps.step()
    assert not torch.allclose(torch.from_numpy(steps.last_logits().copy()).double(), want, atol=0.1)
