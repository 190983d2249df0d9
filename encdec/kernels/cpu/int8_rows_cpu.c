/* The two float passes around an int8 matmul (quantization="int8", CPU):
 *
 *   quantize_rows_s8:   q[r, k] = round(x[r, k] * 127 / max_k |x[r, k]|)    (int8)
 *                       scale[r] = max_k |x[r, k]| / 127
 *   dequantize_rows:    out[r, n] = act(acc[r, n] * scale[r] * wscale[n] + bias[n])
 *                       written over acc (int32 -> float32, the same 4 bytes)
 *
 * Between them torch._int_mm (oneDNN's s8 x s8 -> s32 with VNNI) multiplies
 * q by the int8 weight. Why by hand: torch's passes for the same work (aminmax
 * per row, a divide, fbgemm's own quantization and dequantization, then
 * addcmul and the activation) were 1.3 s of tiny.en's 5.8 s on 32 short
 * clips; aminmax alone read 1500 x 1536 floats in 2.75 ms (3 GB/s). Here a
 * row (a few KB) is read from memory once for its max and again from L1 for
 * its quantization, and the int32 result is turned into the output in one
 * pass. Rows are items shared by the threads (team.h).
 *
 * Rounding is to nearest, ties to even (the lanes' conversion and lrintf
 * alike), so every ISA path gives the same bytes.
 */
#ifndef ENCDEC_INT8_ROWS_CPU_C /* included by more than one kernel of a build (paged_attention_i8.h too) */
#define ENCDEC_INT8_ROWS_CPU_C
#include <math.h>
#include <stdint.h>

#include "team.h"
#include "vector_math.h"

const char *int8_rows_path(void) { return VM_PATH; }

#define ROWS_PER_ITEM 8

enum { ACT_NONE = 0, ACT_GELU = 1, ACT_RELU = 3 };  /* small_linear_cpu.py's POST codes */

static float abs_max(const float *x, int64_t n) {
    int64_t k = 0;
    float m = 0.0f;
#if defined(VM_VL)
    vm_vec mv = VM_ZERO();
    for (; k + VM_VL <= n; k += VM_VL) mv = VM_MAX(mv, VM_ABS(VM_LOAD(x + k)));
    m = VM_HMAX(mv);
#endif
    for (; k < n; k++) m = fabsf(x[k]) > m ? fabsf(x[k]) : m;
    return m;
}

static void quantize_row(const float *x, int64_t K, int8_t *q, float *scale) {
    const float amax = abs_max(x, K);
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    *scale = amax / 127.0f;
    int64_t k = 0;
#if VM_VL == 16
    const __m512 iv = _mm512_set1_ps(inv);
    for (; k + 16 <= K; k += 16) {
        const __m512i i32 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + k), iv));
        _mm_storeu_si128((__m128i *)(q + k), _mm512_cvtsepi32_epi8(i32));
    }
#elif VM_VL == 8
    const __m256 iv = _mm256_set1_ps(inv);
    for (; k + 8 <= K; k += 8) {
        const __m256i i32 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k), iv));
        const __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
        _mm_storel_epi64((__m128i *)(q + k), _mm_packs_epi16(i16, i16));
    }
#endif
    for (; k < K; k++) {
        const long v = lrintf(x[k] * inv);
        q[k] = (int8_t)(v > 127 ? 127 : v < -127 ? -127 : v);
    }
}

static inline float act_scalar(float v, int act) {
    if (act == ACT_GELU) return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
    if (act == ACT_RELU) return v > 0.0f ? v : 0.0f;
    return v;
}

static void dequantize_row(int32_t *acc, int64_t N, float rs, const float *ws, const float *bias, int act) {
    float *out = (float *)acc;  /* each lane is read before its float is written over it */
    int64_t n = 0;
#if defined(VM_VL)
    const vm_vec rv = VM_SET1(rs);
    for (; n + VM_VL <= N; n += VM_VL) {
#if VM_VL == 16
        const vm_vec a = _mm512_cvtepi32_ps(_mm512_loadu_si512((const void *)(acc + n)));
#else
        const vm_vec a = _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(acc + n)));
#endif
        const vm_vec s = VM_MUL(rv, VM_LOAD(ws + n));
        vm_vec v = bias ? VM_FMA(a, s, VM_LOAD(bias + n)) : VM_MUL(a, s);
        if (act == ACT_GELU) v = vm_gelu(v);
        else if (act == ACT_RELU) v = VM_MAX(v, VM_ZERO());
        VM_STORE(out + n, v);
    }
    if (n < N && act == ACT_GELU) {  /* the tail's GELU in one padded lane block: the lanes' GELU, as
                                      * every column of the decode step's int8 panels gets it */
        float t[VM_VL];
        for (int64_t i = 0; i < VM_VL; i++)
            t[i] = n + i < N ? fmaf((float)acc[n + i], rs * ws[n + i], bias ? bias[n + i] : 0.0f) : 0.0f;
        VM_STORE(t, vm_gelu(VM_LOAD(t)));
        for (; n < N; n++) out[n] = t[n % VM_VL];
    }
#endif
    for (; n < N; n++) {
        const float v = fmaf((float)acc[n], rs * ws[n], bias ? bias[n] : 0.0f);  /* as the lanes: one rounding */
        out[n] = act_scalar(v, act);
    }
}

typedef struct {
    const float *x;
    int64_t R, K, stride;
    int8_t *q;
    float *scale;
    team_t team;
} quantize_job_t;

/* ROW_CALL for every row r < R, ROWS_PER_ITEM rows an item of a team phase. */
#define FOR_ROWS(team, R, ROW_CALL)                                                              \
    TEAM_PHASE(team, 0, ((R) + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM, {                             \
        const int64_t end = (i + 1) * ROWS_PER_ITEM < (R) ? (i + 1) * ROWS_PER_ITEM : (R);       \
        for (int64_t r = i * ROWS_PER_ITEM; r < end; r++) ROW_CALL;                              \
    })

static void quantize_job(void *arg, int tid) {
    quantize_job_t *j = arg;
    (void)tid;
    FOR_ROWS(&j->team, j->R, quantize_row(j->x + r * j->stride, j->K, j->q + r * j->K, j->scale + r));
}

/* x: (R, K) floats, rows ``stride`` apart; q: (R, K) int8, contiguous; scale: (R,). */
void quantize_rows_s8(const float *x, int64_t R, int64_t K, int64_t stride, int8_t *q, float *scale, int threads) {
    atomic_int counters[2] = {0, 0};
    quantize_job_t job = {x, R, K, stride, q, scale, {0, 0, counters, counters + 1}};
    team_run(quantize_job, &job, threads);
}

typedef struct {
    int32_t *acc;
    int64_t R, N;
    const float *rs, *ws, *bias;
    int act;
    team_t team;
} dequantize_job_t;

static void dequantize_job(void *arg, int tid) {
    dequantize_job_t *j = arg;
    (void)tid;
    FOR_ROWS(&j->team, j->R, dequantize_row(j->acc + r * j->N, j->N, j->rs[r], j->ws, j->bias, j->act));
}

/* acc: (R, N) int32, contiguous, overwritten by the float32 result; rs: (R,)
 * row scales; ws: (N,) weight scales; bias: (N,) or NULL; act: ACT_*. */
void dequantize_rows(int32_t *acc, int64_t R, int64_t N, const float *rs, const float *ws, const float *bias,
                     int act, int threads) {
    atomic_int counters[2] = {0, 0};
    dequantize_job_t job = {acc, R, N, rs, ws, bias, act, {0, 0, counters, counters + 1}};
    team_run(dequantize_job, &job, threads);
}

#endif
