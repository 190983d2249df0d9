"""``select_candidates``: each candidate's token log-prob renormalised after the
processors' masks (HF Whisper's average log-prob) for requests that ask, beside the running score
the search ranks on."""
from __future__ import annotations

import pytest
import torch

from encdec.beam_search.params import BeamSearchParams
from encdec.sample.beam_candidates import find_beam_rows, select_candidates
from encdec.sampling_params import BeamRowParams
from encdec.sequence import SequenceData, SequenceGroupMetadata


@pytest.mark.parametrize("asked", [True, False])
def test_token_logprobs_are_renormalised_after_the_masks(asked: bool):
    torch.manual_seed(0)
    vocab, k = 50, 3
    data = {i: SequenceData([1, 2]) for i in range(k)}
    for i, d in enumerate(data.values()):
        d.cumulative_logprob = -float(i)
    params = BeamSearchParams(k, 8, renormalized_logprob=asked)
    meta = SequenceGroupMetadata("r", False, data, BeamRowParams.from_beam_params(params), {i: [0] for i in data})
    rows = find_beam_rows([meta], {i: i for i in data}, torch.device("cpu"))
    processed = torch.randn(k, vocab).log_softmax(-1)
    processed[:, 30:] = float("-inf")  # a processor masked a block of the vocabulary
    cand = select_candidates(rows, processed)["r"]
    if not asked:  # the extra vocabulary-wide pass is only made for requests that ask
        assert cand.token_logprobs is None and cand.scores
        return
    renormed = processed.log_softmax(-1)
    for score, parent, token, lp in zip(cand.scores, cand.parents, cand.tokens, cand.token_logprobs):
        assert token < 30
        assert abs(score - (processed[parent, token] - parent)) < 1e-5  # running score + processed
        assert abs(lp - renormed[parent, token]) < 1e-5 and lp > processed[parent, token]


def _beam_metas(groups: int, k: int) -> list[SequenceGroupMetadata]:
    metas, sid = [], 0
    for g in range(groups):
        data = {}
        for j in range(k):
            data[sid] = SequenceData([1, 2])
            data[sid].cumulative_logprob = -0.5 * j - g
            sid += 1
        params = BeamRowParams.from_beam_params(BeamSearchParams(k, 8, renormalized_logprob=True))
        metas.append(SequenceGroupMetadata(f"r{g}", False, data, params, {i: [0] for i in data}))
    return metas


def _reference(metas, batch_rows, logprobs):
    """HF's rule per group: top candidates of running score + log-prob over beams x vocab."""
    out = {}
    for m in metas:
        rows = logprobs[[batch_rows[s] for s in m.seq_data]]
        running = torch.tensor([d.cumulative_logprob for d in m.seq_data.values()])
        flat = (rows + running[:, None]).flatten()
        values, idx = flat.topk(2 * len(m.seq_data))
        renormed = rows.log_softmax(-1).flatten()[idx]
        out[m.request_id] = (values.tolist(), (idx // rows.shape[1]).tolist(), (idx % rows.shape[1]).tolist(),
                             renormed.tolist())
    return out


@pytest.mark.parametrize("order", ["in_order", "permuted", "with_a_sampled_row", "a_run_then_a_sampled_row"])
def test_a_batch_of_beams_alone_is_read_in_place(order: str):
    """Beams alone in the batch (any row order): the sampler returns the whole
    batch's log-probs as they are (a slice, no row copied, no token sampled) and
    ``select_candidates`` finds each group's beams through ``positions``; with
    another request's row among them, the rows go by index, or by a slice where
    they are a run in order. Every way the candidates are HF's."""
    from encdec.sample.sampler import Sampler
    from encdec.sampling_params import SamplingParams
    from tests.sample.reference import make_batch

    torch.manual_seed(1)
    vocab, groups, k = 40, 3, 2
    metas = _beam_metas(groups, k)
    seqs = [s for m in metas for s in m.seq_data]
    extra = 1 if "sampled_row" in order else 0
    perm = list(range(len(seqs) + extra))
    if order in ("permuted", "with_a_sampled_row"):
        perm = [perm[i] for i in torch.randperm(len(perm)).tolist()]
    batch_rows = {s: perm[i] for i, s in enumerate(seqs)}
    if extra:
        batch_rows[99] = perm[-1]  # a sampled request's row
    rows = find_beam_rows(metas, batch_rows, torch.device("cpu"))
    if order == "with_a_sampled_row":
        assert isinstance(rows.row_index, torch.Tensor) and rows.positions is None
    elif extra:
        assert rows.row_index == slice(0, len(seqs)) and rows.positions is None
    else:
        assert rows.row_index == slice(0, len(seqs))
        assert rows.positions == (None if order == "in_order" else [batch_rows[s] for s in seqs])
    logits = torch.randn(len(perm), vocab) * 3
    params = [SamplingParams(temperature=0.0) for _ in perm]
    md = make_batch(params, [[1]] * len(perm), [[]] * len(perm), vocab).refresh_metadata()
    out = Sampler()(logits.clone(), md, logprob_rows=rows.row_index)
    if extra:
        beam_lp = logits[rows.row_index].log_softmax(-1)
        torch.testing.assert_close(out.processed_logprobs, beam_lp, rtol=0, atol=0)
        assert out.sampled_token_ids[batch_rows[99], 0] == logits[batch_rows[99]].argmax()
    else:
        torch.testing.assert_close(out.processed_logprobs, logits.log_softmax(-1), rtol=0, atol=0)
        assert out.sampled_token_ids.flatten().tolist() == [0] * len(perm)  # not sampled
    lp_by_batch_row = logits.log_softmax(-1)
    got = select_candidates(rows, out.processed_logprobs)
    for rid, (values, parents, tokens, renormed) in _reference(metas, batch_rows, lp_by_batch_row).items():
        c = got[rid]
        assert (c.parents, c.tokens) == (parents, tokens)
        assert c.scores == pytest.approx(values, abs=1e-6) and c.token_logprobs == pytest.approx(renormed, abs=1e-6)
