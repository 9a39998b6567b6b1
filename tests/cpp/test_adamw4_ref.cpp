// CPU reference of the 4-bit AdamW step (coat/adamw4.h): its maps, and the fused two-pass step
// against a whole-tensor oracle written here (decode everything to fp32, update, take block and
// row / column maxima over the fp32 copy, encode), on odd shapes, every kind and master mode, and
// adversarial inputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "adamw4/adamw4_math.h"
#include "adamw4_slot.h"
#include "coat/adamw4.h"

namespace coat {
namespace {

using namespace test4;  // NOLINT

// ---- maps --------------------------------------------------------------------------------------

TEST(Adamw4Maps, MonotoneAndZeroOnlyInM) {
  for (int c = 0; c + 1 < adamw4::kCodes; ++c) {
    EXPECT_LT(adamw4::m_level(c), adamw4::m_level(c + 1)) << c;
    EXPECT_LT(adamw4::v_level(c), adamw4::v_level(c + 1)) << c;
    EXPECT_GT(adamw4::m_mid(c), adamw4::m_level(c));
    EXPECT_LT(adamw4::m_mid(c), adamw4::m_level(c + 1));
    EXPECT_GT(adamw4::v_mid(c), adamw4::v_level(c));
    EXPECT_LT(adamw4::v_mid(c), adamw4::v_level(c + 1));
  }
  EXPECT_EQ(adamw4::m_level(adamw4::kZeroCodeM), 0.0f);
  EXPECT_EQ(adamw4::m_level(15), 1.0f);
  EXPECT_EQ(adamw4::v_level(0), 1.0f / 16);  // no code of v means 0
  EXPECT_EQ(adamw4::v_level(15), 1.0f);
  // The signed map is symmetric apart from +1 (the paper's map has no -1).
  for (int c = 0; c < 7; ++c) EXPECT_EQ(adamw4::m_level(c), -adamw4::m_level(14 - c));
}

TEST(Adamw4Maps, EncodeDecodeRoundTripsEveryCode) {
  for (float s : {1.0f, 3.7f, 1e-30f, 2e30f, 1.2e-38f /* the smallest normals */}) {
    for (int c = 0; c < adamw4::kCodes; ++c) {
      EXPECT_EQ(adamw4::encode_m(adamw4::decode_m(c, s), s), c) << "m code " << c << " scale " << s;
      EXPECT_EQ(adamw4::encode_v(adamw4::decode_v(c, s), s), c) << "v code " << c << " scale " << s;
    }
  }
}

TEST(Adamw4Maps, EncodeIsNearestAndMonotone) {
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  int prev_m = 0, prev_v = 0;
  for (int i = 0; i <= 20000; ++i) {  // a sweep: codes never decrease
    const float x = -1.0f + 2.0f * static_cast<float>(i) / 20000.0f;
    const int cm = adamw4::encode_m(x, 1.0f), cv = adamw4::encode_v(std::fabs(x), 1.0f);
    if (i > 0) {
      EXPECT_GE(cm, prev_m) << x;
    }
    if (i > 10000) {
      EXPECT_GE(cv, prev_v) << x;
    }
    prev_m = cm;
    prev_v = cv;
  }
  for (int i = 0; i < 100000; ++i) {
    const float x = u(rng);
    const int cm = adamw4::encode_m(x, 1.0f), cv = adamw4::encode_v(std::fabs(x), 1.0f);
    for (int k = 0; k < adamw4::kCodes; ++k) {
      // Nearest up to one ulp (the boundaries are fp32 midpoints).
      EXPECT_LE(std::fabs(adamw4::m_level(cm) - x), std::fabs(adamw4::m_level(k) - x) + 1e-7f) << x;
      EXPECT_LE(std::fabs(adamw4::v_level(cv) - std::fabs(x)), std::fabs(adamw4::v_level(k) - std::fabs(x)) + 1e-7f);
    }
  }
  EXPECT_EQ(adamw4::encode_m(0.0f, 1.0f), adamw4::kZeroCodeM);
  EXPECT_EQ(adamw4::encode_m(-0.0f, 1.0f), adamw4::kZeroCodeM);
  EXPECT_EQ(adamw4::encode_m(-1.0f, 1.0f), 0);  // -absmax: the map's most negative value
  EXPECT_EQ(adamw4::encode_v(0.0f, 1.0f), 0);    // v = 0 under a non-zero scale: 1/16 of it
}

// The encoders the step runs (a bucket table for m, arithmetic for v) against the definitions:
// every midpoint and its neighbouring floats, every code's value, random values, scales of all
// magnitudes, unusable scales and NaN.
// m's bucket table: every bucket holds at most one midpoint, and none lies within 2^-22 of a bucket
// edge (y = x + 2 rounds by at most 2^-23, so no rounding moves a value across a midpoint).
TEST(Adamw4Maps, MBucketsHoldOneMidpointAwayFromTheEdges) {
  for (int i = 0; i < adamw4::kMBuckets; ++i) {
    const float lo = adamw4::m_bucket_x(i), hi = i + 1 < adamw4::kMBuckets ? adamw4::m_bucket_x(i + 1) : 2.0f;
    int inside = 0;
    for (int k = 0; k + 1 < adamw4::kCodes; ++k) {
      const float mid = adamw4::m_mid(k);
      inside += mid >= lo && mid < hi;
      EXPECT_GT(std::fabs(mid - lo), std::ldexp(1.0f, -22)) << "midpoint " << k << " near bucket " << i;
    }
    EXPECT_LE(inside, 1) << "bucket " << i;
    EXPECT_EQ(adamw4::m_bucket_of(lo), i) << "bucket " << i;
  }
  EXPECT_FLOAT_EQ(adamw4::m_bucket_x(0), -1.0f);
  EXPECT_FLOAT_EQ(adamw4::m_bucket_x(adamw4::kMBuckets - 1), 1.0f);
}

TEST(Adamw4Maps, FastEncodersEqualTheDefinitions) {
  std::vector<adamw4::MBucket> table(adamw4::kMBuckets);  // what encode_m_table reads
  for (int i = 0; i < adamw4::kMBuckets; ++i) table[i] = adamw4::m_bucket(i);
  std::vector<float> xs = {0.0f, -0.0f, 1.0f, -1.0f, 2.0f, 1e30f, -1e30f, std::numeric_limits<float>::infinity(),
                           -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()};
  for (int k = 0; k + 1 < adamw4::kCodes; ++k) {
    for (float b : {adamw4::m_mid(k), adamw4::v_mid(k), adamw4::m_level(k), adamw4::v_level(k)}) {
      float lo = b, hi = b;
      for (int u = 0; u < 3; ++u) {
        xs.push_back(lo), xs.push_back(hi);
        lo = std::nextafter(lo, -1e30f), hi = std::nextafter(hi, 1e30f);
      }
    }
  }
  for (int i = 0; i < adamw4::kMBuckets; ++i) {  // every bucket edge and its neighbouring floats
    float lo = adamw4::m_bucket_x(i), hi = lo;
    for (int u = 0; u < 4; ++u) {
      xs.push_back(lo), xs.push_back(hi);
      lo = std::nextafter(lo, -1e30f), hi = std::nextafter(hi, 1e30f);
    }
  }
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (int i = 0; i < 20000; ++i) xs.push_back(u(rng));
  for (int i = 0; i < 5000; ++i) xs.push_back(u(rng) * 0.05f);  // where most normalized moments lie
  for (float s : {1.0f, 3.7f, 0.1f, 1e-30f, 2e30f, 1.2e-38f, 1e-40f, 0.0f, -1.0f, std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::quiet_NaN()}) {
    for (float x : xs) {
      const float m = x * (std::isfinite(s) && s > 0.0f ? s : 1.0f);
      const float r = 1.0f / s;
      EXPECT_EQ(adamw4::encode_m_table(m, s, r, table.data()), adamw4::encode_m(m, s)) << "m " << m << " scale " << s;
      const float v = std::fabs(m);
      EXPECT_EQ(adamw4::encode_v_fast(v, s, r), adamw4::encode_v(v, s)) << "v " << v << " scale " << s;
      EXPECT_EQ(adamw4::encode_m_table(x, s, r, table.data()), adamw4::encode_m(x, s)) << "m " << x << " scale " << s;
      EXPECT_EQ(adamw4::encode_v_fast(std::fabs(x), s, r), adamw4::encode_v(std::fabs(x), s)) << x << " " << s;
    }
  }
}

// The kernel's row of an element: a multiply-high and one correction, exact for every n < 2^31.
TEST(Adamw4Maps, DivisionByMagicIsExact) {
  std::mt19937 rng(5);
  std::vector<uint32_t> ds = {1, 2, 3, 4, 5, 7, 100, 128, 4096, 11008, 32000, 65536, (1u << 30) + 7, (1u << 31) - 1};
  for (int k = 0; k < 2000; ++k) ds.push_back(k % 2 ? (rng() % 100000) + 1 : (rng() & 0x7FFFFFFFu) | 1u);
  for (uint32_t d : ds) {
    uint32_t magic;
    int shift;
    adamw4::make_magic(d, magic, shift);
    std::vector<int64_t> ns = {0, 1, d - 1, d, int64_t{d} + 1, (int64_t{1} << 31) - 1};
    for (int k = 0; k < 200; ++k) ns.push_back(rng() & 0x7FFFFFFFu);
    for (int64_t q = 1; q < 50; ++q) ns.push_back(q * d - 1), ns.push_back(q * d);
    for (int64_t n : ns) {
      if (n < 0 || n >= (int64_t{1} << 31)) continue;
      ASSERT_EQ(adamw4::div_magic(static_cast<uint32_t>(n), d, magic, shift), static_cast<uint32_t>(n / d))
          << n << " / " << d;
    }
  }
}

TEST(Adamw4Maps, FastDecodersAndMaximaEqualTheDefinitions) {
  for (uint32_t c = 0; c < adamw4::kCodes; ++c)
    EXPECT_EQ(bits_of(adamw4::v_level_of_bits(c)), bits_of(adamw4::v_level(static_cast<int>(c)))) << c;
  // The key of a nan_max over |x| equals the umax of the elements' keys (the kernels' block, row
  // and column maxima), whatever mix of zeros, subnormals, infinities and NaN a block holds.
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const float pool[] = {0.0f, -0.0f, 1e-40f, -1e-40f, 1.0f, -3.5f, 2e38f, inf, -inf, nan, 7e-3f, FLT_MAX};
  std::mt19937 rng(11);
  for (int trial = 0; trial < 20000; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 6);
    float acc = 0.0f;
    uint32_t want = 0;
    for (int i = 0; i < n; ++i) {
      const float x = rng() % 2 ? pool[rng() % 12] : std::ldexp(static_cast<float>(rng() % 1000) - 500.0f, -static_cast<int>(rng() % 140));
      acc = adamw4::nan_max(acc, std::fabs(x));
      want = adamw4::umax(want, adamw4::max_key(x));
    }
    ASSERT_EQ(adamw4::max_key(acc), want) << "trial " << trial;
    ASSERT_EQ(adamw4::key_of_bits(bits_of(acc)), want) << "trial " << trial;
  }
  EXPECT_TRUE(std::isnan(adamw4::nan_max(1.0f, nan)));
  EXPECT_TRUE(std::isnan(adamw4::nan_max(nan, 1.0f)));
}

TEST(Adamw4Maps, UnusableScales) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (float s : {0.0f, nan, inf, 1e-40f /* subnormal: its reciprocal overflows */}) {
    EXPECT_EQ(adamw4::encode_m(0.5f, s), adamw4::kZeroCodeM);
    EXPECT_EQ(adamw4::encode_v(0.5f, s), 0);
  }
  EXPECT_EQ(adamw4::decode_v(7, 0.0f), 0.0f);  // a zero scale (all-zero block) decodes to 0
  EXPECT_TRUE(std::isnan(adamw4::decode_m(3, nan)));
  EXPECT_TRUE(std::isnan(adamw4::rank1_scale(nan, 1.0f)));
  EXPECT_TRUE(std::isnan(adamw4::rank1_scale(1.0f, nan)));
  EXPECT_EQ(adamw4::rank1_scale(2.0f, 3.0f), 2.0f);
  EXPECT_EQ(adamw4::max_key(-2.0f), bits_of(2.0f));
  EXPECT_EQ(adamw4::max_key(inf), adamw4::kNanBits);
  EXPECT_EQ(adamw4::max_key(nan), adamw4::kNanBits);
}

