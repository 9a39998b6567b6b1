// CPU reference of the scaled (row / block) quantizer: group maxima over the whole of X first, then
// every element, with the scalar helpers the kernel uses, so codes and scales match it bit for bit.
#include <algorithm>
#include <vector>

#include "common/fp8.h"
#include "common/host_dispatch.h"
#include "common/scale_grid.h"
#include "quantize_args.h"

namespace coat {
namespace ref {

void quantize_scaled(const StackedRows& x, int64_t rows_pad, int64_t cols_pad, Fp8Format fmt,
                     ScaleMode mode, uint8_t* q, float* scale, ScaleMode mode_t, uint8_t* q_t,
                     float* scale_t) {
  const int64_t rows = detail::check_scaled(x, rows_pad, cols_pad, mode, q, scale, mode_t, q_t, scale_t);
  const int64_t cols = x.cols;
  const ScaleGrid g = scale_grid(mode, false, rows_pad, cols_pad);
  const ScaleGrid gt = scale_grid(mode_t, true, rows_pad, cols_pad);
  // Group maxima; entries no element reaches (the padding of a 128x128 layout) stay 0 -> scale 1.
  std::vector<float> m(q || scale ? scale_count(mode, rows_pad, cols_pad) : 0, 0.0f);
  std::vector<float> mt(q_t || scale_t ? scale_count(mode_t, cols_pad, rows_pad) : 0, 0.0f);
  std::vector<float> v(static_cast<size_t>(rows * cols));
  dispatch_dtype(x.dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    int64_t r0 = 0;
    for (int p = 0; p < x.count; ++p) {
      const T* xp = static_cast<const T*>(x.data[p]);
      for (int64_t i = 0; i < x.rows[p] * cols; ++i) v[r0 * cols + i] = Elem<T>::load(xp[i]);
      r0 += x.rows[p];
    }
  });
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const float a = finite_abs(v[r * cols + c]);
      if (q) m[g.index(r, c)] = std::max(m[g.index(r, c)], a);
      if (q_t) mt[gt.index(r, c)] = std::max(mt[gt.index(r, c)], a);
    }
  for (size_t i = 0; i < m.size(); ++i) scale[i] = scale_for(m[i], fmt);
  for (size_t i = 0; i < mt.size(); ++i) scale_t[i] = scale_for(mt[i], fmt);
  for (int64_t r = 0; r < rows_pad; ++r)
    for (int64_t c = 0; c < cols_pad; ++c) {
      const float x_rc = r < rows && c < cols ? v[r * cols + c] : 0.0f;
      if (q) q[r * cols_pad + c] = encode_fp8(x_rc * (1.0f / scale[g.index(r, c)]), fmt);
      if (q_t) q_t[c * rows_pad + r] = encode_fp8(x_rc * (1.0f / scale_t[gt.index(r, c)]), fmt);
    }
}

}  // namespace ref
}  // namespace coat
