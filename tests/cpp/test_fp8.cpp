// Host FP8 / bf16 / fp16 conversions and the deterministic log2/exp2.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "common/fp8.h"
#include "common/fp_math.h"

using namespace coat;

namespace {

bool is_nan_code(uint8_t c, Fp8Format f) {
  const uint8_t m = c & 0x7F;
  return f == Fp8Format::kE4M3 ? m == 0x7F : m > 0x7C;
}

}  // namespace

// GoogleTest prints a parameter without PrintTo as its bytes, and gtest_discover_tests puts that
// print in the CTest name ("Formats/Fp8Codes.EveryCodeRoundTrips/4-byte object <00-00 00-00>").
// Found by argument-dependent lookup, hence in namespace coat.
namespace coat {
void PrintTo(Fp8Format f, std::ostream* os) { *os << (f == Fp8Format::kE4M3 ? "E4M3" : "E5M2"); }
}  // namespace coat

class Fp8Codes : public ::testing::TestWithParam<Fp8Format> {};

TEST_P(Fp8Codes, EveryCodeRoundTrips) {
  const Fp8Format f = GetParam();
  for (int c = 0; c < 256; ++c) {
    const float v = decode_fp8(static_cast<uint8_t>(c), f);
    const uint8_t back = encode_fp8(v, f);
    if (is_nan_code(static_cast<uint8_t>(c), f)) {
      EXPECT_TRUE(std::isnan(v));
      EXPECT_EQ(back, kFp8NaN);
    } else if (f == Fp8Format::kE5M2 && (c & 0x7F) == 0x7C) {
      EXPECT_TRUE(std::isinf(v));
      EXPECT_EQ(back, (c & 0x80) | 0x7B) << "infinity saturates to the max finite code";
    } else {
      EXPECT_EQ(back, c) << "code " << c << " value " << v;
    }
  }
}

TEST_P(Fp8Codes, SaturatesAndRoundsHalfToEven) {
  const Fp8Format f = GetParam();
  const float mx = fp8_max(f);
  EXPECT_EQ(decode_fp8(encode_fp8(mx * 4.0f, f), f), mx);
  EXPECT_EQ(decode_fp8(encode_fp8(-INFINITY, f), f), -mx);
  // Every midpoint between neighbouring positive finite codes rounds to the even code.
  const uint8_t top = f == Fp8Format::kE4M3 ? 0x7E : 0x7B;
  for (uint8_t c = 0; c < top; ++c) {
    const float lo = decode_fp8(c, f), hi = decode_fp8(static_cast<uint8_t>(c + 1), f);
    const float mid = 0.5f * (lo + hi);
    EXPECT_EQ(encode_fp8(mid, f), (c % 2 == 0) ? c : c + 1) << "between codes " << int(c);
    EXPECT_EQ(encode_fp8(std::nextafter(mid, 0.0f), f), c);
    EXPECT_EQ(encode_fp8(std::nextafter(mid, 1e9f), f), c + 1);
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, Fp8Codes, ::testing::Values(Fp8Format::kE4M3, Fp8Format::kE5M2));

TEST(Half, EveryCodeRoundTrips) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float v = host_half_to_float(static_cast<uint16_t>(h));
    if (std::isnan(v)) continue;
    EXPECT_EQ(host_float_to_half(v), h);
  }
}

TEST(Half, RoundsToNearestEven) {
  EXPECT_EQ(host_float_to_half(65520.0f), 0x7C00);  // exactly halfway to 2^16: rounds to inf
  EXPECT_EQ(host_float_to_half(65519.99f), 0x7BFF);
  EXPECT_EQ(host_float_to_half(1.0f + 1.0f / 2048.0f), 0x3C00);  // tie -> even
  EXPECT_EQ(host_float_to_half(1.0f + 3.0f / 2048.0f), 0x3C02);
  EXPECT_EQ(host_float_to_half(2.98023224e-8f), 0x0000);  // 2^-25: tie between 0 and 2^-24
}

TEST(Bf16, RoundTripsAndRounds) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const float v = host_bf16_to_float(static_cast<uint16_t>(b));
    if (std::isnan(v)) continue;
    EXPECT_EQ(host_float_to_bf16(v), b);
  }
  EXPECT_EQ(host_float_to_bf16(1.0f + 1.0f / 256.0f), 0x3F80);  // tie -> even
  EXPECT_TRUE(std::isnan(host_bf16_to_float(host_float_to_bf16(NAN))));
}

// The optimizer kernels' packed amax of four bf16 values against finite_abs, value by value: every
// bf16 pattern in every slot (the other three random, NaN, Inf, zeros and large finite values among
// them), and quads with no finite value.
TEST(Bf16, PackedFiniteAmaxEqualsFiniteAbs) {
  std::mt19937 rng(5);
  const uint16_t special[] = {0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFFF, 0x7F7F, 0xFF7F, 0x0001, 0x3F80};
  auto draw = [&]() -> uint16_t { return rng() % 3 == 0 ? special[rng() % 10] : static_cast<uint16_t>(rng()); };
  for (int slot = 0; slot < 4; ++slot) {
    for (uint32_t b = 0; b < 65536; ++b) {
      uint16_t h[4] = {draw(), draw(), draw(), draw()};
      h[slot] = static_cast<uint16_t>(b);
      float want = 0.0f;
      for (uint16_t x : h) want = std::max(want, finite_abs(host_bf16_to_float(x)));
      const uint32_t lo = h[0] | (uint32_t{h[1]} << 16), hi = h[2] | (uint32_t{h[3]} << 16);
      ASSERT_EQ(bits_of(bf16x4_finite_amax(lo, hi)), bits_of(want)) << std::hex << h[0] << " " << h[1] << " " << h[2]
                                                                     << " " << h[3];
    }
  }
  EXPECT_EQ(bf16x4_finite_amax(0x7F80FF80u, 0x7FC0FFFFu), 0.0f);  // Inf, -Inf, NaN, -NaN
  EXPECT_EQ(bf16x4_finite_amax(0x80000000u, 0x00000000u), 0.0f);
  EXPECT_EQ(bf16x4_finite_amax(0x7F80FF7Fu, 0x7FC00001u), host_bf16_to_float(0x7F7F));
}

TEST(DetMath, Log2AndExp2AreAccurate) {
  std::mt19937 rng(1234);
  std::uniform_int_distribution<uint32_t> bits(1, 0x7F7FFFFFu);
  double worst_log = 0, worst_exp = 0;
  for (int i = 0; i < 200000; ++i) {
    const float x = float_of(bits(rng));  // any positive finite, subnormals included
    const double ref = std::log2(static_cast<double>(x));
    worst_log = std::max(worst_log, std::fabs(det_log2(x) - ref) / std::max(1.0, std::fabs(ref)));
    const float t = static_cast<float>(std::ldexp(static_cast<double>(bits(rng) % 1000000), -12)) - 120.0f;
    const double eref = std::exp2(static_cast<double>(t));
    worst_exp = std::max(worst_exp, std::fabs(det_exp2(t) - eref) / eref);
  }
  EXPECT_LT(worst_log, 3e-6);
  EXPECT_LT(worst_exp, 2e-6);
  EXPECT_EQ(det_log2(1.0f), 0.0f);
  EXPECT_EQ(det_exp2(0.0f), 1.0f);
  EXPECT_EQ(det_exp2(-200.0f), 0.0f);
  EXPECT_TRUE(std::isinf(det_exp2(129.0f)));
}
