// FP8 operand statistics (coat.fp8_stats): how much of a GEMM operand the per-tensor FP8 cast
// loses, counted in one pass over the operand, without a host synchronisation.
//
// Over the n values of x (fp32, bf16 or fp16), with a = |x| * (1 / scale[0]) in fp32 (the
// quantizer's x * (1/s)), accumulated into what counts and amax already hold:
//   counts[0] += #(x != 0)                           (NaN counts: it is not zero)
//   counts[1] += #(x != 0 and a <= half_sub)         (non-zero values that round to the zero code)
//   counts[2] += #(a >= clip)                        (values that saturation clips)
//   amax[0]    = max(amax[0], max |x|), NaN when any x is NaN (amax[0] must be >= 0 or NaN)
// half_sub and clip come from the caller (per format: half the smallest subnormal, and the smallest
// fp32 |x|/s that rounds past the largest finite code). The kernel and the CPU reference count
// exactly the same elements; amax is exact in both.
#pragma once

#include <cstdint>

#include "coat/common.h"

namespace coat {

void fp8_operand_stats(const void* x, DType dtype, int64_t n, const float* scale, float half_sub, float clip,
                       int64_t* counts, float* amax, cudaStream_t stream);

namespace ref {
void fp8_operand_stats(const void* x, DType dtype, int64_t n, const float* scale, float half_sub, float clip,
                       int64_t* counts, float* amax);
}  // namespace ref

}  // namespace coat
