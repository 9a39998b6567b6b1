// log2 / exp2 that give bit-identical results on host and device.
//
// Dynamic Range Expansion needs x^k; libm and CUDA's math library round differently, which would
// make the CPU reference and the GPU kernel disagree by an ulp now and then. These versions use
// only IEEE add/mul/div (never contracted into fma: the device helpers are the _rn intrinsics and
// the host is compiled with -ffp-contract=off), so both sides compute the same bits.
// Accuracy: a few ulp over the whole fp32 range, subnormals included.
#pragma once

#include "fp8.h"

namespace coat {
namespace detail {

#if defined(__CUDA_ARCH__)
COAT_HD float fmul(float a, float b) { return __fmul_rn(a, b); }
COAT_HD float fadd(float a, float b) { return __fadd_rn(a, b); }
COAT_HD float fsub(float a, float b) { return __fsub_rn(a, b); }
COAT_HD float fdiv(float a, float b) { return __fdiv_rn(a, b); }
#else
inline float fmul(float a, float b) { return a * b; }
inline float fadd(float a, float b) { return a + b; }
inline float fsub(float a, float b) { return a - b; }
inline float fdiv(float a, float b) { return a / b; }
#endif

}  // namespace detail

// log2(x) for finite x > 0 (subnormals included). Reduces x = m 2^e with m in [sqrt(1/2), sqrt(2)),
// then log(m) = 2 atanh(s), s = (m-1)/(m+1), |s| < 0.172, by its odd series through s^11.
COAT_HD float det_log2(float x) {
  using namespace detail;
  uint32_t u = bits_of(x);
  int e = 0;
  if (u < 0x00800000u) {  // subnormal: scale into the normal range first (exact)
    u = bits_of(fmul(x, 8388608.0f));
    e = -23;
  }
  e += static_cast<int>(u >> 23) - 127;
  float m = float_of((u & 0x007FFFFFu) | 0x3F800000u);
  if (m > 1.41421356f) {
    m = fmul(m, 0.5f);
    e += 1;
  }
  const float f = fsub(m, 1.0f);
  const float s = fdiv(f, fadd(2.0f, f));
  const float z = fmul(s, s);
  float p = 0.0909090909f;                       // 1/11
  p = fadd(0.111111111f, fmul(z, p));            // 1/9
  p = fadd(0.142857143f, fmul(z, p));            // 1/7
  p = fadd(0.2f, fmul(z, p));                    // 1/5
  p = fadd(0.333333333f, fmul(z, p));            // 1/3
  const float ln_m = fadd(fmul(2.0f, s), fmul(fmul(2.0f, s), fmul(z, p)));
  return fadd(static_cast<float>(e), fmul(ln_m, 1.44269504f));
}

// 2^t. Saturates to +inf above 128 and to 0 below -150. t = n + r with |r| <= 1/2, then
// e^(r ln2) by its Taylor series through degree 8, then an exact scaling by 2^n.
COAT_HD float det_exp2(float t) {
  using namespace detail;
  if (!(t < 128.0f)) return t != t ? t : float_of(0x7F800000u);
  if (t < -150.0f) return 0.0f;
  const float n = floorf(fadd(t, 0.5f));
  const float r = fsub(t, n);
  const float u = fmul(r, 0.693147181f);
  float p = 2.48015873e-5f;                      // 1/8!
  p = fadd(1.98412698e-4f, fmul(u, p));          // 1/7!
  p = fadd(1.38888889e-3f, fmul(u, p));          // 1/6!
  p = fadd(8.33333333e-3f, fmul(u, p));          // 1/5!
  p = fadd(4.16666667e-2f, fmul(u, p));          // 1/4!
  p = fadd(1.66666667e-1f, fmul(u, p));          // 1/3!
  p = fadd(0.5f, fmul(u, p));
  p = fadd(1.0f, fmul(u, p));
  p = fadd(1.0f, fmul(u, p));
  int ni = static_cast<int>(n);
  // Apply 2^ni in at most two steps: 2^128 itself is not a float, and results in the subnormal
  // range must not be flushed.
  if (ni > 127) {
    p = fmul(p, 2.0f);
    ni -= 1;
  }
  if (ni < -126) {
    p = fmul(p, 1.17549435e-38f);  // 2^-126
    ni += 126;
  }
  return fmul(p, float_of(static_cast<uint32_t>(ni + 127) << 23));
}

}  // namespace coat
