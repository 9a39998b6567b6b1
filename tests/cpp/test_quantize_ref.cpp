// CPU reference of the quantize family: semantics, edge cases and argument checks.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <stdexcept>
#include <vector>

#include "coat/quantize.h"
#include "common/dre.h"
#include "common/fp8.h"

#include "test_data.h"

using namespace coat;

namespace {

using coat_test::randn;

double rel_err(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / den);
}

}  // namespace

TEST(PerTensor, AmaxScaleAndCodes) {
  const int64_t rows = 7, cols = 33;
  auto x = randn(rows * cols, 1, 3.0f);
  x[5] = NAN;
  x[6] = INFINITY;
  std::vector<uint8_t> q(x.size()), qt(x.size());
  float amax = -1, scale = -1;
  ref::quantize_per_tensor_amax(x.data(), DType::kFloat32, rows, cols, Fp8Format::kE4M3, &amax,
                                &scale, q.data(), qt.data());
  float expect = 0;
  for (float v : x)
    if (std::isfinite(v)) expect = std::max(expect, std::fabs(v));
  EXPECT_EQ(amax, expect) << "amax ignores NaN and inf";
  EXPECT_EQ(scale, expect / 448.0f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t i = r * cols + c;
      EXPECT_EQ(q[i], encode_fp8(x[i] * (1.0f / scale), Fp8Format::kE4M3));
      EXPECT_EQ(qt[c * rows + r], q[i]);
    }
  EXPECT_EQ(q[5], kFp8NaN);
  EXPECT_EQ(q[6], 0x7E) << "inf saturates";
}

TEST(Stacked, MatchesPerTensorOfTheConcatenation) {
  // Parts of 5, 0 and 3 rows (a fused projection's weights) read where they lie.
  const int64_t cols = 17;
  const int64_t rows[3] = {5, 0, 3};
  std::vector<std::vector<float>> parts;
  std::vector<float> cat;
  StackedRows s;
  s.count = 3;
  s.cols = cols;
  s.dtype = DType::kFloat32;
  for (int p = 0; p < 3; ++p) {
    parts.push_back(randn(rows[p] * cols, 10 + p, 1.0f + p));
    cat.insert(cat.end(), parts.back().begin(), parts.back().end());
    s.data[p] = parts.back().data();
    s.rows[p] = rows[p];
  }
  const int64_t R = 8;
  std::vector<uint8_t> q(R * cols), qt(R * cols), rq(R * cols), rqt(R * cols), qt2(R * cols);
  float amax = -1, scale = -1, ramax = -1, rscale = -1;
  ref::quantize_stacked(s, Fp8Format::kE4M3, nullptr, &amax, &scale, q.data(), qt.data());
  ref::quantize_per_tensor_amax(cat.data(), DType::kFloat32, R, cols, Fp8Format::kE4M3, &ramax, &rscale,
                                rq.data(), rqt.data());
  EXPECT_EQ(amax, ramax);
  EXPECT_EQ(scale, rscale);
  EXPECT_EQ(q, rq);
  EXPECT_EQ(qt, rqt);
  // The backward's pass: transposed codes only, with the forward's scale.
  ref::quantize_stacked(s, Fp8Format::kE4M3, &scale, nullptr, nullptr, nullptr, qt2.data());
  EXPECT_EQ(qt2, rqt);
}

TEST(Stacked, RejectsBadArguments) {
  std::vector<float> x(8, 1.0f);
  std::vector<uint8_t> q(8);
  float scale = 1.0f, amax = 0.0f;
  StackedRows s;
  s.data[0] = x.data();
  s.rows[0] = 2;
  s.cols = 4;
  s.count = 0;
  EXPECT_THROW(ref::quantize_stacked(s, Fp8Format::kE4M3, &scale, nullptr, nullptr, q.data(), nullptr),
               std::invalid_argument);
  s.count = 1;
  EXPECT_THROW(ref::quantize_stacked(s, Fp8Format::kE4M3, &scale, nullptr, nullptr, nullptr, nullptr),
               std::invalid_argument);
  EXPECT_THROW(ref::quantize_stacked(s, Fp8Format::kE4M3, nullptr, &amax, nullptr, q.data(), nullptr),
               std::invalid_argument);
  EXPECT_THROW(ref::quantize_stacked(s, Fp8Format::kE4M3, nullptr, nullptr, nullptr, q.data(), nullptr),
               std::invalid_argument);
  s.rows[0] = -1;
  EXPECT_THROW(ref::quantize_stacked(s, Fp8Format::kE4M3, &scale, nullptr, nullptr, q.data(), nullptr),
               std::invalid_argument);
}

