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
 * in float32 (the sections "Int8 scores" and "Int8 P V" say how and why).
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
/* Int8 scores (quantization="int8": dense_attention(..., int8=True)).
 * Why: Whisper's encoder attention is ~55% of an int8 encoder's time, and its
 * float32 Q K^T runs 16 multiply-adds an FMA; vpdpbusd runs 64 (4 byte products a
 * lane), measured 6.1 G instructions/s a core against the FMA's 8.9 G here.
 * How (as SageAttention's int8 Q K^T): each key minus the mean key of its (batch,
 * head), which moves every score of a query by one constant, so the softmax is
 * unchanged while channels common to all keys stop spending the int8 range; then
 * each key and each scaled query row in symmetric int8 with its own scale
 * (int8_rows_cpu.c's quantize_row: max |x| / 127, round to nearest even). A score
 * is (acc - 128 sum_d q8[d]) * qscale * kscale[t] with acc = sum_d q8[d] (k8[t][d] + 128):
 * vpdpbusd multiplies unsigned by signed bytes, so keys are stored plus 128.
 * The softmax stays float32; P V below. Paths: AVX512-VNNI on the AVX-512 build,
 * AVX-VNNI on the AVX2 build (target attributes; the caller checks the CPU). */
#if defined(__AVX512F__)
#define QK8_TARGET __attribute__((target("avx512vnni")))
#else
#define QK8_TARGET __attribute__((target("avxvnni")))
#endif
/* acc += u8 . s8 by quads, in asm: GCC 12 copied every accumulator around each
 * vpdpbusd intrinsic (two moves an instruction, the int8 Q K^T no faster than
 * float32's). {vex}: the AVX2 build's is AVX-VNNI, not AVX512-VNNI's EVEX form. */
#define DPBUSD(acc, u8, s8) __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "v"(s8))
#define DPBUSD_VEX(acc, u8, s8) __asm__("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(u8), "x"(s8))

/* Where key t's quad g (dims 4g .. 4g + 3, as one int32) goes in the packed int8
 * K: panels of 16 keys, (ldk / 16, D / 4, 16) quads, so one vector load is 16 keys'
 * quad g. */
static inline int64_t k8_at(int64_t t, int g) { return (t & ~15) * (D / 4) + g * 16 + (t & 15); }

#if defined(__AVX512F__)
/* s[i][c .. c + 16 NV) for i < R: R x 16 NV int8 products in registers. */
#define QK8_TILE(NV)                                                                              \
    static inline __attribute__((always_inline)) QK8_TARGET void qk8_tile_##NV(                   \
        const int8_t *q8, const float *qscale, const int32_t *qc, const int32_t *k8,              \
        const float *ks, int64_t ldk, float *s, int64_t c) {                                      \
        __m512i acc[R][NV];                                                                       \
        for (int i = 0; i < R; i++)                                                               \
            for (int j = 0; j < NV; j++) acc[i][j] = _mm512_set1_epi32(qc[i]);                    \
        for (int g = 0; g < D / 4; g++) {                                                         \
            __m512i kv[NV];                                                                       \
            for (int j = 0; j < NV; j++) kv[j] = _mm512_loadu_si512((const void *)(k8 + k8_at(c + 16 * j, g))); \
            for (int i = 0; i < R; i++) {                                                         \
                int32_t quad;                                                                     \
                memcpy(&quad, q8 + i * D + 4 * g, sizeof quad);                                   \
                const __m512i qb = _mm512_set1_epi32(quad);                                       \
                for (int j = 0; j < NV; j++) DPBUSD(acc[i][j], kv[j], qb);                       \
            }                                                                                     \
        }                                                                                         \
        for (int j = 0; j < NV; j++) {                                                            \
            const __m512 kscale = _mm512_loadu_ps(ks + c + 16 * j);                               \
            for (int i = 0; i < R; i++)                                                           \
                _mm512_storeu_ps(s + i * ldk + c + 16 * j,                                        \
                                 _mm512_mul_ps(_mm512_cvtepi32_ps(acc[i][j]),                     \
                                               _mm512_mul_ps(kscale, _mm512_set1_ps(qscale[i])))); \
        }                                                                                         \
    }
QK8_TILE(4)
QK8_TILE(1)
#endif

