/* The sparse decode step on the CPU in one call per layer: mean-pooled block selection over the cached centroids,
 * and attention over anchor + chosen blocks + window read in place from the KV cache.
 *
 * Built at first use by sparsedecode/kernels/cpu.py (cc -O3 -march=native -fopenmp-simd -pthread), called through
 * ctypes.
 * It replaces ~20 small torch operations whose fixed per-call cost dominated below ~32K positions. Semantics are
 * those of sparsedecode.selectors (top_blocks: the b best, ties to the lowest block, ascending) and of
 * sparsedecode.session.attend_support (softmax over the support, all query heads of a GQA group sharing it).
 * Queries, keys and values are float32, bfloat16 or float16, one dtype for the three (every entry point's last
 * argument, DTYPE_*), converted to float32 as they are loaded; everything is computed and accumulated in float32, as
 * the torch path does after its upcast. Centroids and outputs are float32.
 * Layouts: q (H, d) contiguous; keys/values rows of d contiguous elements at head * stride_h + position * stride_n
 * (strides in elements); centroids stored (kv, d, capacity): element (h, i, j) at h * c_stride_h + i * c_stride_d + j.
 * The caller checks the rest (sparsedecode/kernels/cpu.py: the dtype, one d for q, keys and values, caches of at
 * least n rows, chosen (kv, b), b <= n_blocks for selection); a chosen block outside the distant region is skipped.
 *
 * Speed where it counts, a decode step: every layer's centroids and support come from memory, not from the
 * last-level cache (the other layers and the weights evicted them). So selection streams the centroid rows once,
 * scoring a tile of blocks at a time in a buffer that stays in L1 and keeping the b best of each tile as it goes (no
 * score array of N / B floats, no second pass), with software prefetches one row segment ahead where the hardware
 * prefetcher stops (page and row ends); attention prefetches the support's scattered key and value rows ahead of
 * use. Large calls split over persistent worker threads (KV heads, and ranges of blocks within a head for
 * selection), which wait briefly by spinning, so the attention call that follows a selection finds them awake.
 *
 * A batch (sparse_step_batch, at the end) is served in one call per layer: each sequence with its own length,
 * centroids and blocks, selecting where it selects afresh and attending in the same task, the threads taking
 * (sequence, KV head) tasks. It scores and attends with the very functions the single-sequence calls use.
 */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#define cpu_relax() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield" ::: "memory")
#else
#define cpu_relax() __asm__ __volatile__("" ::: "memory")
#endif

/* e^x for x <= 0 (a logit minus the row's maximum): Cody-Waite reduction by ln 2 (k rounded to nearest by adding
 * and subtracting 1.5 * 2^23) and Cephes' degree-6 polynomial for expf (relative error ~1e-7, as libm's expf); below
 * -87 it returns ~1e-38 instead of underflowing. exp8_nonpositive does the same on 8 floats at once. */
static const float EXP_MAGIC = 12582912.0f, LOG2E = 1.44269504088896341f, LN2_HI = 0.693359375f,
                   LN2_LO = -2.12194440e-4f;
static const float EXP_POLY[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                  4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float t = x * LOG2E + EXP_MAGIC, k = t - EXP_MAGIC;
    float r = x - k * LN2_HI - k * LN2_LO;
    float p = EXP_POLY[0];
    for (int e = 1; e < 6; e++) p = p * r + EXP_POLY[e];
    p = p * r * r + r + 1.0f;
    union {
        int32_t i;
        float f;
    } scale = {.i = ((int32_t)k + 127) << 23};
    return p * scale.f;
}

/* ---------------------------------------------------------------------------------------------------------------
 * Element types. A bfloat16 is the upper half of a float32: a shift. A float16 converts exactly too (every float16
 * is a float32): one element at a time by integer arithmetic (half_to_float), eight at a time (half8, after the
 * vector types below) by F16C's vcvtph2ps where the build targets it, by _Float16 on aarch64, else by the same
 * integer arithmetic on vectors. SPARSE_STEP_HALF (1, 2, 3) picks one of the three by hand (the tests build each
 * that compiles here); all give the same floats.
 */
enum { DTYPE_F32 = 0, DTYPE_BF16 = 1, DTYPE_F16 = 2 };

#ifndef SPARSE_STEP_HALF
#if defined(__F16C__)
#define SPARSE_STEP_HALF 1
#elif defined(__aarch64__) && defined(__FLT16_MAX__)
#define SPARSE_STEP_HALF 2
#else
#define SPARSE_STEP_HALF 3
#endif
#endif
#if SPARSE_STEP_HALF == 1
#include <immintrin.h>
#endif

static inline int64_t element_size(int dtype) { return dtype == DTYPE_F32 ? 4 : 2; }

/* The address of element i of an array of `dtype` elements at p. */
static inline const char *element(const void *p, int64_t i, int dtype) {
    return (const char *)p + i * element_size(dtype);
}

static inline float bits_float(uint32_t u) {
    union {
        uint32_t u;
        float f;
    } v = {u};
    return v.f;
}

static inline uint32_t float_bits(float f) {
    union {
        float f;
        uint32_t u;
    } v = {f};
    return v.u;
}

/* float16 -> float32: zero and subnormals as m * 2^-24 (exact, and no subnormal float arithmetic, which a
 * denormals-are-zero mode would flush); normal numbers rebiased from 15 to 127; infinities and NaNs to exponent 255,
 * the mantissa kept. */
