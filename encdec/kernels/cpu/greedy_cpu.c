/* Greedy choice with its log-probability, CPU, float32, one pass a row:
 *
 *     tok  = the first index of the row's maximum          (torch.argmax)
 *     lp   = -log(sum_t exp(x_t - max))                    (log_softmax at tok)
 *     rank = how many entries equal the maximum            (ties share a rank)
 *
 * Why: a greedy Whisper step asks for its token's log-probability
 * (avg_logprob), and the sampler's general path runs a vocab-wide
 * log_softmax into a new (rows, vocab) tensor, a gather, a vocab-wide ">="
 * for the rank and torch's argmax: 1.29 ms a step at 7 rows of 51865 (torch's
 * argmax alone 0.5 ms), 0.29 ms at one row (tiny.en, AMD EPYC). This reads
 * the row twice (the max, then exp and ties) and writes nothing vocab-wide.
 *
 * Lanes and exp() from vector_math.h (AVX-512, AVX2+FMA); the portable build
 * is not used (greedy_cpu.py: scalar expf is slower than torch). The sum of
 * exp() runs in double lanes, so lp is within float32 rounding of a float64
 * log_softmax (torch's float sum drifts by a few 1e-6 at this length).
 * Returns 1 when a row holds a NaN (torch's argmax would pick it) or has no
 * finite maximum: the caller runs the general path.
 */
#include <math.h>
#include <stdint.h>

#include "team.h"
#include "vector_math.h"

const char *greedy_path(void) { return VM_PATH; }

typedef struct {
    const float *x;
    int64_t R, V, stride;
    int64_t *tok, *rank;
    float *lp;
    atomic_int bad;
    team_t team;
} greedy_job_t;

/* Row r's token, and its log-prob and rank unless lp is NULL (argmax only: no
 * exp() over the row); 1 where the row holds a NaN or no finite value. */
static int greedy_row(greedy_job_t *j, int64_t r) {
    const float *x = j->x;
    const int64_t V = j->V, stride = j->stride;
    int64_t *tok = j->tok, *rank = j->rank;
    float *lp = j->lp;
    const float *row = x + r * stride;
    const float mx = vm_max_of(row, V);
    if (!isfinite(mx)) return 1;
    int64_t first = -1, ties = 0, t = 0;
    unsigned nan = 0;
    double sum = 0.0;
#if defined(VM_VL)
    const vm_vec mv = VM_SET1(mx);
    vm_dsum acc = vm_dsum_zero();
    for (; t + VM_VL <= V; t += VM_VL) {
        const vm_vec v = VM_LOAD(row + t);
        if (lp) vm_dsum_add(&acc, vm_exp(VM_SUB(v, mv)));
        const unsigned eq = VM_EQ_BITS(v, mv);
        nan |= VM_NAN_BITS(v);
        if (eq) {
            if (first < 0) first = t + __builtin_ctz(eq);
            ties += __builtin_popcount(eq);
        }
    }
    sum = vm_dsum_total(acc);
#endif
    for (; t < V; t++) {
        nan |= isnan(row[t]);
        if (lp) sum += (double)expf(row[t] - mx);
        if (row[t] == mx) {
            if (first < 0) first = t;
            ties++;
        }
    }
    if (nan) return 1;
    tok[r] = first;
    if (lp) {
        lp[r] = (float)-log(sum);
        rank[r] = ties;
    }
    return 0;
}

static void greedy_job(void *arg, int tid) {
    greedy_job_t *j = arg;
    (void)tid;
    TEAM_PHASE(&j->team, 0, j->R, if (greedy_row(j, i)) atomic_store(&j->bad, 1));
}

/* x: (R, V), rows ``stride`` floats apart; tok, rank: (R,) int64; lp: (R,).
 * Rows are taken one at a time by whichever thread is free (team.h). */
int greedy_logprob_f32(const float *x, int64_t R, int64_t V, int64_t stride, int64_t *tok, float *lp,
                       int64_t *rank, int threads) {
    atomic_int counters[2] = {0, 0};
    greedy_job_t job = {x, R, V, stride, tok, rank, lp, 0, {0, 0, counters, counters + 1}};
    team_run(greedy_job, &job, threads);
    return atomic_load(&job.bad);
}

/* tok: (R,) int64, each row's first maximum, as torch.argmax; 1 as above.
 * Why: torch's argmax took 7.6 ms on 64 rows of M2M100's 128112 logits and
 * 4.3 ms on 37, this 0.88 and 0.53 ms (Xeon family 6 model 207, AVX-512,
 * 2 threads, random logits, 50 calls each): about 0.4 s of a 64-request
 * greedy M2M100 run (123 steps). */
int greedy_argmax_f32(const float *x, int64_t R, int64_t V, int64_t stride, int64_t *tok, int threads) {
    return greedy_logprob_f32(x, R, V, stride, tok, NULL, NULL, threads);
}
