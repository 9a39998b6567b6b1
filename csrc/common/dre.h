// Dynamic Range Expansion: per-group parameters and per-element encode/decode, shared by the
// quantize kernels, the fused AdamW step and their CPU references (host and device give the same
// bits: see fp_math.h). Per-group work (log2 of the group max, 1/k) is hoisted into DreGroup; the
// log2 of an FP8 code's magnitude comes from a 128-entry table (dre_log2_code) that kernels keep in
// shared memory, so decoding costs one exp2.
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

// log2 of the span from the format's max to its smallest normal: compression (k < 1) maps a group's
// smallest value there, where the format still has all its mantissa bits.
COAT_HD float fp8_log2_normal_range(Fp8Format f) {
  return f == Fp8Format::kE4M3 ? 14.807354922f : 29.807354922f;  // log2(448 / 2^-6), log2(57344 / 2^-14)
}
// The smallest non-zero magnitude of a format: where a non-zero value that would round to zero goes.
COAT_HD float fp8_min_subnormal(Fp8Format f) {
  return f == Fp8Format::kE4M3 ? 0.001953125f : 1.52587890625e-05f;  // 2^-9, 2^-16
}

// ---- Split groups: a group's largest element kept apart ------------------------------------------
// One element far above the rest of its group would set the scale of all 128: the others land in
// the format's coarse low end (or need compression, k < 1), and while the outlier's moment decays
// over the next hundreds of steps their codes stay put as the scale moves, so they follow its
// decay. A group whose largest finite |x| (hi) is at least kDreSplitRatio times the largest of the
// others (mx2) is split: hi is kept in the group's gmax word and the others form a group of their
// own, of max s = hi_t 2^(-e/2) >= mx2 (e half-octaves, the largest such e), whose top is the
// format's second-largest code; the top code decodes to hi_t. gmax word of a split group: sign bit
// set, bits 8-30 hi truncated to 15 mantissa bits (hi_t, relative error < 2^-15), bits 0-7 e. A
// word without the sign bit is a whole group (gmax >= 0, the format before split groups existed),
// which decodes as it always did. Everything here is IEEE arithmetic on exponents: host and device
// split alike.
constexpr float kDreSplitRatio = 16.0f;
constexpr uint32_t kDreSplitMaxE = 250;  // s >= hi_t 2^-125: the power of two stays a normal float

// log2(fmt_max / the format's second-largest value): 448 / 416, 57344 / 49152.
COAT_HD float fp8_log2_top_gap(Fp8Format f) { return f == Fp8Format::kE4M3 ? 0.106915204f : 0.222392421f; }

COAT_HD float dre_split_scale(float hi_t, uint32_t e) {
  const float s = hi_t * float_of((127u - (e >> 1)) << 23);
  return (e & 1u) ? s * float_of(0x3F3504F3u) : s;  // 2^-1/2
}

// e of a split group, 0 to keep it whole. mx2 below fp32's normal range never splits (the device
// flushes such values).
COAT_HD uint32_t dre_split_e(float hi, float mx2) {
  if (!(mx2 >= 1.17549435e-38f) || !(hi >= kDreSplitRatio * mx2) || !(hi <= 3.40282347e38f)) return 0;
  const float t = float_of(bits_of(hi) & 0x7FFFFF00u);
  // log2(t / mx2) < (exponent difference) + 1: from the largest e that could hold, down (<= 4 tries).
  int e = 2 * (static_cast<int>(bits_of(t) >> 23) - static_cast<int>(bits_of(mx2) >> 23)) + 1;
  e = e < static_cast<int>(kDreSplitMaxE) ? e : static_cast<int>(kDreSplitMaxE);
  for (; e > 0; --e)
    if (dre_split_scale(t, static_cast<uint32_t>(e)) >= mx2) return static_cast<uint32_t>(e);
  return 0;
}

// The gmax word of a group from its largest finite |x| and the largest finite |x| below it.
COAT_HD float dre_split_word(float hi, uint32_t e) { return float_of(0x80000000u | (bits_of(hi) & 0x7FFFFF00u) | e); }

