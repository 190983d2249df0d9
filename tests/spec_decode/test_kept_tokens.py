"""A speculating row's kept tokens in ``Scheduler.update`` (``step_update``'s
quick path: each through the stop checker's quick rule, a full check only for
a token the rule does not pass): the same end as checking every token."""
from encdec.core.outputs import ModelRunnerOutput, SampledTokens
from encdec.sampling_params import SamplingParams
from encdec.sequence import SequenceStatus
from tests.core.test_scheduler import assert_all_free, make_group
from tests.core.test_scheduler_update import EOS, scheduler


def _one_step(sched, tokens):
    metas, out = sched.schedule()
    return sched.update(out, ModelRunnerOutput([SampledTokens(sid, tokens[sid]) for m in metas
                                                for sid in m.seq_data]))


def test_kept_tokens_past_max_tokens_are_dropped_and_the_rest_counted_computed():
    sched = scheduler()
    a, b = make_group("a", arrival=0), make_group("b", arrival=1)
    a.sampling_params = SamplingParams(max_tokens=3)
    b.sampling_params = SamplingParams(max_tokens=10)
    for g in (a, b):
        sched.add_seq_group(g)
    sa, sb = a.get_seqs()[0], b.get_seqs()[0]
    finished = _one_step(sched, {sa.seq_id: [5, 6, 7, 8], sb.seq_id: [5, 6, 8]})
    assert finished == [a] and sa.status is SequenceStatus.FINISHED_LENGTH_CAPPED
    assert sa.get_output_token_ids() == [5, 6, 7] and sb.get_output_token_ids() == [5, 6, 8]
    # b's prompt was computed in the step; of its three tokens the first two are (their K/V was written)
    assert sb.data.get_num_computed_tokens() == sb.get_len() - 1
    assert _one_step(sched, {sb.seq_id: [9, EOS, 9]}) == [b]
    assert sb.get_output_token_ids() == [5, 6, 8, 9, EOS] and sb.status is SequenceStatus.FINISHED_STOPPED
    assert_all_free(sched)


def test_a_stop_id_among_kept_tokens_ends_the_sequence_there():
    sched = scheduler()
    g = make_group("g", arrival=0)
    g.sampling_params = SamplingParams(max_tokens=10, stop_token_ids=[6])
    sched.add_seq_group(g)
    s = g.get_seqs()[0]
    assert _one_step(sched, {s.seq_id: [5, 6, 7]}) == [g]
    assert s.get_output_token_ids() == [5, 6] and s.status is SequenceStatus.FINISHED_STOPPED
    assert_all_free(sched)
