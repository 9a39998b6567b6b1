// Group scaling in the CPU references: the amax that RMSNorm (forward and recompute) and SwiGLU
// (forward and backward) write beside their outputs equals the amax quantize_per_tensor_amax finds
// by re-reading those outputs, NaN and infinities excluded; quantize_stacked_from_amax with that
// amax gives the amax pass's codes and scale.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "coat/norm.h"
#include "coat/quantize.h"
#include "coat/swiglu.h"

#include "test_data.h"

using namespace coat;

namespace {

using coat_test::randn;

// The amax pass's amax of an fp32 [rows, cols] tensor, and its codes and scale.
struct Pass {
  float amax = -1.0f, scale = -1.0f;
  std::vector<uint8_t> q;
};
Pass amax_pass(const std::vector<float>& y, int64_t rows, int64_t cols) {
  Pass p;
  p.q.resize(y.size());
  ref::quantize_per_tensor_amax(y.data(), DType::kFloat32, rows, cols, Fp8Format::kE4M3, &p.amax, &p.scale,
                                p.q.data(), nullptr);
  return p;
}

void expect_from_amax_matches(const std::vector<float>& y, int64_t rows, int64_t cols, float amax) {
  const Pass p = amax_pass(y, rows, cols);
  EXPECT_EQ(amax, p.amax);
  StackedRows x;
  x.data[0] = y.data(), x.rows[0] = rows, x.count = 1, x.cols = cols, x.dtype = DType::kFloat32;
  std::vector<uint8_t> q(y.size());
  float scale = -1.0f;
  ref::quantize_stacked_from_amax(x, Fp8Format::kE4M3, &amax, &scale, q.data(), nullptr);
  EXPECT_EQ(scale, p.scale);
  EXPECT_EQ(q, p.q);
}

}  // namespace

TEST(GroupAmax, NormForwardAndRecomputeWriteTheirOutputsAmax) {
  const int64_t rows = 5, cols = 48;
  std::vector<float> x = randn(rows * cols, 1), w = randn(cols, 2), y(x.size()), rstd(rows), y2(x.size());
  x[7] = 300.0f;                                       // an outlier
  x[cols + 3] = std::numeric_limits<float>::infinity();  // a non-finite row: y is NaN there
  std::vector<uint8_t> q(x.size());
  std::vector<float> scales(x.size() / kNormGroup);
  float amax = -1.0f, amax2 = -1.0f;
  ref::rmsnorm_fwd(x.data(), DType::kFloat32, w.data(), DType::kFloat32, NormKind::kScaled, rows, cols, 1e-5f,
                   y.data(), rstd.data(), q.data(), scales.data(), ScaleKind::kFloat32, Fp8Format::kE4M3, &amax);
  expect_from_amax_matches(y, rows, cols, amax);
  EXPECT_GT(amax, 0.0f);
  EXPECT_TRUE(std::isfinite(amax));
  ref::rmsnorm_fwd_fp8(q.data(), scales.data(), ScaleKind::kFloat32, Fp8Format::kE4M3, rstd.data(), w.data(),
                       DType::kFloat32, NormKind::kScaled, rows, cols, y2.data(), DType::kFloat32, &amax2);
  expect_from_amax_matches(y2, rows, cols, amax2);
}

TEST(GroupAmax, SwigluForwardAndBackwardWriteTheirOutputsAmax) {
  const int64_t rows = 4, inter = 32;
  std::vector<float> gu = randn(rows * 2 * inter, 3), h(rows * inter), dh = randn(rows * inter, 4);
  gu[5] = std::numeric_limits<float>::quiet_NaN();
  dh[9] = 1e4f;
  std::vector<uint8_t> q(gu.size());
  std::vector<float> scales(gu.size() / kSwigluGroup), dgu(gu.size()), h2(h.size());
  float ha = -1.0f, da = -1.0f, ha2 = -1.0f;
  ref::swiglu_fwd(gu.data(), DType::kFloat32, GatedAct::kSilu, rows, inter, h.data(), q.data(), scales.data(),
                  ScaleKind::kFloat32, Fp8Format::kE4M3, &ha);
  expect_from_amax_matches(h, rows, inter, ha);
  ref::swiglu_bwd(q.data(), scales.data(), ScaleKind::kFloat32, Fp8Format::kE4M3, dh.data(), DType::kFloat32,
                  GatedAct::kSilu, rows, inter, dgu.data(), h2.data(), &da, &ha2);
  expect_from_amax_matches(dgu, rows, 2 * inter, da);
  expect_from_amax_matches(h2, rows, inter, ha2);
  // Without the recomputed h its amax is 0; zero rows give 0 and scale 1.
  ref::swiglu_bwd(q.data(), scales.data(), ScaleKind::kFloat32, Fp8Format::kE4M3, dh.data(), DType::kFloat32,
                  GatedAct::kSilu, rows, inter, dgu.data(), nullptr, &da, &ha2);
  EXPECT_EQ(ha2, 0.0f);
  ref::swiglu_fwd(gu.data(), DType::kFloat32, GatedAct::kSilu, 0, inter, h.data(), nullptr, nullptr,
                  ScaleKind::kFloat32, Fp8Format::kE4M3, &ha);
  EXPECT_EQ(ha, 0.0f);
}

TEST(GroupAmax, FromAmaxRejectsAMissingAmax) {
  std::vector<float> y(16, 1.0f);
  StackedRows x;
  x.data[0] = y.data(), x.rows[0] = 1, x.count = 1, x.cols = 16, x.dtype = DType::kFloat32;
  std::vector<uint8_t> q(16);
  float scale = 0.0f;
  EXPECT_THROW(ref::quantize_stacked_from_amax(x, Fp8Format::kE4M3, nullptr, &scale, q.data(), nullptr),
               std::invalid_argument);
}
