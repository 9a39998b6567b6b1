// Scalar pieces of the 4-bit AdamW step (coat/adamw4.h), shared by the CPU reference and the CUDA
// kernel. The update is adamw::update, the FP8 step's: on the device its square root and division,
// and the encoders' reciprocals (recip below), come from the hardware approximations and the kernel
// keeps fma and flushes subnormals (-ftz=true); the host computes them correctly rounded. The step
// is instruction-bound, and the IEEE sequences cost ~20 instructions each (section 14 of
// benchmarks/RESULTS.md). So fp32 values agree to a few ulp, and a code may sit one step away where
// its normalized moment lies on a midpoint (tests/cpp/test_adamw4_gpu.cpp states the contract).
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <string>

#include "adamw/adamw_math.h"
#include "coat/adamw4.h"
#include "common/fp8.h"

namespace coat {
namespace adamw4 {

constexpr int kCodes = 16;
constexpr int kZeroCodeM = 7;  // m's map value 0
constexpr uint32_t kNanBits = 0x7FC00000u;

// m's signed dynamic-exponent map (sorted): per decade 10^-2, 10^-1, 10^0 the midpoints of 1, 2 and
// 4 linear steps over [0.1, 1], both signs, plus 0 and 1.
COAT_HD float m_level(int c) {
  switch (c) {
    case 0: return -0.8875f;
    case 1: return -0.6625f;
    case 2: return -0.4375f;
    case 3: return -0.2125f;
    case 4: return -0.0775f;
    case 5: return -0.0325f;
    case 6: return -0.0055f;
    case 7: return 0.0f;
    case 8: return 0.0055f;
    case 9: return 0.0325f;
    case 10: return 0.0775f;
    case 11: return 0.2125f;
    case 12: return 0.4375f;
    case 13: return 0.6625f;
    case 14: return 0.8875f;
    default: return 1.0f;
  }
}

// v's linear map without zero: (c + 1) / 16 (exact in fp32).
COAT_HD float v_level(int c) { return static_cast<float>(c + 1) * 0.0625f; }

// The boundary between codes k and k + 1 (k in [0, 14]): a normalized value >= it takes code k + 1.
COAT_HD float m_mid(int k) { return (m_level(k) + m_level(k + 1)) * 0.5f; }
COAT_HD float v_mid(int k) { return static_cast<float>(2 * k + 3) * 0.03125f; }

// A scale that values can be encoded against: normal, finite and > 0. A block (row, column) whose
// scale is 0 (all zero), subnormal (all below 2^-126: its reciprocal overflows) or NaN (non-finite
// moments) stores the zero code of m, code 0 of v.
COAT_HD bool usable_scale(float s) { return s >= FLT_MIN && s <= FLT_MAX; }

// 1 / s (dre.h's fast_rcp: correctly rounded on the host, the hardware's ~1-ulp approximation on
// the device). A block shares its reciprocal, so the kernel takes one per block (per element for
// rank-1 v).
COAT_HD float recip(float s) { return fast_rcp(s); }

// A value is normalized as x = value * (1 / s).
COAT_HD float normalized(float value, float s) { return value * recip(s); }

// Code of m for the block absmax s: nearest map value of the normalized m, ties up.
COAT_HD int encode_m(float m, float s) {
  if (!usable_scale(s)) return kZeroCodeM;
  const float x = normalized(m, s);
  int c = 0;
  for (int k = 0; k < kCodes - 1; ++k) c += x >= m_mid(k) ? 1 : 0;
  return c;
}

// Code of v (>= 0) for the scale s (block absmax or min(row max, column max)): nearest of
// (c + 1) / 16 to the normalized v, ties up.
COAT_HD int encode_v(float v, float s) {
  if (!usable_scale(s)) return 0;
  const float x = normalized(v, s);
  int c = 0;
  for (int k = 0; k < kCodes - 1; ++k) c += x >= v_mid(k) ? 1 : 0;
  return c;
}

// The encoders the step runs (CPU reference and kernel alike), equal to encode_m / encode_v above
// for every input (tests/cpp/test_adamw4_ref.cpp checks them against each other); r = 1 / s,
// computed once per block (m, v of kBlock) or per element (v of kRank1):
// - m: by a table of buckets. x = m r is clamped to [-1, 1] (NaN to -1, code 0 as encode_m gives;
//   no midpoint lies outside, so the code does not change), y = x + 2 in [1, 3] and the bucket is
//   y's bits >> kMShift: 2^-7 wide below x = 0, 2^-6 above. Each bucket holds at most one midpoint,
//   and none lies within y's rounding error (2^-23) of a bucket edge, so the rounding of x + 2 moves
//   no value across a midpoint and code = the bucket's base (midpoints below it) + (x >= its
//   midpoint): one table load and one comparison (the kernel keeps the 193 buckets in shared
//   memory), where a binary search over the midpoints took four.
// - v: the midpoints (2k + 3) / 32 are found arithmetically (encode_v_fast).
// Both are written as selects, not branches (every element runs them).
struct MBucket {
  float mid;  // the midpoint inside the bucket, +Inf where none
  int base;   // midpoints below the bucket
};
constexpr int kMShift = 16;
constexpr uint32_t kMFirst = 0x3F800000u >> kMShift;  // y = 1: x = -1
constexpr int kMBuckets = static_cast<int>((0x40400000u >> kMShift) - kMFirst) + 1;  // through y = 3: x = 1

// The lowest x of bucket i (exact: a bucket edge minus 2).
COAT_HD float m_bucket_x(int i) { return float_of((kMFirst + static_cast<uint32_t>(i)) << kMShift) - 2.0f; }

COAT_HD MBucket m_bucket(int i) {
  const float lo = m_bucket_x(i), hi = i + 1 < kMBuckets ? m_bucket_x(i + 1) : FLT_MAX;
  MBucket b{INFINITY, 0};
  for (int k = 0; k < kCodes - 1; ++k) {
    const float mid = m_mid(k);
    if (mid < lo) ++b.base;
    else if (mid < hi) b.mid = mid;
  }
  return b;
}

COAT_HD int m_bucket_of(float x) { return static_cast<int>((bits_of(x + 2.0f) >> kMShift) - kMFirst); }

COAT_HD int encode_m_table(float m, float s, float r, const MBucket* table) {
  const float x = fminf(fmaxf(m * r, -1.0f), 1.0f);
  const MBucket b = table[m_bucket_of(x)];
  const int c = b.base + (x >= b.mid ? 1 : 0);
  return usable_scale(s) ? c : kZeroCodeM;
}

COAT_HD int encode_v_fast(float v, float s, float r) {
  // floor((y - 3) / 2) + 1 = floor(z) with z = (y - 1) / 2 = 16 x - 0.5, exact for y >= 1 (as y - 3
  // above); below that z < 0 and the code is 0. fmaxf takes NaN to 0 and fminf +Inf to 15 (the
  // device's FMNMX does the same), so the clamp is two min / max and a truncation.
  const float z = (v * r) * 16.0f - 0.5f;
  const int c = static_cast<int>(fminf(fmaxf(z, 0.0f), 15.0f));
  return usable_scale(s) ? c : 0;
}

// v_level(c) in one fused multiply-add on the float 2^23 + c (bits 0x4B000000 | c): (2^23 + c) / 16
// - (2^19 - 1/16) = (c + 1) / 16 exactly, so it equals v_level; the kernels decode with it where an
// integer add and a conversion took two more instructions (c in [0, 15]; the mask and the or are
// one instruction).
COAT_HD float v_level_of_bits(uint32_t c) { return fmaf(float_of(0x4B000000u | c), 0.0625f, -524287.9375f); }

COAT_HD float decode_m(int c, float s) { return m_level(c) * s; }
COAT_HD float decode_v(int c, float s) {
#if defined(__CUDA_ARCH__)
  return v_level_of_bits(static_cast<uint32_t>(c)) * s;
#else
  return v_level(c) * s;  // the host's fmaf may be a library call
#endif
}

// A moment's contribution to a max: the bits of |x| for finite x, of the canonical NaN otherwise.
// Maxima are taken on these bits as unsigned integers (the order of non-negative floats), so a
// non-finite moment makes its block's (row's, column's) scale NaN; an atomic max on the device
// gives the same result as the host's loop in any order.
COAT_HD uint32_t max_key(float x) {
  const float a = fabsf(x);
  return a <= FLT_MAX ? bits_of(a) : kNanBits;
}

COAT_HD uint32_t umax(uint32_t a, uint32_t b) { return a > b ? a : b; }

// max(a, b), NaN if either is NaN. A block's maximum is taken on floats with it and turned into a
// key once (max_key of the result is the max of the elements' keys: NaN and +Inf both give the
// NaN key, as they do element by element), where a key per element took four instructions.
COAT_HD float nan_max(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  if (a != a || b != b) return float_of(kNanBits);
  return a > b ? a : b;
#endif
}

// max_key of a value in [+0, +Inf] or NaN from its bits: unsigned order of such bits is value order
// with NaN on top, so the kernels reduce a warp's raw bits (one redux) and take the key once.
COAT_HD uint32_t key_of_bits(uint32_t u) { return u >= 0x7F800000u ? kNanBits : u; }

// min(row max, column max), NaN if either is NaN (both are >= +0 or the canonical NaN). On the
// device one min.NaN instead of two comparisons and two selects (the step takes eight per lane).
COAT_HD float rank1_scale(float r, float c) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float s;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(s) : "f"(r), "f"(c));
  return s;
#else
  if (r != r || c != c) return float_of(kNanBits);
  return r < c ? r : c;
#endif
}

