/* A whole decode step of a pre-LayerNorm decoder (Whisper's) on CPU, float32,
 * in one call whose threads share the work of every layer (team.h):
 *
 *     h += out1(self_attn(qkv(LN1(h))))      new K/V written to the paged cache first
 *     h += out2(cross_attn(q(LN2(h))))       cross K/V read from the paged cache
 *     h += fc2(act(fc1(LN3(h))))            act: GELU (Whisper, mBART) or ReLU (M2M100, NLLB)
 *
 * for the M rows of a decode-only step. Why: a decode step streams the
 * decoder's weights and each row's cross K/V from memory, which two cores do
 * at ~32 GB/s here and one at ~26; the op-by-op path runs dozens of parallel
 * regions a step, and under OMP_WAIT_POLICY=PASSIVE each wakes the sleeping
 * worker (~55 us here) and each OpenMP barrier puts one to sleep (~22 us).
 * So the old fused layer kept its matmuls on one thread. Here one call
 * runs the step as a list of phases (team.h): matmuls in items of column
 * panels (small_linear_cpu.c), attention in items of CHUNK slots of a row
 * (paged_attention_cpu.c), LayerNorm and joins by rows; each item is taken by
 * whichever thread is free, and a thread done early spins a little, then
 * sleeps, until the phase's last item is done (a partner that lost its core
 * to another process costs a wake-up, not a time slice).
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
 * The BART-layout pre-norm families (mBART, M2M100, NLLB) have Whisper's
 * layer, biases included; they differ in the activation alone.
 *
 * Post-norm (post_norm: BART's layer) is the same layer with each norm moved
 * after its residual add, h = LN1(h + out1(...)) and so on: the matmuls read
 * h itself, and each norm runs in place on h in the next norm's phase (the
 * last in LN_OUT).
 *
 * T5's layer (rms_norm, no biases: NULL, scale 1, a ReLU FFN) is the same
 * layer with RMSNorm (x * rsqrt(mean(x^2) + eps) * w, no mean, no bias) and
 * its relative position bias in self-attention (a per-step distance table,
 * paged_attention_cpu.c's header).
 *
 * int8 weights (quantization="int8", qlayers given): each matmul's input rows
 * are quantized where they are made (the LayerNorm and join phases, and one
 * phase after fc1) and the matmuls run small_linear_int8_cpu.c. Measured
 * (tiny.en, one 6-minute file sequentially, Xeon AVX-512 VNNI, 2 threads): see
 * decoder_step_cpu.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "small_linear_int8_cpu.c" /* and small_linear_cpu.c */
#include "paged_attention_cpu.c"
#include "team.h"

const char *decoder_step_path(void) { return small_linear_path(); }

/* One layer's weights, as decoder_step_cpu.py lays them out: matmul weights
 * packed in panels (small_linear_cpu.c), LayerNorm weights and biases plain,
 * and the layer's K and V cache, (slots, H, D) each. */
typedef struct {
    const float *ln1_w, *ln1_b, *qkv_w, *qkv_b, *o1_w, *o1_b;
    const float *ln2_w, *ln2_b, *q_w, *q_b, *o2_w, *o2_b;
    const float *ln3_w, *ln3_b, *fc1_w, *fc1_b, *fc2_w, *fc2_b;
    void *k_cache, *v_cache;  /* float32, or bfloat16 where the step's kv_bf16 */
} layer_t;

/* One layer's int8 matmuls (small_linear_int8_cpu.c), in layer_t's order. */
typedef struct {
    qlinear_t qkv, o1, q, o2, fc1, fc2;
} qlayer_t;

