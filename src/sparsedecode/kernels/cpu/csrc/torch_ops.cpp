/* The C kernel's quantized products (qlinear.h) as torch operators implemented in C++ for the CPU: the compiled step
 * calls about 210 of them a token, and the Python implementation of sparsedecode/kernels/cpu/qlinear.py costs about
 * 10 us a call before any work (argument checks, ctypes) where this one costs about 1. Built against torch's stable
 * C++ interface (torch/csrc/stable: headers only, no ATen), so it compiles in seconds; the ops themselves are defined
 * by qlinear.py, and where this file cannot be built its Python implementation serves them.
 *
 * The products are those of the C library built from sparse_step.c, which qlinear.py hands over by address
 * (sparsedecode_set_products) before any call: one build of the arithmetic, two ways of calling it. */

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

typedef int (*int4_product)(const uint8_t *, const void *, const void *, const float *, float *, int64_t, int64_t,
                            int64_t, int64_t, int64_t);
typedef int (*int8_product)(const int8_t *, const void *, const float *, float *, int64_t, int64_t, int64_t, int64_t,
                            int64_t, int64_t);

static int4_product q4 = nullptr;
static int8_product q8 = nullptr;

extern "C" void sparsedecode_set_products(void *int4, void *int8) {
    q4 = reinterpret_cast<int4_product>(int4);
    q8 = reinterpret_cast<int8_product>(int8);
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
    m.impl("int8_linear", TORCH_BOX(&int8_linear));
}