// Nibble c of element e in packed codes (element 2i low, 2i + 1 high).
COAT_HD int nibble(const uint8_t* codes, int64_t e) {
  const uint8_t b = codes[e >> 1];
  return (e & 1) ? (b >> 4) : (b & 0xF);
}

// v's update alone, as adamw::update computes it: the statistics pass needs nothing else. On the
// device the two may contract differently and land an ulp apart; a v an ulp above its row's or
// column's maximum normalizes to just above 1 and takes the top code, as the maximum itself does.
COAT_HD float new_v(float v, float g, const adamw::Scalars& s) { return v * s.beta2 + (s.w2 * g) * g; }

// Rank-1 statistics buffers of step t (t >= 1): decode with the ones step t - 1 wrote, write the
// other. Each buffer is rows + cols floats (rows first).
COAT_HD int old_buffer(uint64_t t) { return static_cast<int>((t + 1u) & 1u); }
COAT_HD int new_buffer(uint64_t t) { return static_cast<int>(t & 1u); }

// The scale of v at element (row i, column j) of local group lg: the block absmax (kBlock), or
// min(row max, column max) from rank-1 buffer `buffer` (kRank1; i, j unused for kBlock).
COAT_HD float v_scale_of(const Adamw4Tensor& d, int64_t lg, int64_t i, int64_t j, int buffer) {
  if (d.kind == Adamw4Kind::kBlock) return d.v_scale[lg];
  const float* r = d.v_scale + buffer * (d.rows + d.cols);
  return rank1_scale(r[i], r[d.rows + j]);
}

