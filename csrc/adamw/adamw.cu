// CUDA fused AdamW step with FP8 (DRE) optimizer states: one launch for all tensors of a
// configuration. Numerics in coat/adamw.h; the scalar code is shared with the CPU reference
// (adamw_math.h), so both produce the same bits.
#include <cstdint>

#include "adamw_math.h"
#include "coat/adamw.h"
#include "common/cuda_utils.cuh"
#include "common/dre.h"

namespace coat {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int G = kDreGroupSize;

__device__ __forceinline__ int64_t groups_of(int64_t n) { return (n + G - 1) / G; }

// Four consecutive elements as fp32: 16 bytes of fp32 or 8 bytes of bf16/fp16, one vector access
// (the caller checked the alignment).
template <typename T>
__device__ __forceinline__ void load4(const T* p, float (&v)[4]) {
  if constexpr (sizeof(T) == 4) {
    const float4 a = *reinterpret_cast<const float4*>(p);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
  } else {
    const uint2 raw = *reinterpret_cast<const uint2*>(p);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = Elem<T>::load(e[j]);
  }
}

template <typename T>
__device__ __forceinline__ void store4(T* p, const float (&v)[4]) {
  if constexpr (sizeof(T) == 4) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  } else {
    uint2 raw;
    T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int j = 0; j < 4; ++j) e[j] = Elem<T>::store(v[j]);
    *reinterpret_cast<uint2*>(p) = raw;
  }
}

__device__ __forceinline__ bool is_aligned(const void* p, unsigned bytes) {
  return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0;
}

// One warp per DRE group of 128 elements, lane l owning elements 4l .. 4l+3 of the group, warps
// striding over the groups of all tensors (a warp finds its tensor by binary search over the
// descriptors' group_begin, and keeps it while its groups stay inside). Bytes per element:
// param r/w (or fp32 master r/w plus param write), grad read, m and v codes r/w, plus 2 x 5 bytes
// of group metadata r/w per 128. Nothing is written when *found_inf != 0.
template <typename P, typename Gr, MasterKind M>
__global__ void __launch_bounds__(kThreads, 3) adamw_kernel(const AdamwTensor* __restrict__ tensors,
                                                         int64_t n_tensors, int64_t n_groups,
                                                         AdamwConfig c) {
  if (c.found_inf != nullptr && *c.found_inf != 0.0f) return;
  // log2 of every FP8 code value, per format: dre_decode's det_log2 of the code, done once here.
  __shared__ float lq[2][128];
  for (int i = threadIdx.x; i < 256; i += kThreads)
    lq[i >> 7][i & 127] = adamw::code_log2(i & 127, (i >> 7) ? c.v_fmt : c.m_fmt);
  __syncthreads();
  const double lr = c.lr_tensor != nullptr ? static_cast<double>(*c.lr_tensor) : c.lr;
  const float gscale = c.grad_scale != nullptr ? *c.grad_scale : 1.0f;
  const int lane = threadIdx.x & 31;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarps;

  AdamwTensor d{};
  adamw::Scalars s{};
  uint64_t t = 0;
  int64_t t_begin = 0, t_end = 0;
  bool vec = false;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5); g < n_groups; g += stride) {
    if (g < t_begin || g >= t_end) {  // warp-uniform: every lane has the same g
      int64_t lo = 0, hi = n_tensors - 1;  // last descriptor with group_begin <= g
      while (lo < hi) {
        const int64_t mid = (lo + hi + 1) >> 1;
        if (tensors[mid].group_begin <= g) lo = mid; else hi = mid - 1;
      }
      d = tensors[lo];
      t_begin = d.group_begin;
      t_end = t_begin + groups_of(d.numel);
      t = adamw::step_count(*d.step);
      s = adamw::make_scalars(lr, c, t);
      vec = is_aligned(d.param, 4 * sizeof(P)) && is_aligned(d.grad, 4 * sizeof(Gr)) &&
            is_aligned(d.m_q, 4) && is_aligned(d.v_q, 4) &&
            (M != MasterKind::kFp32 || is_aligned(d.master, 16));
      if (g < t_begin || g >= t_end) continue;  // n_groups larger than the table covers
    }
    const int64_t lg = g - t_begin;
    const int64_t i0 = lg * G + lane * 4;
    const bool whole = vec && lg * G + G <= d.numel;
    P* param = static_cast<P*>(d.param);
    const Gr* grad = static_cast<const Gr*>(d.grad);

    float p[4], gr[4];
    uint8_t mq[4], vq[4];
    if (whole) {
      if constexpr (M == MasterKind::kFp32) load4(d.master + i0, p); else load4(param + i0, p);
      load4(grad + i0, gr);
      const uint32_t mw = *reinterpret_cast<const uint32_t*>(d.m_q + i0);
      const uint32_t vw = *reinterpret_cast<const uint32_t*>(d.v_q + i0);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        mq[j] = static_cast<uint8_t>(mw >> (8 * j));
        vq[j] = static_cast<uint8_t>(vw >> (8 * j));
      }
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const bool in = i0 + j < d.numel;
        if constexpr (M == MasterKind::kFp32) p[j] = in ? d.master[i0 + j] : 0.0f;
        else p[j] = in ? Elem<P>::load(param[i0 + j]) : 0.0f;
        gr[j] = in ? Elem<Gr>::load(grad[i0 + j]) : 0.0f;
        mq[j] = in ? d.m_q[i0 + j] : 0;  // absent elements decode to 0 and stay 0: they never
        vq[j] = in ? d.v_q[i0 + j] : 0;  // move the group's max or its non-zero min
      }
    }

    const DreGroupFast m_old = dre_group_fast(d.m_gmax[lg], d.m_k16[lg], c.m_fmt);
    const DreGroupFast v_old = dre_group_fast(d.v_gmax[lg], d.v_k16[lg], c.v_fmt);
    float m[4], v[4];
    float m_hi = 0.0f, m_lo = INFINITY, v_hi = 0.0f, v_lo = INFINITY;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float gj = gr[j];
      if (gscale != 1.0f) gj = gj / gscale;
      m[j] = adamw::decode_state(mq[j], m_old, lq[0], c.m_fmt);
      v[j] = adamw::decode_state(vq[j], v_old, lq[1], c.v_fmt);
      p[j] = adamw::update(p[j], gj, m[j], v[j], s);
      adamw::group_minmax(m[j], m_hi, m_lo);
      adamw::group_minmax(v[j], v_hi, v_lo);
    }
    m_hi = cuda::warp_max(m_hi);
    m_lo = cuda::warp_min(m_lo);
    v_hi = cuda::warp_max(v_hi);
    v_lo = cuda::warp_min(v_lo);
    const uint8_t m_k16 = adamw::group_k16(m_hi, m_lo, c.expansion, c.m_log2_range);
    const uint8_t v_k16 = adamw::group_k16(v_hi, v_lo, c.expansion, c.v_log2_range);
    // Every lane has read this group's old metadata above (program order), so lane 0 may
    // overwrite it now; no other warp touches this group.
    __syncwarp();
    if (lane == 0) {
      d.m_gmax[lg] = m_hi;
      d.m_k16[lg] = m_k16;
      d.v_gmax[lg] = v_hi;
      d.v_k16[lg] = v_k16;
    }
    const DreGroupFast m_new = dre_group_fast(m_hi, m_k16, c.m_fmt);
    const DreGroupFast v_new = dre_group_fast(v_hi, v_k16, c.v_fmt);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      mq[j] = adamw::encode_state(m[j], m_new, c.m_fmt);
      vq[j] = adamw::encode_state(v[j], v_new, c.v_fmt);
    }

    uint16_t sr[4] = {0, 0, 0, 0};
    if constexpr (M == MasterKind::kBf16Sr) {
      const uint64_t r = adamw::sr_bits(d.seed, t, static_cast<uint64_t>(i0 >> 2));
#pragma unroll
      for (int j = 0; j < 4; ++j) sr[j] = adamw::bf16_sr(p[j], static_cast<uint32_t>(r >> (16 * j)));
    }
    if (whole) {
      *reinterpret_cast<uint32_t*>(d.m_q + i0) = mq[0] | (mq[1] << 8) | (mq[2] << 16) | (uint32_t(mq[3]) << 24);
      *reinterpret_cast<uint32_t*>(d.v_q + i0) = vq[0] | (vq[1] << 8) | (vq[2] << 16) | (uint32_t(vq[3]) << 24);
      if constexpr (M == MasterKind::kBf16Sr) {
        *reinterpret_cast<uint2*>(param + i0) =
            make_uint2(sr[0] | (uint32_t(sr[1]) << 16), sr[2] | (uint32_t(sr[3]) << 16));
      } else {
        if constexpr (M == MasterKind::kFp32) store4(d.master + i0, p);
        store4(param + i0, p);
      }
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (i0 + j >= d.numel) continue;
        d.m_q[i0 + j] = mq[j];
        d.v_q[i0 + j] = vq[j];
        if constexpr (M == MasterKind::kBf16Sr) {
          reinterpret_cast<uint16_t*>(param)[i0 + j] = sr[j];
        } else {
          if constexpr (M == MasterKind::kFp32) d.master[i0 + j] = p[j];
          param[i0 + j] = Elem<P>::store(p[j]);
        }
      }
    }
  }
}

