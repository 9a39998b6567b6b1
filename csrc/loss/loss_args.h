// Argument checks shared by the CPU reference and the CUDA launcher of cross_entropy_rows.
#pragma once

#include <string>

#include "coat/loss.h"
#include "common/fp8.h"

namespace coat {
namespace detail {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

inline void check_cross_entropy(const void* logits, int64_t rows, int64_t vocab, const int64_t* labels,
                                const float* inv, bool grad, const float* lse, const float* target) {
  COAT_CHECK_ARG(rows >= 0 && vocab >= 0, "rows and vocab must be >= 0, got " + std::to_string(rows) + " x " +
                                              std::to_string(vocab));
  COAT_CHECK_ARG(rows == 0 || vocab > 0, "vocab must be > 0 when there are rows");
  COAT_CHECK_ARG(rows == 0 || (logits != nullptr && labels != nullptr && lse != nullptr && target != nullptr),
                 "logits, labels, lse and target must not be null");
  COAT_CHECK_ARG(!grad || inv != nullptr, "inv must not be null when the gradient is written");
}

}  // namespace detail
}  // namespace coat
