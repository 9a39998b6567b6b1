// CUDA kernel of the rope family. A thread handles two consecutive rotation pairs (columns j, j+1
// and j+h, j+h+1) of one head of one token, for q and k in one launch, and copies v in 2-element
// units in the same launch, each as one 2-element access.
// Bytes: q, k, v read once and written once, plus cos/sin rows (L2-resident: one sequence's rows
// are shared by the batch). An odd h or unaligned rows take the scalar path (same arithmetic).
#include <algorithm>

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

// Two consecutive elements as one 4-byte (16-bit types) or 8-byte (fp32) access.
template <typename T>
struct Vec2;
template <>
struct Vec2<float> {
  using V = float2;
};
template <>
struct Vec2<bf16_t> {
  using V = __nv_bfloat162;
};
template <>
struct Vec2<fp16_t> {
  using V = __half2;
};

template <typename T>
__device__ __forceinline__ void load2(const T* p, bool vec, float& a, float& b) {
  if (vec) {
    const typename Vec2<T>::V v = *reinterpret_cast<const typename Vec2<T>::V*>(p);
    a = Elem<T>::load(v.x);
    b = Elem<T>::load(v.y);
  } else {
    a = Elem<T>::load(p[0]);
    b = Elem<T>::load(p[1]);
  }
}

template <typename T>
__device__ __forceinline__ void store2(T* p, bool vec, float a, float b) {
  if (vec) {
    typename Vec2<T>::V v;
    v.x = Elem<T>::store(a);
    v.y = Elem<T>::store(b);
    *reinterpret_cast<typename Vec2<T>::V*>(p) = v;
  } else {
    p[0] = Elem<T>::store(a);
    p[1] = Elem<T>::store(b);
  }
}

// One block per token (grid-stride over tokens); its threads stride over that token's work items:
// q and k units (2 pairs of one head each), then v units (2 elements). Index math stays in 32 bits
// within a token (64-bit division per element cost more than the memory traffic).
template <typename T>
__global__ void rope_kernel(Part<T> q, Part<T> k, Part<T> v, int64_t tokens, int dim, const T* cs, const T* sn,
                            int64_t cs_rows, bool backward, bool vec) {
  const int h = dim / 2;
  const int units = (h + 1) / 2;  // pair units per head (2 pairs each)
  const int qk_heads = static_cast<int>(q.heads + k.heads);
  const int rot_items = qk_heads * units;
  const int v_width = static_cast<int>(v.heads) * dim;
  const int items = rot_items + (v_width + 1) / 2;
  for (int64_t m = blockIdx.x; m < tokens; m += gridDim.x) {
    const T* crow = cs + (m % cs_rows) * dim;
    const T* srow = sn + (m % cs_rows) * dim;
    for (int t = threadIdx.x; t < items; t += blockDim.x) {
      if (t < rot_items) {
        const int e = t / units, j = (t - e * units) * 2;
        const bool is_q = e < q.heads;
        const int head = is_q ? e : e - static_cast<int>(q.heads);
        const T* src = (is_q ? q.src + m * q.src_stride : k.src + m * k.src_stride) + head * dim;
        T* dst = (is_q ? q.dst + m * q.dst_stride : k.dst + m * k.dst_stride) + head * dim;
        if (vec) {  // h even: the unit is two whole pairs
          float x0[2], x1[2], c0[2], s0[2], c1[2], s1[2], y0[2], y1[2];
          load2(src + j, true, x0[0], x0[1]);
          load2(src + j + h, true, x1[0], x1[1]);
          load2(crow + j, true, c0[0], c0[1]);
          load2(srow + j, true, s0[0], s0[1]);
          load2(crow + j + h, true, c1[0], c1[1]);
          load2(srow + j + h, true, s1[0], s1[1]);
#pragma unroll
          for (int i = 0; i < 2; ++i)
            detail::rope_pair(x0[i], x1[i], c0[i], s0[i], c1[i], s1[i], backward, y0[i], y1[i]);
          store2(dst + j, true, y0[0], y0[1]);
          store2(dst + j + h, true, y1[0], y1[1]);
        } else {
          for (int jj = j; jj < j + 2 && jj < h; ++jj) {
            float y0, y1;
            detail::rope_pair(Elem<T>::load(src[jj]), Elem<T>::load(src[jj + h]), Elem<T>::load(crow[jj]),
                              Elem<T>::load(srow[jj]), Elem<T>::load(crow[jj + h]), Elem<T>::load(srow[jj + h]),
                              backward, y0, y1);
            dst[jj] = Elem<T>::store(y0);
            dst[jj + h] = Elem<T>::store(y1);
          }
        }
      } else {
        const int c = (t - rot_items) * 2;
        const T* src = v.src + m * v.src_stride + c;
        T* dst = v.dst + m * v.dst_stride + c;
        if (vec) {  // dim even, so the width is too
          *reinterpret_cast<typename Vec2<T>::V*>(dst) = *reinterpret_cast<const typename Vec2<T>::V*>(src);
        } else {
          dst[0] = src[0];
          if (c + 1 < v_width) dst[1] = src[1];
        }
      }
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
    // Two-element accesses need every row start 2-element aligned: even strides and h, aligned bases.
    const size_t al = 2 * sizeof(T);
    bool vec = (a.dim / 2) % 2 == 0 && cuda::aligned(a.cos, al) && cuda::aligned(a.sin, al);
    for (const Part<T>* p : {&q, &k, &v})
      if (p->heads > 0)
        vec = vec && p->src_stride % 2 == 0 && p->dst_stride % 2 == 0 && cuda::aligned(p->src, al) &&
              cuda::aligned(p->dst, al);
    const unsigned grid = static_cast<unsigned>(std::min<int64_t>(a.tokens, int64_t(cuda::sm_count()) * 16));
    rope_kernel<T><<<grid, kThreads, 0, stream>>>(q, k, v, a.tokens, static_cast<int>(a.dim),
                                                  static_cast<const T*>(a.cos), static_cast<const T*>(a.sin),
                                                  a.cs_rows, a.backward, vec);
    COAT_CHECK_LAUNCH();
  });
}

}  // namespace coat