COAT_HD float dre_gmax_word(float hi, float mx2) {
  const uint32_t e = dre_split_e(hi, mx2);
  return e == 0 ? hi : dre_split_word(hi, e);
}

// What a gmax word says: the max the codes below the top code are scaled to (mx), what the top
// code decodes to (out), and log2(fmt_max / the value of the others' top code) (off: 0 for a whole
// group).
struct DreTop {
  float mx, out, off;
};

COAT_HD DreTop dre_top(float word, Fp8Format fmt) {
  const uint32_t w = bits_of(word);
  if ((w & 0x80000000u) == 0 || (w & 0xFFu) == 0) return {fabsf(word), fabsf(word), 0.0f};
  const float t = float_of(w & 0x7FFFFF00u);
  return {dre_split_scale(t, w & 0xFFu), t, fp8_log2_top_gap(fmt)};
}

// k16 from 16 log2_range / span and 16 log2_normal_range / span (span = log2(mx / mn) > 0):
// expansion where the group fits the range (>= 16), else compression down to the normal range,
// never above 1; floored, clamped to [kDreMinK16, kDreMaxK16] (a zero span -> +inf -> the max).
COAT_HD float dre_k16_choose(float k16_expand, float k16_compress) {
  const float k16 = k16_expand >= 16.0f ? k16_expand : fminf(k16_compress, 16.0f);
  return fminf(fmaxf(k16, static_cast<float>(kDreMinK16)), static_cast<float>(kDreMaxK16));
}

// k16 from the group's largest and smallest non-zero finite |x| (mn = +inf when there is none);
// log2_range <= 0 turns expansion off (k <= 1: compression only where the group needs it). The
// others of a split group have a top code off octaves below the format's max (DreTop::off): both
// ranges are that much shorter for them.
COAT_HD uint8_t dre_k16(float mx, float mn, float log2_range, Fp8Format fmt, float off = 0.0f) {
  using namespace detail;
  if (!(mx > mn) || !(mn > 0.0f)) return kDreUnitK16;  // constant, empty or all-zero group: k is moot
  const float span = fsub(det_log2(mx), det_log2(mn));
  if (!(span > 0.0f)) return kDreMaxK16;
  const float e = floorf(fdiv(fmul(16.0f, log2_range > 0.0f ? fsub(log2_range, off) : 0.0f), span));
  const float c = floorf(fdiv(fmul(16.0f, fsub(fp8_log2_normal_range(fmt), off)), span));
  return static_cast<uint8_t>(dre_k16_choose(e, c));
}

struct DreGroup {
  float mx;        // the others' max (DreTop::mx; 0 for an all-zero group)
  float out;       // what the top code stands for (DreTop::out)
  float log2_mx;   // log2(mx), 0 when mx == 0
  float log2_top;  // log2 of the value of the others' top code: log2 fmt_max - DreTop::off
  float k;         // k16 / 16
  float inv_k;     // 16 / k16
};

// A group from its gmax word (dre_gmax_word) and k16.
COAT_HD DreGroup dre_group(float word, uint8_t k16, Fp8Format fmt) {
  using namespace detail;
  const DreTop t = dre_top(word, fmt);
  DreGroup g;
  g.mx = t.mx;
  g.out = t.out;
  g.log2_mx = t.mx > 0.0f ? det_log2(t.mx) : 0.0f;
  g.log2_top = fsub(fp8_log2_max(fmt), t.off);
  g.k = fmul(static_cast<float>(k16), 0.0625f);
  g.inv_k = fdiv(16.0f, static_cast<float>(k16));
  return g;
}

// gmax word, k16 and encoding parameters of a group from its statistics: the largest finite |x|
// (hi), the largest finite |x| below hi (mx2, 0 when none) and the smallest non-zero finite |x|
// (mn, +inf when none).
struct DreNewGroup {
  float word;
  uint8_t k16;
  DreGroup g;
};

