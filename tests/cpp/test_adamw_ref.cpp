// CPU reference of the fused AdamW step: against decode -> fp32 AdamW -> dre_quantize written out
// with the quantize family's reference, plus edge cases, stochastic rounding and argument checks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "adamw/adamw_math.h"
#include "adamw/fp8_states.h"
#include "coat/adamw.h"
#include "coat/quantize.h"
#include "common/fp8.h"

namespace coat {
namespace {

constexpr int G = kDreGroupSize;

// One parameter tensor with its states, in host memory.
struct Slot {
  int64_t n;
  std::vector<float> p32, master;
  std::vector<uint16_t> p16;
  std::vector<float> g32;
  std::vector<uint16_t> g16;
  std::vector<uint8_t> mq, vq, mk, vk;
  std::vector<float> mg, vg;
  float step = 1.0f;
  explicit Slot(int64_t n_) : n(n_) {
    const int64_t g = (n + G - 1) / G;
    mq.assign(n, 0); vq.assign(n, 0); mg.assign(g, 0.0f); vg.assign(g, 0.0f);
    mk.assign(g, kDreUnitK16); vk.assign(g, kDreUnitK16);
  }
  AdamwTensor desc(bool bf16_param, bool bf16_grad, bool with_master, int64_t begin) {
    AdamwTensor d{};
    d.param = bf16_param ? static_cast<void*>(p16.data()) : static_cast<void*>(p32.data());
    d.grad = bf16_grad ? static_cast<const void*>(g16.data()) : static_cast<const void*>(g32.data());
    d.master = with_master ? master.data() : nullptr;
    d.m_q = mq.data(); d.m_gmax = mg.data(); d.m_k16 = mk.data();
    d.v_q = vq.data(); d.v_gmax = vg.data(); d.v_k16 = vk.data();
    d.step = &step; d.numel = n; d.group_begin = begin; d.seed = 1234;
    return d;
  }
};

void fill(std::vector<float>& x, int64_t n, float scale, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, scale);
  x.resize(n);
  for (auto& v : x) v = nd(rng);
}

AdamwConfig base_config() {
  AdamwConfig c;
  c.lr = 1e-2; c.beta1 = 0.9; c.beta2 = 0.95; c.eps = 1e-8; c.weight_decay = 0.1;
  return c;
}

// The states' DRE with the fast variants (what the step uses), written out element by element.
void fast_decode(const std::vector<uint8_t>& q, const std::vector<float>& gm, const std::vector<uint8_t>& k,
                 int64_t n, Fp8Format f, std::vector<float>& out) {
  float lut[128];
  for (int i = 0; i < 128; ++i) lut[i] = adamw::code_log2(i, f);
  for (int64_t j = 0; j < n; ++j)
    out[j] = dre_decode_fast(q[j], dre_group_fast(gm[j / G], k[j / G], f), lut);
}

void fast_quantize(const std::vector<float>& x, int64_t n, Fp8Format f, bool expansion, float range,
                   std::vector<uint8_t>& q, std::vector<float>& gm, std::vector<uint8_t>& k) {
  for (int64_t g = 0; g * G < n; ++g) {
    const int64_t end = std::min<int64_t>(n, g * G + G);
    float mx = 0.0f, mn = INFINITY, mx2 = 0.0f;
    for (int64_t j = g * G; j < end; ++j) adamw::group_minmax(x[j], mx, mn);
    for (int64_t j = g * G; j < end; ++j) adamw::group_second(x[j], mx, mx2);
    const DreNewGroupFast grp = adamw::new_group(mx, mx2, mn, expansion, range, f);
    gm[g] = grp.word;
    k[g] = grp.k16;
    for (int64_t j = g * G; j < end; ++j) q[j] = adamw::encode_state(x[j], grp.g, f);
  }
}

// The fused step must equal: decode m, v -> update in fp32 -> quantize the new m, v.
TEST(AdamwRef, MatchesUnfusedComposition) {
  for (bool expansion : {true, false}) {
    for (Fp8Format vf : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
      std::vector<int64_t> sizes = {1, 127, 128, 129, 1000, 4099};
      std::vector<Slot> slots;
      for (int64_t n : sizes) slots.emplace_back(n);
      AdamwConfig c = base_config();
      c.expansion = expansion; c.v_fmt = vf; c.v_log2_range = dre_default_log2_range(vf);
      for (int iter = 0; iter < 3; ++iter) {
        std::vector<AdamwTensor> ds;
        int64_t begin = 0;
        std::vector<std::vector<float>> m_old, v_old, p_old;
        for (size_t i = 0; i < slots.size(); ++i) {
          Slot& s = slots[i];
          if (iter == 0) fill(s.p32, s.n, 1.0f, 7 + i);
          fill(s.g32, s.n, 1e-3f * (1 + i), 100 * iter + i);
          s.step = static_cast<float>(iter + 1);
          std::vector<float> m(s.n), v(s.n);
          fast_decode(s.mq, s.mg, s.mk, s.n, c.m_fmt, m);
          fast_decode(s.vq, s.vg, s.vk, s.n, c.v_fmt, v);
          m_old.push_back(m); v_old.push_back(v); p_old.push_back(s.p32);
          ds.push_back(s.desc(false, false, false, begin));
          begin += (s.n + G - 1) / G;
        }
        ref::adamw_step(ds.data(), ds.size(), begin, c);
        for (size_t i = 0; i < slots.size(); ++i) {
          Slot& s = slots[i];
          const adamw::Scalars sc = adamw::make_scalars(c.lr, c, iter + 1);
          std::vector<float> m = m_old[i], v = v_old[i];
          for (int64_t j = 0; j < s.n; ++j) {
            const float p = adamw::update(p_old[i][j], s.g32[j], m[j], v[j], sc);
            ASSERT_EQ(p, s.p32[j]) << "param " << i << "," << j;
          }
          const int64_t g = (s.n + G - 1) / G;
          std::vector<uint8_t> q(s.n), k(g);
          std::vector<float> gm(g);
          for (int st = 0; st < 2; ++st) {
            const auto& x = st ? v : m;
            const Fp8Format f = st ? c.v_fmt : c.m_fmt;
            fast_quantize(x, s.n, f, expansion, st ? c.v_log2_range : c.m_log2_range, q, gm, k);
            EXPECT_EQ(q, st ? s.vq : s.mq) << "codes, state " << st;
            EXPECT_EQ(gm, st ? s.vg : s.mg);
            EXPECT_EQ(k, st ? s.vk : s.mk);
          }
        }
      }
    }
  }
}

TEST(AdamwRef, MasterAndThreadsAreConsistent) {
  // bf16 params + fp32 master + bf16 grads; 5000 groups so that threads split the work.
  const int64_t n = 5000 * G + 77;
  auto run = [&](int threads) {
    Slot s(n);
    fill(s.master, n, 0.5f, 1);
    std::vector<float> g;
    fill(g, n, 1e-2f, 2);
    s.p16.resize(n); s.g16.resize(n);
    for (int64_t i = 0; i < n; ++i) { s.p16[i] = host_float_to_bf16(s.master[i]); s.g16[i] = host_float_to_bf16(g[i]); }
    AdamwConfig c = base_config();
    c.param_dtype = DType::kBFloat16; c.grad_dtype = DType::kBFloat16; c.master = MasterKind::kFp32;
    c.cpu_threads = threads;
    AdamwTensor d = s.desc(true, true, true, 0);
    for (int it = 1; it <= 3; ++it) { s.step = it; ref::adamw_step(&d, 1, (n + G - 1) / G, c); }
    for (int64_t i = 0; i < n; ++i) EXPECT_EQ(s.p16[i], host_float_to_bf16(s.master[i]));
    return s;
  };
  Slot a = run(1), b = run(4);
  EXPECT_EQ(a.master, b.master);
  EXPECT_EQ(a.mq, b.mq);
  EXPECT_EQ(a.vq, b.vq);
  EXPECT_EQ(a.vg, b.vg);
}

TEST(AdamwRef, ZeroConstantAndHugeGradients) {
  const int64_t n = 300;
  Slot s(n);
  s.p32.assign(n, 2.0f);
  AdamwConfig c = base_config();
  s.g32.assign(n, 0.0f);  // zero grads: only weight decay moves p, states stay exactly zero
  AdamwTensor d = s.desc(false, false, false, 0);
  ref::adamw_step(&d, 1, 3, c);
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_EQ(s.p32[i], 2.0f * static_cast<float>(1.0 - c.lr * c.weight_decay));
    EXPECT_EQ(s.mq[i], 0);
    EXPECT_EQ(s.vq[i], 0);
  }
  s.g32.assign(n, 3e-3f);  // constant grads: every group is constant and represented exactly
  s.step = 2;
  ref::adamw_step(&d, 1, 3, c);
  std::vector<float> m(n);
  ref::dre_dequantize(s.mq.data(), s.mg.data(), s.mk.data(), n, c.m_fmt, m.data());
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(m[i], 0.1f * 3e-3f);
  s.g32.assign(n, 3e30f);  // huge: v = 1e60 overflows fp32 -> the state says so (NaN), like torch
  s.g32[5] = 1e-30f;       // tiny next to huge: finite, stays finite
  s.step = 3;
  ref::adamw_step(&d, 1, 3, c);
  ref::dre_dequantize(s.vq.data(), s.vg.data(), s.vk.data(), n, c.v_fmt, m.data());
  EXPECT_TRUE(std::isnan(m[0]));
  EXPECT_TRUE(std::isfinite(m[5]));
  for (float gmax : s.vg) EXPECT_TRUE(std::isfinite(gmax));
}