// ---- the whole-tensor oracle ---------------------------------------------------------------------

float nan_max(const std::vector<float>& x, int64_t b, int64_t e, int64_t stride = 1) {
  float mx = 0.0f;
  for (int64_t i = b; i < e; i += stride) {
    if (!std::isfinite(x[i])) return std::numeric_limits<float>::quiet_NaN();
    mx = std::max(mx, std::fabs(x[i]));
  }
  return mx;
}

// The expected slot after one step of fp32 params (no master; t = s.step, already incremented).
// Returns the new fp32 parameters.
std::vector<float> oracle(Slot& s, const AdamwConfig& c) {
  const uint64_t t = adamw::step_count(s.step);
  const adamw::Scalars sc = adamw::make_scalars(c.lr, c, t);
  const int64_t n = s.n, rc = s.rows + s.cols;
  std::vector<float> m(n), v(n), p(n);
  for (int64_t e = 0; e < n; ++e) {
    if (s.kind == Adamw4Kind::kFull) {
      std::memcpy(&m[e], &s.m[4 * e], 4);
      std::memcpy(&v[e], &s.v[4 * e], 4);
    } else {
      m[e] = adamw4::decode_m(adamw4::nibble(s.m.data(), e), s.m_scale[e / G]);
      const float* old = s.v_scale.data() + adamw4::old_buffer(t) * rc;
      const float vs = s.kind == Adamw4Kind::kBlock ? s.v_scale[e / G]
                                                    : adamw4::rank1_scale(old[e / s.cols], old[s.rows + e % s.cols]);
      v[e] = adamw4::decode_v(adamw4::nibble(s.v.data(), e), vs);
    }
    p[e] = adamw::update(s.p(e), value_at(s.grad, e, s.gt) * adamw::grad_multiplier(c), m[e], v[e], sc);
  }
  if (s.kind == Adamw4Kind::kFull) {
    std::memcpy(s.m.data(), m.data(), 4 * n);
    std::memcpy(s.v.data(), v.data(), 4 * n);
    return p;
  }
  float* fresh = s.v_scale.data() + adamw4::new_buffer(t) * rc;
  if (s.kind == Adamw4Kind::kRank1) {
    for (int64_t i = 0; i < s.rows; ++i) fresh[i] = nan_max(v, i * s.cols, (i + 1) * s.cols);
    for (int64_t j = 0; j < s.cols; ++j) fresh[s.rows + j] = nan_max(v, j, n, s.cols);
  }
  std::fill(s.m.begin(), s.m.end(), 0);
  std::fill(s.v.begin(), s.v.end(), 0);
  for (int64_t g = 0; g < groups_of(n); ++g) {
    const int64_t b = g * G, e1 = std::min(n, b + G);
    s.m_scale[g] = nan_max(m, b, e1);
    if (s.kind == Adamw4Kind::kBlock) s.v_scale[g] = nan_max(v, b, e1);
    for (int64_t e = b; e < e1; ++e) {
      const float vs = s.kind == Adamw4Kind::kBlock ? s.v_scale[g]
                                                    : adamw4::rank1_scale(fresh[e / s.cols], fresh[s.rows + e % s.cols]);
      s.m[e / 2] |= static_cast<uint8_t>(adamw4::encode_m(m[e], s.m_scale[g]) << (4 * (e % 2)));
      s.v[e / 2] |= static_cast<uint8_t>(adamw4::encode_v(v[e], vs) << (4 * (e % 2)));
    }
  }
  return p;
}

