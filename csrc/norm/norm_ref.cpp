// CPU reference of the norm family: plain loops over the scalar helpers the kernels use, so FP8
// codes match the GPU bit for bit and y matches whenever rstd does.
#include <cmath>
#include <vector>

#include "common/fp8.h"
#include "common/group_scale.h"
#include "common/host_dispatch.h"
#include "norm_args.h"

namespace coat {
namespace ref {
namespace {

// Both element types at once: T (activations) and W (weight).
template <typename F>
void dispatch2(DType t, DType w, F&& f) {
  dispatch_dtype(t, [&](auto* tt) { dispatch_dtype(w, [&](auto* wt) { f(tt, wt); }); });
}

// y of one element from h = x * rstd (fp32): the kind's rounding (coat/norm.h).
template <typename T>
float norm_out(float h, float w, bool unit_offset) {
  return unit_offset ? h * (1.0f + w) : round_to<T>(h) * w;
}

}  // namespace

void rmsnorm_fwd(const void* x, DType x_dtype, const void* w, DType w_dtype, NormKind kind, int64_t rows,
                 int64_t cols, float eps, void* y, float* rstd, uint8_t* q, void* scales,
                 ScaleKind scale_kind, Fp8Format fmt, float* y_amax) {
  detail::check_rmsnorm_fwd(x, w, kind, rows, cols, eps, y, rstd, q, scales);
  const bool unit = kind == NormKind::kUnitOffset;
  float ymax = 0.0f;
  dispatch2(x_dtype, w_dtype, [&](auto* tt, auto* wt) {
    using T = std::remove_pointer_t<decltype(tt)>;
    using W = std::remove_pointer_t<decltype(wt)>;
    const T* xt = static_cast<const T*>(x);
    const W* wv = static_cast<const W*>(w);
    T* yt = static_cast<T*>(y);
    for (int64_t r = 0; r < rows; ++r) {
      const T* xr = xt + r * cols;
      float ss = 0.0f;
      for (int64_t c = 0; c < cols; ++c) {
        const float v = Elem<T>::load(xr[c]);
        ss += v * v;
      }
      const float rs = 1.0f / std::sqrt(ss / static_cast<float>(cols) + eps);
      rstd[r] = rs;
      for (int64_t c = 0; c < cols; ++c) {
        yt[r * cols + c] = Elem<T>::store(norm_out<T>(Elem<T>::load(xr[c]) * rs, Elem<W>::load(wv[c]), unit));
        ymax = std::max(ymax, finite_abs(Elem<T>::load(yt[r * cols + c])));
      }
      if (q == nullptr) continue;
      for (int64_t g0 = 0; g0 < cols; g0 += kNormGroup) {
        float amax = 0.0f;
        for (int i = 0; i < kNormGroup; ++i) amax = std::max(amax, finite_abs(Elem<T>::load(xr[g0 + i])));
        const float s = store_group_scale(scales, (r * cols + g0) / kNormGroup, amax, scale_kind, fmt);
        const float inv = 1.0f / s;
        for (int i = 0; i < kNormGroup; ++i)
          q[r * cols + g0 + i] = encode_fp8(Elem<T>::load(xr[g0 + i]) * inv, fmt);
      }
    }
  });
  if (y_amax != nullptr) y_amax[0] = ymax;
}

void rmsnorm_fwd_fp8(const uint8_t* q, const void* scales, ScaleKind scale_kind, Fp8Format fmt,
                     const float* rstd, const void* w, DType w_dtype, NormKind kind, int64_t rows, int64_t cols,
                     void* y, DType y_dtype, float* y_amax) {
  detail::check_rmsnorm_fwd_fp8(q, scales, rstd, w, kind, rows, cols, y);
  const int64_t n = rows * cols;
  const bool unit = kind == NormKind::kUnitOffset;
  float ymax = 0.0f;
  dispatch2(y_dtype, w_dtype, [&](auto* tt, auto* wt) {
    using T = std::remove_pointer_t<decltype(tt)>;
    using W = std::remove_pointer_t<decltype(wt)>;
    const W* wv = static_cast<const W*>(w);
    T* yt = static_cast<T*>(y);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = i / cols, c = i % cols;
      const float x = decode_fp8(q[i], fmt) * load_group_scale(scales, i / kNormGroup, scale_kind);
      yt[i] = Elem<T>::store(norm_out<T>(x * rstd[r], Elem<W>::load(wv[c]), unit));
      ymax = std::max(ymax, finite_abs(Elem<T>::load(yt[i])));
    }
  });
  if (y_amax != nullptr) y_amax[0] = ymax;
}

void rmsnorm_bwd(const uint8_t* q, const void* scales, ScaleKind scale_kind, Fp8Format fmt,
                 const float* rstd, const void* w, DType w_dtype, NormKind kind, const void* dy, DType dy_dtype,
                 int64_t rows, int64_t cols, void* dx, float* workspace, float* dw) {
  detail::check_rmsnorm_bwd(q, scales, rstd, w, kind, dy, rows, cols, dx, dw);
  const bool unit = kind == NormKind::kUnitOffset;
  (void)workspace;  // the reference accumulates dw directly, in row order
  for (int64_t c = 0; c < cols; ++c) dw[c] = 0.0f;
  dispatch2(dy_dtype, w_dtype, [&](auto* tt, auto* wt) {
    using T = std::remove_pointer_t<decltype(tt)>;
    using W = std::remove_pointer_t<decltype(wt)>;
    const W* wv = static_cast<const W*>(w);
    const T* dyt = static_cast<const T*>(dy);
    T* dxt = static_cast<T*>(dx);
    std::vector<float> xh(static_cast<size_t>(cols)), g(static_cast<size_t>(cols));
    for (int64_t r = 0; r < rows; ++r) {
      const float rs = rstd[r];
      float dot = 0.0f;
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t i = r * cols + c;
        xh[c] = decode_fp8(q[i], fmt) * load_group_scale(scales, i / kNormGroup, scale_kind) * rs;
        g[c] = Elem<T>::load(dyt[i]) * detail::norm_weight(Elem<W>::load(wv[c]), unit);
        dot += g[c] * xh[c];
      }
      const float mean = dot / static_cast<float>(cols);
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t i = r * cols + c;
        dxt[i] = Elem<T>::store(rs * (g[c] - xh[c] * mean));
        dw[c] += Elem<T>::load(dyt[i]) * xh[c];
      }
    }
  });
}

}  // namespace ref
}  // namespace coat