static inline float half_to_float(uint16_t h) {
    uint32_t magnitude = h & 0x7fffu, sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t rebias = (magnitude >= 0x7c00u ? 224u : 112u) << 23;
    float value = magnitude < 0x400u ? (float)magnitude * 0x1p-24f : bits_float((magnitude << 13) + rebias);
    return bits_float(float_bits(value) | sign);
}

/* Element i of an array of `dtype` elements at p, as a float. */
static inline float load1(const void *p, int64_t i, int dtype) {
    if (dtype == DTYPE_F32) return ((const float *)p)[i];
    uint16_t h = ((const uint16_t *)p)[i];
    return dtype == DTYPE_BF16 ? bits_float((uint32_t)h << 16) : half_to_float(h);
}

/* a better than b: a higher score, or an equal score at a lower block index */
static int better(float score_a, int64_t a, float score_b, int64_t b) {
    return score_a > score_b || (score_a == score_b && a < b);
}

static int compare_ascending(const void *x, const void *y) {
    int64_t a = *(const int64_t *)x, b = *(const int64_t *)y;
    return (a > b) - (a < b);
}

/* Offer block j with score s to a list of at most b (score, block), kept sorted best-first. `better` is a total
 * order on (score, block) for non-NaN scores, so the b best do not depend on the order of the offers. */
static void offer(float s, int64_t j, float *scores, int64_t *blocks, int64_t *kept, int64_t b) {
    if (*kept == b && !better(s, j, scores[b - 1], blocks[b - 1])) return;
    int64_t at = *kept < b ? (*kept)++ : b - 1;
    while (at > 0 && better(s, j, scores[at - 1], blocks[at - 1])) {
        scores[at] = scores[at - 1];
        blocks[at] = blocks[at - 1];
        at--;
    }
    scores[at] = s;
    blocks[at] = j;
}

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

/* ---------------------------------------------------------------------------------------------------------------
 * Selection. Task (h, chunk) scores blocks [first, stop) of head h against the head's mean query and keeps its b
 * best; the caller merges the chunks' lists and the tail block per head. A block's score is accumulated over the d
 * channels in order, exactly as a single pass over all blocks would: the split changes no score.
 */
enum { TILE = 1024, LINE = 16 /* floats per 64-byte cache line */ };
enum { NONFINITE = 2 }; /* a status: a selection score is NaN or infinite (-1 is out of memory) */

/* x * 0 is 0 for finite x and NaN for NaN or an infinity (the build has no -ffast-math, so this is not folded) */
static inline int nonfinite(float x) { return x * 0.0f != 0.0f; }

typedef struct {
    const void *q;
    const float *centroids;
    int64_t c_stride_h, c_stride_d, n_full, group, d, b, chunks;
    int dtype;
    float *best_scores;   /* (tasks, b) */
    int64_t *best_blocks; /* (tasks, b) */
    int64_t *kept;        /* (tasks) */
} select_job;

static void mean_query(const void *q, int64_t h, int64_t group, int64_t d, int dtype, float *q_mean) {
    for (int64_t i = 0; i < d; i++) {
        float sum = 0.0f;
        for (int64_t g = 0; g < group; g++) sum += load1(q, (h * group + g) * d + i, dtype);
        q_mean[i] = sum / (float)group;
    }
}

/* Score blocks [first, stop) of one head's transposed centroids `c` (row i of d at c + i * stride) against q_mean and
 * keep the b best in (best_scores, best_blocks, kept). Returns 0, or NONFINITE when a score is NaN or infinite (a
 * non-finite key in a block, or a query: NaN ranks nowhere, so nothing is chosen), found by one pass over each tile
 * while it is in L1 (the sum of every score times 0, see nonfinite). Not inlined: every entry point scores with the same
 * code, so the single-sequence and the batched calls pick the same blocks to the bit. */
__attribute__((noinline)) static int score_blocks(const float *q_mean, const float *c, int64_t stride, int64_t first,
                                                   int64_t stop, int64_t d, int64_t b, float *best_scores,
                                                  int64_t *best_blocks, int64_t *kept) {
    float tile[TILE];
    *kept = 0;
    for (int64_t t0 = first; t0 < stop; t0 += TILE) {
        int64_t m = stop - t0 < TILE ? stop - t0 : TILE;
        memset(tile, 0, sizeof(float) * (size_t)m);
        for (int64_t i = 0; i < d; i++) { /* tile += q_i * row i of the transposed centroids */
            const float *row = c + i * stride + t0;
            /* what comes next: the same blocks in the next row, or the next tile's first row */
            const float *next = i + 1 < d ? row + stride : (t0 + TILE < stop ? c + t0 + TILE : NULL);
            float qi = q_mean[i];
            int64_t j = 0;
            for (; j + LINE <= m; j += LINE) {
                if (next) __builtin_prefetch(next + j, 0, 3);
#pragma omp simd
                for (int64_t k = j; k < j + LINE; k++) tile[k] += qi * row[k];
            }
            for (; j < m; j++) tile[j] += qi * row[j];
        }
        float probe = 0.0f;
#pragma omp simd reduction(+ : probe)
        for (int64_t k = 0; k < m; k++) probe += tile[k] * 0.0f;
        if (nonfinite(probe)) return NONFINITE;
        /* keep the b best; once b are kept, look only at groups of 8 whose best reaches the b-th */
        int64_t j = 0;
        for (; j < m && *kept < b; j++) offer(tile[j], t0 + j, best_scores, best_blocks, kept, b);
        for (; j < m; j += 8) {
            int64_t end = j + 8 < m ? j + 8 : m;
            float top = -INFINITY;
            for (int64_t k = j; k < end; k++) top = tile[k] > top ? tile[k] : top;
            if (top < best_scores[b - 1]) continue;
            for (int64_t k = j; k < end; k++) offer(tile[k], t0 + k, best_scores, best_blocks, kept, b);
        }
    }
    return 0;
}