TEST(PerTensor, EmptyAndZeroTensors) {
  float amax = -1, scale = -1;
  ref::quantize_per_tensor_amax(nullptr, DType::kBFloat16, 0, 5, Fp8Format::kE5M2, &amax, &scale,
                                nullptr, nullptr);
  EXPECT_EQ(amax, 0.0f);
  EXPECT_EQ(scale, 1.0f);
  std::vector<float> z(16, 0.0f);
  std::vector<uint8_t> q(16, 0xAA);
  ref::quantize_per_tensor_amax(z.data(), DType::kFloat32, 1, 16, Fp8Format::kE4M3, &amax, &scale,
                                q.data(), nullptr);
  EXPECT_EQ(scale, 1.0f);
  for (auto c : q) EXPECT_EQ(c, 0);
}

// amax near fp32's smallest normal (or subnormal): the scale is floored at 2^-126, so 1 / scale is
// finite, zeros stay the zero code and the rest are not saturated NaN-adjacent codes.
TEST(PerTensor, TinyAmaxKeepsScaleFinite) {
  for (auto fmt : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    for (float tiny : {1e-37f, 1e-39f, 1.4e-45f}) {
      std::vector<float> x = {0.0f, tiny, -tiny, 0.5f * tiny};
      std::vector<uint8_t> q(4, 0xAA);
      float amax = -1, scale = -1;
      ref::quantize_per_tensor_amax(x.data(), DType::kFloat32, 1, 4, fmt, &amax, &scale, q.data(), nullptr);
      EXPECT_EQ(amax, tiny);
      EXPECT_EQ(scale, std::max(tiny / fp8_max(fmt), 1.17549435e-38f));
      EXPECT_TRUE(std::isfinite(1.0f / scale));
      EXPECT_EQ(q[0], 0) << "zero stays zero";
      for (auto c : q) EXPECT_NE(c & 0x7F, 0x7F) << "no NaN code";
      EXPECT_EQ(q[1] & 0x80, 0);
      EXPECT_EQ(q[2] & 0x80, 0x80);
      std::vector<float> s(1);
      std::vector<uint8_t> qg(16, 0xAA);
      std::vector<float> xg(16, 0.0f);
      xg[3] = tiny;
      ref::quantize_per_group(xg.data(), DType::kFloat32, 1, 16, 16, fmt, ScaleKind::kFloat32, s.data(), qg.data());
      EXPECT_TRUE(std::isfinite(1.0f / s[0]));
      for (int i = 0; i < 16; ++i) EXPECT_EQ(qg[i], i == 3 ? qg[3] : 0) << "group zeros stay zero";
    }
  }
}

TEST(PerTensor, DequantizeToBf16AndHalf) {
  std::vector<uint8_t> q(256);
  for (int i = 0; i < 256; ++i) q[i] = static_cast<uint8_t>(i);
  const float s = 0.5f;
  std::vector<uint16_t> yb(256), yh(256);
  ref::dequantize_per_tensor(q.data(), Fp8Format::kE4M3, 256, &s, yb.data(), DType::kBFloat16);
  ref::dequantize_per_tensor(q.data(), Fp8Format::kE4M3, 256, &s, yh.data(), DType::kFloat16);
  for (int i = 0; i < 256; ++i) {
    const float v = decode_fp8(q[i], Fp8Format::kE4M3) * s;
    if (std::isnan(v)) continue;
    EXPECT_EQ(host_bf16_to_float(yb[i]), v);  // FP8 values times 0.5 are exact in bf16 and fp16
    EXPECT_EQ(host_half_to_float(yh[i]), v);
  }
}

