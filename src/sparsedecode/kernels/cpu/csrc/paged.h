/* Included by sparse_step.c (one translation unit): attention over supports read through vLLM's CPU pages
 * (sparsedecode.integrations.vllm: the page-list form of the step, as FlashInfer's page-table decode reads pages).
 *
 * The cache is vLLM's CPU layout for its vec instruction sets, of `dtype`: (pages, kv, P, 2 d), per page and KV head
 * the keys transposed (d, P), then the values (P, d). Position p of row r lies in page tables[r][p / P] at offset
 * p % P. A row's support is a list of positions per support row (index (R, rows, S), valid (R, rows, S) or NULL);
 * support row i reads KV head i / rep and the query heads i * qpr .. (i + 1) * qpr - 1 (rep = 1, qpr = G: one support
 * per KV head shared by its group; rep = G, qpr = 1: one per query head). Nothing but the support is read: its keys are
 * copied, run by run of consecutive positions of one page (each channel's run is contiguous), into a float32 buffer;
 * then logits, softmax and the weighted sum of the value rows, read in place, all in float32. Out (R, H, d) float32.
 */

typedef struct {
    const void *q;
    const char *cache;
    const int32_t *tables;
    const int64_t *index;
    const uint8_t *valid;
    int64_t table_width, rows, rep, qpr, kv, d, page, support;
    float scale;
    float *out;
    int dtype;
    const int64_t *blocks, *lengths; /* instead of index: chosen blocks (R, rows, b), the rows' lengths (R) */
    int64_t b, window, block;
} paged_job;

/* A support row's positions from its chosen blocks: the anchor, each block's distant positions, the window
 * (sparsedecode.layout.support_positions, blocks outside the distant region skipped). Returns the count. */
static int64_t block_positions(const paged_job *job, int64_t r, int64_t i, int64_t *positions) {
    int64_t n = job->lengths[r], distant_end = n - job->window > 1 ? n - job->window : 1, B = job->block;
    int64_t n_blocks = (distant_end - 1 + B - 1) / B, count = 0;
    const int64_t *chosen = job->blocks + (r * job->rows + i) * job->b;
    positions[count++] = 0;
    for (int64_t c = 0; c < job->b; c++) {
        if (chosen[c] < 0 || chosen[c] >= n_blocks) continue;
        int64_t start = 1 + chosen[c] * B, stop = start + B < distant_end ? start + B : distant_end;
        for (int64_t p = start; p < stop; p++) positions[count++] = p;
    }
    for (int64_t p = distant_end; p < n; p++) positions[count++] = p;
    return count;
}

static inline __attribute__((always_inline)) int paged_row_as(const paged_job *job, int64_t task, int t) {
    int64_t r = task / job->rows, i = task % job->rows, h = i / job->rep, qpr = job->qpr, d = job->d, P = job->page;
    int64_t S = job->support, esize = element_size(t);
    int64_t *own = NULL; /* positions made from chosen blocks */
    if (job->blocks) {
        own = malloc(sizeof(int64_t) * (size_t)S);
        if (!own) return -1;
        S = block_positions(job, r, i, own);
    }
    const int64_t *index = own ? own : job->index + (r * job->rows + i) * S;
    const uint8_t *valid = own || !job->valid ? NULL : job->valid + (r * job->rows + i) * S;
    const int32_t *table = job->tables + r * job->table_width;
    int64_t head_bytes = P * 2 * d * esize, page_bytes = job->kv * head_bytes;
    float *keys = malloc(sizeof(float) * (size_t)(S * d + S * qpr + qpr * d));
    const char **vrows = malloc(sizeof(char *) * (size_t)S);
    if (!keys || !vrows) {
        free(keys), free(vrows), free(own);
        return -1;
    }
    float *w = keys + S * d, *qh = w + S * qpr;
    int64_t count = 0;
    for (int64_t s = 0; s < S;) { /* a run: consecutive valid positions inside one page */
        if (valid && !valid[s]) {
            s++;
            continue;
        }
        int64_t p = index[s], off = p % P, len = 1;
        while (s + len < S && (!valid || valid[s + len]) && index[s + len] == p + len && off + len < P) len++;
        const char *head = job->cache + (int64_t)table[p / P] * page_bytes + h * head_bytes;
        for (int64_t c = 0; c < d; c++) {
            const char *row = head + (c * P + off) * esize;
            for (int64_t e = 0; e < len; e++) keys[(count + e) * d + c] = load1(row, e, t);
        }
        for (int64_t e = 0; e < len; e++) vrows[count + e] = head + (P * d + (off + e) * d) * esize;
        count += len, s += len;
    }
    const void *q = element(job->q, (r * job->rows * qpr + i * qpr) * d, t);
    for (int64_t x = 0; x < qpr * d; x++) qh[x] = load1(q, x, t);
    int64_t vector_d = d / 8 * 8;
    for (int64_t g = 0; g < qpr; g++) { /* logits and softmax per query head */
        const float *qg = qh + g * d;
        float *wg = w + g * count, top = -INFINITY, total = 0.0f;
        for (int64_t s = 0; s < count; s++) {
            const float *k = keys + s * d;
            v8 acc = {0};
            for (int64_t c = 0; c < vector_d; c += 8) acc += load8(qg + c) * load8(k + c);
            float logit = sum8(acc);
            for (int64_t c = vector_d; c < d; c++) logit += qg[c] * k[c];
            wg[s] = logit * job->scale;
            top = wg[s] > top ? wg[s] : top;
        }
        for (int64_t s = 0; s < count; s++) total += (wg[s] = exp_nonpositive(wg[s] - top));
        float inverse = 1.0f / total, *o = job->out + (r * job->rows * qpr + i * qpr + g) * d;
        for (int64_t c = 0; c < d; c++) o[c] = 0.0f;
        for (int64_t s = 0; s < count; s++) { /* the value rows, read in place */
            float ws = wg[s] * inverse;
            int64_t c = 0;
            for (; c < vector_d; c += 8) store8(o + c, load8(o + c) + ws * load8_at(vrows[s], c, t));
            for (; c < d; c++) o[c] += ws * load1(vrows[s], c, t);
        }
    }
    free(keys), free(vrows), free(own);
    return 0;
}

