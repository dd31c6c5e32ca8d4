/* Included by sparse_step.c (one translation unit): weight-only quantized linear layers for a decode step's few rows
 * (sparsedecode/models/quantized.py holds the formats and the same product in torch operations).
 *
 * int4: w[n, 32g + j] = nibble * scale[g, n] + offset[g, n]; packed (G, 16, N) bytes, byte j of group g holding input
 * j in its low nibble and input j + 16 in its high one (GGUF's Q4_0/Q4_1 byte order), the outputs innermost; scale
 * and offset (G, N) float16. int8: w[n, 32g + j] = q[n, g, j] * scale[n, g]; q (N, G, 32), scale (N, G) float16.
 * Activations x (rows, 32 G) and the output (rows, N) are float32; every product and sum is float32.
 *
 * int4 runs over spans of Q4_SPAN outputs: for each group, 16 rows of Q4_SPAN bytes read in order make Q4_SPAN
 * independent sums (8-lane vectors, -march=native: AVX2's byte widening and FMA where the CPU has them), then one
 * multiply-add per output applies the group's scale and its offset times the group's sum of x. int8 takes Q8_ROWS
 * outputs at a time, each a sum over 32 contiguous inputs per group. Work is split over threads by spans and rows. */

enum { Q4_SPAN = 512, Q4_VECS = Q4_SPAN / 8, Q8_ROWS = 4 };
typedef uint8_t v8b __attribute__((vector_size(8)));
typedef int8_t v8c __attribute__((vector_size(8)));

/* 8 bytes at p widened to 32 bits: AVX2's one instruction where the build targets it (compilers turn the generic
 * conversion into eight byte loads) */
