/* Included by sparse_step.c after qlinear.h: the int4 and int5 products (formats and activations: qlinear.h).
 *
 * int5 is int4 with a fifth bit per weight: w[n, 32g + j] = (nibble + 16 bit) * scale[g, n] + offset[g, n] (GGUF's
 * Q5_0: scale d, offset -16 d). The bits lie in a plane `high` (G, 4, N) bytes beside the nibbles, outputs
 * innermost: byte b of group g, output n, holds in bit i the fifth bit of input 4b + i and in bit 4 + i that of input
 * 16 + 4b + i (i = 0..3), so the byte of nibble row j (inputs j and j + 16) is plane row j / 4 shifted right by j % 4,
 * its bits 0 and 4 the two weights' fifth bits. With AVX2 the unsigned 5-bit values (0..31) take the same
 * multiply-add as nibbles, four rows at most into a 16-bit sum (4 * 2 * 31 * 127 fits). */

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
                const uint8_t *bits = job->high ? job->high + (g * 4 + j / 4) * n + n0 : NULL;
                for (int64_t i = 0; i < count; i++) {
                    int32_t fifth = bits ? bits[i] >> (j % 4) : 0;
                    sums[i] += ((row[i] & 15) | (fifth & 1) << 4) * low + ((row[i] >> 4) | (fifth & 16)) * high;
                }
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
/* Outputs n0 .. n0 + 32 chunks - 1 of every row over groups g0 .. g1 - 1, into out, with AVX2 (qlinear.h's header;
 * `five`: the int5 weights of this file's). After unpacking a lane's bytes, a 16-bit sum vector holds outputs 0-7
 * and 16-23 of its chunk (pairs[0]) or 8-15 and 24-31 (pairs[1]); widening puts them back in order. */
