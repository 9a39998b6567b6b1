// FP8 GEMM: Y = (A * sa) @ (B * sb)^T, the "TN" product nn.Linear needs, on cuBLASLt.
//
// Layouts (row-major, contiguous, no strides):
//   A [M, K] FP8 codes (E4M3 or E5M2), B [N, K] FP8 codes (E4M3 or E5M2): both K-contiguous.
//   Y [M, N] bf16, fp32 or E4M3 codes.
//   E5M2 x E5M2 is rejected: FP8 tensor cores have no such product.
//   For a Linear layer: forward  y  = gemm(x8 [M,K], w8 [N,K]);
//                       backward dx = gemm(dy8 [M,N], w8_t [K,N]), dw = gemm(dy8_t [N,M], x8_t [K,M]).
//
// Numerics:
// - Scales are per-tensor dequantization multipliers on the device (fp32, one element each):
//   A ~= qa * a_scale[0], B ~= qb * b_scale[0], as produced by coat's quantize family.
// - acc[m,n] = sum_k qa[m,k] * qb[n,k] in fp32 (products of FP8 values are exact in fp32; the
//   summation order is the implementation's), v = acc * (a_scale * b_scale) + bias[n], then v is
//   rounded to the output type (nearest even). With an FP8 output, out = e4m3(v * (1/out_scale)),
//   saturating; out_scale is a dequantization multiplier like the others.
// - bias: bf16 [N], or null. It needs a bf16 or FP8 output (as torch._scaled_mm: cuBLASLt's FP8
//   kernels have no bias epilogue for fp32 output); with fp32 output add the bias separately.
// - amax (optional, fp32 [1]): max |v| over the finite values of the result before the final
//   rounding. Fused into cuBLASLt for FP8 output (cuBLASLt computes amax only for FP8 D when the
//   inputs are FP8). For bf16/fp32 output a separate pass reads the stored output, so on the GPU
//   that amax carries the output's rounding (one bf16 ulp at most).
// - Devices with FP8 tensor cores (compute capability >= 8.9) run cuBLASLt FP8 kernels with fp32
//   accumulation (no "fast accumulation" unless args.fast_accum), except that the tensor cores add
//   the products inside one instruction's K slice with fewer mantissa bits: measured on an H200, up
//   to 2^-14 of the sum of |terms| (tests/cpp/test_gemm_gpu.cpp holds it to 2^-13; DeepSeek-V3
//   reports ~14 bits on H800). Others (sm80) keep the same API: both operands are
//   decoded exactly to bf16 in `scratch` (FP8 values are bf16 values) and a bf16 cuBLASLt GEMM with
//   fp32 accumulation and alpha = a_scale * b_scale computes the same sum: results match within
//   accumulation order. `force_bf16` takes that path on any device (tests, comparisons).
//
// Alignment (CUDA only; the CPU reference takes any shape):
// - cuBLASLt FP8 needs K % 16 == 0 and N % 16 == 0 (leading dimensions of 16 bytes) and 16-byte
//   aligned A, B, Y and bias pointers. The CUDA entry point checks this on every path and raises
//   std::invalid_argument (Python ValueError) rather than padding: the core never allocates.
//   coat.nn.Fp8Linear avoids the error by running its BF16 path for such layers. M is free
//   (0 and 1 included); N == 0 or M == 0 only writes amax = 0; K == 0 gives Y = bias (or 0).
//
// Buffers (the caller allocates; the core never does):
// - workspace: device bytes for cuBLASLt (32 MiB recommended on Hopper, 256-byte aligned); the first
//   kGemmWorkspaceReserve bytes hold small device scalars coat computes (1/out_scale, alpha).
//   Calls that share a workspace must be on the same stream.
// - scratch: only for the bf16 path, gemm_fp8_scratch_bytes() bytes (0 on FP8 devices).
//
// Thread safety: the cuBLASLt handle is cached per device and each (shape, dtypes, alignment) key
// caches its descriptors and heuristic choice, behind mutexes; concurrent calls are safe.
#pragma once

#include <cstddef>
#include <cstdint>

#include "coat/common.h"

namespace coat {

// Output element type of an FP8 GEMM.
enum class GemmOut : int { kFloat32 = 0, kBFloat16 = 1, kE4M3 = 2 };

constexpr size_t kGemmWorkspaceReserve = 256;
constexpr size_t kGemmDefaultWorkspace = size_t(32) << 20;

struct Fp8GemmArgs {
  int64_t m = 0, n = 0, k = 0;
  const uint8_t* a = nullptr;  // [m, k]
  Fp8Format a_fmt = Fp8Format::kE4M3;
  const float* a_scale = nullptr;
  const uint8_t* b = nullptr;  // [n, k]
  Fp8Format b_fmt = Fp8Format::kE4M3;
  const float* b_scale = nullptr;
  const void* bias = nullptr;  // bf16 [n] or null
  void* out = nullptr;         // [m, n] of out_type
  GemmOut out_type = GemmOut::kBFloat16;
  const float* out_scale = nullptr;  // FP8 output only
  float* amax = nullptr;             // optional
  // How a and b are scaled (ScaleMode, coat/common.h; a is [m, k], b is [n, k], both with K = k):
  // a_scale / b_scale hold scale_count(mode, rows, k) values in the mode's layout. Per tensor
  // (the default) both; otherwise one of the pairs cuBLASLt takes on Hopper: row x row, or 1x128
  // with 1x128 or 128x128 on either side (128x128 x 128x128 is not a Hopper kernel). Finer modes
  // need a bf16 or fp32 output, no bias and no fast accumulation with 1x128/128x128 (the block
  // kernels accumulate in split fp32 only), and on CUDA an sm_90 GPU with m % 16 == 0 (callers pad
  // tokens; coat's quantize_scaled writes padded operands). v = sum_k (qa sa)(qb sb) per group.
  ScaleMode a_mode = ScaleMode::kTensor;
  ScaleMode b_mode = ScaleMode::kTensor;
  // Hopper's fast FP8 accumulation (no periodic promotion of the tensor cores' partial sums to
  // fp32): ~10-15% faster, less accurate over long K. TransformerEngine uses it for the forward
  // GEMM only; coat's layers do the same (Fp8Recipe.fast_accum_fwd). Ignored on the bf16 path.
  bool fast_accum = false;
};

// Whether `device` runs FP8 tensor-core kernels (compute capability >= 8.9).
bool gemm_fp8_native(int device);

// Scratch bytes the CUDA path needs on `device` for this problem (0 when it runs FP8 natively and
// force_bf16 is false).
size_t gemm_fp8_scratch_bytes(int device, int64_t m, int64_t n, int64_t k, GemmOut out_type,
                              bool force_bf16);

// CUDA: all pointers on the current device; runs on `stream`, no host synchronisation.
void gemm_fp8(const Fp8GemmArgs& args, void* workspace, size_t workspace_bytes, void* scratch,
              size_t scratch_bytes, bool force_bf16, cudaStream_t stream);

namespace ref {
// CPU reference: the same arguments on host memory (no workspace, no stream). Any m, n, k.
void gemm_fp8(const Fp8GemmArgs& args);
}  // namespace ref

}  // namespace coat
