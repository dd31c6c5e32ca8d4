/* Included by sparse_step.c (one translation unit): vectors of 8 floats, and attention over the support. */

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

/* silu(x) = x / (1 + e^-x) on 8 floats: e^-x by exp8_nonpositive, which also serves arguments up to 87 (x down to
 * -87); below -87 (and for NaN) the result is x * 0 instead (silu is under 1e-35 there; NaN and -inf give NaN, as
 * the formula does), whatever e^-x came to there. */
static inline v8 silu8(v8 x) {
    v8i kept = x >= splat8(-87.0f);
    v8 e = exp8_nonpositive(-x);
    return (v8)(((v8i)(x / (1.0f + e)) & kept) | ((v8i)(x * 0.0f) & ~kept));
}

/* gate[i] = silu(gate[i]) * up[i] for n elements, 8 at a time (the tail through zero-padded vectors). */
static void silu_times(float *gate, const float *up, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) store8(gate + i, silu8(load8(gate + i)) * load8(up + i));
    if (i == n) return;
    v8 g = splat8(0.0f), u = splat8(0.0f);
    memcpy(&g, gate + i, sizeof(float) * (size_t)(n - i));
    memcpy(&u, up + i, sizeof(float) * (size_t)(n - i));
    g = silu8(g) * u;
    memcpy(gate + i, &g, sizeof(float) * (size_t)(n - i));
}

/* silu_times for the tests; returns 0. */
int silu_times_f32(float *gate, const float *up, int64_t n) {
    silu_times(gate, up, n);
    return 0;
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