/* s[i][0 .. ldk) for i < R: the int8 scores of the quantized query rows q8
 * (R x D, scales qscale, corrections qc[i] = -128 sum_d q8[i][d]) over the
 * packed keys k8 (scales ks, zero past tk). */
static QK8_TARGET void qk8_rows(const int8_t *q8, const float *qscale, const int32_t *qc,
                                const int32_t *k8, const float *ks, int64_t ldk, float *s) {
#if defined(__AVX512F__) /* 6 x 64 tiles (24 accumulators, 4 key vectors, one broadcast), then 6 x 16 */
    int64_t c = 0;
    for (; c + 64 <= ldk; c += 64) qk8_tile_4(q8, qscale, qc, k8, ks, ldk, s, c);
    for (; c < ldk; c += 16) qk8_tile_1(q8, qscale, qc, k8, ks, ldk, s, c);
#else /* 6 x 16 tiles: 12 accumulators, two key vectors, one broadcast: 15 of the 16 ymm */
    for (int64_t c = 0; c < ldk; c += 16) {
        __m256i acc[R][2];
        for (int i = 0; i < R; i++) acc[i][0] = acc[i][1] = _mm256_set1_epi32(qc[i]);
        for (int g = 0; g < D / 4; g++) {
            const __m256i k0 = _mm256_loadu_si256((const __m256i *)(k8 + k8_at(c, g)));
            const __m256i k1 = _mm256_loadu_si256((const __m256i *)(k8 + k8_at(c, g) + 8));
            for (int i = 0; i < R; i++) {
                int32_t quad;
                memcpy(&quad, q8 + i * D + 4 * g, sizeof quad);
                const __m256i qb = _mm256_set1_epi32(quad);
                DPBUSD_VEX(acc[i][0], k0, qb);
                DPBUSD_VEX(acc[i][1], k1, qb);
            }
        }
        for (int j = 0; j < 2; j++) {
            const __m256 kscale = _mm256_loadu_ps(ks + c + 8 * j);
            for (int i = 0; i < R; i++)
                _mm256_storeu_ps(s + i * ldk + c + 8 * j,
                                 _mm256_mul_ps(_mm256_cvtepi32_ps(acc[i][j]),
                                               _mm256_mul_ps(kscale, _mm256_set1_ps(qscale[i]))));
        }
    }
#endif
}

/* The job's keys, minus their mean, in int8 (layout k8_at, plus 128 as bytes)
 * with one scale each (ks, zero for the padding keys past tk). */
static void pack_k8(const float *kb, int64_t k_st, int64_t tk, int64_t ldk, int32_t *k8, float *ks) {
    float mean[D] __attribute__((aligned(64))) = {0}, row[D] __attribute__((aligned(64)));
    for (int64_t t = 0; t < tk; t++)
        for (int d = 0; d < D; d++) mean[d] += kb[t * k_st + d];
    for (int d = 0; d < D; d++) mean[d] /= (float)tk;
    int8_t q[D];
    for (int64_t t = 0; t < tk; t++) {
        for (int d = 0; d < D; d++) row[d] = kb[t * k_st + d] - mean[d];
        quantize_row(row, D, q, ks + t);
        for (int g = 0; g < D / 4; g++) {
            uint32_t quad;
            memcpy(&quad, q + 4 * g, sizeof quad);
            k8[k8_at(t, g)] = (int32_t)(quad ^ 0x80808080u);  /* each byte q -> q + 128 */
        }
    }
    for (int64_t t = tk; t < ldk; t++) {
        ks[t] = 0.f;
        for (int g = 0; g < D / 4; g++) k8[k8_at(t, g)] = (int32_t)0x80808080u;
    }
}

