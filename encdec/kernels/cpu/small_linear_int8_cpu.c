/* x W^T + b for the few rows of a decode step with int8 weights
 * (quantization="int8"): small_linear_cpu.c's panel matmul, for the fused
 * decode step (decoder_step_cpu.c) and its tests.
 *
 * Why: a decode step of a few rows reads every decoder weight once, so its
 * matmuls take as long as the weights take to stream; int8 weights are a
 * quarter of the bytes. (The op-by-op int8 path, oneDNN's matmul per linear,
 * costs a parallel region and torch's dispatch per op: tiny.en decode steps
 * ran 1.8x slower that way than in the fused float32 step.)
 *
 * Layouts. The weight (N, K), int8 per output channel (Linear.quantize_int8),
 * in panels of PW = 32 columns, each a run of K4 = ceil(K / 4) quads:
 * wq[p][kq][c][0..4) = W[32 p + c][4 kq .. 4 kq + 4) (zero past K and N).
 * The input rows as unsigned bytes: xq[m][k] = q + 128, where q is the row's
 * symmetric int8 (int8_rows_cpu.c: scale max |x| / 127), 128 past K; with
 * comp[n] = 128 sum_k W[n][k] the exact product sum is acc - comp[n]:
 *
 *     y[m][n] = post((acc[m][n] - comp[n]) * rs[m] * ws[n] + b[n])
 *
 * the value the op-by-op path (torch._int_mm on the same int8, then
 * int8_rows_cpu.c's dequantize) gives, bit for bit.
 *
 * Paths: AVX-512 VNNI on the AVX-512 build, AVX-VNNI on the AVX2 build
 * (vpdpbusd: 4 byte products a lane, summed in int32, no saturation), each
 * compiled by a target attribute for the CPUs that have it (the caller checks
 * the CPU: small_linear_int8_cpu.vnni_available); plain C on the portable
 * build, for tests only (decoder_step_cpu.py keeps float32 decoder weights in
 * the step where VNNI is missing: the AVX2 path without VNNI saturates 16 bits).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "small_linear_cpu.c"
#include "int8_rows_cpu.c" /* quantize_row */

#if defined(__AVX512F__)
#define INT8_TARGET __attribute__((target("avx512vnni")))
const char *small_linear_int8_path(void) { return "avx512"; } /* with AVX512-VNNI */
#elif defined(__AVX2__)
#define INT8_TARGET __attribute__((target("avxvnni")))
const char *small_linear_int8_path(void) { return "avx2"; } /* with AVX-VNNI */
#else
#define INT8_TARGET
const char *small_linear_int8_path(void) { return "none"; }
#endif

/* One int8 linear as the kernels take it: packed weight, per-column scales
 * and 128 x column sums (both padded to whole panels). */
typedef struct {
    const int8_t *wq;
    const float *ws;
    const int32_t *comp;
} qlinear_t;

/* Bytes of one quantized input row: K padded to whole quads (xq's row stride). */
static inline int64_t quad_row_bytes(int64_t K) { return 4 * ((K + 3) / 4); }

/* Row x (K floats) -> xq (K4 * 4 bytes: q + 128, then 128) and its scale. */
static void quantize_row_u8(const float *x, int64_t K, uint8_t *xq, float *scale) {
    const int64_t K4 = (K + 3) / 4;
    quantize_row(x, K, (int8_t *)xq, scale);
    memset(xq + K, 0, (size_t)(4 * K4 - K));
    for (int64_t k = 0; k < 4 * K4; k++) xq[k] ^= 0x80; /* int8 q -> q + 128, as a byte */
}

