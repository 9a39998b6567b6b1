// The FP8 + Dynamic Range Expansion state codec of the AdamW step (coat.optim.AdamW): how m and v
// are encoded in groups of 128 (coat/quantize.h, common/dre.h). The step's codec-independent math
// (scalars, gradient transforms, the per-element update, master kinds, stochastic rounding) is in
// adamw_math.h, shared with the 4-bit codec (csrc/adamw4/adamw4_math.h).
#pragma once

#include <cmath>
#include <cstdint>

#include "adamw_math.h"
#include "common/dre.h"
#include "common/fp8.h"

namespace coat {
namespace adamw {

// Fold |x| into a group's max and non-zero min: finite values only (NaN and inf never enter).
COAT_HD void group_minmax(float x, float& mx, float& mn) {
  float a = fabsf(x);
  a = dre_counts(a) ? a : 0.0f;
  mx = fmaxf(mx, a);
  mn = fminf(mn, a > 0.0f ? a : INFINITY);
}

// Fold |x| into the largest |x| below the group max hi (what splits a group, dre.h): NaN and inf
// never enter (they do not compare below a finite hi).
COAT_HD void group_second(float x, float hi, float& mx2) {
  const float a = fabsf(x);
  mx2 = a < hi ? fmaxf(mx2, a) : mx2;
}

// The states use dre.h's fast variants (hardware log2/exp2 on the GPU, libm on the CPU): the exact
// variants cost ~100 instructions per element each way and would make the step compute-bound.
// CPU and GPU steps therefore agree to ~1e-7 relative in the fp32 math; a code differs by one step
// only where a value sits within an ulp of an FP8 rounding boundary.
// A group's new gmax word, k16 and encoding parameters from its statistics (hi, mx2, mn: see
// dre_new_group_fast). Without expansion k is 1, or below 1 where the group is wider than the
// format (compression).
COAT_HD DreNewGroupFast new_group(float hi, float mx2, float mn, bool expansion, float log2_range, Fp8Format fmt) {
  return dre_new_group_fast(hi, mx2, mn, expansion ? log2_range : 0.0f, fmt);
}

// The decode table of a format (dre_fast_lut_entry: identical on host and device).
COAT_HD float code_log2(int mag, Fp8Format fmt) { return dre_fast_lut_entry(mag, fmt); }

// Decode one state element of a group (lq = the code_log2 table of fmt).
COAT_HD float decode_state(uint8_t c, const DreGroupFast& g, const float* lq) {
  return dre_decode_fast(c, g, lq);
}

// Encode one state element; NaN and +-Inf become the NaN code (saturating Inf to gmax would hide
// an overflow of the moments).
COAT_HD uint8_t encode_state(float x, const DreGroupFast& g, Fp8Format fmt) {
  return dre_encode_fast(dre_counts(fabsf(x)) ? x : float_of(0x7FC00000u), g, fmt);
}

}  // namespace adamw
}  // namespace coat
