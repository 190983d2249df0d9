/* y = x W^T + b on CPU, float32, for the few rows of a decode step.
 *
 * x: (M, K), W: (N, K) (nn.Linear's own layout, no packing), b: (N,) or NULL,
 * y: (M, N), all contiguous. A decode step is bound by reading the weights
 * from memory, and oneDNN's packed matmul reads them well below a plain
 * streaming read: Whisper tiny's 24 decoder linears, after the LM head has
 * flushed the cache, 1 thread, AMD EPYC: oneDNN 3.4 ms at 1 row, 4.0 at 8;
 * a streaming read of the same weights 1.2-1.5 ms; this kernel 2.2 and 3.7.
 * The weight rows are streamed once per step, in order (interleaving four
 * rows' streams ran at half the rate), each multiplied with the input rows
 * four at a time (the row stays in L1 for the next four); the four sums share
 * one horizontal add tree.
 *
 * Paths by the build's ISA (build.py compiles this once per ISA): AVX-512
 * (16 lanes), AVX2+FMA (8 lanes), and plain C for "none"
 * (``small_linear_path`` says which). Each output's sum runs in VL lanes over
 * k, then one fixed reduction: deterministic, equal to F.linear to float32
 * rounding.
 */
#include <stdint.h>
#include <stddef.h>

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define VL 16
typedef __m512 vec;
#define VLOAD(p) _mm512_loadu_ps(p)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VZERO() _mm512_setzero_ps()
#define VADD(a, b) _mm512_add_ps(a, b)
static inline __m128 to128(__m512 a) {
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VL 8
typedef __m256 vec;
#define VLOAD(p) _mm256_loadu_ps(p)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VZERO() _mm256_setzero_ps()
#define VADD(a, b) _mm256_add_ps(a, b)
static inline __m128 to128(__m256 a) {
    return _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
}
#endif

/* Input rows per pass over a weight row (the row stays in L1 for the next
 * pass). 8 was slower at 8 rows (4.9 against 3.7 ms, the linears above). */
#define MB 4

const char *small_linear_path(void) {
#ifdef VL
    return VL == 16 ? "avx512" : "avx2";
#else
    return "none";
#endif
}

/* One output, any K (tails and the portable path): VL-lane partial sums, then k's tail. */
static float dot(const float *a, const float *b, int64_t K) {
    float acc[16] = {0};
    int64_t k = 0;
    for (; k + 16 <= K; k += 16)
        for (int j = 0; j < 16; j++) acc[j] += a[k + j] * b[k + j];
    float s = 0.f;
    for (int j = 0; j < 16; j++) s += acc[j];
    for (; k < K; k++) s += a[k] * b[k];
    return s;
}

static void rows_generic(float *y, const float *x, const float *w, const float *b,
                         int64_t M, int64_t K, int64_t N, int64_t n) {
    for (int64_t m = 0; m < M; m++)
        y[m * N + n] = dot(x + m * K, w + n * K, K) + (b ? b[n] : 0.f);
}

#ifdef VL
/* Weight row n times input rows m0..m0+MR-1, K a multiple of VL. Inlined with
 * a constant MR, so the accumulators live in registers. */
static inline __attribute__((always_inline)) void row(
    const int MR, float *y, const float *x, const float *w, const float *b,
    int64_t K, int64_t N, int64_t n, int64_t m0) {
    vec acc[MB];
    for (int j = 0; j < MB; j++) acc[j] = VZERO();
    const float *wr = w + n * K, *xr = x + m0 * K;
    int64_t k = 0;
    if (MR == 1) {  /* one row: two chains, or the FMA latency bounds the read rate */
        vec odd = VZERO();
        for (; k + 2 * VL <= K; k += 2 * VL) {
            acc[0] = VFMA(VLOAD(wr + k), VLOAD(xr + k), acc[0]);
            odd = VFMA(VLOAD(wr + k + VL), VLOAD(xr + k + VL), odd);
        }
        acc[0] = VADD(acc[0], odd);
    }
    for (; k < K; k += VL) {
        vec wv = VLOAD(wr + k);
        for (int j = 0; j < MR; j++) acc[j] = VFMA(wv, VLOAD(xr + j * K + k), acc[j]);
    }
    __m128 h01 = _mm_hadd_ps(to128(acc[0]), to128(acc[1]));
    __m128 h23 = _mm_hadd_ps(to128(acc[2]), to128(acc[3]));
    float s[4];
    _mm_storeu_ps(s, _mm_hadd_ps(h01, h23));  /* the sums of rows m0..m0+3 */
    const float bias = b ? b[n] : 0.f;
    for (int j = 0; j < MR; j++) y[(m0 + j) * N + n] = s[j] + bias;
}
#endif

void small_linear_f32(float *y, const float *x, const float *w, const float *b,
                      int64_t M, int64_t K, int64_t N, int num_threads) {
#pragma omp parallel for if (num_threads > 1) num_threads(num_threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
#ifdef VL
        if (K % VL == 0) {
            int64_t m0 = 0;
            for (; m0 + MB <= M; m0 += MB) row(MB, y, x, w, b, K, N, n, m0);
            switch (M - m0) {
            case 3: row(3, y, x, w, b, K, N, n, m0); break;
            case 2: row(2, y, x, w, b, K, N, n, m0); break;
            case 1: row(1, y, x, w, b, K, N, n, m0); break;
            default: break;
            }
            continue;
        }
#endif
        rows_generic(y, x, w, b, M, K, N, n);
    }
}