/* The score of the short tail block [start, distant_end) of one head's keys `k` (rows k_stride_n elements apart):
 * the mean query against the mean of its keys, averaged now (the centroid cache holds full blocks only). */
__attribute__((noinline)) static float tail_score(const float *q_mean, const void *k, int64_t k_stride_n,
                                                  int64_t start, int64_t distant_end, int64_t d, int dtype) {
    int64_t tail = distant_end - start;
    float dot = 0.0f;
    for (int64_t i = 0; i < d; i++) {
        float sum = 0.0f;
        for (int64_t p = start; p < distant_end; p++) sum += load1(k, p * k_stride_n + i, dtype);
        dot += q_mean[i] * (sum / (float)tail);
    }
    return dot;
}

static int select_task(const void *arg, int64_t task) {
    const select_job *job = arg;
    int64_t d = job->d, b = job->b, h = task / job->chunks, chunk = task % job->chunks;
    int64_t first = job->n_full * chunk / job->chunks, stop = job->n_full * (chunk + 1) / job->chunks;
    float stack_mean[256];
    float *q_mean = d <= 256 ? stack_mean : malloc(sizeof(float) * (size_t)d);
    if (!q_mean) return -1;
    mean_query(job->q, h, job->group, d, job->dtype, q_mean);
    int status = score_blocks(q_mean, job->centroids + h * job->c_stride_h, job->c_stride_d, first, stop, d, b,
                              job->best_scores + task * b, job->best_blocks + task * b, job->kept + task);
    if (q_mean != stack_mean) free(q_mean);
    return status;
}

/* chosen (kv, b) = the b best blocks per KV head, ascending (q and keys of `dtype`). Returns 0; NONFINITE when a
 * score (a cached block's or the tail block's) is NaN or infinite, chosen then undefined; -1 (or -1 | NONFINITE)
 * when memory ran out. */
int select_mean_pooled(const void *q, const float *centroids, int64_t c_stride_h, int64_t c_stride_d,
                       int64_t n_full, const void *keys, int64_t k_stride_h, int64_t k_stride_n, int64_t kv_heads,
                       int64_t group, int64_t d, int64_t distant_end, int64_t block, int64_t b, int64_t threads,
                       int64_t *chosen, int64_t dtype) {
    enum { MIN_WORK_PER_THREAD = 1 << 16 }; /* centroid floats: 256 KB from memory pays for waking a worker */
    int64_t n_blocks = (distant_end - 1 + block - 1) / block;
    int64_t work = kv_heads * n_full * d, parts = threads;
    if (parts > work / MIN_WORK_PER_THREAD) parts = work / MIN_WORK_PER_THREAD;
    if (parts > MAX_THREADS) parts = MAX_THREADS;
    int64_t chunks = parts > kv_heads ? (parts + kv_heads - 1) / kv_heads : 1;
    if (parts > 1 && (kv_heads * chunks) % parts) chunks *= 4; /* parts of nearly equal size */
    int64_t tasks = kv_heads * chunks, width = b > 0 ? b : 1;
    char *space = scratch((size_t)tasks * (size_t)width * (sizeof(float) + sizeof(int64_t)) +
                          (size_t)tasks * sizeof(int64_t) + sizeof(float) * (size_t)(d + width) +
                          sizeof(int64_t) * (size_t)width);
    if (!space) return -1;
    int64_t *best_blocks = (int64_t *)space, *kept = best_blocks + tasks * width, *merged = kept + tasks;
    float *best_scores = (float *)(merged + width), *merged_scores = best_scores + tasks * width;
    float *q_mean = merged_scores + width;
    select_job job = {q,      centroids, c_stride_h, c_stride_d, n_full,      group, d,
                      b,      chunks,    (int)dtype, best_scores, best_blocks, kept};
    int status = b > 0 ? parallel(select_task, &job, tasks, parts, 0) : 0;
    if (status) return status;
    for (int64_t h = 0; h < kv_heads && b > 0; h++) {
        int64_t count = 0;
        for (int64_t t = h * chunks; t < (h + 1) * chunks; t++)
            for (int64_t k = 0; k < kept[t]; k++)
                offer(best_scores[t * b + k], best_blocks[t * b + k], merged_scores, merged, &count, b);
        if (n_blocks > n_full) { /* the short tail block is not cached: average its keys now */
            mean_query(q, h, group, d, (int)dtype, q_mean);
            float dot = tail_score(q_mean, element(keys, h * k_stride_h, (int)dtype), k_stride_n, 1 + n_full * block,
                                   distant_end, d, (int)dtype);
            if (nonfinite(dot)) return NONFINITE;
            offer(dot, n_full, merged_scores, merged, &count, b);
        }
        qsort(merged, (size_t)count, sizeof(int64_t), compare_ascending);
        memcpy(chosen + h * b, merged, sizeof(int64_t) * (size_t)count);
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------------------------------
 * Attention over the support, one task per KV head. Logits take each key row once for the whole GQA group (four
 * queries at a time, independent accumulators), the weighted sum each value row once per group of four queries, in
 * tiles of rows that stay in L1 across the head dim. Rows are prefetched ahead: keys PREFETCH_ROWS positions ahead
 * of the logits, values during the logits (they are read after the softmax).
 */
typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4), may_alias)); /* an unaligned view of 8 floats */

