/* Included by sparse_step.c (one translation unit): the native decode step, a Llama-shaped model's whole decode
 * step of one token per row in one call (sparsedecode/compiled/native.py builds its tables and says which models it
 * serves): no graph, no guards, no operator dispatch between the products, which is what the compiled step spends
 * beside them at a small model's decode step on a CPU.
 *
 * Per layer, for every row (batch rows of equal length, the current token at position n - 1; x its embedding at
 * the first layer):
 *   h = rms_norm(x) * w1;  q, k, v = h Wq (+ b), h Wk (+ b), h Wv (+ b);  RoPE on q and k (cos, sin given per row);
 *   k, v written into the layer's cache at n - 1;  a = attention(q, cache[0, n));  x += a Wo (+ b);
 *   h = rms_norm(x) * w2;  x += (silu(h Wgate) * (h Wup)) Wdown
 * then logits = (rms_norm(x) * w) Whead. A linear layer is float32 (N, K), int4 (int5 with LIN_HIGH: qlinear4.h) or
 * int8 (qlinear.h, the activations quantized as there). rms_norm(x) = x / sqrt(mean(x^2) + eps); RoPE as transformers'
 * rotate_half (dimension i < d/2 pairs with i + d/2). Attention: a layer without a sparse state, or one whose context
 * fits its support (n <= support), attends over every position (anchor and a window of n - 1: attend_support); then a
 * sparse layer's state moves as the schedule's dense step moves it (sparsedecode/step/schedule.py: after_write of one
 * token, decode_step ending the chain, count_step of dense rows). Otherwise it is prepared_step over the layer's row
 * table, which may return NEEDS_STATISTICS before attending: a layer keeping block means only (L_MEANS) completes them
 * here (complete_means) and calls it again; for any other the call stops with that status and the layer in *stopped,
 * the caller completes the statistics and calls again from that layer with `resumed` (q, k and v are kept in the work
 * buffer, the cache written already).
 *
 * Tables are int64 fields (pointers as integers; floats as the bits of a float32): the model's M_FIELDS, each
 * layer's L_FIELDS, each linear layer's LIN_FIELDS. */

enum {
    LIN_KIND, LIN_OUT, LIN_IN, LIN_WEIGHT, LIN_SCALE, LIN_OFFSET, LIN_BIAS, LIN_BLOCK, LIN_SCALE32, LIN_HIGH, LIN_FIELDS
};
enum { LINEAR_F32 = 0, LINEAR_INT4 = 4, LINEAR_INT8 = 8 };
enum { Q_PROJ, K_PROJ, V_PROJ, O_PROJ, GATE_PROJ, UP_PROJ, DOWN_PROJ, LINEARS };
enum {
    L_NORM1, L_EPS1, L_NORM2, L_EPS2, L_KEY, L_KEY_SB, L_KEY_SH, L_KEY_SN, L_VALUE, L_VALUE_SB, L_VALUE_SH,
    L_VALUE_SN, L_SPARSE, L_TABLE, L_WINDOW, L_BLOCK, L_REUSE, L_EVERY, L_SPLIT, L_COUNT, L_STEP, L_LAST, L_TALLY,
    L_SUPPORT, L_MEANS, L_LINEAR, L_FIELDS = L_LINEAR + LINEARS * LIN_FIELDS
};
enum {
    M_LAYERS, M_BATCH, M_HIDDEN, M_HEADS, M_KV, M_D, M_INTER, M_SCALE, M_NORM, M_EPS, M_EMBED, M_VOCAB, M_HEAD,
    M_FIELDS = M_HEAD + LIN_FIELDS
};
enum { BAD_TOKEN = 4 }; /* a status: a token id outside the embedding table (nothing written) */

static inline float bits_to_float(int64_t bits) {
    union { uint32_t u; float f; } v = {(uint32_t)bits};
    return v.f;
}

static inline void *pointer(int64_t field) { return (void *)(intptr_t)field; }

typedef struct {
    const float *w, *x;
    float *out;
    int64_t rows, n, k;
} f32_job;

enum { F32_OUTPUTS = 16 };

