/* Dense non-causal attention on CPU, float32, head_size 64 (every Whisper and
 * BART size): softmax(scale * Q K^T) V for a batch of equal-length sequences.
 * Written for Whisper's encoder, where attention over 1500 positions is half of
 * the encoder's time and torch's CPU flash kernel runs at ~70% of what this
 * machine's GEMMs reach.
 *
 * Why it is faster: one job per (batch, head) packs K transposed and V once
 * (both stay in L2), then for each block of 6 query rows
 * computes the whole score rows (T_k fits, so the softmax is exact two-pass,
 * no online rescaling), exponentiates them in place and multiplies by V; both
 * products are 6x64 register-tiled AVX-512 FMA loops. Scores are never written
 * to memory beyond one block's rows.
 *
 * Layout: q is (B, T_q, H, 64) and k, v are (B, T_k, H, 64), each with its own
 * batch/time strides (in floats; the head stride is 64 and the last dim is
 * contiguous), so a fused (B, T, 3, H, 64) qkv projection is read in place.
 * out is (B, T_q, H, 64) contiguous: it is the (B, T_q, H * 64) input of the
 * output projection, no transpose needed.
 *
 * Two paths, chosen at compile time by the ISA flags build.py passes (one build
 * per ISA): AVX-512 (6 rows x 64 columns per QK tile, 24 of 32 zmm) and
 * AVX2+FMA (6 rows x 16 columns per tile, 12 accumulators of 16 ymm, as BLIS's
 * Haswell sgemm kernel). Both keep the exact two-pass softmax and a ~1 ulp exp.
 * Built with neither, the entry point returns -1 and the caller uses torch.
 * int8 (quantization="int8"): Q K^T and P V from int8 with VNNI, the softmax
 * in float32 (dense_attention_int8.h says how and why).
 *
 * A bias by offset (T5's relative position bias in its encoder): bias[h][o]
 * is added to the score of a query at i over the key at t, o = t - i + tq - 1,
 * after the scale, as torch's SDPA adds a float mask. A row's bias is then one
 * contiguous slice of its head's table (no (tq, tk) matrix): 0.2% of the
 * scores' FMAs. NULL: none. Measured (Xeon family 6 model 207, AVX-512, 2
 * threads): one encoder layer's attention for 64 sequences of 32-512 tokens,
 * 12 heads of 64, torch's SDPA with the (H, n, n) bias as its mask 172-187 ms,
 * this kernel 109-118 ms (105-166 ms with no bias); a 64-request run at
 * T5-base dims (bart_bench's workload) 28.4-28.5 -> 26.0-26.5 s.
 *
 * Packed layouts, so every tile streams contiguous memory: K^T in panels of 16
 * keys, (T_k / 16, 64, 16); V as (T_k, 64) for AVX-512 (a tile reads whole rows)
 * and in panels of 16 columns, (4, T_k, 16), for AVX2 (a tile reads 16 columns).
 * With K^T as one (64, T_k) matrix a tile read 64 lines 6 KB apart. Measured on
 * one layer of Whisper tiny (1500 positions, 6 heads, 2 threads, AMD EPYC):
 * AVX2 25.9 -> 22.9 ms from the layouts, -> 20.7 ms with the cheaper exp (vector_math.h);
 * AVX-512 17.9 -> 17.6 ms.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "int8_rows_cpu.c" /* quantize_row (int8 attention); before the one-letter macros below */

#define D 64
#define R 6 /* query rows per register tile */
/* Keys summed in registers before a P V partial sum joins its row's total, as
 * a GEMM's k blocks do: one running sum over all 1500 keys was 2.4x torch's
 * error against float64 (1.2e-5 vs 5e-6 at Whisper's shapes), and made the
 * encoder's output drift past HF's own float32 error on a 30 s clip. */
#define KC 128

#include "team.h"
#include "vector_math.h" /* vm_exp */

/* What this build runs; the "none" build declines every call (returns -1). */
const char *dense_attention_path(void) { return VM_PATH; }

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define HAVE_VECTOR_PATH 1
#include <immintrin.h>

static float *alloc_floats(int64_t n) {
    void *p = NULL;
    return posix_memalign(&p, 64, sizeof(float) * (size_t)(n > 0 ? n : 1)) == 0 ? p : NULL;
}

/* Where K[t][d] goes in the packed K^T: panels of 16 keys, (ldk / 16, D, 16). */
static inline int64_t kt_at(int64_t t, int d) { return (t & ~15) * D + d * 16 + (t & 15); }
#endif