static inline v8 load8(const float *p) { return *(const v8u *)p; }
static inline void store8(float *p, v8 x) { *(v8u *)p = x; }
typedef int32_t v8i __attribute__((vector_size(32)));

static inline float sum8(v8 x) { return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7])); }
static inline v8 splat8(float x) { return (v8){x, x, x, x, x, x, x, x}; }
static inline v8 max8(v8 a, v8 b) { /* lanes where a > b from a, else (b larger, equal or NaN) from b */
    v8i take_a = a > b;
    return (v8)(((v8i)a & take_a) | ((v8i)b & ~take_a));
}
static inline v8 exp8_nonpositive(v8 x) {
    x = max8(x, splat8(-87.0f));
    v8 t = x * LOG2E + EXP_MAGIC, k = t - EXP_MAGIC;
    v8 r = x - k * LN2_HI - k * LN2_LO;
    v8 p = splat8(EXP_POLY[0]);
    for (int e = 1; e < 6; e++) p = p * r + EXP_POLY[e];
    p = p * r * r + r + 1.0f;
    v8i exponent = ((v8i)t - (v8i)splat8(EXP_MAGIC) + 127) << 23; /* k as an integer: t's low mantissa bits */
    return p * (v8)exponent;
}

typedef uint16_t v8h __attribute__((vector_size(16), aligned(2), may_alias)); /* an unaligned view of 8 halves */
typedef uint32_t v8w __attribute__((vector_size(32)));

/* 8 float16 at p as floats (see "Element types"). */
#if SPARSE_STEP_HALF == 1
static inline v8 half8(const void *p) { return (v8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
#elif SPARSE_STEP_HALF == 2
typedef _Float16 v8f16 __attribute__((vector_size(16), aligned(2), may_alias));
static inline v8 half8(const void *p) { return __builtin_convertvector(*(const v8f16 *)p, v8); }
#else
static inline v8 half8(const void *p) { /* half_to_float on 8 lanes */
    v8w h = __builtin_convertvector(*(const v8h *)p, v8w);
    v8w magnitude = h & 0x7fffu, sign = (h & 0x8000u) << 16;
    v8w small = (v8w)(magnitude < 0x400u), large = (v8w)(magnitude >= 0x7c00u);
    v8w normal = (magnitude << 13) + 112u * (1u << 23) + (large & (112u * (1u << 23)));
    v8w tiny = (v8w)(__builtin_convertvector((v8i)magnitude, v8) * 0x1p-24f);
    return (v8)(((normal & ~small) | (tiny & small)) | sign);
}
#endif

/* 8 elements of `dtype` at p as floats. Inlined into code specialised for one dtype, where the tests fold away. */
static inline __attribute__((always_inline)) v8 load8_as(const void *p, int dtype) {
    if (dtype == DTYPE_F32) return load8(p);
    if (dtype == DTYPE_BF16) return (v8)(__builtin_convertvector(*(const v8h *)p, v8w) << 16);
    return half8(p);
}

/* Elements i .. i + 7 of a row of `dtype` elements at p as floats. */
static inline __attribute__((always_inline)) v8 load8_at(const char *p, int64_t i, int dtype) {
    return load8_as(p + i * element_size(dtype), dtype);
}

/* n elements of `dtype` at src as floats into dst: the conversion every load makes, for the tests. */
void to_float32(const void *src, int64_t n, int64_t dtype, float *dst) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) store8(dst + i, load8_as(element(src, i, (int)dtype), (int)dtype));
    for (; i < n; i++) dst[i] = load1(src, i, (int)dtype);
}

enum { QUERIES = 4, PREFETCH_ROWS = 16, ROW_TILE = 32 };

typedef struct {
    const void *q, *keys, *values; /* of `dtype` */
    const int64_t *chosen;
    int64_t k_stride_h, k_stride_n, v_stride_h, v_stride_n, b, group, d, n, distant_end, block;
    float scale;
    float *out;
    int dtype;
} attend_job;

static void prefetch_row(const char *row, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(row + i, 0, 3);
}