/* Outputs task * F32_OUTPUTS .. of every row: dot products of float32 rows, 8 lanes then summed. */
static int f32_outputs(const void *arg, int64_t task) {
    const f32_job *job = arg;
    int64_t n0 = task * F32_OUTPUTS, n1 = n0 + F32_OUTPUTS < job->n ? n0 + F32_OUTPUTS : job->n, k = job->k;
    for (int64_t r = 0; r < job->rows; r++) {
        const float *x = job->x + r * k;
        for (int64_t o = n0; o < n1; o++) {
            const float *w = job->w + o * k;
            v8 total = splat8(0.0f);
            int64_t i = 0;
            for (; i + 8 <= k; i += 8) total += load8(w + i) * load8(x + i);
            float sum = sum8(total);
            for (; i < k; i++) sum += w[i] * x[i];
            job->out[r * job->n + o] = sum;
        }
    }
    return 0;
}

/* Whether the linear layer `f` reads its input quantized (int4 or int8: qlinear.h). */
static inline int reads_quantized(const int64_t *f) { return f[LIN_KIND] == LINEAR_INT4 || f[LIN_KIND] == LINEAR_INT8; }

/* A linear layer's product made into tasks (make_product), run in a parallel region of its own or in one with the
 * other products of the same input (linear_rows: q, k and v; gate and up), then completed (finish_product). */
typedef struct {
    task_fn run;
    union {
        qjob_t q;
        f32_job f;
    } job;
    int64_t tasks, parts;
    const int64_t *lin;
    float *out;
} product_t;

/* out (rows, N) = x (rows, K) times the linear layer `f` (LIN_FIELDS), as tasks in *p; a quantized layer reads
 * `act`, x's activations as quantize_for left them. Returns 0, or -1 when memory ran out. */
static int make_product(product_t *p, const int64_t *f, const float *x, const qact_t *act, float *out, int64_t rows,
                        int64_t threads) {
    int64_t n = f[LIN_OUT], k = f[LIN_IN];
    p->lin = f, p->out = out;
    if (f[LIN_KIND] == LINEAR_INT4) {
        p->run = q4_tile;
        return q4_job(&p->job.q, &p->tasks, &p->parts, pointer(f[LIN_WEIGHT]), pointer(f[LIN_HIGH]),
                      pointer(f[LIN_SCALE]), pointer(f[LIN_OFFSET]), act, out, rows, n, k / 32, f[LIN_SCALE32],
                      threads);
    }
    if (f[LIN_KIND] == LINEAR_INT8) {
        p->run = q8_rows;
        q8_job(&p->job.q, &p->tasks, &p->parts, pointer(f[LIN_WEIGHT]), pointer(f[LIN_SCALE]), act, out, rows, n,
               k / 32, f[LIN_BLOCK], f[LIN_SCALE32], threads);
        return 0;
    }
    p->run = f32_outputs;
    p->job.f = (f32_job){pointer(f[LIN_WEIGHT]), x, out, rows, n, k};
    p->tasks = (n + F32_OUTPUTS - 1) / F32_OUTPUTS;
    p->parts = n * k < (1 << 16) ? 1 : threads;
    return 0;
}

/* The product's int4 partial sums added, then its bias. */
static void finish_product(product_t *p, int64_t rows) {
    int64_t n = p->lin[LIN_OUT];
    if (p->run == q4_tile) q4_add_partials(&p->job.q);
    const float *bias = pointer(p->lin[LIN_BIAS]);
    if (bias)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < n; i++) p->out[r * n + i] += bias[i];
}

typedef struct {
    product_t *products;
    int count;
} products_job;

/* Part `part` of the products in turn: the tasks its product's part would run in a region of its own (contiguous
 * ranges of them, part j of a product's P the j-th; int4's slices, int8's and float32's ranges of outputs). */
static int product_part(const void *arg, int64_t part) {
    const products_job *job = arg;
    int i = 0;
    for (; i < job->count - 1 && part >= job->products[i].parts; i++) part -= job->products[i].parts;
    const product_t *p = &job->products[i];
    part_t range = {p->run, &p->job, p->tasks * part / p->parts, p->tasks * (part + 1) / p->parts, NULL, 0};
    run_part(&range); /* as `parallel` runs a static part */
    return range.status;
}