#ifdef __AVX512F__
/* s[i][c .. c + 16 * NV) = qs[i] . K^T[:, c ..] for i < R; kt holds K^T in
 * panels of 16 keys: (ldk / 16, D, 16). */
#define QK_TILE(NV)                                                                  \
    static inline void qk_tile_##NV(const float *qs, const float *kt, int64_t ldk,   \
                                    float *s, int64_t c) {                           \
        __m512 acc[R][NV];                                                           \
        for (int i = 0; i < R; i++)                                                  \
            for (int j = 0; j < NV; j++) acc[i][j] = _mm512_setzero_ps();            \
        for (int d = 0; d < D; d++) {                                                \
            __m512 kv[NV];                                                           \
            for (int j = 0; j < NV; j++) kv[j] = _mm512_loadu_ps(kt + kt_at(c + 16 * j, d)); \
            for (int i = 0; i < R; i++) {                                            \
                __m512 qb = _mm512_set1_ps(qs[i * D + d]);                           \
                for (int j = 0; j < NV; j++) acc[i][j] = _mm512_fmadd_ps(qb, kv[j], acc[i][j]); \
            }                                                                        \
        }                                                                            \
        for (int i = 0; i < R; i++)                                                  \
            for (int j = 0; j < NV; j++) _mm512_storeu_ps(s + i * ldk + c + 16 * j, acc[i][j]); \
    }
QK_TILE(4)
QK_TILE(1)

/* s (R rows of ldk) = qs kt: 6x64 tiles, then 6x16 for the rest of ldk. */
static inline void qk_rows(const float *qs, const float *kt, int64_t ldk, float *s) {
    int64_t c = 0;
    for (; c + 64 <= ldk; c += 64) qk_tile_4(qs, kt, ldk, s, c);
    for (; c < ldk; c += 16) qk_tile_1(qs, kt, ldk, s, c);
}

/* V row t into the packed V: (tk, D), whole rows (pv_rows reads a row per key). */
static inline void pack_v_row(float *vp, const float *row, int64_t t, int64_t tk) {
    (void)tk;
    memcpy(vp + t * D, row, sizeof(float) * D);
}

/* o[i] = inv[i] * sum_t p[i][t] * v[t] for i < rows, t < tk; v is (tk, D)
 * contiguous; row i goes to o + i * ldo. Sums run KC keys in registers, then
 * join the rows' totals in tot (see KC). */
static inline void pv_rows(const float *p, int64_t ldp, const float *v, int64_t tk,
                           const float *inv, int rows, float *o, int64_t ldo) {
    __m512 tot[R][4];
    for (int64_t t0 = 0; t0 < tk; t0 += KC) {
        const int64_t t1 = t0 + KC < tk ? t0 + KC : tk;
        __m512 acc[R][4];
        for (int i = 0; i < R; i++)
            for (int j = 0; j < 4; j++) acc[i][j] = _mm512_setzero_ps();
        for (int64_t t = t0; t < t1; t++) {
            const float *vt = v + t * D;
            __m512 v0 = _mm512_loadu_ps(vt), v1 = _mm512_loadu_ps(vt + 16);
            __m512 v2 = _mm512_loadu_ps(vt + 32), v3 = _mm512_loadu_ps(vt + 48);
            for (int i = 0; i < R; i++) {
                __m512 pb = _mm512_set1_ps(p[i * ldp + t]);
                acc[i][0] = _mm512_fmadd_ps(pb, v0, acc[i][0]);
                acc[i][1] = _mm512_fmadd_ps(pb, v1, acc[i][1]);
                acc[i][2] = _mm512_fmadd_ps(pb, v2, acc[i][2]);
                acc[i][3] = _mm512_fmadd_ps(pb, v3, acc[i][3]);
            }
        }
        for (int i = 0; i < R; i++)
            for (int j = 0; j < 4; j++) tot[i][j] = t0 ? _mm512_add_ps(tot[i][j], acc[i][j]) : acc[i][j];
    }
    for (int i = 0; i < rows; i++) {
        __m512 w = _mm512_set1_ps(inv[i]);
        for (int j = 0; j < 4; j++) _mm512_storeu_ps(o + i * ldo + 16 * j, _mm512_mul_ps(tot[i][j], w));
    }
}