TEST(PerGroup, Fp32AndE8M0Scales) {
  const int64_t rows = 3, cols = 96;
  for (int group : {16, 32}) {
    auto x = randn(rows * cols, 2 + group, 10.0f);
    for (int64_t c = 0; c < 16; ++c) x[c] = 0.0f;  // an all-zero group gets scale 1
    std::vector<uint8_t> q(x.size()), qe(x.size()), se(x.size() / group);
    std::vector<float> s(x.size() / group);
    ref::quantize_per_group(x.data(), DType::kFloat32, rows, cols, group, Fp8Format::kE4M3,
                            ScaleKind::kFloat32, s.data(), q.data());
    ref::quantize_per_group(x.data(), DType::kFloat32, rows, cols, group, Fp8Format::kE4M3,
                            ScaleKind::kE8M0, se.data(), qe.data());
    for (size_t g = 0; g < s.size(); ++g) {
      float amax = 0;
      for (int i = 0; i < group; ++i) amax = std::max(amax, std::fabs(x[g * group + i]));
      EXPECT_EQ(s[g], amax > 0 ? amax / 448.0f : 1.0f);
      const float p2 = e8m0_to_float(se[g]);
      if (amax > 0) {
        EXPECT_GE(p2 * 448.0f, amax) << "E8M0 scale never saturates the group max";
        EXPECT_LT(p2 * 0.5f * 448.0f, amax) << "and is the smallest such power of two";
      }
    }
    std::vector<float> y(x.size());
    ref::dequantize_per_group(q.data(), Fp8Format::kE4M3, rows, cols, group, ScaleKind::kFloat32,
                              s.data(), y.data(), DType::kFloat32);
    EXPECT_LT(rel_err(y, x), 0.04);
  }
}

TEST(PerGroup, RejectsBadGroups) {
  std::vector<float> x(48);
  std::vector<uint8_t> q(48);
  std::vector<float> s(3);
  EXPECT_THROW(ref::quantize_per_group(x.data(), DType::kFloat32, 1, 48, 32, Fp8Format::kE4M3,
                                       ScaleKind::kFloat32, s.data(), q.data()),
               std::invalid_argument);
  EXPECT_THROW(ref::quantize_per_group(x.data(), DType::kFloat32, 1, 48, 24, Fp8Format::kE4M3,
                                       ScaleKind::kFloat32, s.data(), q.data()),
               std::invalid_argument);
  EXPECT_THROW(ref::quantize_per_tensor(x.data(), DType::kFloat32, -1, 4, Fp8Format::kE4M3,
                                        s.data(), q.data(), nullptr),
               std::invalid_argument);
}

TEST(Dre, ZerosConstantsAndMaximaAreExact) {
  const int64_t n = 3 * 128 + 50;  // partial last group
  auto x = randn(n, 7, 1e-3f);
  x[0] = 0.0f;  // a zero first element must not enter the minimum (NVlabs COAT's defect)
  for (int i = 128; i < 256; ++i) x[i] = (i % 3 == 0) ? 0.0f : ((i % 2) ? -0.37f : 0.37f);
  for (int i = 256; i < 384; ++i) x[i] = 0.0f;
  std::vector<uint8_t> q(n), k(4);
  std::vector<float> gmax(4), y(n);
  ref::dre_quantize(x.data(), n, Fp8Format::kE4M3, kDreLog2RangeE4M3, q.data(), gmax.data(), k.data());
  ref::dre_dequantize(q.data(), gmax.data(), k.data(), n, Fp8Format::kE4M3, y.data());
  for (int64_t i = 0; i < n; ++i) {
    if (x[i] == 0.0f) EXPECT_EQ(y[i], 0.0f);
    if (std::fabs(x[i]) == gmax[i / 128]) EXPECT_EQ(y[i], x[i]) << "the group max decodes exactly";
    if (i >= 128 && i < 256) EXPECT_EQ(y[i], x[i]) << "constant-magnitude group is exact";
  }
  EXPECT_GT(k[0], kDreUnitK16) << "a zero in the group must not collapse k";
  for (int g = 0; g < 4; ++g) {
    EXPECT_GE(k[g], kDreMinK16);
    EXPECT_LE(k[g], kDreMaxK16);
  }
}

TEST(Dre, NoNonFiniteFromFiniteInput) {
  std::mt19937 rng(3);
  std::uniform_int_distribution<uint32_t> bits(0, 0x7F7FFFFFu);  // any finite magnitude
  const int64_t n = 128 * 64;
  std::vector<float> x(n);
  for (auto& v : x) v = float_of(bits(rng) | ((rng() & 1u) << 31));
  for (auto fmt : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    std::vector<uint8_t> q(n), k(64);
    std::vector<float> gmax(64), y(n);
    ref::dre_quantize(x.data(), n, fmt, dre_default_log2_range(fmt), q.data(), gmax.data(), k.data());
    ref::dre_dequantize(q.data(), gmax.data(), k.data(), n, fmt, y.data());
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_TRUE(std::isfinite(y[i])) << x[i];
      ASSERT_EQ(std::signbit(y[i]) && y[i] != 0.0f, std::signbit(x[i]) && y[i] != 0.0f);
    }
  }
}

