/* A 4-bit copy of an int8 panel weight (small_linear_int8_cpu.c includes
 * this at its end): the first, screening pass of a CPU draft's two-stage LM
 * head (draft_step.h), which then scores its best candidates exactly from the
 * int8 panels.
 *
 * Why: a draft step streams its bytes, and Whisper base's int8 head (51865 x
 * 512, 26.5 MB) was its largest stream (~1.0 ms of ~3.3 ms); 4 bits a weight
 * halve it. Only the argmax matters, and the int8 scores of a few candidates
 * are cheap.
 *
 * Layout: the int8 one's panels (PW = 32 columns, K4 = ceil(K / 4) quads),
 * 64 bytes a quad instead of 128: byte j's low nibble holds the int8 quad's
 * byte j, its high nibble byte j + 64 (columns 0-15 low, 16-31 high), each as
 * q4 + 8, q4 = round(q8 * 7 / max |q8| of its column) in [-7, 7]; the column's
 * scale ws4 = ws8 * max |q8| / 7 (small_linear_int4.py: from_int8). The
 * input rows are the int8 kernel's (xq = q + 128); vpdpbusd takes the nibbles
 * as its unsigned operand and q (xq ^ 0x80) as its signed one, so
 *
 *     y[m][n] = (sum_k q[m][k] (q4[n][k] + 8) - 8 sum_k q[m][k]) rs[m] ws4[n] + b[n]
 *
 * (int32 sums, exact in any order: every path gives the same value).
 */

/* An int4 linear as the kernels take it: packed nibbles and per-column scales (padded to whole panels). */
typedef struct {
    const uint8_t *wq;
    const float *ws;
} q4linear_t;

/* q8's int4 value at step: clamp(nearbyint(q8 / step), -7, 7). */
static inline int int4_of(int8_t q8, float step) {
    const float q = nearbyintf((float)q8 / step);
    return (int)(q < -7 ? -7 : q > 7 ? 7 : q);
}

/* sum (q4 step - q8)^2 over a column of the int8 panels. */
static float int4_error(const int8_t *col, int64_t K4, float step) {
    float err = 0;
    for (int64_t kq = 0; kq < K4; kq++)
        for (int u = 0; u < 4; u++) {
            const float e = (float)int4_of(col[kq * 4 * PW + u], step) * step - (float)col[kq * 4 * PW + u];
            err += e * e;
        }
    return err;
}

/* Entry point (small_linear_int4.from_int8): the int4 copy of an int8
 * panel weight wq8 (panels, K4, 32, 4) with column scales ws8, into wq4
 * (panels, K4, 64), zeroed by the caller, and ws4: per column, for each of
 * the n_clips fractions c, step = max(max |q8|, 1) * (c / 7) and q4 =
 * clamp(nearbyint(q8 / step), -7, 7) (half to even), the first of least
 * squared error sum (q4 step - q8)^2 kept, and ws4 = ws8 * step. In C: the
 * same in torch took 2 s for Whisper base's head (a draft's load). */
void int4_from_int8(uint8_t *wq4, float *ws4, const int8_t *wq8, const float *ws8, int64_t panels, int64_t K4,
                    const float *clips, int n_clips) {
    for (int64_t p = 0; p < panels; p++)
        for (int c = 0; c < PW; c++) {
            const int8_t *col = wq8 + p * K4 * 4 * PW + 4 * c; /* value (kq, u) at col[kq * 4 PW + u] */
            float peak = 1;
            for (int64_t kq = 0; kq < K4; kq++)
                for (int u = 0; u < 4; u++) peak = fmaxf(peak, fabsf((float)col[kq * 4 * PW + u]));
            float best = INFINITY, best_step = 0;
            for (int t = 0; t < n_clips; t++) {
                const float step = peak * (clips[t] / 7), err = int4_error(col, K4, step);
                if (err < best) {
                    best = err;
                    best_step = step;
                }
            }
            for (int64_t kq = 0; kq < K4; kq++)
                for (int u = 0; u < 4; u++) {
                    const int b = 4 * c + u;
                    const uint8_t nib = (uint8_t)(int4_of(col[kq * 4 * PW + u], best_step) + 8);
                    wq4[(p * K4 + kq) * 2 * PW + (b & 63)] |= (uint8_t)(b < 64 ? nib : nib << 4);
                }
            ws4[p * PW + c] = ws8[p * PW + c] * best_step;
        }
}

/* 8 sum_k q[k] of a quantized row (xq: q + 128, 128 past K). */
static int32_t row_sum8_i4(const uint8_t *xq, int64_t K4) {
    int32_t sum = 0;
    for (int64_t k = 0; k < 4 * K4; k++) sum += (int32_t)xq[k] - 128;
    return 8 * sum;
}

