/* Paged decode attention on CPU, float32: one query token per sequence
 * attends to its keys/values where they lie in the paged cache, with no
 * gather copy. Used for decoder self-attention (block table grows) and
 * cross-attention (cross block table, written once at prefill). The cache
 * holds float32, or bfloat16 (kv_cache_dtype="bfloat16" with float32 weights:
 * half the bytes a step streams; each value widens to float32 exactly, and
 * every sum stays float32).
 *
 * Cache layout of one layer's K (and V), slot-major:
 *     cache[slot][kv_head][head_size],  slot = block * block_size + offset
 *
 * One job per sequence, three passes: every cached slot (all heads,
 * contiguous) is read once, in order, for the scores; then each head's
 * softmax over its own row of scores; then every slot once more for the
 * values, the normalisation applied to the sums at the end.
 *
 * Paths by the build's ISA (build.py compiles this once per ISA; says which
 * ``paged_attention_path``): AVX-512 and AVX2+FMA score each head in vector
 * lanes over head_size (when head_size is a multiple of the lanes) and take
 * exp() in lanes; plain C ("none") keeps 8 scalar lanes and libm's expf.
 * Why the vector paths: Whisper tiny's cross-attention (1500 slots, 6 heads
 * of 64) ran one row on one thread in 0.44 ms, 10 GB/s against the core's
 * 27 GB/s streaming read, bound by the per-score scalar work (a horizontal
 * sum of 8 lanes, the running max, libm's expf, a division per slot and
 * head), not by memory. The lanes' exp() is vector_math.h's. Results
 * match a softmax(QK^T)V reference to float32 rounding. Measured (that
 * shape, cache flushed, huge pages, alternating builds in one process): one
 * row on one thread 0.248 -> 0.209 ms; 8 rows on two threads 1.372 ->
 * 1.252 ms (29 GB/s; two cores stream 32.6). Software prefetch a few slots
 * ahead made both slower (0.29 and 1.45 ms).
 *
 * A relative position bias (T5, decoder self-attention, causal): the caller
 * gives one table per step, bias[h][d] for a key d positions before the query
 * (d = 0: the query's own slot), already bucketed as the model buckets it and
 * wide enough for the step's longest sequence. The query's position is
 * len - 1 and slot t's is t, so score(t) = q.k(t) * scale + bias[h][len-1-t]:
 * no (query, key) matrix per row. NULL for none (cross-attention, BART,
 * Whisper: the code below then compiles to what it was without a bias).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "team.h"

#define LANES 8

#include "vector_math.h"

/* a . b over n values in 8 scalar lanes; b float32 or bfloat16 (widened exactly, so
 * a bfloat16 row scores as the same values held in float32 do). */
static inline __attribute__((always_inline)) float dot_any(const float *a, const void *b, int n, int bf16) {
#define B_AT(i) (bf16 ? vm_bf16_to_f32(((const uint16_t *)b)[i]) : ((const float *)b)[i])
    float acc[LANES] = {0};
    int i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += a[i + j] * B_AT(i + j);
    float s = 0.f;
    for (int j = 0; j < LANES; j++) s += acc[j];
    for (; i < n; i++) s += a[i] * B_AT(i);
    return s;
#undef B_AT
}

const char *paged_attention_path(void) { return VM_PATH; }

/* score_slots and attend_range_kv are inlined into their callers: one passing
 * group 1 then folds the per-slot, per-head division h / group away (called
 * out of line, the decode step's attention ran 8% slower). */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* The cache's element size: bfloat16 or float32 (bf16: a literal 0 or 1 at
 * each always-inlined call, so each cache type compiles to its own loops). */
#define KV_BYTES(bf16) ((bf16) ? 2 : 4)

/* Slot t's row of a cache (all heads), table-mapped. */
ALWAYS_INLINE const char *slot_row(const void *cache, const int32_t *table, int32_t t, int64_t block_size,
                                   int64_t slot_stride, int bf16) {
    const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
    return (const char *)cache + slot * slot_stride * KV_BYTES(bf16);
}

