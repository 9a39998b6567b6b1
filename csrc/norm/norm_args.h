// Argument checks shared by the CPU reference and the CUDA launchers of the norm family, so both
// reject the same input with the same message before anything is written.
#pragma once

#include <cmath>
#include <string>

#include "coat/norm.h"

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

}  // namespace detail
}  // namespace coat
