/* One pre-LayerNorm decoder layer (Whisper's) for a decode step of a few rows,
 * CPU, float32, in one call:
 *
 *     h += out1(self_attn(qkv(LN1(h))))      new K/V written to the paged cache first
 *     h += out2(cross_attn(q(LN2(h))))       cross K/V read from the paged cache
 *     h += fc2(gelu(fc1(LN3(h))))
 *
 * Why: a batch-1 Whisper tiny decode step spent ~1.6 of its 4.0 ms outside
 * the matmul and attention kernels (torch op dispatch, module calls, views and
 * allocations: ~60 ops and ~1300 Python calls a step; AMD EPYC, cache flushed
 * between steps). The matmuls and attention are the kernels the torch path
 * runs (small_linear_cpu.c and paged_attention_cpu.c, included below), so
 * this adds only LayerNorm, GELU and the residual adds.
 *
 * LayerNorm: mean, then the mean of squared deviations, both summed in double
 * (torch sums in float with its own blocking: results agree to float32
 * rounding). GELU is the exact one, 0.5 x (1 + erf(x / sqrt 2)).
 */
#include <math.h>
#include <stdint.h>

/* Both kernels name their dot product "dot". */
#define dot small_linear_dot
#include "small_linear_cpu.c"
#undef dot
#define dot paged_attention_dot
#include "paged_attention_cpu.c"
#undef dot

const char *decoder_layer_path(void) { return small_linear_path(); }

/* x = LN(h) row by row; (M, d). */
static void layer_norm(float *x, const float *h, const float *w, const float *b, int64_t M, int64_t d,
                       float eps) {
    for (int64_t m = 0; m < M; m++) {
        const float *hr = h + m * d;
        float *xr = x + m * d;
        double sum = 0.0, sq = 0.0;
        for (int64_t i = 0; i < d; i++) sum += hr[i];
        const double mean = sum / (double)d;
        for (int64_t i = 0; i < d; i++) {
            const double c = hr[i] - mean;
            sq += c * c;
        }
        const float rstd = (float)(1.0 / sqrt(sq / (double)d + (double)eps));
        const float mf = (float)mean;
        for (int64_t i = 0; i < d; i++) xr[i] = (hr[i] - mf) * rstd * w[i] + b[i];
    }
}

static void add(float *h, const float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) h[i] += y[i];
}

static void gelu(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = 0.5f * x[i] * (1.0f + erff(x[i] * (float)M_SQRT1_2));
}

/* h += out(attention of the rows' q over their cached K/V); a, y: (M, d) scratch. */
static void attend(float *h, float *a, float *y, const float *q, const float *k_cache, const float *v_cache,
                   const int32_t *tables, int64_t stride, const int32_t *lens, const float *o_w, const float *o_b,
                   int64_t M, int64_t d, int64_t num_heads, int64_t block_size, float scale, int threads) {
    paged_attention_decode_f32(a, q, k_cache, v_cache, tables, stride, lens, M, num_heads, num_heads,
                               d / num_heads, block_size, scale, threads);
    small_linear_f32(y, a, o_w, o_b, M, d, d, 1);
    add(h, y, M * d);
}

/* Weights as nn.Linear's (out, in) row-major, biases (out,); NULL bias: none.
 * h: (M, d) residual stream, updated in place. work: at least
 * M * (7 d + ffn) floats. k_cache/v_cache: (slots, H, D) of this
 * layer; slots: (M,) int64, where each row's new K/V goes; self tables/lens
 * include the new token. attn_threads: threads for the two attention calls
 * (the matmuls run on one). */
void decoder_layer_f32(
    float *h, float *work, int64_t M, int64_t d, int64_t num_heads, int64_t ffn, float eps, float scale,
    const float *ln1_w, const float *ln1_b, const float *qkv_w, const float *qkv_b,
    const float *o1_w, const float *o1_b,
    const float *ln2_w, const float *ln2_b, const float *q_w, const float *q_b,
    const float *o2_w, const float *o2_b,
    const float *ln3_w, const float *ln3_b, const float *fc1_w, const float *fc1_b,
    const float *fc2_w, const float *fc2_b,
    float *k_cache, float *v_cache, int64_t block_size, const int64_t *slots,
    const int32_t *self_tables, int64_t self_stride, const int32_t *self_lens,
    const int32_t *cross_tables, int64_t cross_stride, const int32_t *cross_lens,
    int attn_threads)
{
    float *x = work, *qkv = x + M * d, *q = qkv + M * 3 * d, *a = q + M * d, *y = a + M * d, *f = y + M * d;

    layer_norm(x, h, ln1_w, ln1_b, M, d, eps);
    small_linear_f32(qkv, x, qkv_w, qkv_b, M, d, 3 * d, 1);
    for (int64_t m = 0; m < M; m++) {
        const float *r = qkv + m * 3 * d;
        for (int64_t i = 0; i < d; i++) {
            q[m * d + i] = r[i];
            k_cache[slots[m] * d + i] = r[d + i];
            v_cache[slots[m] * d + i] = r[2 * d + i];
        }
    }
    attend(h, a, y, q, k_cache, v_cache, self_tables, self_stride, self_lens, o1_w, o1_b, M, d, num_heads,
           block_size, scale, attn_threads);

    layer_norm(x, h, ln2_w, ln2_b, M, d, eps);
    small_linear_f32(q, x, q_w, q_b, M, d, d, 1);
    attend(h, a, y, q, k_cache, v_cache, cross_tables, cross_stride, cross_lens, o2_w, o2_b, M, d, num_heads,
           block_size, scale, attn_threads);

    layer_norm(x, h, ln3_w, ln3_b, M, d, eps);
    small_linear_f32(f, x, fc1_w, fc1_b, M, d, ffn, 1);
    gelu(f, M * ffn);
    small_linear_f32(y, f, fc2_w, fc2_b, M, ffn, d, 1);
    add(h, y, M * d);
}
