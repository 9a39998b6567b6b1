// log2 / exp2 that give bit-identical results on host and device.
//
// Dynamic Range Expansion needs x^k; libm and CUDA's math library round differently, which would
// make the CPU reference and the GPU kernel disagree by an ulp now and then. These versions use
// only IEEE add/mul/div (never contracted into fma: the device helpers are the _rn intrinsics and
// the host is compiled with -ffp-contract=off), so both sides compute the same bits.
// Accuracy: ~1e-6 relative over the whole fp32 range, subnormals included: far finer than the
// FP8 step (>= 6%) that follows every use.
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
// then log2(m) = f P(f), f = m - 1, P a degree-6 fit (relative error ~1e-6, exact 0 at m = 1).
// No division: the optimizer step evaluates several of these per element.
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
  float p = 0.171619684f;
  p = fadd(-0.269318581f, fmul(f, p));
  p = fadd(0.295700043f, fmul(f, p));
  p = fadd(-0.359371781f, fmul(f, p));
  p = fadd(0.480626762f, fmul(f, p));
  p = fadd(-0.721363544f, fmul(f, p));
  p = fadd(1.44269645f, fmul(f, p));
  return fadd(static_cast<float>(e), fmul(f, p));
}

// 2^t. Saturates to +inf at 128 and above and to 0 below -150. t = n + r with |r| <= 1/2, then
// 2^r = 1 + r Q(r), Q a degree-4 fit (relative error ~5e-7), then an exact scaling by 2^n.
COAT_HD float det_exp2(float t) {
  using namespace detail;
  if (!(t < 128.0f)) return t != t ? t : float_of(0x7F800000u);
  if (t < -150.0f) return 0.0f;
  const float n = floorf(fadd(t, 0.5f));
  const float r = fsub(t, n);
  float q = 0.00133335381f;
  q = fadd(0.00966624543f, fmul(r, q));
  q = fadd(0.0555050038f, fmul(r, q));
  q = fadd(0.240223512f, fmul(r, q));
  q = fadd(0.693147123f, fmul(r, q));
  float p = fadd(1.0f, fmul(r, q));
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
