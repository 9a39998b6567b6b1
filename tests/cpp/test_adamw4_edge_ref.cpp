// CPU reference of the 4-bit AdamW step on adversarial inputs (zeros, outliers, tiny and huge
// magnitudes, NaN / Inf gradients, skipped steps) and its argument checks.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <stdexcept>
#include <vector>

#include "adamw4/adamw4_math.h"
#include "adamw4_slot.h"
#include "coat/adamw4.h"

namespace coat {
namespace {

using namespace test4;  // NOLINT

void step_once(Slot& s, const AdamwConfig& c, float t) {
  s.step = t;
  Adamw4Tensor d = s.desc(0);
  ref::adamw4_step(&d, 1, groups_of(s.n), c);
}

// The decoded v of element e after step t (the buffer step t wrote).
float v_of(const Slot& s, int64_t e) {
  if (s.kind == Adamw4Kind::kBlock) return adamw4::decode_v(adamw4::nibble(s.v.data(), e), s.v_scale[e / G]);
  const float* r = s.v_scale.data() + adamw4::new_buffer(adamw::step_count(s.step)) * (s.rows + s.cols);
  return adamw4::decode_v(adamw4::nibble(s.v.data(), e), adamw4::rank1_scale(r[e / s.cols], r[s.rows + e % s.cols]));
}

float m_of(const Slot& s, int64_t e) { return adamw4::decode_m(adamw4::nibble(s.m.data(), e), s.m_scale[e / G]); }

TEST(Adamw4Edge, ZeroGradientsKeepStatesZero) {
  for (Adamw4Kind k : {Adamw4Kind::kBlock, Adamw4Kind::kRank1}) {
    Slot s(40, 130, k);
    s.set_param(std::vector<float>(s.n, 2.0f));
    s.set_grad(std::vector<float>(s.n, 0.0f));
    const AdamwConfig c = config();
    step_once(s, c, 1);
    for (int64_t e = 0; e < s.n; ++e) {
      ASSERT_EQ(s.p(e), 2.0f * static_cast<float>(1.0 - c.lr * c.weight_decay));
      ASSERT_EQ(m_of(s, e), 0.0f);
      ASSERT_EQ(v_of(s, e), 0.0f);  // zero scale: the only way v decodes to 0
    }
  }
}

// A zero gradient next to non-zero ones: its v decodes to a positive value (the zero-point
// problem the linear map without zero avoids), so its update stays bounded by m / sqrt(v).
TEST(Adamw4Edge, ZeroExcludedFromV) {
  for (Adamw4Kind k : {Adamw4Kind::kBlock, Adamw4Kind::kRank1}) {
    Slot s(16, 256, k);
    std::vector<float> g = normal(s.n, 1e-2f, 5);
    for (int64_t e = 0; e < s.n; e += 3) g[e] = 0.0f;
    s.set_grad(g);
    step_once(s, config(), 1);
    for (int64_t e = 0; e < s.n; ++e) ASSERT_GT(v_of(s, e), 0.0f) << e;
  }
}

// One outlier among small gradients: everything stays finite; the outlier's own moments are exact
// to the map's resolution (it sets its block's absmax and its row's and column's maxima).
TEST(Adamw4Edge, OutlierStaysFiniteAndExact) {
  for (Adamw4Kind k : {Adamw4Kind::kBlock, Adamw4Kind::kRank1}) {
    Slot s(64, 200, k);
    std::vector<float> g = normal(s.n, 1e-3f, 6);
    g[777] = 1e4f;
    s.set_grad(g);
    const AdamwConfig c = config();
    step_once(s, c, 1);
    const float w2 = static_cast<float>(1.0 - c.beta2);
    EXPECT_EQ(v_of(s, 777), (w2 * 1e4f) * 1e4f);
    EXPECT_EQ(m_of(s, 777), static_cast<float>(1.0 - c.beta1) * 1e4f);
    for (int64_t e = 0; e < s.n; ++e) ASSERT_TRUE(std::isfinite(s.p(e)) && std::isfinite(v_of(s, e))) << e;
  }
}

// Tiny gradients: v underflows toward fp32 subnormals; nothing becomes NaN or Inf. Huge ones: v
// overflows to Inf, which the state shows as a NaN scale, as coat.optim.AdamW shows the NaN code.
TEST(Adamw4Edge, TinyAndHugeMagnitudes) {
  for (Adamw4Kind k : {Adamw4Kind::kBlock, Adamw4Kind::kRank1}) {
    Slot s(8, 640, k);
    s.set_grad(normal(s.n, 1e-25f, 7));
    const AdamwConfig c = config();
    step_once(s, c, 1);
    step_once(s, c, 2);
    for (int64_t e = 0; e < s.n; ++e) ASSERT_TRUE(std::isfinite(s.p(e)) && std::isfinite(m_of(s, e))) << e;
    std::vector<float> g = normal(s.n, 1e-3f, 8);
    g[100] = 3e30f;  // (1 - beta2) g^2 overflows
    s.set_grad(g);
    step_once(s, c, 3);
    EXPECT_TRUE(std::isnan(v_of(s, 100)));
    EXPECT_TRUE(std::isfinite(m_of(s, 100)));  // m = 0.1 g is finite
    EXPECT_TRUE(std::isfinite(v_of(s, k == Adamw4Kind::kBlock ? 300 : 640 * 5 + 7)));  // another block / row+col
  }
}

// A NaN gradient: the element's parameter is NaN at once; 4 bits have no NaN code, so its block's
// (row's and column's) scales are NaN and the block decodes to NaN at the next step; the rest of
// the tensor is untouched by it.
TEST(Adamw4Edge, NanGradientShowsInItsBlockOnly) {
  for (Adamw4Kind k : {Adamw4Kind::kBlock, Adamw4Kind::kRank1}) {
    Slot s(10, 512, k);
    std::vector<float> g = normal(s.n, 1e-3f, 9);
    g[1000] = std::numeric_limits<float>::quiet_NaN();
    s.set_grad(g);
    const AdamwConfig c = config();
    step_once(s, c, 1);
    EXPECT_TRUE(std::isnan(s.p(1000)));
    EXPECT_TRUE(std::isnan(s.m_scale[1000 / G]));
    EXPECT_TRUE(std::isnan(v_of(s, 1000)));
    int64_t finite = 0;
    for (int64_t e = 0; e < s.n; ++e) finite += std::isfinite(s.p(e)) ? 1 : 0;
    EXPECT_EQ(finite, s.n - 1);
    EXPECT_TRUE(std::isfinite(m_of(s, 1000 + 2 * G)));
    s.set_grad(normal(s.n, 1e-3f, 10));
    step_once(s, c, 2);
    EXPECT_TRUE(std::isnan(s.p(1000 / G * G + 5)));  // the block decoded NaN m
    EXPECT_TRUE(std::isfinite(s.p(1000 + 3 * G)));   // another block, another row
  }
}

TEST(Adamw4Edge, FoundInfSkipsAndGradScaleUnscales) {
  Slot a(30, 400, Adamw4Kind::kRank1), b(30, 400, Adamw4Kind::kRank1);
  const std::vector<uint8_t> p0 = a.param;
  AdamwConfig c = config();
  const float inf_found = 1.0f;
  c.found_inf = &inf_found;
  step_once(a, c, 1);
  EXPECT_EQ(a.param, p0);
  EXPECT_EQ(a.v_scale, std::vector<float>(a.v_scale.size(), 0.0f));
  const float scale = 1024.0f;
  std::vector<float> g = normal(a.n, 1e-2f, 12), g_scaled(g);
  for (float& x : g_scaled) x *= scale;
  a.set_grad(g_scaled);
  b.set_grad(g);
  c.found_inf = nullptr;
  c.amp_scale = &scale;
  step_once(a, c, 1);
  c.amp_scale = nullptr;
  step_once(b, c, 1);
  EXPECT_EQ(a.param, b.param);
  EXPECT_EQ(a.v, b.v);
  EXPECT_EQ(a.v_scale, b.v_scale);
}

TEST(Adamw4Edge, ArgumentChecksWriteNothing) {
  Slot s(20, 300, Adamw4Kind::kRank1);
  const std::vector<uint8_t> p0 = s.param;
  const AdamwConfig c = config();
  s.step = 1.0f;
  auto expect_invalid = [&](Adamw4Tensor d, int64_t ng, const AdamwConfig& cc) {
    EXPECT_THROW(ref::adamw4_step(&d, 1, ng, cc), std::invalid_argument);
    EXPECT_EQ(s.param, p0);
  };
  const int64_t ng = groups_of(s.n);
  Adamw4Tensor d = s.desc(0);
  d.rows = 19;
  expect_invalid(d, ng, c);  // rows x cols != numel
  d = s.desc(0);
  d.kind = static_cast<Adamw4Kind>(5);
  expect_invalid(d, ng, c);
  d = s.desc(0);
  d.v_scale = nullptr;
  expect_invalid(d, ng, c);
  d = s.desc(3);
  expect_invalid(d, ng, c);  // group_begin
  expect_invalid(s.desc(0), ng + 1, c);
  AdamwConfig bad = c;
  bad.master = MasterKind::kFp32;  // fp32 params with an fp32 master: not a combination
  expect_invalid(s.desc(0), ng, bad);
  bad = c;
  bad.beta2 = 1.0;
  expect_invalid(s.desc(0), ng, bad);
  Slot f(1, 10, Adamw4Kind::kFull);
  d = f.desc(0);
  d.m_scale = reinterpret_cast<float*>(f.v.data());
  EXPECT_THROW(ref::adamw4_step(&d, 1, 1, c), std::invalid_argument);  // full states have no scales
}

}  // namespace
}  // namespace coat
