/* The sparse decode step on the CPU in one call per layer: mean-pooled block selection over the cached centroids,
 * and attention over anchor + chosen blocks + window read in place from the KV cache.
 *
 * Built at first use by sparsedecode/kernels/cpu/__init__.py (cc -O3 -march=native -fopenmp-simd -pthread), called
 * through ctypes. One translation unit in parts: numeric.h (e^x, element types), threads.h (work splitting),
 * select.h (selection), attend.h (attention), paged.h (selection and attention through vLLM's pages), qlinear.h
 * (quantized linear layers), here the calls of a step, and model.h (a whole model's decode step) after them.
 * It replaces ~20 small torch operations whose fixed per-call cost dominated below ~32K positions. Semantics are
 * those of sparsedecode.selectors (top_blocks: the b best, ties to the lowest block, ascending) and of
 * sparsedecode.session.attend_support (softmax over the support, all query heads of a GQA group sharing it).
 * Queries, keys and values are float32, bfloat16 or float16, one dtype for the three (every entry point's last
 * argument, DTYPE_*), converted to float32 as they are loaded; everything is computed and accumulated in float32, as
 * the torch path does after its upcast. Centroids and outputs are float32.
 * Layouts: q (H, d) contiguous; keys/values rows of d contiguous elements at head * stride_h + position * stride_n
 * (strides in elements); centroids stored (kv, d, capacity): element (h, i, j) at h * c_stride_h + i * c_stride_d + j.
 * The caller checks the rest (sparsedecode/kernels/cpu/__init__.py: the dtype, one d for q, keys and values, caches of at
 * least n rows, chosen (kv, b), b <= n_blocks for selection); a chosen block outside the distant region is skipped.
 *
 * Speed where it counts, a decode step: every layer's centroids and support come from memory, not from the
 * last-level cache (the other layers and the weights evicted them). So selection streams the centroid rows once,
 * scoring a tile of blocks at a time in a buffer that stays in L1 and keeping the b best of each tile as it goes (no
 * score array of N / B floats, no second pass), with software prefetches one row segment ahead where the hardware
 * prefetcher stops (page and row ends); attention prefetches the support's scattered key and value rows ahead of
 * use. Large calls split over persistent worker threads (KV heads, and ranges of blocks within a head for
 * selection), which wait briefly by spinning, so the attention call that follows a selection finds them awake.
 *
 * A batch (sparse_step_batch, at the end) is served in one call per layer: each sequence with its own length,
 * centroids and blocks, selecting where it selects afresh and attending in the same task, the threads taking
 * (sequence, KV head) tasks. It scores and attends with the very functions the single-sequence calls use.
 */

#include "numeric.h"
#include "threads.h"
#include "select.h"
#include "attend.h"
#include "paged.h"
#include "qlinear.h"
#include "qlinear4.h"


/* ---------------------------------------------------------------------------------------------------------------
 * The sparse step of a whole batch in one call. Each sequence (a "row") has its own length, hence its own layout,
 * its own centroid cache and its own blocks; one task is one (row, KV head): select that head's blocks if the row
 * selects afresh at this step (exactly as select_mean_pooled does), then attend over its support (attend_head).
 * Tasks are taken longest first by whichever thread is free, so rows of different lengths share the threads well.
 *
 * A row is described by ROW_FIELDS int64 values (pointers as integers), in this order:
 *   q, k, v, out    element offsets from the query, key, value and output bases (elements of the call's dtype;
 *                   of float32 for the output): the row's query (H, d)
 *                   contiguous, its keys and values at its own position 0 (head h, position p at
 *                   + h * stride_h + p * stride_n), its output (H, d) contiguous;
 *   n               the row's positions (the current token included): distant_end = max(n - window, 1);
 *   centroids       its centroid storage (kv, d, capacity), element (h, i, j) at h * c_stride_h + i * c_stride_d
 *   c_stride_h, c_stride_d   + j; read only when the row selects afresh (blocks [0, n_full));
 *   chosen, b       its blocks (kv, b) int64: written when the row selects afresh (the b best per head,
 *                   ascending, b <= n_blocks), read otherwise (an index outside [0, n_blocks) is skipped);
 *   fresh           1: select then attend; 0: attend over `chosen` as it is.
 */
