// CUDA fused AdamW step with 4-bit states (coat/adamw4.h): three launches for all tensors of a
// configuration. The per-element math is adamw4_math.h, shared with the CPU reference; this file
// is compiled with --fmad=false (CMakeLists.txt) and IEEE division / square root, so the two agree
// bit for bit.
//
// A first version, written for correctness: a warp per group of 128 elements (a lane per 4
// consecutive elements); a warp looks its group's descriptor up (binary search) and derives the
// step's scalars only when its next group is in another tensor. Bytes per parameter
// of the step (bf16 params and grads, fp32 master): 2 + 2 + 8 (master) + 2 x 0.5 x 2 (codes) plus
// for rank-1 tensors a second read of the gradient and the v codes (2.5 B) in the statistics pass.
// Not measured yet (no GPU where it was written); the FP8 step's lessons (adamw.cu: whole-sector
// metadata stores, cp.async staging) apply here too.
#include <cstdint>
#include <type_traits>

#include "adamw4_math.h"
#include "coat/adamw4.h"
#include "common/cuda_utils.cuh"

namespace coat {
namespace {

constexpr int G = kAdamw4Block;
constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kPer = G / 32;  // elements per lane, consecutive
static_assert(kPer == 4, "a lane's elements are one stochastic-rounding quad");

using adamw4::groups_of;

// The last descriptor whose first group is <= g (warp-uniform).
__device__ __forceinline__ int64_t find_tensor(const Adamw4Tensor* t, int64_t n, int64_t g) {
  int64_t lo = 0, hi = n - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) >> 1;
    if (t[mid].group_begin <= g) lo = mid; else hi = mid - 1;
  }
  return lo;
}

__device__ __forceinline__ bool skipped(const AdamwConfig& c) { return c.found_inf != nullptr && *c.found_inf != 0.0f; }

// The descriptor of group g and its step's scalars, kept across a warp's groups: a warp's next
// group is usually in the same tensor, and the scalars cost ~20 fp64 operations (beta^t).
struct Current {
  Adamw4Tensor d{};
  uint64_t t;
  adamw::Scalars s;
  int64_t end = -1;  // one past the tensor's last group; -1: none yet

  __device__ __forceinline__ void seek(const Adamw4Tensor* tensors, int64_t n, int64_t g, double lr,
                                       const AdamwConfig& c) {
    if (g >= d.group_begin && g < end) return;
    d = tensors[find_tensor(tensors, n, g)];
    end = d.group_begin + groups_of(d.numel);
    t = adamw::step_count(*d.step);
    s = adamw::make_scalars(lr, c, t);
  }
};

// Row and column of a lane's first element (rank-1 tensors); the next ones follow by stepping.
struct RowCol {
  int64_t i, j;
  __device__ __forceinline__ void next(int64_t cols) {
    if (++j == cols) {
      j = 0;
      ++i;
    }
  }
};

__device__ __forceinline__ RowCol row_col(const Adamw4Tensor& d, int64_t e) {
  if (d.kind != Adamw4Kind::kRank1) return {0, 0};
  return {e / d.cols, e % d.cols};
}

// atomicMax on the bits of a non-negative float, skipped when the stored value is already larger
// (maxima settle early, so most elements skip the atomic).
__device__ __forceinline__ void max_into(float* at, uint32_t key) {
  auto* u = reinterpret_cast<unsigned int*>(at);
  if (key > *reinterpret_cast<volatile unsigned int*>(u)) atomicMax(u, key);
}

// Block b zeroes the new rank-1 buffers of descriptors b, b + grid, ...: pass one max-reduces
// into them. Moves 4 (rows + cols) bytes per rank-1 tensor.
__global__ void clear_kernel(const Adamw4Tensor* __restrict__ tensors, int64_t n_tensors, AdamwConfig c) {
  if (skipped(c)) return;
  for (int64_t ti = blockIdx.x; ti < n_tensors; ti += gridDim.x) {
    const Adamw4Tensor d = tensors[ti];
    if (d.kind != Adamw4Kind::kRank1) continue;
    const uint64_t t = adamw::step_count(*d.step);
    float* out = d.v_scale + adamw4::new_buffer(t) * (d.rows + d.cols);
    for (int64_t i = threadIdx.x; i < d.rows + d.cols; i += blockDim.x) out[i] = 0.0f;
  }
}

