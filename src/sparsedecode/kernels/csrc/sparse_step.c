/* The sparse decode step on the CPU in one call per layer (float32 caches): mean-pooled block selection over the
 * cached centroids, and attention over anchor + chosen blocks + window read in place from the KV cache.
 *
 * Built at first use by sparsedecode/kernels/cpu.py (cc -O3 -march=native -fopenmp-simd -pthread), called through
 * ctypes.
 * It replaces ~20 small torch operations whose fixed per-call cost dominated below ~32K positions. Semantics are
 * those of sparsedecode.selectors (top_blocks: the b best, ties to the lowest block, ascending) and of
 * sparsedecode.attention.attend_support (softmax over the support, all query heads of a GQA group sharing it).
 * Layouts: q (H, d) contiguous; keys/values rows of d contiguous floats at head * stride_h + position * stride_n;
 * centroids stored (kv, d, capacity): element (h, i, j) at h * c_stride_h + i * c_stride_d + j.
 * The caller checks the rest (sparsedecode/kernels/cpu.py: float32, one d for q, keys and values, caches of at
 * least n rows, chosen (kv, b), b <= n_blocks for selection); a chosen block outside the distant region is skipped.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* e^x for x <= 0 (a logit minus the row's maximum), vectorisable: Cody-Waite reduction by ln 2 and Cephes' degree-6
 * polynomial for expf (relative error ~1e-7, as libm's expf); below -87 it returns ~1e-38 instead of underflowing. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float k = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - k * 0.693359375f + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union {
        int32_t i;
        float f;
    } scale = {.i = ((int32_t)k + 127) << 23};
    return p * scale.f;
}

/* a better than b: a higher score, or an equal score at a lower block index */
static int better(float score_a, int64_t a, float score_b, int64_t b) {
    return score_a > score_b || (score_a == score_b && a < b);
}

static int compare_ascending(const void *x, const void *y) {
    int64_t a = *(const int64_t *)x, b = *(const int64_t *)y;
    return (a > b) - (a < b);
}

/* The KV heads are independent: a call splits them over up to `threads` POSIX threads when its work is large
 * enough to pay for starting them (the caller passes torch's thread count), else runs them in the calling thread. */
typedef int (*head_fn)(const void *job, int64_t h);

typedef struct {
    head_fn run;
    const void *job;
    int64_t first, stop;
    int status;
} part_t;

static void *run_part(void *arg) {
    part_t *part = arg;
    for (int64_t h = part->first; h < part->stop && !part->status; h++) part->status = part->run(part->job, h);
    return NULL;
}

static int over_heads(head_fn run, const void *job, int64_t kv_heads, int64_t threads, int64_t work) {
    enum { MAX_THREADS = 64, MIN_WORK_PER_THREAD = 1 << 18 };
    int64_t parts = threads < kv_heads ? threads : kv_heads;
    if (parts > work / MIN_WORK_PER_THREAD) parts = work / MIN_WORK_PER_THREAD;
    if (parts > MAX_THREADS) parts = MAX_THREADS;
    if (parts < 2) {
        part_t all = {run, job, 0, kv_heads, 0};
        run_part(&all);
        return all.status;
    }
    part_t part[MAX_THREADS];
    pthread_t thread[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int64_t t = 0; t < parts; t++) {
        part[t] = (part_t){run, job, kv_heads * t / parts, kv_heads * (t + 1) / parts, 0};
        started[t] = t > 0 && pthread_create(&thread[t], NULL, run_part, &part[t]) == 0;
        if (t > 0 && !started[t]) run_part(&part[t]); /* no thread to be had: do it here */
    }
    run_part(&part[0]);
    int status = part[0].status;
    for (int64_t t = 1; t < parts; t++) {
        if (started[t]) pthread_join(thread[t], NULL);
        status |= part[t].status;
    }
    return status;
}

typedef struct {
    const float *q, *centroids, *keys;
    int64_t c_stride_h, c_stride_d, n_full, k_stride_h, k_stride_n, group, d, distant_end, block, b, n_blocks;
    int64_t *chosen;
    float *scores; /* kv_heads * n_blocks scratch */
} select_job;

/* The calling thread's score buffer, kept between calls and grown by doubling: no per-step allocation of
 * O(N / B) once the context stops growing past its capacity. */
static __thread float *score_buffer = NULL;
static __thread size_t score_capacity = 0;

static float *score_scratch(size_t needed) {
    if (needed > score_capacity) {
        size_t capacity = score_capacity ? 2 * score_capacity : 4096;
        while (capacity < needed) capacity *= 2;
        float *grown = realloc(score_buffer, capacity * sizeof(float));
        if (!grown) return NULL;
        score_buffer = grown, score_capacity = capacity;
    }
    return score_buffer;
}