template <typename P, MasterKind M>
void launch(const AdamwTensor* tensors, int64_t n_tensors, int64_t n_groups, const AdamwConfig& c,
            cudaStream_t stream) {
  const unsigned grid = cuda::grid_for(n_groups * 32, kThreads, 3);
  switch (c.grad_dtype) {
    case DType::kFloat32:
      adamw_kernel<P, float, M><<<grid, kThreads, 0, stream>>>(tensors, n_tensors, n_groups, c);
      break;
    case DType::kBFloat16:
      adamw_kernel<P, bf16_t, M><<<grid, kThreads, 0, stream>>>(tensors, n_tensors, n_groups, c);
      break;
    case DType::kFloat16:
      adamw_kernel<P, fp16_t, M><<<grid, kThreads, 0, stream>>>(tensors, n_tensors, n_groups, c);
      break;
  }
  COAT_CHECK_LAUNCH();
}

}  // namespace

void adamw_step(const AdamwTensor* tensors, int64_t n_tensors, int64_t n_groups, const AdamwConfig& c,
                cudaStream_t stream) {
  detail::check_adamw_config(n_tensors, n_groups, c);
  COAT_CHECK_ARG(n_groups == 0 || (n_tensors > 0 && tensors != nullptr),
                 "n_groups > 0 needs at least one tensor descriptor");
  if (n_groups == 0) return;
  switch (c.master) {
    case MasterKind::kNone: return launch<float, MasterKind::kNone>(tensors, n_tensors, n_groups, c, stream);
    case MasterKind::kBf16Sr: return launch<bf16_t, MasterKind::kBf16Sr>(tensors, n_tensors, n_groups, c, stream);
    case MasterKind::kFp32:
      if (c.param_dtype == DType::kBFloat16)
        return launch<bf16_t, MasterKind::kFp32>(tensors, n_tensors, n_groups, c, stream);
      return launch<fp16_t, MasterKind::kFp32>(tensors, n_tensors, n_groups, c, stream);
  }
}

}  // namespace coat
