/* Paged decode attention on CPU, float32: one query token per sequence
 * attends to its keys/values where they lie in the paged cache, with no
 * gather copy. Used for decoder self-attention (block table grows) and
 * cross-attention (cross block table, written once at prefill).
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
 * head), not by memory. The lanes' exp() is Cephes' expf (range reduction
 * by ln 2 in two parts, a degree-5 polynomial): within 2 ulp of libm's on
 * the scores' range (x <= 0), 0 below -87.3 where expf is denormal. Results
 * match a softmax(QK^T)V reference to float32 rounding. Measured (that
 * shape, cache flushed, huge pages, alternating builds in one process): one
 * row on one thread 0.248 -> 0.209 ms; 8 rows on two threads 1.372 ->
 * 1.252 ms (29 GB/s; two cores stream 32.6). Software prefetch a few slots
 * ahead made both slower (0.29 and 1.45 ms).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 8

static float dot(const float *a, const float *b, int n) {
    float acc[LANES] = {0};
    int i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += a[i + j] * b[i + j];
    float s = 0.f;
    for (int j = 0; j < LANES; j++) s += acc[j];
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#if defined(__AVX512F__)
#define PA_VL 16
typedef __m512 pa_vec;
typedef __m512i pa_ivec;
#define PA_LOAD(p) _mm512_loadu_ps(p)
#define PA_STORE(p, a) _mm512_storeu_ps(p, a)
#define PA_SET1(x) _mm512_set1_ps(x)
#define PA_ZERO() _mm512_setzero_ps()
#define PA_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define PA_MUL(a, b) _mm512_mul_ps(a, b)
#define PA_ADD(a, b) _mm512_add_ps(a, b)
#define PA_SUB(a, b) _mm512_sub_ps(a, b)
#define PA_MAX(a, b) _mm512_max_ps(a, b)
#define PA_FLOOR(a) _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)
#define PA_CVT(a) _mm512_cvttps_epi32(a)
#define PA_POW2(n) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23))
#define PA_HSUM(a) _mm512_reduce_add_ps(a)
#define PA_HMAX(a) _mm512_reduce_max_ps(a)
#define PA_BLEND_LT(x, lim, a, b) _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, lim, _CMP_LT_OQ), a, b)
#else
#define PA_VL 8
typedef __m256 pa_vec;
typedef __m256i pa_ivec;
#define PA_LOAD(p) _mm256_loadu_ps(p)
#define PA_STORE(p, a) _mm256_storeu_ps(p, a)
#define PA_SET1(x) _mm256_set1_ps(x)
#define PA_ZERO() _mm256_setzero_ps()
#define PA_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define PA_MUL(a, b) _mm256_mul_ps(a, b)
#define PA_ADD(a, b) _mm256_add_ps(a, b)
#define PA_SUB(a, b) _mm256_sub_ps(a, b)
#define PA_MAX(a, b) _mm256_max_ps(a, b)
#define PA_FLOOR(a) _mm256_floor_ps(a)
#define PA_CVT(a) _mm256_cvttps_epi32(a)
#define PA_POW2(n) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23))
static inline float pa_hsum(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline float pa_hmax(__m256 a) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
#define PA_HSUM(a) pa_hsum(a)
#define PA_HMAX(a) pa_hmax(a)
#define PA_BLEND_LT(x, lim, a, b) _mm256_blendv_ps(a, b, _mm256_cmp_ps(x, lim, _CMP_LT_OQ))
#endif

/* exp(x) in lanes for x <= 0 (Cephes expf; see the header). */
static inline pa_vec pa_exp(pa_vec x) {
    const pa_vec lo = PA_SET1(-87.33654f);
    const pa_vec under = PA_BLEND_LT(x, lo, PA_SET1(1.f), PA_ZERO());  /* 0 where x < lo */
    x = PA_MAX(x, lo);
    const pa_vec n = PA_FLOOR(PA_FMA(x, PA_SET1(1.44269504088896341f), PA_SET1(0.5f)));
    x = PA_SUB(x, PA_MUL(n, PA_SET1(0.693359375f)));
    x = PA_SUB(x, PA_MUL(n, PA_SET1(-2.12194440e-4f)));
    pa_vec p = PA_SET1(1.9875691500e-4f);
    p = PA_FMA(p, x, PA_SET1(1.3981999507e-3f));
    p = PA_FMA(p, x, PA_SET1(8.3334519073e-3f));
    p = PA_FMA(p, x, PA_SET1(4.1665795894e-2f));
    p = PA_FMA(p, x, PA_SET1(1.6666665459e-1f));
    p = PA_FMA(p, x, PA_SET1(5.0000001201e-1f));
    p = PA_FMA(p, PA_MUL(x, x), PA_ADD(x, PA_SET1(1.f)));
    return PA_MUL(PA_MUL(p, PA_POW2(PA_CVT(n))), under);
}
#endif