/* Slot t + PF_AHEAD's whole row into the caches while slot t's is used. Why:
 * a slot's dot products end in a horizontal sum, so the out-of-order window
 * holds only a few slots' loads; a decode step of 8 Whisper rows read its
 * cross K/V from memory at ~11 GB/s of the ~25 this host streams. Measured
 * (tiny.en dims, 8 rows x 1500 slots, 8 caches of 18 MB cycled, AVX-512, 2
 * threads): bfloat16 10.6-10.9 -> 7.8-8.0 ms, float32 15.5-15.9 -> 13.9-15.0 ms,
 * one row unchanged; 4, 8 and 16 slots ahead alike. tiny.en sequential, 8 files:
 * decode steps 4.75-5.18 -> 3.43-3.77 s. */
#define PF_AHEAD 8
ALWAYS_INLINE void prefetch_slot(const void *cache, const int32_t *table, int32_t t, int32_t t1, int64_t block_size,
                                 int64_t slot_stride, int bf16) {
    if (t + PF_AHEAD >= t1) return;
    const char *row = slot_row(cache, table, t + PF_AHEAD, block_size, slot_stride, bf16);
    for (int64_t off = 0; off < slot_stride * KV_BYTES(bf16); off += 64) __builtin_prefetch(row + off);
}

/* q . k over n values, k float32 or bfloat16. */
ALWAYS_INLINE float dot_kv(const float *q, const char *k, int64_t n, int bf16) {
#if defined(VM_VL)
    if (n % VM_VL == 0) {
        vm_vec acc = VM_ZERO();
        for (int64_t d = 0; d < n; d += VM_VL)
            acc = VM_FMA(VM_LOAD(q + d), bf16 ? VM_LOAD_BF16((const uint16_t *)k + d) : VM_LOAD((const float *)k + d),
                         acc);
        return VM_HSUM(acc);
    }
#endif
    return dot_any(q, k, (int)n, bf16);
}

/* o += p v over n values, v float32 or bfloat16. */
ALWAYS_INLINE void axpy_kv(float *restrict o, float p, const char *v, int64_t n, int bf16) {
    if (!bf16) {
        const float *restrict vv = (const float *)v;
        for (int64_t d = 0; d < n; d++) o[d] += p * vv[d];
        return;
    }
    const uint16_t *vv = (const uint16_t *)v;
    int64_t d = 0;
#if defined(VM_VL)
    const vm_vec pv = VM_SET1(p);
    for (; d + VM_VL <= n; d += VM_VL) VM_STORE(o + d, VM_FMA(pv, VM_LOAD_BF16(vv + d), VM_LOAD(o + d)));
#endif
    for (; d < n; d++) o[d] += p * vm_bf16_to_f32(vv[d]);
}

#if defined(VM_VL)
/* The rows of slots t .. t + 3 (prefetching ahead), for the four-slot loops below. */
ALWAYS_INLINE void four_slot_rows(const char *rows[4], const void *cache, const int32_t *table, int32_t t,
                                  int32_t t1, int64_t block_size, int64_t slot_stride, int bf16) {
    for (int j = 0; j < 4; j++) {
        prefetch_slot(cache, table, t + j, t1, block_size, slot_stride, bf16);
        rows[j] = slot_row(cache, table, t + j, block_size, slot_stride, bf16);
    }
}

/* score_slots for slots t .. t + 3 (head_size a multiple of VM_VL): the four
 * dot products of a head and query summed across lanes together (VM_HSUM4). */