TEST(Dre, BeatsPlainGroupQuantizationOnNarrowGroups) {
  // Adam's first moment: values within a group span a modest range, where expansion helps.
  const int64_t n = 128 * 256;
  auto x = randn(n, 11, 1e-4f);
  std::vector<uint8_t> q(n), k(256), qp(n);
  std::vector<float> gmax(256), y(n), s(256), yp(n);
  ref::dre_quantize(x.data(), n, Fp8Format::kE4M3, kDreLog2RangeE4M3, q.data(), gmax.data(), k.data());
  ref::dre_dequantize(q.data(), gmax.data(), k.data(), n, Fp8Format::kE4M3, y.data());
  ref::quantize_per_group(x.data(), DType::kFloat32, 1, n, 128, Fp8Format::kE4M3, ScaleKind::kFloat32,
                          s.data(), qp.data());
  ref::dequantize_per_group(qp.data(), Fp8Format::kE4M3, 1, n, 128, ScaleKind::kFloat32, s.data(),
                            yp.data(), DType::kFloat32);
  EXPECT_LT(rel_err(y, x), 0.8 * rel_err(yp, x));
}

// The bound on |decoded / x - 1| of one element: half the FP8 quantum at y = top (|x|/mx)^k,
// relative to y, either way, through the k-th root that decoding takes, plus fp32 slack. top is
// fmt_max, or the second-largest code for the others of a split group, whose max is kept to 15
// bits.
double dre_bound(float x, float word, int k16, Fp8Format fmt) {
  const DreTop t = dre_top(word, fmt);
  if (std::fabs(x) >= t.out) return std::ldexp(1.0, -15);
  const double k = k16 / 16.0, fmax = (fmt == Fp8Format::kE4M3 ? 448.0 : 57344.0) / std::exp2(t.off);
  const int mant = fmt == Fp8Format::kE4M3 ? 3 : 2, emin = fmt == Fp8Format::kE4M3 ? -6 : -14;
  const double y = fmax * std::pow(std::fabs(x) / t.mx, k);
  const double quantum = std::ldexp(1.0, std::max(static_cast<int>(std::floor(std::log2(y))), emin) - mant);
  const double e = 0.5 * quantum / y;
  if (e >= 1.0) return std::pow(quantum / y, 1.0 / k) - 1.0 + 1e-4;  // lifted to the smallest code
  return std::max(std::pow(1.0 + e, 1.0 / k) - 1.0, 1.0 - std::pow(1.0 - e, 1.0 / k)) + 1e-4;
}

// Groups wider than the format (an outlier beside small values, geometric spans up to 2^60): no
// non-zero value is stored as the zero code or decodes to zero, and every element keeps the
// accuracy its exponent allows (compression, k < 1, puts the smallest value in the normal range).
TEST(Dre, WideGroupsKeepEveryValue) {
  std::mt19937 rng(5);
  for (auto fmt : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    for (float range : {dre_default_log2_range(fmt), 0.0f}) {
      for (int span = 8; span <= 60; span += 4) {
        std::vector<float> x(256);
        for (int i = 0; i < 128; ++i)  // geometric: 2^0 .. 2^span
          x[i] = std::exp2(span * i / 127.0f) * ((rng() & 1) ? -1.0f : 1.0f);
        std::normal_distribution<float> nd(0.0f, 1.0f);
        for (int i = 128; i < 256; ++i) x[i] = nd(rng) * 1e-3f;  // a single outlier 2^span larger
        x[128 + 77] = 1e-3f * std::exp2(static_cast<float>(span));
        std::vector<uint8_t> q(256), k(2);
        std::vector<float> gmax(2), y(256);
        ref::dre_quantize(x.data(), 256, fmt, range, q.data(), gmax.data(), k.data());
        ref::dre_dequantize(q.data(), gmax.data(), k.data(), 256, fmt, y.data());
        for (int i = 0; i < 256; ++i) {
          ASSERT_NE(q[i] & 0x7F, 0) << "span 2^" << span << " element " << i << " stored as zero";
          ASSERT_EQ(std::signbit(y[i]), std::signbit(x[i]));
          const double err = std::fabs(y[i] / x[i] - 1.0);
          ASSERT_LE(err, dre_bound(x[i], gmax[i / 128], k[i / 128], fmt))
              << "fmt " << int(fmt) << " range " << range << " span 2^" << span << " element " << i
              << " k16 " << int(k[i / 128]);
        }
        if (span > (fmt == Fp8Format::kE4M3 ? 17 : 30)) EXPECT_LT(k[0], kDreUnitK16) << "compressed";
        // The single outlier is kept apart: its group is split, and the others keep their own scale
        // (expanded where expansion is on, never compressed).
        EXPECT_TRUE(std::signbit(gmax[1])) << "span 2^" << span << ": the outlier's group is split";
        EXPECT_GE(k[1], range > 0.0f ? kDreUnitK16 + 1 : kDreUnitK16) << "span 2^" << span;
      }
    }
  }
}

