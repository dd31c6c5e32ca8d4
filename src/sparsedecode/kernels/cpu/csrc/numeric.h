/* Included by sparse_step.c (one translation unit): the system headers, e^x, the element types and their loads,
 * and the ordering of selected blocks. */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#define cpu_relax() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield" ::: "memory")
#else
#define cpu_relax() __asm__ __volatile__("" ::: "memory")
#endif

/* e^x for x <= 0 (a logit minus the row's maximum): Cody-Waite reduction by ln 2 (k rounded to nearest by adding
 * and subtracting 1.5 * 2^23) and Cephes' degree-6 polynomial for expf (relative error ~1e-7, as libm's expf); below
 * -87 it returns ~1e-38 instead of underflowing. exp8_nonpositive does the same on 8 floats at once. */
static const float EXP_MAGIC = 12582912.0f, LOG2E = 1.44269504088896341f, LN2_HI = 0.693359375f,
                   LN2_LO = -2.12194440e-4f;
static const float EXP_POLY[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                  4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float t = x * LOG2E + EXP_MAGIC, k = t - EXP_MAGIC;
    float r = x - k * LN2_HI - k * LN2_LO;
    float p = EXP_POLY[0];
    for (int e = 1; e < 6; e++) p = p * r + EXP_POLY[e];
    p = p * r * r + r + 1.0f;
    union {
        int32_t i;
        float f;
    } scale = {.i = ((int32_t)k + 127) << 23};
    return p * scale.f;
}

/* ---------------------------------------------------------------------------------------------------------------
 * Element types. A bfloat16 is the upper half of a float32: a shift. A float16 converts exactly too (every float16
 * is a float32): one element at a time by integer arithmetic (half_to_float), eight at a time (half8, after the
 * vector types below) by F16C's vcvtph2ps where the build targets it, by _Float16 on aarch64, else by the same
 * integer arithmetic on vectors. SPARSE_STEP_HALF (1, 2, 3) picks one of the three by hand (the tests build each
 * that compiles here); all give the same floats.
 */
enum { DTYPE_F32 = 0, DTYPE_BF16 = 1, DTYPE_F16 = 2 };

#ifndef SPARSE_STEP_HALF
#if defined(__F16C__)
#define SPARSE_STEP_HALF 1
#elif defined(__aarch64__) && defined(__FLT16_MAX__)
#define SPARSE_STEP_HALF 2
#else
#define SPARSE_STEP_HALF 3
#endif
#endif
#if SPARSE_STEP_HALF == 1
#include <immintrin.h>
#endif

static inline int64_t element_size(int dtype) { return dtype == DTYPE_F32 ? 4 : 2; }

/* The address of element i of an array of `dtype` elements at p. */
static inline const char *element(const void *p, int64_t i, int dtype) {
    return (const char *)p + i * element_size(dtype);
}

static inline float bits_float(uint32_t u) {
    union {
        uint32_t u;
        float f;
    } v = {u};
    return v.f;
}

static inline uint32_t float_bits(float f) {
    union {
        float f;
        uint32_t u;
    } v = {f};
    return v.u;
}

/* float16 -> float32: zero and subnormals as m * 2^-24 (exact, and no subnormal float arithmetic, which a
 * denormals-are-zero mode would flush); normal numbers rebiased from 15 to 127; infinities and NaNs to exponent 255,
 * the mantissa kept. */
static inline float half_to_float(uint16_t h) {
    uint32_t magnitude = h & 0x7fffu, sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t rebias = (magnitude >= 0x7c00u ? 224u : 112u) << 23;
    float value = magnitude < 0x400u ? (float)magnitude * 0x1p-24f : bits_float((magnitude << 13) + rebias);
    return bits_float(float_bits(value) | sign);
}

/* Element i of an array of `dtype` elements at p, as a float. */
static inline float load1(const void *p, int64_t i, int dtype) {
    if (dtype == DTYPE_F32) return ((const float *)p)[i];
    uint16_t h = ((const uint16_t *)p)[i];
    return dtype == DTYPE_BF16 ? bits_float((uint32_t)h << 16) : half_to_float(h);
}

/* a better than b: a higher score, or an equal score at a lower block index */
static int better(float score_a, int64_t a, float score_b, int64_t b) {
    return score_a > score_b || (score_a == score_b && a < b);
}

static int compare_ascending(const void *x, const void *y) {
    int64_t a = *(const int64_t *)x, b = *(const int64_t *)y;
    return (a > b) - (a < b);
}

/* Offer block j with score s to a list of at most b (score, block), kept sorted best-first. `better` is a total
 * order on (score, block) for non-NaN scores, so the b best do not depend on the order of the offers. */
static void offer(float s, int64_t j, float *scores, int64_t *blocks, int64_t *kept, int64_t b) {
    if (*kept == b && !better(s, j, scores[b - 1], blocks[b - 1])) return;
    int64_t at = *kept < b ? (*kept)++ : b - 1;
    while (at > 0 && better(s, j, scores[at - 1], blocks[at - 1])) {
        scores[at] = scores[at - 1];
        blocks[at] = blocks[at - 1];
        at--;
    }
    scores[at] = s;
    blocks[at] = j;
}