void expect_same_states(const Slot& a, const Slot& b, const char* where) {
  EXPECT_EQ(a.m, b.m) << where;
  EXPECT_EQ(a.v, b.v) << where;
  ASSERT_EQ(a.m_scale.size(), b.m_scale.size());
  for (size_t i = 0; i < a.m_scale.size(); ++i) EXPECT_EQ(bits_of(a.m_scale[i]), bits_of(b.m_scale[i])) << where << i;
  if (a.kind == Adamw4Kind::kBlock) {
    for (size_t i = 0; i < a.v_scale.size(); ++i) EXPECT_EQ(bits_of(a.v_scale[i]), bits_of(b.v_scale[i])) << where << i;
  }
  if (a.kind == Adamw4Kind::kRank1) {  // only the buffer this step wrote is defined
    const int64_t rc = a.rows + a.cols, nb = adamw4::new_buffer(adamw::step_count(a.step));
    for (int64_t i = 0; i < rc; ++i)
      EXPECT_EQ(bits_of(a.v_scale[nb * rc + i]), bits_of(b.v_scale[nb * rc + i])) << where << " rowcol " << i;
  }
}

// Several tensors of every kind and odd shapes in one launch, over several steps.
TEST(Adamw4Ref, MatchesWholeTensorOracle) {
  struct Shape {
    int64_t r, c;
    Adamw4Kind k;
  };
  const Shape shapes[] = {{1, 1, Adamw4Kind::kRank1},    {3, 5000, Adamw4Kind::kRank1}, {5000, 3, Adamw4Kind::kRank1},
                          {129, 257, Adamw4Kind::kRank1}, {129, 257, Adamw4Kind::kBlock}, {1, 4097, Adamw4Kind::kBlock},
                          {1, 1, Adamw4Kind::kFull},     {7, 300, Adamw4Kind::kFull},   {1, 129, Adamw4Kind::kBlock}};
  std::vector<Slot> slots;
  for (const Shape& sh : shapes) slots.emplace_back(sh.r, sh.c, sh.k);
  const AdamwConfig c = config();
  for (int it = 1; it <= 4; ++it) {
    std::vector<Slot> want = slots;
    for (size_t i = 0; i < slots.size(); ++i) {
      slots[i].set_grad(normal(slots[i].n, 1e-2f * (1 + i % 3), 100 * it + i));
      slots[i].step = want[i].step = static_cast<float>(it);
      want[i].grad = slots[i].grad;
    }
    int64_t ng = 0;
    std::vector<Adamw4Tensor> ds = descs_of(slots, ng);
    ref::adamw4_step(ds.data(), ds.size(), ng, c);
    for (size_t i = 0; i < slots.size(); ++i) {
      const std::vector<float> p = oracle(want[i], c);
      for (int64_t e = 0; e < slots[i].n; ++e) ASSERT_EQ(slots[i].p(e), p[e]) << "tensor " << i << " element " << e;
      expect_same_states(slots[i], want[i], "oracle");
    }
  }
}

