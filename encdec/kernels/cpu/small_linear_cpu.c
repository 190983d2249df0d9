/* y = x W^T + b on CPU, float32, for the few rows of a decode step, from a
 * weight packed in column panels.
 *
 * A decode step reads every decoder weight once and multiplies it with a few
 * rows, so it is bound by the weight's memory read, and by the FMAs only from
 * about 8 rows on. The weight (N, K) is packed once into panels of 32 output
 * columns, (ceil(N / 32), K, 32), zero-padded: a panel is one contiguous
 * stream, and each of its k rows is 32 lanes of outputs, multiplied with one
 * broadcast input value per row of x. A register tile of MR rows x 32 columns
 * (AVX-512: 8 x 2 zmm; AVX2+FMA: 3 x 4 ymm) runs down the whole panel; more
 * rows take another tile over the same panel, which is in L2 by then. No
 * horizontal sums (the old kernel took a dot product per output and spent a
 * quarter of its time in them). Threads take the panels a few at a time
 * (panels_item), so both cores stream the weight, each as fast as its core
 * lets it: one core reads ~26 GB/s here, two ~32.
 *
 * Measured (AMD EPYC Zen 4, AVX-512, 2 threads, the weight flushed from the
 * cache, medians; the old kernel took a dot product per output, four input rows
 * per weight row, and ran the decoder's matmuls on one thread): Whisper tiny's
 * LM head (51865 x 384) at 8 rows 3.78 -> 2.19 ms, at 1 row 2.99 -> 2.2-2.8 ms;
 * base's (51865 x 512) at 8 rows 4.20 -> 3.18 ms; tiny's fc2 (384 x 1536) at
 * 8 rows on one thread 0.33 -> 0.16 ms.
 *
 * Sums: each output sums its K products in order, KC at a time in registers,
 * each block's partial then added to the running total (a GEMM's k blocks).
 * Against float64, KC = 16 errs at most 0.7x F.linear (MKL) for K >= 384 and
 * 2.7x for K <= 100; 128 erred 1.5x and 4.8x, and put a tiny BART's prompt
 * log-probs 1.1e-4 from float64 (HF 1.2e-5; the old kernel 7e-5, now 3.5e-5). Paths by the build's ISA (build.py
 * compiles this once per ISA; ``small_linear_path`` says which): AVX-512,
 * AVX2+FMA, and plain C for "none".
 *
 * Post-ops, applied to a panel's outputs as they are written: none, exact GELU
 * (vector_math.h's vm_gelu), or adding into y (a residual stream).
 */
#include <stdatomic.h>
#include <stdint.h>
#include <stddef.h>
#include <string.h>
#include <math.h>
#include "team.h"
#include "vector_math.h"

#define PW 32   /* columns per panel */
#define KC 16  /* k steps summed in registers before joining the total */
/* Panel rows fetched ahead of the tile (32 rows = 4 KiB): with several rows of x
 * the FMAs between loads hide the stream from the hardware prefetcher, which then
 * falls behind. Measured (Intel Xeon, family 6 model 207, 2 threads, 300 MB of
 * M2M100-sized weights streamed once): AVX-512 at 8 rows 16.4 -> 22.5 GB/s, at 16
 * rows 13.1 -> 17.0, at 1 row unchanged (27 GB/s); AVX2+FMA at 8 rows 11.6 ->
 * 13.9, 16 rows 8.3 -> 9.4, 1 row 20.6 -> 23.0. 8 and 16 rows ahead gained less. */
#define PF_ROWS 32
#define PREFETCH_ROW(wp, k) do { \
        _mm_prefetch((const char *)((wp) + ((k) + PF_ROWS) * PW), _MM_HINT_T0); \
        _mm_prefetch((const char *)((wp) + ((k) + PF_ROWS) * PW + 16), _MM_HINT_T0); \
    } while (0)

/* What write_tile does with a tile: store it, its exact GELU, add it to y, or its
 * ReLU (max(0, v): NaN stays NaN, as torch.relu keeps it). */
enum { POST_NONE = 0, POST_GELU = 1, POST_ADD = 2, POST_RELU = 3 };