static int select_head(const void *arg, int64_t h) {
    const select_job *job = arg;
    int64_t d = job->d, b = job->b, n_full = job->n_full, n_blocks = job->n_blocks, block = job->block;
    float *scores = job->scores + h * n_blocks;
    float *q_mean = malloc(sizeof(float) * (size_t)d); /* O(d + b): small, unlike the scores */
    float *best_scores = malloc(sizeof(float) * (size_t)(b > 0 ? b : 1));
    if (!q_mean || !best_scores) {
        free(q_mean), free(best_scores);
        return -1;
    }
    memset(scores, 0, sizeof(float) * (size_t)n_blocks);
    for (int64_t i = 0; i < d; i++) {
        float sum = 0.0f;
        for (int64_t g = 0; g < job->group; g++) sum += job->q[(h * job->group + g) * d + i];
        q_mean[i] = sum / (float)job->group;
    }
    const float *c = job->centroids + h * job->c_stride_h;
    for (int64_t i = 0; i < d; i++) { /* scores += q_i * row i of the transposed centroids */
        const float *row = c + i * job->c_stride_d;
        float qi = q_mean[i];
#pragma omp simd
        for (int64_t j = 0; j < n_full; j++) scores[j] += qi * row[j];
    }
    if (n_blocks > n_full) { /* the short tail block is not cached: average its keys now */
        int64_t start = 1 + n_full * block, count = job->distant_end - start;
        const float *k = job->keys + h * job->k_stride_h;
        float dot = 0.0f;
        for (int64_t i = 0; i < d; i++) {
            float sum = 0.0f;
            for (int64_t p = start; p < job->distant_end; p++) sum += k[p * job->k_stride_n + i];
            dot += q_mean[i] * (sum / (float)count);
        }
        scores[n_full] = dot;
    }
    /* keep the b best in a list sorted best-first (b is tens at most) */
    int64_t *out = job->chosen + h * b, kept = 0;
    for (int64_t j = 0; j < n_blocks; j++) {
        float s = scores[j];
        if (kept == b && !better(s, j, best_scores[b - 1], out[b - 1])) continue;
        int64_t at = kept < b ? kept++ : b - 1;
        while (at > 0 && better(s, j, best_scores[at - 1], out[at - 1])) {
            best_scores[at] = best_scores[at - 1];
            out[at] = out[at - 1];
            at--;
        }
        best_scores[at] = s;
        out[at] = j;
    }
    qsort(out, (size_t)kept, sizeof(int64_t), compare_ascending);
    free(q_mean), free(best_scores);
    return 0;
}

/* chosen (kv, b) = the b best blocks per KV head, ascending. Returns 0, or -1 when scratch memory ran out. */
int select_mean_pooled(const float *q, const float *centroids, int64_t c_stride_h, int64_t c_stride_d,
                       int64_t n_full, const float *keys, int64_t k_stride_h, int64_t k_stride_n, int64_t kv_heads,
                       int64_t group, int64_t d, int64_t distant_end, int64_t block, int64_t b, int64_t threads,
                       int64_t *chosen) {
    int64_t n_blocks = (distant_end - 1 + block - 1) / block;
    float *scores = score_scratch((size_t)(kv_heads * (n_blocks > 0 ? n_blocks : 1)));
    if (!scores) return -1;
    select_job job = {q,     centroids, keys,        c_stride_h, c_stride_d, n_full,   k_stride_h, k_stride_n,
                      group, d,         distant_end, block,      b,          n_blocks, chosen,     scores};
    return over_heads(select_head, &job, kv_heads, threads, kv_heads * n_full * d);
}

typedef struct {
    const float *q, *keys, *values;
    const int64_t *chosen;
    int64_t k_stride_h, k_stride_n, v_stride_h, v_stride_n, b, group, d, n, distant_end, block;
    float scale;
    float *out;
} attend_job;

static int attend_head(const void *arg, int64_t h) {
    const attend_job *job = arg;
    int64_t group = job->group, d = job->d, block = job->block, distant_end = job->distant_end;
    int64_t capacity = 1 + job->b * block + (job->n - distant_end);
    int64_t *positions = malloc(sizeof(int64_t) * (size_t)capacity);
    float *weights = malloc(sizeof(float) * (size_t)(capacity * group));
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

    const float *qh = job->q + h * group * d;
    for (int64_t s = 0; s < count; s++) { /* logits, one key row against every query of the group */
        const float *k = job->keys + h * job->k_stride_h + positions[s] * job->k_stride_n;
        for (int64_t g = 0; g < group; g++) {
            const float *qg = qh + g * d;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t i = 0; i < d; i++) dot += qg[i] * k[i];
            weights[g * count + s] = dot * job->scale;
        }
    }
    for (int64_t g = 0; g < group; g++) { /* softmax per query head */
        float *w = weights + g * count, top = -INFINITY, total = 0.0f;
#pragma omp simd reduction(max : top)
        for (int64_t s = 0; s < count; s++) top = w[s] > top ? w[s] : top;
#pragma omp simd reduction(+ : total)
        for (int64_t s = 0; s < count; s++) total += (w[s] = exp_nonpositive(w[s] - top));
        float inverse = 1.0f / total;
#pragma omp simd
        for (int64_t s = 0; s < count; s++) w[s] *= inverse;
    }
    float *oh = job->out + h * group * d;
    memset(oh, 0, sizeof(float) * (size_t)(group * d));
    for (int64_t s = 0; s < count; s++) { /* out += w * value row, one value row for the whole group */
        const float *v = job->values + h * job->v_stride_h + positions[s] * job->v_stride_n;
        for (int64_t g = 0; g < group; g++) {
            float ws = weights[g * count + s];
            float *og = oh + g * d;
#pragma omp simd
            for (int64_t i = 0; i < d; i++) og[i] += ws * v[i];
        }
    }
    free(positions), free(weights);
    return 0;
}

/* out (H, d) = softmax(q . k_support * scale) v_support per query head. Returns 0, or -1 on allocation failure. */
int attend_support(const float *q, const float *keys, int64_t k_stride_h, int64_t k_stride_n, const float *values,
                   int64_t v_stride_h, int64_t v_stride_n, const int64_t *chosen, int64_t b, int64_t kv_heads,
                   int64_t group, int64_t d, int64_t n, int64_t distant_end, int64_t block, float scale,
                   int64_t threads, float *out) {
    attend_job job = {q, keys, values, chosen, k_stride_h, k_stride_n, v_stride_h, v_stride_n, b, group, d, n,
                      distant_end, block, scale, out};
    int64_t support = 1 + b * block + (n - distant_end);
    return over_heads(attend_head, &job, kv_heads, threads, 2 * kv_heads * support * group * d);
}