// Every master mode and gradient dtype; threads change nothing; bf16_sr draws coat::adamw_step's bits.
TEST(Adamw4Ref, MasterModesAndThreads) {
  struct Combo {
    DType p, g;
    MasterKind m;
  };
  const Combo combos[] = {{DType::kFloat32, DType::kBFloat16, MasterKind::kNone},
                          {DType::kBFloat16, DType::kBFloat16, MasterKind::kFp32},
                          {DType::kFloat16, DType::kFloat16, MasterKind::kFp32},
                          {DType::kBFloat16, DType::kFloat32, MasterKind::kBf16Sr}};
  for (const Combo& cb : combos) {
    auto run = [&](int threads) {
      std::vector<Slot> slots;
      slots.emplace_back(600, 700, Adamw4Kind::kRank1, cb.p, cb.g, cb.m == MasterKind::kFp32);
      slots.emplace_back(1, 2100 * G + 33, Adamw4Kind::kBlock, cb.p, cb.g, cb.m == MasterKind::kFp32);
      AdamwConfig c = config(cb.p, cb.g, cb.m);
      c.cpu_threads = threads;
      for (int it = 1; it <= 2; ++it) {
        for (Slot& s : slots) s.step = static_cast<float>(it);
        int64_t ng = 0;
        std::vector<Adamw4Tensor> ds = descs_of(slots, ng);
        ref::adamw4_step(ds.data(), ds.size(), ng, c);
      }
      return slots;
    };
    const std::vector<Slot> a = run(1), b = run(4);
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_EQ(a[i].param, b[i].param);
      EXPECT_EQ(a[i].master, b[i].master);
      expect_same_states(a[i], b[i], "threads");
      for (int64_t e = 0; e < a[i].n; e += 97) ASSERT_TRUE(std::isfinite(a[i].p(e)));
    }
  }
}

