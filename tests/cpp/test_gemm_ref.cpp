// CPU reference of the FP8 GEMM against a naive double-precision product on odd shapes, the
// output types, epilogues (bias, amax, FP8 output) and argument errors.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <stdexcept>
#include <vector>

#include "coat/gemm.h"
#include "common/fp8.h"

namespace coat {
namespace {

struct Problem {
  int64_t m, n, k;
  Fp8Format fa, fb;
  std::vector<uint8_t> a, b;
  std::vector<uint16_t> bias;
  float sa, sb;
};

Problem make(int64_t m, int64_t n, int64_t k, Fp8Format fa, Fp8Format fb, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  Problem p{m, n, k, fa, fb, {}, {}, {}, 0.37f, 1.9f};
  p.a.resize(static_cast<size_t>(m * k));
  p.b.resize(static_cast<size_t>(n * k));
  // Values spread over several binades, encoded with coat's own rounding.
  for (auto& c : p.a) c = host_encode_fp8(nd(rng) * 40.0f, fa);
  for (auto& c : p.b) c = host_encode_fp8(nd(rng) * 40.0f, fb);
  p.bias.resize(static_cast<size_t>(n));
  for (auto& c : p.bias) c = host_float_to_bf16(nd(rng) * 100.0f);
  return p;
}

// Exact-ish product in double, and the sum of |terms| that bounds the fp32 rounding error.
void naive(const Problem& p, bool with_bias, std::vector<double>& y, std::vector<double>& mag) {
  y.assign(static_cast<size_t>(p.m * p.n), 0.0);
  mag.assign(y.size(), 0.0);
  const double alpha = static_cast<double>(p.sa * p.sb);
  for (int64_t i = 0; i < p.m; ++i)
    for (int64_t j = 0; j < p.n; ++j) {
      double s = 0, g = 0;
      for (int64_t t = 0; t < p.k; ++t) {
        const double x = static_cast<double>(decode_fp8(p.a[i * p.k + t], p.fa)) *
                         decode_fp8(p.b[j * p.k + t], p.fb);
        s += x;
        g += std::fabs(x);
      }
      const double bv = with_bias ? host_bf16_to_float(p.bias[j]) : 0.0;
      y[i * p.n + j] = s * alpha + bv;
      mag[i * p.n + j] = g * std::fabs(alpha) + std::fabs(bv);
    }
}

Fp8GemmArgs args_of(const Problem& p) {
  Fp8GemmArgs g;
  g.m = p.m; g.n = p.n; g.k = p.k;
  g.a = p.a.data(); g.a_fmt = p.fa; g.a_scale = &p.sa;
  g.b = p.b.data(); g.b_fmt = p.fb; g.b_scale = &p.sb;
  return g;
}

struct Shape { int64_t m, n, k; };
// The CTest name of each case (gtest_discover_tests prints the parameter): m3_n5_k7, not its bytes.
void PrintTo(const Shape& s, std::ostream* os) { *os << "m" << s.m << "_n" << s.n << "_k" << s.k; }

class GemmRefShapes : public ::testing::TestWithParam<Shape> {};

// fp32 output: error bounded by fp32 accumulation, (K + 4) * 2^-23 * sum |terms|.
TEST_P(GemmRefShapes, Fp32MatchesDouble) {
  const Shape s = GetParam();
  for (auto fmts : {std::pair{Fp8Format::kE4M3, Fp8Format::kE4M3},
                    std::pair{Fp8Format::kE5M2, Fp8Format::kE4M3},
                    std::pair{Fp8Format::kE4M3, Fp8Format::kE5M2}}) {
    const Problem p = make(s.m, s.n, s.k, fmts.first, fmts.second, 7u + static_cast<uint32_t>(s.k));
    std::vector<float> out(static_cast<size_t>(s.m * s.n), -1.0f);
    float amax = -1.0f;
    Fp8GemmArgs g = args_of(p);
    g.out = out.data();
    g.out_type = GemmOut::kFloat32;
    g.amax = &amax;
    ref::gemm_fp8(g);
    std::vector<double> y, mag;
    naive(p, false, y, mag);
    double want_amax = 0;
    for (size_t i = 0; i < y.size(); ++i) {
      const double tol = static_cast<double>(s.k + 4) * std::ldexp(1.0, -23) * mag[i] + 1e-30;
      ASSERT_NEAR(out[i], y[i], tol) << "at " << i;
      want_amax = std::max(want_amax, std::fabs(static_cast<double>(out[i])));
    }
    EXPECT_EQ(amax, static_cast<float>(want_amax));
  }
}

// The blocking never changes the summation order: each output is the sequential fp32 sum over k.
TEST_P(GemmRefShapes, Fp32IsSequentialSum) {
  const Shape s = GetParam();
  const Problem p = make(s.m, s.n, s.k, Fp8Format::kE4M3, Fp8Format::kE5M2, 11u);
  std::vector<float> out(static_cast<size_t>(s.m * s.n));
  Fp8GemmArgs g = args_of(p);
  g.out = out.data();
  g.out_type = GemmOut::kFloat32;
  ref::gemm_fp8(g);
  const float alpha = p.sa * p.sb;
  for (int64_t i = 0; i < s.m; ++i)
    for (int64_t j = 0; j < s.n; ++j) {
      float acc = 0.0f;
      for (int64_t t = 0; t < s.k; ++t) {
        const float prod = decode_fp8(p.a[i * s.k + t], p.fa) * decode_fp8(p.b[j * s.k + t], p.fb);
        acc += prod;
      }
      ASSERT_EQ(out[i * s.n + j], acc * alpha) << "at (" << i << ", " << j << ")";
    }
}

// bf16 output with bias: exactly the bf16 rounding of the fp32 result plus bias computed the same
// way, and within bf16 rounding of the double product.
TEST_P(GemmRefShapes, Bf16WithBias) {
  const Shape s = GetParam();
  const Problem p = make(s.m, s.n, s.k, Fp8Format::kE4M3, Fp8Format::kE4M3, 99u);
  std::vector<uint16_t> out(static_cast<size_t>(s.m * s.n), 0xFFFF);
  Fp8GemmArgs g = args_of(p);
  g.out = out.data();
  g.out_type = GemmOut::kBFloat16;
  g.bias = p.bias.data();
  ref::gemm_fp8(g);
  std::vector<double> y, mag;
  naive(p, true, y, mag);
  for (size_t i = 0; i < y.size(); ++i) {
    const double v = host_bf16_to_float(out[i]);
    const double tol = std::ldexp(std::fabs(y[i]), -8) +
                       static_cast<double>(s.k + 6) * std::ldexp(1.0, -23) * mag[i] + 1e-30;
    ASSERT_NEAR(v, y[i], tol) << "at " << i;
  }
}

// E4M3 output: the codes are e4m3(v / out_scale) of the fp32 result, bit for bit.
TEST_P(GemmRefShapes, Fp8OutputCodes) {
  const Shape s = GetParam();
  const Problem p = make(s.m, s.n, s.k, Fp8Format::kE5M2, Fp8Format::kE4M3, 5u);
  std::vector<float> f(static_cast<size_t>(s.m * s.n));
  Fp8GemmArgs g = args_of(p);
  g.out = f.data();
  g.out_type = GemmOut::kFloat32;
  ref::gemm_fp8(g);
  std::vector<uint8_t> q(f.size(), 0x55);
  const float out_scale = 3.0f;
  float amax = -1;
  g.out = q.data();
  g.out_type = GemmOut::kE4M3;
  g.out_scale = &out_scale;
  g.amax = &amax;
  ref::gemm_fp8(g);
  float want = 0;
  for (size_t i = 0; i < f.size(); ++i) {
    ASSERT_EQ(q[i], host_encode_fp8(f[i] * (1.0f / out_scale), Fp8Format::kE4M3)) << "at " << i;
    want = std::max(want, std::fabs(f[i]));
  }
  EXPECT_EQ(amax, want);
}

INSTANTIATE_TEST_SUITE_P(Odd, GemmRefShapes,
                         ::testing::Values(Shape{1, 1, 1}, Shape{3, 5, 7}, Shape{2, 9, 16},
                                           Shape{17, 33, 130}, Shape{70, 67, 300},
                                           Shape{65, 131, 257}, Shape{1, 200, 520}));

TEST(GemmRef, EmptyAndZeroK) {
  Problem p = make(3, 4, 0, Fp8Format::kE4M3, Fp8Format::kE4M3, 1u);
  std::vector<uint16_t> out(12, 0xFFFF);
  float amax = -1;
  Fp8GemmArgs g = args_of(p);
  g.out = out.data();
  g.out_type = GemmOut::kBFloat16;
  g.bias = p.bias.data();
  g.amax = &amax;
  ref::gemm_fp8(g);  // K = 0: Y = bias
  float want = 0;
  for (int64_t i = 0; i < 3; ++i)
    for (int64_t j = 0; j < 4; ++j) {
      EXPECT_EQ(out[i * 4 + j], p.bias[j]);
      want = std::max(want, std::fabs(host_bf16_to_float(p.bias[j])));
    }
  EXPECT_EQ(amax, want);

  Problem e = make(0, 5, 16, Fp8Format::kE4M3, Fp8Format::kE4M3, 2u);
  g = args_of(e);
  g.out = nullptr;  // nothing to write
  g.out_type = GemmOut::kFloat32;
  amax = -1;
  g.amax = &amax;
  ref::gemm_fp8(g);
  EXPECT_EQ(amax, 0.0f);
}

// A NaN code gives NaN outputs in its row; amax ignores them.
TEST(GemmRef, NaNPropagatesAmaxIgnoresIt) {
  Problem p = make(2, 3, 5, Fp8Format::kE4M3, Fp8Format::kE4M3, 3u);
  p.a[0] = kFp8NaN;
  std::vector<float> out(6);
  float amax = -1;
  Fp8GemmArgs g = args_of(p);
  g.out = out.data();
  g.out_type = GemmOut::kFloat32;
  g.amax = &amax;
  ref::gemm_fp8(g);
  float want = 0;
  for (int j = 0; j < 3; ++j) EXPECT_TRUE(std::isnan(out[j]));
  for (int j = 3; j < 6; ++j) {
    EXPECT_FALSE(std::isnan(out[j]));
    want = std::max(want, std::fabs(out[j]));
  }
  EXPECT_EQ(amax, want);
}

TEST(GemmRef, BadArgumentsWriteNothing) {
  Problem p = make(2, 3, 4, Fp8Format::kE5M2, Fp8Format::kE5M2, 4u);
  std::vector<float> out(6, 42.0f);
  Fp8GemmArgs g = args_of(p);
  g.out = out.data();
  g.out_type = GemmOut::kFloat32;
  auto expect_invalid = [&](const Fp8GemmArgs& bad, const char* needle) {
    try {
      ref::gemm_fp8(bad);
      FAIL() << "expected std::invalid_argument mentioning " << needle;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    for (float v : out) ASSERT_EQ(v, 42.0f);
  };
  expect_invalid(g, "e5m2 x e5m2");
  g.b_fmt = Fp8Format::kE4M3;
  Fp8GemmArgs bad = g;
  bad.k = -1;
  expect_invalid(bad, "sizes");
  bad = g;
  bad.a_scale = nullptr;
  expect_invalid(bad, "scale_a");
  bad = g;
  bad.b = nullptr;
  expect_invalid(bad, "b must not be null");
  bad = g;
  bad.bias = p.bias.data();
  expect_invalid(bad, "bias needs");
  bad = g;
  bad.out_type = GemmOut::kE4M3;
  expect_invalid(bad, "out_scale is required");
  bad = g;
  const float s = 1.0f;
  bad.out_scale = &s;
  expect_invalid(bad, "out_scale is only used");
}

}  // namespace
}  // namespace coat
