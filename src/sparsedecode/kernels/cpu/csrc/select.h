/* Included by sparse_step.c (one translation unit): mean-pooled block selection over the cached centroids. */

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
