/* torch operators of the compiled step implemented in C++ for the CPU, so that no Python runs between the caller
 * (the compiled step's wrapper) and the C kernel where none is needed:
 *   - the C kernel's quantized products (qlinear.h): the compiled step calls about 210 of them a token, and the
 *     Python implementation of sparsedecode/kernels/cpu/qlinear.py costs about 10 us a call before any work
 *     (argument checks, ctypes) where this one costs about 1;
 *   - the sparse step's prepared call (sparsedecode/compiled/prepared.py), at the end of this file.
 * Built against torch's stable C++ interface (torch/csrc/stable: headers only, no ATen), so it compiles in seconds;
 * the ops themselves are defined in Python (qlinear.py, compiled/op.py), and where this file cannot be built their
 * Python implementations serve them.
 *
 * The C functions are those of the library built from sparse_step.c, which native.py hands over by address
 * (sparsedecode_set_products) before any call: one build of the arithmetic, two ways of calling it. */

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

typedef int (*int4_product)(const uint8_t *, const void *, const void *, const float *, float *, int64_t, int64_t,
                            int64_t, int64_t, int64_t);
typedef int (*int5_product)(const uint8_t *, const uint8_t *, const void *, const void *, const float *, float *,
                            int64_t, int64_t, int64_t, int64_t, int64_t);
typedef int (*int8_product)(const int8_t *, const void *, const float *, float *, int64_t, int64_t, int64_t, int64_t,
                            int64_t, int64_t);

typedef int (*prepared_call)(const void *, const void *, int64_t, int64_t, const void *, int64_t, int64_t, float *,
                             int64_t *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, int64_t, int64_t,
                             int64_t, int64_t, int64_t, int64_t, int64_t *, int64_t *, int64_t *, int64_t *, int64_t);

static int4_product q4 = nullptr;
static int8_product q8 = nullptr;
static int5_product q5 = nullptr;
static prepared_call prepared = nullptr;

extern "C" void sparsedecode_set_products(void *int4, void *int8, void *step, void *int5) {
    q4 = reinterpret_cast<int4_product>(int4);
    q5 = reinterpret_cast<int5_product>(int5);
    q8 = reinterpret_cast<int8_product>(int8);
    prepared = reinterpret_cast<prepared_call>(step);
}

/* The activations (rows, inputs) float32, contiguous (copied if not), on the CPU. */
static Tensor activations(const Tensor &x, int64_t inputs) {
    STD_TORCH_CHECK(x.is_cpu() && x.scalar_type() == ScalarType::Float && x.dim() == 2 && x.size(1) == inputs,
                    "quantized product: activations (rows, ", inputs, ") float32 on the CPU");
    return x.is_contiguous() ? x : torch::stable::contiguous(x);
}

/* A weight tensor as the C loop reads it: contiguous, of the given dtype. */
static void check_weight(const Tensor &t, ScalarType dtype, const char *what) {
    STD_TORCH_CHECK(t.is_cpu() && t.is_contiguous() && t.scalar_type() == dtype, "quantized product: ", what,
                    " must be contiguous CPU tensors of the layer's dtype");
}

/* Scales and offsets in float16 or float32 (both the same); returns whether float32. */
static int64_t wide_scales(const Tensor &scale) {
    ScalarType dtype = scale.scalar_type();
    STD_TORCH_CHECK(dtype == ScalarType::Half || dtype == ScalarType::Float,
                    "quantized product: scales are float16 or float32");
    check_weight(scale, dtype, "scales");
    return dtype == ScalarType::Float;
}

static Tensor output(int64_t rows, int64_t n) {
    int64_t sizes[2] = {rows, n}, strides[2] = {n, 1};
    AtenTensorHandle handle;
    STD_TORCH_CHECK(aoti_torch_empty_strided(2, sizes, strides, aoti_torch_dtype_float32(),
                                             aoti_torch_device_type_cpu(), 0, &handle) == AOTI_TORCH_SUCCESS,
                    "quantized product: out of memory for its output");
    return Tensor(handle);
}

static void check_status(int status) {
    STD_TORCH_CHECK(status == 0, "quantized product: out of memory for its scratch buffers");
}