ALWAYS_INLINE void score_four_slots(float *scores, int G, const float *const *qs, const void *k_cache,
                                    const int32_t *table, int32_t t, int32_t t0, int32_t t1, int64_t num_heads,
                                    int64_t group, int64_t head_size, int64_t slot_stride, int64_t block_size,
                                    float scale, const float *bias, int64_t bias_stride, int32_t q_pos, int bf16) {
    const int64_t n = t1 - t0;
    const char *k[4];
    four_slot_rows(k, k_cache, table, t, t1, block_size, slot_stride, bf16);
    for (int64_t h = 0; h < num_heads; h++) {
        const int64_t off = (h / group) * head_size;
        for (int g = 0; g < G; g++) {
            const float *q = qs[g] + h * head_size;
            vm_vec acc[4] = {VM_ZERO(), VM_ZERO(), VM_ZERO(), VM_ZERO()};
            for (int64_t d = 0; d < head_size; d += VM_VL) {
                const vm_vec qv = VM_LOAD(q + d);
                for (int j = 0; j < 4; j++)
                    acc[j] = VM_FMA(qv, bf16 ? VM_LOAD_BF16((const uint16_t *)k[j] + off + d)
                                             : VM_LOAD((const float *)k[j] + off + d), acc[j]);
            }
            float *out = scores + (g * num_heads + h) * n + t - t0;
            _mm_storeu_ps(out, _mm_mul_ps(VM_HSUM4(acc[0], acc[1], acc[2], acc[3]), _mm_set1_ps(scale)));
            if (bias)
                for (int j = 0; j < 4; j++) out[j] += bias[h * bias_stride + q_pos - t - j];
        }
    }
}
#endif

/* scores[(g * num_heads + h) * (t1 - t0) + t - t0] = qs[g]_h . k_h(t) * scale
 * for each of the G queries (all heads), every slot t in [t0, t1) and head h:
 * a slot's keys are read once for all G. */
ALWAYS_INLINE void score_slots(float *scores, int G, const float *const *qs, const void *k_cache,
                               const int32_t *table, int32_t t0, int32_t t1, int64_t num_heads, int64_t group,
                               int64_t head_size, int64_t slot_stride, int64_t block_size, float scale,
                               const float *bias, int64_t bias_stride, int32_t q_pos, int bf16) {
    const int64_t n = t1 - t0;
    int32_t t = t0;
#if defined(VM_VL)
    if (head_size % VM_VL == 0)
        for (; t + 4 <= t1; t += 4)
            score_four_slots(scores, G, qs, k_cache, table, t, t0, t1, num_heads, group, head_size, slot_stride,
                             block_size, scale, bias, bias_stride, q_pos, bf16);
#endif
    for (; t < t1; t++) {
        prefetch_slot(k_cache, table, t, t1, block_size, slot_stride, bf16);
        const char *k = slot_row(k_cache, table, t, block_size, slot_stride, bf16);
        for (int64_t h = 0; h < num_heads; h++) {
            const char *kh = k + (h / group) * head_size * KV_BYTES(bf16);
            for (int g = 0; g < G; g++) {
                const float s = dot_kv(qs[g] + h * head_size, kh, head_size, bf16);
                scores[(g * num_heads + h) * n + t - t0] =
                    bias ? s * scale + bias[h * bias_stride + q_pos - t] : s * scale;
            }
        }
    }
}

/* row[t] = exp(row[t] - max(row)); *max_out = max(row) (-inf for none); returns the sum. */
static float softmax_numerators(float *row, int32_t len, float *max_out) {
    const float mx = vm_max_of(row, len);
    *max_out = mx;
    float sum = 0.f;
    int32_t t = 0;
#if defined(VM_VL)
    const vm_vec mv = VM_SET1(mx);
    vm_vec acc = VM_ZERO();
    for (; t + VM_VL <= len; t += VM_VL) {
        const vm_vec e = vm_exp(VM_SUB(VM_LOAD(row + t), mv));
        VM_STORE(row + t, e);
        acc = VM_ADD(acc, e);
    }
    sum = VM_HSUM(acc);
    if (t < len) {  /* the tail through a padded lane block, as the lanes do it */
        float tail[VM_VL];
        for (int j = 0; j < VM_VL; j++) tail[j] = t + j < len ? row[t + j] - mx : -INFINITY;
        VM_STORE(tail, vm_exp(VM_LOAD(tail)));
        for (; t < len; t++) {
            row[t] = tail[t % VM_VL];
            sum += row[t];
        }
    }
#else
    for (; t < len; t++) {
        row[t] = expf(row[t] - mx);
        sum += row[t];
    }
#endif
    return sum;
}