/* tot[i][0..32) = sum_kq q[i][4 kq ..] . nibbles[kq][c][..] for i < MR (before the -8 sum q correction). */
static inline __attribute__((always_inline)) INT8_TARGET void tile_i4(const int MR, int32_t tot[][PW],
                                                                     const uint8_t *xq, int64_t ldq,
                                                                     const uint8_t *wp, int64_t K4) {
#if defined(__AVX512F__)
    const __m512i lo = _mm512_set1_epi8(0x0f);
    if (MR == 1) { /* one row: 4 independent accumulator pairs, as tile_i8_row (its comment) */
        __m512i acc[4][2];
        for (int u = 0; u < 4; u++) acc[u][0] = acc[u][1] = _mm512_setzero_si512();
        int64_t kq = 0;
#define I4_QUAD(U, KQ)                                                                                   \
    do {                                                                                                 \
        int32_t quad;                                                                                    \
        memcpy(&quad, xq + 4 * (KQ), sizeof quad);                                                       \
        const __m512i xb = _mm512_set1_epi32(quad ^ (int32_t)0x80808080);                                \
        const __m512i v = _mm512_loadu_si512((const void *)(wp + (KQ) * 2 * PW));                        \
        acc[U][0] = _mm512_dpbusd_epi32(acc[U][0], _mm512_and_si512(v, lo), xb);                         \
        acc[U][1] = _mm512_dpbusd_epi32(acc[U][1], _mm512_and_si512(_mm512_srli_epi16(v, 4), lo), xb);   \
    } while (0)
        for (; kq + 4 <= K4; kq += 4) /* the accumulators in registers: constant indices */
            for (int u = 0; u < 4; u++) I4_QUAD(u, kq + u);
        for (; kq < K4; kq++) I4_QUAD(0, kq);
#undef I4_QUAD
        for (int j = 0; j < 2; j++)
            _mm512_storeu_si512((void *)(tot[0] + 16 * j),
                                _mm512_add_epi32(_mm512_add_epi32(acc[0][j], acc[1][j]),
                                                 _mm512_add_epi32(acc[2][j], acc[3][j])));
        return;
    }
    __m512i acc[MR_MAX][2];
    for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = _mm512_setzero_si512();
    for (int64_t kq = 0; kq < K4; kq++) {
        const __m512i v = _mm512_loadu_si512((const void *)(wp + kq * 2 * PW));
        const __m512i w0 = _mm512_and_si512(v, lo), w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo);
        for (int i = 0; i < MR; i++) {
            int32_t quad;
            memcpy(&quad, xq + i * ldq + 4 * kq, sizeof quad);
            const __m512i xb = _mm512_set1_epi32(quad ^ (int32_t)0x80808080);
            acc[i][0] = _mm512_dpbusd_epi32(acc[i][0], w0, xb);
            acc[i][1] = _mm512_dpbusd_epi32(acc[i][1], w1, xb);
        }
    }
    for (int i = 0; i < MR; i++) {
        _mm512_storeu_si512((void *)tot[i], acc[i][0]);
        _mm512_storeu_si512((void *)(tot[i] + 16), acc[i][1]);
    }
#elif defined(__AVX2__)
    /* bytes 0-31 of a quad: columns 0-7 (low nibbles) and 16-23 (high); bytes 32-63: 8-15 and 24-31 */
    const __m256i lo = _mm256_set1_epi8(0x0f);
    __m256i acc[MR_MAX][4];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < 4; j++) acc[i][j] = _mm256_setzero_si256();
    for (int64_t kq = 0; kq < K4; kq++) {
        const __m256i v0 = _mm256_loadu_si256((const __m256i *)(wp + kq * 2 * PW));
        const __m256i v1 = _mm256_loadu_si256((const __m256i *)(wp + kq * 2 * PW + 32));
        const __m256i w[4] = {_mm256_and_si256(v0, lo), _mm256_and_si256(v1, lo),
                              _mm256_and_si256(_mm256_srli_epi16(v0, 4), lo),
                              _mm256_and_si256(_mm256_srli_epi16(v1, 4), lo)};
        for (int i = 0; i < MR; i++) {
            int32_t quad;
            memcpy(&quad, xq + i * ldq + 4 * kq, sizeof quad);
            const __m256i xb = _mm256_set1_epi32(quad ^ (int32_t)0x80808080);
            for (int j = 0; j < 4; j++) acc[i][j] = _mm256_dpbusd_avx_epi32(acc[i][j], w[j], xb);
        }
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < 4; j++) _mm256_storeu_si256((__m256i *)(tot[i] + 8 * j), acc[i][j]);
#else
    for (int i = 0; i < MR; i++) {
        for (int c = 0; c < PW; c++) tot[i][c] = 0;
        for (int64_t kq = 0; kq < K4; kq++)
            for (int b = 0; b < 4 * PW; b++) {
                const uint8_t byte = wp[kq * 2 * PW + (b & 63)];
                const int32_t nib = b < 64 ? byte & 15 : byte >> 4;
                tot[i][b / 4] += ((int32_t)xq[i * ldq + 4 * kq + b % 4] - 128) * nib;
            }
    }
