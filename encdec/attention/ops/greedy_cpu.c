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

#include "vector_math.h"

const char *greedy_path(void) { return VM_PATH; }

#if defined(VM_VL)
/* The sum of exp() in double lanes: ~35k terms a Whisper row, and a float
 * lane's running sum drifts by 1e-5 relative (measured against float64). */
#if VM_VL == 16
typedef __m512d acc_d;
#define ACC_ZERO() _mm512_setzero_pd()
#define ACC_ADD(acc, v, half) _mm512_add_pd(acc, _mm512_cvtps_pd(half ? _mm512_extractf32x8_ps(v, 1) : _mm512_castps512_ps256(v)))
#define ACC_SUM(a) _mm512_reduce_add_pd(a)
#else
typedef __m256d acc_d;
#define ACC_ZERO() _mm256_setzero_pd()
#define ACC_ADD(acc, v, half) _mm256_add_pd(acc, _mm256_cvtps_pd(half ? _mm256_extractf128_ps(v, 1) : _mm256_castps256_ps128(v)))
static inline double acc_sum(__m256d a) {
    double s[4];
    _mm256_storeu_pd(s, a);
    return (s[0] + s[1]) + (s[2] + s[3]);
}
#define ACC_SUM(a) acc_sum(a)
#endif
#endif

/* x: (R, V), rows ``stride`` floats apart; tok, rank: (R,) int64; lp: (R,). */
int greedy_logprob_f32(const float *x, int64_t R, int64_t V, int64_t stride, int64_t *tok, float *lp,
                       int64_t *rank, int threads) {
    int bad = 0;
#pragma omp parallel for if (threads > 1) num_threads(threads) schedule(static) reduction(| : bad)
    for (int64_t r = 0; r < R; r++) {
        const float *row = x + r * stride;
        const float mx = vm_max_of(row, V);
        if (!isfinite(mx)) {
            bad = 1;
            continue;
        }
        int64_t first = -1, ties = 0, t = 0;
        unsigned nan = 0;
        double sum = 0.0;
#if defined(VM_VL)
        const vm_vec mv = VM_SET1(mx);
        acc_d lo = ACC_ZERO(), hi = ACC_ZERO();
        for (; t + VM_VL <= V; t += VM_VL) {
            const vm_vec v = VM_LOAD(row + t);
            const vm_vec e = vm_exp(VM_SUB(v, mv));
            lo = ACC_ADD(lo, e, 0);
            hi = ACC_ADD(hi, e, 1);
            const unsigned eq = VM_EQ_BITS(v, mv);
            nan |= VM_NAN_BITS(v);
            if (eq) {
                if (first < 0) first = t + __builtin_ctz(eq);
                ties += __builtin_popcount(eq);
            }
        }
        sum = ACC_SUM(lo) + ACC_SUM(hi);
#endif
        for (; t < V; t++) {
            nan |= isnan(row[t]);
            sum += (double)expf(row[t] - mx);
            if (row[t] == mx) {
                if (first < 0) first = t;
                ties++;
            }
        }
        if (nan) {
            bad = 1;
            continue;
        }
        tok[r] = first;
        lp[r] = (float)-log(sum);
        rank[r] = ties;
    }
    return bad;
}
