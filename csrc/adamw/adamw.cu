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

// The inputs of one group for one lane: its 4 elements (fp32 master or param, grad, codes) and the
// group's old metadata. Loaded one group ahead so that memory latency hides behind the math.
struct GroupIn {
  float p[4], g[4];
  uint32_t mq, vq;
  float m_mx, v_mx;
  uint8_t m_k16, v_k16;
};

template <typename P, typename Gr, MasterKind M>
__device__ __forceinline__ void load_group(const AdamwTensor& d, int64_t lg, int lane, bool vec, GroupIn& in) {
  const int64_t i0 = lg * G + lane * 4;
  const P* param = static_cast<const P*>(d.param);
  const Gr* grad = static_cast<const Gr*>(d.grad);
  if (vec && lg * G + G <= d.numel) {
    if constexpr (M == MasterKind::kFp32) load4(d.master + i0, in.p); else load4(param + i0, in.p);
    load4(grad + i0, in.g);
    in.mq = *reinterpret_cast<const uint32_t*>(d.m_q + i0);
    in.vq = *reinterpret_cast<const uint32_t*>(d.v_q + i0);
  } else {
    in.mq = in.vq = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const bool ok = i0 + j < d.numel;  // absent elements decode to 0 and stay 0
      if constexpr (M == MasterKind::kFp32) in.p[j] = ok ? d.master[i0 + j] : 0.0f;
      else in.p[j] = ok ? Elem<P>::load(param[i0 + j]) : 0.0f;
      in.g[j] = ok ? Elem<Gr>::load(grad[i0 + j]) : 0.0f;
      in.mq |= static_cast<uint32_t>(ok ? d.m_q[i0 + j] : 0) << (8 * j);
      in.vq |= static_cast<uint32_t>(ok ? d.v_q[i0 + j] : 0) << (8 * j);
    }
  }
  in.m_mx = d.m_gmax[lg];
  in.v_mx = d.v_gmax[lg];
  in.m_k16 = d.m_k16[lg];
  in.v_k16 = d.v_k16[lg];
}

// Decode -> AdamW -> new group max/min (warp shuffles) -> k -> encode -> store, for one group.
template <typename P, typename Gr, MasterKind M>
__device__ __forceinline__ void step_group(const AdamwTensor& d, int64_t lg, int lane, bool vec,
                                           const GroupIn& in, const adamw::Scalars& s, float gscale,
                                           uint64_t t, const AdamwConfig& c, const float* lq_m,
                                           const float* lq_v) {
  const DreGroupFast m_old = dre_group_fast(in.m_mx, in.m_k16, c.m_fmt);
  const DreGroupFast v_old = dre_group_fast(in.v_mx, in.v_k16, c.v_fmt);
  float p[4], m[4], v[4];
  float m_hi = 0.0f, m_lo = INFINITY, v_hi = 0.0f, v_lo = INFINITY;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float gj = gscale != 1.0f ? in.g[j] / gscale : in.g[j];
    m[j] = adamw::decode_state(static_cast<uint8_t>(in.mq >> (8 * j)), m_old, lq_m, c.m_fmt);
    v[j] = adamw::decode_state(static_cast<uint8_t>(in.vq >> (8 * j)), v_old, lq_v, c.v_fmt);
    p[j] = adamw::update(in.p[j], gj, m[j], v[j], s);
    adamw::group_minmax(m[j], m_hi, m_lo);
    adamw::group_minmax(v[j], v_hi, v_lo);
  }
  // group_minmax keeps these non-negative and NaN-free (m_lo/v_lo may be +inf).
  m_hi = cuda::warp_max_nonneg(m_hi);
  m_lo = cuda::warp_min_nonneg(m_lo);
  v_hi = cuda::warp_max_nonneg(v_hi);
  v_lo = cuda::warp_min_nonneg(v_lo);
  const uint8_t m_k16 = adamw::group_k16(m_hi, m_lo, c.expansion, c.m_log2_range);
  const uint8_t v_k16 = adamw::group_k16(v_hi, v_lo, c.expansion, c.v_log2_range);
  if (lane == 0) {  // the old metadata was read into registers when the group was loaded
    d.m_gmax[lg] = m_hi;
    d.m_k16[lg] = m_k16;
    d.v_gmax[lg] = v_hi;
    d.v_k16[lg] = v_k16;
  }
  const DreGroupFast m_new = dre_group_fast(m_hi, m_k16, c.m_fmt);
  const DreGroupFast v_new = dre_group_fast(v_hi, v_k16, c.v_fmt);
  uint32_t mq = 0, vq = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    mq |= static_cast<uint32_t>(adamw::encode_state(m[j], m_new, c.m_fmt)) << (8 * j);
    vq |= static_cast<uint32_t>(adamw::encode_state(v[j], v_new, c.v_fmt)) << (8 * j);
  }
  const int64_t i0 = lg * G + lane * 4;
  P* param = static_cast<P*>(d.param);
  uint16_t sr[4] = {0, 0, 0, 0};
  if constexpr (M == MasterKind::kBf16Sr) {
    const uint64_t r = adamw::sr_bits(d.seed, t, static_cast<uint64_t>(i0 >> 2));
#pragma unroll
    for (int j = 0; j < 4; ++j) sr[j] = adamw::bf16_sr(p[j], static_cast<uint32_t>(r >> (16 * j)));
  }
  if (vec && lg * G + G <= d.numel) {
    *reinterpret_cast<uint32_t*>(d.m_q + i0) = mq;
    *reinterpret_cast<uint32_t*>(d.v_q + i0) = vq;
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
      d.m_q[i0 + j] = static_cast<uint8_t>(mq >> (8 * j));
      d.v_q[i0 + j] = static_cast<uint8_t>(vq >> (8 * j));
      if constexpr (M == MasterKind::kBf16Sr) {
        reinterpret_cast<uint16_t*>(param)[i0 + j] = sr[j];
      } else {
        if constexpr (M == MasterKind::kFp32) d.master[i0 + j] = p[j];
        param[i0 + j] = Elem<P>::store(p[j]);
      }
    }
  }
}