#if defined(__AVX512F__)
#define MR_MAX 8
#elif defined(__AVX2__) && defined(__FMA__)
#define MR_MAX 3
#else
#define MR_MAX 4
#endif

const char *small_linear_path(void) { return VM_PATH; }

/* CALL(MR) with MR = rows (1 .. MR_MAX), a constant per case: the tile's
 * accumulators then stay in registers. */
#if MR_MAX >= 8
#define ROWS_8_TO_5(CALL) case 8: CALL(8); break; case 7: CALL(7); break; case 6: CALL(6); break; \
    case 5: CALL(5); break;
#else
#define ROWS_8_TO_5(CALL)
#endif
#if MR_MAX >= 4
#define ROWS_4(CALL) case 4: CALL(4); break;
#else
#define ROWS_4(CALL)
#endif
#define SWITCH_ROWS(rows, CALL) \
    switch (rows) { ROWS_8_TO_5(CALL) ROWS_4(CALL) case 3: CALL(3); break; case 2: CALL(2); break; \
                    default: CALL(1); break; }

/* tot[i][0..32) = sum_k x[i][k] wp[k][0..32) for i < MR. next (or NULL):
 * rows [f0, f1) of a panel to fetch into L2 meanwhile, spread over the k
 * steps (see panel_range). */
static inline __attribute__((always_inline)) void tile(const int MR, float tot[][PW], const float *x,
                                                       int64_t ldx, const float *wp, int64_t K,
                                                       const float *next, int64_t f0, int64_t f1) {
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t k1 = k0 + KC < K ? k0 + KC : K;
        if (next)
            for (int64_t r = f0 + k0 * (f1 - f0) / K; r < f0 + k1 * (f1 - f0) / K; r++) {
                __builtin_prefetch(next + r * PW, 0, 2);  /* 2: to L2 (T1) */
                __builtin_prefetch(next + r * PW + 16, 0, 2);
            }
#if defined(__AVX512F__)
        __m512 acc[MR_MAX][2];
        for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
        int64_t k = k0;
        if (MR == 1) {  /* one row: odd k on a second pair, or the FMA latency bounds the read */
            __m512 odd0 = _mm512_setzero_ps(), odd1 = odd0;
            for (; k + 2 <= k1; k += 2) {
                const __m512 xa = _mm512_set1_ps(x[k]), xb = _mm512_set1_ps(x[k + 1]);
                acc[0][0] = _mm512_fmadd_ps(xa, _mm512_loadu_ps(wp + k * PW), acc[0][0]);
                acc[0][1] = _mm512_fmadd_ps(xa, _mm512_loadu_ps(wp + k * PW + 16), acc[0][1]);
                odd0 = _mm512_fmadd_ps(xb, _mm512_loadu_ps(wp + (k + 1) * PW), odd0);
                odd1 = _mm512_fmadd_ps(xb, _mm512_loadu_ps(wp + (k + 1) * PW + 16), odd1);
            }
            acc[0][0] = _mm512_add_ps(acc[0][0], odd0);
            acc[0][1] = _mm512_add_ps(acc[0][1], odd1);
        }
        for (; k < k1; k++) {
            PREFETCH_ROW(wp, k);
            const __m512 w0 = _mm512_loadu_ps(wp + k * PW), w1 = _mm512_loadu_ps(wp + k * PW + 16);
            for (int i = 0; i < MR; i++) {
                const __m512 xb = _mm512_set1_ps(x[i * ldx + k]);
                acc[i][0] = _mm512_fmadd_ps(xb, w0, acc[i][0]);
                acc[i][1] = _mm512_fmadd_ps(xb, w1, acc[i][1]);
            }
        }
        for (int i = 0; i < MR; i++)
            for (int j = 0; j < 2; j++) {
                float *t = tot[i] + 16 * j;
                _mm512_storeu_ps(t, k0 ? _mm512_add_ps(_mm512_loadu_ps(t), acc[i][j]) : acc[i][j]);
            }
#elif defined(__AVX2__) && defined(__FMA__)
        __m256 acc[MR_MAX][4];
        for (int i = 0; i < MR; i++)
            for (int j = 0; j < 4; j++) acc[i][j] = _mm256_setzero_ps();
        for (int64_t k = k0; k < k1; k++) {
            PREFETCH_ROW(wp, k);
            /* 12 accumulators, 3 broadcasts and one weight vector at a time: the 16
             * ymm registers exactly (all four weight vectors at once spilled one) */
            __m256 xb[MR_MAX];
            for (int i = 0; i < MR; i++) xb[i] = _mm256_broadcast_ss(x + i * ldx + k);
            for (int j = 0; j < 4; j++) {
                const __m256 w = _mm256_loadu_ps(wp + k * PW + 8 * j);
                for (int i = 0; i < MR; i++) acc[i][j] = _mm256_fmadd_ps(xb[i], w, acc[i][j]);
            }
        }
        for (int i = 0; i < MR; i++)
            for (int j = 0; j < 4; j++) {
                float *t = tot[i] + 8 * j;
                _mm256_storeu_ps(t, k0 ? _mm256_add_ps(_mm256_loadu_ps(t), acc[i][j]) : acc[i][j]);
            }
#else
        float acc[MR_MAX][PW];
        memset(acc, 0, sizeof(acc));
        for (int64_t k = k0; k < k1; k++)
            for (int i = 0; i < MR; i++) {
                const float xv = x[i * ldx + k];
                for (int j = 0; j < PW; j++) acc[i][j] += xv * wp[k * PW + j];
            }
        for (int i = 0; i < MR; i++)
            for (int j = 0; j < PW; j++) tot[i][j] = k0 ? tot[i][j] + acc[i][j] : acc[i][j];
#endif
    }
}