/* One KV head's attention, for keys and values of one dtype `t` (a constant where it is inlined: attend_head). */
static inline __attribute__((always_inline)) int attend_head_as(const attend_job *job, int64_t h, int t) {
    int64_t group = job->group, d = job->d, block = job->block, distant_end = job->distant_end;
    int64_t padded = (group + QUERIES - 1) / QUERIES * QUERIES, vector_d = d / 8 * 8;
    int64_t capacity = 1 + job->b * block + (job->n - distant_end);
    int64_t *positions = malloc(sizeof(int64_t) * (size_t)capacity);
    float *weights = malloc(sizeof(float) * (size_t)(capacity * padded + 2 * padded * d));
    if (!positions || !weights) {
        free(positions), free(weights);
        return -1;
    }
    int64_t count = 0, n_blocks = (distant_end - 1 + block - 1) / block;
    positions[count++] = 0;
    for (int64_t c = 0; c < job->b; c++) {
        int64_t j = job->chosen[h * job->b + c];
        if (j < 0 || j >= n_blocks) continue; /* not a distant block: nothing to read */
        int64_t start = 1 + j * block;
        int64_t stop = start + block < distant_end ? start + block : distant_end;
        for (int64_t p = start; p < stop; p++) positions[count++] = p;
    }
    for (int64_t p = distant_end; p < job->n; p++) positions[count++] = p;
    float *qh = weights + capacity * padded, *acc = qh + padded * d; /* the group's queries, zero-padded; output */
    const void *q = element(job->q, h * group * d, t);
    for (int64_t i = 0; i < group * d; i++) qh[i] = load1(q, i, t);
    memset(qh + group * d, 0, sizeof(float) * (size_t)((padded - group) * d));
    memset(acc, 0, sizeof(float) * (size_t)(padded * d));
    const char *keys = element(job->keys, h * job->k_stride_h, t);
    const char *values = element(job->values, h * job->v_stride_h, t);
    int64_t k_stride = job->k_stride_n * element_size(t), v_stride = job->v_stride_n * element_size(t); /* bytes */
    int64_t row_bytes = d * element_size(t);

    for (int64_t s = 0; s < count && s < PREFETCH_ROWS; s++) prefetch_row(keys + positions[s] * k_stride, row_bytes);
    for (int64_t s = 0; s < count; s += 2) { /* logits: two key rows against every query of the group */
        for (int64_t r = s; r < s + 2 && r < count; r++) {
            if (r + PREFETCH_ROWS < count) prefetch_row(keys + positions[r + PREFETCH_ROWS] * k_stride, row_bytes);
            prefetch_row(values + positions[r] * v_stride, row_bytes);
        }
        const char *k = keys + positions[s] * k_stride;
        const char *l = s + 1 < count ? keys + positions[s + 1] * k_stride : k; /* a lone last row: twice */
        for (int64_t g = 0; g < padded; g += QUERIES) {
            const float *q0 = qh + g * d, *q1 = q0 + d, *q2 = q1 + d, *q3 = q2 + d;
            v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
            for (int64_t i = 0; i < vector_d; i += 8) {
                v8 x = load8_at(k, i, t), y = load8_at(l, i, t), p0 = load8(q0 + i), p1 = load8(q1 + i);
                v8 p2 = load8(q2 + i), p3 = load8(q3 + i);
                a0 += p0 * x, a1 += p1 * x, a2 += p2 * x, a3 += p3 * x;
                b0 += p0 * y, b1 += p1 * y, b2 += p2 * y, b3 += p3 * y;
            }
            float r[2][QUERIES] = {{sum8(a0), sum8(a1), sum8(a2), sum8(a3)}, {sum8(b0), sum8(b1), sum8(b2), sum8(b3)}};
            for (int64_t i = vector_d; i < d; i++) {
                float ki = load1(k, i, t), li = load1(l, i, t);
                for (int64_t e = 0; e < QUERIES; e++) r[0][e] += q0[e * d + i] * ki, r[1][e] += q0[e * d + i] * li;
            }
            for (int64_t u = 0; u < 2 && s + u < count; u++)
                for (int64_t e = 0; e < QUERIES; e++) weights[(g + e) * count + s + u] = r[u][e] * job->scale;
        }
    }
    int64_t vector_count = count / 8 * 8;
    for (int64_t g = 0; g < group; g++) { /* softmax per query head (padding rows stay at logit 0, unused) */
        float *w = weights + g * count, top = -INFINITY, total = 0.0f;
        v8 tops = splat8(-INFINITY), totals = splat8(0.0f);
        for (int64_t s = 0; s < vector_count; s += 8) tops = max8(load8(w + s), tops);
        for (int64_t e = 0; e < 8; e++) top = tops[e] > top ? tops[e] : top;
        for (int64_t s = vector_count; s < count; s++) top = w[s] > top ? w[s] : top;
        for (int64_t s = 0; s < vector_count; s += 8) {
            v8 e = exp8_nonpositive(load8(w + s) - top);
            store8(w + s, e);
            totals += e;
        }
        total = sum8(totals);
        for (int64_t s = vector_count; s < count; s++) total += (w[s] = exp_nonpositive(w[s] - top));
        float inverse = 1.0f / total;
        for (int64_t s = 0; s < count; s++) w[s] *= inverse;
    }
    for (int64_t s0 = 0; s0 < count; s0 += ROW_TILE) { /* acc += w * value rows, a tile of rows at a time */
        int64_t s1 = s0 + ROW_TILE < count ? s0 + ROW_TILE : count;
        for (int64_t g = 0; g < padded; g += QUERIES) {
            const float *w0 = weights + g * count, *w1 = w0 + count, *w2 = w1 + count, *w3 = w2 + count;
            float *o0 = acc + g * d, *o1 = o0 + d, *o2 = o1 + d, *o3 = o2 + d;
            int64_t i = 0;
            for (; i + 16 <= vector_d; i += 16) { /* two vectors of the head dim: eight independent sums */
                v8 a0 = load8(o0 + i), a1 = load8(o1 + i), a2 = load8(o2 + i), a3 = load8(o3 + i);
                v8 b0 = load8(o0 + i + 8), b1 = load8(o1 + i + 8), b2 = load8(o2 + i + 8), b3 = load8(o3 + i + 8);
                for (int64_t s = s0; s < s1; s++) {
                    const char *row = values + positions[s] * v_stride;
                    v8 x = load8_at(row, i, t), y = load8_at(row, i + 8, t);
                    a0 += w0[s] * x, a1 += w1[s] * x, a2 += w2[s] * x, a3 += w3[s] * x;
                    b0 += w0[s] * y, b1 += w1[s] * y, b2 += w2[s] * y, b3 += w3[s] * y;
                }
                store8(o0 + i, a0), store8(o1 + i, a1), store8(o2 + i, a2), store8(o3 + i, a3);
                store8(o0 + i + 8, b0), store8(o1 + i + 8, b1), store8(o2 + i + 8, b2), store8(o3 + i + 8, b3);
            }
            for (; i < vector_d; i += 8) {
                v8 a0 = load8(o0 + i), a1 = load8(o1 + i), a2 = load8(o2 + i), a3 = load8(o3 + i);
                for (int64_t s = s0; s < s1; s++) {
                    v8 x = load8_at(values + positions[s] * v_stride, i, t);
                    a0 += w0[s] * x, a1 += w1[s] * x, a2 += w2[s] * x, a3 += w3[s] * x;
                }
                store8(o0 + i, a0), store8(o1 + i, a1), store8(o2 + i, a2), store8(o3 + i, a3);
            }
            for (int64_t i = vector_d; i < d; i++)
                for (int64_t s = s0; s < s1; s++) {
                    float v = load1(values + positions[s] * v_stride, i, t);
                    o0[i] += w0[s] * v, o1[i] += w1[s] * v, o2[i] += w2[s] * v, o3[i] += w3[s] * v;
                }
        }
    }
    memcpy(job->out + h * group * d, acc, sizeof(float) * (size_t)(group * d));
    free(positions), free(weights);
    return 0;
}

