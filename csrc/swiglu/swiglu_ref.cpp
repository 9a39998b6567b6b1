// CPU reference of the swiglu family.
#include <cmath>

#include "common/fp8.h"
#include "common/group_scale.h"
#include "common/host_dispatch.h"
#include "swiglu_args.h"

namespace coat {
namespace ref {
namespace {

}  // namespace

void swiglu_fwd(const void* gu, DType dtype, int64_t rows, int64_t inter, void* h, uint8_t* q,
                void* scales, ScaleKind scale_kind, Fp8Format fmt) {
  detail::check_swiglu_fwd(gu, rows, inter, h, q, scales);
  dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* x = static_cast<const T*>(gu);
    T* ht = static_cast<T*>(h);
    for (int64_t r = 0; r < rows; ++r) {
      const T* g = x + r * 2 * inter;
      const T* u = g + inter;
      for (int64_t j = 0; j < inter; ++j) {
        const float gv = Elem<T>::load(g[j]);
        const float silu = round_to<T>(gv * detail::swiglu_sigmoid(gv));
        ht[r * inter + j] = Elem<T>::store(silu * Elem<T>::load(u[j]));
      }
      if (q == nullptr) continue;
      for (int64_t c0 = 0; c0 < 2 * inter; c0 += kSwigluGroup) {
        float amax = 0.0f;
        for (int i = 0; i < kSwigluGroup; ++i) amax = std::max(amax, finite_abs(Elem<T>::load(g[c0 + i])));
        const float s = store_group_scale(scales, (r * 2 * inter + c0) / kSwigluGroup, amax, scale_kind, fmt);
        const float inv = 1.0f / s;
        for (int i = 0; i < kSwigluGroup; ++i)
          q[r * 2 * inter + c0 + i] = encode_fp8(Elem<T>::load(g[c0 + i]) * inv, fmt);
      }
    }
  });
}

void swiglu_bwd(const uint8_t* q, const void* scales, ScaleKind scale_kind, Fp8Format fmt,
                const void* dh, DType dtype, int64_t rows, int64_t inter, void* dgu, void* h) {
  detail::check_swiglu_bwd(q, scales, dh, rows, inter, dgu);
  dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* dht = static_cast<const T*>(dh);
    T* d = static_cast<T*>(dgu);
    T* ht = static_cast<T*>(h);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < inter; ++j) {
        const int64_t ig = r * 2 * inter + j, iu = ig + inter;
        const float g = decode_fp8(q[ig], fmt) * load_group_scale(scales, ig / kSwigluGroup, scale_kind);
        const float u = decode_fp8(q[iu], fmt) * load_group_scale(scales, iu / kSwigluGroup, scale_kind);
        const float dhv = Elem<T>::load(dht[r * inter + j]);
        const float s = detail::swiglu_sigmoid(g);
        const float silu = round_to<T>(g * s);
        d[ig] = Elem<T>::store(dhv * u * (s * (1.0f + g * (1.0f - s))));
        d[iu] = Elem<T>::store(dhv * silu);
        if (ht != nullptr) ht[r * inter + j] = Elem<T>::store(silu * u);
      }
    }
  });
}

}  // namespace ref
}  // namespace coat
