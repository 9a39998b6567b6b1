// Cross-entropy over rows of logits, with the gradient written in place: the per-chunk core of
// coat's fused LM head + loss (coat/nn/loss.py computes the gradients in its forward).
//
// For each row r of logits [rows, vocab] (dtype T: fp32, bf16 or fp16):
// - lse[r] = m + log(sum_j exp(x_j - m)) with m the row max, in fp32 (the sum is formed in base 2:
//   exp2(x log2 e - m log2 e));
// - target[r] = logits[r, labels[r]] (exact, as fp32), or 0 for an ignored row;
// - if grad: logits[r, j] is overwritten with T(inv * (softmax_j - [j == labels[r]])), formed in
//   fp32 and rounded once; every entry of an ignored row becomes 0.
// labels[r] in [0, vocab) is the row's target; a negative label marks the row ignored (its lse is
// still computed). inv is a device scalar (1 / the loss denominator; may be inf: ignored rows
// stay 0). NaN inputs give NaN lse; no host synchronisation. Rows and vocab may be any size >= 0.
// exp2/log2 differ between the host libm and CUDA by an ulp: CPU and GPU agree to fp32 rounding,
// not bit for bit.
#pragma once

#include <cstdint>

#include "coat/common.h"

namespace coat {

void cross_entropy_rows(void* logits, DType dtype, int64_t rows, int64_t vocab, const int64_t* labels,
                        const float* inv, bool grad, float* lse, float* target, cudaStream_t stream);

namespace ref {
void cross_entropy_rows(void* logits, DType dtype, int64_t rows, int64_t vocab, const int64_t* labels,
                        const float* inv, bool grad, float* lse, float* target);
}  // namespace ref

}  // namespace coat