static int paged_row(const void *arg, int64_t task) {
    const paged_job *job = arg;
    if (job->dtype == DTYPE_BF16) return paged_row_as(job, task, DTYPE_BF16);
    if (job->dtype == DTYPE_F16) return paged_row_as(job, task, DTYPE_F16);
    return paged_row_as(job, task, DTYPE_F32);
}

/* out (R, H, d) float32: every row's attention over its support in the pages (see above). 0, or -1 out of memory. */
int attend_paged(const void *q, const void *cache, const int32_t *tables, int64_t table_width, const int64_t *index,
                 const uint8_t *valid, int64_t n_rows, int64_t rows, int64_t rep, int64_t qpr, int64_t kv, int64_t d,
                 int64_t page, int64_t support, float scale, int64_t threads, float *out, int64_t dtype) {
    paged_job job = {q, cache, tables, index, valid, table_width, rows, rep, qpr, kv, d, page, support, scale, out,
                     (int)dtype, NULL, NULL, 0, 0, 0};
    int64_t tasks = n_rows * rows;
    return parallel(paged_row, &job, tasks, threads < tasks ? threads : tasks, 1);
}

/* attend_paged with each support row's positions made from its chosen blocks (R, rows, b), -1 for none, and the
 * rows' lengths: the support is then at most 1 + b * block + window positions. */
int attend_paged_blocks(const void *q, const void *cache, const int32_t *tables, int64_t table_width,
                        const int64_t *blocks, const int64_t *lengths, int64_t n_rows, int64_t rows, int64_t rep,
                        int64_t qpr, int64_t kv, int64_t d, int64_t page, int64_t b, int64_t window, int64_t block,
                        float scale, int64_t threads, float *out, int64_t dtype) {
    paged_job job = {q, cache, tables, NULL, NULL, table_width, rows, rep, qpr, kv, d, page, 1 + b * block + window,
                     scale, out, (int)dtype, blocks, lengths, b, window, block};
    int64_t tasks = n_rows * rows;
    return parallel(paged_row, &job, tasks, threads < tasks ? threads : tasks, 1);
}

/* ---------------------------------------------------------------------------------------------------------------
 * Mean-dot selection through the pages: per row and KV head, each distant block's mean key from its page's piece sum
 * (pieces (pages, kv, P / B, d) float32, sparsedecode.integrations.vllm.pages) plus the next chunk's first key (firsts,
 * the same shape), both found through the row's table; the short last block's mean from its keys; score <group-mean query, mean> / sqrt(d);
 * the b best kept as they come (higher first, ties to the lower block), written ascending into blocks (R, kv, b).
 * 0, NONFINITE for a score that is not finite, -1 out of memory.
 */
