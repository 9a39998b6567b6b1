// CUDA kernels of the norm family. One thread owns whole 16-element groups (two 16-byte loads of
// bf16), so the FP8 group amax needs no shuffles; rows are walked twice (sum of squares, then the
// outputs), the second read hitting L1/L2. All indices are 64-bit; tails need no masking because
// cols is a multiple of 16 (checked), and unaligned rows fall back to scalar loads.
#include "common/cuda_utils.cuh"
#include "common/group_scale.h"
#include "norm_args.h"

namespace coat {
namespace {

using cuda::decode16;
using cuda::dispatch_dtype;
using cuda::load16;
using cuda::round_to;
using cuda::store16;

constexpr int kThreads = 256;
constexpr int G = kNormGroup;

template <typename F>
void dispatch2(DType t, DType w, F&& f) {
  dispatch_dtype(t, [&](auto* tt) { dispatch_dtype(w, [&](auto* wt) { f(tt, wt); }); });
}

// y of one element from h = x * rstd (fp32): the kind's rounding (coat/norm.h).
template <typename T>
__device__ __forceinline__ float norm_out(float h, float w, bool unit_offset) {
  return unit_offset ? h * (1.0f + w) : round_to<T>(h) * w;
}

__device__ __forceinline__ void encode16(uint8_t* p, bool vec, Fp8Format fmt, float inv, const float (&v)[G]) {
  float a[8], b[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) { a[i] = v[i] * inv; b[i] = v[8 + i] * inv; }
  if (vec) {
    const uint2 lo = cuda::encode8(a, fmt), hi = cuda::encode8(b, fmt);
    *reinterpret_cast<uint4*>(p) = make_uint4(lo.x, lo.y, hi.x, hi.y);
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) { p[i] = encode_fp8(a[i], fmt); p[8 + i] = encode_fp8(b[i], fmt); }
  }
}

// Sum over the block; every thread gets the result. red holds 32 floats.
__device__ __forceinline__ float block_sum(float v, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = (blockDim.x + 31) >> 5;
  __syncthreads();  // red may still be read by a previous call
  if (lane == 0) red[warp] = v;
  __syncthreads();
  v = lane < nw ? red[lane] : 0.0f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Forward: one block per row (grid-stride over rows), thread t owns groups t, t + blockDim, ...
// Bytes per element: read x twice (2nd from cache) + w, write y, and 1 + 4/16 (or 1/16) for the
// FP8 copy of x; plus 4 bytes of rstd per row.
template <typename T, typename W>
__global__ void rmsnorm_fwd_kernel(const T* __restrict__ x, const W* __restrict__ w, int64_t rows,
                                   int64_t cols, float eps, bool unit, bool vec, T* __restrict__ y,
                                   float* __restrict__ rstd, uint8_t* __restrict__ q,
                                   void* __restrict__ scales, ScaleKind kind, Fp8Format fmt,
                                   float* __restrict__ y_amax) {
  __shared__ float red[32];
  const int64_t groups = cols / G;
  float ymax = 0.0f;  // over this thread's groups of y, as stored
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * cols;
    float ss = 0.0f;
    for (int64_t g = threadIdx.x; g < groups; g += blockDim.x) {
      float v[G];
      load16(xr + g * G, vec, v);
#pragma unroll
      for (int i = 0; i < G; ++i) ss += v[i] * v[i];
    }
    ss = block_sum(ss, red);
    const float rs = 1.0f / sqrtf(ss / static_cast<float>(cols) + eps);
    if (threadIdx.x == 0) rstd[r] = rs;
    for (int64_t g = threadIdx.x; g < groups; g += blockDim.x) {
      float v[G], wv[G], o[G];
      load16(xr + g * G, vec, v);
      load16(w + g * G, vec, wv);
      float amax = 0.0f;
#pragma unroll
      for (int i = 0; i < G; ++i) {
        o[i] = norm_out<T>(v[i] * rs, wv[i], unit);
        amax = fmaxf(amax, finite_abs(v[i]));
        ymax = fmaxf(ymax, finite_abs(round_to<T>(o[i])));
      }
      store16(y + r * cols + g * G, vec, o);
      if (q != nullptr) {
        const float s = store_group_scale(scales, r * groups + g, amax, kind, fmt);
        encode16(q + r * cols + g * G, vec, fmt, 1.0f / s, v);
      }
    }
  }
  if (y_amax != nullptr) cuda::block_max_atomic(ymax, y_amax);
}

// Recompute y from FP8 x: one thread per 16-group, grid-stride. Bytes per element: 1 (+ scale)
// read, sizeof(T) written; w and rstd stay in cache.
template <typename T, typename W>
__global__ void rmsnorm_fwd_fp8_kernel(const uint8_t* __restrict__ q, const void* __restrict__ scales,
                                       ScaleKind kind, Fp8Format fmt, const float* __restrict__ rstd,
                                       const W* __restrict__ w, int64_t rows, int64_t cols, bool unit,
                                       bool vec, T* __restrict__ y, float* __restrict__ y_amax) {
  const int64_t groups_per_row = cols / G;
  const int64_t groups = rows * groups_per_row;
  float ymax = 0.0f;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < groups;
       g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = g / groups_per_row, c0 = (g % groups_per_row) * G;
    float v[G], wv[G];
    decode16(q + g * G, vec, fmt, load_group_scale(scales, g, kind), v);
    load16(w + c0, vec, wv);
    const float rs = rstd[r];
#pragma unroll
    for (int i = 0; i < G; ++i) {
      v[i] = norm_out<T>(v[i] * rs, wv[i], unit);
      ymax = fmaxf(ymax, finite_abs(round_to<T>(v[i])));
    }
    store16(y + g * G, vec, v);
  }
  if (y_amax != nullptr) cuda::block_max_atomic(ymax, y_amax);
}

