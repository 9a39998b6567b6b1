// Argument checks shared by the CPU reference and the CUDA launchers, so both reject the same input
// with the same message before anything is written.
#pragma once

#include <string>

#include "coat/quantize.h"
#include "common/fp8.h"

namespace coat {
namespace detail {

inline void check_shape(int64_t rows, int64_t cols) {
  COAT_CHECK_ARG(rows >= 0 && cols >= 0, "rows and cols must be >= 0, got " + std::to_string(rows) +
                                             " x " + std::to_string(cols));
}

inline void check_group(int64_t cols, int group) {
  COAT_CHECK_ARG(group == 16 || group == 32 || group == 64 || group == 128,
                 "group_size must be 16, 32, 64 or 128, got " + std::to_string(group));
  COAT_CHECK_ARG(cols % group == 0, "group_size " + std::to_string(group) +
                                        " does not divide the last dimension " + std::to_string(cols));
}

inline void check_ptr(const void* p, int64_t n, const char* name) {
  COAT_CHECK_ARG(n == 0 || p != nullptr, std::string(name) + " must not be null");
}

inline void check_dre(int64_t n, float log2_range) {
  COAT_CHECK_ARG(n >= 0, "n must be >= 0");
  COAT_CHECK_ARG(log2_range > 0.0f && log2_range < 64.0f,
                 "log2_range must be in (0, 64), got " + std::to_string(log2_range));
}

COAT_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace detail
}  // namespace coat
