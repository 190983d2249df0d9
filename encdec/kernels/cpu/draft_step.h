/* A draft model's whole greedy decode step on CPU, in one call (decoder_step_cpu.c
 * includes this after its layers' step; decoder_step_cpu.py: draft_step):
 *
 *     h      = tok_embed[token] + pos_embed[position]      Whisper's embedding
 *     h      = the decoder layers (decoder_step_f32's phases, their K/V written at slot)
 *     logits = head(LN(h))                                 int8 (qlayers given) or float32 panels
 *                                                          (int8 with head_q4: draft_head4.h's two stages)
 *     out    = ids[argmax(logits, banned columns at -inf)] numpy's argmax: the first NaN, else the first maximum
 *
 * for the M rows of a speculative proposal, one token a row; each row's slot
 * and self length come from its position and self table. Why: the draft's
 * steps are a third of a speculating Whisper run, and in Python each one spent
 * ~0.5 ms on the model's forward around the layers' call (module calls, new
 * tensors, a metadata object, the LM head's own parallel region); here the
 * layers, the head and the argmax share one parallel region (team.h).
 *
 * The values are those of the op-by-op forward but for the final LayerNorm
 * (layer_norm_rows: torch's to float32 rounding): the embedding's one float
 * add, the layers' step, the head's matmul (the same per-row quantization and
 * panel kernel as small_linear_int8_cpu.c, or small_linear_cpu.c's) bit for bit.
 * A draft's tokens decide no output (the target verifies them), only how many
 * are kept.
 */

/* The fixed arguments of a draft's steps (draft_step.py fills them once per
 * proposal); the rows' arrays hold at least M rows. */
typedef struct {
    int64_t d, H, ffn, num_layers, block_size;
    float eps, scale;
    const layer_t *layers;
    const qlayer_t *qlayers; /* int8 layers and head, or NULL: float32 ones */
    int ffn_post, kv_bf16, num_threads;
    int cross_i8; /* the cross blocks hold int8 records (paged_attention_i8.h: a self-draft's copy) */
    const float *tok_embed, *pos_embed; /* (vocab, d), (positions, d) */
    const float *norm_w, *norm_b;       /* the final LayerNorm */
    float norm_eps;
    const float *head_w;      /* float32 head: small_linear_cpu.c's panels (qlayers NULL) */
    const qlinear_t *head_q;  /* int8 head (qlayers given) */
    const float *head_b;      /* (N,) or NULL */
    int64_t N;                /* the head's columns */
    const int64_t *ids;       /* column -> token id, or NULL: the column is the id */
    const int64_t *banned;    /* columns never chosen (the processors' static bans), n_banned of them */
    int64_t n_banned;
    const int64_t *tokens, *positions; /* (M,) each: the rows' inputs */
    int64_t *slots;                    /* (M,) written: where each row's K/V goes */
    const int32_t *self_tables;        /* (M, self_stride) */
    int64_t self_stride;
    int32_t *self_lens;                /* (M,) written: position + 1 */
    const int32_t *cross_tables;       /* (M, cross_stride) */
    int64_t cross_stride;
    const int32_t *cross_lens;         /* (M,) */
    float *h, *work, *logits;          /* (M, d), M * (6 d + ffn), (M, N) */
    int64_t *out;                      /* (M,) written: each row's token */
    const q4linear_t *head_q4; /* the int8 head's int4 copy: the two-stage head (below), or NULL: int8 alone */
    const int8_t *head_rows;   /* with head_q4: the int8 head's weight (N, d) row-major */
} draft_t;

typedef struct {
    step_t s; /* first: step_job takes the job as a step_t */
    const draft_t *a;
    int64_t p; /* the first phase after the layers' */
    int64_t items, blocks; /* the two-stage head (draft_head4.h): the int4 pass's items, blocks a row */
    float *best;           /* (M, blocks): each block's best int4 score, or NULL: no two-stage head */
} draft_job_t;

#include "draft_head4.h" /* the two-stage head: an int4 pass, then its best candidates in int8 */