/* Int8 P V (with the int8 scores). P = exp(s - max s) is in (0, 1]: per row and
 * block of KC keys, unsigned 8 bits scaled by the block's largest value (a block
 * far from the row's peak keeps its own resolution: one scale a row lost the
 * small weights whose sum is most of a flat row's mass; in the peak's own block
 * weights under 1/510 of it still round to 0); V in int8 per channel
 * (its scale over the job's keys). A row's sum of P is taken from the quantized
 * values, so its weights still sum to one. Values in quads of 4 keys, (ldk / 4,
 * D) int32, as vpdpbusd reads them: 4 keys' bytes for a lane (a channel).
 * Measured (tiny.en dims, 4 x 1500 positions, 6 heads, 2 threads): float32
 * 54-55 ms, int8 scores 38.9, with int8 P V 30.2-30.6, P quantized in the
 * softmax's pass 27.7-28.2 (AVX-512); on the AVX2 build with AVX-VNNI 99-105,
 * 71, 53, 51 ms. WER on the 32 shipped clips: tiny.en 0.1486 (float32 0.1655),
 * base 0.1250 (0.1318). */
static void pack_v8(const float *vb, int64_t v_st, int64_t tk, int64_t ldk, int32_t *v8, float *vs) {
    float amax[D] __attribute__((aligned(64))) = {0}, inv[D] __attribute__((aligned(64)));
    for (int64_t t = 0; t < tk; t++)
        for (int d = 0; d < D; d++) {
            const float a = fabsf(vb[t * v_st + d]);
            amax[d] = a > amax[d] ? a : amax[d];
        }
    for (int d = 0; d < D; d++) {
        vs[d] = amax[d] / 127.0f;
        inv[d] = amax[d] > 0.0f ? 127.0f / amax[d] : 0.0f;
    }
    /* a quad's 4 bytes from 4 keys' int32 lanes (|v * inv| <= 127: no clamp) */
    for (int64_t t4 = 0; t4 < ldk; t4 += 4)
        for (int d = 0; d < D; d += VM_VL) {
#if VM_VL == 16
            __m512i quad = _mm512_setzero_si512();
            for (int u = 0; u < 4 && t4 + u < tk; u++) {
                const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(vb + (t4 + u) * v_st + d),
                                                                   _mm512_load_ps(inv + d)));
                quad = _mm512_or_si512(quad, _mm512_slli_epi32(_mm512_and_si512(q, _mm512_set1_epi32(0xff)), 8 * u));
            }
            _mm512_storeu_si512((void *)(v8 + (t4 / 4) * D + d), quad);
#else
            __m256i quad = _mm256_setzero_si256();
            for (int u = 0; u < 4 && t4 + u < tk; u++) {
                const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(vb + (t4 + u) * v_st + d),
                                                                   _mm256_load_ps(inv + d)));
                quad = _mm256_or_si256(quad, _mm256_slli_epi32(_mm256_and_si256(q, _mm256_set1_epi32(0xff)), 8 * u));
            }
            _mm256_storeu_si256((__m256i *)(v8 + (t4 / 4) * D + d), quad);
#endif
        }
}

/* A score row s[0 .. tk) to its quantized P in one pass over the scores: with bm
 * each block's largest score and M the row's, p8[t] = round(255 exp(s[t] - bm))
 * (exp(s - M) scaled by its block's largest, exp(bm - M)) and ps[blk] =
 * exp(bm - M) / 255; bytes zero from tk to ldk. Returns the sum of the quantized
 * P. (Quantizing the float numerators afterwards took two more passes over the
 * row: 30% of the int8 attention's non-matmul time, on tiny.en's encoder.) */
