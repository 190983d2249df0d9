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
 * The threads (team_run): the caller and up to nt - 1 threads of a pool this
 * library starts once. The caller starts on the work at once and never waits
 * for a pool thread to arrive, only for items taken and not finished: a pool
 * thread whose core is taken joins when it gets one, or finds the job done.
 * (An OpenMP region ends at a barrier every thread must reach: a worker that
 * had not even started yet held the caller there until the scheduler ran it.)
 *
 * Where the pool threads run (team_place_pool): on any CPU the caller may use
 * but the one it is on. Why: a pool thread asleep between jobs is woken by the
 * caller, and with every CPU busy (ours and one busy process on this 2-core
 * host) the kernel put it on the waker's CPU, beside the caller: our two
 * threads then took turns on one core for the whole job while the busy process
 * kept the other. Kept off the caller's CPU, the pool thread shares the busy
 * process's core instead, and we get 1.5 cores of 2. Measured (AMD EPYC,
 * AVX-512, 2 threads, one `while True: pass` process, medians of 3 means, kept
 * off and not alternating): the dense attention over two tiny.en windows 62.1
 * -> 54.4 ms (idle 39.5 either way), tiny.en's LM head at 8 rows 4.99 -> 4.10 ms
 * (idle 2.73 and 2.75).
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
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#define TEAM_SPIN_NS 50000

/* Subnormal floats (below 2^-126 ~ 1.2e-38) read and written as zero while a
 * job runs: the x86 MXCSR's flush-to-zero and denormals-are-zero bits.
 * Why: a softmax over sharply peaked scores (random weights at m2m100_418M's
 * dims; real checkpoints' attention sinks) makes exp() of scores more than
 * ~87 below the row max subnormal, and each FMA that reads or writes one
 * takes a microcode assist of ~100 cycles. Measured on this kind of host
 * (avx512): the dense kernel at 510 tokens x 16 heads went 4.6 ms -> 92 ms
 * with scores of std 30; m2m100's encoder attention ran 3-5x slower than its
 * FLOPs. A value that small next to the row max's exp(0) = 1 (or in any
 * product or sum of normal-range activations) changes no float32 result.
 * Per thread: the pool threads set it once (they run only our jobs); the
 * caller's own mode is put back when the job ends, so torch and numpy on
 * that thread keep theirs. Other architectures keep their default. */
#if defined(__x86_64__) || defined(__i386__)
#define TEAM_FTZ_DAZ 0x8040u /* MXCSR bit 15 flush-to-zero, bit 6 denormals-are-zero */
static inline unsigned team_ftz_begin(void) {
    const unsigned saved = _mm_getcsr();
    _mm_setcsr(saved | TEAM_FTZ_DAZ);
    return saved;
}
static inline void team_ftz_end(unsigned saved) { _mm_setcsr(saved); }
#else
static inline unsigned team_ftz_begin(void) { return 0; }
static inline void team_ftz_end(unsigned saved) { (void)saved; }
#endif

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

/* Sleeps while *word reads value, counted in *sleepers. A waker changes
 * *word, then looks at *sleepers (both seq_cst): either it sees this thread
 * counted and wakes it, or this thread's last look sees the change. */
static void team_sleep(atomic_int *word, int value, atomic_int *sleepers) {
    atomic_fetch_add_explicit(sleepers, 1, memory_order_seq_cst);
    if (atomic_load_explicit(word, memory_order_seq_cst) == value)  /* the kernel sleeps only while it still is */
        syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, value, NULL, NULL, 0);
    atomic_fetch_sub_explicit(sleepers, 1, memory_order_seq_cst);
}