#if defined(__AVX512F__)
/* tile_i8 for one row (a batch-1 decode step, every LM head call of one
 * sequence). Why: with one accumulator pair, each vpdpbusd waited for the
 * previous one's result (a chain of K/4 products a panel), and the weight
 * stream stalled behind it; 4 independent pairs, summed at the end (int32:
 * the same sums in any order). No software prefetch: the hardware's stream
 * prefetcher does better on this one contiguous stream. Measured with the
 * item size (panels_item) and the vectorized epilogue (panel_range_i8), on
 * the 2-core AVX512-VNNI host, 2 threads, a 17.5 MB and tiny.en's 19.9 MB
 * LM head read by turns (interleaved in one process, medians): one row
 * 1.39 -> 0.91 ms, 3 rows 1.86 -> 1.05. In tiny.en's sequential long-form run
 * (int8) the LM head went 0.83-0.85 -> 0.74 ms a step: there the step's other
 * traffic shares the memory bandwidth. */
static inline __attribute__((always_inline)) INT8_TARGET void tile_i8_row(int32_t tot[PW], const uint8_t *xq,
                                                                         const int8_t *wp, int64_t K4) {
    __m512i acc[4][2];
    for (int u = 0; u < 4; u++) acc[u][0] = acc[u][1] = _mm512_setzero_si512();
    int64_t kq = 0;
    for (; kq + 4 <= K4; kq += 4)
        for (int u = 0; u < 4; u++) {
            int32_t quad;
            memcpy(&quad, xq + 4 * (kq + u), sizeof quad);
            const __m512i xb = _mm512_set1_epi32(quad);
            const int8_t *w = wp + (kq + u) * 4 * PW;
            acc[u][0] = _mm512_dpbusd_epi32(acc[u][0], xb, _mm512_loadu_si512((const void *)w));
            acc[u][1] = _mm512_dpbusd_epi32(acc[u][1], xb, _mm512_loadu_si512((const void *)(w + 64)));
        }
    for (; kq < K4; kq++) {
        int32_t quad;
        memcpy(&quad, xq + 4 * kq, sizeof quad);
        const __m512i xb = _mm512_set1_epi32(quad);
        acc[0][0] = _mm512_dpbusd_epi32(acc[0][0], xb, _mm512_loadu_si512((const void *)(wp + kq * 4 * PW)));
        acc[0][1] = _mm512_dpbusd_epi32(acc[0][1], xb, _mm512_loadu_si512((const void *)(wp + kq * 4 * PW + 64)));
    }
    for (int j = 0; j < 2; j++)
        _mm512_storeu_si512((void *)(tot + 16 * j), _mm512_add_epi32(_mm512_add_epi32(acc[0][j], acc[1][j]),
                                                                     _mm512_add_epi32(acc[2][j], acc[3][j])));
}
#endif

