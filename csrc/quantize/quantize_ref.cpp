// CPU reference of the quantize family: plain loops over the same scalar helpers the kernels use,
// so every FP8 code matches the GPU bit for bit.
#include <algorithm>
#include <cmath>

#include "common/dre.h"
#include "common/fp8.h"
#include "common/host_dispatch.h"
#include "quantize_args.h"

namespace coat {
namespace ref {
namespace {

using detail::ceil_div;

template <typename T>
float amax_of(const T* x, int64_t n) {
  float m = 0.0f;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, finite_abs(Elem<T>::load(x[i])));
  return m;
}

template <typename T>
// limit: a finite |value| above it encodes as NaN (quantize.h quantize_stacked_from_part_amax).
void quantize_stacked_impl(const StackedRows& x, int64_t rows, Fp8Format fmt, float inv, uint8_t* q,
                           uint8_t* q_t, float limit = INFINITY) {
  const int64_t cols = x.cols;
  int64_t r0 = 0;
  for (int p = 0; p < x.count; ++p) {
    const T* xp = static_cast<const T*>(x.data[p]);
    for (int64_t r = 0; r < x.rows[p]; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        const float v = Elem<T>::load(xp[r * cols + c]);
        const uint8_t code = finite_abs(v) > limit ? kFp8NaN : encode_fp8(v * inv, fmt);
        if (q) q[(r0 + r) * cols + c] = code;
        if (q_t) q_t[c * rows + r0 + r] = code;
      }
    }
    r0 += x.rows[p];
  }
}

template <typename T>
void store_out(void* y, int64_t i, float v) {
  static_cast<T*>(y)[i] = Elem<T>::store(v);
}

}  // namespace

void quantize_stacked(const StackedRows& x, Fp8Format fmt, const float* scale, float* amax,
                      float* scale_out, uint8_t* q, uint8_t* q_t) {
  const int64_t rows = detail::check_stacked(x, scale, amax, scale_out, q, q_t);
  dispatch_dtype(x.dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    float s = 0.0f;
    if (amax != nullptr) {
      float m = 0.0f;
      for (int p = 0; p < x.count; ++p)
        m = std::max(m, amax_of(static_cast<const T*>(x.data[p]), x.rows[p] * x.cols));
      amax[0] = m;
      s = scale_out[0] = scale_for(m, fmt);
    } else if (rows * x.cols > 0) {
      s = scale[0];
    }
    if (rows * x.cols > 0) quantize_stacked_impl<T>(x, rows, fmt, 1.0f / s, q, q_t);
  });
}

void quantize_stacked_from_amax(const StackedRows& x, Fp8Format fmt, const float* amax, float* scale_out,
                                uint8_t* q, uint8_t* q_t) {
  COAT_CHECK_ARG(amax != nullptr, "amax must not be null");
  const int64_t rows = detail::check_stacked(x, amax, amax, scale_out, q, q_t);
  const float s = scale_out[0] = scale_for(amax[0], fmt);
  if (rows * x.cols == 0) return;
  dispatch_dtype(x.dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    quantize_stacked_impl<T>(x, rows, fmt, 1.0f / s, q, q_t);
  });
}

void quantize_stacked_from_part_amax(const StackedRows& x, Fp8Format fmt, const float* const* part_amax,
                                     float* scale_out, uint8_t* q, uint8_t* q_t) {
  COAT_CHECK_ARG(part_amax != nullptr, "part_amax must not be null");
  float m = 0.0f;
  for (int p = 0; p < x.count && p < kMaxStackParts; ++p) {
    COAT_CHECK_ARG(part_amax[p] != nullptr, "part_amax[" + std::to_string(p) + "] must not be null");
    m = std::max(m, part_amax[p][0]);
  }
  const int64_t rows = detail::check_stacked(x, part_amax[0], part_amax[0], scale_out, q, q_t);
  const float s = scale_out[0] = scale_for(m, fmt);
  if (rows * x.cols == 0) return;
  dispatch_dtype(x.dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    quantize_stacked_impl<T>(x, rows, fmt, 1.0f / s, q, q_t, m);
  });
}

