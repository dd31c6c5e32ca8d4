/* Included by sparse_step.c (one translation unit): weight-only quantized linear layers for a decode step's few rows
 * (sparsedecode/models/quantized.py holds the formats and the same product in torch operations).
 *
 * int4: w[n, 32g + j] = nibble * scale[g, n] + offset[g, n]; packed (G, 16, N) bytes, byte j of group g holding input
 * j in its low nibble and input j + 16 in its high one (GGUF's Q4_0/Q4_1 byte order), the outputs innermost; scale
 * and offset (G, N). int8: w[n, 32g + j] = q[n, g, j] * scale[n, (32g + j) / block]; q (N, G, 32), scale (N, 32G /
 * block), block 32 (Q8_0) or 16 (Q6_K's sub-blocks). Scales are float16 (GGUF's own) or, with `scale32`, float32
 * (a K-quant's super-block scale times a sub-block's integer scale, exact in float32).
 *
 * The activations x (rows, 32 G) float32 are first quantized as llama.cpp quantizes them for its dot products: per
 * group of 32, d = max |x| / 127 and xq = rint(x * (127 / max |x|)) in -127..127 (d = 0 and xq = 0 for a group of
 * zeros; xq = 0 for one whose 127 / max |x| overflows, max |x| below ~3.7e-37; d NaN for one holding a NaN or an
 * infinity, so that the output is NaN as a float product's would be). A
 * group's dot product of integers is then exact in 32-bit integers, and the output (rows, N) float32 is
 *   int4: sum over g of (scale * d) * sum_j nibble * xq + offset * (d * sum_j xq)
 *   int8: sum over g of (scale * d) * sum_j q * xq,
 * that is, the float product of the de-quantized weight with the de-quantized activations (xq * d), summed in
 * another order.
 *
 * int4 runs over spans of Q4_SPAN outputs: for each group, 16 rows of span bytes read in order (a stream the
 * hardware prefetcher follows). With AVX2, 32 outputs at a time: each byte's two nibbles side by side, times the
 * pair (xq[j], xq[j + 16]) by one unsigned-by-signed multiply-add into 16-bit sums (8 rows at most: 8 * 2 * 15 * 127
 * fits), widened to 32 bits; elsewhere the same sums in plain loops. int8 takes Q8_ROWS outputs at a time, each a sum
 * over 32 contiguous inputs per group (AVX2: |q| times xq with q's sign, multiply-added to 32 bits). Work is split
 * over threads by ranges of groups for int4 (each thread's part of the weight one contiguous stream; weights under
 * Q4_PART bytes stay on one thread) and by rows for int8. The int4 products (and int5's, GGUF's Q5_0: int4 with a
 * plane of fifth bits) are in qlinear4.h, included after this file. */

#if defined(__AVX2__)
#include <immintrin.h>
#endif

enum { Q4_SPAN = 2048, Q4_CHUNK = 32, Q4_AHEAD = 8, Q4_PART = 1 << 17, Q8_ROWS = 4, Q8_AHEAD = 2048, Q8_GROUPS = 64 };

typedef struct {
    const uint8_t *weights;
    const uint8_t *high;        /* int5: (G, 4, N) the fifth bits (qlinear4.h); NULL for int4 and int8 */
    const void *scale, *offset; /* float16, or float32 with scale32 */
    const int8_t *xq; /* (rows, 32 G) the quantized activations (qact_t) */
    const float *xd;  /* (rows, G) their scales d */
    const float *xs;  /* (rows, G) d * sum of the group's xq */
    float *out;
    int64_t rows, n, groups, span; /* span: outputs per int4 task, a multiple of Q4_CHUNK, at most Q4_SPAN */
    int64_t block, scale32;         /* int8: inputs per scale (16 or 32); whether scales are float32 */
    int64_t slices;                 /* int4: ranges of groups summed apart (one per thread), then added */
    float *partial;                 /* int4: (slices - 1, rows, n), the sums of slices 1 .. slices - 1 */
} qjob_t;

/* Scale i of an array of the job's scales, as a float. */
static inline float scale_at(const qjob_t *job, const void *p, int64_t i) {
    return job->scale32 ? ((const float *)p)[i] : half_to_float(((const uint16_t *)p)[i]);
}

/* Group i's xq, xd and xs from its scale inputs: amax = max |v| (NaN when a value is NaN), total = sum of xq. */
static inline void group_scales(float amax, int32_t total, int64_t i, float *xd, float *xs) {
    xd[i] = amax <= 3.4028235e38f ? amax / 127.0f : NAN;
    xs[i] = xd[i] * (float)total;
}

/* x (rows, 32 groups) -> xq, xd, xs as the header says; with AVX2 eight values at a time, the same operations on
 * each value (x times 127 / amax, rounded to nearest even as rintf rounds), so the same numbers. */
