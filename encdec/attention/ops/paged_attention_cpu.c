/* Paged decode attention on CPU, float32: one query token per sequence
 * attends to its keys/values where they lie in the paged cache, with no
 * gather copy. Used for decoder self-attention (block table grows) and
 * cross-attention (cross block table, written once at prefill).
 *
 * Cache layout of one layer's K (and V), slot-major:
 *     cache[slot][kv_head][head_size],  slot = block * block_size + offset
 *
 * Sums are kept in 8 independent lanes so the compiler vectorises them
 * without -ffast-math; the result matches a softmax(QK^T)V reference to
 * float32 rounding.
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

/* out, q: (num_seqs, num_heads, head_size); tables: (num_seqs, table_stride) int32;
 * lens: (num_seqs,) int32. */
void paged_attention_decode_f32(
    float *out, const float *q, const float *k_cache, const float *v_cache,
    const int32_t *tables, int64_t table_stride, const int32_t *lens,
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
    int64_t block_size, float scale, int num_threads)
{
    const int64_t group = num_heads / num_kv_heads;
    const int64_t slot_stride = num_kv_heads * head_size;
    const int64_t total = num_seqs * num_heads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t job = 0; job < total; job++) {
        const int64_t s = job / num_heads, h = job % num_heads, kh = h / group;
        const int32_t len = lens[s];
        const int32_t *table = tables + s * table_stride;
        const float *qv = q + (s * num_heads + h) * head_size;
        float *o = out + (s * num_heads + h) * head_size;
        float stack_scores[2048];
        float *scores = len <= 2048 ? stack_scores : (float *)malloc(sizeof(float) * len);
        float mx = -INFINITY;
        for (int32_t t = 0; t < len; t++) {
            const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
            const float v = dot(qv, k_cache + slot * slot_stride + kh * head_size, (int)head_size) * scale;
            scores[t] = v;
            if (v > mx) mx = v;
        }
        float denom = 0.f;
        for (int32_t t = 0; t < len; t++) {
            scores[t] = expf(scores[t] - mx);
            denom += scores[t];
        }
        memset(o, 0, sizeof(float) * head_size);
        const float inv = 1.f / denom;
        for (int32_t t = 0; t < len; t++) {
            const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
            const float *vv = v_cache + slot * slot_stride + kh * head_size;
            const float p = scores[t] * inv;
            for (int64_t d = 0; d < head_size; d++) o[d] += p * vv[d];
        }
        if (scores != stack_scores) free(scores);
    }
}