typedef struct {
    const void *q;
    const char *cache;
    const float *pieces, *firsts;
    const int32_t *tables;
    const int64_t *lengths;
    int64_t table_width, kv, group, d, page, block, window, b;
    int64_t *blocks;
    int dtype;
} paged_select_job;

static inline __attribute__((always_inline)) int paged_select_as(const paged_select_job *job, int64_t task, int t) {
    int64_t r = task / job->kv, h = task % job->kv, d = job->d, P = job->page, B = job->block, b = job->b;
    int64_t esize = element_size(t), head_bytes = P * 2 * d * esize, page_bytes = job->kv * head_bytes;
    int64_t n = job->lengths[r], distant_end = n - job->window > 1 ? n - job->window : 1;
    int64_t n_full = (distant_end - 1) / B, n_blocks = (distant_end - 1 + B - 1) / B, chunks = P / B;
    const int32_t *table = job->tables + r * job->table_width;
    float *buffer = malloc(sizeof(float) * (size_t)(2 * d + b + 1));
    int64_t *ids = malloc(sizeof(int64_t) * (size_t)(b + 1)), kept = 0;
    if (!buffer || !ids) {
        free(buffer), free(ids);
        return -1;
    }
    float *qm = buffer, *mean = qm + d, *best = mean + d; /* the group-mean query, a block's mean, the best scores */
    mean_query(element(job->q, r * job->kv * job->group * d, t), h, job->group, d, t, qm);
    float inv_sqrt_d = 1.0f / sqrtf((float)d);
    int status = 0;
    for (int64_t j = 0; j < n_blocks && b > 0; j++) {
        if (j < n_full) { /* piece of chunk j + first key of chunk j + 1 */
            int64_t start = j * B, next = start + B;
            const float *piece = job->pieces + (((int64_t)table[start / P] * job->kv + h) * chunks + (start % P) / B) * d;
            const float *last = job->firsts + (((int64_t)table[next / P] * job->kv + h) * chunks + (next % P) / B) * d;
            for (int64_t c = 0; c < d; c++) mean[c] = (piece[c] + last[c]) / (float)B;
        } else { /* the short last block, from its keys */
            int64_t first = 1 + n_full * B, count = distant_end - first;
            for (int64_t c = 0; c < d; c++) mean[c] = 0.0f;
            for (int64_t p = first; p < distant_end; p++) {
                const char *head = job->cache + (int64_t)table[p / P] * page_bytes + h * head_bytes;
                for (int64_t c = 0; c < d; c++) mean[c] += load1(head, c * P + p % P, t);
            }
            for (int64_t c = 0; c < d; c++) mean[c] /= (float)count;
        }
        float score = 0.0f;
        for (int64_t c = 0; c < d; c++) score += qm[c] * mean[c];
        score *= inv_sqrt_d;
        if (nonfinite(score)) {
            status = NONFINITE;
            break;
        }
        offer(score, j, best, ids, &kept, b); /* the tie rule: the earlier block wins */
    }
    int64_t *out = job->blocks + (r * job->kv + h) * b;
    qsort(ids, (size_t)kept, sizeof(int64_t), compare_ascending);
    memcpy(out, ids, sizeof(int64_t) * (size_t)kept);
    for (int64_t i = kept; i < b; i++) out[i] = -1; /* fewer blocks than b: none to read */
    free(buffer), free(ids);
    return status;
}

static int paged_select(const void *arg, int64_t task) {
    const paged_select_job *job = arg;
    if (job->dtype == DTYPE_BF16) return paged_select_as(job, task, DTYPE_BF16);
    if (job->dtype == DTYPE_F16) return paged_select_as(job, task, DTYPE_F16);
    return paged_select_as(job, task, DTYPE_F32);
}

int select_paged(const void *q, const void *cache, const float *pieces, const float *firsts, const int32_t *tables,
                 int64_t table_width,
                 const int64_t *lengths, int64_t n_rows, int64_t kv, int64_t group, int64_t d, int64_t page,
                 int64_t block, int64_t window, int64_t b, int64_t threads, int64_t *blocks, int64_t dtype) {
    paged_select_job job = {q, cache, pieces, firsts, tables, lengths, table_width, kv, group, d, page, block, window, b,
                            blocks, (int)dtype};
    int64_t tasks = n_rows * kv;
    return parallel(paged_select, &job, tasks, threads < tasks ? threads : tasks, 1);
}
