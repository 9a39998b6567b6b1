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

inline void check_swiglu_fwd(const void* gu, int64_t rows, int64_t inter, const void* h,
                             const uint8_t* q, const void* scales) {
  check_swiglu_shape(rows, inter);
  const int64_t n = rows * inter;
  check_swiglu_ptr(gu, n, "gate_up");
  check_swiglu_ptr(h, n, "h");
  COAT_CHECK_ARG(q == nullptr || scales != nullptr || n == 0, "scales must not be null when q is given");
}

inline void check_swiglu_bwd(const uint8_t* q, const void* scales, const void* dh, int64_t rows,
                             int64_t inter, const void* dgu) {
  check_swiglu_shape(rows, inter);
  const int64_t n = rows * inter;
  check_swiglu_ptr(q, n, "q");
  check_swiglu_ptr(scales, n, "scales");
  check_swiglu_ptr(dh, n, "dh");
  check_swiglu_ptr(dgu, n, "dgu");
}

// The SiLU pieces, identical on host and device up to exp's last-ulp difference.
COAT_HD float swiglu_sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

}  // namespace detail
}  // namespace coat