TEST(AdamwRef, NanGradientPropagatesToThatElementOnly) {
  const int64_t n = 256;
  Slot s(n);
  fill(s.p32, n, 1.0f, 3);
  fill(s.g32, n, 1e-3f, 4);
  s.g32[10] = NAN;
  AdamwConfig c = base_config();
  AdamwTensor d = s.desc(false, false, false, 0);
  ref::adamw_step(&d, 1, 2, c);
  EXPECT_TRUE(std::isnan(s.p32[10]));
  EXPECT_EQ(s.mq[10] & 0x7F, kFp8NaN);
  for (int64_t i = 0; i < n; ++i)
    if (i != 10) EXPECT_TRUE(std::isfinite(s.p32[i]) && (s.mq[i] & 0x7F) != kFp8NaN);
}

TEST(AdamwRef, FoundInfSkipsAndGradScaleDivides) {
  const int64_t n = 200;
  Slot a(n), b(n);
  fill(a.p32, n, 1.0f, 5); b.p32 = a.p32;
  fill(a.g32, n, 1e-3f, 6); b.g32 = a.g32;
  for (auto& g : b.g32) g *= 1024.0f;  // exact: a power of two
  AdamwConfig c = base_config();
  const float scale = 1024.0f, inf_flag = 1.0f, no_inf = 0.0f;
  AdamwTensor da = a.desc(false, false, false, 0), db = b.desc(false, false, false, 0);
  AdamwConfig cb = c;
  cb.amp_scale = &scale;
  cb.found_inf = &inf_flag;
  const std::vector<float> before = b.p32;
  ref::adamw_step(&db, 1, 2, cb);
  EXPECT_EQ(b.p32, before);
  EXPECT_EQ(b.mg[0], 0.0f);
  cb.found_inf = &no_inf;
  ref::adamw_step(&db, 1, 2, cb);
  ref::adamw_step(&da, 1, 2, c);
  EXPECT_EQ(a.p32, b.p32);
  EXPECT_EQ(a.mq, b.mq);
}

