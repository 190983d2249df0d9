"""The pieces together, below the engine: random BART (the fused post-norm step),
T5 (a position bias) and Marian (op by op) models driven by hand-built
metadata, as the runner would drive them. A greedy loop that verifies drafts in
multi-row decode steps (n-gram drafts, and drafts that are right for a while
then wrong, so both acceptance and rollback happen), beside a request decoding
one row a step, produces the tokens of the plain one-token-a-step loop, with
the fused decode step on and off."""
from __future__ import annotations

import pytest
import torch

from encdec.attention.backends.torch_sdpa import TorchSDPABackend
from encdec.kernels.cpu import decoder_step_cpu
from encdec.models.loader import iterate_weights, open_checkpoint
from encdec.models.registry import get_model_cls
from encdec.spec_decode import NgramProposer, accept_greedy
from encdec.testing import make_random_bart, make_random_marian, make_random_t5

torch.set_num_threads(1)
BS, MAX_LEN, STEPS = 16, 64, 24
MAKERS = {"bart": make_random_bart, "t5": lambda p, seed: make_random_t5(p, seed=seed, d_kv=16, init_factor=1.5),
          "marian": make_random_marian}


@pytest.fixture(scope="module", params=sorted(MAKERS))
def model(request, tmp_path_factory):
    ckpt = open_checkpoint(MAKERS[request.param](str(tmp_path_factory.mktemp(request.param)), seed=2))
    m = get_model_cls(ckpt.architecture)(ckpt.hf_config, TorchSDPABackend)
    m.load_weights(iterate_weights(ckpt))
    return request.param, m.eval(), ckpt.hf_config.decoder_start_token_id