#endif
}

/* Panels [p0, p1) of y = x W4^T + b (the header's formula), y (M, N) with row stride ldy. */
static INT8_TARGET void panel_range_i4(float *y, int64_t ldy, const uint8_t *xq, int64_t ldq, const float *rs,
                                       const q4linear_t *w, const float *b, int64_t M, int64_t K, int64_t N,
                                       int64_t p0, int64_t p1) {
    int32_t acc[MR_MAX][PW] __attribute__((aligned(64)));
    const int64_t K4 = (K + 3) / 4;
    for (int64_t m0 = 0; m0 < M; m0 += MR_MAX) {
        const int rows = (int)(M - m0 < MR_MAX ? M - m0 : MR_MAX);
        const uint8_t *xr = xq + m0 * ldq;
        int32_t corr[MR_MAX];
        for (int i = 0; i < rows; i++) corr[i] = row_sum8_i4(xr + i * ldq, K4);
        for (int64_t p = p0; p < p1; p++) {
            const uint8_t *wp = w->wq + p * K4 * 2 * PW;
            const int64_t n0 = p * PW;
            const int cols = (int)(N - n0 < PW ? N - n0 : PW);
#define TILE_I4(MR) tile_i4(MR, acc, xr, ldq, wp, K4)
            SWITCH_ROWS(rows, TILE_I4);
#undef TILE_I4
            for (int i = 0; i < rows; i++) {
                float *yr = y + (m0 + i) * ldy + n0;
                const float r = rs[m0 + i];
                int c = 0;
#if defined(__AVX512F__)
                /* 16 lanes at a time, as panel_range_i8 (a scalar loop took ~15% of its one-row head) */
                for (; c + 16 <= cols; c += 16) {
                    const __m512 av = _mm512_cvtepi32_ps(_mm512_sub_epi32(
                        _mm512_load_si512((const void *)(acc[i] + c)), _mm512_set1_epi32(corr[i])));
                    const __m512 sc = _mm512_mul_ps(_mm512_set1_ps(r), _mm512_loadu_ps(w->ws + n0 + c));
                    _mm512_storeu_ps(yr + c, b ? _mm512_fmadd_ps(av, sc, _mm512_loadu_ps(b + n0 + c))
                                               : _mm512_mul_ps(av, sc));
                }
#endif
                for (; c < cols; c++) {
                    const float a = (float)(acc[i][c] - corr[i]), s = r * w->ws[n0 + c];
                    yr[c] = b ? fmaf(a, s, b[n0 + c]) : a * s;
                }
            }
        }
    }
}

/* Item i (matmul_items(N) of them) of y = x W4^T + b from the quantized rows. */
static INT8_TARGET void matmul_item_i4(int64_t i, float *y, int64_t ldy, const uint8_t *xq, int64_t ldq,
                                       const float *rs, const q4linear_t *w, const float *b, int64_t M, int64_t K,
                                       int64_t N) {
    int64_t p0, p1;
    item_panels(i, N, &p0, &p1);
    panel_range_i4(y, ldy, xq, ldq, rs, w, b, M, K, N, p0, p1);
}

static void linear_i4_item(const rows_job_t *j, int64_t i, int64_t ldq) {
    matmul_item_i4(i, j->y, j->N, j->xq, ldq, j->rs, j->w, j->b, j->M, j->K, j->N);
}

/* Entry point (tests): y (M, N) = x (M, K) W4^T + b, each row of x quantized as
 * small_linear_int8 quantizes it; work: M * (K4 * 4) bytes, then M floats. */
void small_linear_int4(float *y, const float *x, const uint8_t *wq, const float *ws, const float *b, int64_t M,
                       int64_t K, int64_t N, void *work, int num_threads) {
    const q4linear_t w = {wq, ws};
    rows_job_t job = {.y = y, .x = x, .b = b, .w = &w, .M = M, .K = K, .N = N, .item = linear_i4_item};
    run_linear(&job, work, num_threads);
}
