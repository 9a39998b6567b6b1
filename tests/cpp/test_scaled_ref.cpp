// Row and block scaling in the C++ core: the scale layouts cuBLASLt reads (counts, grid indices,
// padding entries), the scaled quantizer's CPU reference on a small matrix worked out by hand, the
// GEMM reference in each scale mode against a double-precision product of the dequantized operands,
// and the argument errors.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <stdexcept>
#include <vector>

#include "coat/gemm.h"
#include "coat/quantize.h"
#include "common/fp8.h"
#include "common/scale_grid.h"

namespace coat {
namespace {

StackedRows one(const std::vector<float>& x, int64_t rows, int64_t cols) {
  StackedRows s;
  s.data[0] = x.data();
  s.rows[0] = rows;
  s.count = 1;
  s.cols = cols;
  s.dtype = DType::kFloat32;
  return s;
}

TEST(ScaledLayout, CountsAndIndicesAreCublasLts) {
  EXPECT_EQ(scale_count(ScaleMode::kTensor, 300, 640), 1);
  EXPECT_EQ(scale_count(ScaleMode::kRow, 300, 640), 300);
  EXPECT_EQ(scale_count(ScaleMode::kVec128, 300, 640), 5 * 300);
  EXPECT_EQ(scale_count(ScaleMode::kBlock128, 300, 640), 3 * 8);  // round_up(5, 4) per 128 rows
  // 1x128: [K/128][rows], rows fastest; as q_t (K = X's rows): [R/128][cols].
  EXPECT_EQ(scale_grid(ScaleMode::kVec128, false, 300, 640).index(7, 300), 2 * 300 + 7);
  EXPECT_EQ(scale_grid(ScaleMode::kVec128, true, 300, 640).index(130, 9), 1 * 640 + 9);
  // 128x128: [rows/128][round_up(K/128, 4)]; as q_t: [cols/128][round_up(R/128, 4)].
  EXPECT_EQ(scale_grid(ScaleMode::kBlock128, false, 300, 640).index(260, 513), 2 * 8 + 4);
  EXPECT_EQ(scale_grid(ScaleMode::kBlock128, true, 300, 640).index(260, 513), 4 * 4 + 2);
  EXPECT_EQ(scale_grid(ScaleMode::kRow, true, 300, 640).index(299, 17), 17);
}

TEST(ScaledRef, GroupsByHand) {
  // X [2, 256]: row 0 holds 1.0 everywhere and one 896.0 in its second 128-group; row 1 is zero.
  std::vector<float> x(512, 0.0f);
  for (int c = 0; c < 256; ++c) x[c] = 1.0f;
  x[200] = 896.0f;
  std::vector<uint8_t> q(512), qt(512);
  std::vector<float> s(scale_count(ScaleMode::kVec128, 2, 256)), st(scale_count(ScaleMode::kRow, 256, 2));
  ref::quantize_scaled(one(x, 2, 256), 2, 256, Fp8Format::kE4M3, ScaleMode::kVec128, q.data(), s.data(),
                       ScaleMode::kRow, qt.data(), st.data());
  // [K/128][rows]: (row 0, g0) = 1/448, (row 1, g0) = 1 (zero group), (row 0, g1) = 2, (row 1, g1) = 1.
  EXPECT_EQ(s[0], 1.0f / 448.0f);
  EXPECT_EQ(s[1], 1.0f);
  EXPECT_EQ(s[2], 2.0f);
  EXPECT_EQ(s[3], 1.0f);
  EXPECT_EQ(decode_fp8(q[0], Fp8Format::kE4M3), 448.0f);    // 1.0 / (1/448)
  EXPECT_EQ(decode_fp8(q[130], Fp8Format::kE4M3), 0.5f);    // 1.0 / 2: the outlier's group only
  EXPECT_EQ(decode_fp8(q[200], Fp8Format::kE4M3), 448.0f);
  EXPECT_EQ(q[256 + 5], 0);
  // q_t per row of X^T (per column of X): column 200's scale is 896/448, the others 1/448.
  EXPECT_EQ(st[200], 2.0f);
  EXPECT_EQ(st[3], 1.0f / 448.0f);
  EXPECT_EQ(decode_fp8(qt[3 * 2 + 0], Fp8Format::kE4M3), 448.0f);
  EXPECT_EQ(qt[3 * 2 + 1], 0);
}

TEST(ScaledRef, PaddingIsZerosAndBlockPaddingEntriesAreOne) {
  std::vector<float> x(5 * 20, 3.0f);
  std::vector<uint8_t> q(16 * 32);
  std::vector<float> s(scale_count(ScaleMode::kBlock128, 16, 32));
  ASSERT_EQ(s.size(), 4u);
  ref::quantize_scaled(one(x, 5, 20), 16, 32, Fp8Format::kE4M3, ScaleMode::kBlock128, q.data(), s.data(),
                       ScaleMode::kRow, nullptr, nullptr);
  EXPECT_EQ(s[0], 3.0f / 448.0f);
  EXPECT_EQ(s[1], 1.0f);
  EXPECT_EQ(s[3], 1.0f);
  EXPECT_EQ(decode_fp8(q[4 * 32 + 19], Fp8Format::kE4M3), 448.0f);
  EXPECT_EQ(q[4 * 32 + 20], 0);
  EXPECT_EQ(q[5 * 32], 0);
}

double deq(const std::vector<uint8_t>& q, const std::vector<float>& s, ScaleMode m, int64_t rows, int64_t k,
           int64_t r, int64_t c) {
  const ScaleGrid g = scale_grid(m, false, rows, k);
  return static_cast<double>(decode_fp8(q[r * k + c], Fp8Format::kE4M3)) * s[g.index(r, c)];
}

TEST(ScaledRef, GemmIsTheDequantizedProductInEveryPair) {
  const int64_t m = 24, n = 40, k = 200;
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> a(m * k), b(n * k);
  for (auto& v : a) v = nd(rng) * std::exp2(static_cast<float>(static_cast<int>(rng() % 12)) - 6.0f);
  for (auto& v : b) v = nd(rng);
  const ScaleMode pairs[][2] = {{ScaleMode::kRow, ScaleMode::kRow},
                                {ScaleMode::kVec128, ScaleMode::kBlock128},
                                {ScaleMode::kVec128, ScaleMode::kVec128},
                                {ScaleMode::kBlock128, ScaleMode::kVec128}};
  for (const auto& pr : pairs) {
    std::vector<uint8_t> qa(m * k), qb(n * k);
    std::vector<float> sa(scale_count(pr[0], m, k)), sb(scale_count(pr[1], n, k)), out(m * n);
    ref::quantize_scaled(one(a, m, k), m, k, Fp8Format::kE4M3, pr[0], qa.data(), sa.data(), ScaleMode::kRow, nullptr,
                         nullptr);
    ref::quantize_scaled(one(b, n, k), n, k, Fp8Format::kE4M3, pr[1], qb.data(), sb.data(), ScaleMode::kRow, nullptr,
                         nullptr);
    Fp8GemmArgs g;
    g.m = m, g.n = n, g.k = k;
    g.a = qa.data(), g.a_scale = sa.data(), g.b = qb.data(), g.b_scale = sb.data();
    g.a_mode = pr[0], g.b_mode = pr[1];
    g.out = out.data(), g.out_type = GemmOut::kFloat32;
    ref::gemm_fp8(g);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double want = 0.0, mag = 0.0;
        for (int64_t t = 0; t < k; ++t) {
          const double p = deq(qa, sa, pr[0], m, k, i, t) * deq(qb, sb, pr[1], n, k, j, t);
          want += p, mag += std::fabs(p);
        }
        ASSERT_LE(std::fabs(out[i * n + j] - want), 1e-5 * mag + 1e-30) << scale_mode_name(pr[0]) << " " << i << "," << j;
      }
  }
}

TEST(ScaledRef, ArgumentErrors) {
  std::vector<float> x(64, 1.0f), s(64);
  std::vector<uint8_t> q(64);
  EXPECT_THROW(ref::quantize_scaled(one(x, 4, 16), 4, 16, Fp8Format::kE4M3, ScaleMode::kTensor, q.data(), s.data(),
                                    ScaleMode::kRow, nullptr, nullptr),
               std::invalid_argument);
  EXPECT_THROW(ref::quantize_scaled(one(x, 4, 16), 2, 16, Fp8Format::kE4M3, ScaleMode::kRow, q.data(), s.data(),
                                    ScaleMode::kRow, nullptr, nullptr),
               std::invalid_argument);
  Fp8GemmArgs g;
  g.m = 4, g.n = 4, g.k = 16;
  g.a = q.data(), g.b = q.data(), g.a_scale = s.data(), g.b_scale = s.data(), g.out = s.data();
  g.out_type = GemmOut::kFloat32;
  g.a_mode = g.b_mode = ScaleMode::kBlock128;
  EXPECT_THROW(ref::gemm_fp8(g), std::invalid_argument);  // no 128x128 x 128x128 kernel
  g.a_mode = ScaleMode::kVec128;
  g.fast_accum = true;
  EXPECT_THROW(ref::gemm_fp8(g), std::invalid_argument);  // block GEMMs accumulate in split fp32 only
  g.fast_accum = false;
  g.out_type = GemmOut::kE4M3;
  EXPECT_THROW(ref::gemm_fp8(g), std::invalid_argument);  // no FP8 output with row/block scales
}

}  // namespace
}  // namespace coat
