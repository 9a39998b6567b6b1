// Dynamic Range Expansion: per-element encode/decode and the per-group exponent, shared by the
// quantize kernels, the fused AdamW step and their CPU references (host and device give the same
// bits: see fp_math.h).
#pragma once

#include "coat/quantize.h"
#include "fp_math.h"

namespace coat {

COAT_HD float fp8_log2_max(Fp8Format f) {
  return f == Fp8Format::kE4M3 ? 8.80735492f : 15.8073549f;  // log2(448), log2(57344)
}
COAT_HD uint8_t fp8_max_code(Fp8Format f) { return f == Fp8Format::kE4M3 ? 0x7E : 0x7B; }

// |x| that may enter a group's max/min: finite values only.
COAT_HD bool dre_counts(float a) { return a <= 3.40282347e38f; }

// k16 from the group's largest and smallest non-zero finite |x| (mn = +inf when there is none).
COAT_HD uint8_t dre_k16(float mx, float mn, float log2_range) {
  using namespace detail;
  if (!(mx > mn) || !(mn > 0.0f)) return kDreMinK16;  // constant, empty or all-zero group: k is moot
  const float span = fsub(det_log2(mx), det_log2(mn));
  const float k16 = floorf(fdiv(fmul(16.0f, log2_range), span));  // +inf when span rounds to 0
  if (!(k16 < static_cast<float>(kDreMaxK16))) return kDreMaxK16;
  return k16 < static_cast<float>(kDreMinK16) ? kDreMinK16 : static_cast<uint8_t>(k16);
}

// q = fp8(sign(x) fmt_max (|x|/mx)^k), computed as 2^(k (log2|x| - log2 mx) + log2 fmt_max).
COAT_HD uint8_t dre_encode(float x, float mx, uint8_t k16, Fp8Format fmt) {
  using namespace detail;
  const float a = fabsf(x);
  if (a != a) return kFp8NaN;
  if (a == 0.0f) return 0;
  const uint8_t sign = x < 0.0f ? 0x80 : 0x00;
  if (a >= mx) return sign | fp8_max_code(fmt);  // the group max (and +-inf) decode to mx exactly
  const float k = fmul(static_cast<float>(k16), 0.0625f);
  const float t = fadd(fmul(k, fsub(det_log2(a), det_log2(mx))), fp8_log2_max(fmt));
  return encode_fp8(sign ? -det_exp2(t) : det_exp2(t), fmt);
}

// x = sign(q) mx (|q| / fmt_max)^(1/k).
COAT_HD float dre_decode(uint8_t c, float mx, uint8_t k16, Fp8Format fmt) {
  using namespace detail;
  const uint8_t mag = c & 0x7F;
  if (mag == 0) return 0.0f;
  const float sign = (c & 0x80) ? -1.0f : 1.0f;
  if (mag >= fp8_max_code(fmt)) {
    if (fmt == Fp8Format::kE4M3 ? mag == 0x7F : mag > 0x7C) return float_of(0x7FC00000u);  // NaN
    return sign * mx;
  }
  const float lq = det_log2(decode_fp8(mag, fmt));
  const float k = fmul(static_cast<float>(k16), 0.0625f);
  const float t = fadd(det_log2(mx), fdiv(fsub(lq, fp8_log2_max(fmt)), k));
  return sign * det_exp2(t);
}

}  // namespace coat
