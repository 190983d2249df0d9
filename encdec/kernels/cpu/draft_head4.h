/* A CPU draft's two-stage LM head (draft_step.h includes this; draft_t's
 * head_q4): every column scored from the int8 head's int4 copy
 * (small_linear_int4.h: half the bytes), each row's HEAD4_CAND best columns
 * scored again exactly in int8, and the argmax taken over those.
 *
 * Phase 1 (items of column panels, over the threads): the int4 scores into
 * the logits, the row's banned columns set to -inf, and each block of 16
 * columns' best score (a NaN if it has one) while they are in cache.
 * Phase 2 (one item a row): the row's HEAD4_CAND best blocks, then its
 * HEAD4_CAND best columns within them (the best columns lie in the best
 * blocks: a block ranked below HEAD4_CAND others holds no column above their
 * HEAD4_CAND bests), each scored as small_linear_int8_cpu.c's panel kernel
 * scores it (the same int32 sum and epilogue: bit for bit), written over its
 * int4 score, bans applied again, and numpy's argmax over them in column
 * order (the first NaN, else the first maximum).
 *
 * So the token is the int8 head's whenever the int8 winner is among the
 * candidates: "best" puts a NaN first and, at equal scores, the lower
 * column, so a NaN row or a row of ties gets the int8 head's answer too.
 * Otherwise a different draft costs acceptance, never exactness (the target
 * verifies every draft).
 */

/* Candidates a row. Measured on Whisper base's head with 1484 rows of draft
 * steps (the final LayerNorm's, from a 2- and an 8-minute run): the int8
 * winner was the int4 pass's best in 93.3%, among its best 16 in 99.8%, 32 in
 * 99.87% (ranks 37 and 38 missed), 64 in all. Phase 2 at 32 takes ~25 us of a
 * one-row step (~11 selecting, ~12 the int8 rows, from memory), ~3% of what
 * the int4 pass saves; in the draft steps of 8-minute runs the token was the
 * int8 head's in every one (base 1187, tiny 1139). */
#define HEAD4_CAND 32
#define HEAD4_BLOCK 16 /* columns a block */

/* Whether score v of column n ranks before w of column wn: a NaN first, then
 * the higher score, then the lower column. */
static inline int head4_better(float v, int64_t n, float w, int64_t wn) {
    if (isnan(v) || isnan(w)) return isnan(v) && (!isnan(w) || n < wn);
    return v > w || (v == w && n < wn);
}

/* Column n (score v) into the list idx/val of *cnt, best first, kept at HEAD4_CAND at most. */
static inline void head4_insert(int64_t *idx, float *val, int32_t *cnt, int64_t n, float v) {
    int32_t at = *cnt < HEAD4_CAND ? *cnt : HEAD4_CAND - 1;
    if (*cnt == HEAD4_CAND && !head4_better(v, n, val[at], idx[at])) return;
    for (; at > 0 && head4_better(v, n, val[at - 1], idx[at - 1]); at--) {
        idx[at] = idx[at - 1];
        val[at] = val[at - 1];
    }
    idx[at] = n;
    val[at] = v;
    if (*cnt < HEAD4_CAND) (*cnt)++;
}

/* The best entries of x[n0, n1) into the list, in index order: one enters
 * only past the list's last (a NaN, or above it: a tie loses to the lower
 * index already there), so the scan skips 16 at a time below it. */
static void head4_scan(const float *x, int64_t n0, int64_t n1, int64_t *idx, float *val, int32_t *cnt) {
    int64_t n = n0;
    for (; n < n1 && *cnt < HEAD4_CAND; n++) head4_insert(idx, val, cnt, n, x[n]);
#if defined(__AVX512F__)
    for (; n + 16 <= n1; n += 16) {
        __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + n), _mm512_set1_ps(val[HEAD4_CAND - 1]),
                                           _CMP_NLE_UQ); /* above it, or NaN */
        for (; hit; hit &= hit - 1) {
            const int64_t c = n + __builtin_ctz(hit);
            head4_insert(idx, val, cnt, c, x[c]);
        }
    }
