// Rotary position embedding (RoPE) in the rotate-half convention of Llama, Mistral and Qwen, for
// the q and k heads of an attention layer, with the v heads copied alongside: one pass replaces
// the split, the RoPE arithmetic (about ten elementwise ops) and the copies that make q, k and v
// contiguous for attention; its backward writes the gradient of the fused QKV output directly.
//
// Layout: token m (of `tokens`) holds, for each of q, k and v, `heads` x `dim` elements at
// src + m * src_stride (row strides in elements, so q, k and v can be column slices of one fused
// [tokens, (hq + 2 hk) dim] projection output); outputs have their own row strides the same way.
// cos and sin are [cs_rows, dim] row-major, cs_rows == tokens or cs_rows dividing tokens (the rows
// of one sequence shared by every sequence of the batch: row m % cs_rows). dim is even.
//
// Numerics, with h = dim / 2, in fp32 and rounded once to the tensor dtype:
//   forward   y[j]   = x[j] c[j]     - x[j+h] s[j]        (x cos + rotate_half(x) sin)
//             y[j+h] = x[j+h] c[j+h] + x[j] s[j+h]
//   backward  dx[j]   = dy[j] c[j]     + dy[j+h] s[j+h]   (the transpose of the forward map)
//             dx[j+h] = dy[j+h] c[j+h] - dy[j] s[j]
// each as fma(a, b, +-(c d)) with the product c d rounded to fp32 first, on host and device alike,
// so the CPU reference and the kernel agree bit for bit. v is copied unchanged.
#pragma once

#include <cstdint>

#include "coat/common.h"

namespace coat {

struct RopeHeads {
  const void* src = nullptr;  // [tokens, heads, dim] rows at src + m * src_stride
  int64_t src_stride = 0;
  void* dst = nullptr;        // same layout at dst + m * dst_stride
  int64_t dst_stride = 0;
  int64_t heads = 0;
};

struct RopeArgs {
  int64_t tokens = 0;
  int64_t dim = 0;
  DType dtype = DType::kBFloat16;  // of every src, dst, cos and sin
  RopeHeads q, k, v;               // v.heads == 0 (or v.src == null): no copy
  const void* cos = nullptr;
  const void* sin = nullptr;
  int64_t cs_rows = 0;
  bool backward = false;  // apply the transpose (the gradient map) instead of the rotation
};

void rope_apply(const RopeArgs& args, cudaStream_t stream);

namespace ref {
void rope_apply(const RopeArgs& args);
}  // namespace ref

}  // namespace coat