/* x = RMSNorm(h) for rows [r0, r1); (M, d): T5's, the mean square summed in double. */
static void rms_norm_rows(float *x, const float *h, const float *w, int64_t r0, int64_t r1, int64_t d, float eps) {
    for (int64_t m = r0; m < r1; m++) {
        const float *hr = h + m * d;
        float *xr = x + m * d;
        double sq = 0.0;
        for (int64_t i = 0; i < d; i++) sq += (double)hr[i] * hr[i];
        const float rstd = (float)(1.0 / sqrt(sq / (double)d + (double)eps));
        for (int64_t i = 0; i < d; i++) xr[i] = w[i] * (hr[i] * rstd);
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

/* Rows read together: at most this many queries share one pass over a table.
 * 17: the rows verifying k = 16 drafts share one cross table, and each slot is
 * then read once for all of them (Whisper base, a 13-row verify step, 2
 * threads: 10.2 ms with groups of 8, 8.5-9.6 ms with 16). Every row's sums
 * are its own whatever the group, so the results do not change. */
#define GROUP_MAX 17

/* leader[m]: the first row whose table row (over its length) and length equal
 * row m's, m itself if none: best_of samples and beams share their window's
 * cross table. next[m]: the next row with row m's leader, -1 after the last.
 * Leaders are found by a hash of their first block, not by comparing every
 * pair of rows (45 us of a 256-row step at d_model 32). */
static void find_groups(int64_t *leader, int64_t *next, const int32_t *tables, int64_t stride, const int32_t *lens,
                        int64_t M, int64_t block_size) {
    int64_t nb = 1;
    while (nb < 2 * M) nb <<= 1;
    int64_t head[nb], chain[M], last[M];  /* bucket -> its newest leader; a leader -> the bucket's next one */
    for (int64_t b = 0; b < nb; b++) head[b] = -1;
    for (int64_t m = 0; m < M; m++) {
        const int64_t blocks = (lens[m] + block_size - 1) / block_size;
        const size_t bytes = sizeof(int32_t) * (size_t)blocks;
        int64_t *bucket = head + ((blocks ? (uint32_t)tables[m * stride] : 0u) * 2654435761u & (uint32_t)(nb - 1));
        int64_t l = *bucket;
        while (l >= 0 && !(lens[l] == lens[m] && !memcmp(tables + l * stride, tables + m * stride, bytes)))
            l = chain[l];
        leader[m] = l >= 0 ? l : m;
        next[m] = -1;
        if (l >= 0) {
            next[last[l]] = m;
            last[l] = m;
        } else {
            last[m] = m;
            chain[m] = *bucket;
            *bucket = m;
        }
    }
}

/* Slots of a row's attention per work item: each item is a part of one row's
 * (or one group's) attention, and a row's parts are joined in order. Parts
 * are cut by this length, not by the number of threads, so the result is the
 * same on any number of threads, whoever ran which part. A cross-attention
 * row of Whisper (1500 slots) is 6 items, so a step of one row keeps both
 * cores reading; 256 slots of tiny.en's K and V are 768 KB, ~40 us. 128 cost
 * a 5-row step 3% more on one thread (more parts to start and join). */
#define CHUNK 256

static int64_t num_chunks(int32_t len) { return (len + CHUNK - 1) / CHUNK; }

/* The attention items of a step: (row, chunk) for each leader row (find_groups;
 * NULL leader: every row leads itself) and each of its chunks, in order. */
static int64_t list_items(int64_t *items, const int32_t *lens, const int64_t *leader, int64_t M, int64_t C) {
    int64_t n = 0;
    for (int64_t m = 0; m < M; m++)
        if (!leader || leader[m] == m)
            for (int64_t c = 0; c < num_chunks(lens[m]); c++) items[n++] = m * C + c;
    return n;
}

/* attend_range_kv for a step's rows (one K/V head per query head), compiled
 * once; i8_block: the bytes of a block of an int8 cache (paged_attention_i8.h), 0 for another. */
static void attend_group(int G, float *const *os, const float *const *qs, const void *k_cache, const void *v_cache,
                         const int32_t *table, int32_t t0, int32_t t1, int64_t H, int64_t D, int64_t block_size,
                         float scale, float *scores, float *const *mx, float *const *sum, const float *bias,
                         int64_t bias_stride, int32_t q_pos, int kv_bf16, int64_t i8_block) {
    if (i8_block) {
        attend_range_i8(G, os, qs, k_cache, v_cache, table, t0, t1, H, D, block_size, i8_block, scale, scores, mx,
                        sum);
        return;
    }
    attend_range_kv(G, os, qs, k_cache, v_cache, table, t0, t1, H, 1, D, H * D, block_size, scale, scores, mx, sum,
                    bias, bias_stride, q_pos, kv_bf16);
}

/* One attention item: chunk c of the slots of leader row l, for l and the rows
 * it leads (each slot's K and V read once for all of them), not yet normalised,
 * into their parts (next: the rows after l that l leads, find_groups; NULL:
 * none): part (m, c) at part + (m * C + c) * (H D + 2 H) holds
 * o (H, D), mx (H), sum (H) (attend_range_kv). q rows lie q_stride apart;
 * scores: this thread's scratch, CHUNK * H * GROUP_MAX floats. bias: a
 * distance table (H, bias_stride) for self-attention (no leader), or NULL.
 * kv_bf16: the caches hold bfloat16; i8_block: attend_group's. */
static void attend_item(int64_t item, const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                        const int32_t *tables, int64_t table_stride, const int32_t *lens, const int64_t *next,
                        int64_t H, int64_t D, int64_t block_size, float scale, float *scores, float *part, int64_t C,
                        const float *bias, int64_t bias_stride, int kv_bf16, int64_t i8_block) {
    const int64_t stride = H * D + 2 * H, l = item / C, c = item % C;
    const int32_t t0 = (int32_t)(c * CHUNK), t1 = (int32_t)(t0 + CHUNK < lens[l] ? t0 + CHUNK : lens[l]);
    const int32_t *table = tables + l * table_stride;
    float *os[GROUP_MAX], *mx[GROUP_MAX], *sum[GROUP_MAX];
    const float *qs[GROUP_MAX];
    int G = 0;
    for (int64_t m = l; m >= 0; m = next ? next[m] : -1) {
        os[G] = part + (m * C + c) * stride;
        mx[G] = os[G] + H * D;
        sum[G] = mx[G] + H;
        qs[G++] = q + m * q_stride;
        if (G == GROUP_MAX) {
            attend_group(G, os, qs, k_cache, v_cache, table, t0, t1, H, D, block_size, scale, scores, mx, sum, bias,
                         bias_stride, lens[l] - 1, kv_bf16, i8_block);
            G = 0;
        }
    }
    if (G)
        attend_group(G, os, qs, k_cache, v_cache, table, t0, t1, H, D, block_size, scale, scores, mx, sum, bias,
                     bias_stride, lens[l] - 1, kv_bf16, i8_block);
}

/* Row m's attention output a (H * D) from its parts, joined in chunk order:
 *     out = sum_c e^(mx_c - mx) o_c / sum_c e^(mx_c - mx) sum_c. */
static void join_row(float *a, const float *part, int64_t m, int32_t len, int64_t H, int64_t D, int64_t C) {
    const int64_t stride = H * D + 2 * H, n = num_chunks(len);
    const float *row = part + m * C * stride;
    for (int64_t h = 0; h < H; h++) {
        float mx = -INFINITY, total = 0.f, w[n];
        for (int64_t c = 0; c < n; c++) mx = fmaxf(mx, row[c * stride + H * D + h]);
        for (int64_t c = 0; c < n; c++) {
            const float *o = row + c * stride;
            w[c] = o[H * D + H + h] > 0.f ? expf(o[H * D + h] - mx) : 0.f;
            total += w[c] * o[H * D + H + h];
        }
        float *out = a + h * D;
        for (int64_t i = 0; i < D; i++) {
            float acc = 0.f;
            for (int64_t c = 0; c < n; c++) acc += w[c] * row[c * stride + h * D + i];
            out[i] = acc / total;
        }
    }
}

static int32_t max_len(const int32_t *lens, int64_t M) {
    int32_t mx = 1;
    for (int64_t m = 0; m < M; m++) mx = lens[m] > mx ? lens[m] : mx;
    return mx;
}

/* Rows per item of the row-wise phases (LayerNorm, K/V copy, joins). */
#define ROWS_ITEM 4
/* The phases of one layer, in order (TEAM_PHASE numbers them l * PHASES + k). */
enum { LN1, QKV, KV_COPY, SELF_ATT, SELF_JOIN, O1, LN2, Q, CROSS_ATT, CROSS_JOIN, O2, LN3, FC1, QF, FC2, LN_OUT,
       PHASES };

/* A step's arguments and scratch, shared by its threads (step_job). */
typedef struct {
    float *h, *x, *qkv, *q, *a, *f, *part, *scores_all;
    const layer_t *layers;
    const qlayer_t *qlayers; /* NULL: float32 matmuls */
    uint8_t *xq;             /* int8: the next matmul's input rows, quantized (small_linear_int8_cpu.c) */
    float *rs;               /* their scales */
    const int64_t *slots, *self_items, *cross_items, *next;
    const int32_t *self_tables, *self_lens, *cross_tables, *cross_lens;
    int64_t M, d, H, ffn, num_layers, block_size, self_stride, cross_stride, C, scores_size, n_self, n_cross;
    float eps, scale;
    int ffn_post;  /* POST_GELU or POST_RELU: fc1's activation */
    int rms_norm;  /* T5: RMSNorm (the norms' biases unused) */
    int post_norm; /* BART: each norm after its residual add, in place on h */
    const float *bias;  /* T5: self-attention's distance table (H, bias_stride), or NULL */
    int64_t bias_stride;
    int kv_bf16;        /* the caches hold bfloat16 (else float32) */
    int cross_i8;       /* the cross blocks hold int8 records (paged_attention_i8.h) */
    team_t team;
} step_t;

/* A row's new K and V (kv: k then v, d each) into the layer's caches at slot:
 * copied, or rounded to bfloat16 as torch's cache write rounds them. */
static void copy_kv(const step_t *s, const layer_t *w, const float *kv, int64_t slot) {
    const int64_t d = s->d;
    if (!s->kv_bf16) {
        memcpy((float *)w->k_cache + slot * d, kv, sizeof(float) * d);
        memcpy((float *)w->v_cache + slot * d, kv + d, sizeof(float) * d);
        return;
    }
    uint16_t *k = (uint16_t *)w->k_cache + slot * d, *v = (uint16_t *)w->v_cache + slot * d;
    for (int64_t i = 0; i < d; i++) {
        k[i] = vm_f32_to_bf16(kv[i]);
        v[i] = vm_f32_to_bf16(kv[d + i]);
    }
}

/* int8: rows [r0, r1) of x (K wide, row stride ldx) quantized into the step's xq. */
static void quantize_step_rows(const step_t *s, const float *x, int64_t ldx, int64_t K, int64_t r0, int64_t r1) {
    if (!s->qlayers) return;
    const int64_t ldq = quad_row_bytes(K);
    for (int64_t m = r0; m < r1; m++) quantize_row_u8(x + m * ldx, K, s->xq + m * ldq, s->rs + m);
}

/* The next matmul's input rows [r0, r1), quantized for an int8 matmul:
 * x = LN(h), or post-norm h = LN(h) in place (w NULL: h as it is). */
static void norm_rows(const step_t *s, const float *w, const float *b, int64_t r0, int64_t r1) {
    float *out = s->post_norm ? s->h : s->x;
    if (w && s->rms_norm)
        rms_norm_rows(out, s->h, w, r0, r1, s->d, s->eps);
    else if (w)
        layer_norm_rows(out, s->h, w, b, r0, r1, s->d, s->eps);
    quantize_step_rows(s, out, s->d, s->d, r0, r1);
}

/* Row m of an attention's output a from its parts, and the row quantized for an int8 matmul. */
static void join_rows(const step_t *s, const int32_t *lens, int64_t m) {
    const int64_t d = s->d;
    join_row(s->a + m * d, s->part, m, lens[m], s->H, d / s->H, s->C);
    quantize_step_rows(s, s->a, d, d, m, m + 1);
}

/* Item i of y = post(x W^T + b), x (M, K): float32 (W packed in panels), or
 * int8 (QW) from the rows quantize_step_rows made of x. */
static void step_matmul(const step_t *s, int64_t i, float *y, int64_t ldy, const float *x, int64_t ldx,
                        const float *W, const qlinear_t *QW, const float *b, int64_t K, int64_t N, int post) {
    if (s->qlayers)
        matmul_item_i8(i, y, ldy, s->xq, quad_row_bytes(K), s->rs, QW, b, s->M, K, N, post);
    else
        matmul_item(i, y, ldy, x, ldx, W, b, s->M, K, N, post);
}

/* Every layer's phases, in order; tid picks this thread's scores scratch. */
static void step_job(void *arg, int tid) {
    step_t *s = arg;
    float *h = s->h, *qkv = s->qkv, *q = s->q, *a = s->a, *f = s->f, *part = s->part;
    const float *x = s->post_norm ? h : s->x;  /* the matmuls' input rows (norm_rows) */
    float *scores = s->scores_all + tid * s->scores_size;
    const int64_t M = s->M, d = s->d, H = s->H, D = d / H, ffn = s->ffn, block_size = s->block_size, C = s->C;
    const int64_t rows_items = (M + ROWS_ITEM - 1) / ROWS_ITEM;
    const float scale = s->scale;
    team_t *team = &s->team;
    for (int64_t l = 0; l < s->num_layers; l++) {
        const layer_t *w = s->layers + l;
        const qlayer_t *qw = s->qlayers ? s->qlayers + l : NULL;
#define QW(name) (qw ? &qw->name : NULL)
        const int p = (int)(l * PHASES);
#define ROWS(i) (i) * ROWS_ITEM, ((i) + 1) * ROWS_ITEM < M ? ((i) + 1) * ROWS_ITEM : M
        /* Post-norm: norm k of the layer runs in phase k + 1 (LN2, LN3, LN_OUT); LN1 quantizes h for an
         * int8 first layer (later ones' LN_OUT did). */
        const layer_t *pre = s->post_norm ? NULL : w;
        const int post = s->post_norm;
        TEAM_PHASE(team, p + LN1, post && !(s->qlayers && l == 0) ? 0 : rows_items,
                   norm_rows(s, pre ? w->ln1_w : NULL, w->ln1_b, ROWS(i)));
        TEAM_PHASE(team, p + QKV, matmul_items(3 * d),
                   step_matmul(s, i, qkv, 3 * d, x, d, w->qkv_w, QW(qkv), w->qkv_b, d, 3 * d, POST_NONE));
        TEAM_PHASE(team, p + KV_COPY, M, copy_kv(s, w, qkv + i * 3 * d + d, s->slots[i]));
        TEAM_PHASE(team, p + SELF_ATT, s->n_self,
                   attend_item(s->self_items[i], qkv, 3 * d, w->k_cache, w->v_cache, s->self_tables, s->self_stride,
                               s->self_lens, NULL, H, D, block_size, scale, scores, part, C, s->bias,
                               s->bias_stride, s->kv_bf16, 0));
        TEAM_PHASE(team, p + SELF_JOIN, M, join_rows(s, s->self_lens, i));
        TEAM_PHASE(team, p + O1, matmul_items(d),
                   step_matmul(s, i, h, d, a, d, w->o1_w, QW(o1), w->o1_b, d, d, POST_ADD));
        TEAM_PHASE(team, p + LN2, rows_items,
                   norm_rows(s, pre ? w->ln2_w : w->ln1_w, pre ? w->ln2_b : w->ln1_b, ROWS(i)));
        TEAM_PHASE(team, p + Q, matmul_items(d),
                   step_matmul(s, i, q, d, x, d, w->q_w, QW(q), w->q_b, d, d, POST_NONE));
        TEAM_PHASE(team, p + CROSS_ATT, s->n_cross,
                   attend_item(s->cross_items[i], q, d, w->k_cache, w->v_cache, s->cross_tables, s->cross_stride,
                               s->cross_lens, s->next, H, D, block_size, scale, scores, part, C, NULL, 0,
                               s->kv_bf16, s->cross_i8 ? block_size * d * (s->kv_bf16 ? 2 : 4) : 0));
        TEAM_PHASE(team, p + CROSS_JOIN, M, join_rows(s, s->cross_lens, i));
        TEAM_PHASE(team, p + O2, matmul_items(d),
                   step_matmul(s, i, h, d, a, d, w->o2_w, QW(o2), w->o2_b, d, d, POST_ADD));
        TEAM_PHASE(team, p + LN3, rows_items,
                   norm_rows(s, pre ? w->ln3_w : w->ln2_w, pre ? w->ln3_b : w->ln2_b, ROWS(i)));
        TEAM_PHASE(team, p + FC1, matmul_items(ffn),
                   step_matmul(s, i, f, ffn, x, d, w->fc1_w, QW(fc1), w->fc1_b, d, ffn, s->ffn_post));
        TEAM_PHASE(team, p + QF, s->qlayers ? rows_items : 0, quantize_step_rows(s, f, ffn, ffn, ROWS(i)));
        TEAM_PHASE(team, p + FC2, matmul_items(d),
                   step_matmul(s, i, h, d, f, ffn, w->fc2_w, QW(fc2), w->fc2_b, ffn, d, POST_ADD));
        TEAM_PHASE(team, p + LN_OUT, post ? rows_items : 0, norm_rows(s, w->ln3_w, w->ln3_b, ROWS(i)));
#undef ROWS
#undef QW
    }
}

/* Fills *s for a step of decoder_step_f32's arguments whose job runs `extra`
 * more phases after the layers' (draft_step.h); returns its scratch (free it
 * after team_run), or NULL where that could not be allocated or ffn_post is
 * neither activation. */
static char *step_init(
    step_t *s, float *h, float *work, int64_t M, int64_t d, int64_t H, int64_t ffn, float eps, float scale,
    const layer_t *layers, int64_t num_layers, int64_t block_size, const int64_t *slots,
    const int32_t *self_tables, int64_t self_stride, const int32_t *self_lens,
    const int32_t *cross_tables, int64_t cross_stride, const int32_t *cross_lens, int num_threads, int ffn_post,
    const qlayer_t *qlayers, int rms_norm, const float *bias, int64_t bias_stride, int kv_bf16, int post_norm,
    int cross_i8, int64_t extra)
{
    if (ffn_post != POST_GELU && ffn_post != POST_RELU) return NULL;
    const int32_t self_longest = max_len(self_lens, M), cross_longest = max_len(cross_lens, M);
    const int64_t C = num_chunks(self_longest > cross_longest ? self_longest : cross_longest);
    const int64_t P = PHASES * num_layers + extra, nt = num_threads > 1 ? num_threads : 1;
    const int64_t scores_size = (int64_t)CHUNK * H * GROUP_MAX;
    /* One block: the parts (M * C of H D + 2 H), each thread's scores, both
     * attentions' item lists, the rows' leaders and next (find_groups), the
     * phase counters. */
    const size_t part_bytes = sizeof(float) * (size_t)(M * C * (d + 2 * H) + nt * scores_size + M);
    const size_t counter_bytes = sizeof(atomic_int) * 2 * (P + 1);
    const size_t xq_bytes = qlayers ? (size_t)(M * quad_row_bytes(d > ffn ? d : ffn)) : 0;
    char *block = malloc(part_bytes + sizeof(int64_t) * 2 * M * (C + 1) + counter_bytes + xq_bytes);
    if (!block) return NULL;
    float *part = (float *)block;
    int64_t *self_items = (int64_t *)(block + part_bytes), *cross_items = self_items + M * C;
    int64_t *leader = cross_items + M * C, *next = leader + M;  /* rows sharing a cross table */
    atomic_int *counters = (atomic_int *)(next + M);
    memset(counters, 0, sizeof(atomic_int) * 2 * (P + 1));
    find_groups(leader, next, cross_tables, cross_stride, cross_lens, M, block_size);
    *s = (step_t){
        .h = h, .x = work, .qkv = work + M * d, .q = work + 4 * M * d, .a = work + 5 * M * d, .f = work + 6 * M * d,
        .part = part, .scores_all = part + M * C * (d + 2 * H), .layers = layers, .slots = slots,
        .self_items = self_items, .cross_items = cross_items, .next = next, .self_tables = self_tables,
        .self_lens = self_lens, .cross_tables = cross_tables, .cross_lens = cross_lens, .M = M, .d = d, .H = H,
        .ffn = ffn, .num_layers = num_layers, .block_size = block_size, .self_stride = self_stride,
        .cross_stride = cross_stride, .C = C, .scores_size = scores_size,
        .n_self = list_items(self_items, self_lens, NULL, M, C),
        .n_cross = list_items(cross_items, cross_lens, leader, M, C), .eps = eps, .scale = scale,
        .ffn_post = ffn_post, .qlayers = qlayers, .rms_norm = rms_norm, .post_norm = post_norm, .bias = bias,
        .bias_stride = bias_stride, .kv_bf16 = kv_bf16, .cross_i8 = cross_i8,
        .rs = part + M * C * (d + 2 * H) + nt * scores_size,
        .xq = (uint8_t *)counters + counter_bytes,
        .team = {0, 0, counters, counters + P + 1},
    };
    return block;
}

/* h: (M, d) residual stream, updated in place. work: at least M * (6 d + ffn)
 * floats. layers: num_layers of layer_t. slots: (M,) int64, where each row's
 * new K/V goes; self tables/lens include the new token. Runs on up to
 * num_threads threads (team.h). ffn_post: fc1's activation, POST_GELU or
 * POST_RELU. qlayers: num_layers of qlayer_t (int8 matmuls; the matmul
 * weights of layers are then not read), or NULL. rms_norm: T5's norms (their
 * biases unused); bias: self-attention's distance table (H, bias_stride,
 * bias_stride >= the longest self length), or NULL. Biases of matmuls may be
 * NULL (none). kv_bf16: the layers' caches hold bfloat16 (else float32).
 * post_norm: BART's post-norm layers (the header).
 * Returns 0, or -1 where the scratch could not be allocated, or ffn_post is
 * neither (then nothing was done). */
int decoder_step_f32(
    float *h, float *work, int64_t M, int64_t d, int64_t H, int64_t ffn, float eps, float scale,
    const layer_t *layers, int64_t num_layers, int64_t block_size, const int64_t *slots,
    const int32_t *self_tables, int64_t self_stride, const int32_t *self_lens,
    const int32_t *cross_tables, int64_t cross_stride, const int32_t *cross_lens, int num_threads, int ffn_post,
    const qlayer_t *qlayers, int rms_norm, const float *bias, int64_t bias_stride, int kv_bf16, int post_norm)
{
    step_t step;
    char *block = step_init(&step, h, work, M, d, H, ffn, eps, scale, layers, num_layers, block_size, slots,
                            self_tables, self_stride, self_lens, cross_tables, cross_stride, cross_lens, num_threads,
                            ffn_post, qlayers, rms_norm, bias, bias_stride, kv_bf16, post_norm, 0, 0);
    if (!block) return -1;
    team_run(step_job, &step, num_threads > 1 ? num_threads : 1);
    free(block);
    return 0;
}

#include "draft_step.h" /* a draft's whole step: embedding, these layers, its head and argmax */
