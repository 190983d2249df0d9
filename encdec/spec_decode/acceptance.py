"""Which draft tokens a verification step keeps, per request, batched (torch).

A request verifying n drafts d_0..d_{n-1} has n + 1 scored rows: row j holds the
target's distribution for the token after the prefix + d_0..d_{j-1}. The
tensors here are padded to the step's longest (``k_max`` drafts, ``k_max + 1``
rows); ``num_drafts[b]`` says how many of request b's are real, so a request
with fewer (or no) drafts, or one that rejects early, never touches another's
result. Outputs are the tokens a request appends this step: its accepted
drafts, then one more (the target's own token at the first rejection, or the
bonus token after all n), 1 to n + 1 tokens.

Greedy (``accept_greedy``): the longest prefix of drafts equal to the target's
argmax, then the target's argmax at the first mismatch: exactly the tokens
greedy decoding one step at a time produces.

Sampled (``rejection_sample``, Leviathan et al. 2023; vLLM's rejection sampler):
draft d_j is accepted with probability min(1, p(d_j) / q(d_j)); at the first
rejection the token is drawn from norm(max(0, p - q)); after n acceptances the
bonus is drawn from row n's p. Each output token is then distributed as the
target's p, whatever q is. An ``ngram`` draft is a point mass (q(d_j) = 1):
accept with p(d_j), on rejection draw from p with d_j removed.

    drafts     d0   d1   d2        rows  p0 p1 p2 p3
    accepted   yes  yes  no   ->   out   d0 d1 x2 ~ norm(max(0, p2 - q2))
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

PAD = -1  # token id of an output position a request does not reach


def _num_drafts(num_drafts: torch.Tensor | Sequence[int], batch: int, k_max: int,
                device: torch.device) -> torch.Tensor:
    n = torch.as_tensor(num_drafts, dtype=torch.long, device=device)
    if n.shape != (batch,) or (n.numel() and (int(n.min()) < 0 or int(n.max()) > k_max)):
        raise ValueError(f"num_drafts must hold {batch} counts in 0..{k_max}, got {n.tolist()}")
    return n


def _outputs(accepted: torch.Tensor, drafts: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """(B, k_max + 1): each request's accepted drafts, then ``last``, then PAD."""
    B, k_max = drafts.shape
    pos = torch.arange(k_max + 1, device=drafts.device)[None, :]
    out = torch.full((B, k_max + 1), PAD, dtype=torch.long, device=drafts.device)
    out[:, :k_max] = torch.where(pos[:, :k_max] < accepted[:, None], drafts, PAD)
    out.scatter_(1, accepted[:, None], last[:, None])
    return out


