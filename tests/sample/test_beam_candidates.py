"""``select_candidates``: each candidate's token log-prob renormalised after the
processors' masks (HF Whisper's average log-prob) for requests that ask, beside the running score
the search ranks on."""
from __future__ import annotations

import pytest
import torch

from encdec.beam_search.params import BeamSearchParams
from encdec.beam_search.rows import BeamRowParams
from encdec.sample.beam_candidates import find_beam_rows, select_candidates
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