// Work item = kItemGroups consecutive groups (of the launch's global group numbering), one warp
// per item, lane l owning elements 4l .. 4l+3 of each group; warps stride over items. Within an
// item the next group's inputs are loaded before the current group's math (one group of
// prefetch), and the warp streams through 1024 consecutive elements. A warp finds a group's
// tensor by binary search over the descriptors' group_begin when it leaves the current one.
// Bytes per element: param r/w (or fp32 master r/w plus param write), grad read, m and v codes
// r/w, plus 2 x 5 bytes of group metadata r/w per 128. Nothing is written when *found_inf != 0.
constexpr int kItemGroups = 8;

template <typename P, typename Gr, MasterKind M>
__global__ void __launch_bounds__(kThreads, 2) adamw_kernel(const AdamwTensor* __restrict__ tensors,
                                                            int64_t n_tensors, int64_t n_groups,
                                                            AdamwConfig c) {
  if (c.found_inf != nullptr && *c.found_inf != 0.0f) return;
  // log2 of every FP8 code value, per format (identical tables on host and device).
  __shared__ float lq[2][128];
  for (int i = threadIdx.x; i < 256; i += kThreads)
    lq[i >> 7][i & 127] = adamw::code_log2(i & 127, (i >> 7) ? c.v_fmt : c.m_fmt);
  __syncthreads();
  const double lr = c.lr_tensor != nullptr ? static_cast<double>(*c.lr_tensor) : c.lr;
  const float gscale = c.grad_scale != nullptr ? *c.grad_scale : 1.0f;
  const int lane = threadIdx.x & 31;
  const int64_t n_items = (n_groups + kItemGroups - 1) / kItemGroups;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarps;

  AdamwTensor d{};
  adamw::Scalars s{};
  uint64_t t = 0;
  int64_t t_begin = 0, t_end = 0;
  bool vec = false;
  auto enter = [&](int64_t g) {  // warp-uniform
    if (g >= t_begin && g < t_end) return;
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
  };

  for (int64_t item = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5); item < n_items;
       item += stride) {
    int64_t g = item * kItemGroups;
    const int64_t g_stop = g + kItemGroups < n_groups ? g + kItemGroups : n_groups;
    enter(g);
    GroupIn cur, nxt;
    load_group<P, Gr, M>(d, g - t_begin, lane, vec, cur);
    while (true) {
      const int64_t gn = g + 1;
      const bool ahead = gn < g_stop && gn < t_end;  // next group in the same tensor: load now
      if (ahead) load_group<P, Gr, M>(d, gn - t_begin, lane, vec, nxt);
      step_group<P, Gr, M>(d, g - t_begin, lane, vec, cur, s, gscale, t, c, lq[0], lq[1]);
      if (gn >= g_stop) break;
      if (!ahead) {
        enter(gn);
        load_group<P, Gr, M>(d, gn - t_begin, lane, vec, nxt);
      }
      cur = nxt;
      g = gn;
    }
  }
}

template <typename P, MasterKind M>
void launch(const AdamwTensor* tensors, int64_t n_tensors, int64_t n_groups, const AdamwConfig& c,
            cudaStream_t stream) {
  const unsigned grid = cuda::grid_for((n_groups + kItemGroups - 1) / kItemGroups * 32, kThreads, 2);
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
