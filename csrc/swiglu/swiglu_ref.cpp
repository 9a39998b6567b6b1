// CPU reference of the swiglu family.
#include <cmath>

#include "common/fp8.h"
#include "common/group_scale.h"
#include "common/host_dispatch.h"
#include "swiglu_args.h"

namespace coat {
namespace ref {
namespace {

// Both compile-time parameters at once: the element type T and the activation A.
template <typename F>
void dispatch2(DType t, GatedAct act, F&& f) {
  dispatch_dtype(t, [&](auto* tt) { detail::dispatch_act(act, [&](auto at) { f(tt, at); }); });
}

}  // namespace

void swiglu_fwd(const void* gu, DType dtype, GatedAct act, int64_t rows, int64_t inter, void* h, uint8_t* q,
                void* scales, ScaleKind scale_kind, Fp8Format fmt, float* h_amax) {
  detail::check_swiglu_fwd(gu, act, rows, inter, h, q, scales);
  float hmax = 0.0f;
  dispatch2(dtype, act, [&](auto* tt, auto at) {
    using T = std::remove_pointer_t<decltype(tt)>;
    constexpr GatedAct A = decltype(at)::value;
    const T* x = static_cast<const T*>(gu);
    T* ht = static_cast<T*>(h);
    for (int64_t r = 0; r < rows; ++r) {
      const T* g = x + r * 2 * inter;
      const T* u = g + inter;
      for (int64_t j = 0; j < inter; ++j) {
        const float f = round_to<T>(detail::act_value<A>(Elem<T>::load(g[j])));
        ht[r * inter + j] = Elem<T>::store(f * Elem<T>::load(u[j]));
        hmax = std::max(hmax, finite_abs(Elem<T>::load(ht[r * inter + j])));
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
  if (h_amax != nullptr) h_amax[0] = hmax;
}

void swiglu_bwd(const uint8_t* q, const void* scales, ScaleKind scale_kind, Fp8Format fmt,
                const void* dh, DType dtype, GatedAct act, int64_t rows, int64_t inter, void* dgu, void* h,
                float* dgu_amax, float* h_amax) {
  detail::check_swiglu_bwd(q, scales, dh, act, rows, inter, dgu);
  float dmax = 0.0f, hmax = 0.0f;
  dispatch2(dtype, act, [&](auto* tt, auto at) {
    using T = std::remove_pointer_t<decltype(tt)>;
    constexpr GatedAct A = decltype(at)::value;
    const T* dht = static_cast<const T*>(dh);
    T* d = static_cast<T*>(dgu);
    T* ht = static_cast<T*>(h);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < inter; ++j) {
        const int64_t ig = r * 2 * inter + j, iu = ig + inter;
        const float g = decode_fp8(q[ig], fmt) * load_group_scale(scales, ig / kSwigluGroup, scale_kind);
        const float u = decode_fp8(q[iu], fmt) * load_group_scale(scales, iu / kSwigluGroup, scale_kind);
        const float dhv = Elem<T>::load(dht[r * inter + j]);
        const detail::ActGrad a = detail::act_grad<A>(g);
        const float f = round_to<T>(a.f);
        d[ig] = Elem<T>::store(dhv * u * a.df);
        d[iu] = Elem<T>::store(dhv * f);
        dmax = std::max(dmax, std::max(finite_abs(Elem<T>::load(d[ig])), finite_abs(Elem<T>::load(d[iu]))));
        if (ht == nullptr) continue;
        ht[r * inter + j] = Elem<T>::store(f * u);
        hmax = std::max(hmax, finite_abs(Elem<T>::load(ht[r * inter + j])));
      }
    }
  });
  if (dgu_amax != nullptr) dgu_amax[0] = dmax;
  if (h_amax != nullptr) h_amax[0] = hmax;
}

}  // namespace ref
}  // namespace coat