enum { ROW_FIELDS = 11 };

typedef struct {
    int64_t q, k, v, out, n, centroids, c_stride_h, c_stride_d, chosen, b, fresh;
} row_t;

typedef struct {
    const void *q, *keys, *values; /* of `dtype` */
    float *out;
    const row_t *rows;
    const int64_t *order; /* rows, most work first */
    int64_t k_stride_h, k_stride_n, v_stride_h, v_stride_n, kv_heads, group, d, window, block;
    float scale;
    int dtype;
} batch_job;

/* chosen (b) of head h of one row: the b best blocks against the head's mean query, ascending. */
static int select_head(const batch_job *job, const row_t *row, int64_t h, const void *q, const void *keys,
                       int64_t distant_end) {
    int64_t d = job->d, b = row->b, block = job->block, count = 0;
    int64_t n_full = (distant_end - 1) / block, n_blocks = (distant_end - 1 + block - 1) / block;
    float stack_mean[256], stack_scores[64];
    int64_t stack_blocks[64];
    float *q_mean = d <= 256 ? stack_mean : malloc(sizeof(float) * (size_t)d);
    float *scores = b <= 64 ? stack_scores : malloc(sizeof(float) * (size_t)b);
    int64_t *blocks = b <= 64 ? stack_blocks : malloc(sizeof(int64_t) * (size_t)b);
    int status = -1;
    if (q_mean && scores && blocks) {
        mean_query(q, h, job->group, d, job->dtype, q_mean);
        const float *c = (const float *)(intptr_t)row->centroids + h * row->c_stride_h;
        status = score_blocks(q_mean, c, row->c_stride_d, 0, n_full, d, b, scores, blocks, &count);
        if (!status && n_blocks > n_full) { /* the short tail block is not cached: average its keys now */
            float dot = tail_score(q_mean, element(keys, h * job->k_stride_h, job->dtype), job->k_stride_n,
                                   1 + n_full * block, distant_end, d, job->dtype);
            if (nonfinite(dot)) status = NONFINITE;
            offer(dot, n_full, scores, blocks, &count, b);
        }
        if (!status) {
            qsort(blocks, (size_t)count, sizeof(int64_t), compare_ascending);
            memcpy((int64_t *)(intptr_t)row->chosen + h * b, blocks, sizeof(int64_t) * (size_t)count);
        }
    }
    if (q_mean != stack_mean) free(q_mean);
    if (scores != stack_scores) free(scores);
    if (blocks != stack_blocks) free(blocks);
    return status;
}

static int batch_task(const void *arg, int64_t task) {
    const batch_job *job = arg;
    const row_t *row = job->rows + job->order[task / job->kv_heads];
    int64_t h = task % job->kv_heads, n = row->n;
    int64_t distant_end = n - job->window > 1 ? n - job->window : 1;
    int t = job->dtype;
    const void *q = element(job->q, row->q, t), *keys = element(job->keys, row->k, t);
    const void *values = element(job->values, row->v, t);
    if (row->fresh && row->b > 0) {
        int status = select_head(job, row, h, q, keys, distant_end);
        if (status) return status;
    }
    attend_job attend = {q,
                         keys,
                         values,
                         (const int64_t *)(intptr_t)row->chosen,
                         job->k_stride_h,
                         job->k_stride_n,
                         job->v_stride_h,
                         job->v_stride_n,
                         row->b,
                         job->group,
                         job->d,
                         n,
                         distant_end,
                         job->block,
                         job->scale,
                         job->out + row->out,
                         t};
    return attend_head(&attend, h);
}

/* The sparse step of `n_rows` rows (`rows`: n_rows * ROW_FIELDS int64, see above), queries, keys and values of
 * `dtype`, out float32. Returns 0; NONFINITE when a row selecting afresh met a NaN or infinite score (outputs then
 * undefined); -1 when memory ran out.
 * One row selecting afresh with fewer KV heads than threads (a sequence alone, a head's selection then split into
 * ranges of blocks) runs the selection and the attention calls in turn: the same blocks and output to the bit, as
 * both score with score_blocks and tail_score and attend with attend_head. */