static int attend_head(const void *arg, int64_t h) {
    const attend_job *job = arg;
    if (job->dtype == DTYPE_BF16) return attend_head_as(job, h, DTYPE_BF16);
    if (job->dtype == DTYPE_F16) return attend_head_as(job, h, DTYPE_F16);
    return attend_head_as(job, h, DTYPE_F32);
}

/* out (H, d) = softmax(q . k_support * scale) v_support per query head (q, keys and values of `dtype`, out float32).
 * Returns 0, or -1 on allocation failure. */
int attend_support(const void *q, const void *keys, int64_t k_stride_h, int64_t k_stride_n, const void *values,
                   int64_t v_stride_h, int64_t v_stride_n, const int64_t *chosen, int64_t b, int64_t kv_heads,
                   int64_t group, int64_t d, int64_t n, int64_t distant_end, int64_t block, float scale,
                   int64_t threads, float *out, int64_t dtype) {
    enum { MIN_WORK_PER_THREAD = 1 << 18 }; /* multiply-adds */
    attend_job job = {q, keys, values, chosen, k_stride_h, k_stride_n, v_stride_h, v_stride_n, b, group, d, n,
                      distant_end, block, scale, out, (int)dtype};
    int64_t support = 1 + b * block + (n - distant_end), work = 2 * kv_heads * support * group * d;
    int64_t parts = threads < work / MIN_WORK_PER_THREAD ? threads : work / MIN_WORK_PER_THREAD;
    return parallel(attend_head, &job, kv_heads, parts, 0);
}

/* ---------------------------------------------------------------------------------------------------------------
 * The sparse step of a whole batch in one call. Each sequence (a "row") has its own length, hence its own layout,
 * its own centroid cache and its own blocks; one task is one (row, KV head): select that head's blocks if the row
 * selects afresh at this step (exactly as select_mean_pooled does), then attend over its support (attend_head).
 * Tasks are taken longest first by whichever thread is free, so rows of different lengths share the threads well.
 *
 * A row is described by ROW_FIELDS int64 values (pointers as integers), in this order:
 *   q, k, v, out    element offsets from the query, key, value and output bases (elements of the call's dtype;
 *                   of float32 for the output): the row's query (H, d)
 *                   contiguous, its keys and values at its own position 0 (head h, position p at
 *                   + h * stride_h + p * stride_n), its output (H, d) contiguous;
 *   n               the row's positions (the current token included): distant_end = max(n - window, 1);
 *   centroids       its centroid storage (kv, d, capacity), element (h, i, j) at h * c_stride_h + i * c_stride_d
 *   c_stride_h, c_stride_d   + j; read only when the row selects afresh (blocks [0, n_full));
 *   chosen, b       its blocks (kv, b) int64: written when the row selects afresh (the b best per head,
 *                   ascending, b <= n_blocks), read otherwise (an index outside [0, n_blocks) is skipped);
 *   fresh           1: select then attend; 0: attend over `chosen` as it is.
 */
enum { ROW_FIELDS = 11 };

typedef struct {
    int64_t q, k, v, out, n, centroids, c_stride_h, c_stride_d, chosen, b, fresh;
} row_t;

typedef struct {
    const void *q, *keys, *values; /* of `dtype` */
    float *out;
    const row_t *rows;
    const int64_t *order; /* rows, most work first */
    int64_t k_stride_h, k_stride_n, v_stride_h, v_stride_n, kv_heads, group, d, window, block;
    float scale;
    int dtype;
} batch_job;

