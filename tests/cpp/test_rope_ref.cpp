// CPU reference of the rope family: a known rotation, the backward as its transpose, the v copy,
// shared cos/sin rows, and argument checks.
#include <gtest/gtest.h>

#include <cmath>
#include <stdexcept>
#include <vector>

#include "coat/rope.h"

using namespace coat;

namespace {

RopeArgs args_for(const std::vector<float>& x, std::vector<float>& y, const std::vector<float>& c,
                  const std::vector<float>& s, int64_t tokens, int64_t heads, int64_t dim, int64_t cs_rows) {
  RopeArgs a;
  a.tokens = tokens;
  a.dim = dim;
  a.dtype = DType::kFloat32;
  a.q = RopeHeads{x.data(), heads * dim, y.data(), heads * dim, heads};
  a.cos = c.data();
  a.sin = s.data();
  a.cs_rows = cs_rows;
  return a;
}

}  // namespace

TEST(Rope, RotatesPairsByTheAngle) {
  // dim 2: the pair (x0, x1) is rotated by theta (cos/sin duplicated across halves, as HF builds them).
  const float th = 0.3f;
  std::vector<float> x{1.0f, 2.0f}, y(2), c{std::cos(th), std::cos(th)}, s{std::sin(th), std::sin(th)};
  ref::rope_apply(args_for(x, y, c, s, 1, 1, 2, 1));
  EXPECT_FLOAT_EQ(y[0], 1.0f * std::cos(th) - 2.0f * std::sin(th));
  EXPECT_FLOAT_EQ(y[1], 2.0f * std::cos(th) + 1.0f * std::sin(th));
}

TEST(Rope, BackwardIsTheTransposeAndVIsCopied) {
  const int64_t tokens = 6, heads = 3, dim = 8, rows = 3;  // cos/sin rows shared by two sequences
  std::vector<float> x(tokens * heads * dim), g(x.size()), y(x.size()), dx(x.size()), c(rows * dim), s(rows * dim);
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = std::sin(0.7f * i + 0.1f);
    g[i] = std::cos(1.3f * i);
  }
  for (size_t i = 0; i < c.size(); ++i) {
    c[i] = std::cos(0.37f * i);
    s[i] = std::sin(0.37f * i);
  }
  RopeArgs f = args_for(x, y, c, s, tokens, heads, dim, rows);
  std::vector<float> vsrc(tokens * dim, 5.0f), vdst(tokens * dim, 0.0f);
  f.v = RopeHeads{vsrc.data(), dim, vdst.data(), dim, 1};
  ref::rope_apply(f);
  EXPECT_EQ(vdst, vsrc);
  RopeArgs b = args_for(g, dx, c, s, tokens, heads, dim, rows);
  b.backward = true;
  ref::rope_apply(b);
  double lhs = 0, rhs = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    lhs += double(y[i]) * g[i];
    rhs += double(x[i]) * dx[i];
  }
  EXPECT_NEAR(lhs, rhs, 1e-5 * std::fabs(lhs));
}

TEST(Rope, RejectsBadArguments) {
  std::vector<float> x(8), y(8), c(4), s(4);
  RopeArgs a = args_for(x, y, c, s, 2, 1, 3, 1);
  EXPECT_THROW(ref::rope_apply(a), std::invalid_argument);  // odd head_dim
  a = args_for(x, y, c, s, 2, 1, 4, 3);
  EXPECT_THROW(ref::rope_apply(a), std::invalid_argument);  // 3 cos rows for 2 tokens
  a = args_for(x, y, c, s, 2, 1, 4, 1);
  a.q.dst = nullptr;
  EXPECT_THROW(ref::rope_apply(a), std::invalid_argument);
}