// Backward: block p owns the rows of partition p and walks them twice (dot, then dx and dw).
// Thread t owns groups t, t + blockDim, ... of every row, so its dw accumulators are private:
// kept in shared memory as acc[i * groups + g] (bank-conflict free) when cols * 4 bytes fit, else
// directly in the block's fp32 partial row. Bytes per element: 1 (x) + 2 sizeof(T) (dy, twice,
// second from cache) read, sizeof(T) (dx) written.
template <typename T, typename W>
__global__ void rmsnorm_bwd_kernel(const uint8_t* __restrict__ q, const void* __restrict__ scales,
                                   ScaleKind kind, Fp8Format fmt, const float* __restrict__ rstd,
                                   const W* __restrict__ w, const T* __restrict__ dy, int64_t rows,
                                   int64_t cols, int64_t parts, bool unit, bool vec, bool smem_acc,
                                   T* __restrict__ dx, float* __restrict__ partial) {
  extern __shared__ float sacc[];
  __shared__ float red[32];
  const int64_t groups = cols / G;
  const int64_t p = blockIdx.x;
  const int64_t per = (rows + parts - 1) / parts;
  const int64_t r0 = p * per, r1 = min(rows, r0 + per);
  float* prow = partial + p * cols;
  for (int64_t g = threadIdx.x; g < groups; g += blockDim.x) {
#pragma unroll
    for (int i = 0; i < G; ++i) {
      if (smem_acc) sacc[i * groups + g] = 0.0f;
      else prow[g * G + i] = 0.0f;
    }
  }
  for (int64_t r = r0; r < r1; ++r) {
    const float rs = rstd[r];
    float dot = 0.0f;
    for (int64_t g = threadIdx.x; g < groups; g += blockDim.x) {
      const int64_t gi = r * groups + g;
      float xv[G], dv[G], wv[G];
      decode16(q + gi * G, vec, fmt, load_group_scale(scales, gi, kind), xv);
      load16(dy + gi * G, vec, dv);
      load16(w + g * G, vec, wv);
#pragma unroll
      for (int i = 0; i < G; ++i) dot += (dv[i] * detail::norm_weight(wv[i], unit)) * (xv[i] * rs);
    }
    const float mean = block_sum(dot, red) / static_cast<float>(cols);
    for (int64_t g = threadIdx.x; g < groups; g += blockDim.x) {
      const int64_t gi = r * groups + g;
      float xv[G], dv[G], wv[G], o[G];
      decode16(q + gi * G, vec, fmt, load_group_scale(scales, gi, kind), xv);
      load16(dy + gi * G, vec, dv);
      load16(w + g * G, vec, wv);
#pragma unroll
      for (int i = 0; i < G; ++i) {
        const float xh = xv[i] * rs;
        o[i] = rs * (dv[i] * detail::norm_weight(wv[i], unit) - xh * mean);
        if (smem_acc) sacc[i * groups + g] += dv[i] * xh;
        else prow[g * G + i] += dv[i] * xh;
      }
      store16(dx + gi * G, vec, o);
    }
  }
  if (smem_acc) {
    for (int64_t g = threadIdx.x; g < groups; g += blockDim.x) {
#pragma unroll
      for (int i = 0; i < G; ++i) prow[g * G + i] = sacc[i * groups + g];
    }
  }
}

// dw[c] = sum over partitions in order: one thread per column (coalesced across the warp).
// Bytes: parts * cols * 4 read, cols * 4 written.
__global__ void rmsnorm_dw_reduce_kernel(const float* __restrict__ partial, int64_t parts,
                                         int64_t cols, float* __restrict__ dw) {
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < cols;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float s = 0.0f;
    for (int64_t p = 0; p < parts; ++p) s += partial[p * cols + c];
    dw[c] = s;
  }
}

int threads_for(int64_t groups) {
  const int64_t t = ((groups + 31) / 32) * 32;
  return static_cast<int>(t < 32 ? 32 : (t > kThreads ? kThreads : t));
}

}  // namespace