/* outs[i] (rows, N_i) = x (rows, K) times the `count` (at most 3) linear layers from `lin` (LIN_FIELDS each), biases
 * added; quantized layers read `act`. One parallel region for all of them: each product in the parts it runs in
 * alone (the same sums: the same bits), taken in order by the threads as they finish one, so that a product too
 * small to split (k and v of a GQA model) runs beside another's part instead of leaving the other threads idle. */
static int linear_rows(const int64_t *lin, int count, const float *x, const qact_t *act, float *const *outs,
                       int64_t rows, int64_t threads) {
    product_t products[3];
    int64_t parts = 0, widest = 1;
    for (int i = 0; i < count; i++) {
        if (make_product(&products[i], lin + i * LIN_FIELDS, x, act, outs[i], rows, threads)) {
            while (i-- > 0) free(products[i].run == q4_tile ? products[i].job.q.partial : NULL);
            return -1;
        }
        if (products[i].parts > products[i].tasks) products[i].parts = products[i].tasks;
        parts += products[i].parts;
        widest = products[i].parts > widest ? products[i].parts : widest;
    }
    products_job job = {products, count};
    int status = count == 1 ? parallel(products[0].run, &products[0].job, products[0].tasks, products[0].parts, 0)
                            : parallel(product_part, &job, parts, widest > 1 ? threads : 1, 1);
    for (int i = 0; i < count; i++) finish_product(&products[i], rows);
    return status;
}

/* x (rows, k) quantized once into the activations at `space` for the `count` linear layers from `lin` that read it
 * (when any of them reads it quantized); the activations they read. */
static qact_t quantize_for(const int64_t *lin, int count, const float *x, int64_t rows, int64_t k, void *space) {
    qact_t act = qact_at(space, rows * (k / 32));
    for (int i = 0; i < count; i++)
        if (reads_quantized(lin + i * LIN_FIELDS)) {
            quantize_into(&act, x, rows, k / 32);
            break;
        }
    return act;
}

/* out (rows, size) = x / sqrt(mean(x^2) + eps) * weight, per row, in float32. */
static void rms_norm(const float *x, const float *weight, float eps, float *out, int64_t rows, int64_t size) {
    for (int64_t r = 0; r < rows; r++) {
        const float *v = x + r * size;
        float squares = 0.0f;
        for (int64_t i = 0; i < size; i++) squares += v[i] * v[i];
        float inverse = 1.0f / sqrtf(squares / (float)size + eps);
        for (int64_t i = 0; i < size; i++) out[r * size + i] = weight[i] * (v[i] * inverse);
    }
}