int sparse_step_batch(const void *q, const void *keys, int64_t k_stride_h, int64_t k_stride_n, const void *values,
                      int64_t v_stride_h, int64_t v_stride_n, float *out, const int64_t *rows, int64_t n_rows,
                      int64_t kv_heads, int64_t group, int64_t d, int64_t window, int64_t block, float scale,
                      int64_t threads, int64_t dtype) {
    enum { MIN_SELECT_PER_THREAD = 1 << 16, MIN_ATTEND_PER_THREAD = 1 << 18 }; /* as the single-row calls */
    const row_t *row = (const row_t *)rows;
    if (n_rows == 1 && row->fresh && row->b > 0 && kv_heads < threads) {
        int64_t n = row->n, distant_end = n - window > 1 ? n - window : 1;
        const void *q0 = element(q, row->q, (int)dtype), *k0 = element(keys, row->k, (int)dtype);
        const void *v0 = element(values, row->v, (int)dtype);
        int64_t *chosen = (int64_t *)(intptr_t)row->chosen;
        int status = select_mean_pooled(q0, (const float *)(intptr_t)row->centroids, row->c_stride_h, row->c_stride_d,
                                        (distant_end - 1) / block, k0, k_stride_h, k_stride_n, kv_heads, group, d,
                                        distant_end, block, row->b, threads, chosen, dtype);
        if (status) return status;
        return attend_support(q0, k0, k_stride_h, k_stride_n, v0, v_stride_h, v_stride_n, chosen, row->b, kv_heads,
                              group, d, n, distant_end, block, scale, threads, out + row->out, dtype);
    }
    int64_t *order = scratch(sizeof(int64_t) * (size_t)(2 * n_rows + 1));
    if (!order) return -1;
    int64_t *cost = order + n_rows;
    double parts = 0.0;
    for (int64_t r = 0; r < n_rows; r++) { /* multiply-adds per KV head; rows sorted by it, most first */
        int64_t distant_end = row[r].n - window > 1 ? row[r].n - window : 1;
        int64_t select = row[r].fresh ? (distant_end - 1) / block * d : 0;
        int64_t attend = 2 * (1 + row[r].b * block + (row[r].n - distant_end)) * group * d;
        cost[r] = select + attend;
        parts += kv_heads * ((double)select / MIN_SELECT_PER_THREAD + (double)attend / MIN_ATTEND_PER_THREAD);
        int64_t at = r;
        for (; at > 0 && cost[order[at - 1]] < cost[r]; at--) order[at] = order[at - 1];
        order[at] = r;
    }
    batch_job job = {q,          keys,       values,   out,   row, order,  k_stride_h, k_stride_n,
                     v_stride_h, v_stride_n, kv_heads, group, d,   window, block,      scale,      (int)dtype};
    return parallel(batch_task, &job, n_rows * kv_heads, threads < parts ? threads : (int64_t)parts, 1);
}

/* The whole sparse step of one sequence in one call: when `fresh`, select into chosen (kv, b) what
 * select_mean_pooled selects, then attend over anchor + chosen + window as attend_support does: one batch row. */
int sparse_step(const void *q, const float *centroids, int64_t c_stride_h, int64_t c_stride_d, int64_t n_full,
                const void *keys, int64_t k_stride_h, int64_t k_stride_n, const void *values, int64_t v_stride_h,
                int64_t v_stride_n, int64_t *chosen, int64_t b, int64_t fresh, int64_t kv_heads, int64_t group,
                int64_t d, int64_t n, int64_t distant_end, int64_t block, float scale, int64_t threads, float *out,
                int64_t dtype) {
    row_t row = {0, 0, 0, 0, n, (int64_t)(intptr_t)centroids, c_stride_h, c_stride_d, (int64_t)(intptr_t)chosen,
                 b, fresh ? 1 : 0};
    (void)n_full; /* the row derives it from n and the window */
    return sparse_step_batch(q, keys, k_stride_h, k_stride_n, values, v_stride_h, v_stride_n, out,
                             (const int64_t *)&row, 1, kv_heads, group, d, n - distant_end, block, scale, threads,
                             dtype);
}