static void quantize_rows(const float *x, int64_t rows, int64_t groups, int8_t *xq, float *xd, float *xs) {
    for (int64_t i = 0; i < rows * groups; i++) {
        const float *v = x + i * 32;
#if defined(__AVX2__)
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 a[4], top = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
        for (int c = 0; c < 4; c++) {
            a[c] = _mm256_loadu_ps(v + 8 * c);
            top = _mm256_max_ps(_mm256_andnot_ps(sign, a[c]), top);
            odd = _mm256_or_ps(odd, _mm256_cmp_ps(a[c], a[c], _CMP_UNORD_Q));
        }
        __m128 half = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
        half = _mm_max_ps(half, _mm_movehl_ps(half, half));
        float amax = _mm_cvtss_f32(_mm_max_ss(half, _mm_shuffle_ps(half, half, 1)));
        amax = _mm256_movemask_ps(odd) ? NAN : amax;
        int finite = amax <= 3.4028235e38f;
        float ratio = finite && amax > 0.0f ? 127.0f / amax : 0.0f;
        __m256 inverse = _mm256_set1_ps(ratio <= 3.4028235e38f ? ratio : 0.0f); /* overflowed: the group as zeros */
        __m256i q[4], total = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            q[c] = finite ? _mm256_cvtps_epi32(_mm256_mul_ps(a[c], inverse)) : _mm256_setzero_si256();
            total = _mm256_add_epi32(total, q[c]);
        }
        __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)); /* lanes in order */
        _mm256_storeu_si256((__m256i *)(xq + i * 32), bytes);
        __m128i sum = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
        sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0x4e));
        sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0xb1));
        group_scales(amax, _mm_cvtsi128_si32(sum), i, xd, xs);
#else
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) amax = fabsf(v[j]) > amax || v[j] != v[j] ? fabsf(v[j]) : amax;
        int finite = amax <= 3.4028235e38f;
        float inverse = finite && amax > 0.0f ? 127.0f / amax : 0.0f;
        inverse = inverse <= 3.4028235e38f ? inverse : 0.0f; /* overflowed: the group as zeros */
        int32_t total = 0;
        for (int j = 0; j < 32; j++) {
            int8_t q = finite ? (int8_t)rintf(v[j] * inverse) : 0;
            xq[i * 32 + j] = q;
            total += q;
        }
        group_scales(amax, total, i, xd, xs);
#endif
    }
}

#if defined(__AVX2__)
/* Scales i .. i + 7 of an array of the job's scales. */
static inline __m256 scales8(const qjob_t *job, const void *p, int64_t i) {
    return job->scale32 ? _mm256_loadu_ps((const float *)p + i) : (__m256)half8((const uint16_t *)p + i);
}

/* One group's 32 products of int8 weights w and activations x, summed in 8 lanes of 32 bits as floats. */
static inline __m256 q8_dots(const int8_t *w, const int8_t *x) {
    __m256i wg = _mm256_loadu_si256((const __m256i *)w), xg = _mm256_loadu_si256((const __m256i *)x);
    __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(wg), _mm256_sign_epi8(xg, wg));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

/* Output o of row r, one scale per group (block 32): each group's scale times the activations' d taken eight at a
 * time (Q8_GROUPS groups a pass), then the groups' sums scaled in that order. */
static float q8_output(const qjob_t *job, int64_t r, int64_t o) {
    int64_t groups = job->groups, k = groups * 32;
    const int8_t *w = (const int8_t *)job->weights + o * k, *xq = job->xq + r * k;
    const float *xd = job->xd + r * groups;
    float scaled[Q8_GROUPS];
    __m256 total = _mm256_setzero_ps();
    for (int64_t g0 = 0; g0 < groups; g0 += Q8_GROUPS) {
        int64_t count = groups - g0 < Q8_GROUPS ? groups - g0 : Q8_GROUPS, g = 0, at = o * groups + g0;
        for (; g + 8 <= count; g += 8)
            _mm256_storeu_ps(scaled + g, _mm256_mul_ps(scales8(job, job->scale, at + g), _mm256_loadu_ps(xd + g0 + g)));
        for (; g < count; g++) scaled[g] = scale_at(job, job->scale, at + g) * xd[g0 + g];
        for (g = 0; g < count; g++) {
            if (!(g & 1)) _mm_prefetch((const char *)(w + (g0 + g) * 32 + Q8_AHEAD), _MM_HINT_T0);
            __m256 dots = q8_dots(w + (g0 + g) * 32, xq + (g0 + g) * 32);
            total = _mm256_add_ps(total, _mm256_mul_ps(dots, _mm256_set1_ps(scaled[g])));
        }
    }
    float sum = 0.0f;
    for (int lane = 0; lane < 8; lane++) sum += total[lane];
    return sum;
}
#endif