const char *paged_attention_path(void) {
#if defined(PA_VL)
    return PA_VL == 16 ? "avx512" : "avx2";
#else
    return "none";
#endif
}

/* scores[h * len + t] = q_h . k_h(t) * scale for every slot t and head h. */
static void score_slots(float *scores, const float *qs, const float *k_cache, const int32_t *table, int32_t len,
                        int64_t num_heads, int64_t group, int64_t head_size, int64_t slot_stride,
                        int64_t block_size, float scale) {
    for (int32_t t = 0; t < len; t++) {
        const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
        const float *k = k_cache + slot * slot_stride;
        for (int64_t h = 0; h < num_heads; h++) {
            const float *qh = qs + h * head_size, *kh = k + (h / group) * head_size;
            float s;
#if defined(PA_VL)
            if (head_size % PA_VL == 0) {
                pa_vec acc = PA_ZERO();
                for (int64_t d = 0; d < head_size; d += PA_VL) acc = PA_FMA(PA_LOAD(qh + d), PA_LOAD(kh + d), acc);
                s = PA_HSUM(acc);
            } else
#endif
                s = dot(qh, kh, (int)head_size);
            scores[h * len + t] = s * scale;
        }
    }
}

/* row[t] = exp(row[t] - max(row)); returns the sum. */
static float softmax_numerators(float *row, int32_t len) {
    int32_t t = 0;
    float mx = -INFINITY, sum = 0.f;
#if defined(PA_VL)
    pa_vec m = PA_SET1(-INFINITY);
    for (; t + PA_VL <= len; t += PA_VL) m = PA_MAX(m, PA_LOAD(row + t));
    mx = PA_HMAX(m);
#endif
    for (; t < len; t++) mx = row[t] > mx ? row[t] : mx;
    t = 0;
#if defined(PA_VL)
    const pa_vec mv = PA_SET1(mx);
    pa_vec acc = PA_ZERO();
    for (; t + PA_VL <= len; t += PA_VL) {
        const pa_vec e = pa_exp(PA_SUB(PA_LOAD(row + t), mv));
        PA_STORE(row + t, e);
        acc = PA_ADD(acc, e);
    }
    sum = PA_HSUM(acc);
    if (t < len) {  /* the tail through a padded lane block, as the lanes do it */
        float tail[PA_VL];
        for (int j = 0; j < PA_VL; j++) tail[j] = t + j < len ? row[t + j] - mx : -INFINITY;
        PA_STORE(tail, pa_exp(PA_LOAD(tail)));
        for (; t < len; t++) {
            row[t] = tail[t % PA_VL];
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

/* out, q: (num_seqs, num_heads, head_size); tables: (num_seqs, table_stride) int32;
 * lens: (num_seqs,) int32. One job per sequence (the header). */
void paged_attention_decode_f32(
    float *out, const float *q, const float *k_cache, const float *v_cache,
    const int32_t *tables, int64_t table_stride, const int32_t *lens,
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
    int64_t block_size, float scale, int num_threads)
{
    const int64_t group = num_heads / num_kv_heads;
    const int64_t slot_stride = num_kv_heads * head_size;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t s = 0; s < num_seqs; s++) {
        const int32_t len = lens[s];
        const int32_t *table = tables + s * table_stride;
        const float *qs = q + s * num_heads * head_size;
        float *restrict os = out + s * num_heads * head_size;
        float *scores = (float *)malloc(sizeof(float) * (size_t)len * num_heads);  /* [h][t] */
        float inv[num_heads];
        score_slots(scores, qs, k_cache, table, len, num_heads, group, head_size, slot_stride, block_size, scale);
        for (int64_t h = 0; h < num_heads; h++) inv[h] = 1.f / softmax_numerators(scores + h * len, len);
        memset(os, 0, sizeof(float) * num_heads * head_size);
        for (int32_t t = 0; t < len; t++) {
            const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
            const float *restrict v = v_cache + slot * slot_stride;
            for (int64_t h = 0; h < num_heads; h++) {
                const float p = scores[h * len + t];
                const float *restrict vv = v + (h / group) * head_size;
                float *restrict o = os + h * head_size;
                for (int64_t d = 0; d < head_size; d++) o[d] += p * vv[d];
            }
        }
        for (int64_t h = 0; h < num_heads; h++)
            for (int64_t d = 0; d < head_size; d++) os[h * head_size + d] *= inv[h];
        free(scores);
    }
}