#endif
    for (; n < n1; n++)
        if (x[n] > val[HEAD4_CAND - 1] || isnan(x[n])) head4_insert(idx, val, cnt, n, x[n]);
}

/* x[0, n)'s best score: a NaN if it has one, else the maximum. */
static inline float head4_block_best(const float *x, int64_t n) {
#if defined(__AVX512F__)
    if (n == HEAD4_BLOCK) {
        const __m512 v = _mm512_loadu_ps(x);
        return VM_NAN_BITS(v) ? NAN : _mm512_reduce_max_ps(v);
    }
#endif
    float mx = -INFINITY;
    for (int64_t c = 0; c < n; c++) {
        if (isnan(x[c])) return NAN;
        mx = x[c] > mx ? x[c] : mx;
    }
    return mx;
}

/* Item i of phase 1 (the header). */
static void head4_screen(const draft_job_t *j, int64_t i) {
    const step_t *s = &j->s;
    const draft_t *a = j->a;
    const int64_t N = a->N, M = s->M;
    int64_t p0, p1;
    item_panels(i, N, &p0, &p1);
    panel_range_i4(a->logits, N, s->xq, quad_row_bytes(s->d), s->rs, a->head_q4, a->head_b, M, s->d, N, p0, p1);
    const int64_t n0 = p0 * PW, n1 = p1 * PW < N ? p1 * PW : N; /* n0: a whole number of blocks */
    for (int64_t m = 0; m < M; m++) {
        float *row = a->logits + m * N, *best = j->best + m * j->blocks;
        for (int64_t b = 0; b < a->n_banned; b++)
            if (a->banned[b] >= n0 && a->banned[b] < n1) row[a->banned[b]] = -INFINITY;
        for (int64_t c = n0; c < n1; c += HEAD4_BLOCK)
            best[c / HEAD4_BLOCK] = head4_block_best(row + c, n1 - c < HEAD4_BLOCK ? n1 - c : HEAD4_BLOCK);
    }
}

/* Row m's exact int8 logit at column n: panel_range_i8's int32 sum (over the
 * head's row-major int8 weight, head_rows: 8 cache lines a column where the
 * panels spread one over 128) and its epilogue for that one column, bit for bit. */
static float head4_exact(const step_t *s, const draft_t *a, int64_t m, int64_t n) {
    const int8_t *w = a->head_rows + n * s->d;
    const uint8_t *xr = s->xq + m * quad_row_bytes(s->d);
    int32_t acc = 0;
    for (int64_t k = 0; k < s->d; k++) acc += (int32_t)xr[k] * (int32_t)w[k];
    const float v = (float)(acc - a->head_q->comp[n]), sc = s->rs[m] * a->head_q->ws[n];
    return a->head_b ? fmaf(v, sc, a->head_b[n]) : v * sc;
}

/* idx[0, n) ascending. */
static void head4_sort(int64_t *idx, int32_t n) {
    for (int32_t c = 1; c < n; c++)
        for (int32_t e = c; e > 0 && idx[e - 1] > idx[e]; e--) {
            const int64_t t = idx[e];
            idx[e] = idx[e - 1];
            idx[e - 1] = t;
        }
}