void rmsnorm_fwd(const void* x, DType x_dtype, const void* w, DType w_dtype, NormKind kind, int64_t rows,
                 int64_t cols, float eps, void* y, float* rstd, uint8_t* q, void* scales,
                 ScaleKind scale_kind, Fp8Format fmt, float* y_amax, cudaStream_t stream) {
  detail::check_rmsnorm_fwd(x, w, kind, rows, cols, eps, y, rstd, q, scales);
  if (y_amax != nullptr) COAT_CUDA_CHECK(cudaMemsetAsync(y_amax, 0, sizeof(float), stream));
  if (rows == 0) return;
  dispatch2(x_dtype, w_dtype, [&](auto* tt, auto* wt) {
    using T = std::remove_pointer_t<decltype(tt)>;
    using W = std::remove_pointer_t<decltype(wt)>;
    // Rows start at multiples of 16 elements, so base alignment decides for every row.
    const bool vec = cuda::aligned(x, 16) && cuda::aligned(w, 16) && cuda::aligned(y, 16) &&
                     (q == nullptr || cuda::aligned(q, 16));
    const unsigned grid = cuda::grid_for(rows, 1, 8);
    rmsnorm_fwd_kernel<T, W><<<grid, threads_for(cols / G), 0, stream>>>(
        static_cast<const T*>(x), static_cast<const W*>(w), rows, cols, eps, kind == NormKind::kUnitOffset, vec,
        static_cast<T*>(y),
        rstd, q, scales, scale_kind, fmt, y_amax);
    COAT_CHECK_LAUNCH();
  });
}

void rmsnorm_fwd_fp8(const uint8_t* q, const void* scales, ScaleKind scale_kind, Fp8Format fmt,
                     const float* rstd, const void* w, DType w_dtype, NormKind kind, int64_t rows, int64_t cols,
                     void* y, DType y_dtype, float* y_amax, cudaStream_t stream) {
  detail::check_rmsnorm_fwd_fp8(q, scales, rstd, w, kind, rows, cols, y);
  const int64_t n = rows * cols;
  if (y_amax != nullptr) COAT_CUDA_CHECK(cudaMemsetAsync(y_amax, 0, sizeof(float), stream));
  if (n == 0) return;
  dispatch2(y_dtype, w_dtype, [&](auto* tt, auto* wt) {
    using T = std::remove_pointer_t<decltype(tt)>;
    using W = std::remove_pointer_t<decltype(wt)>;
    const bool vec = cuda::aligned(q, 16) && cuda::aligned(w, 16) && cuda::aligned(y, 16);
    rmsnorm_fwd_fp8_kernel<T, W><<<cuda::grid_for(n / G, kThreads), kThreads, 0, stream>>>(
        q, scales, scale_kind, fmt, rstd, static_cast<const W*>(w), rows, cols, kind == NormKind::kUnitOffset, vec,
        static_cast<T*>(y), y_amax);
    COAT_CHECK_LAUNCH();
  });
}

void rmsnorm_bwd(const uint8_t* q, const void* scales, ScaleKind scale_kind, Fp8Format fmt,
                 const float* rstd, const void* w, DType w_dtype, NormKind kind, const void* dy, DType dy_dtype,
                 int64_t rows, int64_t cols, void* dx, float* workspace, float* dw,
                 cudaStream_t stream) {
  detail::check_rmsnorm_bwd(q, scales, rstd, w, kind, dy, rows, cols, dx, dw);
  const int64_t n = rows * cols;
  detail::check_norm_ptr(workspace, n, "workspace");
  if (cols == 0) return;
  const int64_t parts = rmsnorm_bwd_parts(rows);
  dispatch2(dy_dtype, w_dtype, [&](auto* tt, auto* wt) {
    using T = std::remove_pointer_t<decltype(tt)>;
    using W = std::remove_pointer_t<decltype(wt)>;
    if (parts > 0) {
      const bool vec = cuda::aligned(q, 16) && cuda::aligned(w, 16) && cuda::aligned(dy, 16) &&
                       cuda::aligned(dx, 16);
      // 48 KiB is the dynamic shared memory every launch may use without opting in.
      const size_t smem = static_cast<size_t>(cols) * sizeof(float);
      const bool smem_acc = smem + sizeof(float) * 32 <= 48 * 1024;
      rmsnorm_bwd_kernel<T, W><<<static_cast<unsigned>(parts), threads_for(cols / G),
                                 smem_acc ? smem : 0, stream>>>(
          q, scales, scale_kind, fmt, rstd, static_cast<const W*>(w), static_cast<const T*>(dy), rows,
          cols, parts, kind == NormKind::kUnitOffset, vec, smem_acc, static_cast<T*>(dx), workspace);
      COAT_CHECK_LAUNCH();
    }
    rmsnorm_dw_reduce_kernel<<<cuda::grid_for(cols, kThreads), kThreads, 0, stream>>>(workspace, parts,
                                                                                     cols, dw);
    COAT_CHECK_LAUNCH();
  });
}

}  // namespace coat
