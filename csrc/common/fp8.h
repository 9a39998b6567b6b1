// Scalar conversions between fp32 and FP8 / bf16 / fp16, identical on host and device.
//
// Device code uses the cuda_fp8.h / cuda_bf16.h intrinsics; host code uses coat's own bit-exact
// versions so that a build without the CUDA toolkit works and the CPU reference produces the same
// codes as the GPU. Rounding: nearest-even; FP8 encoding saturates finite and infinite values to
// the format's max magnitude; every NaN becomes the canonical code 0x7F (as the hardware does).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "coat/common.h"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#define COAT_HD __host__ __device__ __forceinline__
#else
#define COAT_HD inline
#endif

namespace coat {

constexpr float kE4M3Max = 448.0f;
constexpr float kE5M2Max = 57344.0f;
constexpr uint8_t kFp8NaN = 0x7F;

COAT_HD float fp8_max(Fp8Format f) { return f == Fp8Format::kE4M3 ? kE4M3Max : kE5M2Max; }

COAT_HD uint32_t bits_of(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

COAT_HD float float_of(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// ---- FP8 -----------------------------------------------------------------------------------

// Host encoder: nearest-even on the fp32 bit pattern for the normal range, exact power-of-two
// scaling plus nearbyint for the FP8 subnormal range.
inline uint8_t host_encode_fp8(float f, Fp8Format fmt) {
  const uint32_t u = bits_of(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t ab = u & 0x7FFFFFFFu;
  if (ab > 0x7F800000u) return kFp8NaN;
  const bool e4 = fmt == Fp8Format::kE4M3;
  const int mant = e4 ? 3 : 2;
  const int bias = e4 ? 7 : 15;
  const uint8_t max_code = e4 ? 0x7E : 0x7B;
  const float a = float_of(ab);
  if (a >= fp8_max(fmt)) return sign | max_code;
  const int emin = 1 - bias;
  if (a < std::ldexp(1.0f, emin)) {
    // Multiplying by a power of two is exact here; nearbyint rounds half to even.
    const float q = std::nearbyint(a * std::ldexp(1.0f, mant - emin));
    return sign | static_cast<uint8_t>(q);
  }
  const int shift = 23 - mant;
  uint32_t r = ab + ((1u << (shift - 1)) - 1u) + ((ab >> shift) & 1u);
  r >>= shift;
  r -= static_cast<uint32_t>(127 - bias) << mant;
  return sign | static_cast<uint8_t>(r);
}

constexpr float host_decode_fp8_value(uint8_t c, bool e4) {
  const int mant = e4 ? 3 : 2;
  const int bias = e4 ? 7 : 15;
  const int exp_bits = (c >> mant) & (e4 ? 0xF : 0x1F);
  const int m = c & ((1 << mant) - 1);
  const float sign = (c & 0x80) ? -1.0f : 1.0f;
  if (e4 && exp_bits == 0xF && m == 0x7) return __builtin_nanf("");
  if (!e4 && exp_bits == 0x1F) return m == 0 ? sign * __builtin_huge_valf() : __builtin_nanf("");
  float v = 0.0f;
  if (exp_bits == 0) {
    v = static_cast<float>(m);
    for (int i = 0; i < bias - 1 + mant; ++i) v *= 0.5f;
  } else {
    v = 1.0f + static_cast<float>(m) / static_cast<float>(1 << mant);
    int e = exp_bits - bias;
    for (; e > 0; --e) v *= 2.0f;
    for (; e < 0; ++e) v *= 0.5f;
  }
  return sign * v;
}

COAT_HD uint8_t encode_fp8(float f, Fp8Format fmt) {
#if defined(__CUDA_ARCH__)
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(
      f, __NV_SATFINITE, fmt == Fp8Format::kE4M3 ? __NV_E4M3 : __NV_E5M2));
#else
  return host_encode_fp8(f, fmt);
#endif
}

COAT_HD float decode_fp8(uint8_t c, Fp8Format fmt) {
#if defined(__CUDA_ARCH__)
  __half_raw h = __nv_cvt_fp8_to_halfraw(c, fmt == Fp8Format::kE4M3 ? __NV_E4M3 : __NV_E5M2);
  return __half2float(__half(h));
#else
  return host_decode_fp8_value(c, fmt == Fp8Format::kE4M3);
#endif
}

// ---- bf16 / fp16 ---------------------------------------------------------------------------

inline float host_bf16_to_float(uint16_t b) { return float_of(static_cast<uint32_t>(b) << 16); }

inline uint16_t host_float_to_bf16(float f) {
  const uint32_t u = bits_of(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline float host_half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu;
  const uint32_t m = h & 0x3FFu;
  if (e == 0x1F) return float_of(sign | 0x7F800000u | (m << 13));
  if (e == 0) {
    // Subnormal (or zero): m * 2^-24, exact in fp32.
    const float v = static_cast<float>(m) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return float_of(sign | ((e + 112u) << 23) | (m << 13));
}

inline uint16_t host_float_to_half(float f) {
  const uint32_t u = bits_of(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t ab = u & 0x7FFFFFFFu;
  if (ab > 0x7F800000u) return sign | 0x7E00u;
  if (ab >= 0x477FF000u) return sign | 0x7C00u;  // rounds to >= 65520: infinity
  const float a = float_of(ab);
  if (a < 6.103515625e-5f) {  // fp16 subnormal range: quantum 2^-24, exact scaling
    return sign | static_cast<uint16_t>(std::nearbyint(a * 16777216.0f));
  }
  uint32_t r = ab + 0xFFFu + ((ab >> 13) & 1u);
  r >>= 13;
  r -= 112u << 10;
  return sign | static_cast<uint16_t>(r);
}

// Load one element of type T as fp32 / store fp32 as T, on host or device.
template <typename T>
struct Elem;

template <>
struct Elem<float> {
  static COAT_HD float load(float v) { return v; }
  static COAT_HD float store(float v) { return v; }
};

#if defined(__CUDACC__)
using bf16_t = __nv_bfloat16;
using fp16_t = __half;
template <>
struct Elem<bf16_t> {
  static __device__ __forceinline__ float load(bf16_t v) { return __bfloat162float(v); }
  static __device__ __forceinline__ bf16_t store(float v) { return __float2bfloat16_rn(v); }
};
template <>
struct Elem<fp16_t> {
  static __device__ __forceinline__ float load(fp16_t v) { return __half2float(v); }
  static __device__ __forceinline__ fp16_t store(float v) { return __float2half_rn(v); }
};
#endif

// Host-side element wrappers (16-bit storage types carried as raw bits).
struct HostBf16 { uint16_t bits; };
struct HostFp16 { uint16_t bits; };
template <>
struct Elem<HostBf16> {
  static inline float load(HostBf16 v) { return host_bf16_to_float(v.bits); }
  static inline HostBf16 store(float v) { return HostBf16{host_float_to_bf16(v)}; }
};
template <>
struct Elem<HostFp16> {
  static inline float load(HostFp16 v) { return host_half_to_float(v.bits); }
  static inline HostFp16 store(float v) { return HostFp16{host_float_to_half(v)}; }
};

// Power-of-two (E8M0) scale: the smallest 2^e >= amax / fmt_max, so no element saturates.
// Stored as the biased exponent e + 127, clamped to [1, 254] (2^-126 .. 2^127).
COAT_HD uint8_t e8m0_scale_for(float amax, Fp8Format fmt) {
  if (!(amax > 0.0f) || amax > 3.0e38f) return 127;  // zero / non-finite group -> scale 1
  const float r = amax / fp8_max(fmt);
  const uint32_t u = bits_of(r);
  int e = static_cast<int>((u >> 23) & 0xFF);
  if (e == 0) return 1;  // below 2^-126: the smallest normal scale is used
  if ((u & 0x7FFFFFu) != 0) ++e;  // round up to the next power of two
  if (e > 254) e = 254;
  return static_cast<uint8_t>(e);
}
COAT_HD float e8m0_to_float(uint8_t b) { return float_of(static_cast<uint32_t>(b) << 23); }

// |v| for finite v, 0 for NaN and infinities: what enters an amax (no scale can represent them).
COAT_HD float finite_abs(float v) {
  const float a = fabsf(v);
  return a <= 3.4028234663852886e38f ? a : 0.0f;  // NaN and inf compare false
}

// finite_abs's maximum over four bf16 values packed two to a word (value bits in each 16-bit half),
// as a float. A half's |value| bits plus 0x80 are below 0x8000 exactly when the value is finite, so
// as signed 16-bit integers the non-finite ones sort below every finite one and one packed max
// (max.s16x2 on the device) orders a pair of values; no carry crosses a half. The optimizer kernels
// fold the values they write into a weight's amax with this, where a select chain per value took
// four instructions.
COAT_HD uint32_t max_s16x2(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t r;
  asm("max.s16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
#else
  const auto half = [](uint32_t x, int sh) { return static_cast<int16_t>(static_cast<uint16_t>(x >> sh)); };
  const uint32_t lo = static_cast<uint16_t>(half(a, 0) > half(b, 0) ? half(a, 0) : half(b, 0));
  const uint32_t hi = static_cast<uint16_t>(half(a, 16) > half(b, 16) ? half(a, 16) : half(b, 16));
  return lo | (hi << 16);
#endif
}

COAT_HD float bf16x4_finite_amax(uint32_t lo, uint32_t hi) {
  const uint32_t w = max_s16x2((lo & 0x7FFF7FFFu) + 0x00800080u, (hi & 0x7FFF7FFFu) + 0x00800080u);
  const int32_t a = static_cast<int32_t>(w << 16), b = static_cast<int32_t>(w & 0xFFFF0000u);
  const int32_t top = a > b ? a : b;  // (the largest finite |value| + 0x80) << 16; below 0x80 << 16: none
  return top >= 0x00800000 ? float_of(static_cast<uint32_t>(top - 0x00800000)) : 0.0f;
}

// fp32 per-tensor / per-group scale: max(amax / fmt_max, 2^-126), 1 when amax is 0 (or not
// finite). The floor keeps 1 / scale finite: below it a tiny amax would give an infinite inverse,
// zeros would become NaN codes (0 * inf) and everything else would saturate.
constexpr float kMinScale = 1.17549435e-38f;  // 2^-126
COAT_HD float scale_for(float amax, Fp8Format fmt) {
  return (amax > 0.0f && amax <= 3.4028234663852886e38f) ? fmaxf(amax / fp8_max(fmt), kMinScale) : 1.0f;
}

}  // namespace coat