TEST(Adamw4Ref, StochasticRoundingIsCoatAdamwsAndUnbiased) {
  Slot s(1, 8192, Adamw4Kind::kBlock, DType::kBFloat16, DType::kFloat32, false);
  std::vector<float> p0(s.n, 1.0f);
  s.set_param(p0);
  s.set_grad(std::vector<float>(s.n, 1e-3f));
  AdamwConfig c = config(DType::kBFloat16, DType::kFloat32, MasterKind::kBf16Sr);
  c.lr = 1e-4;  // an update well below bf16's ulp at 1 (2^-7): only rounding can move p
  c.weight_decay = 0.0;
  s.step = 1.0f;
  Adamw4Tensor d = s.desc(0, 99);
  ref::adamw4_step(&d, 1, groups_of(s.n), c);
  const adamw::Scalars sc = adamw::make_scalars(c.lr, c, 1);
  double mean = 0.0;
  for (int64_t e = 0; e < s.n; ++e) {
    float m = 0.0f, v = 0.0f;
    const float exact = adamw::update(1.0f, 1e-3f, m, v, sc);
    const uint64_t r = adamw::sr_bits(99, 1, static_cast<uint64_t>(e / 4));
    ASSERT_EQ(s.p(e), host_bf16_to_float(adamw::bf16_sr(exact, static_cast<uint32_t>(r >> (16 * (e % 4))))));
    mean += s.p(e);
  }
  const double exact = 1.0 - 1e-4;  // m / sqrt(v) = 1 at step 1
  EXPECT_NEAR(mean / s.n, exact, 2e-5);
}

}  // namespace
}  // namespace coat
