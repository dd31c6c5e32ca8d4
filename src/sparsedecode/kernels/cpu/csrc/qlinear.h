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
 * zeros; d NaN for one holding a NaN or an infinity, so that the output is NaN as a float product's would be). A
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
 * Q4_PART bytes stay on one thread) and by rows for int8. */

#if defined(__AVX2__)
#include <immintrin.h>
#endif

enum { Q4_SPAN = 2048, Q4_CHUNK = 32, Q4_AHEAD = 8, Q4_PART = 1 << 17, Q8_ROWS = 4, Q8_AHEAD = 2048, Q8_GROUPS = 64 };

typedef struct {
    const uint8_t *weights;
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
        __m256 inverse = _mm256_set1_ps(finite && amax > 0.0f ? 127.0f / amax : 0.0f);
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

/* Outputs n0 .. n0 + count - 1 (count <= Q4_SPAN) of every row over groups g0 .. g1 - 1, into out (rows, n), in
 * plain loops: 32-bit sums per group, then the scales. */
static void q4_plain(const qjob_t *job, int64_t n0, int64_t count, int64_t g0, int64_t g1, float *out) {
    int64_t n = job->n;
    for (int64_t r = 0; r < job->rows; r++) {
        const int8_t *xq = job->xq + r * job->groups * 32;
        float total[Q4_SPAN];
        int32_t sums[Q4_SPAN];
        for (int64_t i = 0; i < count; i++) total[i] = 0.0f;
        for (int64_t g = g0; g < g1; g++) {
            for (int64_t i = 0; i < count; i++) sums[i] = 0;
            for (int64_t j = 0; j < 16; j++) {
                int32_t low = xq[g * 32 + j], high = xq[g * 32 + 16 + j];
                const uint8_t *row = job->weights + (g * 16 + j) * n + n0;
                for (int64_t i = 0; i < count; i++) sums[i] += (row[i] & 15) * low + (row[i] >> 4) * high;
            }
            float d = job->xd[r * job->groups + g], s = job->xs[r * job->groups + g];
            for (int64_t i = 0; i < count; i++) {
                int64_t at = g * n + n0 + i;
                total[i] += (float)sums[i] * (scale_at(job, job->scale, at) * d) + scale_at(job, job->offset, at) * s;
            }
        }
        for (int64_t i = 0; i < count; i++) out[r * n + n0 + i] = total[i];
    }
}

#if defined(__AVX2__)
/* Scales i .. i + 7 of an array of the job's scales. */
static inline __m256 scales8(const qjob_t *job, const void *p, int64_t i) {
    return job->scale32 ? _mm256_loadu_ps((const float *)p + i) : (__m256)half8((const uint16_t *)p + i);
}

/* Outputs n0 .. n0 + 32 chunks - 1 of every row over groups g0 .. g1 - 1, into out, with AVX2 (header). After
 * unpacking a lane's bytes, a 16-bit sum vector holds outputs 0-7 and 16-23 of its chunk (pairs[0]) or 8-15 and 24-31
 * (pairs[1]); widening puts them back in order. */
static void q4_chunks(const qjob_t *job, int64_t n0, int chunks, int64_t g0, int64_t g1, float *out) {
    int64_t n = job->n;
    const __m256i nibble = _mm256_set1_epi8(15);
    for (int64_t r = 0; r < job->rows; r++) {
        const int8_t *xq = job->xq + r * job->groups * 32;
        __m256 total[Q4_SPAN / 8];
        __m256i sums[Q4_SPAN / 8], pairs[Q4_SPAN / 16];
        for (int64_t g = g0; g < g1; g++) {
            for (int64_t half = 0; half < 16; half += 8) {
                for (int64_t j = half; j < half + 8; j++) {
                    uint16_t both = (uint8_t)xq[g * 32 + j] | (uint16_t)((uint8_t)xq[g * 32 + 16 + j] << 8);
                    __m256i x = _mm256_set1_epi16((int16_t)both);
                    const uint8_t *row = job->weights + (g * 16 + j) * n + n0;
                    for (int c = 0; c < chunks; c++) {
                        if (!(c & 1)) _mm_prefetch((const char *)(row + Q4_AHEAD * n + Q4_CHUNK * c), _MM_HINT_T0);
                        __m256i bytes = _mm256_loadu_si256((const __m256i *)(row + Q4_CHUNK * c));
                        __m256i low = _mm256_and_si256(bytes, nibble);
                        __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
                        __m256i a = _mm256_maddubs_epi16(_mm256_unpacklo_epi8(low, high), x);
                        __m256i b = _mm256_maddubs_epi16(_mm256_unpackhi_epi8(low, high), x);
                        /* the half's first row starts its sums: no array cleared beforehand */
                        pairs[2 * c] = j == half ? a : _mm256_add_epi16(pairs[2 * c], a);
                        pairs[2 * c + 1] = j == half ? b : _mm256_add_epi16(pairs[2 * c + 1], b);
                    }
                }
                for (int c = 0; c < chunks; c++) {
                    __m256i a = pairs[2 * c], b = pairs[2 * c + 1];
                    __m256i wide[4] = {_mm256_cvtepi16_epi32(_mm256_castsi256_si128(a)),
                                       _mm256_cvtepi16_epi32(_mm256_castsi256_si128(b)),
                                       _mm256_cvtepi16_epi32(_mm256_extracti128_si256(a, 1)),
                                       _mm256_cvtepi16_epi32(_mm256_extracti128_si256(b, 1))};
                    for (int i = 0; i < 4; i++) sums[4 * c + i] = half ? _mm256_add_epi32(sums[4 * c + i], wide[i]) : wide[i];
                }
            }
            __m256 d = _mm256_set1_ps(job->xd[r * job->groups + g]), s = _mm256_set1_ps(job->xs[r * job->groups + g]);
            for (int v = 0; v < 4 * chunks; v++) {
                int64_t at = g * n + n0 + 8 * v;
                __m256 scaled = _mm256_mul_ps(scales8(job, job->scale, at), d);
                __m256 shifted = _mm256_mul_ps(scales8(job, job->offset, at), s);
                shifted = g == g0 ? shifted : _mm256_add_ps(total[v], shifted);
                total[v] = _mm256_add_ps(shifted, _mm256_mul_ps(_mm256_cvtepi32_ps(sums[v]), scaled));
            }
        }
        for (int v = 0; v < 4 * chunks; v++) _mm256_storeu_ps(out + r * n + n0 + 8 * v, total[v]);
    }
}
#endif

/* Task = slice * tiles + tile: the outputs of one span over one slice's groups. */
static int q4_tile(const void *arg, int64_t task) {
    const qjob_t *job = arg;
    int64_t tiles = (job->n + job->span - 1) / job->span, slice = task / tiles, tile = task % tiles;
    int64_t g0 = job->groups * slice / job->slices, g1 = job->groups * (slice + 1) / job->slices;
    float *out = slice ? job->partial + (slice - 1) * job->rows * job->n : job->out;
    int64_t n0 = tile * job->span, left = job->n - n0 < job->span ? job->n - n0 : job->span, whole = 0;
#if defined(__AVX2__)
    whole = left / Q4_CHUNK * Q4_CHUNK;
    if (whole) q4_chunks(job, n0, (int)(whole / Q4_CHUNK), g0, g1, out);
#endif
    if (left > whole) q4_plain(job, n0 + whole, left - whole, g0, g1, out);
    return 0;
}

#if defined(__AVX2__)
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

/* The int4 product of the quantized activations act (rows, 32 groups) into out (rows, n) as `*tasks` tasks of
 * q4_tile for up to `*parts` threads, in *job; q4_add_partials then completes out. Returns 0, or -1 when memory ran
 * out (nothing to complete). */
static int q4_job(qjob_t *job, int64_t *tasks, int64_t *parts, const uint8_t *packed, const void *scale,
                  const void *offset, const qact_t *act, float *out, int64_t rows, int64_t n, int64_t groups,
                  int64_t scale32, int64_t threads) {
    int64_t slices = threads < 1 ? 1 : threads > groups ? groups : threads, size = groups * 16 * n;
    if (slices > 1 + size / Q4_PART) slices = 1 + size / Q4_PART; /* a small weight: a second thread costs more */
    int64_t span = n > Q4_SPAN ? Q4_SPAN : (n + Q4_CHUNK - 1) / Q4_CHUNK * Q4_CHUNK, tiles = (n + span - 1) / span;
    /* each thread sums its own range of groups over every output: a contiguous part of the packed weight, read as
     * one stream (split by outputs, each thread read every other piece of each row, at about half the rate) */
    float *partial = slices > 1 ? malloc((size_t)((slices - 1) * rows * n) * sizeof(float)) : NULL;
    if (slices > 1 && !partial) return -1;
    *job = (qjob_t){packed, scale, offset, act->xq, act->xd, act->xs, out, rows, n, groups, span, 32, scale32, slices,
                    partial};
    *tasks = slices * tiles, *parts = slices;
    return 0;
}

/* out += the sums of slices 1 .. slices - 1 (in that order), once every task of q4_job's job has run. */
static void q4_add_partials(qjob_t *job) {
    int64_t size = job->rows * job->n;
    for (int64_t p = 1; p < job->slices; p++)
        for (int64_t i = 0; i < size; i++) job->out[i] += job->partial[(p - 1) * size + i];
    free(job->partial);
    job->partial = NULL;
}

/* out (rows, n) = the quantized activations act (rows, 32 groups) times the int4 weight. */
static int q4_product(const uint8_t *packed, const void *scale, const void *offset, const qact_t *act, float *out,
                      int64_t rows, int64_t n, int64_t groups, int64_t scale32, int64_t threads) {
    qjob_t job;
    int64_t tasks, parts;
    if (q4_job(&job, &tasks, &parts, packed, scale, offset, act, out, rows, n, groups, scale32, threads)) return -1;
    int status = parallel(q4_tile, &job, tasks, parts, 0);
    q4_add_partials(&job);
    return status;
}

/* The int8 product of act into out (rows, n) as `*tasks` tasks of q8_rows (Q8_ROWS outputs each) for up to
 * `*parts` threads, in *job. */
static void q8_job(qjob_t *job, int64_t *tasks, int64_t *parts, const int8_t *q, const void *scale,
                   const qact_t *act, float *out, int64_t rows, int64_t n, int64_t groups, int64_t block,
                   int64_t scale32, int64_t threads) {
    *job = (qjob_t){(const uint8_t *)q, scale, NULL, act->xq, act->xd, act->xs, out, rows, n, groups, 0, block,
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

/* out (rows, n) = x (rows, 32 groups) times the int4 weight (its activations quantized first). */
int q4_linear(const uint8_t *packed, const void *scale, const void *offset, const float *x, float *out, int64_t rows,
              int64_t n, int64_t groups, int64_t scale32, int64_t threads) {
    void *space = malloc(qact_bytes(rows * groups));
    if (!space) return -1;
    qact_t act = qact_at(space, rows * groups);
    quantize_into(&act, x, rows, groups);
    int status = q4_product(packed, scale, offset, &act, out, rows, n, groups, scale32, threads);
    free(space);
    return status;
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