/* In place: s[0 .. n) <- exp(s - max(s)); returns the sum. */
static inline float softmax_numerator(float *s, int64_t n) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 16 <= n; t += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + t));
    __mmask16 tail = (__mmask16)((1u << (n - t)) - 1u);
    m = _mm512_mask_max_ps(m, tail, m, _mm512_maskz_loadu_ps(tail, s + t));
    __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));
    __m512 sum = _mm512_setzero_ps();
    for (t = 0; t + 16 <= n; t += 16) {
        __m512 e = vm_exp(_mm512_sub_ps(_mm512_loadu_ps(s + t), mx));
        _mm512_storeu_ps(s + t, e);
        sum = _mm512_add_ps(sum, e);
    }
    if (tail) {
        __m512 e = vm_exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + t), mx));
        e = _mm512_maskz_mov_ps(tail, e);
        _mm512_mask_storeu_ps(s + t, tail, e);
        sum = _mm512_add_ps(sum, e);
    }
    return _mm512_reduce_add_ps(sum);
}

#elif defined(HAVE_VECTOR_PATH) /* AVX2 + FMA */
/* A 6x16 tile in 12 named accumulators: GCC kept an __m256 acc[6][2] array
 * on the stack (a store per FMA, measured 1.5x slower). FMA6(a, b, ptr, ld)
 * adds broadcast(ptr[i * ld]) * (a, b) to row i's pair. */
#define DECL6 __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, \
    c21 = c00, c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00
#define FMA2(i, a, b, ptr)                                                \
    do {                                                                  \
        __m256 bc = _mm256_broadcast_ss(ptr);                             \
        c##i##0 = _mm256_fmadd_ps(bc, a, c##i##0);                        \
        c##i##1 = _mm256_fmadd_ps(bc, b, c##i##1);                        \
    } while (0)
#define FMA6(a, b, ptr, ld)                                               \
    do {                                                                  \
        FMA2(0, a, b, (ptr));          FMA2(1, a, b, (ptr) + (ld));       \
        FMA2(2, a, b, (ptr) + 2 * (ld)); FMA2(3, a, b, (ptr) + 3 * (ld)); \
        FMA2(4, a, b, (ptr) + 4 * (ld)); FMA2(5, a, b, (ptr) + 5 * (ld)); \
    } while (0)

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