COAT_HD DreNewGroup dre_new_group(float hi, float mx2, float mn, float log2_range, Fp8Format fmt) {
  const float word = dre_gmax_word(hi, mx2);
  const DreTop t = dre_top(word, fmt);
  const uint8_t k16 = dre_k16(t.mx, mn, log2_range, fmt, t.off);
  return {word, k16, dre_group(word, k16, fmt)};
}

// log2 of the magnitude of FP8 code `mag` (1..127): the table entries kernels and the CPU share.
COAT_HD float dre_log2_code(uint8_t mag, Fp8Format fmt) { return det_log2(decode_fp8(mag, fmt)); }

// q = fp8(sign(x) top (|x|/mx)^k), computed as 2^(k (log2|x| - log2 mx) + log2 top) (top = fmt_max
// for a whole group); the group max gets the top code.
COAT_HD uint8_t dre_encode(float x, const DreGroup& g, Fp8Format fmt) {
  using namespace detail;
  const float a = fabsf(x);
  if (a != a) return kFp8NaN;
  if (a == 0.0f) return 0;
  const uint8_t sign = x < 0.0f ? 0x80 : 0x00;
  if (a >= g.out) return sign | fp8_max_code(fmt);  // the group max (and +-inf) decode to it exactly
  const float t = fadd(fmul(g.k, fsub(det_log2(a), g.log2_mx)), g.log2_top);
  const float y = fmaxf(det_exp2(t), fp8_min_subnormal(fmt));  // never the zero code
  return encode_fp8(sign ? -y : y, fmt);
}

// x = sign(q) mx (|q| / top)^(1/k), the top code sign(q) out; log2_lut[mag] = dre_log2_code(mag, fmt).
COAT_HD float dre_decode(uint8_t c, const DreGroup& g, Fp8Format fmt, const float* log2_lut) {
  using namespace detail;
  const uint8_t mag = c & 0x7F;
  if (mag == 0) return 0.0f;
  const float sign = (c & 0x80) ? -1.0f : 1.0f;
  if (mag >= fp8_max_code(fmt)) {
    if (fmt == Fp8Format::kE4M3 ? mag == 0x7F : mag > 0x7C) return float_of(0x7FC00000u);  // NaN
    return sign * g.out;
  }
  const float t = fadd(g.log2_mx, fmul(fsub(log2_lut[mag], g.log2_top), g.inv_k));
  return sign * det_exp2(t);
}

// Host copy of the code-log2 tables (built once, with the same function the device uses).
const float* dre_host_log2_lut(Fp8Format fmt);

// ---- fast variants for fused kernels (the AdamW step) -----------------------------------------
// The exact variants above cost ~100 instructions per element on the GPU, which would make the
// optimizer step compute-bound. These use the hardware's approximate log2/exp2 (single MUFU
// instructions, lg2/ex2.approx.ftz: relative error ~2^-22, fp32 subnormals flushed to zero) on the
// device and libm's log2f/exp2f on the host. Same format, same guarantees (zeros, group maxima and
// constant groups exact; no NaN/Inf from finite input). The codes can differ from the exact
// variants, and between host and device, where a value lies within a few ulp of an FP8 rounding
// boundary; on the device a moment below 2^-126 (fp32's normal range) is stored as zero.
COAT_HD float fast_log2(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return std::log2(x);
#endif
}

COAT_HD float fast_exp2(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return std::exp2(x);
#endif
}

// 1 / x: the hardware's reciprocal on the device (~1 ulp; 0 where the result is below 2^-126),
// IEEE division on the host.
COAT_HD float fast_rcp(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return 1.0f / x;
#endif
}

// a / b: one reciprocal and a multiply on the device (~2 ulp), IEEE division on the host.
COAT_HD float fast_div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdividef(a, b);
#else
  return a / b;
#endif
}

// A small non-negative integer (k16, below 2^23) as a float: on the device by the bit pattern
// 2^23 + n on the FMA pipe (the I2F conversion shares the MUFU's busy pipe).
COAT_HD float small_uint_to_float(uint32_t n) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(0x4B000000u | n) - 8388608.0f;
#else
  return static_cast<float>(n);
#endif
}