/* x (rows, K) times packed (K/32, 16, N) uint8 with scale and offset (K/32, N): (rows, N) float32. */
Tensor int4_linear(Tensor x, Tensor packed, Tensor scale, Tensor offset) {
    STD_TORCH_CHECK(q4 != nullptr && packed.dim() == 3 && packed.size(1) == 16, "int4_linear: packed (K/32, 16, N)");
    int64_t groups = packed.size(0), n = packed.size(2);
    Tensor input = activations(x, groups * 32);
    check_weight(packed, ScalarType::Byte, "packed weights");
    int64_t wide = wide_scales(scale);
    check_weight(offset, scale.scalar_type(), "offsets");
    STD_TORCH_CHECK(scale.numel() == groups * n && offset.numel() == groups * n, "int4_linear: scales (K/32, N)");
    Tensor out = output(input.size(0), n);
    check_status(q4(static_cast<const uint8_t *>(packed.data_ptr()), scale.data_ptr(), offset.data_ptr(),
                    static_cast<const float *>(input.data_ptr()), static_cast<float *>(out.data_ptr()),
                    input.size(0), n, groups, wide, torch::stable::get_num_threads()));
    return out;
}

/* x (rows, K) times packed (K/32, 16, N) and high (K/32, 4, N) uint8 with scale and offset (K/32, N): (rows, N). */
Tensor int5_linear(Tensor x, Tensor packed, Tensor high, Tensor scale, Tensor offset) {
    STD_TORCH_CHECK(q5 != nullptr && packed.dim() == 3 && packed.size(1) == 16, "int5_linear: packed (K/32, 16, N)");
    int64_t groups = packed.size(0), n = packed.size(2);
    STD_TORCH_CHECK(high.dim() == 3 && high.size(0) == groups && high.size(1) == 4 && high.size(2) == n,
                    "int5_linear: high (K/32, 4, N)");
    Tensor input = activations(x, groups * 32);
    check_weight(packed, ScalarType::Byte, "packed weights");
    check_weight(high, ScalarType::Byte, "fifth bits");
    int64_t wide = wide_scales(scale);
    check_weight(offset, scale.scalar_type(), "offsets");
    STD_TORCH_CHECK(scale.numel() == groups * n && offset.numel() == groups * n, "int5_linear: scales (K/32, N)");
    Tensor out = output(input.size(0), n);
    check_status(q5(static_cast<const uint8_t *>(packed.data_ptr()), static_cast<const uint8_t *>(high.data_ptr()),
                    scale.data_ptr(), offset.data_ptr(), static_cast<const float *>(input.data_ptr()),
                    static_cast<float *>(out.data_ptr()), input.size(0), n, groups, wide,
                    torch::stable::get_num_threads()));
    return out;
}

/* x (rows, K) times q (N, K/32, 32) int8 with scale (N, K/block), block 32 or 16: (rows, N) float32. */
Tensor int8_linear(Tensor x, Tensor q, Tensor scale) {
    STD_TORCH_CHECK(q8 != nullptr && q.dim() == 3 && q.size(2) == 32, "int8_linear: q (N, K/32, 32)");
    int64_t n = q.size(0), groups = q.size(1);
    Tensor input = activations(x, groups * 32);
    check_weight(q, ScalarType::Char, "int8 weights");
    int64_t wide = wide_scales(scale);
    STD_TORCH_CHECK(scale.dim() == 2 && scale.size(0) == n && (scale.size(1) == groups || scale.size(1) == 2 * groups),
                    "int8_linear: scales (N, K/32) or (N, K/16)");
    Tensor out = output(input.size(0), n);
    check_status(q8(static_cast<const int8_t *>(q.data_ptr()), scale.data_ptr(),
                    static_cast<const float *>(input.data_ptr()), static_cast<float *>(out.data_ptr()), input.size(0),
                    n, groups, groups * 32 / scale.size(1), wide, torch::stable::get_num_threads()));
    return out;
}

STABLE_TORCH_LIBRARY_IMPL(sparsedecode_quantized, CPU, m) {
    m.impl("int4_linear", TORCH_BOX(&int4_linear));
    m.impl("int5_linear", TORCH_BOX(&int5_linear));
    m.impl("int8_linear", TORCH_BOX(&int8_linear));
}