/* After *word changed (seq_cst): wakes those asleep on it. */
static void team_wake_word(atomic_int *word, atomic_int *sleepers) {
    if (atomic_load_explicit(sleepers, memory_order_seq_cst))
        syscall(SYS_futex, word, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

/* Whether a spinning wait that began at start should sleep now (every 64 spins it looks at the clock). */
static inline int team_spun_enough(int spins, int64_t start) {
    return (spins & 63) == 63 && team_now_ns() - start >= TEAM_SPIN_NS;
}

static void team_wake(team_t *t) { team_wake_word(&t->phase, &t->sleepers); }

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
static inline void team_wait(team_t *t, int p, int64_t n) {
    if (n == 0) {  /* no item: the first thread here opens the next phase */
        int expected = p;
        if (atomic_compare_exchange_strong(&t->phase, &expected, p + 1)) team_wake(t);
    }
    const int64_t start = team_now_ns();
    int seen;
    for (int spins = 0; (seen = atomic_load_explicit(&t->phase, memory_order_acquire)) <= p; spins++) {
        if (team_spun_enough(spins, start)) team_sleep(&t->phase, seen, &t->sleepers);
        else team_relax();
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

typedef void (*team_job)(void *ctx, int tid);

/* This library's pool: threads started on first use, asleep between jobs. */
#define TEAM_MAX_THREADS 64
static struct {
    pthread_mutex_t lock;   /* one job at a time: a second caller meanwhile runs alone */
    int started;            /* pool threads running */
    atomic_int generation;  /* bumped for each job; idle pool threads sleep on it */
    atomic_int idle_sleepers;
    atomic_int open;        /* the job takes pool threads still */
    atomic_int active;      /* pool threads inside the job; the caller waits for 0 at its end */
    atomic_int active_sleepers;
    atomic_int next_tid;
    int want;               /* the job takes tids 1 .. want */
    team_job job;
    void *ctx;
    atomic_int tids[TEAM_MAX_THREADS];  /* the pool threads' kernel thread ids, 0 until each has started */
    int placed_off;         /* 1 + the caller's CPU the pool threads were last kept off; 0: not yet */
} team_pool = {PTHREAD_MUTEX_INITIALIZER};

/* glibc exports it whatever the feature macros (the vDSO's getcpu: no system call). */
extern int sched_getcpu(void);

#define TEAM_MASK_WORDS 16  /* CPUs 0 .. 1023 */

/* Keeps the pool threads off the CPU the caller is on (the header says why):
 * their affinity becomes the caller's less that CPU. Only when the caller has
 * moved since the last time (two system calls a thread), and not where the
 * caller may use just one CPU. With the pool lock held. */
static void team_place_pool(void) {
    const int cpu = sched_getcpu();
    if (cpu < 0 || cpu >= 64 * TEAM_MASK_WORDS || cpu + 1 == team_pool.placed_off) return;
    unsigned long mask[TEAM_MASK_WORDS] = {0};
    if (syscall(SYS_sched_getaffinity, 0, sizeof mask, mask) <= 0) return;
    mask[cpu / 64] &= ~(1ul << (cpu % 64));
    int others = 0;
    for (int w = 0; w < TEAM_MASK_WORDS; w++) others |= mask[w] != 0;
    if (!others) return;
    int all = 1;
    for (int t = 0; t < team_pool.started; t++) {
        const int tid = atomic_load_explicit(&team_pool.tids[t], memory_order_acquire);
        if (tid <= 0)
            all = 0;  /* not started yet: again at the next job */
        else  /* refused (a cpuset that changed meanwhile): the thread stays where it was, as before this */
            (void)syscall(SYS_sched_setaffinity, tid, sizeof mask, mask);
    }
    team_pool.placed_off = all ? cpu + 1 : 0;
}

static void *team_pool_thread(void *arg) {
    int seen = (int)(intptr_t)arg;
    for (int t = 0, none = 0; t < TEAM_MAX_THREADS; t++, none = 0)  /* the first free slot */
        if (atomic_compare_exchange_strong(&team_pool.tids[t], &none, (int)syscall(SYS_gettid))) break;
    (void)team_ftz_begin(); /* for the thread's life: it runs only our jobs */
    for (;;) {
        /* Idle: spin a little (jobs often come back to back: a decode step, then
         * its LM head), then sleep until the next job. */
        const int64_t start = team_now_ns();
        int g;
        for (int spins = 0; (g = atomic_load_explicit(&team_pool.generation, memory_order_acquire)) == seen; spins++) {
            if (team_spun_enough(spins, start)) team_sleep(&team_pool.generation, seen, &team_pool.idle_sleepers);
            else team_relax();
        }
        seen = g;
        /* Counted in active before looking at open (both seq_cst), as the caller
         * closes open before looking at active: either this thread sees the job
         * closed or the caller waits for it. */
        atomic_fetch_add_explicit(&team_pool.active, 1, memory_order_seq_cst);
        if (atomic_load_explicit(&team_pool.open, memory_order_seq_cst)
                && atomic_load_explicit(&team_pool.generation, memory_order_seq_cst) == g) {
            const int tid = atomic_fetch_add_explicit(&team_pool.next_tid, 1, memory_order_relaxed);
            if (tid <= team_pool.want) team_pool.job(team_pool.ctx, tid);
        }
        if (atomic_fetch_sub_explicit(&team_pool.active, 1, memory_order_seq_cst) == 1)
            team_wake_word(&team_pool.active, &team_pool.active_sleepers);
    }
    return NULL;
}

/* A forked child has none of the parent's pool threads: it starts its own. */
static void team_pool_after_fork(void) {
    pthread_mutex_init(&team_pool.lock, NULL);
    team_pool.started = 0;
    atomic_store(&team_pool.idle_sleepers, 0);
    atomic_store(&team_pool.active, 0);
    atomic_store(&team_pool.active_sleepers, 0);
    atomic_store(&team_pool.open, 0);
    for (int t = 0; t < TEAM_MAX_THREADS; t++) atomic_store(&team_pool.tids[t], 0);
    team_pool.placed_off = 0;
}

static void team_pool_register_fork(void) { pthread_atfork(NULL, NULL, team_pool_after_fork); }

/* Runs job(ctx, tid) on this thread (tid 0) and on the pool threads that join
 * while it runs (tids 1 .. nt - 1, each at most once; some may never come).
 * The job hands out its work as items (TEAM_PHASE), so it is done when this
 * thread's call returns; team_run then waits for the pool threads still inside
 * it to leave. With nt <= 1, another job running, or no pool thread to be
 * had, this thread runs it alone. */
static inline void team_run(team_job job, void *ctx, int nt) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    if (nt > TEAM_MAX_THREADS) nt = TEAM_MAX_THREADS;
    const unsigned fp_mode = team_ftz_begin();
    if (nt <= 1 || pthread_mutex_trylock(&team_pool.lock) != 0) {
        job(ctx, 0);
        team_ftz_end(fp_mode);
        return;
    }
    pthread_once(&once, team_pool_register_fork);
    const int gen = atomic_load_explicit(&team_pool.generation, memory_order_relaxed);
    while (team_pool.started < nt - 1) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int ok = pthread_create(&thread, &attr, team_pool_thread, (void *)(intptr_t)gen) == 0;
        pthread_attr_destroy(&attr);
        if (!ok) break;
        team_pool.started++;
    }
    team_place_pool();
    team_pool.job = job;
    team_pool.ctx = ctx;
    team_pool.want = nt - 1 < team_pool.started ? nt - 1 : team_pool.started;
    atomic_store_explicit(&team_pool.next_tid, 1, memory_order_relaxed);
    atomic_store_explicit(&team_pool.open, 1, memory_order_seq_cst);
    atomic_store_explicit(&team_pool.generation, gen + 1, memory_order_seq_cst);
    team_wake_word(&team_pool.generation, &team_pool.idle_sleepers);
    job(ctx, 0);
    atomic_store_explicit(&team_pool.open, 0, memory_order_seq_cst);
    const int64_t start = team_now_ns();
    int inside;
    for (int spins = 0; (inside = atomic_load_explicit(&team_pool.active, memory_order_seq_cst)) != 0; spins++) {
        if (team_spun_enough(spins, start)) team_sleep(&team_pool.active, inside, &team_pool.active_sleepers);
        else team_relax();
    }
    pthread_mutex_unlock(&team_pool.lock);
    team_ftz_end(fp_mode);
}

#endif /* ENCDEC_TEAM_H */
