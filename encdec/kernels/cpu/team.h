/* How the threads of one parallel region share work on a host whose cores
 * other processes use too (a server's HTTP workers, a second model, the rest
 * of a Ray node).
 *
 * The threads run the same list of phases (a matmul, an attention, the
 * LayerNorm of some rows, ...). A phase is n items, each taken by whichever
 * thread asks first (an atomic counter), so a thread on a busy core, or one
 * descheduled, does fewer of them; the phase ends when its last item is
 * done, by whoever did it. A thread that comes late finds the phases it
 * missed already done and skips them: no thread waits for another to arrive,
 * only for items that are taken and not yet finished.
 *
 * Why: a fixed half per thread and a barrier between phases made every phase
 * as slow as the slower thread. With one busy process on this 2-core host
 * the kernel's two threads and the busy one share two cores, so one of ours
 * is off its core every few milliseconds, for a time slice; its partner spun
 * at the barrier through that slice, and tiny.en's long-form transcription
 * went 3.7 s -> 8.4-23.2 s (CTranslate2 1.25-1.5x).
 *
 * Waiting (team_wait): spin about TEAM_SPIN_NS, then sleep on a futex. The
 * spin covers the usual case, a partner a few microseconds from the end of
 * its last item, at no syscall cost (a futex sleep and wake-up take 5-50 us).
 * Past it the partner was most likely descheduled: sleeping frees our core,
 * so the scheduler can run the partner (or the process that took its core)
 * there, instead of us spinning through its time slice.
 */
#ifndef ENCDEC_TEAM_H
#define ENCDEC_TEAM_H

#include <limits.h>
#include <linux/futex.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define TEAM_SPIN_NS 50000

typedef struct {
    atomic_int phase;     /* the phase now open: every item of the earlier ones is done (the futex word) */
    atomic_int sleepers;  /* threads asleep (or about to be) on phase */
    atomic_int *next;     /* per phase: items taken so far */
    atomic_int *done;     /* per phase: items finished */
} team_t;

static inline void team_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static inline int64_t team_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* The next item of phase p (of n) for this thread, or -1: none left, or the
 * phase is over (a late thread skips it without touching its counter). */
static inline int64_t team_take(team_t *t, int p, int64_t n) {
    if (atomic_load_explicit(&t->phase, memory_order_acquire) > p) return -1;
    const int64_t i = atomic_fetch_add_explicit(&t->next[p], 1, memory_order_relaxed);
    return i < n ? i : -1;
}

/* After phase was moved on (seq_cst): wakes the sleepers. A waiter counts
 * itself in sleepers (seq_cst) before its last look at phase, so either it
 * sees the new phase or it is counted here and woken. */
static void team_wake(team_t *t) {
    if (atomic_load_explicit(&t->sleepers, memory_order_seq_cst))
        syscall(SYS_futex, &t->phase, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

static void team_open(team_t *t, int p) {
    atomic_store_explicit(&t->phase, p, memory_order_seq_cst);
    team_wake(t);
}

/* One item of phase p (of n) is done; the last one opens phase p + 1. The
 * acq_rel count orders every item's writes before the opening. */
static inline void team_done(team_t *t, int p, int64_t n) {
    if (atomic_fetch_add_explicit(&t->done[p], 1, memory_order_acq_rel) + 1 == n) team_open(t, p + 1);
}

/* Returns when phase p (of n items) is over: spins, then sleeps (the header). */
static void team_wait(team_t *t, int p, int64_t n) {
    if (n == 0) {  /* no item: the first thread here opens the next phase */
        int expected = p;
        if (atomic_compare_exchange_strong(&t->phase, &expected, p + 1)) team_wake(t);
    }
    const int64_t start = team_now_ns();
    for (int spins = 0; atomic_load_explicit(&t->phase, memory_order_acquire) <= p; spins++) {
        if ((spins & 63) != 63 || team_now_ns() - start < TEAM_SPIN_NS) {
            team_relax();
            continue;
        }
        atomic_fetch_add_explicit(&t->sleepers, 1, memory_order_seq_cst);
        const int seen = atomic_load_explicit(&t->phase, memory_order_seq_cst);
        if (seen <= p)  /* the kernel sleeps only while phase still reads `seen` */
            syscall(SYS_futex, &t->phase, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
        atomic_fetch_sub_explicit(&t->sleepers, 1, memory_order_seq_cst);
    }
}

/* Run phase p's n items on this thread as long as any is left, then wait for
 * the phase to end. ITEM(i) is a statement using i. */
#define TEAM_PHASE(t, p, n, ITEM)                                   \
    do {                                                            \
        const int64_t team_n_ = (n);                                \
        for (int64_t i; (i = team_take((t), (p), team_n_)) >= 0;) { \
            ITEM;                                                   \
            team_done((t), (p), team_n_);                           \
        }                                                           \
        team_wait((t), (p), team_n_);                               \
    } while (0)

#endif /* ENCDEC_TEAM_H */
