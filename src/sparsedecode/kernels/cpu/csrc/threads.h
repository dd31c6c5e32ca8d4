/* Included by sparse_step.c (one translation unit): work splitting over persistent worker threads, and the
 * per-thread scratch buffer. */

/* ---------------------------------------------------------------------------------------------------------------
 * Work splitting. A call is a list of independent tasks (KV heads; for selection, ranges of blocks of a head). When
 * it is large enough to pay for it, the tasks are split into contiguous parts over up to `threads` threads (the
 * caller passes torch's thread count): the calling thread runs the first part, persistent workers the others.
 * Workers are started once, on first need, and then wait for their next part: spinning for SPIN_NS, then asleep
 * on a condition variable. A part its worker has not started when the caller is done with its own is taken back
 * and run by the caller (on a machine busier than its cores a worker may wait long for one). One dispatch at a time: a call made while another thread's call holds the workers runs
 * in its own thread. After a fork the child has no workers and starts new ones when needed.
 */
typedef int (*task_fn)(const void *job, int64_t task);

typedef struct {
    task_fn run;
    const void *job;
    int64_t first, stop;
    int64_t *next; /* NULL: run tasks first .. stop - 1; else take the next task from this shared counter */
    int status;
} part_t;

static void run_part(part_t *part) {
    if (part->next) {
        for (int64_t t; !part->status && (t = __atomic_fetch_add(part->next, 1, __ATOMIC_RELAXED)) < part->stop;)
            part->status = part->run(part->job, t);
        return;
    }
    for (int64_t t = part->first; t < part->stop && !part->status; t++) part->status = part->run(part->job, t);
}

enum { MAX_THREADS = 64, SPIN_NS = 50000 };

typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t wake;
    uint64_t posted, done; /* parts handed to this worker and parts it finished or gave up (atomic) */
    uint64_t taken;        /* the last part claimed, by this worker to run it or by the caller to take it back */
    part_t *part;
} worker_t;