/* ---------------------------------------------------------------------------------------------------------------
 * sparsedecode::sparse_step's CPU kernel. A call whose layer state has a prepared call (Python's Prepared, offered
 * here when Python made it or used it, and filed under that call's signature: every tensor's address and layout, the
 * configuration, the layer and the scale, as compiled/prepared.py's signature_of) and whose context is sparse is the
 * C library's prepared_step, called as Prepared.__call__ calls it. Every other call (a dense step, the first sparse
 * call of a state, another form, a selector the prepared call does not serve, a signature not seen) is the Python
 * implementation, sparsedecode::sparse_step_host, and so are the completion of block statistics the C call asks for
 * and its errors: Python keeps an error it raises there, returns an empty tensor, and the caller raises it again
 * (compiled/op.py: no Python error crosses this C interface, which would turn it into a RuntimeError). */

enum { F_ID, F_TABLE, F_ROWS, F_KV, F_GROUP, F_D, F_WINDOW, F_BLOCK, F_CODE, F_REUSE, F_EVERY, F_SPLIT, F_COUNT, F_STEP,
       F_LAST, F_TALLY, F_SUPPORT, F_FIELDS };
enum { NEEDS_STATISTICS = 3 };
static const char *FAILED = "sparse_step: the step failed in Python (sparsedecode raises its error again)";

struct Record {
    std::string config;
    std::vector<int64_t> signature;
    int64_t fields[F_FIELDS];
};
static std::unordered_map<intptr_t, Record> records; /* by the state's count tensor's address */
static int64_t offered[F_FIELDS];
static bool has_offer = false;
static int64_t calls = 0; /* prepared calls made here */

/* How many prepared calls this kernel has made (tests, diagnostics). */
extern "C" int64_t sparsedecode_step_calls() { return calls; }

/* A prepared call for the call in progress (fields: F_FIELDS int64, compiled/prepared.py's Prepared.native). */
extern "C" void sparsedecode_offer_step(const int64_t *fields) {
    std::memcpy(offered, fields, sizeof(offered));
    has_offer = true;
}

/* Forget every prepared call (Python drops its Prepared objects, which own the row tables). */
extern "C" void sparsedecode_forget_steps() {
    records.clear();
    has_offer = false;
}

static void describe(std::vector<int64_t> &out, const Tensor &t, bool address) {
    if (address) out.push_back(static_cast<int64_t>(reinterpret_cast<intptr_t>(t.data_ptr())));
    out.push_back(static_cast<int64_t>(t.scalar_type()));
    out.push_back(t.dim());
    for (int64_t i = 0; i < t.dim(); i++) out.push_back(t.size(i)), out.push_back(t.stride(i));
}

static std::vector<int64_t> signature(const Tensor &query, const Tensor &key, const Tensor &value,
                                      const Tensor &position, const Tensor &stats, const Tensor &count,
                                      const Tensor &blocks, const Tensor &step, const Tensor &last, const Tensor &tally,
                                      int64_t layer, double scale) {
    std::vector<int64_t> out;
    out.reserve(96);
    int64_t bits;
    std::memcpy(&bits, &scale, sizeof(bits));
    out.push_back(layer), out.push_back(bits);
    describe(out, query, false), describe(out, key, true), describe(out, value, true), describe(out, position, false);
    describe(out, stats, true), describe(out, count, true), describe(out, blocks, true), describe(out, step, true);
    describe(out, last, true), describe(out, tally, true);
    return out;
}

static Tensor host(std::array<StableIValue, 16> &stack) {
    STD_TORCH_CHECK(torch_call_dispatcher("sparsedecode::sparse_step_host", "", stack.data(), TORCH_ABI_VERSION) ==
                        AOTI_TORCH_SUCCESS,
                    FAILED);
    Tensor out = torch::stable::detail::to<Tensor>(stack[0]);
    STD_TORCH_CHECK(out.dim() != 1, FAILED); /* the empty tensor of a kept error; a step's output has 4 dims */
    return out;
}

/* Python's part of a prepared call (compiled/op.py's prepared_host): the statistics the C call asks for, or the
 * error of its status. Returns whether the call goes on. */
static bool prepared_host(const Tensor &key, const Tensor &stats, int64_t id, int64_t n, int64_t status) {
    std::array<StableIValue, 5> stack{torch::stable::detail::from(key), torch::stable::detail::from(stats),
                                      torch::stable::detail::from(id), torch::stable::detail::from(n),
                                      torch::stable::detail::from(status)};
    STD_TORCH_CHECK(torch_call_dispatcher("sparsedecode::prepared_host", "", stack.data(), TORCH_ABI_VERSION) ==
                        AOTI_TORCH_SUCCESS,
                    FAILED);
    return torch::stable::detail::to<bool>(stack[0]);
}