// floor(x) for 0 <= x < 2^23 as 2^23 + floor(x) (rounding down), whose low bits are the integer:
// no FRND / F2I on the device.
COAT_HD float floor_biased(float x) {
#if defined(__CUDA_ARCH__)
  return __fadd_rd(x, 8388608.0f);
#else
  return std::floor(x) + 8388608.0f;
#endif
}

// Branch-free (the kernel computes it once per group and lane): a zero span gives +inf and clamps
// to the largest k16; a constant, empty or all-zero group gets k = 1. log2_range <= 0 turns
// expansion off. log2_mx = fast_log2(mx), which the caller also needs for encoding.
// off: DreTop::off, as in dre_k16.
COAT_HD uint8_t dre_k16_fast_l(float mx, float mn, float log2_mx, float log2_range, Fp8Format fmt, float off) {
  const float inv = fast_div(16.0f, log2_mx - fast_log2(mn));
  const float expand = log2_range > 0.0f ? log2_range - off : 0.0f;
  float k16 = dre_k16_choose(expand * inv, (fp8_log2_normal_range(fmt) - off) * inv);
  k16 = mx > mn && mn > 0.0f ? k16 : static_cast<float>(kDreUnitK16);
  return static_cast<uint8_t>(bits_of(floor_biased(k16)));
}

struct DreGroupFast {
  float mx;     // the others' max (DreTop::mx; 0 for an all-zero group)
  float out;    // the top code's value (DreTop::out)
  float at;     // |x| from which x takes the top code: out (+inf in an all-zero group, where 0 stays 0)
  float off;    // DreTop::off
  float k;      // k16 / 16
  float c_enc;  // log2 fmt_max - off - k log2 mx : log2 q = k log2|x| + c_enc
  float inv_k;  // 16 / k16                       : |x| = mx 2^((log2(|q| / fmt_max) + off) / k)
};

// 1 / fmt_max rounded to fp32: fmt_max times it is exactly 1 (both maxima are 7 2^n), so the top
// code decodes to mx exactly without a compare.
COAT_HD float fp8_inv_max(Fp8Format f) { return f == Fp8Format::kE4M3 ? 1.0f / kE4M3Max : 1.0f / kE5M2Max; }

// log2_mx = fast_log2(t.mx) (ignored when it is 0).
COAT_HD DreGroupFast dre_group_fast_l(const DreTop& t, float log2_mx, uint8_t k16, Fp8Format fmt) {
  DreGroupFast g;
  const float kf = small_uint_to_float(k16);
  g.mx = t.mx;
  g.out = t.out;
  g.at = t.out > 0.0f ? t.out : INFINITY;
  g.off = t.off;
  g.k = kf * 0.0625f;
  g.inv_k = fast_div(16.0f, kf);
  g.c_enc = (fp8_log2_max(fmt) - t.off) - g.k * (t.mx > 0.0f ? log2_mx : 0.0f);
  return g;
}

// A group from its gmax word (dre_gmax_word) and k16.
COAT_HD DreGroupFast dre_group_fast(float word, uint8_t k16, Fp8Format fmt) {
  const DreTop t = dre_top(word, fmt);
  return dre_group_fast_l(t, fast_log2(t.mx), k16, fmt);
}

// gmax word, k16 and encoding parameters from a group's statistics (as dre_new_group; log2_range
// 0 with expansion off).
struct DreNewGroupFast {
  float word;
  uint8_t k16;
  DreGroupFast g;
};

// A group known to stay whole (no split: hi is its word).
COAT_HD DreNewGroupFast dre_new_whole_group_fast(float hi, float mn, float log2_range, Fp8Format fmt) {
  const float l = fast_log2(hi);
  const uint8_t k16 = dre_k16_fast_l(hi, mn, l, log2_range, fmt, 0.0f);
  return {hi, k16, dre_group_fast_l(DreTop{hi, hi, 0.0f}, l, k16, fmt)};
}

