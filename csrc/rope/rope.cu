// CUDA kernel of the rope family. Thread t handles two consecutive rotation pairs (columns j, j+1
// and j+h, j+h+1) of one head of one token, grid-stride over tokens x heads x h/2, for q and k in
// one launch, and copies v in 2-element units in the same launch. Bytes: q, k, v read once and
// written once, plus cos/sin rows (L2-resident: one sequence's rows are shared by the batch).
// An odd h takes the scalar path with the same arithmetic.
#include "common/cuda_utils.cuh"
#include "rope_args.h"

namespace coat {
namespace {

using cuda::dispatch_dtype;

constexpr int kThreads = 256;

template <typename T>
struct Part {
  const T* src;
  T* dst;
  int64_t src_stride, dst_stride, heads;
};

template <typename T>
__global__ void rope_kernel(Part<T> q, Part<T> k, Part<T> v, int64_t tokens, int64_t dim, const T* cs,
                            const T* sn, int64_t cs_rows, bool backward) {
  const int64_t h = dim / 2;
  const int64_t units = (h + 1) / 2;  // pair units per head (2 pairs each)
  const int64_t qk_heads = q.heads + k.heads;
  const int64_t rot_work = tokens * qk_heads * units;
  const int64_t v_units = (v.heads * dim + 1) / 2;
  const int64_t work = rot_work + tokens * v_units;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < work;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (t < rot_work) {
      const int64_t u = t % units, mh = t / units;
      const int64_t e = mh % qk_heads, m = mh / qk_heads;
      const Part<T>& p = e < q.heads ? q : k;
      const int64_t head = e < q.heads ? e : e - q.heads;
      const T* src = p.src + m * p.src_stride + head * dim;
      T* dst = p.dst + m * p.dst_stride + head * dim;
      const T* crow = cs + (m % cs_rows) * dim;
      const T* srow = sn + (m % cs_rows) * dim;
      for (int64_t j = 2 * u; j < 2 * u + 2 && j < h; ++j) {
        float y0, y1;
        detail::rope_pair(Elem<T>::load(src[j]), Elem<T>::load(src[j + h]), Elem<T>::load(crow[j]),
                          Elem<T>::load(srow[j]), Elem<T>::load(crow[j + h]), Elem<T>::load(srow[j + h]),
                          backward, y0, y1);
        dst[j] = Elem<T>::store(y0);
        dst[j + h] = Elem<T>::store(y1);
      }
    } else {
      const int64_t r = t - rot_work;
      const int64_t m = r / v_units, c = (r % v_units) * 2;
      const int64_t width = v.heads * dim;
      const T* src = v.src + m * v.src_stride;
      T* dst = v.dst + m * v.dst_stride;
      dst[c] = src[c];
      if (c + 1 < width) dst[c + 1] = src[c + 1];
    }
  }
}

template <typename T>
Part<T> part_of(const RopeHeads& h) {
  return Part<T>{static_cast<const T*>(h.src), static_cast<T*>(h.dst), h.src_stride, h.dst_stride,
                 h.src == nullptr ? 0 : h.heads};
}

}  // namespace

void rope_apply(const RopeArgs& a, cudaStream_t stream) {
  detail::check_rope(a);
  if (a.tokens == 0) return;
  dispatch_dtype(a.dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const Part<T> q = part_of<T>(a.q), k = part_of<T>(a.k), v = part_of<T>(a.v);
    const int64_t units = (a.dim / 2 + 1) / 2;
    const int64_t work = a.tokens * ((q.heads + k.heads) * units + (v.heads * a.dim + 1) / 2);
    rope_kernel<T><<<cuda::grid_for(work, kThreads), kThreads, 0, stream>>>(
        q, k, v, a.tokens, a.dim, static_cast<const T*>(a.cos), static_cast<const T*>(a.sin), a.cs_rows,
        a.backward);
    COAT_CHECK_LAUNCH();
  });
}

}  // namespace coat