def _first_false(ok: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """(B,) the index of each row's first False among its first n[b] entries of
    ``ok`` (B, k_max), or n[b] where all of them are True."""
    k_max = ok.shape[1]
    real = torch.arange(k_max, device=ok.device)[None, :] < n[:, None]
    end = torch.ones(ok.shape[0], 1, dtype=torch.bool, device=ok.device)  # (k_max may be 0: no drafts at all)
    stop = torch.cat([~ok | ~real, end], dim=1)  # (B, k_max + 1)
    return stop.to(torch.int8).argmax(1)  # the first True


def accept_greedy(target_ids: torch.Tensor, draft_ids: torch.Tensor,
                  num_drafts: torch.Tensor | Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``target_ids`` (B, k_max + 1): the target's argmax per scored row;
    ``draft_ids`` (B, k_max) padded, ``num_drafts`` (B,) real counts. Returns
    (output ids (B, k_max + 1), PAD past each request's end; accepted drafts (B,))."""
    B, k_max = draft_ids.shape
    if target_ids.shape != (B, k_max + 1):
        raise ValueError(f"target_ids must be (B, k_max + 1) = {(B, k_max + 1)}, got {tuple(target_ids.shape)}")
    n = _num_drafts(num_drafts, B, k_max, draft_ids.device)
    accepted = _first_false(draft_ids == target_ids[:, :k_max], n)
    last = target_ids.gather(1, accepted[:, None])[:, 0]
    return _outputs(accepted, draft_ids, last), accepted


def recovered_probs(target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                    draft_ids: torch.Tensor) -> torch.Tensor:
    """(B, k_max, V): norm(max(0, p - q)) per draft row, what a rejection draws
    from; a point-mass draft (``draft_probs`` None) zeroes p at its token. A row
    with nothing left (p <= q everywhere: it cannot reject) keeps p."""
    p = target_probs[:, :-1]
    if draft_probs is None:
        diff = p.scatter(2, draft_ids.clamp(min=0)[..., None], 0.0)
    else:
        diff = (p - draft_probs).clamp(min=0.0)
    total = diff.sum(-1, keepdim=True)
    return torch.where(total > 0, diff / total.clamp(min=torch.finfo(diff.dtype).tiny), p)


def _draws(shape: tuple[int, ...], generators: Sequence[torch.Generator | None] | None,
           device: torch.device, kind: str) -> torch.Tensor:
    """Uniform or exponential draws of (B, ...), row b from its request's own
    generator where it has one (a seeded request reproduces), else the global one."""
    out = torch.empty(shape, dtype=torch.float32, device=device)
    fill = (lambda t, g: t.uniform_(generator=g)) if kind == "uniform" else (lambda t, g: t.exponential_(generator=g))
    if generators is None or all(g is None for g in generators):
        return fill(out, None)
    for b, g in enumerate(generators):
        fill(out[b], g)
    return out


def _sample(probs: torch.Tensor, exp: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` (B, V) from exponential draws ``exp`` (B, V):
    argmax p / e is a draw from p (the exponential race). A draw of exactly 0
    is raised to the smallest normal, so a p of 0 never gives 0 / 0 = NaN
    (which argmax would pick)."""
    return (probs / exp.clamp(min=torch.finfo(exp.dtype).tiny)).argmax(-1)


def rejection_sample(target_probs: torch.Tensor, draft_ids: torch.Tensor, num_drafts: torch.Tensor | Sequence[int],
                     draft_probs: torch.Tensor | None = None, *,
                     generators: Sequence[torch.Generator | None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``target_probs`` (B, k_max + 1, V): the target's sampling distribution per
    scored row (after its logits processors, temperature, top-k/p); ``draft_ids``
    (B, k_max) padded; ``num_drafts`` (B,); ``draft_probs`` (B, k_max, V) the
    draft model's distributions, or None for point-mass (n-gram) drafts;
    ``generators``: per request, its own (seeded) or None. Returns (output ids
    (B, k_max + 1), PAD past each request's end; accepted drafts (B,))."""
    B, k_max = draft_ids.shape
    if target_probs.shape[:2] != (B, k_max + 1):
        raise ValueError(f"target_probs must be (B, k_max + 1, V) with (B, k_max + 1) = {(B, k_max + 1)}, "
                         f"got {tuple(target_probs.shape)}")
    if draft_probs is not None and draft_probs.shape != (B, k_max, target_probs.shape[2]):
        raise ValueError(f"draft_probs must be (B, k_max, V) = {(B, k_max, target_probs.shape[2])}, "
                         f"got {tuple(draft_probs.shape)}")
    device = target_probs.device
    n = _num_drafts(num_drafts, B, k_max, device)
    ids = draft_ids.clamp(min=0)[..., None]  # PAD drafts read token 0; never counted (past n)
    p = target_probs[:, :k_max].gather(2, ids)[..., 0]  # (B, k_max)
    q = torch.ones_like(p) if draft_probs is None else draft_probs.gather(2, ids)[..., 0]
    u = _draws((B, k_max), generators, device, "uniform")
    accepted = _first_false(u * q < p, n)  # u < p / q without dividing by a zero q
    # The last token: drawn from the recovered distribution at the first rejection,
    # or from the target's own at row n (the bonus) when every draft was accepted.
    rows = torch.arange(B, device=device)
    last_probs = target_probs[rows, accepted].clone()  # (B, V), row n: the bonus's p
    rejected = accepted < n
    if bool(rejected.any()):
        rec = recovered_probs(target_probs, draft_probs, draft_ids)  # (B, k_max, V)
        last_probs[rejected] = rec[rows[rejected], accepted[rejected]]
    last = _sample(last_probs, _draws(tuple(last_probs.shape), generators, device, "exponential"))
    return _outputs(accepted, draft_ids, last), accepted