// Pass one: a warp per group of a rank-1 tensor (lane = 4 consecutive elements) computes the new
// v from the gradient and the old codes and max-reduces it into the new row and column maxima.
// Reads gradient (2-4 B) and v codes (0.5 B) per element; a group inside one row makes one row
// atomic, columns one (mostly skipped) atomic per element.
template <typename Gr>
__global__ void __launch_bounds__(kThreads) stats_kernel(const Adamw4Tensor* __restrict__ tensors, int64_t n_tensors,
                                                         int64_t n_groups, AdamwConfig c) {
  if (skipped(c)) return;
  const double lr = c.lr_tensor != nullptr ? static_cast<double>(*c.lr_tensor) : c.lr;
  const float inv_gs = adamw::inv_grad_scale(c.grad_scale);
  const int lane = threadIdx.x & 31;
  const int64_t n_warps = static_cast<int64_t>(gridDim.x) * kWarps;
  Current cur;
  for (int64_t g = blockIdx.x * int64_t{kWarps} + (threadIdx.x >> 5); g < n_groups; g += n_warps) {
    cur.seek(tensors, n_tensors, g, lr, c);
    const Adamw4Tensor& d = cur.d;
    if (d.kind != Adamw4Kind::kRank1) continue;
    const uint64_t t = cur.t;
    const adamw::Scalars& s = cur.s;
    const int64_t begin = (g - d.group_begin) * G, e0 = begin + lane * kPer;
    const int64_t end = begin + G < d.numel ? begin + G : d.numel;
    const float* old_r = d.v_scale + adamw4::old_buffer(t) * (d.rows + d.cols);
    float* new_r = d.v_scale + adamw4::new_buffer(t) * (d.rows + d.cols);
    const bool one_row = begin / d.cols == (end - 1) / d.cols;
    uint32_t row_key = 0;
    RowCol rc = row_col(d, e0);
    for (int k = 0; k < kPer; ++k, rc.next(d.cols)) {
      const int64_t e = e0 + k;
      if (e >= end) break;
      const float v_old = adamw4::decode_v(adamw4::nibble(static_cast<const uint8_t*>(d.v), e),
                                           adamw4::rank1_scale(old_r[rc.i], old_r[d.rows + rc.j]));
      const float g_e = Elem<Gr>::load(static_cast<const Gr*>(d.grad)[e]) * inv_gs;
      const uint32_t key = adamw4::max_key(adamw4::new_v(v_old, g_e, s));
      if (key == 0) continue;  // the buffers start at 0
      max_into(new_r + d.rows + rc.j, key);
      if (one_row) row_key = adamw4::umax(row_key, key);
      else max_into(new_r + rc.i, key);
    }
    if (one_row) {
      row_key = __reduce_max_sync(0xFFFFFFFFu, row_key);
      if (lane == 0 && row_key != 0) max_into(new_r + begin / d.cols, row_key);
    }
  }
}

// A lane's 4 new moments encoded and stored (kBlock / kRank1), with the group's absmax (lane 0).
__device__ __forceinline__ void store_codes(const Adamw4Tensor& d, int64_t lg, int64_t e0, const float (&m)[kPer],
                                            const float (&v)[kPer], uint64_t t) {
  const int64_t n = d.numel;
  uint32_t mk = 0, vk = 0;
  for (int k = 0; k < kPer; ++k) {
    if (e0 + k >= n) break;
    mk = adamw4::umax(mk, adamw4::max_key(m[k]));
    vk = adamw4::umax(vk, adamw4::max_key(v[k]));
  }
  const float ms = float_of(__reduce_max_sync(0xFFFFFFFFu, mk));
  const float vb = float_of(__reduce_max_sync(0xFFFFFFFFu, vk));
  if ((threadIdx.x & 31) == 0) {
    d.m_scale[lg] = ms;
    if (d.kind == Adamw4Kind::kBlock) d.v_scale[lg] = vb;
  }
  RowCol rc = row_col(d, e0);
  int mc[kPer] = {}, vc[kPer] = {};  // past the end: nibble 0, as the reference leaves it
  for (int k = 0; k < kPer; ++k, rc.next(d.cols)) {
    if (e0 + k >= n) break;
    const float vs = d.kind == Adamw4Kind::kBlock ? vb : adamw4::v_scale_of(d, lg, rc.i, rc.j, adamw4::new_buffer(t));
    mc[k] = adamw4::encode_m(m[k], ms);
    vc[k] = adamw4::encode_v(v[k], vs);
  }
  auto* mq = static_cast<uint8_t*>(d.m);
  auto* vq = static_cast<uint8_t*>(d.v);
  for (int k = 0; k < kPer; k += 2) {
    if (e0 + k >= n) break;
    mq[(e0 + k) / 2] = static_cast<uint8_t>(mc[k] | (mc[k + 1] << 4));
    vq[(e0 + k) / 2] = static_cast<uint8_t>(vc[k] | (vc[k + 1] << 4));
  }
}