/* tot[i][0..32) = sum_kq xq[i][4 kq ..] . wp[kq][c][..] for i < MR. */
static inline __attribute__((always_inline)) INT8_TARGET void tile_i8(const int MR, int32_t tot[][PW],
                                                                     const uint8_t *xq, int64_t ldq,
                                                                     const int8_t *wp, int64_t K4) {
#if defined(__AVX512F__)
    if (MR == 1) { /* one row: 4 quads at a time into 4 accumulator pairs (below) */
        tile_i8_row(tot[0], xq, wp, K4);
        return;
    }
    __m512i acc[MR_MAX][2];
    for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = _mm512_setzero_si512();
    for (int64_t kq = 0; kq < K4; kq++) {
        _mm_prefetch((const char *)(wp + (kq + 16) * 4 * PW), _MM_HINT_T0);
        _mm_prefetch((const char *)(wp + (kq + 16) * 4 * PW + 64), _MM_HINT_T0);
        const __m512i w0 = _mm512_loadu_si512((const void *)(wp + kq * 4 * PW));
        const __m512i w1 = _mm512_loadu_si512((const void *)(wp + kq * 4 * PW + 64));
        for (int i = 0; i < MR; i++) {
            int32_t quad;
            memcpy(&quad, xq + i * ldq + 4 * kq, sizeof quad);
            const __m512i xb = _mm512_set1_epi32(quad);
            acc[i][0] = _mm512_dpbusd_epi32(acc[i][0], xb, w0);
            acc[i][1] = _mm512_dpbusd_epi32(acc[i][1], xb, w1);
        }
    }
    for (int i = 0; i < MR; i++) {
        _mm512_storeu_si512((void *)tot[i], acc[i][0]);
        _mm512_storeu_si512((void *)(tot[i] + 16), acc[i][1]);
    }
#elif defined(__AVX2__)
    /* 12 accumulators, 3 broadcasts and one weight vector at a time: the 16 ymm
     * registers (small_linear_cpu.c's AVX2 tile) */
    __m256i acc[MR_MAX][4];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < 4; j++) acc[i][j] = _mm256_setzero_si256();
    for (int64_t kq = 0; kq < K4; kq++) {
        _mm_prefetch((const char *)(wp + (kq + 16) * 4 * PW), _MM_HINT_T0);
        _mm_prefetch((const char *)(wp + (kq + 16) * 4 * PW + 64), _MM_HINT_T0);
        __m256i xb[MR_MAX];
        for (int i = 0; i < MR; i++) {
            int32_t quad;
            memcpy(&quad, xq + i * ldq + 4 * kq, sizeof quad);
            xb[i] = _mm256_set1_epi32(quad);
        }
        for (int j = 0; j < 4; j++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(wp + kq * 4 * PW + 32 * j));
            for (int i = 0; i < MR; i++) acc[i][j] = _mm256_dpbusd_avx_epi32(acc[i][j], xb[i], w);
        }
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < 4; j++) _mm256_storeu_si256((__m256i *)(tot[i] + 8 * j), acc[i][j]);
#else
    for (int i = 0; i < MR; i++) {
        for (int c = 0; c < PW; c++) tot[i][c] = 0;
        for (int64_t kq = 0; kq < K4; kq++)
            for (int c = 0; c < PW; c++)
                for (int u = 0; u < 4; u++)
                    tot[i][c] += (int32_t)xq[i * ldq + 4 * kq + u] * (int32_t)wp[(kq * PW + c) * 4 + u];
    }
#endif
}

/* Panels [p0, p1) of y = post(dequantized xq W^T + b), y (M, N) with row stride ldy. */
static INT8_TARGET void panel_range_i8(float *y, int64_t ldy, const uint8_t *xq, int64_t ldq, const float *rs,
                                       const qlinear_t *w, const float *b, int64_t M, int64_t K, int64_t N,
                                       int64_t p0, int64_t p1, int post) {
    int32_t acc[MR_MAX][PW] __attribute__((aligned(64)));
    float tot[MR_MAX][PW] __attribute__((aligned(64)));
    const int64_t K4 = (K + 3) / 4;
    for (int64_t p = p0; p < p1; p++) {
        const int8_t *wp = w->wq + p * K4 * 4 * PW;
        const int64_t n0 = p * PW;
        const int cols = (int)(N - n0 < PW ? N - n0 : PW);
        for (int64_t m0 = 0; m0 < M; m0 += MR_MAX) {
            const int rows = (int)(M - m0 < MR_MAX ? M - m0 : MR_MAX);
            const uint8_t *xr = xq + m0 * ldq;
#define TILE_I8(MR) tile_i8(MR, acc, xr, ldq, wp, K4)
            SWITCH_ROWS(rows, TILE_I8);
#undef TILE_I8
            /* The bias in one fused multiply-add, as int8_rows_cpu.c's dequantize
             * does: the same value as the op-by-op path, bit for bit. */
#if defined(__AVX512F__)
            /* The same floats 16 lanes at a time (a scalar loop here was ~15% of a one-row
             * LM head); lanes past N get a zero bias (fmaf(a, s, 0) is a * s) and are not written. */
            for (int i = 0; i < rows; i++)
                for (int c = 0; c < PW; c += 16) {
                    const __m512i diff = _mm512_sub_epi32(_mm512_load_si512((const void *)(acc[i] + c)),
                                                          _mm512_loadu_si512((const void *)(w->comp + n0 + c)));
                    const __m512 a = _mm512_cvtepi32_ps(diff);
                    const __m512 sc = _mm512_mul_ps(_mm512_set1_ps(rs[m0 + i]), _mm512_loadu_ps(w->ws + n0 + c));
                    const __mmask16 live = cols - c >= 16 ? 0xffff : cols <= c ? 0 : (__mmask16)((1u << (cols - c)) - 1);
                    _mm512_store_ps(tot[i] + c, b ? _mm512_fmadd_ps(a, sc, _mm512_maskz_loadu_ps(live, b + n0 + c))
                                                  : _mm512_mul_ps(a, sc));
                }
#else
            for (int i = 0; i < rows; i++)
                for (int c = 0; c < PW; c++) {
                    const float a = (float)(acc[i][c] - w->comp[n0 + c]), s = rs[m0 + i] * w->ws[n0 + c];
                    tot[i][c] = b && c < cols ? fmaf(a, s, b[n0 + c]) : a * s;
                }
#endif
            write_tile(tot, rows, cols, y + m0 * ldy + n0, ldy, NULL, post);
        }
    }
}

