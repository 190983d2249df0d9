"""A CPU draft's two-stage LM head (draft_head4.h, small_linear_int4.h), per
ISA build in the ids: the int4 pass against a float64 reference of its own
dequantized weights; the int4 copy (``from_int8``) each column's nearest of
its clips; the two-stage tokens exactly those of an oracle (the int4 pass's
best ``CANDIDATES`` columns, a NaN first and ties to the lower column, bans
first, then numpy's argmax of their int8 logits in column order), its logits
the int8 head's at the candidates bit for bit, so the token is the int8
head's whenever the int8 winner is a candidate (constructed cases: one where
it is, one where it is not, NaN rows, ties, bans over the best columns), and
how often that is on random heads; a draft's steps with the two-stage head
propose the int8 head's tokens and write the same K/V."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from encdec.kernels.cpu import build, decoder_step_cpu, small_linear_int4 as s4, small_linear_int8_cpu as s8
from encdec.kernels.cpu.decoder_step_cpu import DraftHeadWeights, DraftSteps
from encdec.models.layers import Linear

pytestmark = pytest.mark.skipif(not decoder_step_cpu.available(), reason="no C compiler here")
ISAS = build.host_isas()  # each build this CPU runs, "none" = portable


def _skip_without_vnni(isa: str) -> None:
    if not s8.vnni_available(isa) and s8.path(isa) != "none":
        pytest.skip(f"the int8 and int4 passes run on a vector path with its VNNI only, not on {isa} here")


def _head(n: int, k: int, seed: int, bias: bool = True) -> tuple[Linear, s8.PackedInt8, s4.PackedInt4]:
    torch.manual_seed(seed)
    lin = Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.mul_(4)
    lin.quantize_int8("onednn")
    p8 = lin.int8_panel_weight()
    return lin, p8, s4.from_int8(p8)


def _quantized(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = x.abs().amax(1, keepdim=True) / 127
    return torch.round(x / scale).double(), scale.double()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n,k,m,bias", [(300, 64, 3, True), (1000, 70, 1, False), (77, 512, 9, True)])
def test_int4_pass_matches_a_float64_reference_of_its_weights(isa, n, k, m, bias):
    _skip_without_vnni(isa)
    lin, _, p4 = _head(n, k, seed=n + k, bias=bias)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    b = lin.bias.detach() if bias else None
    got = s4.small_linear_int4(x, p4, b, isa=isa)
    q, scale = _quantized(x)
    want = q @ s4.dequantized(p4).T * scale + (b.double() if bias else 0)
    torch.testing.assert_close(got.double(), want, atol=1e-5 * float(want.abs().max()), rtol=0)


def test_the_int4_copy_is_each_columns_nearest_of_its_clips():
    _, p8, _ = _head(200, 96, seed=5)
    with torch.no_grad():
        p8.wq[0, :, 3] = 0  # a zero column
    p4 = s4.from_int8(p8)
    q8 = p8.wq.permute(0, 2, 1, 3).reshape(-1, 96)[:200].double() * p8.ws[:200, None].double()
    w4 = s4.dequantized(p4)
    assert bool((w4[3] == 0).all())
    q4 = w4 / p4.ws[:200, None].double()
    assert bool((q4.round() == q4).all()) and float(q4.abs().max()) <= 7
    err = (w4 - q8).square().sum(1)
    for clip in s4.CLIPS:  # no listed clip does better than the chosen one, column by column
        step = (q8.abs().amax(1, keepdim=True) * clip / 7).clamp_min(1e-30)
        alt = torch.clamp(torch.round(q8 / step), -7, 7) * step
        assert bool((err <= (alt - q8).square().sum(1) * (1 + 1e-5)).all())  # ws4 is float32
    clipped = w4.abs().amax(1) < q8.abs().amax(1) * (1 - 1e-6)
    assert int(clipped.sum()) > 20  # columns whose best range is below max |q8|


def _oracle(x, p8, p4, bias, banned, isa):
    """(tokens, candidates per row, int8 logits, int4 scores), bans at -inf."""
    y8 = s8.small_linear_int8(x, p8, bias, isa=isa).numpy().copy()
    y4 = s4.small_linear_int4(x, p4, bias, isa=isa).numpy().copy()
    y8[:, banned] = y4[:, banned] = -np.inf
    tokens, cands = [], []
    for r8, r4 in zip(y8, y4):
        nan = np.isnan(r4)
        order = np.lexsort((np.arange(len(r4)), -np.where(nan, 0, r4), ~nan))  # NaN first, high, low column
        c = np.sort(order[:s4.CANDIDATES])
        cands.append(c)
        tokens.append(int(c[np.argmax(r8[c])]))  # numpy's: the first NaN, else the first maximum
    return tokens, cands, y8, y4


def _check_two_stage(x, lin, p8, p4, banned, isa, ids=None):
    bias = None if lin.bias is None else lin.bias.detach()
    got = s4.two_stage_tokens(x, p8, lin.weight.detach(), p4, bias, banned, ids, isa=isa)
    tokens, cands, y8, y4 = _oracle(x, p8, p4, bias, banned, isa)
    out, logits = got
    want = tokens if ids is None else [int(ids[t]) for t in tokens]
    assert out == want
    lg = logits.numpy()
    for r, c in enumerate(cands):
        rest = np.setdiff1d(np.arange(y4.shape[1]), c)
        np.testing.assert_array_equal(lg[r, c], y8[r, c])  # the int8 head's values, bit for bit
        np.testing.assert_array_equal(lg[r, rest], y4[r, rest])
    return tokens, cands, y8


@pytest.mark.parametrize("isa", ISAS)
def test_two_stage_tokens_are_the_int8_heads_among_the_int4_candidates(isa):
    _skip_without_vnni(isa)
    lin, p8, p4 = _head(3000, 70, seed=2)
    x = torch.randn(64, 70, generator=torch.Generator().manual_seed(4))
    top = s8.small_linear_int8(x, p8, lin.bias.detach(), isa=isa).argmax(1)
    banned = sorted({int(top[0]), int(top[1]), 7, 2999})  # bans over two rows' best columns
    tokens, cands, y8 = _check_two_stage(x, lin, p8, p4, banned, isa)
    inside = [int(np.argmax(r)) in c for r, c in zip(y8, cands)]
    for t, r, ok in zip(tokens, y8, inside):
        if ok:
            assert t == int(np.argmax(r))
    assert sum(inside) >= 60, f"int8 winner among the int4 candidates in {sum(inside)} of 64 random rows"
    ids = torch.randperm(5000, generator=torch.Generator().manual_seed(6))[:3000]  # a reduced head's columns
    _check_two_stage(x[:5].contiguous(), lin, p8, p4, banned, isa, ids=ids)


@pytest.mark.parametrize("isa", ISAS)
def test_constructed_heads_winner_inside_and_outside_the_candidates_nan_and_ties(isa):
    _skip_without_vnni(isa)
    k, n = 64, 100
    lin, _, _ = _head(n, k, seed=9, bias=False)
    lin.weight_scale.fill_(0.01)  # every column on one scale: equal int8 rows, equal scores
    x = torch.ones(1, k)
    base = torch.randint(-60, 60, (k,), dtype=torch.int8)
    base[0], base[1] = 120, 0  # every clip's int4 step is over 8 int8 units: 0 and 1 both round to 0
    for winner in (77, 5):  # 77: past the first CANDIDATES of 100 int4 ties; 5: among them
        with torch.no_grad():
            lin.weight.copy_(base.expand(n, k))
            lin.weight[winner, 1] += 1
            lin.int8_panels = None
        p8 = lin.int8_panel_weight()
        p4 = s4.from_int8(p8)
        tokens, cands, y8 = _check_two_stage(x, lin, p8, p4, [], isa)
        assert int(np.argmax(y8[0])) == winner
        assert tokens == [winner if winner < s4.CANDIDATES else 0]  # outside: the first of the exact ties
    # ties everywhere: the first column not banned; a NaN row: the first NaN not banned (numpy's argmax)
    with torch.no_grad():
        lin.weight.copy_(base.expand(n, k))
        lin.int8_panels = None
    p8 = lin.int8_panel_weight()
    p4 = s4.from_int8(p8)
    assert _check_two_stage(x, lin, p8, p4, [0, 1, 3], isa)[0] == [2]
    nan_row = torch.full((1, k), float("nan"))
    assert _check_two_stage(nan_row, lin, p8, p4, [0, 1], isa)[0] == [2]
    # every column banned but three: the best of those
    keep = [13, 50, 99]
    banned = [c for c in range(n) if c not in keep]
    _check_two_stage(torch.randn(2, k, generator=torch.Generator().manual_seed(8)), *_head(n, k, 10), banned, isa)


@pytest.mark.parametrize("isa", ISAS)
@torch.inference_mode()
def test_draft_steps_with_the_two_stage_head_propose_the_int8_heads_tokens(isa, monkeypatch):
    from tests.kernels.test_draft_step import BANNED, ENC, Draft

    monkeypatch.setenv(build.ISA_ENV, isa)
    if not s8.vnni_available(isa):
        pytest.skip(f"int8 layers run in the step on a vector path with its VNNI only, not on {isa} here")
    draft = Draft(True, torch.float32)
    p8 = draft.head.packed
    two = DraftHeadWeights(draft.head.n, packed=p8, packed4=s4.from_int8(p8), rows8=draft.lm.weight.detach(),
                           bias=draft.head.bias)
    assert DraftSteps.fits(draft.weights, draft.tok, draft.pos, draft.norm, two)
    assert not DraftSteps.fits(draft.weights, draft.tok, draft.pos, draft.norm,
                               DraftHeadWeights(two.n, packed=p8, packed4=two.packed4, bias=two.bias))  # no rows8
    runs = []
    for head in (draft.head, two):
        steps = DraftSteps(draft.weights, draft.tok, draft.pos, draft.norm, head)
        caches = [c.clone() for c in draft.caches]
        assert steps.start(caches, draft.tokens, draft.positions, draft.tables, draft.cross, [ENC] * 3, BANNED,
                           [3, 3, 3], isa=isa)
        runs.append(([steps.step() for _ in range(3)], caches))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