// A split group: the outlier decodes to 15 bits, the others as a group of their own (the same codes
// as the group without the outlier would have, up to the one code the split reserves), and a
// moderate maximum leaves the group whole.
TEST(Dre, SplitGroupsKeepTheOutlierApart) {
  for (auto fmt : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    auto x = randn(256, 9, 1e-3f);
    x[3] = -7.25e5f;      // group 0: an outlier ~1e9 times the rest
    x[128 + 3] = 0.01f;   // group 1: a max ~ 4x the rest's (|randn| reaches ~3e-3): whole
    std::vector<uint8_t> q(256), k(2);
    std::vector<float> gmax(2), y(256);
    ref::dre_quantize(x.data(), 256, fmt, dre_default_log2_range(fmt), q.data(), gmax.data(), k.data());
    ref::dre_dequantize(q.data(), gmax.data(), k.data(), 256, fmt, y.data());
    ASSERT_TRUE(std::signbit(gmax[0]));
    ASSERT_FALSE(std::signbit(gmax[1]));
    EXPECT_LE(std::fabs(y[3] / x[3] - 1.0), std::ldexp(1.0, -15));
    EXPECT_EQ(q[3], 0x80 | (fmt == Fp8Format::kE4M3 ? 0x7E : 0x7B));
    const DreTop t = dre_top(gmax[0], fmt);
    float mx2 = 0.0f;
    for (int i = 0; i < 128; ++i)
      if (i != 3) mx2 = std::max(mx2, std::fabs(x[i]));
    EXPECT_GE(t.mx, mx2);
    EXPECT_LT(t.mx, mx2 * 1.4143f) << "the others' scale is within half an octave of their max";
    for (int i = 0; i < 256; ++i) {
      if (i < 128 && i != 3) EXPECT_NE(q[i] & 0x7F, fmt == Fp8Format::kE4M3 ? 0x7E : 0x7B) << "only the outlier is top";
      ASSERT_LE(std::fabs(y[i] / x[i] - 1.0), dre_bound(x[i], gmax[i / 128], k[i / 128], fmt)) << i;
    }
    // Elements tied for the max are all kept apart (and exact: 1.0 has 15 bits).
    std::vector<float> z(128, 1e-3f);
    z[5] = z[9] = 1.0f;
    ref::dre_quantize(z.data(), 128, fmt, dre_default_log2_range(fmt), q.data(), gmax.data(), k.data());
    ref::dre_dequantize(q.data(), gmax.data(), k.data(), 128, fmt, y.data());
    EXPECT_TRUE(std::signbit(gmax[0]));
    for (int i = 0; i < 128; ++i) {
      if (i == 5 || i == 9) EXPECT_EQ(y[i], 1.0f);
      else ASSERT_LE(std::fabs(y[i] / z[i] - 1.0), dre_bound(z[i], gmax[0], k[0], fmt)) << i;
    }
  }
}

TEST(Dre, RejectsBadArguments) {
  std::vector<float> x(10);
  std::vector<uint8_t> q(10), k(1);
  std::vector<float> g(1);
  EXPECT_THROW(ref::dre_quantize(x.data(), 10, Fp8Format::kE4M3, -1.0f, q.data(), g.data(), k.data()),
               std::invalid_argument);
  EXPECT_THROW(ref::dre_quantize(x.data(), 10, Fp8Format::kE4M3, 8.0f, nullptr, g.data(), k.data()),
               std::invalid_argument);
}