/* Phase 2 for row m (the header). */
static void head4_row_token(const draft_job_t *j, int64_t m) {
    const step_t *s = &j->s;
    const draft_t *a = j->a;
    const int64_t N = a->N;
    float *row = a->logits + m * N;
    int64_t blk[HEAD4_CAND], idx[HEAD4_CAND];
    float val[HEAD4_CAND];
    int32_t nblk = 0, cnt = 0;
    head4_scan(j->best + m * j->blocks, 0, j->blocks, blk, val, &nblk);
    head4_sort(blk, nblk); /* the columns in index order (head4_scan's tie rule) */
    for (int32_t b = 0; b < nblk; b++) {
        const int64_t c0 = blk[b] * HEAD4_BLOCK;
        head4_scan(row, c0, c0 + HEAD4_BLOCK < N ? c0 + HEAD4_BLOCK : N, idx, val, &cnt);
    }
    head4_sort(idx, cnt); /* column order: "first" below is numpy's */
    for (int32_t c = 0; c < cnt; c++) /* the candidates' rows fetched at once, not one miss after another */
        for (int64_t off = 0; off < s->d; off += 64)
            _mm_prefetch((const char *)(a->head_rows + idx[c] * s->d + off), _MM_HINT_T0);
    int64_t best = cnt ? idx[0] : 0; /* cnt >= 1: N >= 1 */
    float mx = -INFINITY;
    int nan = 0;
    for (int32_t c = 0; c < cnt; c++) {
        float v = head4_exact(s, a, m, idx[c]);
        for (int64_t b = 0; b < a->n_banned; b++) v = a->banned[b] == idx[c] ? -INFINITY : v;
        row[idx[c]] = v;
        if (!nan && (isnan(v) || v > mx)) {
            best = idx[c];
            mx = v;
            nan = isnan(v);
        }
    }
    a->out[m] = a->ids ? a->ids[best] : best;
}

/* The blocks' best scores' scratch for M rows of a head of N columns, into j; NULL where it could not be allocated. */
static char *head4_alloc(draft_job_t *j, int64_t M, int64_t N) {
    j->items = matmul_items(N);
    j->blocks = (N + HEAD4_BLOCK - 1) / HEAD4_BLOCK;
    char *block = malloc(sizeof(float) * (size_t)(M * j->blocks));
    j->best = (float *)block;
    return block;
}

static void head4_test_job(void *arg, int tid) {
    draft_job_t *j = arg;
    step_t *s = &j->s;
    const int64_t ldq = quad_row_bytes(s->d);
    (void)tid;
    TEAM_PHASE(&s->team, 0, s->M, quantize_row_u8(s->x + i * s->d, s->d, s->xq + i * ldq, s->rs + i));
    TEAM_PHASE(&s->team, 1, j->items, head4_screen(j, i));
    TEAM_PHASE(&s->team, 2, s->M, head4_row_token(j, i));
}

/* Entry point (tests): the two-stage head alone on x (M, K), each row
 * quantized as the step quantizes the final LayerNorm's: logits (M, N) and
 * out (M,) as draft_step_f32 writes them. head: the int8 head (qlinear_t),
 * rows its (N, K) weight, head4 its int4 copy; b, ids may be NULL. work:
 * M * (K4 * 4) bytes, then M floats. Returns 0, or -1 where the scratch could
 * not be allocated. */
int draft_head4_tokens(const float *x, int64_t M, int64_t K, const qlinear_t *head, const int8_t *rows,
                       const q4linear_t *head4, const float *b, int64_t N, const int64_t *ids,
                       const int64_t *banned, int64_t n_banned, float *logits, int64_t *out, void *work,
                       int num_threads) {
    const draft_t a = {.head_q = head, .head_rows = rows, .head_q4 = head4, .head_b = b, .N = N, .ids = ids,
                       .banned = banned, .n_banned = n_banned, .logits = logits, .out = out};
    atomic_int counters[8] = {0}; /* next and done of phases 0-2 and the end (team.h) */
    draft_job_t j = {.a = &a};
    j.s = (step_t){.x = (float *)x, .xq = work, .rs = (float *)((uint8_t *)work + M * quad_row_bytes(K)), .M = M,
                   .d = K, .team = {0, 0, counters, counters + 4}};
    char *cands = head4_alloc(&j, M, N);
    if (!cands) return -1;
    team_run(head4_test_job, &j, num_threads > 1 ? num_threads : 1);
    free(cands);
    return 0;
}