struct Moments {
  float m, v;
};

// The decoded moments of element e (group lg, row i, column j) before step t's update.
COAT_HD Moments old_moments(const Adamw4Tensor& d, int64_t lg, int64_t e, int64_t i, int64_t j, uint64_t t) {
  if (d.kind == Adamw4Kind::kFull) return {static_cast<const float*>(d.m)[e], static_cast<const float*>(d.v)[e]};
  const float m = decode_m(nibble(static_cast<const uint8_t*>(d.m), e), d.m_scale[lg]);
  const float vs = v_scale_of(d, lg, i, j, old_buffer(t));
  return {m, decode_v(nibble(static_cast<const uint8_t*>(d.v), e), vs)};
}

// Division of n < 2^31 by d in [1, 2^31) through a multiply-high (the kernel's row of an element):
// with s = floor(log2 d) and m = floor(2^(32 + s) / d) (capped at 2^32 - 1), q' = (n m) >> (32 + s)
// is n / d or one less, because n m / 2^(32 + s) > n / d - n / 2^(32 + s) > n / d - 1/2; one
// comparison corrects it.
COAT_HD void make_magic(uint32_t d, uint32_t& magic, int& shift) {
  int s = 0;
  while ((uint64_t{2} << s) <= d) ++s;
  const uint64_t m = (uint64_t{1} << (32 + s)) / d;
  magic = m > 0xFFFFFFFFull ? 0xFFFFFFFFu : static_cast<uint32_t>(m);
  shift = s;
}

COAT_HD uint32_t div_magic(uint32_t n, uint32_t d, uint32_t magic, int shift) {
#if defined(__CUDA_ARCH__)
  const uint32_t q = __umulhi(n, magic) >> shift;
#else
  const uint32_t q = static_cast<uint32_t>((uint64_t{n} * magic) >> 32) >> shift;
#endif
  return n - q * d >= d ? q + 1 : q;
}

COAT_HD int64_t groups_of(int64_t n) { return (n + kAdamw4Block - 1) / kAdamw4Block; }

}  // namespace adamw4

namespace detail {

// Descriptor checks of the CPU reference and the launcher (the launcher cannot read device
// descriptors, so it checks only the counts; Python builds the rows from tensors it validated).
inline void check_adamw4_descriptor(const Adamw4Tensor& d, int64_t i, int64_t next, MasterKind master) {
  const std::string at = "tensor descriptor " + std::to_string(i);
  COAT_CHECK_ARG(d.numel > 0, at + ": numel must be > 0");
  COAT_CHECK_ARG(d.group_begin == next, at + ": group_begin must be " + std::to_string(next));
  COAT_CHECK_ARG(d.param && d.grad && d.m && d.v && d.step, at + ": null pointer");
  COAT_CHECK_ARG((master == MasterKind::kFp32) == (d.master != nullptr),
                 at + ": master must be given exactly for an fp32 master");
  const int64_t k = static_cast<int64_t>(d.kind);
  COAT_CHECK_ARG(k >= 0 && k <= 2, at + ": kind must be 0 (full), 1 (block) or 2 (rank1), got " + std::to_string(k));
  if (d.kind == Adamw4Kind::kFull) {
    COAT_CHECK_ARG(d.m_scale == nullptr && d.v_scale == nullptr, at + ": a full-precision state has no scales");
  } else {
    COAT_CHECK_ARG(d.m_scale && d.v_scale, at + ": null scale pointer");
  }
  if (d.kind == Adamw4Kind::kRank1) {
    COAT_CHECK_ARG(d.rows > 0 && d.cols > 0 && d.rows * d.cols == d.numel,
                   at + ": rank-1 rows x cols must equal numel");
  }
}

}  // namespace detail
}  // namespace coat