static inline float hsum8(__m256 v) {
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    m = _mm_add_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* s (R rows of ldk) = qs kt in 6x16 tiles: 12 accumulators, 2 key loads and a
 * broadcast per step, 15 of the 16 ymm registers. */
static inline void qk_rows(const float *qs, const float *kt, int64_t ldk, float *s) {
    for (int64_t c = 0; c < ldk; c += 16) {
        DECL6;
        for (int d = 0; d < D; d++) {
            __m256 k0 = _mm256_loadu_ps(kt + kt_at(c, d)), k1 = _mm256_loadu_ps(kt + kt_at(c, d) + 8);
            FMA6(k0, k1, qs + d, D);
        }
        __m256 rows[R][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
        for (int i = 0; i < R; i++) {
            _mm256_storeu_ps(s + i * ldk + c, rows[i][0]);
            _mm256_storeu_ps(s + i * ldk + c + 8, rows[i][1]);
        }
    }
}

/* V row t into the packed V: panels of 16 columns, (D / 16, tk, 16). */
static inline void pack_v_row(float *vp, const float *row, int64_t t, int64_t tk) {
    for (int c = 0; c < D; c += 16) memcpy(vp + c * tk + t * 16, row + c, sizeof(float) * 16);
}

/* o[i] = inv[i] * sum_t p[i][t] * v[t] for i < rows, t < tk, in four passes of
 * 16 output columns (6x16 tiles again: 64 columns would need 48 registers);
 * v holds V in panels of 16 columns, (D / 16, tk, 16). Sums run KC keys in
 * registers, then join the pass's totals in tot (see KC). */
static inline void pv_rows(const float *p, int64_t ldp, const float *v, int64_t tk,
                           const float *inv, int rows, float *o, int64_t ldo) {
    for (int c = 0; c < D; c += 16) {
        __m256 tot[R][2];
        for (int64_t t0 = 0; t0 < tk; t0 += KC) {
            const int64_t t1 = t0 + KC < tk ? t0 + KC : tk;
            DECL6;
            for (int64_t t = t0; t < t1; t++) {
                __m256 v0 = _mm256_loadu_ps(v + c * tk + t * 16), v1 = _mm256_loadu_ps(v + c * tk + t * 16 + 8);
                FMA6(v0, v1, p + t, ldp);
            }
            __m256 acc[R][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
            for (int i = 0; i < R; i++)
                for (int j = 0; j < 2; j++) tot[i][j] = t0 ? _mm256_add_ps(tot[i][j], acc[i][j]) : acc[i][j];
        }
        for (int i = 0; i < rows; i++) {
            __m256 w = _mm256_set1_ps(inv[i]);
            _mm256_storeu_ps(o + i * ldo + c, _mm256_mul_ps(tot[i][0], w));
            _mm256_storeu_ps(o + i * ldo + c + 8, _mm256_mul_ps(tot[i][1], w));
        }
    }
}

/* In place: s[0 .. n) <- exp(s - max(s)); returns the sum. The row is padded
 * to a multiple of 16, so the last partial vector is loaded and stored whole
 * with its lanes past n masked out. */
static inline float softmax_numerator(float *s, int64_t n) {
    __m256 m = _mm256_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + t));
    const __m256 tail = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
        _mm256_set1_epi32((int)(n - t)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
    if (t < n) m = _mm256_max_ps(m, _mm256_blendv_ps(m, _mm256_loadu_ps(s + t), tail));
    __m256 mx = _mm256_set1_ps(hmax8(m));
    __m256 sum = _mm256_setzero_ps();
    for (t = 0; t + 8 <= n; t += 8) {
        __m256 e = vm_exp(_mm256_sub_ps(_mm256_loadu_ps(s + t), mx));
        _mm256_storeu_ps(s + t, e);
        sum = _mm256_add_ps(sum, e);
    }
    if (t < n) {
        __m256 e = _mm256_and_ps(vm_exp(_mm256_sub_ps(_mm256_loadu_ps(s + t), mx)), tail);
        _mm256_storeu_ps(s + t, e);
        sum = _mm256_add_ps(sum, e);
    }
    return hsum8(sum);
}
#endif

#ifdef HAVE_VECTOR_PATH
#include "dense_attention_int8.h" /* the int8 scores and P V */

typedef struct {
    float *out;
    const float *q, *k, *v;
    int64_t B, H, tq, tk, q_sb, q_st, k_sb, k_st, v_sb, v_st, ldk;
    float scale;
    const float *bias;   /* (H, bias_stride) by offset, or NULL (the header) */
    int64_t bias_stride;
    float *buffers;      /* each thread's K^T, V (float32 or the int8 parts) and score rows, per_thread floats apart */
    int64_t per_thread;
    int int8;            /* int8 scores and P V (above) */
    team_t team;
} dense_job_t;

/* Job (b, h): pack its K^T and V, then every block of R query rows. vp: the
 * packed float32 V, or on the int8 path its parts (v8 quads, then their channel
 * scales, the quantized P rows' block scales and bytes). */
static void dense_one(const dense_job_t *j, int64_t job, float *kt, float *vp, float *s) {
    const float *q = j->q, *k = j->k, *v = j->v;
    float *out = j->out;
    const int64_t H = j->H, tq = j->tq, tk = j->tk, ldk = j->ldk, q_sb = j->q_sb, q_st = j->q_st;
    const int64_t k_sb = j->k_sb, k_st = j->k_st, v_sb = j->v_sb, v_st = j->v_st;
    const float scale = j->scale;
    float qs[R * D] __attribute__((aligned(64)));
    const int64_t b = job / H, h = job % H;
    const float *kb = k + b * k_sb + h * D, *vb = v + b * v_sb + h * D;
    /* int8: the packed keys' bytes, then their scales, in the K^T buffer */
    int32_t *k8 = (int32_t *)kt, *v8 = (int32_t *)vp;
    float *ks = kt + ldk * (D / 4), *vs = vp + ldk * (D / 4), *ps = vs + D;
    const int64_t nb = (tk + KC - 1) / KC;
    uint8_t *p8 = (uint8_t *)(ps + R * nb);
    int8_t q8[R * D] __attribute__((aligned(64)));
    float qscale[R];
    int32_t qc[R];
    if (j->int8) {
        pack_k8(kb, k_st, tk, ldk, k8, ks);
        pack_v8(vb, v_st, tk, ldk, v8, vs);
    } else {
        for (int64_t t = 0; t < tk; t++) pack_v_row(vp, vb + t * v_st, t, tk);
        for (int64_t t = 0; t < tk; t++)
            for (int d = 0; d < D; d++) kt[kt_at(t, d)] = kb[t * k_st + d];
        for (int d = 0; d < D; d++)
            for (int64_t t = tk; t < ldk; t++) kt[kt_at(t, d)] = 0.f;
    }
    for (int64_t r0 = 0; r0 < tq; r0 += R) {
        const int rows = tq - r0 < R ? (int)(tq - r0) : R;
        for (int i = 0; i < R; i++)
            for (int d = 0; d < D; d++)
                qs[i * D + d] = i < rows ? scale * q[b * q_sb + (r0 + i) * q_st + h * D + d] : 0.f;
        if (j->int8) {
            for (int i = 0; i < R; i++) {
                quantize_row(qs + i * D, D, q8 + i * D, qscale + i);
                int32_t sum = 0;
                for (int d = 0; d < D; d++) sum += q8[i * D + d];
                qc[i] = -128 * sum;
            }
            qk8_rows(q8, qscale, qc, k8, ks, ldk, s);
        } else {
            qk_rows(qs, kt, ldk, s);
        }
        if (j->bias)
            for (int i = 0; i < rows; i++) {
                const float *brow = j->bias + h * j->bias_stride + (tq - 1 - (r0 + i));
                float *srow = s + i * ldk;
                for (int64_t t = 0; t < tk; t++) srow[t] += brow[t];
            }
        float inv[R];  /* 1 / each row's sum of P (int8: of the quantized P) */
        for (int i = 0; i < R; i++)
            inv[i] = 1.0f / (j->int8 ? softmax_p8_row(s + i * ldk, tk, ldk, p8 + i * ldk, ps + i * nb)
                                     : softmax_numerator(s + i * ldk, tk));
        float *o = out + ((b * tq + r0) * H + h) * D;
        if (j->int8)
            pv8_rows(p8, ldk, ps, nb, v8, vs, ldk, inv, rows, o, H * D);
        else
            pv_rows(s, ldk, vp, tk, inv, rows, o, H * D);
    }
}

/* Jobs are taken one at a time by whichever thread is free (team.h): a thread
 * that lost its core to another process leaves its jobs to the others. */
static void dense_job(void *arg, int tid) {
    dense_job_t *j = arg;
    float *kt = j->buffers + tid * j->per_thread, *vp = kt + D * j->ldk, *s = kt + j->per_thread - R * j->ldk;
    TEAM_PHASE(&j->team, 0, j->B * j->H, dense_one(j, i, kt, vp, s));
}
#endif

int dense_attention_f32(float *out, const float *q, const float *k, const float *v,
                        int64_t B, int64_t H, int64_t tq, int64_t tk,
                        int64_t q_sb, int64_t q_st, int64_t k_sb, int64_t k_st,
                        int64_t v_sb, int64_t v_st, float scale, const float *bias, int64_t bias_stride,
                        int int8, int num_threads)
{
#ifndef HAVE_VECTOR_PATH
    (void)out; (void)q; (void)k; (void)v; (void)B; (void)H; (void)tq; (void)tk; (void)q_sb;
    (void)q_st; (void)k_sb; (void)k_st; (void)v_sb; (void)v_st; (void)scale; (void)bias; (void)bias_stride;
    (void)int8; (void)num_threads;
    return -1;
#else
    const int nt = num_threads > 1 ? num_threads : 1;
    const int64_t ldk = (tk + 15) / 16 * 16; /* keys, zero padded to whole panels */
    /* K^T, V, the score rows (multiples of 16 floats: each part stays aligned). V on
     * the int8 path: its quads, channel scales, the P rows' block scales and bytes */
    const int64_t v_part = int8 ? (ldk * (D / 4) + D + R * ((tk + KC - 1) / KC) + R * ldk / 4 + 15) / 16 * 16 : tk * D;
    const int64_t per_thread = D * ldk + v_part + R * ldk;
    float *buffers = alloc_floats(nt * per_thread);
    if (!buffers) return -2;
    atomic_int counters[2] = {0, 0};
    dense_job_t job = {out, q, k, v, B, H, tq, tk, q_sb, q_st, k_sb, k_st, v_sb, v_st, ldk, scale, bias,
                       bias_stride, buffers, per_thread, int8, {0, 0, counters, counters + 1}};
    team_run(dense_job, &job, nt);
    free(buffers);
    return 0;
#endif
}