#if defined(__AVX2__)
#include <immintrin.h>
static inline v8i widen_u8(const uint8_t *p) { return (v8i)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline v8 widen_s8(const int8_t *p) {
    return (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#else
static inline v8i widen_u8(const uint8_t *p) {
    v8b b;
    memcpy(&b, p, 8);
    return __builtin_convertvector(b, v8i);
}
static inline v8 widen_s8(const int8_t *p) {
    v8c b;
    memcpy(&b, p, 8);
    return __builtin_convertvector(b, v8);
}
#endif

typedef struct {
    const uint8_t *weights;
    const uint16_t *scale, *offset;
    const float *x, *xsum;
    float *out;
    int64_t rows, n, groups, span; /* span: outputs per int4 task, a multiple of 8, at most Q4_SPAN */
} qjob_t;

/* Outputs n0 .. n0 + 8 vecs - 1 of every row (vecs <= Q4_VECS). The weight is read in its stored order, row (g, j) after row (g, j - 1),
 * Q4_SPAN bytes of each: a stream the hardware prefetcher follows (a tile of 64 outputs across all rows instead,
 * 16 G lines N bytes apart, waited on memory at every line of a weight that is not in the cache); the span's
 * accumulators (8 lanes each) stay in L1. */
static void q4_span(const qjob_t *job, int64_t n0, int vecs) {
    int64_t n = job->n;
    for (int64_t r = 0; r < job->rows; r++) {
        const float *x = job->x + r * job->groups * 32, *xsum = job->xsum + r * job->groups;
        v8 total[Q4_VECS], acc[Q4_VECS];
        for (int v = 0; v < vecs; v++) total[v] = splat8(0.0f);
        for (int64_t g = 0; g < job->groups; g++) {
            const uint8_t *bytes = job->weights + g * 16 * n + n0;
            for (int v = 0; v < vecs; v++) acc[v] = splat8(0.0f);
            for (int64_t j = 0; j < 16; j++) {
                v8 low = splat8(x[g * 32 + j]), high = splat8(x[g * 32 + 16 + j]);
                const uint8_t *row = bytes + j * n;
                for (int v = 0; v < vecs; v++) {
                    v8i q = widen_u8(row + 8 * v);
                    acc[v] += __builtin_convertvector(q & 15, v8) * low + __builtin_convertvector(q >> 4, v8) * high;
                }
            }
            v8 sum = splat8(xsum[g]);
            for (int v = 0; v < vecs; v++) {
                int64_t at = g * n + n0 + 8 * v;
                total[v] += acc[v] * half8(job->scale + at) + half8(job->offset + at) * sum;
            }
        }
        for (int v = 0; v < vecs; v++) *(v8u *)(job->out + r * n + n0 + 8 * v) = total[v];
    }
}

/* The last outputs, fewer than 8: one at a time. */
static void q4_tail(const qjob_t *job, int64_t n0) {
    int64_t n = job->n;
    for (int64_t r = 0; r < job->rows; r++) {
        const float *x = job->x + r * job->groups * 32, *xsum = job->xsum + r * job->groups;
        for (int64_t o = n0; o < n; o++) {
            float total = 0.0f;
            for (int64_t g = 0; g < job->groups; g++) {
                float acc = 0.0f;
                for (int64_t j = 0; j < 16; j++) {
                    uint8_t b = job->weights[(g * 16 + j) * n + o];
                    acc += (float)(b & 15) * x[g * 32 + j] + (float)(b >> 4) * x[g * 32 + 16 + j];
                }
                total += acc * half_to_float(job->scale[g * n + o]) + half_to_float(job->offset[g * n + o]) * xsum[g];
            }
            job->out[r * n + o] = total;
        }
    }
}

static int q4_tile(const void *arg, int64_t tile) {
    const qjob_t *job = arg;
    int64_t n0 = tile * job->span, left = job->n - n0 < job->span ? job->n - n0 : job->span;
    if (left >= 8) q4_span(job, n0, (int)(left / 8));
    if (left % 8) q4_tail(job, n0 + left / 8 * 8);
    return 0;
}

/* Outputs part * 4 .. + 3, each a row of 32 G int8 weights: per group two 8-lane sums, scaled; one horizontal sum at
 * the end. */
static int q8_rows(const void *arg, int64_t part) {
    const qjob_t *job = arg;
    int64_t groups = job->groups, k = groups * 32, n0 = part * Q8_ROWS;
    int64_t count = job->n - n0 < Q8_ROWS ? job->n - n0 : Q8_ROWS;
    const int8_t *q = (const int8_t *)job->weights;
    for (int64_t r = 0; r < job->rows; r++) {
        const float *x = job->x + r * k;
        for (int64_t i = 0; i < count; i++) {
            int64_t o = n0 + i;
            const int8_t *w = q + o * k;
            v8 total = splat8(0.0f);
            for (int64_t g = 0; g < groups; g++) {
                const int8_t *wg = w + g * 32;
                const float *xg = x + g * 32;
                v8 a = widen_s8(wg) * load8(xg), b = widen_s8(wg + 8) * load8(xg + 8);
                a += widen_s8(wg + 16) * load8(xg + 16);
                b += widen_s8(wg + 24) * load8(xg + 24);
                total += (a + b) * splat8(half_to_float(job->scale[o * groups + g]));
            }
            float sum = 0.0f;
            for (int lane = 0; lane < 8; lane++) sum += total[lane];
            job->out[r * job->n + o] = sum;
        }
    }
    return 0;
}

/* out (rows, n) = x (rows, 32 groups) times the int4 weight; xsum (rows, groups): each group's sum of x. */
int q4_linear(const uint8_t *packed, const uint16_t *scale, const uint16_t *offset, const float *x, const float *xsum,
              float *out, int64_t rows, int64_t n, int64_t groups, int64_t threads) {
    int64_t parts = threads < 1 ? 1 : threads, span = (n + parts - 1) / parts;
    span = span > Q4_SPAN ? Q4_SPAN : (span + 7) / 8 * 8; /* the outputs in about one span per thread */
    qjob_t job = {packed, scale, offset, x, xsum, out, rows, n, groups, span};
    int64_t tiles = (n + span - 1) / span;
    return parallel(q4_tile, &job, tiles, threads < tiles ? threads : tiles, 0);
}

/* out (rows, n) = x (rows, 32 groups) times the int8 weight. */
int q8_linear(const int8_t *q, const uint16_t *scale, const float *x, float *out, int64_t rows, int64_t n,
              int64_t groups, int64_t threads) {
    qjob_t job = {(const uint8_t *)q, scale, NULL, x, NULL, out, rows, n, groups, 0};
    int64_t parts = (n + Q8_ROWS - 1) / Q8_ROWS;
    return parallel(q8_rows, &job, parts, threads < parts ? threads : parts, 0);
}