/* The compiled step's prepared call (sparsedecode/compiled/prepared.py) in one call: a sparse decode step at
 * context length n of a layer state's rows. Its bookkeeping is the declared mirror of the step's schedule,
 * sparsedecode/step/schedule.py (tests/test_schedule.py checks it against that over random schedules): after_write
 * of a decode step (start = keep = n - 1: the statistics of the blocks wholly before it survive, the reuse chain
 * only where the row's last call ended at n - 1), then decode_step (a row selects afresh every `reuse` steps of its
 * chain, every step with `every_step`, and counts the step), then sparse_step_batch over the row table (n and fresh
 * set here), then the tally (support_reads, count_step). count, step, last: one per row; tally: sparse row-steps,
 * dense row-steps, positions read (summed over KV heads), KV-head row-steps. The call splits over `threads` when the
 * centroids scored reach `split` floats, else runs on one. Returns NEEDS_STATISTICS, before any attention, when a
 * row selecting afresh lacks the statistics of blocks completed since (count < n_full): the caller completes them
 * and calls again with `resumed` = 1, which skips the bookkeeping already done. */
enum { NEEDS_STATISTICS = 3 };

int prepared_step(const void *q, const void *keys, int64_t k_stride_h, int64_t k_stride_n, const void *values,
                  int64_t v_stride_h, int64_t v_stride_n, float *out, int64_t *rows, int64_t n_rows, int64_t kv_heads,
                  int64_t group, int64_t d, int64_t window, int64_t block, float scale, int64_t threads,
                  int64_t dtype, int64_t n, int64_t reuse, int64_t every_step, int64_t split, int64_t *count,
                  int64_t *step, int64_t *last, int64_t *tally, int64_t resumed) {
    row_t *row = (row_t *)rows;
    int64_t distant_end = n - window > 1 ? n - window : 1, n_full = (distant_end - 1) / block;
    if (!resumed) {
        int64_t kept = n >= 2 ? (n - 2) / block : 0; /* positions [n - 1, n) are written: kept_blocks */
        for (int64_t r = 0; r < n_rows; r++) {
            if (count[r] > kept) count[r] = kept;
            if (last[r] != n - 1) step[r] = 0; /* continues: one token where the row's last call ended */
            last[r] = n;
        }
        for (int64_t r = 0; r < n_rows; r++)
            if ((every_step || step[r] % reuse == 0) && count[r] < n_full) return NEEDS_STATISTICS;
    }
    for (int64_t r = 0; r < n_rows; r++) {
        row[r].n = n;
        row[r].fresh = every_step || step[r] % reuse == 0;
    }
    if (n_rows * kv_heads * n_full * d < split) threads = 1;
    int status = sparse_step_batch(q, keys, k_stride_h, k_stride_n, values, v_stride_h, v_stride_n, out, rows, n_rows,
                                   kv_heads, group, d, window, block, scale, threads, dtype);
    if (status) return status;
    int64_t b = n_rows ? row[0].b : 0, heads = n_rows * kv_heads, n_blocks = (distant_end - 1 + block - 1) / block;
    int64_t reads = heads * (1 + n - distant_end) + block * heads * b;
    if (n_blocks > n_full) { /* the short last block, where chosen, reads only its distant positions */
        int64_t short_len = distant_end - 1 - n_full * block;
        for (int64_t r = 0; r < n_rows; r++) {
            const int64_t *chosen = (const int64_t *)(intptr_t)row[r].chosen;
            for (int64_t i = 0; i < kv_heads * b; i++) reads -= chosen[i] == n_full ? block - short_len : 0;
        }
    }
    for (int64_t r = 0; r < n_rows; r++) step[r] += 1;
    tally[0] += n_rows, tally[2] += reads, tally[3] += heads;
    return 0;
}

#include "model.h"
