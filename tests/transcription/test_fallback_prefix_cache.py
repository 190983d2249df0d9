"""The prefix cache where Whisper users meet it: long-form transcription with
``condition_on_previous_text`` (the default) of a noise-mixed clip on which a
window fails the thresholds and is decoded again at every higher temperature
(``encdec.bench.whisper_fallback``). Each re-decode is the same window with the
same decoder prompt (previous text, then the start tokens), so its full prompt
blocks are found cached; the transcript is token for token the one without the
cache, and every block is free at the end."""
from __future__ import annotations

import pytest

from encdec import LLM
from encdec.bench.whisper_fallback import noisy_long_clip, transcribe_counted


@pytest.fixture(scope="module")
def fallback_clip():
    """39 s, two windows: the first decodes at temperature 0; the second (its
    prompt holds the first's text) fails at 0 and is retried at 0.2-1.0."""
    return noisy_long_clip(8, snr_db=0.0, seed=0)


@pytest.mark.slow  # two engines transcribe 39 s with 25 sampled re-decodes: 40 s on the shared 2-core host
def test_fallback_re_decodes_hit_the_prefix_cache_and_match_off(ct2_dir, fallback_clip):
    got, stats = {}, {}
    for on in (False, True):
        llm = LLM(ct2_dir, kv_cache_memory=256 << 20, swap_space=0.05, num_threads=2, enable_prefix_caching=on)
        segments, counts = transcribe_counted(llm, fallback_clip, seed=0)
        engine = llm.llm_engine
        assert engine.num_free_blocks()[0] == engine.cache_config.num_gpu_blocks
        got[on], stats[on] = segments, (counts, engine.scheduler.block_manager.prefix_cache_stats())
    assert got[True] == got[False]
    counts, (queries, hits) = stats[True]
    assert counts == stats[False][0]
    assert counts["retries"] >= 1 and any(t > 0 for t, _ in got[True])  # the clip made a window fall back
    block = 16  # LLM's default block_size
    assert hits >= block * counts["retries"], (counts, queries, hits)  # each re-decode skipped a block or more
    assert stats[False][1] == (0, 0)
