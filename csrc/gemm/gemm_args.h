// Argument checks shared by the CPU reference and the CUDA path of the FP8 GEMM, so both reject
// the same input with the same message before anything is written. The CUDA path adds the
// cuBLASLt alignment rules (check_gemm_cuda).
#pragma once

#include <string>

#include "coat/gemm.h"

namespace coat {
namespace detail {

inline void check_gemm(const Fp8GemmArgs& g) {
  COAT_CHECK_ARG(g.m >= 0 && g.n >= 0 && g.k >= 0,
                 "GEMM sizes must be >= 0, got M=" + std::to_string(g.m) + " N=" + std::to_string(g.n) +
                     " K=" + std::to_string(g.k));
  COAT_CHECK_ARG(!(g.a_fmt == Fp8Format::kE5M2 && g.b_fmt == Fp8Format::kE5M2),
                 "a and b are both e5m2: FP8 tensor cores have no e5m2 x e5m2 product; quantize one "
                 "operand (usually the weight side, b) as e4m3");
  COAT_CHECK_ARG(g.out_type == GemmOut::kFloat32 || g.out_type == GemmOut::kBFloat16 ||
                     g.out_type == GemmOut::kE4M3,
                 "out must be float32, bfloat16 or e4m3 codes");
  // An empty operand with row or block scales has no scales at all (no rows, or no 128-column group).
  COAT_CHECK_ARG(g.a_scale != nullptr || scale_count(g.a_mode, g.m, g.k) == 0, "scale_a must not be null");
  COAT_CHECK_ARG(g.b_scale != nullptr || scale_count(g.b_mode, g.n, g.k) == 0, "scale_b must not be null");
  COAT_CHECK_ARG(g.m * g.k == 0 || g.a != nullptr, "a must not be null");
  COAT_CHECK_ARG(g.n * g.k == 0 || g.b != nullptr, "b must not be null");
  COAT_CHECK_ARG(g.m * g.n == 0 || g.out != nullptr, "out must not be null");
  if (g.out_type == GemmOut::kE4M3)
    COAT_CHECK_ARG(g.out_scale != nullptr, "out_scale is required for an FP8 (e4m3) output");
  else
    COAT_CHECK_ARG(g.out_scale == nullptr, "out_scale is only used with an FP8 (e4m3) output");
  const bool tensor = g.a_mode == ScaleMode::kTensor && g.b_mode == ScaleMode::kTensor;
  if (!tensor) {
    const bool blockish_a = g.a_mode == ScaleMode::kVec128 || g.a_mode == ScaleMode::kBlock128;
    const bool blockish_b = g.b_mode == ScaleMode::kVec128 || g.b_mode == ScaleMode::kBlock128;
    const bool pair_ok = (g.a_mode == ScaleMode::kRow && g.b_mode == ScaleMode::kRow) ||
                         (blockish_a && blockish_b &&
                          !(g.a_mode == ScaleMode::kBlock128 && g.b_mode == ScaleMode::kBlock128));
    COAT_CHECK_ARG(pair_ok, std::string("scale modes ") + scale_mode_name(g.a_mode) + " (a) x " +
                                scale_mode_name(g.b_mode) + " (b) are not a pair cuBLASLt multiplies: use row x "
                                "row, or 1x128 with 1x128 or 128x128 (not 128x128 on both sides)");
    COAT_CHECK_ARG(g.out_type != GemmOut::kE4M3, "an FP8 (e4m3) output needs per-tensor scaling (cuBLASLt has no "
                                                 "FP8 output with row or block scales)");
    COAT_CHECK_ARG(g.bias == nullptr, "bias needs per-tensor scaling; add it separately");
    COAT_CHECK_ARG(!(g.fast_accum && blockish_a), "fast accumulation is not available with 1x128/128x128 "
                                                  "scaling (block GEMMs accumulate in split fp32)");
  }
  COAT_CHECK_ARG(g.bias == nullptr || g.out_type != GemmOut::kFloat32,
                 "bias needs a bfloat16 or e4m3 output (cuBLASLt's FP8 kernels have no bias "
                 "epilogue for float32 output); add the bias separately");
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// cuBLASLt FP8 rules, applied on every CUDA path so that a layer behaves the same on every GPU.
inline void check_gemm_cuda(const Fp8GemmArgs& g) {
  COAT_CHECK_ARG(g.k % 16 == 0, "K (the last dimension of a and b) must be a multiple of 16 for "
                                "cuBLASLt FP8, got " + std::to_string(g.k));
  COAT_CHECK_ARG(g.n % 16 == 0, "N (the first dimension of b) must be a multiple of 16 for "
                                "cuBLASLt FP8, got " + std::to_string(g.n));
  COAT_CHECK_ARG(aligned16(g.a), "a must be 16-byte aligned (clone the view)");
  COAT_CHECK_ARG(aligned16(g.b), "b must be 16-byte aligned (clone the view)");
  COAT_CHECK_ARG(aligned16(g.out), "out must be 16-byte aligned");
  COAT_CHECK_ARG(aligned16(g.bias), "bias must be 16-byte aligned (clone the view)");
  if (g.a_mode != ScaleMode::kTensor) {
    COAT_CHECK_ARG(g.m % 16 == 0, "M (the rows of a) must be a multiple of 16 for row or block scaling on "
                                  "CUDA, got " + std::to_string(g.m) + " (pad the tokens)");
    COAT_CHECK_ARG(aligned16(g.a_scale) && aligned16(g.b_scale), "scale_a and scale_b must be 16-byte aligned");
  }
}

}  // namespace detail
}  // namespace coat
