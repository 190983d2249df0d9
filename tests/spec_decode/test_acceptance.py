"""Acceptance: greedy keeps the longest prefix of drafts equal to the target's
argmax plus the target's next token; rejection sampling keeps the target's
distribution (chi-square tests on 4000 samples over a 5-token vocabulary, for
n-gram point-mass drafts and for draft-model distributions), and the same test
fails when the correction step draws from p instead of norm(max(0, p - q)).
Every request's result is its own: padding, other requests' drafts and their
rejections never change it."""
from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from encdec.spec_decode import PAD, accept_greedy, rejection_sample
from encdec.spec_decode import acceptance

N = 4000  # samples per chi-square test (>= 2000)
V = 5


def _greedy_reference(target: list[int], drafts: list[int]) -> list[int]:
    out = []
    for j, d in enumerate(drafts):
        if d != target[j]:
            break
        out.append(d)
    return out + [target[len(out)]]


def test_greedy_examples():
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [9, 1, 1, 1]])
    drafts = torch.tensor([[5, 6, 7], [5, 0, 7], [1, 6, 7], [3, 3, 3]])
    out, acc = accept_greedy(target, drafts, [3, 3, 3, 0])
    assert acc.tolist() == [3, 1, 0, 0]
    assert out.tolist() == [[5, 6, 7, 8], [5, 6, PAD, PAD], [5, PAD, PAD, PAD], [9, PAD, PAD, PAD]]


def test_a_step_without_drafts():
    out, acc = accept_greedy(torch.tensor([[3], [4]]), torch.zeros(2, 0, dtype=torch.long), [0, 0])
    assert out.tolist() == [[3], [4]] and acc.tolist() == [0, 0]
    out, acc = rejection_sample(torch.tensor([[[0.0, 1.0]]]), torch.zeros(1, 0, dtype=torch.long), [0])
    assert out.tolist() == [[1]] and acc.tolist() == [0]


def test_greedy_matches_one_by_one_per_request():
    g = torch.Generator().manual_seed(0)
    B, k = 300, 5
    target = torch.randint(0, 3, (B, k + 1), generator=g)
    drafts = torch.randint(0, 3, (B, k), generator=g)
    n = torch.randint(0, k + 1, (B,), generator=g)
    padded = torch.where(torch.arange(k)[None] < n[:, None], drafts, torch.randint(0, 3, (B, k), generator=g))
    out, acc = accept_greedy(target, padded, n)
    for b in range(B):
        want = _greedy_reference(target[b].tolist(), drafts[b, : n[b]].tolist())
        assert out[b, : len(want)].tolist() == want and (out[b, len(want):] == PAD).all(), b
        assert acc[b] == len(want) - 1


def test_shapes_and_counts_are_checked():
    with pytest.raises(ValueError, match="target_ids"):
        accept_greedy(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long), [1, 1])
    with pytest.raises(ValueError, match="num_drafts"):
        accept_greedy(torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long), [4, 1])
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(torch.full((2, 4, V), 0.2), torch.zeros(2, 3, dtype=torch.long), [1, 1],
                         torch.full((2, 2, V), 0.2))


def _dists(seed: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(rows, V, generator=g) * 1.5, -1)


def _chi2(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=V).double()
    expected = probs.double() / probs.double().sum() * counts.sum()
    return float(chisquare(counts.numpy(), expected.numpy()).pvalue)


def _run(k: int, draft_model: bool, seed: int):
    """N requests verifying the same k drafts under the same rows of p (row j
    stands for the target's distribution given the drafts before it); drafts
    are draws from q (draft model) or fixed (n-gram). Returns (outputs, p, q)."""
    torch.manual_seed(seed)
    p = _dists(seed, k + 1)  # (k + 1, V)
    q = _dists(seed + 100, k) if draft_model else None
    if draft_model:
        drafts = torch.stack([torch.multinomial(q[j], N, replacement=True) for j in range(k)], 1)  # (N, k)
    else:
        drafts = torch.tensor([[1, 3, 0, 2, 4][j] for j in range(k)]).expand(N, k)
    out, acc = rejection_sample(p.expand(N, k + 1, V), drafts, [k] * N,
                                None if q is None else q.expand(N, k, V))
    return out, acc, p, drafts


@pytest.mark.parametrize("draft_model", [False, True], ids=["ngram-point-mass", "draft-model"])
def test_rejection_sampling_keeps_the_target_distribution(draft_model):
    k = 2
    out, acc, p, drafts = _run(k, draft_model, seed=1)
    assert _chi2(out[:, 0], p[0]) > 1e-3  # the first token ~ p0
    # The second token, where the first was the draft (row 1's p is p given that draft), ~ p1.
    kept = acc >= 1
    assert kept.sum() > 500
    assert _chi2(out[kept, 1], p[1]) > 1e-3
    # Every request ends with one token past its accepted drafts, then padding.
    assert ((out != PAD).sum(1) == acc + 1).all()
    assert (out[acc == k, k] >= 0).all()  # the bonus token


@pytest.mark.parametrize("draft_model", [False, True], ids=["ngram-point-mass", "draft-model"])
def test_a_wrong_correction_fails_the_same_test(draft_model, monkeypatch):
    """Draw the rejected position from p itself (no correction): the first
    token is then biased toward the drafts, and the chi-square test sees it."""
    monkeypatch.setattr(acceptance, "recovered_probs", lambda target, draft, ids: target[:, :-1])
    out, _, p, _ = _run(2, draft_model, seed=1)
    assert _chi2(out[:, 0], p[0]) < 1e-6


def test_requests_are_independent_and_seeded_requests_reproduce():
    """Request 0's result depends on its own rows and generator only: changing
    request 1's drafts (so that it rejects) or padding changes nothing there."""
    p = _dists(3, 4).expand(2, 4, V).clone()
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3]])

    def run(d: torch.Tensor, n: list[int]) -> torch.Tensor:
        gens = [torch.Generator().manual_seed(7), torch.Generator().manual_seed(8)]
        return rejection_sample(p, d, n, generators=gens)[0]

    a = run(drafts, [3, 3])
    b = run(torch.tensor([[1, 2, 3], [4, 4, 0]]), [3, 1])
    assert torch.equal(a[0], b[0])
    assert torch.equal(run(drafts, [3, 3]), a)  # seeded: the same again


def test_zero_drafts_is_a_plain_sample_and_certain_drafts_are_kept():
    p = torch.zeros(3, 2, V)
    p[:, :, 4] = 1.0  # the target is certain of token 4
    out, acc = rejection_sample(p, torch.tensor([[4], [4], [0]]), [0, 1, 1])
    assert acc.tolist() == [0, 1, 0]
    assert out.tolist() == [[4, PAD], [4, 4], [4, PAD]]