/* chosen (b) of head h of one row: the b best blocks against the head's mean query, ascending. */
static int select_head(const batch_job *job, const row_t *row, int64_t h, const void *q, const void *keys,
                       int64_t distant_end) {
    int64_t d = job->d, b = row->b, block = job->block, count = 0;
    int64_t n_full = (distant_end - 1) / block, n_blocks = (distant_end - 1 + block - 1) / block;
    float stack_mean[256], stack_scores[64];
    int64_t stack_blocks[64];
    float *q_mean = d <= 256 ? stack_mean : malloc(sizeof(float) * (size_t)d);
    float *scores = b <= 64 ? stack_scores : malloc(sizeof(float) * (size_t)b);
    int64_t *blocks = b <= 64 ? stack_blocks : malloc(sizeof(int64_t) * (size_t)b);
    int status = -1;
    if (q_mean && scores && blocks) {
        mean_query(q, h, job->group, d, job->dtype, q_mean);
        const float *c = (const float *)(intptr_t)row->centroids + h * row->c_stride_h;
        status = score_blocks(q_mean, c, row->c_stride_d, 0, n_full, d, b, scores, blocks, &count);
        if (!status && n_blocks > n_full) { /* the short tail block is not cached: average its keys now */
            float dot = tail_score(q_mean, element(keys, h * job->k_stride_h, job->dtype), job->k_stride_n,
                                   1 + n_full * block, distant_end, d, job->dtype);
            if (nonfinite(dot)) status = NONFINITE;
            offer(dot, n_full, scores, blocks, &count, b);
        }
        if (!status) {
            qsort(blocks, (size_t)count, sizeof(int64_t), compare_ascending);
            memcpy((int64_t *)(intptr_t)row->chosen + h * b, blocks, sizeof(int64_t) * (size_t)count);
        }
    }
    if (q_mean != stack_mean) free(q_mean);
    if (scores != stack_scores) free(scores);
    if (blocks != stack_blocks) free(blocks);
    return status;
}

static int batch_task(const void *arg, int64_t task) {
    const batch_job *job = arg;
    const row_t *row = job->rows + job->order[task / job->kv_heads];
    int64_t h = task % job->kv_heads, n = row->n;
    int64_t distant_end = n - job->window > 1 ? n - job->window : 1;
    int t = job->dtype;
    const void *q = element(job->q, row->q, t), *keys = element(job->keys, row->k, t);
    const void *values = element(job->values, row->v, t);
    if (row->fresh && row->b > 0) {
        int status = select_head(job, row, h, q, keys, distant_end);
        if (status) return status;
    }
    attend_job attend = {q,
                         keys,
                         values,
                         (const int64_t *)(intptr_t)row->chosen,
                         job->k_stride_h,
                         job->k_stride_n,
                         job->v_stride_h,
                         job->v_stride_n,
                         row->b,
                         job->group,
                         job->d,
                         n,
                         distant_end,
                         job->block,
                         job->scale,
                         job->out + row->out,
                         t};
    return attend_head(&attend, h);
}

/* The sparse step of `n_rows` rows (`rows`: n_rows * ROW_FIELDS int64, see above), queries, keys and values of
 * `dtype`, out float32. Returns 0; NONFINITE when a row selecting afresh met a NaN or infinite score (outputs then
 * undefined); -1 when memory ran out.
 * One row selecting afresh with fewer KV heads than threads (a sequence alone, a head's selection then split into
 * ranges of blocks) runs the selection and the attention calls in turn: the same blocks and output to the bit, as
 * both score with score_blocks and tail_score and attend with attend_head. */
int sparse_step_batch(const void *q, const void *keys, int64_t k_stride_h, int64_t k_stride_n, const void *values,
                      int64_t v_stride_h, int64_t v_stride_n, float *out, const int64_t *rows, int64_t n_rows,
                      int64_t kv_heads, int64_t group, int64_t d, int64_t window, int64_t block, float scale,
                      int64_t threads, int64_t dtype) {
    enum { MIN_SELECT_PER_THREAD = 1 << 16, MIN_ATTEND_PER_THREAD = 1 << 18 }; /* as the single-row calls */
    const row_t *row = (const row_t *)rows;
    if (n_rows == 1 && row->fresh && row->b > 0 && kv_heads < threads) {
        int64_t n = row->n, distant_end = n - window > 1 ? n - window : 1;
        const void *q0 = element(q, row->q, (int)dtype), *k0 = element(keys, row->k, (int)dtype);
        const void *v0 = element(values, row->v, (int)dtype);
        int64_t *chosen = (int64_t *)(intptr_t)row->chosen;
        int status = select_mean_pooled(q0, (const float *)(intptr_t)row->centroids, row->c_stride_h, row->c_stride_d,
                                        (distant_end - 1) / block, k0, k_stride_h, k_stride_n, kv_heads, group, d,
                                        distant_end, block, row->b, threads, chosen, dtype);
        if (status) return status;
        return attend_support(q0, k0, k_stride_h, k_stride_n, v0, v_stride_h, v_stride_n, chosen, row->b, kv_heads,
                              group, d, n, distant_end, block, scale, threads, out + row->out, dtype);
    }
    int64_t *order = scratch(sizeof(int64_t) * (size_t)(2 * n_rows + 1));
    if (!order) return -1;
    int64_t *cost = order + n_rows;
    double parts = 0.0;
    for (int64_t r = 0; r < n_rows; r++) { /* multiply-adds per KV head; rows sorted by it, most first */
        int64_t distant_end = row[r].n - window > 1 ? row[r].n - window : 1;
        int64_t select = row[r].fresh ? (distant_end - 1) / block * d : 0;
        int64_t attend = 2 * (1 + row[r].b * block + (row[r].n - distant_end)) * group * d;
        cost[r] = select + attend;
        parts += kv_heads * ((double)select / MIN_SELECT_PER_THREAD + (double)attend / MIN_ATTEND_PER_THREAD);
        int64_t at = r;
        for (; at > 0 && cost[order[at - 1]] < cost[r]; at--) order[at] = order[at - 1];
        order[at] = r;
    }
    batch_job job = {q,          keys,       values,   out,   row, order,  k_stride_h, k_stride_n,
                     v_stride_h, v_stride_n, kv_heads, group, d,   window, block,      scale,      (int)dtype};
    return parallel(batch_task, &job, n_rows * kv_heads, threads < parts ? threads : (int64_t)parts, 1);
}

