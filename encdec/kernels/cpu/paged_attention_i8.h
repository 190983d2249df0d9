/* Attention over an int8 cross cache: a self-draft's copy of its rows' cross
 * K/V (draft_kv.py) in 8 bits a value, read by the draft's fused step
 * (decoder_step_cpu.c includes this after paged_attention_cpu.c, whose
 * softmax_numerators and prefetch distance it shares).
 *
 * Why: a Whisper base draft step of one row spent ~1.45 ms of its ~3.3 ms in
 * cross attention over 1500 bfloat16 slots (18 MB a step for six layers, read
 * at ~13 GB/s: a one-row pass is bound by the misses in flight, not by the
 * arithmetic); half the slots took 0.57 ms less. int8 is half of bfloat16's
 * bytes. Only drafts read the copy and the target verifies every draft, so
 * the rounding costs acceptance at most, never a token.
 *
 * The layout (draft_kv.py writes it): the copy keeps its cache tensors'
 * blocks (block_bytes each, K's in k_cache, V's in v_cache, table-mapped as
 * any paged cache), and a block of int8 slots holds block_size records of
 * H D + 4 H bytes at its start, record j for slot j:
 *
 *     int8 x[H][D]       round(value * 127 / max |value|), |x| <= 127 (0 for all-zero)
 *     float scale[H]     max |value| of the head's D values / 127
 *
 * (int8_rows_cpu.c's quantize_row, rows of D values).
 *
 * A score is scale_k[h] * sum_d q[d] x_k[d] (times the attention's scale),
 * an output o_h += p * scale_v[h] * x_v: the scales come out of the sums. */
#ifndef ENCDEC_PAGED_ATTENTION_I8_H
#define ENCDEC_PAGED_ATTENTION_I8_H

/* Slot t's record in an int8 cache. */
ALWAYS_INLINE const int8_t *i8_slot(const void *cache, const int32_t *table, int32_t t, int64_t block_size,
                                    int64_t block_bytes, int64_t record) {
    return (const int8_t *)cache + (int64_t)table[t / block_size] * block_bytes + (t % block_size) * record;
}

ALWAYS_INLINE float i8_scale(const int8_t *rec, int64_t HD, int64_t h) {
    float s;
    memcpy(&s, rec + HD + 4 * h, sizeof s);
    return s;
}

ALWAYS_INLINE void i8_prefetch(const void *cache, const int32_t *table, int32_t t, int32_t t1, int64_t block_size,
                               int64_t block_bytes, int64_t record) {
    if (t + PF_AHEAD >= t1) return;
    const int8_t *rec = i8_slot(cache, table, t + PF_AHEAD, block_size, block_bytes, record);
    for (int64_t off = 0; off < record; off += 64) __builtin_prefetch(rec + off);
}

/* q . x over D values, x int8. */
ALWAYS_INLINE float dot_i8(const float *q, const int8_t *x, int64_t D) {
    int64_t d = 0;
    float s = 0.f;
#if defined(VM_VL)
    vm_vec acc = VM_ZERO();
    for (; d + VM_VL <= D; d += VM_VL) acc = VM_FMA(VM_LOAD(q + d), VM_LOAD_I8(x + d), acc);
    s = VM_HSUM(acc);
#endif
    for (; d < D; d++) s += q[d] * (float)x[d];
    return s;
}

/* o += p x over D values, x int8. */
ALWAYS_INLINE void axpy_i8(float *restrict o, float p, const int8_t *x, int64_t D) {
    int64_t d = 0;
#if defined(VM_VL)
    const vm_vec pv = VM_SET1(p);
    for (; d + VM_VL <= D; d += VM_VL) VM_STORE(o + d, VM_FMA(pv, VM_LOAD_I8(x + d), VM_LOAD(o + d)));
#endif
    for (; d < D; d++) o[d] += p * (float)x[d];
}