/* Item i (matmul_items(N) of them) of y = post(x W^T + b) from the quantized rows. */
static INT8_TARGET void matmul_item_i8(int64_t i, float *y, int64_t ldy, const uint8_t *xq, int64_t ldq,
                                       const float *rs, const qlinear_t *w, const float *b, int64_t M, int64_t K,
                                       int64_t N, int post) {
    int64_t p0, p1;
    item_panels(i, N, &p0, &p1);
    panel_range_i8(y, ldy, xq, ldq, rs, w, b, M, K, N, p0, p1, post);
}

/* A test entry point's job: each row of x quantized, then the matmul's items
 * (item: the int8 or int4 panels' kernel, on w). */
typedef struct rows_job rows_job_t;
struct rows_job {
    float *y;
    const float *x, *b;
    const void *w;
    uint8_t *xq;
    float *rs;
    int64_t M, K, N;
    int post;
    void (*item)(const rows_job_t *j, int64_t i, int64_t ldq);
    team_t team;
};

static void rows_job(void *arg, int tid) {
    rows_job_t *j = arg;
    const int64_t ldq = quad_row_bytes(j->K);
    (void)tid;
    TEAM_PHASE(&j->team, 0, j->M, quantize_row_u8(j->x + i * j->K, j->K, j->xq + i * ldq, j->rs + i));
    TEAM_PHASE(&j->team, 1, matmul_items(j->N), j->item(j, i, ldq));
}

/* Runs *job (its y, x, b, w, M, K, N, post and item set) on num_threads;
 * work: M * (K4 * 4) bytes, then M floats. */
static void run_linear(rows_job_t *job, void *work, int num_threads) {
    atomic_int counters[6] = {0};  /* next and done of phases 0, 1 and the end (team.h) */
    job->xq = work;
    job->rs = (float *)(job->xq + job->M * quad_row_bytes(job->K));
    job->team = (team_t){0, 0, counters, counters + 3};
    team_run(rows_job, job, num_threads);
}

static void linear_i8_item(const rows_job_t *j, int64_t i, int64_t ldq) {
    matmul_item_i8(i, j->y, j->N, j->xq, ldq, j->rs, j->w, j->b, j->M, j->K, j->N, j->post);
}

/* Entry point (tests): y (M, N) = post(x (M, K) W^T + b) with W packed as above;
 * work: M * (K4 * 4) bytes, then M floats. */
void small_linear_int8(float *y, const float *x, const int8_t *wq, const float *ws, const int32_t *comp,
                       const float *b, int64_t M, int64_t K, int64_t N, int post, void *work, int num_threads) {
    const qlinear_t w = {wq, ws, comp};
    rows_job_t job = {.y = y, .x = x, .b = b, .w = &w, .M = M, .K = K, .N = N, .post = post,
                        .item = linear_i8_item};
    run_linear(&job, work, num_threads);
}

#include "small_linear_int4.h" /* a 4-bit copy of these panels: a draft head's screening pass */