/* RoPE in place on x (rows, heads, d) with each row's cos and sin (rows, d): x * cos + rotate_half(x) * sin. */
static void rope(float *x, const float *cos, const float *sin, int64_t rows, int64_t heads, int64_t d) {
    int64_t half = d / 2;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + (r * heads + h) * d;
            const float *c = cos + r * d, *s = sin + r * d;
            for (int64_t i = 0; i < half; i++) {
                float a = v[i], b = v[i + half];
                v[i] = a * c[i] - b * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
}

/* The block means the prepared call asked for (NEEDS_STATISTICS), for a layer whose only statistic is the mean
 * (L_MEANS): each row selecting afresh gets blocks count .. n_full - 1, block j the mean of its keys at positions
 * 1 + jB .. (j + 1)B summed in order in float32 and divided by B, as selectors/statistics.py's reduce_blocks (a mean
 * over the block's rows) makes them; written where the row table's centroids lie, (kv, d, capacity). A task is a
 * range of MEAN_BLOCKS blocks of one row's KV head (each block's sums are its own: any split gives the same bits). */
enum { MEAN_BLOCKS = 64 };

typedef struct {
    const int64_t *m, *f;
    int64_t n_full, ranges; /* ranges of MEAN_BLOCKS blocks per (row, KV head), from the lowest count missing */
    int64_t from;
} means_job;

/* Whether row r selects afresh at this step and lacks block means. */
static inline int lacks_means(const int64_t *f, int64_t r, int64_t n_full) {
    const int64_t *count = pointer(f[L_COUNT]), *step = pointer(f[L_STEP]);
    return (f[L_EVERY] || step[r] % f[L_REUSE] == 0) && count[r] < n_full;
}

static int mean_blocks(const void *arg, int64_t task) {
    const means_job *job = arg;
    const int64_t *f = job->f;
    int64_t kv = job->m[M_KV], d = job->m[M_D], block = f[L_BLOCK], range = task % job->ranges;
    int64_t r = task / job->ranges / kv, h = task / job->ranges % kv, count = ((const int64_t *)pointer(f[L_COUNT]))[r];
    int64_t j0 = job->from + range * MEAN_BLOCKS, j1 = j0 + MEAN_BLOCKS < job->n_full ? j0 + MEAN_BLOCKS : job->n_full;
    if (!lacks_means(f, r, job->n_full)) return 0;
    const row_t *table = pointer(f[L_TABLE]);
    const float *keys = pointer(f[L_KEY]);
    float *centroids = pointer(table[r].centroids);
    int64_t sn = f[L_KEY_SN], sd = table[r].c_stride_d;
    for (int64_t j = j0 > count ? j0 : count; j < j1; j++) {
        const float *key = keys + table[r].k + h * f[L_KEY_SH] + (1 + j * block) * sn;
        float *out = centroids + h * table[r].c_stride_h + j;
        int64_t i = 0;
        while (i + 8 <= d) { /* up to 64 dimensions at a time, each summed in position order, keys row by row */
            int vectors = (int)((d - i) / 8 < 8 ? (d - i) / 8 : 8);
            v8 sums[8] = {0};
            for (int64_t p = 0; p < block; p++)
                for (int c = 0; c < vectors; c++) sums[c] += load8(key + p * sn + i + 8 * c);
            for (int c = 0; c < vectors; c++) {
                v8 mean = sums[c] / splat8((float)block);
                for (int lane = 0; lane < 8; lane++) out[(i + 8 * c + lane) * sd] = mean[lane];
            }
            i += 8 * vectors;
        }
        for (; i < d; i++) {
            float sum = 0.0f;
            for (int64_t p = 0; p < block; p++) sum += key[p * sn + i];
            out[i * sd] = sum / (float)block;
        }
    }
    return 0;
}

/* Every row's missing block means (above), over up to `threads` threads. */
static void complete_means(const int64_t *m, const int64_t *f, int64_t n, int64_t threads) {
    int64_t rows = m[M_BATCH], kv = m[M_KV], block = f[L_BLOCK], *count = pointer(f[L_COUNT]);
    int64_t distant_end = n - f[L_WINDOW] > 1 ? n - f[L_WINDOW] : 1, n_full = (distant_end - 1) / block;
    int64_t from = n_full;
    for (int64_t r = 0; r < rows; r++)
        if (lacks_means(f, r, n_full) && count[r] < from) from = count[r];
    if (from == n_full) return;
    means_job job = {m, f, n_full, (n_full - from + MEAN_BLOCKS - 1) / MEAN_BLOCKS, from};
    int64_t tasks = rows * kv * job.ranges, parts = threads < tasks ? threads : tasks;
    if ((n_full - from) * rows * kv < MEAN_BLOCKS) parts = 1; /* a block or two (a step's new one): no second thread */
    parallel(mean_blocks, &job, tasks, parts, 1);
    for (int64_t r = 0; r < rows; r++)
        if (lacks_means(f, r, n_full)) count[r] = n_full;
}

/* The layer's attention of every row at context length n into att (rows, H, d): see the header. */
static int layer_attention(const int64_t *m, const int64_t *f, const float *q, float *att, int64_t n, int64_t resumed,
                           int64_t threads) {
    int64_t rows = m[M_BATCH], kv = m[M_KV], d = m[M_D], group = m[M_HEADS] / kv;
    float scale = bits_to_float(m[M_SCALE]);
    const float *keys = pointer(f[L_KEY]), *values = pointer(f[L_VALUE]);
    if (f[L_SPARSE] && n > f[L_SUPPORT]) {
        for (int again = 0;; again++) {
            int status = prepared_step(q, keys, f[L_KEY_SH], f[L_KEY_SN], values, f[L_VALUE_SH], f[L_VALUE_SN], att,
                                       pointer(f[L_TABLE]), rows, kv, group, d, f[L_WINDOW], f[L_BLOCK], scale,
                                       threads, DTYPE_F32, n, f[L_REUSE], f[L_EVERY], f[L_SPLIT], pointer(f[L_COUNT]),
                                       pointer(f[L_STEP]), pointer(f[L_LAST]), pointer(f[L_TALLY]), resumed || again);
            if (status != NEEDS_STATISTICS || !f[L_MEANS] || again) return status;
            complete_means(m, f, n, threads); /* then the call again, its bookkeeping done */
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        int status = attend_support(q + r * kv * group * d, keys + r * f[L_KEY_SB], f[L_KEY_SH], f[L_KEY_SN],
                                    values + r * f[L_VALUE_SB], f[L_VALUE_SH], f[L_VALUE_SN], NULL, 0, kv, group, d, n,
                                    1, 1, scale, threads, att + r * kv * group * d, DTYPE_F32);
        if (status) return status;
    }
    if (f[L_SPARSE]) { /* the schedule's dense step: after_write of one token, then a chain ended, dense rows */
        int64_t kept = n >= 2 ? (n - 2) / f[L_BLOCK] : 0, *count = pointer(f[L_COUNT]), *tally = pointer(f[L_TALLY]);
        int64_t *step = pointer(f[L_STEP]), *last = pointer(f[L_LAST]);
        for (int64_t r = 0; r < rows; r++) {
            if (count[r] > kept) count[r] = kept;
            step[r] = 0;
            last[r] = n;
        }
        tally[1] += rows;
    }
    return 0;
}

/* k, v (rows, kv, d) written into the layer's cache at position p. */
static void write_cache(const int64_t *m, const int64_t *f, const float *k, const float *v, int64_t p) {
    int64_t rows = m[M_BATCH], kv = m[M_KV], d = m[M_D];
    float *keys = pointer(f[L_KEY]), *values = pointer(f[L_VALUE]);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < kv; h++) {
            memcpy(keys + r * f[L_KEY_SB] + h * f[L_KEY_SH] + p * f[L_KEY_SN], k + (r * kv + h) * d, sizeof(float) * d);
            memcpy(values + r * f[L_VALUE_SB] + h * f[L_VALUE_SH] + p * f[L_VALUE_SN], v + (r * kv + h) * d,
                   sizeof(float) * d);
        }
}

/* The widest input of a product (the hidden size, the MLP's, or the attention's H d). */
static inline int64_t widest_input(const int64_t *m) {
    int64_t hidden = m[M_HIDDEN], inter = m[M_INTER], qd = m[M_HEADS] * m[M_D];
    int64_t wide = hidden > inter ? hidden : inter;
    return wide > qd ? wide : qd;
}

/* The work buffer's parts (floats): x (rows, hidden), the residual stream, kept between calls; h (rows, max(hidden,
 * inter)); q and att (rows, H d); k and v (rows, kv d); gate and up (rows, inter); o (rows, hidden); then the
 * quantized activations of the widest input (qact_t: 10 floats a group of 32). */
int64_t model_work_floats(const int64_t *m) {
    int64_t rows = m[M_BATCH], hidden = m[M_HIDDEN], inter = m[M_INTER], qd = m[M_HEADS] * m[M_D];
    int64_t wide = hidden > inter ? hidden : inter, groups = (widest_input(m) + 31) / 32;
    return rows * (2 * hidden + wide + 2 * qd + 2 * m[M_KV] * m[M_D] + 2 * inter) + 10 * rows * groups;
}

/* One decode step of tokens (rows) at context length n (the current token at n - 1) from layer `first` on: x (the
 * work buffer's first part) takes the tokens' rows of the embedding table (M_EMBED, M_VOCAB rows of hidden
 * float32), or holds the residual stream at `first` when resumed; logits (rows, vocab). Returns 0, NEEDS_STATISTICS
 * with the layer in *stopped, BAD_TOKEN, or another kernel status. */
int model_step(const int64_t *m, const int64_t *layers, const int64_t *tokens, float *work, const float *cos,
               const float *sin, int64_t n, int64_t first, int64_t resumed, int64_t threads, float *logits,
               int64_t *stopped) {
    int64_t rows = m[M_BATCH], hidden = m[M_HIDDEN], inter = m[M_INTER], kv = m[M_KV], d = m[M_D];
    int64_t qd = m[M_HEADS] * d, wide = hidden > inter ? hidden : inter;
    float *x = work, *h = x + rows * hidden, *q = h + rows * wide, *att = q + rows * qd, *k = att + rows * qd;
    float *v = k + rows * kv * d, *gate = v + rows * kv * d, *up = gate + rows * inter, *o = up + rows * inter;
    void *space = o + rows * hidden; /* the quantized activations */
    qact_t act;
    if (!resumed) {
        for (int64_t r = 0; r < rows; r++)
            if (tokens[r] < 0 || tokens[r] >= m[M_VOCAB]) return BAD_TOKEN;
        const float *table = pointer(m[M_EMBED]);
        for (int64_t r = 0; r < rows; r++) memcpy(x + r * hidden, table + tokens[r] * hidden, sizeof(float) * hidden);
    }
    for (int64_t l = first; l < m[M_LAYERS]; l++) {
        const int64_t *f = layers + l * L_FIELDS, *lin = f + L_LINEAR;
        int status = 0, again = resumed && l == first;
        if (!again) {
            rms_norm(x, pointer(f[L_NORM1]), bits_to_float(f[L_EPS1]), h, rows, hidden);
            act = quantize_for(lin + Q_PROJ * LIN_FIELDS, 3, h, rows, hidden, space); /* q, k, v read one h */
            float *const qkv[] = {q, k, v};
            status = linear_rows(lin + Q_PROJ * LIN_FIELDS, 3, h, &act, qkv, rows, threads);
            if (status) return status;
            rope(q, cos, sin, rows, m[M_HEADS], d);
            rope(k, cos, sin, rows, kv, d);
            write_cache(m, f, k, v, n - 1);
        }
        status = layer_attention(m, f, q, att, n, again, threads);
        if (status == NEEDS_STATISTICS) *stopped = l;
        if (status) return status;
        act = quantize_for(lin + O_PROJ * LIN_FIELDS, 1, att, rows, qd, space);
        status = linear_rows(lin + O_PROJ * LIN_FIELDS, 1, att, &act, &o, rows, threads);
        if (status) return status;
        for (int64_t i = 0; i < rows * hidden; i++) x[i] += o[i];
        rms_norm(x, pointer(f[L_NORM2]), bits_to_float(f[L_EPS2]), h, rows, hidden);
        act = quantize_for(lin + GATE_PROJ * LIN_FIELDS, 2, h, rows, hidden, space); /* gate and up read one h */
        float *const gate_up[] = {gate, up};
        status = linear_rows(lin + GATE_PROJ * LIN_FIELDS, 2, h, &act, gate_up, rows, threads);
        if (status) return status;
        silu_times(gate, up, rows * inter);
        act = quantize_for(lin + DOWN_PROJ * LIN_FIELDS, 1, gate, rows, inter, space);
        status = linear_rows(lin + DOWN_PROJ * LIN_FIELDS, 1, gate, &act, &o, rows, threads);
        if (status) return status;
        for (int64_t i = 0; i < rows * hidden; i++) x[i] += o[i];
    }
    rms_norm(x, pointer(m[M_NORM]), bits_to_float(m[M_EPS]), h, rows, hidden);
    act = quantize_for(m + M_HEAD, 1, h, rows, hidden, space);
    return linear_rows(m + M_HEAD, 1, h, &act, &logits, rows, threads);
}

/* The table sizes this build uses (M_FIELDS, L_FIELDS, LIN_FIELDS): the caller checks its own against them. */
int model_layout(int64_t *sizes) {
    sizes[0] = M_FIELDS, sizes[1] = L_FIELDS, sizes[2] = LIN_FIELDS;
    return 0;
}