/* The whole sparse step of one sequence in one call: when `fresh`, select into chosen (kv, b) what
 * select_mean_pooled selects, then attend over anchor + chosen + window as attend_support does: one batch row. */
int sparse_step(const void *q, const float *centroids, int64_t c_stride_h, int64_t c_stride_d, int64_t n_full,
                const void *keys, int64_t k_stride_h, int64_t k_stride_n, const void *values, int64_t v_stride_h,
                int64_t v_stride_n, int64_t *chosen, int64_t b, int64_t fresh, int64_t kv_heads, int64_t group,
                int64_t d, int64_t n, int64_t distant_end, int64_t block, float scale, int64_t threads, float *out,
                int64_t dtype) {
    row_t row = {0, 0, 0, 0, n, (int64_t)(intptr_t)centroids, c_stride_h, c_stride_d, (int64_t)(intptr_t)chosen,
                 b, fresh ? 1 : 0};
    (void)n_full; /* the row derives it from n and the window */
    return sparse_step_batch(q, keys, k_stride_h, k_stride_n, values, v_stride_h, v_stride_n, out,
                             (const int64_t *)&row, 1, kv_heads, group, d, n - distant_end, block, scale, threads,
                             dtype);
}

/* The compiled step's prepared call (sparsedecode/attention/prepared.py) in one call: a sparse decode step at
 * context length n of a layer state's rows. Its bookkeeping is the declared mirror of the step's schedule,
 * sparsedecode/step/schedule.py (tests/test_schedule.py checks it against that over random schedules): after_write
 * of a decode step (start = keep = n - 1: the statistics of the blocks wholly before it survive, the reuse chain
 * only where the row's last call ended at n - 1), then decode_step (a row selects afresh every `reuse` steps of its
 * chain, every step with `every_step`, and counts the step), then sparse_step_batch over the row table (n and fresh
 * set here), then the tally (support_reads, count_step). count, step, last: one per row; tally: sparse row-steps,
 * dense row-steps, positions read (summed over KV heads), KV-head row-steps. The call splits over `threads` when the
 * centroids scored reach `split` floats, else runs on one. Returns NEEDS_STATISTICS, before any attention, when a
 * row selecting afresh lacks the statistics of blocks completed since (count < n_full): the caller completes them
 * and calls again with `resumed` = 1, which skips the bookkeeping already done. */
enum { NEEDS_STATISTICS = 3 };

int prepared_step(const void *q, const void *keys, int64_t k_stride_h, int64_t k_stride_n, const void *values,
                  int64_t v_stride_h, int64_t v_stride_n, float *out, int64_t *rows, int64_t n_rows, int64_t kv_heads,
                  int64_t group, int64_t d, int64_t window, int64_t block, float scale, int64_t threads,
                  int64_t dtype, int64_t n, int64_t reuse, int64_t every_step, int64_t split, int64_t *count,
                  int64_t *step, int64_t *last, int64_t *tally, int64_t resumed) {
    row_t *row = (row_t *)rows;
    int64_t distant_end = n - window > 1 ? n - window : 1, n_full = (distant_end - 1) / block;
    if (!resumed) {
        int64_t kept = n >= 2 ? (n - 2) / block : 0; /* positions [n - 1, n) are written: kept_blocks */
        for (int64_t r = 0; r < n_rows; r++) {
            if (count[r] > kept) count[r] = kept;
            if (last[r] != n - 1) step[r] = 0; /* continues: one token where the row's last call ended */
            last[r] = n;
        }
        for (int64_t r = 0; r < n_rows; r++)
            if ((every_step || step[r] % reuse == 0) && count[r] < n_full) return NEEDS_STATISTICS;
    }
    for (int64_t r = 0; r < n_rows; r++) {
        row[r].n = n;
        row[r].fresh = every_step || step[r] % reuse == 0;
    }
    if (n_rows * kv_heads * n_full * d < split) threads = 1;
    int status = sparse_step_batch(q, keys, k_stride_h, k_stride_n, values, v_stride_h, v_stride_n, out, rows, n_rows,
                                   kv_heads, group, d, window, block, scale, threads, dtype);
    if (status) return status;
    int64_t b = n_rows ? row[0].b : 0, heads = n_rows * kv_heads, n_blocks = (distant_end - 1 + block - 1) / block;
    int64_t reads = heads * (1 + n - distant_end) + block * heads * b;
    if (n_blocks > n_full) { /* the short last block, where chosen, reads only its distant positions */
        int64_t short_len = distant_end - 1 - n_full * block;
        for (int64_t r = 0; r < n_rows; r++) {
            const int64_t *chosen = (const int64_t *)(intptr_t)row[r].chosen;
            for (int64_t i = 0; i < kv_heads * b; i++) reads -= chosen[i] == n_full ? block - short_len : 0;
        }
    }
    for (int64_t r = 0; r < n_rows; r++) step[r] += 1;
    tally[0] += n_rows, tally[2] += reads, tally[3] += heads;
    return 0;
}