/* The attention of G queries over one sequence's slots [t0, t1) (G > 1: rows
 * that share a cache table, best_of samples or beams over one cross table;
 * each slot's K and V are read once for all of them), not yet normalised:
 * os[g][h] = sum_t exp(s_t - mx[g][h]) v_t, with mx[g][h] the largest score
 * and sum[g][h] the sum of the exponentials (a part another part's result
 * joins, decoder_step_cpu.c; mx -inf and sum 0 for no slots). qs[g] and
 * os[g]: (num_heads, head_size); scores: scratch of G * num_heads * (t1 - t0) floats.
 * bias (NULL: none): see the header; the G queries all sit at q_pos. */
#if defined(VM_VL)
/* os[g]_h += p(t) v_h(t) for slots t .. t + 3 (head_size a multiple of
 * VM_VL), in slot order as axpy_kv adds them, each output vector loaded and
 * stored once for the four (one add per slot went through memory: a chain of
 * store-to-load latencies at a few heads). */
ALWAYS_INLINE void add_four_slots(int G, float *const *os, const float *scores, const void *v_cache,
                                  const int32_t *table, int32_t t, int32_t t0, int32_t t1, int64_t num_heads,
                                  int64_t group, int64_t head_size, int64_t slot_stride, int64_t block_size,
                                  int bf16) {
    const int64_t n = t1 - t0;
    const char *v[4];
    four_slot_rows(v, v_cache, table, t, t1, block_size, slot_stride, bf16);
    for (int64_t h = 0; h < num_heads; h++) {
        const int64_t off = (h / group) * head_size;
        for (int g = 0; g < G; g++) {
            const float *p = scores + (g * num_heads + h) * n + t - t0;
            const vm_vec p0 = VM_SET1(p[0]), p1 = VM_SET1(p[1]), p2 = VM_SET1(p[2]), p3 = VM_SET1(p[3]);
            float *o = os[g] + h * head_size;
#define V_AT(j) (bf16 ? VM_LOAD_BF16((const uint16_t *)v[j] + off + d) : VM_LOAD((const float *)v[j] + off + d))
            for (int64_t d = 0; d < head_size; d += VM_VL)
                VM_STORE(o + d, VM_FMA(p3, V_AT(3), VM_FMA(p2, V_AT(2), VM_FMA(p1, V_AT(1),
                                                                             VM_FMA(p0, V_AT(0), VM_LOAD(o + d))))));
#undef V_AT
        }
    }
}
#endif

ALWAYS_INLINE void attend_range_biased(int G, float *const *os, const float *const *qs, const void *k_cache,
                                const void *v_cache, const int32_t *table, int32_t t0, int32_t t1,
                                int64_t num_heads, int64_t group, int64_t head_size, int64_t slot_stride,
                                int64_t block_size, float scale, float *scores, float *const *mx,
                                float *const *sum, const float *bias, int64_t bias_stride, int32_t q_pos, int bf16) {
    const int64_t n = t1 - t0;
    score_slots(scores, G, qs, k_cache, table, t0, t1, num_heads, group, head_size, slot_stride, block_size, scale,
                bias, bias_stride, q_pos, bf16);
    for (int g = 0; g < G; g++) {
        for (int64_t h = 0; h < num_heads; h++)
            sum[g][h] = softmax_numerators(scores + (g * num_heads + h) * n, (int32_t)n, mx[g] + h);
        memset(os[g], 0, sizeof(float) * num_heads * head_size);
    }
    int32_t t = t0;
#if defined(VM_VL)
    if (head_size % VM_VL == 0)
        for (; t + 4 <= t1; t += 4)
            add_four_slots(G, os, scores, v_cache, table, t, t0, t1, num_heads, group, head_size, slot_stride,
                           block_size, bf16);
#endif
    for (; t < t1; t++) {
        prefetch_slot(v_cache, table, t, t1, block_size, slot_stride, bf16);
        const char *v = slot_row(v_cache, table, t, block_size, slot_stride, bf16);
        for (int64_t h = 0; h < num_heads; h++) {
            const char *vv = v + (h / group) * head_size * KV_BYTES(bf16);
            for (int g = 0; g < G; g++)
                axpy_kv(os[g] + h * head_size, scores[(g * num_heads + h) * n + t - t0], vv, head_size, bf16);
        }
    }
}

/* attend_range_biased on a float32 (bf16 0) or bfloat16 (1) cache, each
 * compiled on its own; bias NULL for none. */