COAT_HD DreNewGroupFast dre_new_group_fast(float hi, float mx2, float mn, float log2_range, Fp8Format fmt) {
  const uint32_t e = dre_split_e(hi, mx2);
  if (e == 0) return dre_new_whole_group_fast(hi, mn, log2_range, fmt);
  const float word = dre_split_word(hi, e);
  const DreTop t = dre_top(word, fmt);
  const float l = fast_log2(t.mx);
  const uint8_t k16 = dre_k16_fast_l(t.mx, mn, l, log2_range, fmt, t.off);
  return {word, k16, dre_group_fast_l(t, l, k16, fmt)};
}

// The value whose FP8 rounding is x's code, sign(x) fmt_max (|x| / mx)^k. log2(0) = -inf maps a
// zero to 0; NaN stays NaN; |x| == mx lands on fmt_max (the top code after rounding); any other
// non-zero x lands at least on the smallest code, never on zero. Kernels round pairs of these with
// one packed conversion.
// In the optimizer step (the fast variants' one user) the lift never fires: its moments are zero
// or normal fp32 (below 2^-126 flushed), so a group spans at most 254 octaves and k16 (floored)
// puts its smallest value at or above 2^-7.9 (E4M3: at least code 2) or E5M2's smallest normal.
// The device skips it (two compares and a select per element of an instruction-bound kernel);
// the host keeps it, and CPU and GPU codes agree (tests/cpp test_adamw_gpu).
// kSplit = false: the caller knows the group is whole (the top code then comes from the formula).
template <bool kSplit = true>
COAT_HD float dre_encode_value_fast(float x, const DreGroupFast& g, Fp8Format fmt) {
  float y = fast_exp2(g.k * fast_log2(fabsf(x)) + g.c_enc);
  if constexpr (kSplit) y = fabsf(x) >= g.at ? fp8_max(fmt) : y;  // the group max (already fmt_max if whole)
#if !defined(__CUDA_ARCH__)
  y = y < fp8_min_subnormal(fmt) && x != 0.0f ? fp8_min_subnormal(fmt) : y;  // NaN compares false
#endif
  return copysignf(y, x);
}

COAT_HD uint8_t dre_encode_fast(float x, const DreGroupFast& g, Fp8Format fmt) {
  return encode_fp8(dre_encode_value_fast(x, g, fmt), fmt);
}

// x from q, the FP8 value of its code (decode_fp8): sign(q) mx (|q| / fmt_max)^(1/k). The top code
// gives log2(1) = 0, exp2(0) = 1 and so mx exactly; zero gives 0, NaN stays NaN. Kernels get q from
// a packed hardware conversion and the log2 from the MUFU; dre_decode_fast below takes the log2
// from a table instead (same formula).
// kSplit = false: the caller knows the group is whole.
template <bool kSplit = true>
COAT_HD float dre_decode_value_fast(float q, const DreGroupFast& g, Fp8Format fmt) {
  const float l = fast_log2(fabsf(q) * fp8_inv_max(fmt));  // exactly 0 for the top code only
  if constexpr (!kSplit) return copysignf(g.mx * fast_exp2(l * g.inv_k), q);
  return copysignf(l == 0.0f ? g.out : g.mx * fast_exp2((l + g.off) * g.inv_k), q);
}

// Entry `mag` of the decode table: log2(|q| / fmt_max) (exactly 0 for the top code), -inf for 0
// (decodes to 0) and NaN for the NaN codes (decode to NaN), so decoding needs no branches.
COAT_HD float dre_fast_lut_entry(int mag, Fp8Format fmt) {
  if (mag == 0) return -INFINITY;
  const float q = decode_fp8(static_cast<uint8_t>(mag), fmt);
  return q != q ? q : det_log2(q * fp8_inv_max(fmt));
}

// dre_decode_value_fast with the log2 from the table (lut[mag] = dre_fast_lut_entry(mag, fmt)).
COAT_HD float dre_decode_fast(uint8_t c, const DreGroupFast& g, const float* lut) {
  const float l = lut[c & 0x7F];
  const float a = l == 0.0f ? g.out : g.mx * fast_exp2((l + g.off) * g.inv_k);
  return (c & 0x80) ? -a : a;
}

}  // namespace coat
