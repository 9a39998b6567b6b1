// CPU reference of the rope family: the kernel's arithmetic in plain loops.
#include <cstring>

#include "common/fp8.h"
#include "common/host_dispatch.h"
#include "rope_args.h"

namespace coat {
namespace ref {
namespace {

template <typename T>
void apply(const RopeArgs& a) {
  const int64_t h = a.dim / 2;
  const T* cs = static_cast<const T*>(a.cos);
  const T* sn = static_cast<const T*>(a.sin);
  for (const RopeHeads* hd : {&a.q, &a.k}) {
    for (int64_t m = 0; m < a.tokens && hd->heads > 0; ++m) {
      const T* crow = cs + (m % a.cs_rows) * a.dim;
      const T* srow = sn + (m % a.cs_rows) * a.dim;
      const T* src = static_cast<const T*>(hd->src) + m * hd->src_stride;
      T* dst = static_cast<T*>(hd->dst) + m * hd->dst_stride;
      for (int64_t e = 0; e < hd->heads; ++e) {
        for (int64_t j = 0; j < h; ++j) {
          float y0, y1;
          detail::rope_pair(Elem<T>::load(src[e * a.dim + j]), Elem<T>::load(src[e * a.dim + j + h]),
                            Elem<T>::load(crow[j]), Elem<T>::load(srow[j]), Elem<T>::load(crow[j + h]),
                            Elem<T>::load(srow[j + h]), a.backward, y0, y1);
          dst[e * a.dim + j] = Elem<T>::store(y0);
          dst[e * a.dim + j + h] = Elem<T>::store(y1);
        }
      }
    }
  }
  if (a.v.heads > 0 && a.v.src != nullptr) {
    const size_t row = static_cast<size_t>(a.v.heads * a.dim) * sizeof(T);
    for (int64_t m = 0; m < a.tokens; ++m)
      std::memcpy(static_cast<T*>(a.v.dst) + m * a.v.dst_stride, static_cast<const T*>(a.v.src) + m * a.v.src_stride,
                  row);
  }
}

}  // namespace

void rope_apply(const RopeArgs& a) {
  detail::check_rope(a);
  if (a.tokens == 0) return;
  dispatch_dtype(a.dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    apply<T>(a);
  });
}

}  // namespace ref
}  // namespace coat
