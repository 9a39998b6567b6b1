// Argument checks shared by the CPU reference and the CUDA launchers of the norm family, so both
// reject the same input with the same message before anything is written.
#pragma once

#include <cmath>
#include <string>

#include "coat/norm.h"
#include "common/fp8.h"

namespace coat {
namespace detail {

inline void check_norm_shape(int64_t rows, int64_t cols) {
  COAT_CHECK_ARG(rows >= 0 && cols >= 0, "rows and cols must be >= 0, got " + std::to_string(rows) +
                                             " x " + std::to_string(cols));
  COAT_CHECK_ARG(cols % kNormGroup == 0, "the normalized dimension (" + std::to_string(cols) +
                                             ") must be a multiple of 16 for the FP8 path");
}

inline void check_norm_ptr(const void* p, int64_t n, const char* name) {
  COAT_CHECK_ARG(n == 0 || p != nullptr, std::string(name) + " must not be null");
}

inline void check_eps(float eps) {
  COAT_CHECK_ARG(std::isfinite(eps) && eps >= 0.0f, "eps must be finite and >= 0, got " + std::to_string(eps));
}

inline void check_norm_kind(NormKind kind) {
  COAT_CHECK_ARG(kind == NormKind::kScaled || kind == NormKind::kUnitOffset,
                 "norm_kind must be 0 (scaled) or 1 (unit_offset), got " + std::to_string(static_cast<int>(kind)));
}

// One check per entry point, called by the reference and the launcher alike.
inline void check_rmsnorm_fwd(const void* x, const void* w, NormKind kind, int64_t rows, int64_t cols, float eps,
                              const void* y, const float* rstd, const uint8_t* q, const void* scales) {
  check_norm_kind(kind);
  check_norm_shape(rows, cols);
  check_eps(eps);
  const int64_t n = rows * cols;
  check_norm_ptr(x, n, "x");
  check_norm_ptr(w, cols, "weight");
  check_norm_ptr(y, n, "y");
  check_norm_ptr(rstd, rows, "rstd");
  COAT_CHECK_ARG(q == nullptr || scales != nullptr || n == 0, "scales must not be null when q is given");
}

// What the FP8 forward saves and the backward reads: codes, scales, rstd, and the weight.
inline void check_rmsnorm_saved(const uint8_t* q, const void* scales, const float* rstd, const void* w,
                                NormKind kind, int64_t rows, int64_t cols) {
  check_norm_kind(kind);
  check_norm_shape(rows, cols);
  const int64_t n = rows * cols;
  check_norm_ptr(q, n, "q");
  check_norm_ptr(scales, n, "scales");
  check_norm_ptr(rstd, n, "rstd");
  check_norm_ptr(w, cols, "weight");
}

inline void check_rmsnorm_fwd_fp8(const uint8_t* q, const void* scales, const float* rstd,
                                  const void* w, NormKind kind, int64_t rows, int64_t cols, const void* y) {
  check_rmsnorm_saved(q, scales, rstd, w, kind, rows, cols);
  check_norm_ptr(y, rows * cols, "y");
}

inline void check_rmsnorm_bwd(const uint8_t* q, const void* scales, const float* rstd, const void* w,
                              NormKind kind, const void* dy, int64_t rows, int64_t cols, const void* dx,
                              const float* dw) {
  check_rmsnorm_saved(q, scales, rstd, w, kind, rows, cols);
  const int64_t n = rows * cols;
  check_norm_ptr(dy, n, "dy");
  check_norm_ptr(dx, n, "dx");
  check_norm_ptr(dw, cols, "dw");
}

// The weight as it multiplies the normalized input: w, or 1 + w (in fp32) for the unit offset.
COAT_HD float norm_weight(float w, bool unit_offset) { return unit_offset ? 1.0f + w : w; }

}  // namespace detail
}  // namespace coat