// The clip scale, GradScaler's scale and maximize are separate arguments: each is what its own
// transform of the gradients gives, and a clip scale with an AMP scale is the two products.
TEST(AdamwRef, GradTransformsAreSeparateArguments) {
  const int64_t n = 300;
  const float amp = 1024.0f, clip = 3.0f, inv_clip = 1.0f / clip;
  auto run = [&](const std::vector<float>& g, const float* amp_s, const float* clip_s, bool maximize) {
    Slot s(n);
    fill(s.p32, n, 1.0f, 7);
    s.g32 = g;
    AdamwConfig c = base_config();
    c.amp_scale = amp_s;
    c.clip_scale = clip_s;
    c.maximize = maximize;
    AdamwTensor d = s.desc(false, false, false, 0);
    ref::adamw_step(&d, 1, 3, c);
    return std::make_pair(s.p32, s.mq);
  };
  std::vector<float> g;
  fill(g, n, 1e-3f, 8);
  std::vector<float> clipped(g), negated(g), amp_scaled(g);
  for (int64_t i = 0; i < n; ++i) {
    clipped[i] = g[i] * inv_clip;
    negated[i] = -g[i];
    amp_scaled[i] = g[i] * amp;  // exact: a power of two
  }
  EXPECT_EQ(run(g, nullptr, &clip, false), run(clipped, nullptr, nullptr, false));
  EXPECT_EQ(run(g, nullptr, nullptr, true), run(negated, nullptr, nullptr, false));
  EXPECT_EQ(run(amp_scaled, &amp, &clip, false), run(clipped, nullptr, nullptr, false));
  std::vector<float> neg_clipped(clipped);
  for (float& x : neg_clipped) x = -x;
  EXPECT_EQ(run(amp_scaled, &amp, &clip, true), run(neg_clipped, nullptr, nullptr, false));
  EXPECT_NE(run(g, nullptr, &clip, false), run(g, nullptr, nullptr, false));
}