void amax_stacked(const StackedRows& x, float* amax) {
  COAT_CHECK_ARG(amax != nullptr, "amax must not be null");
  detail::check_stacked_parts(x);
  float m = 0.0f;
  dispatch_dtype(x.dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    for (int p = 0; p < x.count; ++p) m = std::max(m, amax_of(static_cast<const T*>(x.data[p]), x.rows[p] * x.cols));
  });
  amax[0] = m;
}

void transpose_stacked_codes(const StackedRows& x, uint8_t* q_t) {
  const int64_t rows = detail::check_stacked_codes(x, q_t);
  int64_t r0 = 0;
  for (int p = 0; p < x.count; ++p) {
    const auto* xp = static_cast<const uint8_t*>(x.data[p]);
    for (int64_t r = 0; r < x.rows[p]; ++r)
      for (int64_t c = 0; c < x.cols; ++c) q_t[c * rows + r0 + r] = xp[r * x.cols + c];
    r0 += x.rows[p];
  }
}

void quantize_per_tensor(const void* x, DType x_dtype, int64_t rows, int64_t cols, Fp8Format fmt,
                         const float* scale, uint8_t* q, uint8_t* q_t) {
  detail::check_shape(rows, cols);
  detail::check_ptr(x, rows * cols, "x");
  detail::check_ptr(q, rows * cols, "q");
  COAT_CHECK_ARG(scale != nullptr, "scale must not be null");
  quantize_stacked(detail::one_part(x, x_dtype, rows, cols), fmt, scale, nullptr, nullptr, q, q_t);
}

void quantize_per_tensor_amax(const void* x, DType x_dtype, int64_t rows, int64_t cols,
                              Fp8Format fmt, float* amax, float* scale, uint8_t* q, uint8_t* q_t) {
  detail::check_shape(rows, cols);
  detail::check_ptr(x, rows * cols, "x");
  detail::check_ptr(q, rows * cols, "q");
  COAT_CHECK_ARG(amax != nullptr && scale != nullptr, "amax and scale must not be null");
  quantize_stacked(detail::one_part(x, x_dtype, rows, cols), fmt, nullptr, amax, scale, q, q_t);
}

void dequantize_per_tensor(const uint8_t* q, Fp8Format fmt, int64_t n, const float* scale, void* y,
                           DType out_dtype) {
  COAT_CHECK_ARG(n >= 0, "n must be >= 0");
  detail::check_ptr(q, n, "q");
  detail::check_ptr(y, n, "y");
  COAT_CHECK_ARG(scale != nullptr, "scale must not be null");
  const float s = scale[0];
  dispatch_dtype(out_dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    for (int64_t i = 0; i < n; ++i) store_out<T>(y, i, decode_fp8(q[i], fmt) * s);
  });
}

void quantize_per_group(const void* x, DType x_dtype, int64_t rows, int64_t cols, int group,
                        Fp8Format fmt, ScaleKind scale_kind, void* scales, uint8_t* q) {
  detail::check_shape(rows, cols);
  detail::check_group(cols, group);
  const int64_t n = rows * cols;
  detail::check_ptr(x, n, "x");
  detail::check_ptr(q, n, "q");
  detail::check_ptr(scales, n, "scales");
  const int64_t groups = n / group;
  dispatch_dtype(x_dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* xt = static_cast<const T*>(x);
    for (int64_t g = 0; g < groups; ++g) {
      const T* xg = xt + g * group;
      const float amax = amax_of(xg, group);
      float s;
      if (scale_kind == ScaleKind::kE8M0) {
        const uint8_t b = e8m0_scale_for(amax, fmt);
        static_cast<uint8_t*>(scales)[g] = b;
        s = e8m0_to_float(b);
      } else {
        s = scale_for(amax, fmt);
        static_cast<float*>(scales)[g] = s;
      }
      const float inv = 1.0f / s;
      for (int i = 0; i < group; ++i) q[g * group + i] = encode_fp8(Elem<T>::load(xg[i]) * inv, fmt);
    }
  });
}

