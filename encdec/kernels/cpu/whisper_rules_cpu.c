/* Whisper's logits rules for a decode step's rows, CPU, float32, in place:
 * HF's begin-suppress, suppress and WhisperTimeStampLogitsProcessor, in that
 * order (encdec/models/whisper_processors.py states them; it computes each
 * row's flags from the row's output and passes them here).
 *
 * Why: the torch version runs ~20 small ops a step plus a Python loop over
 * rows (0.42 ms at one row, 0.75 ms at 7; tiny.en, AMD EPYC), more than the
 * rules' work on 51865 logits a row. Here it is one call.
 *
 * The timestamp rule compares logsumexp(timestamp logits) with the best text
 * logit (the log-softmax's normaliser cancels, as in the torch version); the
 * exp() sum runs in lanes (vector_math.h) and in double.
 */
#include <math.h>
#include <stdint.h>

#include "vector_math.h"

const char *whisper_rules_path(void) { return VM_PATH; }

/* Per-row flags (flags[r]): bit 0 suppress, bit 1 begin-suppress (first
 * token), bit 2 timestamp rules, bit 3 the last token is a timestamp, bit 4
 * the one before it is a timestamp or missing, bit 5 no output yet. low[r]:
 * the lowest timestamp token allowed. max_initial < 0: no cap on the first
 * timestamp. */
enum { SUPPRESS = 1, BEGIN = 2, TIMESTAMPS = 4, LAST_TS = 8, PENULT_TS = 16, FIRST = 32 };

static void fill(float *x, int64_t from, int64_t to) {
    for (int64_t i = from; i < to; i++) x[i] = -INFINITY;
}

static float logsumexp(const float *x, int64_t n) {
    const float mx = vm_max_of(x, n);
    if (!isfinite(mx)) return mx;  /* all -inf: -inf (torch's too); NaN or +inf pass through */
    double sum = 0.0;
    int64_t t = 0;
#if defined(VM_VL)
    const vm_vec mv = VM_SET1(mx);
    vm_dsum acc = vm_dsum_zero();
    for (; t + VM_VL <= n; t += VM_VL) vm_dsum_add(&acc, vm_exp(VM_SUB(VM_LOAD(x + t), mv)));
    sum = vm_dsum_total(acc);
#endif
    for (; t < n; t++) sum += expf(x[t] - mx);
    return mx + (float)log(sum);
}

void whisper_rules_f32(float *logits, int64_t R, int64_t V, int64_t stride, const int32_t *flags,
                       const int64_t *low, const int64_t *suppress, int64_t n_suppress, const int64_t *begin,
                       int64_t n_begin, int64_t no_ts, int64_t eos, int64_t tb, int64_t max_initial) {
    for (int64_t r = 0; r < R; r++) {
        float *x = logits + r * stride;
        const int f = flags[r];
        if (f & BEGIN)
            for (int64_t i = 0; i < n_begin; i++) x[begin[i]] = -INFINITY;
        if (f & SUPPRESS)
            for (int64_t i = 0; i < n_suppress; i++) x[suppress[i]] = -INFINITY;
        if (!(f & TIMESTAMPS)) continue;
        x[no_ts] = -INFINITY;
        if (f & LAST_TS) {
            if (f & PENULT_TS) fill(x, tb, V);  /* a pair just closed: text (or eos) next */
            else fill(x, 0, eos);               /* an open pair: its closing timestamp or eos */
        }
        if (f & FIRST) {  /* the first token is a timestamp, at most max_initial in */
            fill(x, 0, tb);
            if (max_initial >= 0 && tb + max_initial + 1 < V) fill(x, tb + max_initial + 1, V);
        }
        fill(x, tb, low[r] < V ? low[r] : V);  /* monotonic */
        if (logsumexp(x + tb, V - tb) > vm_max_of(x, tb)) fill(x, 0, tb);
    }
}