TEST(AdamwRef, StochasticRoundingIsUnbiased) {
  // x between two bf16 neighbours: the mean over many hash draws approaches x.
  const float x = 1.0f + 0.3f * 0.0078125f;  // 30% of the way from 1 to the next bf16 (1 + 2^-7)
  double sum = 0.0;
  int up = 0;
  const int trials = 20000;
  for (int t = 0; t < trials; ++t) {
    const uint64_t r = adamw::sr_bits(99, t, 12345);
    const uint16_t b = adamw::bf16_sr(x, static_cast<uint32_t>(r));
    sum += host_bf16_to_float(b);
    up += b != 0x3F80;
  }
  EXPECT_NEAR(static_cast<double>(up) / trials, 0.3, 0.015);
  EXPECT_NEAR(sum / trials, x, 0.01 * 0.0078125);
  EXPECT_EQ(adamw::bf16_sr(3.4028235e38f, 0xFFFFu), 0x7F7F);  // never rounds a finite value to inf
  EXPECT_EQ(adamw::bf16_sr(-2.0f, 0xFFFFu), 0xC000);    // exactly representable: unchanged
  EXPECT_EQ(adamw::bf16_sr(NAN, 0u) & 0x7FC0, 0x7FC0);
}

// The kernels' quad form: four bf16_sr, bit for bit, on quads that take the fast path and quads that
// hold one value near the top of the range, +-Inf, a NaN (payloads that would carry into the sign)
// or the largest finite values.
TEST(AdamwRef, StochasticRoundingQuadEqualsFourSingles) {
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-4.0f, 4.0f);
  const float specials[] = {3.4028235e38f, -3.4028235e38f, std::nextafter(3.3895314e38f, 0.0f), 3.3895314e38f,
                            std::nextafter(3.3895314e38f, 4e38f), INFINITY, -INFINITY, NAN,
                            float_of(0x7FFFFFFFu), float_of(0xFFFFFFFFu), float_of(0x7F800001u), 0.0f, -0.0f,
                            1e-45f, -1e-40f};
  for (int trial = 0; trial < 4000; ++trial) {
    float x[4];
    for (float& v : x) v = u(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 200) - 100);
    if (trial % 2) x[trial % 4] = specials[(trial / 2) % (sizeof(specials) / sizeof(float))];
    const uint64_t r = adamw::sr_bits(5, trial, rng());
    uint32_t lo, hi;
    adamw::bf16_sr_quad(x, r, lo, hi);
    const uint32_t want[4] = {adamw::bf16_sr(x[0], static_cast<uint32_t>(r)), adamw::bf16_sr(x[1], static_cast<uint32_t>(r >> 16)),
                              adamw::bf16_sr(x[2], static_cast<uint32_t>(r >> 32)), adamw::bf16_sr(x[3], static_cast<uint32_t>(r >> 48))};
    EXPECT_EQ(lo, want[0] | (want[1] << 16)) << "trial " << trial;
    EXPECT_EQ(hi, want[2] | (want[3] << 16)) << "trial " << trial;
  }
}

// The float step count as an integer, defined for every float (the cast alone is not past 2^64).
TEST(AdamwRef, StepCountIsDefinedForEveryFloat) {
  EXPECT_EQ(adamw::step_count(0.0f), 1u);
  EXPECT_EQ(adamw::step_count(-3.0f), 1u);
  EXPECT_EQ(adamw::step_count(NAN), 1u);
  EXPECT_EQ(adamw::step_count(7.0f), 7u);
  EXPECT_EQ(adamw::step_count(16777216.0f), 16777216u);
  EXPECT_EQ(adamw::step_count(std::ldexp(1.0f, 63)), uint64_t{1} << 63);
  EXPECT_EQ(adamw::step_count(std::ldexp(1.0f, 64)), ~uint64_t{0});
  EXPECT_EQ(adamw::step_count(INFINITY), ~uint64_t{0});
}

TEST(AdamwRef, RejectsBadArguments) {
  Slot s(10);
  s.p32.assign(10, 1.0f); s.g32.assign(10, 1.0f);
  AdamwTensor d = s.desc(false, false, false, 0);
  AdamwConfig c = base_config();
  auto expect_bad = [&](AdamwConfig cc, int64_t groups = 1) {
    EXPECT_THROW(ref::adamw_step(&d, 1, groups, cc), std::invalid_argument);
    EXPECT_EQ(s.p32[0], 1.0f);  // nothing written
  };
  AdamwConfig b = c; b.lr = NAN; expect_bad(b);
  b = c; b.lr = -1.0; expect_bad(b);
  b = c; b.beta1 = 1.0; expect_bad(b);
  b = c; b.beta2 = -0.1; expect_bad(b);
  b = c; b.eps = INFINITY; expect_bad(b);
  b = c; b.weight_decay = -1; expect_bad(b);
  b = c; b.master = MasterKind::kFp32; expect_bad(b);              // fp32 param with a master
  b = c; b.param_dtype = DType::kFloat16; b.master = MasterKind::kBf16Sr; expect_bad(b);
  expect_bad(c, 2);                                                 // wrong group count
  d.group_begin = 1; expect_bad(c); d.group_begin = 0;
  d.m_q = nullptr; expect_bad(c);
}

}  // namespace
}  // namespace coat