static float softmax_p8_row(const float *s, int64_t tk, int64_t ldk, uint8_t *p8, float *ps) {
    const int64_t nb = (tk + KC - 1) / KC;
    float bm[nb], row_max = -INFINITY, sum = 0.0f;
    for (int64_t blk = 0; blk < nb; blk++) {
        const int64_t t0 = blk * KC, n = (t0 + KC < tk ? t0 + KC : tk) - t0;
        bm[blk] = vm_max_of(s + t0, n);
        row_max = bm[blk] > row_max ? bm[blk] : row_max;
    }
    for (int64_t blk = 0; blk < nb; blk++) {
        const int64_t t1 = (blk + 1) * KC < tk ? (blk + 1) * KC : tk;
        int64_t t = blk * KC, isum = 0;
        const vm_vec mv = VM_SET1(bm[blk]), s255 = VM_SET1(255.0f);
#if VM_VL == 16
        __m512i vsum = _mm512_setzero_si512();
        for (; t + 16 <= t1; t += 16) {
            const __m512i i32 = _mm512_cvtps_epi32(VM_MUL(vm_exp(VM_SUB(VM_LOAD(s + t), mv)), s255));
            vsum = _mm512_add_epi32(vsum, i32);
            _mm_storeu_si128((__m128i *)(p8 + t), _mm512_cvtusepi32_epi8(i32));
        }
        isum = _mm512_reduce_add_epi32(vsum);
#else
        __m256i vsum = _mm256_setzero_si256();
        for (; t + 8 <= t1; t += 8) {
            const __m256i i32 = _mm256_cvtps_epi32(VM_MUL(vm_exp(VM_SUB(VM_LOAD(s + t), mv)), s255));
            vsum = _mm256_add_epi32(vsum, i32);
            const __m128i i16 = _mm_packus_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
            _mm_storel_epi64((__m128i *)(p8 + t), _mm_packus_epi16(i16, i16));
        }
        int32_t lanes[8];
        _mm256_storeu_si256((__m256i *)lanes, vsum);
        for (int u = 0; u < 8; u++) isum += lanes[u];
#endif
        if (t < t1) {  /* the tail through one padded lane block, as the lanes do it */
            float tail[VM_VL] __attribute__((aligned(64)));
            for (int u = 0; u < VM_VL; u++) tail[u] = t + u < t1 ? s[t + u] - bm[blk] : -INFINITY;
            VM_STORE(tail, VM_MUL(vm_exp(VM_LOAD(tail)), s255));
            for (const int64_t first = t; t < t1; t++) {
                const long v = lrintf(tail[t - first]);
                p8[t] = (uint8_t)v;
                isum += v;
            }
        }
        ps[blk] = expf(bm[blk] - row_max) / 255.0f;
        sum += ps[blk] * (float)isum;
    }
    memset(p8 + tk, 0, (size_t)(ldk - tk));
    return sum;
}

/* o[i] = inv[i] * vs * sum_blk ps[i][blk] sum_t p8[i][t] v8[t] for i < rows, over
 * ldk keys (zero past tk); p8 rows ldp bytes apart, ps rows nb apart. */
static QK8_TARGET void pv8_rows(const uint8_t *p8, int64_t ldp, const float *ps, int64_t nb, const int32_t *v8,
                                const float *vs, int64_t ldk, const float *inv, int rows, float *o, int64_t ldo) {
#if defined(__AVX512F__) /* 6 rows x 64 channels: 24 accumulators, 4 value vectors, one broadcast */
    __m512 tot[R][4];
    for (int i = 0; i < R; i++)
        for (int j = 0; j < 4; j++) tot[i][j] = _mm512_setzero_ps();
    for (int64_t blk = 0; blk < nb; blk++) {
        const int64_t t1 = (blk + 1) * KC < ldk ? (blk + 1) * KC : ldk;
        __m512i acc[R][4];
        for (int i = 0; i < R; i++)
            for (int j = 0; j < 4; j++) acc[i][j] = _mm512_setzero_si512();
        for (int64_t t = blk * KC; t < t1; t += 4) {
            __m512i vq[4];
            for (int j = 0; j < 4; j++) vq[j] = _mm512_loadu_si512((const void *)(v8 + (t / 4) * D + 16 * j));
            for (int i = 0; i < R; i++) {
                int32_t quad;
                memcpy(&quad, p8 + i * ldp + t, sizeof quad);
                const __m512i pb = _mm512_set1_epi32(quad);
                for (int j = 0; j < 4; j++) DPBUSD(acc[i][j], pb, vq[j]);
            }
        }
        for (int i = 0; i < R; i++) {
            const __m512 w = _mm512_set1_ps(ps[i * nb + blk]);
            for (int j = 0; j < 4; j++) tot[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][j]), w, tot[i][j]);
        }
    }
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < 4; j++)
            _mm512_storeu_ps(o + i * ldo + 16 * j, _mm512_mul_ps(tot[i][j], _mm512_mul_ps(_mm512_loadu_ps(vs + 16 * j),
                                                                                      _mm512_set1_ps(inv[i]))));
