/* The sparse decode step on the CPU in one call per layer (float32 caches): mean-pooled block selection over the
 * cached centroids, and attention over anchor + chosen blocks + window read in place from the KV cache.
 *
 * Built at first use by sparsedecode/cpu_kernel.py (cc -O3 -march=native -fopenmp-simd) and called through ctypes.
 * It replaces ~20 small torch operations whose fixed per-call cost dominated below ~32K positions. Semantics are
 * those of sparsedecode.selectors (top_blocks: the b best, ties to the lowest block, ascending) and of
 * sparsedecode.attention.attend_support (softmax over the support, all query heads of a GQA group sharing it).
 * Layouts: q (H, d) contiguous; keys/values rows of d contiguous floats at head * stride_h + position * stride_n;
 * centroids stored (kv, d, capacity): element (h, i, j) at h * c_stride_h + i * c_stride_d + j.
 */
#include <math.h>
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

/* Returns 0, or -1 when a scratch buffer could not be allocated (the caller falls back to torch). */
int select_mean_pooled(const float *q, const float *centroids, int64_t c_stride_h, int64_t c_stride_d,
                       int64_t n_full, const float *keys, int64_t k_stride_h, int64_t k_stride_n, int64_t kv_heads,
                       int64_t group, int64_t d, int64_t distant_end, int64_t block, int64_t b, int64_t *chosen) {
    int64_t n_blocks = (distant_end - 1 + block - 1) / block;
    float *scores = malloc(sizeof(float) * (size_t)(n_blocks > 0 ? n_blocks : 1));
    float *q_mean = malloc(sizeof(float) * (size_t)d);
    float *best_scores = malloc(sizeof(float) * (size_t)(b > 0 ? b : 1));
    if (!scores || !q_mean || !best_scores) {
        free(scores), free(q_mean), free(best_scores);
        return -1;
    }
    for (int64_t h = 0; h < kv_heads; h++) {
        for (int64_t i = 0; i < d; i++) {
            float sum = 0.0f;
            for (int64_t g = 0; g < group; g++) sum += q[(h * group + g) * d + i];
            q_mean[i] = sum / (float)group;
        }
        memset(scores, 0, sizeof(float) * (size_t)n_blocks);
        const float *c = centroids + h * c_stride_h;
        for (int64_t i = 0; i < d; i++) { /* scores += q_i * row i of the transposed centroids */
            const float *row = c + i * c_stride_d;
            float qi = q_mean[i];
#pragma omp simd
            for (int64_t j = 0; j < n_full; j++) scores[j] += qi * row[j];
        }
        if (n_blocks > n_full) { /* the short tail block is not cached: average its keys now */
            int64_t start = 1 + n_full * block, count = distant_end - start;
            float dot = 0.0f;
            for (int64_t i = 0; i < d; i++) {
                float sum = 0.0f;
                for (int64_t p = start; p < distant_end; p++) sum += keys[h * k_stride_h + p * k_stride_n + i];
                dot += q_mean[i] * (sum / (float)count);
            }
            scores[n_full] = dot;
        }
        /* keep the b best in a list sorted best-first (b is tens at most) */
        int64_t *out = chosen + h * b, kept = 0;
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
    }
    free(scores), free(q_mean), free(best_scores);
    return 0;
}

/* out (H, d) = softmax(q . k_support * scale) v_support per query head. Returns 0, or -1 on allocation failure. */
int attend_support(const float *q, const float *keys, int64_t k_stride_h, int64_t k_stride_n, const float *values,
                   int64_t v_stride_h, int64_t v_stride_n, const int64_t *chosen, int64_t b, int64_t kv_heads,
                   int64_t group, int64_t d, int64_t n, int64_t distant_end, int64_t block, float scale, float *out) {
    int64_t capacity = 1 + b * block + (n - distant_end);
    int64_t *positions = malloc(sizeof(int64_t) * (size_t)capacity);
    float *weights = malloc(sizeof(float) * (size_t)(capacity * group));
    if (!positions || !weights) {
        free(positions), free(weights);
        return -1;
    }
    for (int64_t h = 0; h < kv_heads; h++) {
        int64_t count = 0;
        positions[count++] = 0;
        for (int64_t c = 0; c < b; c++) {
            int64_t start = 1 + chosen[h * b + c] * block;
            int64_t stop = start + block < distant_end ? start + block : distant_end;
            for (int64_t p = start; p < stop; p++) positions[count++] = p;
        }
        for (int64_t p = distant_end; p < n; p++) positions[count++] = p;

        const float *qh = q + h * group * d;
        for (int64_t s = 0; s < count; s++) { /* logits, one key row against every query of the group */
            const float *k = keys + h * k_stride_h + positions[s] * k_stride_n;
            for (int64_t g = 0; g < group; g++) {
                const float *qg = qh + g * d;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t i = 0; i < d; i++) dot += qg[i] * k[i];
                weights[g * count + s] = dot * scale;
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
        float *oh = out + h * group * d;
        memset(oh, 0, sizeof(float) * (size_t)(group * d));
        for (int64_t s = 0; s < count; s++) { /* out += w * value row, one value row for the whole group */
            const float *v = values + h * v_stride_h + positions[s] * v_stride_n;
            for (int64_t g = 0; g < group; g++) {
                float ws = weights[g * count + s];
                float *og = oh + g * d;
#pragma omp simd
                for (int64_t i = 0; i < d; i++) og[i] += ws * v[i];
            }
        }
    }
    free(positions), free(weights);
    return 0;
}