static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static worker_t *workers[MAX_THREADS];
static int64_t n_workers = 0;
static pthread_once_t fork_handler_once = PTHREAD_ONCE_INIT;

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static void *work(void *arg) {
    worker_t *w = arg;
    uint64_t seen = 0;
    for (;;) {
        uint64_t since = now_ns();
        for (unsigned k = 1; __atomic_load_n(&w->posted, __ATOMIC_ACQUIRE) == seen; k++) {
            cpu_relax();
            if (k % 64 == 0 && now_ns() - since > SPIN_NS) {
                pthread_mutex_lock(&w->lock);
                while (__atomic_load_n(&w->posted, __ATOMIC_ACQUIRE) == seen) pthread_cond_wait(&w->wake, &w->lock);
                pthread_mutex_unlock(&w->lock);
            }
        }
        seen = __atomic_load_n(&w->posted, __ATOMIC_ACQUIRE);
        uint64_t before = seen - 1; /* the caller may have taken the part back while this thread was away */
        if (__atomic_compare_exchange_n(&w->taken, &before, seen, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            run_part(w->part);
        __atomic_store_n(&w->done, seen, __ATOMIC_RELEASE);
    }
    return NULL;
}

static void forget_workers(void) { /* in a forked child: the workers stayed in the parent */
    n_workers = 0;
    pthread_mutex_init(&pool_lock, NULL);
}

static void register_fork_handler(void) { pthread_atfork(NULL, NULL, forget_workers); }

/* Worker `index`, started if need be (pool_lock held); NULL when no thread can be started. */
static worker_t *worker(int64_t index) {
    while (n_workers <= index) {
        worker_t *w = calloc(1, sizeof *w);
        if (!w) return NULL;
        pthread_mutex_init(&w->lock, NULL);
        pthread_cond_init(&w->wake, NULL);
        sigset_t all, previous; /* signals stay with the threads Python runs */
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &previous);
        pthread_t thread;
        int failed = pthread_create(&thread, NULL, work, w);
        pthread_sigmask(SIG_SETMASK, &previous, NULL);
        if (failed) {
            pthread_cond_destroy(&w->wake), pthread_mutex_destroy(&w->lock), free(w);
            return NULL;
        }
        pthread_detach(thread);
        workers[n_workers++] = w;
    }
    return workers[index];
}

static void post(worker_t *w, part_t *part) {
    w->part = part;
    pthread_mutex_lock(&w->lock);
    __atomic_store_n(&w->posted, __atomic_load_n(&w->posted, __ATOMIC_RELAXED) + 1, __ATOMIC_RELEASE);
    pthread_cond_signal(&w->wake);
    pthread_mutex_unlock(&w->lock);
}

/* Wait until the worker has run the part posted to it; or, when it has not started on it yet (a busy machine: it
 * may not have a core), take the part back and return 1: the caller runs it, and the worker never touches it. */
static int finish_or_take_back(worker_t *w) {
    uint64_t posted = __atomic_load_n(&w->posted, __ATOMIC_RELAXED), before = posted - 1;
    if (__atomic_compare_exchange_n(&w->taken, &before, posted, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) return 1;
    for (unsigned k = 1; __atomic_load_n(&w->done, __ATOMIC_ACQUIRE) != posted; k++) {
        cpu_relax();
        if (k % 1024 == 0) sched_yield(); /* a busy machine: let the worker have the core */
    }
    return 0;
}

/* Run tasks 0 .. tasks - 1 in up to `parts` parts; returns the tasks' statuses or-ed together. The parts are
 * contiguous ranges of tasks of about equal size, or, `dynamic`, the threads take the next task in order as they
 * finish one (for tasks of unequal sizes). */
static int pool_parallel(task_fn run, const void *job, int64_t tasks, int64_t parts, int dynamic) {
    if (parts > tasks) parts = tasks;
    if (parts > MAX_THREADS) parts = MAX_THREADS;
    if (parts < 2 || pthread_mutex_trylock(&pool_lock) != 0) {
        part_t all = {run, job, 0, tasks, NULL, 0};
        run_part(&all);
        return all.status;
    }
    pthread_once(&fork_handler_once, register_fork_handler);
    part_t part[MAX_THREADS];
    int64_t next = 0;
    for (int64_t t = 0; t < parts; t++)
        part[t] = dynamic ? (part_t){run, job, 0, tasks, &next, 0}
                          : (part_t){run, job, tasks * t / parts, tasks * (t + 1) / parts, NULL, 0};
    int64_t posted = 1;
    for (worker_t *w; posted < parts && (w = worker(posted - 1)) != NULL; posted++) post(w, &part[posted]);
    for (int64_t t = posted; t < parts; t++) run_part(&part[t]); /* no worker to be had: do it here */
    run_part(&part[0]);
    int status = 0;
    for (int64_t t = 0; t < parts; t++) {
        if (t > 0 && t < posted && finish_or_take_back(workers[t - 1])) run_part(&part[t]);
        status |= part[t].status;
    }
    pthread_mutex_unlock(&pool_lock);
    return status;
}

#ifdef SPARSE_STEP_OPENMP
/* Built against the OpenMP runtime torch itself runs on (sparsedecode/kernels/cpu.py links it only when the process
 * has GNU libgomp loaded, which it then shares): the parts run on the threads of torch's own parallel regions, which
 * spin awhile after each of them, so a call made between two of torch's kernels finds them awake instead of
 * waiting for a core they hold. In a process forked from one that ran OpenMP, libgomp's threads stayed in the
 * parent and a parallel region would wait for them forever: there the persistent workers above serve. */
#include <omp.h>
static int forked = 0;
static void note_fork(void) { forked = 1; }
__attribute__((constructor)) static void watch_forks(void) { pthread_atfork(NULL, NULL, note_fork); }

static int parallel(task_fn run, const void *job, int64_t tasks, int64_t parts, int dynamic) {
    if (parts > tasks) parts = tasks;
    if (parts > MAX_THREADS) parts = MAX_THREADS;
    if (forked) return pool_parallel(run, job, tasks, parts, dynamic);
    if (parts < 2 || omp_in_parallel()) {
        part_t all = {run, job, 0, tasks, NULL, 0};
        run_part(&all);
        return all.status;
    }
    int status = 0;
    int64_t next = 0;
#pragma omp parallel num_threads((int)parts) reduction(| : status)
    {
        int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
        part_t part = dynamic ? (part_t){run, job, 0, tasks, &next, 0}
                              : (part_t){run, job, tasks * me / team, tasks * (me + 1) / team, NULL, 0};
        run_part(&part);
        status |= part.status;
    }
    return status;
}
#else
#define parallel pool_parallel
#endif

/* The calling thread's scratch buffer, kept between calls and grown by doubling. */
static __thread void *scratch_buffer = NULL;
static __thread size_t scratch_capacity = 0;

static void *scratch(size_t needed) {
    if (needed > scratch_capacity) {
        size_t capacity = scratch_capacity ? 2 * scratch_capacity : 4096;
        while (capacity < needed) capacity *= 2;
        void *grown = realloc(scratch_buffer, capacity);
        if (!grown) return NULL;
        scratch_buffer = grown, scratch_capacity = capacity;
    }
    return scratch_buffer;
}