/* y[i][n0 + j] (post-op) tot[i][j] + b[n0 + j] for i < rows, j < cols. */
static void write_tile(float tot[][PW], int rows, int cols, float *y, int64_t ldy, const float *b, int post) {
    float bias[PW];
    for (int j = 0; j < PW; j++) bias[j] = b && j < cols ? b[j] : 0.f;
    for (int i = 0; i < rows; i++) {
        float *t = tot[i], *yr = y + i * ldy;
#if defined(VM_VL)
        for (int j = 0; j < PW; j += VM_VL) {
            vm_vec v = VM_ADD(VM_LOAD(t + j), VM_LOAD(bias + j));
            VM_STORE(t + j, post == POST_GELU ? vm_gelu(v) : post == POST_RELU ? VM_MAX(VM_ZERO(), v) : v);
        }
#else
        for (int j = 0; j < PW; j++) {
            t[j] += bias[j];
            if (post == POST_GELU) t[j] = 0.5f * t[j] * (1.0f + erff(t[j] * (float)M_SQRT1_2));
            else if (post == POST_RELU && t[j] < 0.f) t[j] = 0.f;
        }
#endif
        if (post == POST_ADD)
            for (int j = 0; j < cols; j++) yr[j] += t[j];
        else
            memcpy(yr, t, sizeof(float) * (size_t)cols);
    }
}

/* Panels [p0, p1) of y = post(x W^T + b): x (M, K) with row stride ldx, wp
 * the packed weight, y (M, N) with row stride ldy. A thread's share of a call. */
