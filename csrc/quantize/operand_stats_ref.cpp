// CPU reference of coat/operand_stats.h.
#include <cmath>

#include "coat/operand_stats.h"
#include "common/fp8.h"
#include "common/host_dispatch.h"

namespace coat {
namespace ref {

void fp8_operand_stats(const void* x, DType dtype, int64_t n, const float* scale, float half_sub, float clip,
                       int64_t* counts, float* amax) {
  const float inv = 1.0f / scale[0];
  dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* xs = static_cast<const T*>(x);
    int64_t nonzero = 0, under = 0, sat = 0;
    float m = amax[0];
    for (int64_t i = 0; i < n; ++i) {
      const float v = Elem<T>::load(xs[i]);
      const float mag = std::fabs(v);
      const float a = mag * inv;
      const bool nz = v != 0.0f;  // true for NaN
      nonzero += nz;
      under += nz && a <= half_sub;
      sat += a >= clip;
      m = std::isnan(m) || std::isnan(mag) ? NAN : (mag > m ? mag : m);
    }
    counts[0] += nonzero;
    counts[1] += under;
    counts[2] += sat;
    amax[0] = m;
  });
}

}  // namespace ref
}  // namespace coat