#else /* pairs of rows x 32 channels: 8 accumulators, 4 value vectors, one broadcast */
    for (int i0 = 0; i0 < rows; i0 += 2)
        for (int c = 0; c < D; c += 32) {
            __m256 tot[2][4];
            for (int i = 0; i < 2; i++)
                for (int j = 0; j < 4; j++) tot[i][j] = _mm256_setzero_ps();
            for (int64_t blk = 0; blk < nb; blk++) {
                const int64_t t1 = (blk + 1) * KC < ldk ? (blk + 1) * KC : ldk;
                __m256i acc[2][4];
                for (int i = 0; i < 2; i++)
                    for (int j = 0; j < 4; j++) acc[i][j] = _mm256_setzero_si256();
                for (int64_t t = blk * KC; t < t1; t += 4) {
                    __m256i vq[4];
                    for (int j = 0; j < 4; j++)
                        vq[j] = _mm256_loadu_si256((const __m256i *)(v8 + (t / 4) * D + c + 8 * j));
                    for (int i = 0; i < 2; i++) {
                        int32_t quad;
                        memcpy(&quad, p8 + (i0 + i) * ldp + t, sizeof quad);
                        const __m256i pb = _mm256_set1_epi32(quad);
                        for (int j = 0; j < 4; j++) DPBUSD_VEX(acc[i][j], pb, vq[j]);
                    }
                }
                for (int i = 0; i < 2; i++) {
                    const __m256 w = _mm256_set1_ps(ps[(i0 + i) * nb + blk]);
                    for (int j = 0; j < 4; j++)
                        tot[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i][j]), w, tot[i][j]);
                }
            }
            for (int i = 0; i < 2 && i0 + i < rows; i++)
                for (int j = 0; j < 4; j++)
                    _mm256_storeu_ps(o + (i0 + i) * ldo + c + 8 * j,
                                     _mm256_mul_ps(tot[i][j], _mm256_mul_ps(_mm256_loadu_ps(vs + c + 8 * j),
                                                                            _mm256_set1_ps(inv[i0 + i]))));
        }
#endif
}

typedef struct {
    float *out;
    const float *q, *k, *v;
    int64_t B, H, tq, tk, q_sb, q_st, k_sb, k_st, v_sb, v_st, ldk;
    float scale;
    const float *bias;   /* (H, bias_stride) by offset, or NULL (the header) */
    int64_t bias_stride;
    float *buffers;      /* each thread's K^T, V, score rows and int8 parts, per_thread floats apart */
    int64_t per_thread;
    int int8;            /* int8 scores and P V (above) */
    team_t team;
} dense_job_t;

/* Job (b, h): pack its K^T and V, then every block of R query rows. i8: the int8
 * path's values (v8 quads, then their channel scales, the quantized P rows and
 * their block scales). */
static void dense_one(const dense_job_t *j, int64_t job, float *kt, float *vp, float *s, float *i8) {
    const float *q = j->q, *k = j->k, *v = j->v;
    float *out = j->out;
    const int64_t H = j->H, tq = j->tq, tk = j->tk, ldk = j->ldk, q_sb = j->q_sb, q_st = j->q_st;
    const int64_t k_sb = j->k_sb, k_st = j->k_st, v_sb = j->v_sb, v_st = j->v_st;
    const float scale = j->scale;
    float qs[R * D] __attribute__((aligned(64)));
    const int64_t b = job / H, h = job % H;
    const float *kb = k + b * k_sb + h * D, *vb = v + b * v_sb + h * D;
    /* int8: the packed keys' bytes, then their scales, in the K^T buffer */
    int32_t *k8 = (int32_t *)kt, *v8 = (int32_t *)i8;
    float *ks = kt + ldk * (D / 4), *vs = i8 + ldk * (D / 4), *ps = vs + D;
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
    float *kt = j->buffers + tid * j->per_thread, *vp = kt + D * j->ldk, *s = vp + j->tk * D;
    TEAM_PHASE(&j->team, 0, j->B * j->H, dense_one(j, i, kt, vp, s, s + R * j->ldk));
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
    /* K^T, V, the score rows (multiples of 16 floats: each part stays aligned), then
     * the int8 path's V, its channel scales, the P rows' block scales and bytes */
    const int64_t i8 = int8 ? (ldk * (D / 4) + D + R * ((tk + KC - 1) / KC) + R * ldk / 4 + 15) / 16 * 16 : 0;
    const int64_t per_thread = D * ldk + tk * D + R * ldk + i8;
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
