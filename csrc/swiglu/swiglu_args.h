// Argument checks shared by the CPU reference and the CUDA launchers of the swiglu family.
#pragma once

#include <string>

#include "coat/swiglu.h"

namespace coat {
namespace detail {

inline void check_swiglu_shape(int64_t rows, int64_t inter) {
  COAT_CHECK_ARG(rows >= 0 && inter >= 0, "rows and intermediate size must be >= 0, got " +
                                              std::to_string(rows) + " x " + std::to_string(inter));
  COAT_CHECK_ARG(inter % kSwigluGroup == 0, "the intermediate size (" + std::to_string(inter) +
                                                ") must be a multiple of 16 for the FP8 path");
}

inline void check_swiglu_ptr(const void* p, int64_t n, const char* name) {
  COAT_CHECK_ARG(n == 0 || p != nullptr, std::string(name) + " must not be null");
}

// The SiLU pieces, identical on host and device up to exp's last-ulp difference.
COAT_HD float swiglu_sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

}  // namespace detail
}  // namespace coat