static Tensor run_prepared(const Record &record, const Tensor &query, const Tensor &key, const Tensor &value,
                           const Tensor &stats, int64_t n, double scale) {
    const int64_t *f = record.fields;
    int64_t sizes[4] = {query.size(0), 1, query.size(1), value.size(3)};
    int64_t strides[4] = {sizes[2] * sizes[3], sizes[2] * sizes[3], sizes[3], 1};
    AtenTensorHandle handle;
    STD_TORCH_CHECK(aoti_torch_empty_strided(4, sizes, strides, aoti_torch_dtype_float32(),
                                             aoti_torch_device_type_cpu(), 0, &handle) == AOTI_TORCH_SUCCESS,
                    "sparse_step: out of memory for its output");
    Tensor out(handle);
    auto address = [](int64_t at) { return reinterpret_cast<int64_t *>(static_cast<intptr_t>(at)); };
    calls++;
    for (int64_t resumed = 0;; resumed = 1) {
        int status = prepared(query.data_ptr(), key.data_ptr(), key.stride(1), key.stride(2), value.data_ptr(),
                              value.stride(1), value.stride(2), static_cast<float *>(out.data_ptr()),
                              address(f[F_TABLE]), f[F_ROWS], f[F_KV], f[F_GROUP], f[F_D], f[F_WINDOW], f[F_BLOCK],
                              static_cast<float>(scale), torch::stable::get_num_threads(), f[F_CODE], n, f[F_REUSE],
                              f[F_EVERY], f[F_SPLIT], address(f[F_COUNT]), address(f[F_STEP]), address(f[F_LAST]),
                              address(f[F_TALLY]), resumed);
        if (status == 0) break;
        bool again = status == NEEDS_STATISTICS && !resumed;
        STD_TORCH_CHECK(prepared_host(key, stats, f[F_ID], n, status) && again, FAILED);
    }
    return query.scalar_type() == ScalarType::Float ? out : torch::stable::to(out, query.scalar_type());
}

Tensor sparse_step(Tensor query, Tensor key, Tensor value, Tensor position, Tensor stats, Tensor count, Tensor blocks,
                   Tensor budget_mask, Tensor positions, Tensor step, Tensor last, Tensor tally, std::string config,
                   int64_t layer, double scale, std::string form) {
    bool serves = prepared != nullptr && form == "prepared";
    auto found = serves ? records.find(reinterpret_cast<intptr_t>(count.data_ptr())) : records.end();
    if (found != records.end() && found->second.config == config && position.scalar_type() == ScalarType::Long &&
        position.numel() > 0 &&
        found->second.signature ==
            signature(query, key, value, position, stats, count, blocks, step, last, tally, layer, scale)) {
        int64_t at = 0; /* the last element of position, wherever its strides put it */
        for (int64_t i = 0; i < position.dim(); i++) at += (position.size(i) - 1) * position.stride(i);
        int64_t n = static_cast<const int64_t *>(position.data_ptr())[at] + 1;
        if (n > found->second.fields[F_SUPPORT] && n <= key.size(2))
            return run_prepared(found->second, query, key, value, stats, n, scale);
    }
    has_offer = false;
    std::array<StableIValue, 16> stack{
        torch::stable::detail::from(query),      torch::stable::detail::from(key),
        torch::stable::detail::from(value),      torch::stable::detail::from(position),
        torch::stable::detail::from(stats),      torch::stable::detail::from(count),
        torch::stable::detail::from(blocks),     torch::stable::detail::from(budget_mask),
        torch::stable::detail::from(positions),  torch::stable::detail::from(step),
        torch::stable::detail::from(last),       torch::stable::detail::from(tally),
        torch::stable::detail::from(config),     torch::stable::detail::from(layer),
        torch::stable::detail::from(scale),      torch::stable::detail::from(form)};
    Tensor out = host(stack);
    if (serves && has_offer) { /* Python made or used a prepared call for this very call: file it */
        Record record{config, signature(query, key, value, position, stats, count, blocks, step, last, tally, layer,
                                        scale), {}};
        std::memcpy(record.fields, offered, sizeof(offered));
        records[reinterpret_cast<intptr_t>(count.data_ptr())] = std::move(record);
    }
    has_offer = false;
    return out;
}

STABLE_TORCH_LIBRARY_IMPL(sparsedecode, CPU, m) { m.impl("sparse_step", TORCH_BOX(&sparse_step)); }
