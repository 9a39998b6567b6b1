// Argument checks and the per-pair arithmetic shared by the CPU reference and the CUDA kernel.
#pragma once

#include <cmath>
#include <string>

#include "coat/rope.h"

namespace coat {
namespace detail {

inline void check_heads(const RopeHeads& h, int64_t tokens, int64_t dim, const char* name) {
  COAT_CHECK_ARG(h.heads >= 0, std::string(name) + ": heads must be >= 0");
  if (h.heads == 0 || tokens == 0) return;
  COAT_CHECK_ARG(h.src != nullptr && h.dst != nullptr, std::string(name) + ": source and output must not be null");
  COAT_CHECK_ARG(h.src_stride >= h.heads * dim && h.dst_stride >= h.heads * dim,
                 std::string(name) + ": row strides must hold heads x dim elements");
}

inline void check_rope(const RopeArgs& a) {
  COAT_CHECK_ARG(a.tokens >= 0, "tokens must be >= 0");
  COAT_CHECK_ARG(a.dim > 0 && a.dim % 2 == 0, "head_dim must be even and > 0, got " + std::to_string(a.dim));
  check_heads(a.q, a.tokens, a.dim, "q");
  check_heads(a.k, a.tokens, a.dim, "k");
  check_heads(a.v, a.tokens, a.dim, "v");
  COAT_CHECK_ARG((a.q.heads + a.k.heads + a.v.heads) * a.dim < (int64_t(1) << 31),
                 "heads x head_dim of one token must stay below 2^31 elements");
  if (a.tokens == 0) return;
  COAT_CHECK_ARG(a.cos != nullptr && a.sin != nullptr, "cos and sin must not be null");
  COAT_CHECK_ARG(a.cs_rows > 0 && a.tokens % a.cs_rows == 0,
                 "cos/sin must have one row per token or per position of one sequence (" +
                     std::to_string(a.cs_rows) + " rows for " + std::to_string(a.tokens) + " tokens)");
}

// One rotation pair: (x0, x1) at columns (j, j + dim/2) with (c0, s0), (c1, s1) the cos/sin there.
COAT_HD void rope_pair(float x0, float x1, float c0, float s0, float c1, float s1, bool backward,
                       float& y0, float& y1) {
  if (!backward) {
    const float t0 = x1 * s0, t1 = x0 * s1;
    y0 = fmaf(x0, c0, -t0);
    y1 = fmaf(x1, c1, t1);
  } else {
    const float t0 = x1 * s1, t1 = x0 * s0;
    y0 = fmaf(x0, c0, t0);
    y1 = fmaf(x1, c1, -t1);
  }
}

}  // namespace detail
}  // namespace coat
