// 1 x G group scales shared by the fused kernels that quantize activations for saving (norm,
// swiglu): the same rules as quantize_per_group, on host and device, so a fused kernel's codes are
// bit-identical to a separate quantize_per_group call.
#pragma once

#include <math.h>

#include "fp8.h"

namespace coat {

// Stores group g's scale for this amax and returns it as fp32.
COAT_HD float store_group_scale(void* scales, int64_t g, float amax, ScaleKind kind, Fp8Format fmt) {
  if (kind == ScaleKind::kE8M0) {
    const uint8_t b = e8m0_scale_for(amax, fmt);
    static_cast<uint8_t*>(scales)[g] = b;
    return e8m0_to_float(b);
  }
  const float s = scale_for(amax, fmt);
  static_cast<float*>(scales)[g] = s;
  return s;
}

COAT_HD float load_group_scale(const void* scales, int64_t g, ScaleKind kind) {
  return kind == ScaleKind::kE8M0 ? e8m0_to_float(static_cast<const uint8_t*>(scales)[g])
                                  : static_cast<const float*>(scales)[g];
}

}  // namespace coat