class Engine:
    """Two requests' caches and tables; ``step`` runs one model call."""

    def __init__(self, model, encoder_ids: list[list[int]]):
        self.model, self.enc = model, encoder_ids
        n_self, n_cross = MAX_LEN // BS, -(-max(map(len, encoder_ids)) // BS)
        per = n_self + n_cross
        self.tables = [[r * per + j for j in range(n_self)] for r in range(len(encoder_ids))]
        self.cross = [[r * per + n_self + j for j in range(n_cross)] for r in range(len(encoder_ids))]
        blocks = per * len(encoder_ids)
        self.kv = [torch.zeros(2, blocks, BS, model.num_kv_heads, model.head_size)
                   for _ in range(model.num_cache_layers)]

    def _slots(self, r: int, positions) -> list[int]:
        return [self.tables[r][p // BS] * BS + p % BS for p in positions]

    def step(self, rows: list[tuple[list[int], int]], prefill: bool) -> torch.Tensor:
        """``rows``: per request, (its input tokens this step, its length after them).
        Returns the logits of every query row (prefill: each prompt's last)."""
        i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
        q_lens = [len(t) for t, _ in rows]
        seq_lens = [n for _, n in rows]
        enc_lens = [len(e) for e in self.enc]
        pre = lambda xs: [sum(xs[:i]) for i in range(len(xs) + 1)]  # noqa: E731
        slots = [s for r, (t, n) in enumerate(rows) for s in self._slots(r, range(n - len(t), n))]
        cross_slots = [t[p // BS] * BS + p % BS for t, e in zip(self.cross, self.enc) for p in range(len(e))]
        P = len(rows) if prefill else 0
        md = TorchSDPABackend.make_metadata(
            num_prefills=P, num_prefill_tokens=sum(q_lens) if prefill else 0,
            num_decode_tokens=0 if prefill else sum(q_lens), slot_mapping=torch.tensor(slots),
            seq_lens=seq_lens, seq_lens_tensor=i32(seq_lens), max_prefill_seq_len=max(seq_lens) if prefill else 0,
            max_decode_seq_len=0 if prefill else max(seq_lens), max_query_len=max(q_lens) if prefill else 1,
            query_start_loc=i32(pre(q_lens) if prefill else [0]), seq_start_loc=i32(pre(seq_lens) if prefill else [0]),
            context_lens_tensor=i32([n - q for n, q in zip(seq_lens, q_lens)]), block_tables=i32(self.tables),
            encoder_seq_lens=enc_lens, encoder_seq_lens_tensor=i32(enc_lens),
            encoder_seq_start_loc=i32(pre(enc_lens) if prefill else [0]), max_encoder_seq_len=max(enc_lens),
            num_encoder_tokens=sum(enc_lens) if prefill else 0,
            cross_slot_mapping=torch.tensor(cross_slots if prefill else [], dtype=torch.long),
            cross_block_tables=i32(self.cross), block_size=BS, block_tables_list=self.tables,
            cross_block_tables_list=self.cross, decode_query_lens=None if prefill else q_lens)
        ids = torch.tensor([x for t, _ in rows for x in t])
        pos = torch.tensor([p for t, n in rows for p in range(n - len(t), n)])
        enc = self.model.build_encoder_inputs(self.enc, [None] * len(self.enc), torch.device("cpu")) if prefill else {}
        h = self.model(ids, pos, self.kv, md, **enc)
        if prefill:
            h = h[torch.tensor(pre(q_lens)[1:]) - 1]
        return self.model.compute_logits(h)


def _plain(model, encoder_ids, start: list[int]) -> list[list[int]]:
    eng = Engine(model, encoder_ids)
    toks = [list(start) for _ in encoder_ids]
    logits = eng.step([(t, len(t)) for t in toks], prefill=True)
    for _ in range(STEPS):
        for r, t in enumerate(toks):
            t.append(int(logits[r].argmax()))
        logits = eng.step([(t[-1:], len(t)) for t in toks], prefill=False)
    return toks


def _speculative(model, encoder_ids, start: list[int], propose) -> tuple[list[list[int]], int]:
    """Request 0 verifies drafts from ``propose``; request 1 decodes one row a step."""
    eng = Engine(model, encoder_ids)
    toks = [list(start) for _ in encoder_ids]
    logits = eng.step([(t, len(t)) for t in toks], prefill=True)
    for r, t in enumerate(toks):
        t.append(int(logits[r].argmax()))
    accepted_total = 0
    while min(len(t) for t in toks) < len(start) + STEPS:
        drafts = propose(toks[0])[: len(start) + STEPS - len(toks[0])]
        rows = [(toks[0][-1:] + drafts, len(toks[0]) + len(drafts)), (toks[1][-1:], len(toks[1]))]
        logits = eng.step(rows, prefill=False)
        k = len(drafts)
        target = logits[: k + 1].argmax(-1)[None]  # (1, k + 1): request 0's rows
        out, acc = accept_greedy(target, torch.tensor(drafts, dtype=torch.long).view(1, k), [k])
        accepted_total += int(acc[0])
        toks[0] += [x for x in out[0].tolist() if x >= 0]
        toks[1].append(int(logits[k + 1].argmax()))
        # Rejected drafts' K/V stay in their slots; the next step's rows overwrite them.
    return [t[: len(start) + STEPS] for t in toks], accepted_total


@pytest.mark.parametrize("fused", [True, False], ids=["fused-step", "op-by-op"])
def test_verifying_drafts_gives_the_plain_greedy_tokens(model, fused, monkeypatch):
    name, m, start_id = model
    m.fused_decode = fused if name != "marian" else False
    ran = []  # rows of each fused step that ran
    real = decoder_step_cpu.decode_step
    monkeypatch.setattr(decoder_step_cpu, "decode_step", lambda h, *a, **k: (
        out := real(h, *a, **k), ran.append(h.shape[0] if out is not None else 0))[0])
    g = torch.Generator().manual_seed(0)
    encoder_ids = [torch.randint(4, 900, (n,), generator=g).tolist() for n in (21, 37)]
    start = [start_id]
    plain = _plain(m, encoder_ids, start)
    # Oracle drafts, right for a while then wrong: rows accepted and rows rolled back.
    rng = torch.Generator().manual_seed(1)

    def oracle(t: list[int]) -> list[int]:
        truth = plain[0][len(t): len(t) + 4]
        cut = int(torch.randint(0, len(truth) + 1, (1,), generator=rng))
        return truth[:cut] + [(x + 1) % 900 for x in truth[cut:]]

    spec, accepted = _speculative(m, encoder_ids, start, oracle)
    assert spec == plain and accepted > 0
    ngram = NgramProposer(3, 3, 1)
    spec, _ = _speculative(m, encoder_ids, start, lambda t: ngram.propose(encoder_ids[0], t))
    assert spec == plain
    # The fused step ran the multi-row steps too (several rows for two requests), where it runs at all.
    assert (max(ran, default=0) > 2) == (m.fused_decode and decoder_step_cpu.available()), ran[:8]
