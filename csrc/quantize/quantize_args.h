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
  COAT_CHECK_ARG(log2_range >= 0.0f && log2_range < 64.0f,
                 "log2_range must be in [0, 64) (0: no expansion), got " + std::to_string(log2_range));
}

// Checks the parts of a stacked matrix; returns its row count.
inline int64_t check_stacked_parts(const StackedRows& x) {
  COAT_CHECK_ARG(x.count >= 1 && x.count <= kMaxStackParts,
                 "a stacked matrix has 1 to " + std::to_string(kMaxStackParts) + " parts, got " +
                     std::to_string(x.count));
  COAT_CHECK_ARG(x.cols >= 0, "cols must be >= 0, got " + std::to_string(x.cols));
  int64_t rows = 0;
  for (int i = 0; i < x.count; ++i) {
    COAT_CHECK_ARG(x.rows[i] >= 0, "part " + std::to_string(i) + " has a negative row count");
    check_ptr(x.data[i], x.rows[i] * x.cols, "part data");
    rows += x.rows[i];
  }
  return rows;
}

// Checks a stacked matrix and its outputs before anything is written; returns its row count.
inline int64_t check_stacked(const StackedRows& x, const float* scale, const float* amax,
                             const float* scale_out, const uint8_t* q, const uint8_t* q_t) {
  const int64_t rows = check_stacked_parts(x);
  COAT_CHECK_ARG(q != nullptr || q_t != nullptr || rows * x.cols == 0, "q and q_t must not both be null");
  if (amax != nullptr)
    COAT_CHECK_ARG(scale_out != nullptr, "scale_out must not be null when amax is computed");
  else
    COAT_CHECK_ARG(scale != nullptr, "scale must not be null");
  return rows;
}

// Checks stacked codes for transpose_stacked_codes; returns the row count.
inline int64_t check_stacked_codes(const StackedRows& x, const uint8_t* q_t) {
  const int64_t rows = check_stacked_parts(x);
  check_ptr(q_t, rows * x.cols, "q_t");
  return rows;
}

// Checks a scaled quantization (quantize_scaled) before anything is written; returns X's row count.
inline int64_t check_scaled(const StackedRows& x, int64_t rows_pad, int64_t cols_pad, ScaleMode mode,
                            const uint8_t* q, const float* scale, ScaleMode mode_t, const uint8_t* q_t,
                            const float* scale_t) {
  const int64_t rows = check_stacked_parts(x);
  COAT_CHECK_ARG(rows_pad >= rows && cols_pad >= x.cols,
                 "the padded shape [" + std::to_string(rows_pad) + ", " + std::to_string(cols_pad) +
                     "] must hold X [" + std::to_string(rows) + ", " + std::to_string(x.cols) + "]");
  // An output is asked for by its codes or its scales (an empty X still has row scales).
  const bool want_q = q != nullptr || scale != nullptr, want_t = q_t != nullptr || scale_t != nullptr;
  COAT_CHECK_ARG(want_q || want_t || rows_pad * cols_pad == 0, "q and q_t must not both be null");
  auto check_mode = [](ScaleMode m, const char* name) {
    COAT_CHECK_ARG(m == ScaleMode::kRow || m == ScaleMode::kVec128 || m == ScaleMode::kBlock128,
                   std::string(name) + " must be row, 1x128 or 128x128 scaling, got " + scale_mode_name(m) +
                       " (per-tensor scaling is quantize_stacked)");
  };
  if (want_q) {
    check_mode(mode, "mode");
    check_ptr(q, rows_pad * cols_pad, "q");
    check_ptr(scale, scale_count(mode, rows_pad, cols_pad), "scale");
  }
  if (want_t) {
    check_mode(mode_t, "mode_t");
    check_ptr(q_t, rows_pad * cols_pad, "q_t");
    check_ptr(scale_t, scale_count(mode_t, cols_pad, rows_pad), "scale_t");
  }
  return rows;
}

inline StackedRows one_part(const void* x, DType dtype, int64_t rows, int64_t cols) {
  StackedRows s;
  s.data[0] = x;
  s.rows[0] = rows;
  s.count = 1;
  s.cols = cols;
  s.dtype = dtype;
  return s;
}

COAT_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace detail
}  // namespace coat
