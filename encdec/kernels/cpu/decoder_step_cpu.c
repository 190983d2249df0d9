/* A whole decode step of a pre-LayerNorm decoder (Whisper's) on CPU, float32,
 * in one call and one parallel region: every layer of
 *
 *     h += out1(self_attn(qkv(LN1(h))))      new K/V written to the paged cache first
 *     h += out2(cross_attn(q(LN2(h))))       cross K/V read from the paged cache
 *     h += fc2(gelu(fc1(LN3(h))))
 *
 * for the M rows of a decode-only step. Why: a decode step streams the
 * decoder's weights and each row's cross K/V from memory, which two cores do
 * at ~32 GB/s here and one at ~26; the op-by-op path runs dozens of parallel
 * regions a step, and under OMP_WAIT_POLICY=PASSIVE each wakes the sleeping
 * worker (~55 us here) and each OpenMP barrier puts one to sleep (~22 us).
 * So the old fused layer kept its matmuls on one thread. Here one region
 * runs the step and the threads meet at a spinning barrier (~0.04 us) between
 * its phases: matmuls split by column panels (small_linear_cpu.c), attention
 * by each row's slots (paged_attention_cpu.c), LayerNorm by rows.
 *
 * Measured in whole runs (AMD EPYC Zen 4, AVX-512, 2 threads; sequential
 * long-form of 8 six-minute files; a step here is the engine's, LM head and
 * sampling included): an 8-row decode step 14.2-15.5 -> 11.9 ms on tiny.en,
 * 28.7 -> 18.3 ms on base, against one fused call per layer with one-thread
 * matmuls before. Rows past 8 ran op by op then: 12 rows 21-24 -> 15.6 ms (tiny).
 *
 * LayerNorm: mean, then the mean of squared deviations, both summed in double
 * (torch sums in float with its own blocking: results agree to float32
 * rounding). GELU is the exact one (vm_gelu, or erff on the portable build).
 */
#include <math.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <omp.h>

#include "small_linear_cpu.c"
#include "paged_attention_cpu.c"

const char *decoder_step_path(void) { return small_linear_path(); }

/* One layer's weights, as decoder_step_cpu.py lays them out: matmul weights
 * packed in panels (small_linear_cpu.c), LayerNorm weights and biases plain,
 * and the layer's K and V cache, (slots, H, D) each. */
typedef struct {
    const float *ln1_w, *ln1_b, *qkv_w, *qkv_b, *o1_w, *o1_b;
    const float *ln2_w, *ln2_b, *q_w, *q_b, *o2_w, *o2_b;
    const float *ln3_w, *ln3_b, *fc1_w, *fc1_b, *fc2_w, *fc2_b;
    float *k_cache, *v_cache;
} layer_t;

/* A barrier the threads of one region spin at: the phases of a step are tens
 * of microseconds long, and both threads arrive within a few. After many
 * spins (a preempted partner) it yields the core. */
typedef struct {
    atomic_int count;
    atomic_int phase;
} spin_barrier;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void barrier_wait(spin_barrier *b, int nt) {
    if (nt == 1) return;
    const int phase = atomic_load_explicit(&b->phase, memory_order_relaxed);
    if (atomic_fetch_add_explicit(&b->count, 1, memory_order_acq_rel) == nt - 1) {
        atomic_store_explicit(&b->count, 0, memory_order_relaxed);
        atomic_store_explicit(&b->phase, phase + 1, memory_order_release);
        return;
    }
    for (long spins = 0; atomic_load_explicit(&b->phase, memory_order_acquire) == phase; spins++) {
        if (spins < (1L << 16)) cpu_relax();
        else sched_yield();
    }
}