void dequantize_per_group(const uint8_t* q, Fp8Format fmt, int64_t rows, int64_t cols, int group,
                          ScaleKind scale_kind, const void* scales, void* y, DType out_dtype) {
  detail::check_shape(rows, cols);
  detail::check_group(cols, group);
  const int64_t n = rows * cols;
  detail::check_ptr(q, n, "q");
  detail::check_ptr(y, n, "y");
  detail::check_ptr(scales, n, "scales");
  dispatch_dtype(out_dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t g = i / group;
      const float s = scale_kind == ScaleKind::kE8M0
                          ? e8m0_to_float(static_cast<const uint8_t*>(scales)[g])
                          : static_cast<const float*>(scales)[g];
      store_out<T>(y, i, decode_fp8(q[i], fmt) * s);
    }
  });
}

void dre_quantize(const float* x, int64_t n, Fp8Format fmt, float log2_range, uint8_t* q,
                  float* gmax, uint8_t* k16) {
  detail::check_dre(n, log2_range);
  detail::check_ptr(x, n, "x");
  detail::check_ptr(q, n, "q");
  detail::check_ptr(gmax, n, "gmax");
  detail::check_ptr(k16, n, "k16");
  const int64_t groups = ceil_div(n, kDreGroupSize);
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t begin = g * kDreGroupSize;
    const int64_t end = std::min(n, begin + kDreGroupSize);
    float mx = 0.0f, mn = INFINITY;
    for (int64_t i = begin; i < end; ++i) {
      const float a = std::fabs(x[i]);
      if (!dre_counts(a)) continue;
      mx = std::max(mx, a);
      if (a > 0.0f) mn = std::min(mn, a);
    }
    float mx2 = 0.0f;  // the largest finite |x| below mx (NaN compares false)
    for (int64_t i = begin; i < end; ++i)
      if (std::fabs(x[i]) < mx) mx2 = std::max(mx2, std::fabs(x[i]));
    const DreNewGroup grp = dre_new_group(mx, mx2, mn, log2_range, fmt);
    gmax[g] = grp.word;
    k16[g] = grp.k16;
    for (int64_t i = begin; i < end; ++i) q[i] = dre_encode(x[i], grp.g, fmt);
  }
}

void dre_dequantize(const uint8_t* q, const float* gmax, const uint8_t* k16, int64_t n,
                    Fp8Format fmt, float* y) {
  COAT_CHECK_ARG(n >= 0, "n must be >= 0");
  detail::check_ptr(q, n, "q");
  detail::check_ptr(gmax, n, "gmax");
  detail::check_ptr(k16, n, "k16");
  detail::check_ptr(y, n, "y");
  const float* lut = dre_host_log2_lut(fmt);
  for (int64_t g = 0; g * kDreGroupSize < n; ++g) {
    const DreGroup grp = dre_group(gmax[g], k16[g], fmt);
    const int64_t end = std::min(n, (g + 1) * kDreGroupSize);
    for (int64_t i = g * kDreGroupSize; i < end; ++i) y[i] = dre_decode(q[i], grp, fmt, lut);
  }
}

}  // namespace ref

const float* dre_host_log2_lut(Fp8Format fmt) {
  struct Tables {
    float t[2][128];
    Tables() {
      for (int f = 0; f < 2; ++f) {
        t[f][0] = 0.0f;
        for (int c = 1; c < 128; ++c)
          t[f][c] = dre_log2_code(static_cast<uint8_t>(c), static_cast<Fp8Format>(f));
      }
    }
  };
  static const Tables tables;  // thread-safe initialisation
  return tables.t[fmt == Fp8Format::kE4M3 ? 0 : 1];
}

}  // namespace coat
