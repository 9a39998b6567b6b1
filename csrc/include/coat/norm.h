// RMSNorm with an FP8 saved input (the norm of a Llama- or Gemma-family decoder layer, COAT
// precision flow).
//
// Numerics:
// - rstd[r] = 1 / sqrt(mean_c(x[r,c]^2) + eps), the mean accumulated in fp32 (CPU and GPU sum in
//   different orders, so rstd agrees to a few fp32 ulps, not bit for bit).
// - How the weight applies (NormKind), T the dtype of x, h = x[r,c] * rstd[r] in fp32:
//     kScaled:     y = T(T(h) * w[c]), the Hugging Face LlamaRMSNorm rounding (normalize in fp32,
//                  round to the input dtype, multiply by the weight).
//     kUnitOffset: y = T(h * (1 + float(w[c]))), all in fp32 and rounded once: Gemma3RMSNorm, whose
//                  weight is stored as an offset from 1 (initialized to zeros).
//   w may have any float dtype; y always has x's dtype. Given rstd, y is elementwise, so the CPU
//   and GPU agree bit for bit with each other and with torch's elementwise ops on the same rstd.
// - The saved input is x in FP8 with one scale per 1 x 16 group along the row, bit-identical to
//   quantize_per_group(x, 16, fmt, scale_kind) (coat/quantize.h has the scale rules); it does not
//   depend on the kind.
// - Backward, from the FP8 input xq (x~ = its dequantized value) and the forward's rstd, with the
//   effective weight w' = w (kScaled) or 1 + w (kUnitOffset):
//     xh = x~ * rstd,  g = dy * w',  dx = rstd * (g - xh * mean_c(g * xh)),  dw = sum_r dy * xh.
//   For kUnitOffset this is autograd of the forward's formula at x~; for kScaled it takes T(h) as h.
//   dw is reduced deterministically: fixed row partitions (rmsnorm_bwd_parts, independent of the
//   device) write fp32 partial sums that a second pass adds in partition order.
// - cols must be a multiple of 16 (the FP8 group size); the Python layer runs a plain BF16
//   RMSNorm for other widths. Rows may be 0. Tensors are row-major and contiguous; pointers need no
//   particular alignment (aligned rows take 16-byte vector loads).
// - Group scaling (COAT's just-in-time scaling): y_amax, when not null, receives max |y| over y's
//   finite values as stored (in y's dtype), found in the pass that writes y: each thread's 1 x 16
//   group maxima reduce to one atomicMax per thread block. It equals the amax that
//   quantize_per_tensor_amax would find by re-reading y, bit for bit, and feeds
//   quantize_stacked_from_amax (coat/quantize.h), so y's per-tensor FP8 costs no amax pass.
#pragma once

#include <cstdint>

#include "coat/common.h"

namespace coat {

constexpr int kNormGroup = 16;

// How the weight applies (see Numerics above).
enum class NormKind : int { kScaled = 0, kUnitOffset = 1 };

// Upper bound on the row partitions of the dw reduction (the fp32 workspace is parts x cols).
constexpr int64_t kNormBwdMaxParts = 512;

inline int64_t rmsnorm_bwd_parts(int64_t rows) { return rows < kNormBwdMaxParts ? rows : kNormBwdMaxParts; }

// y [rows, cols] (x_dtype), rstd [rows] fp32; q [rows, cols] FP8 codes and scales
// [rows, cols / 16] (fp32 or E8M0 bytes) when q is not null; y_amax [1] when not null.
void rmsnorm_fwd(const void* x, DType x_dtype, const void* w, DType w_dtype, NormKind kind, int64_t rows,
                 int64_t cols, float eps, void* y, float* rstd, uint8_t* q, void* scales,
                 ScaleKind scale_kind, Fp8Format fmt, float* y_amax, cudaStream_t stream);

// Recomputes y from the saved FP8 input with the forward's formula on x~, T = y_dtype; y_amax [1]
// when not null.
void rmsnorm_fwd_fp8(const uint8_t* q, const void* scales, ScaleKind scale_kind, Fp8Format fmt,
                     const float* rstd, const void* w, DType w_dtype, NormKind kind, int64_t rows, int64_t cols,
                     void* y, DType y_dtype, float* y_amax, cudaStream_t stream);

// dx [rows, cols] in dy's dtype; dw [cols] fp32. workspace: fp32 [rmsnorm_bwd_parts(rows), cols]
// (may be null when rows == 0).
void rmsnorm_bwd(const uint8_t* q, const void* scales, ScaleKind scale_kind, Fp8Format fmt,
                 const float* rstd, const void* w, DType w_dtype, NormKind kind, const void* dy, DType dy_dtype,
                 int64_t rows, int64_t cols, void* dx, float* workspace, float* dw,
                 cudaStream_t stream);

namespace ref {
void rmsnorm_fwd(const void* x, DType x_dtype, const void* w, DType w_dtype, NormKind kind, int64_t rows,
                 int64_t cols, float eps, void* y, float* rstd, uint8_t* q, void* scales,
                 ScaleKind scale_kind, Fp8Format fmt, float* y_amax = nullptr);
void rmsnorm_fwd_fp8(const uint8_t* q, const void* scales, ScaleKind scale_kind, Fp8Format fmt,
                     const float* rstd, const void* w, DType w_dtype, NormKind kind, int64_t rows, int64_t cols,
                     void* y, DType y_dtype, float* y_amax = nullptr);
void rmsnorm_bwd(const uint8_t* q, const void* scales, ScaleKind scale_kind, Fp8Format fmt,
                 const float* rstd, const void* w, DType w_dtype, NormKind kind, const void* dy, DType dy_dtype,
                 int64_t rows, int64_t cols, void* dx, float* workspace, float* dw);
}  // namespace ref

}  // namespace coat