ALWAYS_INLINE void attend_range_kv(int G, float *const *os, const float *const *qs, const void *k_cache,
                            const void *v_cache, const int32_t *table, int32_t t0, int32_t t1, int64_t num_heads,
                            int64_t group, int64_t head_size, int64_t slot_stride, int64_t block_size, float scale,
                            float *scores, float *const *mx, float *const *sum, const float *bias,
                            int64_t bias_stride, int32_t q_pos, int bf16) {
#define ATTEND_RANGE(B, BF16)                                                                                   \
    attend_range_biased(G, os, qs, k_cache, v_cache, table, t0, t1, num_heads, group, head_size, slot_stride, \
                        block_size, scale, scores, mx, sum, B, bias_stride, q_pos, BF16)
    if (bf16) {
        if (bias) ATTEND_RANGE(bias, 1); else ATTEND_RANGE(NULL, 1);
    } else {
        if (bias) ATTEND_RANGE(bias, 0); else ATTEND_RANGE(NULL, 0);
    }
#undef ATTEND_RANGE
}

/* One sequence's attention output, all heads over all its len slots. */
static void attend(float *os, const float *qs, const void *k_cache, const void *v_cache, const int32_t *table,
                   int32_t len, int64_t num_heads, int64_t group, int64_t head_size, int64_t slot_stride,
                   int64_t block_size, float scale, float *scores, const float *bias, int64_t bias_stride, int bf16) {
    float mx[num_heads], sum[num_heads];
    float *mxp = mx, *sump = sum;
    attend_range_kv(1, &os, &qs, k_cache, v_cache, table, 0, len, num_heads, group, head_size, slot_stride,
                    block_size, scale, scores, &mxp, &sump, bias, bias_stride, len - 1, bf16);
    for (int64_t h = 0; h < num_heads; h++) {
        const float inv = 1.f / sum[h];
        for (int64_t d = 0; d < head_size; d++) os[h * head_size + d] *= inv;
    }
}

typedef struct {
    float *out;
    const float *q;
    const void *k_cache, *v_cache;  /* float32, or bfloat16 where kv_bf16 */
    const int32_t *tables, *lens;
    int64_t num_seqs, table_stride, num_heads, group, head_size, slot_stride, block_size;
    float scale;
    const float *bias;  /* [h][d], or NULL (the header) */
    int64_t bias_stride;
    int kv_bf16;
    team_t team;
} paged_job_t;

static void paged_one(const paged_job_t *j, int64_t s) {
    const int32_t len = j->lens[s];
    float *scores = (float *)malloc(sizeof(float) * (size_t)(len > 0 ? len : 1) * j->num_heads);  /* [h][t] */
    const int64_t row = s * j->num_heads * j->head_size;
    attend(j->out + row, j->q + row, j->k_cache, j->v_cache, j->tables + s * j->table_stride, len, j->num_heads,
           j->group, j->head_size, j->slot_stride, j->block_size, j->scale, scores, j->bias, j->bias_stride,
           j->kv_bf16);
    free(scores);
}

/* Sequences are taken one at a time by whichever thread is free (team.h). */
static void paged_job(void *arg, int tid) {
    paged_job_t *j = arg;
    (void)tid;
    TEAM_PHASE(&j->team, 0, j->num_seqs, paged_one(j, i));
}

/* out, q: (num_seqs, num_heads, head_size); tables: (num_seqs, table_stride) int32;
 * lens: (num_seqs,) int32; bias: (num_heads, bias_stride) float32 with
 * bias_stride >= max(lens), or NULL; kv_bf16: the caches hold bfloat16 (else
 * float32). One job per sequence (the header). */
void paged_attention_decode_f32(
    float *out, const float *q, const void *k_cache, const void *v_cache,
    const int32_t *tables, int64_t table_stride, const int32_t *lens,
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
    int64_t block_size, float scale, const float *bias, int64_t bias_stride, int num_threads, int kv_bf16)
{
    atomic_int counters[2] = {0, 0};
    paged_job_t job = {out, q, k_cache, v_cache, tables, lens, num_seqs, table_stride, num_heads,
                       num_heads / num_kv_heads, head_size, num_kv_heads * head_size, block_size, scale,
                       bias, bias_stride, kv_bf16, {0, 0, counters, counters + 1}};
    team_run(paged_job, &job, num_threads);
}

