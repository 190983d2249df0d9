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
 * lens: (num_seqs,) int32. One job per sequence: each cached slot (all heads,
 * contiguous) is read once, in order, for the scores and once for the values. */
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
        float *os = out + s * num_heads * head_size;
        float *scores = (float *)malloc(sizeof(float) * (size_t)len * num_heads);  /* [t][h] */
        float mx[num_heads], denom[num_heads];
        for (int64_t h = 0; h < num_heads; h++) { mx[h] = -INFINITY; denom[h] = 0.f; }
        for (int32_t t = 0; t < len; t++) {
            const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
            const float *k = k_cache + slot * slot_stride;
            for (int64_t h = 0; h < num_heads; h++) {
                const float v = dot(qs + h * head_size, k + (h / group) * head_size, (int)head_size) * scale;
                scores[t * num_heads + h] = v;
                if (v > mx[h]) mx[h] = v;
            }
        }
        for (int32_t t = 0; t < len; t++)
            for (int64_t h = 0; h < num_heads; h++) {
                const float e = expf(scores[t * num_heads + h] - mx[h]);
                scores[t * num_heads + h] = e;
                denom[h] += e;
            }
        memset(os, 0, sizeof(float) * num_heads * head_size);
        for (int32_t t = 0; t < len; t++) {
            const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
            const float *v = v_cache + slot * slot_stride;
            for (int64_t h = 0; h < num_heads; h++) {
                const float p = scores[t * num_heads + h] / denom[h];
                const float *vv = v + (h / group) * head_size;
                float *o = os + h * head_size;
                for (int64_t d = 0; d < head_size; d++) o[d] += p * vv[d];
            }
        }
        free(scores);
    }
}