// Pass two: a warp per group (lane = 4 consecutive elements) decodes the old moments, applies the
// update, encodes the new moments and writes the parameter (and master). Per element: param and
// grad (2-4 B each), master (8 B if any), codes 2 x 0.5 B read and written (kFull: 16 B of fp32).
template <typename P, typename Gr, MasterKind M>
__global__ void __launch_bounds__(kThreads) step_kernel(const Adamw4Tensor* __restrict__ tensors, int64_t n_tensors,
                                                        int64_t n_groups, AdamwConfig c) {
  if (skipped(c)) return;
  const double lr = c.lr_tensor != nullptr ? static_cast<double>(*c.lr_tensor) : c.lr;
  const float inv_gs = adamw::inv_grad_scale(c.grad_scale);
  const int lane = threadIdx.x & 31;
  const int64_t n_warps = static_cast<int64_t>(gridDim.x) * kWarps;
  Current cur;
  for (int64_t g = blockIdx.x * int64_t{kWarps} + (threadIdx.x >> 5); g < n_groups; g += n_warps) {
    cur.seek(tensors, n_tensors, g, lr, c);
    const Adamw4Tensor& d = cur.d;
    const uint64_t t = cur.t;
    const adamw::Scalars& s = cur.s;
    const int64_t lg = g - d.group_begin, e0 = lg * G + lane * kPer;
    auto* param = static_cast<P*>(d.param);
    float p[kPer] = {}, m[kPer] = {}, v[kPer] = {};
    RowCol rc = row_col(d, e0);
    for (int k = 0; k < kPer; ++k, rc.next(d.cols)) {
      const int64_t e = e0 + k;
      if (e >= d.numel) break;
      const adamw4::Moments o = adamw4::old_moments(d, lg, e, rc.i, rc.j, t);
      m[k] = o.m;
      v[k] = o.v;
      const float p0 = M == MasterKind::kFp32 ? d.master[e] : Elem<P>::load(param[e]);
      p[k] = adamw4::update(p0, Elem<Gr>::load(static_cast<const Gr*>(d.grad)[e]) * inv_gs, m[k], v[k], s);
    }
    if (d.kind == Adamw4Kind::kFull) {
      for (int k = 0; k < kPer && e0 + k < d.numel; ++k) {
        static_cast<float*>(d.m)[e0 + k] = m[k];
        static_cast<float*>(d.v)[e0 + k] = v[k];
      }
    } else {
      store_codes(d, lg, e0, m, v, t);  // warp-wide: every lane takes part
    }
    if constexpr (M == MasterKind::kBf16Sr) {
      const uint64_t r = adamw::sr_bits(d.seed, t, static_cast<uint64_t>(e0 / 4));
      for (int k = 0; k < kPer && e0 + k < d.numel; ++k)
        reinterpret_cast<uint16_t*>(param)[e0 + k] = adamw::bf16_sr(p[k], static_cast<uint32_t>(r >> (16 * k)));
    } else {
      for (int k = 0; k < kPer && e0 + k < d.numel; ++k) {
        if constexpr (M == MasterKind::kFp32) d.master[e0 + k] = p[k];
        param[e0 + k] = Elem<P>::store(p[k]);
      }
    }
  }
}

template <typename P, typename Gr, MasterKind M>
void launch(const Adamw4Tensor* tensors, int64_t n_tensors, int64_t n_groups, const AdamwConfig& c,
            cudaStream_t stream) {
  const unsigned clear_grid = static_cast<unsigned>(n_tensors < 1024 ? n_tensors : 1024);
  clear_kernel<<<clear_grid, 256, 0, stream>>>(tensors, n_tensors, c);
  COAT_CHECK_LAUNCH();
  const unsigned grid = cuda::grid_for(n_groups, kWarps, 8);  // a warp per group
  stats_kernel<Gr><<<grid, kThreads, 0, stream>>>(tensors, n_tensors, n_groups, c);
  COAT_CHECK_LAUNCH();
  step_kernel<P, Gr, M><<<grid, kThreads, 0, stream>>>(tensors, n_tensors, n_groups, c);
  COAT_CHECK_LAUNCH();
}

template <typename P, MasterKind M>
void launch_grad(const Adamw4Tensor* tensors, int64_t n_tensors, int64_t n_groups, const AdamwConfig& c,
                 cudaStream_t stream) {
  switch (c.grad_dtype) {
    case DType::kFloat32: return launch<P, float, M>(tensors, n_tensors, n_groups, c, stream);
    case DType::kBFloat16: return launch<P, bf16_t, M>(tensors, n_tensors, n_groups, c, stream);
    case DType::kFloat16: return launch<P, fp16_t, M>(tensors, n_tensors, n_groups, c, stream);
  }
}

}  // namespace

void adamw4_step(const Adamw4Tensor* tensors, int64_t n_tensors, int64_t n_groups, const AdamwConfig& c,
                 cudaStream_t stream) {
  detail::check_adamw_config(n_tensors, n_groups, c);
  COAT_CHECK_ARG(n_groups == 0 || (n_tensors > 0 && tensors != nullptr),
                 "n_groups > 0 needs at least one tensor descriptor");
  if (n_groups == 0) return;
  switch (c.master) {
    case MasterKind::kNone: return launch_grad<float, MasterKind::kNone>(tensors, n_tensors, n_groups, c, stream);
    case MasterKind::kBf16Sr: return launch_grad<bf16_t, MasterKind::kBf16Sr>(tensors, n_tensors, n_groups, c, stream);
    case MasterKind::kFp32:
      if (c.param_dtype == DType::kBFloat16)
        return launch_grad<bf16_t, MasterKind::kFp32>(tensors, n_tensors, n_groups, c, stream);
      return launch_grad<fp16_t, MasterKind::kFp32>(tensors, n_tensors, n_groups, c, stream);
  }
}

}  // namespace coat