#if defined(VM_VL)
/* The scores of slots t .. t + 3 (D a multiple of VM_VL), the four dot
 * products of a head summed across lanes together, as score_four_slots. */
ALWAYS_INLINE void i8_score_four(float *scores, int G, const float *const *qs, const void *k_cache,
                                 const int32_t *table, int32_t t, int32_t t0, int32_t t1, int64_t H, int64_t D,
                                 int64_t block_size, int64_t block_bytes, float scale) {
    const int64_t n = t1 - t0, HD = H * D, record = HD + 4 * H;
    const int8_t *k[4];
    for (int j = 0; j < 4; j++) {
        i8_prefetch(k_cache, table, t + j, t1, block_size, block_bytes, record);
        k[j] = i8_slot(k_cache, table, t + j, block_size, block_bytes, record);
    }
    for (int64_t h = 0; h < H; h++) {
        const __m128 ks = _mm_mul_ps(_mm_setr_ps(i8_scale(k[0], HD, h), i8_scale(k[1], HD, h), i8_scale(k[2], HD, h),
                                                 i8_scale(k[3], HD, h)),
                                     _mm_set1_ps(scale));
        for (int g = 0; g < G; g++) {
            const float *q = qs[g] + h * D;
            vm_vec acc[4] = {VM_ZERO(), VM_ZERO(), VM_ZERO(), VM_ZERO()};
            for (int64_t d = 0; d < D; d += VM_VL) {
                const vm_vec qv = VM_LOAD(q + d);
                for (int j = 0; j < 4; j++) acc[j] = VM_FMA(qv, VM_LOAD_I8(k[j] + h * D + d), acc[j]);
            }
            _mm_storeu_ps(scores + (g * H + h) * n + t - t0, _mm_mul_ps(VM_HSUM4(acc[0], acc[1], acc[2], acc[3]), ks));
        }
    }
}

/* os[g]_h += p(t) scale_v(t)_h x_v(t)_h for slots t .. t + 3, in slot order,
 * each output vector loaded and stored once for the four (add_four_slots). */
ALWAYS_INLINE void i8_add_four(int G, float *const *os, const float *scores, const void *v_cache,
                               const int32_t *table, int32_t t, int32_t t0, int32_t t1, int64_t H, int64_t D,
                               int64_t block_size, int64_t block_bytes) {
    const int64_t n = t1 - t0, HD = H * D, record = HD + 4 * H;
    const int8_t *v[4];
    for (int j = 0; j < 4; j++) {
        i8_prefetch(v_cache, table, t + j, t1, block_size, block_bytes, record);
        v[j] = i8_slot(v_cache, table, t + j, block_size, block_bytes, record);
    }
    for (int64_t h = 0; h < H; h++)
        for (int g = 0; g < G; g++) {
            const float *p = scores + (g * H + h) * n + t - t0;
            vm_vec pv[4];
            for (int j = 0; j < 4; j++) pv[j] = VM_SET1(p[j] * i8_scale(v[j], HD, h));
            float *o = os[g] + h * D;
            for (int64_t d = 0; d < D; d += VM_VL) {
                vm_vec acc = VM_LOAD(o + d);
                for (int j = 0; j < 4; j++) acc = VM_FMA(pv[j], VM_LOAD_I8(v[j] + h * D + d), acc);
                VM_STORE(o + d, acc);
            }
        }
}
#endif

/* attend_range_biased's contract (no bias, one K/V head per query head) on
 * an int8 cache: the G queries' attention over slots [t0, t1), not yet
 * normalised, into os, mx and sum. */