static void panel_range(float *y, int64_t ldy, const float *x, int64_t ldx, const float *wp, const float *b,
                        int64_t M, int64_t K, int64_t N, int64_t p0, int64_t p1, int post) {
    float tot[MR_MAX][PW] __attribute__((aligned(64)));
    for (int64_t p = p0; p < p1; p++) {
        const float *w = wp + p * K * PW;
        const int64_t n0 = p * PW;
        const int cols = (int)(N - n0 < PW ? N - n0 : PW);
        for (int64_t m0 = 0; m0 < M; m0 += MR_MAX) {
            const int rows = (int)(M - m0 < MR_MAX ? M - m0 : MR_MAX);
            const float *xr = x + m0 * ldx;
            /* The first tile streams the panel from memory, the later ones find it
             * in L2 and are bound by their FMAs: they fetch the next panel
             * meanwhile, a share each, so the next first tile finds it in L2 too
             * and the stream overlaps the FMAs. Measured (Xeon family 6 model 207,
             * 2 threads, weights cold, old and new builds alternating): M2M100's
             * LM head (128112 x 1024) at 37 rows 46.1 -> 39.8 ms, at 64 rows
             * 69.7 -> 59.8 ms; 4096 x 1024 at 37 rows 1.49 -> 1.25 ms. With one
             * later tile (9-16 rows) it would fetch a whole panel in one tile's
             * time; prefetching there measured 0.95-1.02x at 12 and 16 rows, no
             * gain: none then. */
            const int64_t later = (M - 1) / MR_MAX, j = m0 / MR_MAX;  /* tiles after the first; this one */
            const float *next = later >= 2 && j > 0 && p + 1 < p1 ? w + K * PW : NULL;
            const int64_t f0 = next ? (j - 1) * K / later : 0, f1 = next ? j * K / later : 0;
#define TILE_F32(MR) tile(MR, tot, xr, ldx, w, K, next, f0, f1)
            SWITCH_ROWS(rows, TILE_F32);
#undef TILE_F32
            write_tile(tot, rows, cols, y + m0 * ldy + n0, ldy, b ? b + n0 : NULL, post);
        }
    }
}

/* Column panels per work item of a matmul of P panels: about 16 items (the
 * decoder's matmuls: 2-10 us each at decode sizes; an LM head of 1621 panels:
 * 101 panels each): fine enough that a thread on a free core takes over the
 * share of one that lost its core, coarse enough that taking an item (one
 * atomic add) costs nothing, and long enough that each thread streams its
 * weights in long runs. (Items were at most 8 panels: an int8 LM head of 203
 * items of 96 KB ran ~15% slower at one row, the hardware prefetcher starting
 * over at each jump between items; a float32 head ran the same either way.)
 * Every panel's values are the same whichever thread computes it. */
static int64_t panels_item(int64_t P) { return P / 16 < 1 ? 1 : P / 16; }

static int64_t matmul_items(int64_t N) {
    const int64_t P = (N + PW - 1) / PW;
    return (P + panels_item(P) - 1) / panels_item(P);
}

/* Item i's panels [*p0, *p1) of a matmul of N columns (matmul_items(N) items). */
static inline void item_panels(int64_t i, int64_t N, int64_t *p0, int64_t *p1) {
    const int64_t P = (N + PW - 1) / PW, per = panels_item(P);
    *p0 = i * per;
    *p1 = *p0 + per < P ? *p0 + per : P;
}

/* Item i of y = post(x W^T + b), y (M, N) with row stride ldy, x (M, K) with
 * row stride ldx: its panels. */
static void matmul_item(int64_t i, float *y, int64_t ldy, const float *x, int64_t ldx, const float *wp,
                        const float *b, int64_t M, int64_t K, int64_t N, int post) {
    int64_t p0, p1;
    item_panels(i, N, &p0, &p1);
    panel_range(y, ldy, x, ldx, wp, b, M, K, N, p0, p1, post);
}

typedef struct {
    float *y;
    const float *x, *wp, *b;
    int64_t M, K, N;
    int post;
    team_t team;
} linear_job_t;

static void linear_job(void *arg, int tid) {
    linear_job_t *j = arg;
    (void)tid;
    TEAM_PHASE(&j->team, 0, matmul_items(j->N), matmul_item(i, j->y, j->N, j->x, j->K, j->wp, j->b, j->M, j->K, j->N,
                                                           j->post));
}

/* Entry point: y (M, N) = post(x (M, K) W^T + b) on up to num_threads threads
 * (team.h), each taking the next item while any is left. */
void small_linear_f32(float *y, const float *x, const float *wp, const float *b,
                      int64_t M, int64_t K, int64_t N, int post, int num_threads) {
    atomic_int counters[2] = {0, 0};
    linear_job_t job = {y, x, wp, b, M, K, N, post, {0, 0, counters, counters + 1}};
    team_run(linear_job, &job, num_threads);
}