/* x = LN(h) for rows [r0, r1); (M, d). */
static void layer_norm_rows(float *x, const float *h, const float *w, const float *b, int64_t r0, int64_t r1,
                            int64_t d, float eps) {
    for (int64_t m = r0; m < r1; m++) {
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

/* Rows read together: at most this many queries share one pass over a table. */
#define GROUP_MAX 8

/* leader[m]: the first row whose table row (over its length) and length equal
 * row m's, m itself if none: best_of samples and beams share their window's
 * cross table. */
static void find_groups(int64_t *leader, const int32_t *tables, int64_t stride, const int32_t *lens, int64_t M,
                        int64_t block_size) {
    for (int64_t m = 0; m < M; m++) {
        leader[m] = m;
        const size_t bytes = sizeof(int32_t) * (size_t)((lens[m] + block_size - 1) / block_size);
        for (int64_t l = 0; l < m; l++)
            if (leader[l] == l && lens[l] == lens[m] && !memcmp(tables + l * stride, tables + m * stride, bytes)) {
                leader[m] = l;
                break;
            }
    }
}

/* Attention of each row's q over its cached K/V into a (M, d); q rows lie
 * q_stride apart. Each thread takes its share of every row's slots, all heads
 * (the same K/V bytes, contiguous; splitting a row's heads instead had both
 * threads stream every other part of the same slots, and the step ran 2-4x
 * slower), so a step of one row, or of rows of unequal lengths, keeps both
 * cores reading. Rows with one leader (find_groups; NULL: none share) are
 * taken together, each slot read once for all. The parts meet after a
 * barrier, a share of the rows per thread:
 *     out = sum_t e^(mx_t - mx) o_t / sum_t e^(mx_t - mx) sum_t.
 * part: nt * M * (H * D + 2 H) floats shared; scores: this thread's scratch. */
static void attend_share(float *a, const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                         const int32_t *tables, int64_t table_stride, const int32_t *lens, const int64_t *leader,
                         int64_t M, int64_t H, int64_t D, int64_t block_size, float scale, float *scores,
                         float *part, spin_barrier *bar, int tid, int nt) {
    const int64_t stride = H * D + 2 * H;  /* one part: o (H, D), mx (H), sum (H) */
    for (int64_t l = 0; l < M; l++) {
        if (leader && leader[l] != l) continue;  /* l leads a group (without leaders: every row alone) */
        const int32_t t0 = (int32_t)((int64_t)lens[l] * tid / nt), t1 = (int32_t)((int64_t)lens[l] * (tid + 1) / nt);
        const int32_t *table = tables + l * table_stride;
        float *os[GROUP_MAX], *mx[GROUP_MAX], *sum[GROUP_MAX];
        const float *qs[GROUP_MAX];
        int G = 0;
        for (int64_t m = l; m < M && (m == l || leader); m++) {
            if (m != l && leader[m] != l) continue;
            os[G] = part + (tid * M + m) * stride;
            mx[G] = os[G] + H * D;
            sum[G] = mx[G] + H;
            qs[G++] = q + m * q_stride;
            if (G == GROUP_MAX) {
                attend_range(G, os, qs, k_cache, v_cache, table, t0, t1, H, 1, D, H * D, block_size, scale, scores,
                             mx, sum);
                G = 0;
            }
        }
        if (G)
            attend_range(G, os, qs, k_cache, v_cache, table, t0, t1, H, 1, D, H * D, block_size, scale, scores, mx,
                         sum);
    }
    barrier_wait(bar, nt);
    for (int64_t m = M * tid / nt; m < M * (tid + 1) / nt; m++)
        for (int64_t h = 0; h < H; h++) {
            float mx = -INFINITY, total = 0.f, w[nt];
            for (int t = 0; t < nt; t++) mx = fmaxf(mx, part[(t * M + m) * stride + H * D + h]);
            for (int t = 0; t < nt; t++) {
                const float *o = part + (t * M + m) * stride;
                w[t] = o[H * D + H + h] > 0.f ? expf(o[H * D + h] - mx) : 0.f;
                total += w[t] * o[H * D + H + h];
            }
            float *out = a + m * H * D + h * D;
            for (int64_t i = 0; i < D; i++) {
                float acc = 0.f;
                for (int t = 0; t < nt; t++) acc += w[t] * part[(t * M + m) * stride + h * D + i];
                out[i] = acc / total;
            }
        }
}

/* h += out(attention of the rows' q over the layer's cache): self and cross
 * attention, by their tables; a: (M, d) scratch. Ends at a barrier. */
static void attention_block(float *h, float *a, const float *q, int64_t q_stride, const layer_t *w,
                            const int32_t *tables, int64_t table_stride, const int32_t *lens, const int64_t *leader,
                            const float *o_w, const float *o_b, int64_t M, int64_t H, int64_t D, int64_t block_size,
                            float scale, float *scores, float *part, spin_barrier *bar, int tid, int nt) {
    const int64_t d = H * D;
    attend_share(a, q, q_stride, w->k_cache, w->v_cache, tables, table_stride, lens, leader, M, H, D, block_size,
                 scale, scores, part, bar, tid, nt);
    barrier_wait(bar, nt);
    panel_share(h, d, a, d, o_w, o_b, M, d, d, POST_ADD, tid, nt);
    barrier_wait(bar, nt);
}

static int32_t max_len(const int32_t *lens, int64_t M) {
    int32_t mx = 1;
    for (int64_t m = 0; m < M; m++) mx = lens[m] > mx ? lens[m] : mx;
    return mx;
}

/* h: (M, d) residual stream, updated in place. work: at least
 * M * (6 d + ffn) + num_threads * M * (d + 2 H) floats. layers: num_layers of
 * layer_t. slots: (M,) int64, where each row's new K/V goes; self tables/lens
 * include the new token. Returns 0, or -1 where a thread's scratch could not
 * be allocated (then nothing was done). */
int decoder_step_f32(
    float *h, float *work, int64_t M, int64_t d, int64_t H, int64_t ffn, float eps, float scale,
    const layer_t *layers, int64_t num_layers, int64_t block_size, const int64_t *slots,
    const int32_t *self_tables, int64_t self_stride, const int32_t *self_lens,
    const int32_t *cross_tables, int64_t cross_stride, const int32_t *cross_lens, int num_threads)
{
    const int64_t D = d / H;
    float *x = work, *qkv = x + M * d, *q = qkv + M * 3 * d, *a = q + M * d, *f = a + M * d, *part = f + M * ffn;
    const int32_t self_longest = max_len(self_lens, M), cross_longest = max_len(cross_lens, M);
    const int32_t longest = self_longest > cross_longest ? self_longest : cross_longest;
    int64_t leader[M];  /* rows sharing a cross table (find_groups) */
    find_groups(leader, cross_tables, cross_stride, cross_lens, M, block_size);
    spin_barrier bar = {0, 0};
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t r0 = M * tid / nt, r1 = M * (tid + 1) / nt;  /* this thread's rows */
        float *scores = (float *)malloc(sizeof(float) * (size_t)longest * (size_t)H * GROUP_MAX);
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
        barrier_wait(&bar, nt);
        for (int64_t l = 0; l < num_layers && !failed; l++) {
            const layer_t *w = layers + l;
            layer_norm_rows(x, h, w->ln1_w, w->ln1_b, r0, r1, d, eps);
            barrier_wait(&bar, nt);
            panel_share(qkv, 3 * d, x, d, w->qkv_w, w->qkv_b, M, d, 3 * d, POST_NONE, tid, nt);
            barrier_wait(&bar, nt);
            for (int64_t m = r0; m < r1; m++) {
                memcpy(w->k_cache + slots[m] * d, qkv + m * 3 * d + d, sizeof(float) * d);
                memcpy(w->v_cache + slots[m] * d, qkv + m * 3 * d + 2 * d, sizeof(float) * d);
            }
            barrier_wait(&bar, nt);
            attention_block(h, a, qkv, 3 * d, w, self_tables, self_stride, self_lens, NULL, w->o1_w, w->o1_b,
                            M, H, D, block_size, scale, scores, part, &bar, tid, nt);
            layer_norm_rows(x, h, w->ln2_w, w->ln2_b, r0, r1, d, eps);
            barrier_wait(&bar, nt);
            panel_share(q, d, x, d, w->q_w, w->q_b, M, d, d, POST_NONE, tid, nt);
            barrier_wait(&bar, nt);
            attention_block(h, a, q, d, w, cross_tables, cross_stride, cross_lens, leader, w->o2_w, w->o2_b,
                            M, H, D, block_size, scale, scores, part, &bar, tid, nt);
            layer_norm_rows(x, h, w->ln3_w, w->ln3_b, r0, r1, d, eps);
            barrier_wait(&bar, nt);
            panel_share(f, ffn, x, d, w->fc1_w, w->fc1_b, M, d, ffn, POST_GELU, tid, nt);
            barrier_wait(&bar, nt);
            panel_share(h, d, f, ffn, w->fc2_w, w->fc2_b, M, ffn, d, POST_ADD, tid, nt);
            barrier_wait(&bar, nt);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
