// The stacked matrix X (quantize.h StackedRows) as the quantize kernels read it on the device.
#pragma once

#include "coat/quantize.h"
#include "common/cuda_utils.cuh"

namespace coat {

// The stacked matrix as the quantize kernels read it: part p holds the flat elements
// [first[p], first[p + 1]) of X. One part is a plain tensor; the lookup then costs one compare.
template <typename T>
struct Stack {
  const T* x[kMaxStackParts];
  int64_t first[kMaxStackParts + 1];  // flat element offsets
  int64_t row0[kMaxStackParts + 1];   // row offsets
  int count;
  int64_t cols;

  // Unrolled with constant indices: a dynamically indexed kernel parameter would be copied to
  // local memory (a 128-byte stack frame per thread), which made these kernels 2-3x slower.
  __device__ __forceinline__ const T* elem(int64_t i) const {
    const T* base = x[0];
    int64_t off = i;
#pragma unroll
    for (int p = 1; p < kMaxStackParts; ++p) {
      if (p < count && i >= first[p]) {
        base = x[p];
        off = i - first[p];
      }
    }
    return base + off;
  }
  __device__ __forceinline__ const T* row(int64_t r) const {
    const T* base = x[0];
    int64_t off = r;
#pragma unroll
    for (int p = 1; p < kMaxStackParts; ++p) {
      if (p < count && r >= row0[p]) {
        base = x[p];
        off = r - row0[p];
      }
    }
    return base + off * cols;
  }
};

// The device view of x; *vec_parts: every part 16-byte aligned, no 8-element chunk across parts.
template <typename T>
inline Stack<T> stack_of(const StackedRows& x, bool* vec_parts) {
  Stack<T> s{};
  s.count = x.count;
  s.cols = x.cols;
  bool vec = true;
  for (int p = 0; p < x.count; ++p) {
    s.x[p] = static_cast<const T*>(x.data[p]);
    s.first[p + 1] = s.first[p] + x.rows[p] * x.cols;
    s.row0[p + 1] = s.row0[p] + x.rows[p];
    vec = vec && cuda::aligned(x.data[p], 16);
    // A chunk of 8 must not straddle two parts (a single part may end in a scalar tail).
    if (p + 1 < x.count) vec = vec && (x.rows[p] * x.cols) % 8 == 0;
  }
  *vec_parts = vec;
  return s;
}

}  // namespace coat