static inline __attribute__((always_inline)) void q4_chunks_as(const qjob_t *job, int64_t n0, int chunks, int64_t g0,
                                                               int64_t g1, float *out, int five) {
    int64_t n = job->n, rows16 = five ? 4 : 8; /* nibble rows a 16-bit sum takes */
    const __m256i nibble = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1), sixteen = _mm256_set1_epi8(16);
    for (int64_t r = 0; r < job->rows; r++) {
        const int8_t *xq = job->xq + r * job->groups * 32;
        __m256 total[Q4_SPAN / 8];
        __m256i sums[Q4_SPAN / 8], pairs[Q4_SPAN / 16];
        for (int64_t g = g0; g < g1; g++) {
            for (int64_t part = 0; part < 16; part += rows16) {
                for (int64_t j = part; j < part + rows16; j++) {
                    uint16_t both = (uint8_t)xq[g * 32 + j] | (uint16_t)((uint8_t)xq[g * 32 + 16 + j] << 8);
                    __m256i x = _mm256_set1_epi16((int16_t)both);
                    const uint8_t *row = job->weights + (g * 16 + j) * n + n0;
                    const uint8_t *bits = five ? job->high + (g * 4 + j / 4) * n + n0 : NULL;
                    for (int c = 0; c < chunks; c++) {
                        if (!(c & 1)) _mm_prefetch((const char *)(row + Q4_AHEAD * n + Q4_CHUNK * c), _MM_HINT_T0);
                        __m256i bytes = _mm256_loadu_si256((const __m256i *)(row + Q4_CHUNK * c));
                        __m256i low = _mm256_and_si256(bytes, nibble);
                        __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
                        if (five) {
                            if (!(c & 1) && !(j & 3))
                                _mm_prefetch((const char *)(bits + 2 * n + Q4_CHUNK * c), _MM_HINT_T0);
                            __m256i fifth = _mm256_loadu_si256((const __m256i *)(bits + Q4_CHUNK * c));
                            fifth = _mm256_srl_epi16(fifth, _mm_cvtsi32_si128((int)(j & 3)));
                            low = _mm256_or_si256(low, _mm256_slli_epi16(_mm256_and_si256(fifth, one), 4));
                            high = _mm256_or_si256(high, _mm256_and_si256(fifth, sixteen));
                        }
                        __m256i a = _mm256_maddubs_epi16(_mm256_unpacklo_epi8(low, high), x);
                        __m256i b = _mm256_maddubs_epi16(_mm256_unpackhi_epi8(low, high), x);
                        /* the part's first row starts its sums: no array cleared beforehand */
                        pairs[2 * c] = j == part ? a : _mm256_add_epi16(pairs[2 * c], a);
                        pairs[2 * c + 1] = j == part ? b : _mm256_add_epi16(pairs[2 * c + 1], b);
                    }
                }
                for (int c = 0; c < chunks; c++) {
                    __m256i a = pairs[2 * c], b = pairs[2 * c + 1];
                    __m256i wide[4] = {_mm256_cvtepi16_epi32(_mm256_castsi256_si128(a)),
                                       _mm256_cvtepi16_epi32(_mm256_castsi256_si128(b)),
                                       _mm256_cvtepi16_epi32(_mm256_extracti128_si256(a, 1)),
                                       _mm256_cvtepi16_epi32(_mm256_extracti128_si256(b, 1))};
                    for (int i = 0; i < 4; i++)
                        sums[4 * c + i] = part ? _mm256_add_epi32(sums[4 * c + i], wide[i]) : wide[i];
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

static void q4_chunks(const qjob_t *job, int64_t n0, int chunks, int64_t g0, int64_t g1, float *out) {
    q4_chunks_as(job, n0, chunks, g0, g1, out, 0);
}

static void q5_chunks(const qjob_t *job, int64_t n0, int chunks, int64_t g0, int64_t g1, float *out) {
    q4_chunks_as(job, n0, chunks, g0, g1, out, 1);
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
    if (whole) (job->high ? q5_chunks : q4_chunks)(job, n0, (int)(whole / Q4_CHUNK), g0, g1, out);
#endif
    if (left > whole) q4_plain(job, n0 + whole, left - whole, g0, g1, out);
    return 0;
}

/* The int4 product (int5 with the plane `high`, else NULL) of the quantized activations act (rows, 32 groups) into
 * out (rows, n) as `*tasks` tasks of q4_tile for up to `*parts` threads, in *job; q4_add_partials then completes out.
 * Returns 0, or -1 when memory ran out (nothing to complete). */
static int q4_job(qjob_t *job, int64_t *tasks, int64_t *parts, const uint8_t *packed, const uint8_t *high,
                  const void *scale, const void *offset, const qact_t *act, float *out, int64_t rows, int64_t n,
                  int64_t groups, int64_t scale32, int64_t threads) {
    int64_t slices = threads < 1 ? 1 : threads > groups ? groups : threads, size = groups * 16 * n;
    if (slices > 1 + size / Q4_PART) slices = 1 + size / Q4_PART; /* a small weight: a second thread costs more */
    int64_t span = n > Q4_SPAN ? Q4_SPAN : (n + Q4_CHUNK - 1) / Q4_CHUNK * Q4_CHUNK, tiles = (n + span - 1) / span;
    /* each thread sums its own range of groups over every output: a contiguous part of the packed weight, read as
     * one stream (split by outputs, each thread read every other piece of each row, at about half the rate) */
    float *partial = slices > 1 ? malloc((size_t)((slices - 1) * rows * n) * sizeof(float)) : NULL;
    if (slices > 1 && !partial) return -1;
    *job = (qjob_t){packed, high, scale, offset, act->xq, act->xd, act->xs, out, rows, n, groups, span, 32, scale32,
                    slices, partial};
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

/* out (rows, n) = the quantized activations act (rows, 32 groups) times the int4 (or int5) weight. */
static int q4_product(const uint8_t *packed, const uint8_t *high, const void *scale, const void *offset,
                      const qact_t *act, float *out, int64_t rows, int64_t n, int64_t groups, int64_t scale32,
                      int64_t threads) {
    qjob_t job;
    int64_t tasks, parts;
    if (q4_job(&job, &tasks, &parts, packed, high, scale, offset, act, out, rows, n, groups, scale32, threads))
        return -1;
    int status = parallel(q4_tile, &job, tasks, parts, 0);
    q4_add_partials(&job);
    return status;
}

/* out (rows, n) = x (rows, 32 groups) times the int5 weight (its activations quantized first); `high` NULL: int4. */
int q5_linear(const uint8_t *packed, const uint8_t *high, const void *scale, const void *offset, const float *x,
              float *out, int64_t rows, int64_t n, int64_t groups, int64_t scale32, int64_t threads) {
    void *space = malloc(qact_bytes(rows * groups));
    if (!space) return -1;
    qact_t act = qact_at(space, rows * groups);
    quantize_into(&act, x, rows, groups);
    int status = q4_product(packed, high, scale, offset, &act, out, rows, n, groups, scale32, threads);
    free(space);
    return status;
}


/* out (rows, n) = x (rows, 32 groups) times the int4 weight (its activations quantized first). */
int q4_linear(const uint8_t *packed, const void *scale, const void *offset, const float *x, float *out, int64_t rows,
              int64_t n, int64_t groups, int64_t scale32, int64_t threads) {
    return q5_linear(packed, NULL, scale, offset, x, out, rows, n, groups, scale32, threads);
}