/* Writing new K or V rows to a bfloat16 cache under float32 weights, in one
 * pass: rows [0, n) of src (d floats each, row_stride apart: a view of a fused
 * projection) rounded as torch rounds (vm_f32_to_bf16) into cache slot
 * slots[i], and the same rounded values widened into widened (n, d) for the
 * prefill's own attention. Why: torch ran it as a conversion of the strided
 * view, an index_copy_ and a widening copy, 90 ms of a 16-window tiny.en int8
 * prefill here. Rows in items of KV_WRITE_ROWS, taken by whichever thread is
 * free (team.h). */
#define KV_WRITE_ROWS 64

typedef struct {
    const float *src;
    int64_t n, d, row_stride;
    const int64_t *slots;
    uint16_t *cache;
    float *widened;
    team_t team;
} kv_write_t;

static void kv_write_rows(const kv_write_t *j, int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; i++) {
        const float *s = j->src + i * j->row_stride;
        uint16_t *c = j->cache + j->slots[i] * j->d;
        float *w = j->widened + i * j->d;
        for (int64_t k = 0; k < j->d; k++) {
            const uint16_t b = vm_f32_to_bf16(s[k]);
            c[k] = b;
            w[k] = vm_bf16_to_f32(b);
        }
    }
}

static void kv_write_job(void *arg, int tid) {
    kv_write_t *j = arg;
    (void)tid;
    const int64_t items = (j->n + KV_WRITE_ROWS - 1) / KV_WRITE_ROWS;
    TEAM_PHASE(&j->team, 0, items,
               kv_write_rows(j, i * KV_WRITE_ROWS, (i + 1) * KV_WRITE_ROWS < j->n ? (i + 1) * KV_WRITE_ROWS : j->n));
}

void kv_write_bf16(const float *src, int64_t n, int64_t d, int64_t row_stride, const int64_t *slots,
                   uint16_t *cache, float *widened, int num_threads) {
    atomic_int counters[2] = {0, 0};
    kv_write_t job = {src, n, d, row_stride, slots, cache, widened, {0, 0, counters, counters + 1}};
    team_run(kv_write_job, &job, num_threads);
}

/* A self-draft's bfloat16 copy of the K/V it reads (encdec/worker/draft_kv.py):
 * units src_units[i] of a float32 cache (unit floats each: a block, or a slot
 * of every head) rounded as torch rounds (vm_f32_to_bf16) into units
 * dst_units[i] of a bfloat16 one, in one pass. Why: torch's index_select, its
 * conversion and index_copy_ took ~3 ms a layer for one Whisper window's cross
 * K/V, three passes over them. Units taken by whichever thread is free. */
typedef struct {
    const float *src;
    uint16_t *dst;
    const int64_t *src_units, *dst_units;
    int64_t n, unit;
    team_t team;
} kv_round_t;

static void kv_round_unit(const kv_round_t *j, int64_t i) {
    const float *s = j->src + j->src_units[i] * j->unit;
    uint16_t *d = j->dst + j->dst_units[i] * j->unit;
    for (int64_t k = 0; k < j->unit; k++) d[k] = vm_f32_to_bf16(s[k]);
}

static void kv_round_job(void *arg, int tid) {
    kv_round_t *j = arg;
    (void)tid;
    TEAM_PHASE(&j->team, 0, j->n, kv_round_unit(j, i));
}

void kv_round_bf16(const float *src, uint16_t *dst, const int64_t *src_units, const int64_t *dst_units, int64_t n,
                   int64_t unit, int num_threads) {
    atomic_int counters[2] = {0, 0};
    kv_round_t job = {src, dst, src_units, dst_units, n, unit, {0, 0, counters, counters + 1}};
    team_run(kv_round_job, &job, num_threads);
}

#include "int8_rows_cpu.c" /* quantize_row */
#include "paged_attention_i8.h" /* a self-draft's int8 cross copy: its attention and its writes */