/* numpy's argmax of x[0 .. n): the first NaN, else the first maximum (all -inf: 0). */
static int64_t first_argmax(const float *x, int64_t n) {
    float mx = -INFINITY;
    unsigned nan = 0;
    int64_t t = 0;
#if defined(VM_VL)
    vm_vec mv = VM_SET1(-INFINITY);
    for (; t + VM_VL <= n; t += VM_VL) {
        const vm_vec v = VM_LOAD(x + t);
        nan |= VM_NAN_BITS(v);
        mv = VM_MAX(mv, v);
    }
    mx = VM_HMAX(mv);
#endif
    for (; t < n; t++) {
        nan |= isnan(x[t]);
        mx = x[t] > mx ? x[t] : mx;
    }
    for (t = 0; t < n; t++)
        if (nan ? isnan(x[t]) : x[t] == mx) return t;
    return 0;
}

/* Row m's token: its banned columns set to -inf, then the argmax, as an id. */
static void draft_row_token(const draft_t *a, int64_t m) {
    float *row = a->logits + m * a->N;
    for (int64_t b = 0; b < a->n_banned; b++) row[a->banned[b]] = -INFINITY;
    const int64_t j = first_argmax(row, a->N);
    a->out[m] = a->ids ? a->ids[j] : j;
}

/* The final LayerNorm of rows [r0, r1) into x, quantized for an int8 head. */
static void draft_norm_rows(const step_t *s, const draft_t *a, int64_t r0, int64_t r1) {
    layer_norm_rows(s->x, s->h, a->norm_w, a->norm_b, r0, r1, s->d, a->norm_eps);
    quantize_step_rows(s, s->x, s->d, s->d, r0, r1);
}

static void draft_job(void *arg, int tid) {
    draft_job_t *j = arg;
    step_t *s = &j->s;
    const draft_t *a = j->a;
    const int64_t M = s->M, p = j->p;
    step_job(s, tid);
#define ROWS(i) (i) * ROWS_ITEM, ((i) + 1) * ROWS_ITEM < M ? ((i) + 1) * ROWS_ITEM : M
    TEAM_PHASE(&s->team, (int)p, (M + ROWS_ITEM - 1) / ROWS_ITEM, draft_norm_rows(s, a, ROWS(i)));
#undef ROWS
    if (j->best) { /* the two-stage head (draft_head4.h) */
        TEAM_PHASE(&s->team, (int)p + 1, j->items, head4_screen(j, i));
        TEAM_PHASE(&s->team, (int)p + 2, M, head4_row_token(j, i));
        return;
    }
    TEAM_PHASE(&s->team, (int)p + 1, matmul_items(a->N),
               step_matmul(s, i, a->logits, a->N, s->x, s->d, a->head_w, a->head_q, a->head_b, s->d, a->N,
                           POST_NONE));
    TEAM_PHASE(&s->team, (int)p + 2, M, draft_row_token(a, i));
}

/* One greedy step of M rows (draft_t). Returns 0, or -1 where the scratch
 * could not be allocated (then nothing was done). The caller keeps every
 * index in range: tokens and positions of the embeddings, positions within
 * the self tables, banned columns below N. */
int draft_step_f32(const draft_t *a, int64_t M) {
    const int64_t d = a->d;
    for (int64_t m = 0; m < M; m++) {
        const int64_t pos = a->positions[m];
        a->slots[m] = (int64_t)a->self_tables[m * a->self_stride + pos / a->block_size] * a->block_size
                      + pos % a->block_size;
        a->self_lens[m] = (int32_t)(pos + 1);
        const float *te = a->tok_embed + a->tokens[m] * d, *pe = a->pos_embed + pos * d;
        float *hr = a->h + m * d;
        for (int64_t i = 0; i < d; i++) hr[i] = te[i] + pe[i];
    }
    draft_job_t job = {.a = a, .p = PHASES * a->num_layers};
    char *cands = a->head_q4 && a->qlayers ? head4_alloc(&job, M, a->N) : NULL;
    if (a->head_q4 && a->qlayers && !cands) return -1;
    char *block = step_init(&job.s, a->h, a->work, M, d, a->H, a->ffn, a->eps, a->scale, a->layers, a->num_layers,
                            a->block_size, a->slots, a->self_tables, a->self_stride, a->self_lens, a->cross_tables,
                            a->cross_stride, a->cross_lens, a->num_threads, a->ffn_post, a->qlayers, 0, NULL, 0,
                            a->kv_bf16, 0, a->cross_i8, 3);
    if (!block) {
        free(cands);
        return -1;
    }
    team_run(draft_job, &job, a->num_threads > 1 ? a->num_threads : 1);
    free(block);
    free(cands);
    return 0;
}