static void attend_range_i8(int G, float *const *os, const float *const *qs, const void *k_cache,
                            const void *v_cache, const int32_t *table, int32_t t0, int32_t t1, int64_t H, int64_t D,
                            int64_t block_size, int64_t block_bytes, float scale, float *scores, float *const *mx,
                            float *const *sum) {
    const int64_t n = t1 - t0, HD = H * D, record = HD + 4 * H;
    int32_t t = t0;
#if defined(VM_VL)
    if (D % VM_VL == 0)
        for (; t + 4 <= t1; t += 4)
            i8_score_four(scores, G, qs, k_cache, table, t, t0, t1, H, D, block_size, block_bytes, scale);
#endif
    for (; t < t1; t++) {
        i8_prefetch(k_cache, table, t, t1, block_size, block_bytes, record);
        const int8_t *k = i8_slot(k_cache, table, t, block_size, block_bytes, record);
        for (int64_t h = 0; h < H; h++) {
            const float ks = i8_scale(k, HD, h) * scale;
            for (int g = 0; g < G; g++) scores[(g * H + h) * n + t - t0] = dot_i8(qs[g] + h * D, k + h * D, D) * ks;
        }
    }
    for (int g = 0; g < G; g++) {
        for (int64_t h = 0; h < H; h++)
            sum[g][h] = softmax_numerators(scores + (g * H + h) * n, (int32_t)n, mx[g] + h);
        memset(os[g], 0, sizeof(float) * HD);
    }
    t = t0;
#if defined(VM_VL)
    if (D % VM_VL == 0)
        for (; t + 4 <= t1; t += 4) i8_add_four(G, os, scores, v_cache, table, t, t0, t1, H, D, block_size, block_bytes);
#endif
    for (; t < t1; t++) {
        i8_prefetch(v_cache, table, t, t1, block_size, block_bytes, record);
        const int8_t *v = i8_slot(v_cache, table, t, block_size, block_bytes, record);
        for (int64_t h = 0; h < H; h++) {
            const float vs = i8_scale(v, HD, h);
            for (int g = 0; g < G; g++) axpy_i8(os[g] + h * D, scores[(g * H + h) * n + t - t0] * vs, v + h * D, D);
        }
    }
}

/* kv_quantize_i8: blocks src_blocks[i] of a float32 cache (block_size slots
 * of H D values) as int8 records into blocks dst_blocks[i] of another
 * (dst_block_bytes apart), one pass, whichever thread is free taking blocks.
 * (quantize_row: rounding half to even, as torch.round). Why: torch took eight passes over a
 * window's cross K/V (~30 ms a Whisper base window) where the copy's draft
 * steps save ~0.5 ms each. */
typedef struct {
    const float *src;
    int8_t *dst;
    const int64_t *src_blocks, *dst_blocks;
    int64_t n, block_size, H, D, dst_block_bytes;
    team_t team;
} kv_quantize_t;

static void kv_quantize_block(const kv_quantize_t *j, int64_t i) {
    const int64_t HD = j->H * j->D, record = HD + 4 * j->H;
    const float *s = j->src + j->src_blocks[i] * j->block_size * HD;
    int8_t *d = j->dst + j->dst_blocks[i] * j->dst_block_bytes;
    for (int64_t t = 0; t < j->block_size; t++, s += HD, d += record)
        for (int64_t h = 0; h < j->H; h++) {
            float scale;
            quantize_row(s + h * j->D, j->D, d + h * j->D, &scale);
            memcpy(d + HD + 4 * h, &scale, sizeof scale);
        }
}

static void kv_quantize_job(void *arg, int tid) {
    kv_quantize_t *j = arg;
    (void)tid;
    TEAM_PHASE(&j->team, 0, j->n, kv_quantize_block(j, i));
}

void kv_quantize_i8(const float *src, int8_t *dst, const int64_t *src_blocks, const int64_t *dst_blocks, int64_t n,
                    int64_t block_size, int64_t H, int64_t D, int64_t dst_block_bytes, int num_threads) {
    atomic_int counters[2] = {0, 0};
    kv_quantize_t job = {src, dst, src_blocks, dst_blocks, n, block_size, H, D, dst_block_bytes,
                         {0, 0, counters, counters + 1}};
    team_run(kv_quantize_job, &job, num_threads);
}

#endif