/* Outputs part * Q8_ROWS .. + Q8_ROWS - 1, each a row of 32 G int8 weights: a 32-bit sum per block, scaled. */
static int q8_rows(const void *arg, int64_t part) {
    const qjob_t *job = arg;
    int64_t groups = job->groups, k = groups * 32, n0 = part * Q8_ROWS, per = 32 / job->block; /* scales a group */
    int64_t count = job->n - n0 < Q8_ROWS ? job->n - n0 : Q8_ROWS;
    const int8_t *q = (const int8_t *)job->weights;
    for (int64_t r = 0; r < job->rows; r++) {
        const int8_t *xq = job->xq + r * k;
        const float *xd = job->xd + r * groups;
        for (int64_t i = 0; i < count; i++) {
            int64_t o = n0 + i;
            const int8_t *w = q + o * k;
            float sum = 0.0f;
#if defined(__AVX2__)
            if (per == 1) {
                job->out[r * job->n + o] = q8_output(job, r, o);
                continue;
            }
            __m256 total = _mm256_setzero_ps();
            for (int64_t g = 0; g < groups; g++) { /* two scales a group (Q6_K's blocks of 16) */
                if (!(g & 1)) _mm_prefetch((const char *)(w + g * 32 + Q8_AHEAD), _MM_HINT_T0);
                __m256 dots = q8_dots(w + g * 32, xq + g * 32);
                const int64_t at = (o * groups + g) * per;
                float first = scale_at(job, job->scale, at) * xd[g];
                float second = scale_at(job, job->scale, at + 1) * xd[g];
                __m256 scale = _mm256_setr_m128(_mm_set1_ps(first), _mm_set1_ps(second)); /* lanes 0-3: inputs 0-15 */
                total = _mm256_add_ps(total, _mm256_mul_ps(dots, scale));
            }
            for (int lane = 0; lane < 8; lane++) sum += total[lane];
#else
            for (int64_t b = 0; b < groups * per; b++) {
                int32_t dot = 0;
                for (int64_t j = b * job->block; j < (b + 1) * job->block; j++) dot += w[j] * xq[j];
                sum += (float)dot * (scale_at(job, job->scale, o * groups * per + b) * xd[b / per]);
            }
#endif
            job->out[r * job->n + o] = sum;
        }
    }
    return 0;
}

/* Activations as the products read them: xq (rows, 32 G), xd and xs (rows, G), quantized once for every product
 * of the same x (the native step's q, k and v, or gate and up). */
typedef struct {
    int8_t *xq;
    float *xd, *xs;
} qact_t;

/* Bytes of a qact_t's three arrays for `values` groups (rows * G), laid out by qact_at. */
static inline size_t qact_bytes(int64_t values) { return (size_t)values * (32 + 2 * sizeof(float)); }

/* The qact_t whose arrays lie in `space` (qact_bytes of `values` groups, 4-byte aligned). */
static inline qact_t qact_at(void *space, int64_t values) {
    float *xd = space, *xs = xd + values;
    return (qact_t){(int8_t *)(xs + values), xd, xs};
}

/* x (rows, 32 groups) quantized into act. */
static void quantize_into(const qact_t *act, const float *x, int64_t rows, int64_t groups) {
    quantize_rows(x, rows, groups, act->xq, act->xd, act->xs);
}

/* The int8 product of act into out (rows, n) as `*tasks` tasks of q8_rows (Q8_ROWS outputs each) for up to
 * `*parts` threads, in *job. */
static void q8_job(qjob_t *job, int64_t *tasks, int64_t *parts, const int8_t *q, const void *scale,
                   const qact_t *act, float *out, int64_t rows, int64_t n, int64_t groups, int64_t block,
                   int64_t scale32, int64_t threads) {
    *job = (qjob_t){(const uint8_t *)q, NULL, scale, NULL, act->xq, act->xd, act->xs, out, rows, n, groups, 0, block,
                    scale32, 1, NULL};
    *tasks = (n + Q8_ROWS - 1) / Q8_ROWS;
    *parts = threads < *tasks ? threads : *tasks;
}

/* out (rows, n) = the quantized activations act (rows, 32 groups) times the int8 weight. */
static int q8_product(const int8_t *q, const void *scale, const qact_t *act, float *out, int64_t rows, int64_t n,
                      int64_t groups, int64_t block, int64_t scale32, int64_t threads) {
    qjob_t job;
    int64_t tasks, parts;
    q8_job(&job, &tasks, &parts, q, scale, act, out, rows, n, groups, block, scale32, threads);
    return parallel(q8_rows, &job, tasks, parts, 0);
}

/* out (rows, n) = x (rows, 32 groups) times the int8 weight (its activations quantized first). */
int q8_linear(const int8_t *q, const void *scale, const float *x, float *out, int64_t rows, int64_t n, int64_t groups,
              int64_t block, int64_t scale32, int64_t threads) {
    void *space = malloc(qact_bytes(rows * groups));
    if (!space) return -1;
    qact_t act = qact_at(space, rows * groups);
    quantize_into(&act, x, rows, groups);
    int status = q8_product(q, scale, &act, out, rows, n, groups, block, scale32, threads);
    free(space);
    return status;
}
