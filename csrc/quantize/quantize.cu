// CUDA kernels of the quantize family. Every kernel is a grid-stride loop with 64-bit indices; the
// vectorized paths move 16-byte loads (8 bf16 or 4+4 fp32) and 8-byte FP8 stores per thread and are
// taken only when pointers are aligned; otherwise a scalar path computes the same bits.
#include <cfloat>

#include "common/cuda_utils.cuh"
#include "common/dre.h"
#include "quantize_args.h"
#include "stack.cuh"

namespace coat {
namespace {

using cuda::grid_for;
using detail::ceil_div;

constexpr int kThreads = 256;

using cuda::dispatch_dtype;

// The amax a per-tensor kernel derives its scale from: none (count 0: the scale is given), the
// amax pass's or a producer's (count 1), or the optimizer's, one per part (their max). `limit`: a
// finite |value| above it encodes as NaN (infinity but for the optimizer's amax, which comes from
// outside the call and may be stale: quantize.h quantize_stacked_from_part_amax).
struct GivenAmax {
  const float* p[kMaxStackParts];
  int count;
  bool check;
};

GivenAmax no_amax() { return GivenAmax{{}, 0, false}; }
GivenAmax one_amax(const float* a) { return GivenAmax{{a}, 1, false}; }

__device__ __forceinline__ float given_max(const GivenAmax& a) {
  float m = 0.0f;
#pragma unroll
  for (int i = 0; i < kMaxStackParts; ++i)  // constant indices: no local-memory copy of the parameter
    if (i < a.count) m = fmaxf(m, *a.p[i]);
  return m;
}

// The scale a per-tensor kernel applies: given, or derived from the amax (block 0 publishes it).
__device__ __forceinline__ float tensor_scale(const float* scale, const GivenAmax& amax, float* scale_out,
                                              Fp8Format fmt) {
  if (amax.count == 0) return *scale;
  const float s = scale_for(given_max(amax), fmt);
  if (blockIdx.x == 0 && threadIdx.x == 0) *scale_out = s;
  return s;
}

__device__ __forceinline__ float limit_of(const GivenAmax& amax) { return amax.check ? given_max(amax) : INFINITY; }

// x / scale, or NaN where a finite |x| exceeds the amax the scale came from (never with limit inf).
__device__ __forceinline__ float scaled(float x, float inv, float limit) {
  return finite_abs(x) > limit ? __int_as_float(0x7FC00000) : x * inv;
}

// amax: thread t reads 8-element chunks t, t + stride, ... walking from the END of the tensor, so
// that the chunks read last (the head) are still in L2 when the quantize pass starts there; two
// 16-byte loads are in flight per thread. Bytes: n * sizeof(T) read. Partial maxima combine with an
// integer atomicMax on the float bits (valid for non-negative floats); *amax must be zero before.
// With vec, no 8-element chunk straddles two parts (the launcher checks).
template <typename T>
__global__ void amax_kernel(Stack<T> x, int64_t n, bool vec, float* amax) {
  float m = 0.0f;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t chunks = vec ? n / 8 : 0;
  int64_t c = chunks - 1 - tid;
  for (; c - stride >= 0; c -= 2 * stride) {
    float v[8], w[8];
    cuda::load8(x.elem(c * 8), v);
    cuda::load8(x.elem((c - stride) * 8), w);
#pragma unroll
    for (int i = 0; i < 8; ++i) m = fmaxf(m, fmaxf(finite_abs(v[i]), finite_abs(w[i])));
  }
  if (c >= 0) {
    float v[8];
    cuda::load8(x.elem(c * 8), v);
#pragma unroll
    for (int i = 0; i < 8; ++i) m = fmaxf(m, finite_abs(v[i]));
  }
  for (int64_t i = chunks * 8 + tid; i < n; i += stride) m = fmaxf(m, finite_abs(Elem<T>::load(*x.elem(i))));
  cuda::block_max_atomic(m, amax);
}

// Per-tensor quantize, row-major output only. Thread t handles 8-element chunks; bytes moved:
// n * sizeof(T) read + n written.
template <typename T>
__global__ void quantize_tensor_kernel(Stack<T> x, int64_t n, bool vec, Fp8Format fmt,
                                       const float* scale, GivenAmax amax, float* scale_out,
                                       uint8_t* __restrict__ q) {
  const float inv = 1.0f / tensor_scale(scale, amax, scale_out, fmt);
  const float limit = limit_of(amax);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t chunks = vec ? n / 8 : 0;
  int64_t c = tid;
  for (; c + stride < chunks; c += 2 * stride) {  // two 16-byte loads in flight
    float v[8], w[8];
    cuda::load8(x.elem(c * 8), v);
    cuda::load8(x.elem((c + stride) * 8), w);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      v[i] = scaled(v[i], inv, limit);
      w[i] = scaled(w[i], inv, limit);
    }
    reinterpret_cast<uint2*>(q)[c] = cuda::encode8(v, fmt);
    reinterpret_cast<uint2*>(q)[c + stride] = cuda::encode8(w, fmt);
  }
  if (c < chunks) {
    float v[8];
    cuda::load8(x.elem(c * 8), v);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = scaled(v[i], inv, limit);
    reinterpret_cast<uint2*>(q)[c] = cuda::encode8(v, fmt);
  }
  for (int64_t i = chunks * 8 + tid; i < n; i += stride)
    q[i] = encode_fp8(scaled(Elem<T>::load(*x.elem(i)), inv, limit), fmt);
}

// Tiles of the transposing kernels: 64 x 64 bytes of codes in shared memory (rows padded by 16).
constexpr int kTile = 64;

// The transpose of a full 64x64 byte tile from shared memory: thread tid writes 16 consecutive bytes
// of output row tid / 4 (out points at the tile's first byte in q_t, whose rows are ld bytes apart).
__device__ __forceinline__ void store_tile_t(const uint8_t (&tile)[kTile][kTile + 16], int tid, uint8_t* out,
                                             int64_t ld) {
  const int cc = tid >> 2, rr = (tid & 3) * 16;
  uint32_t w[4];
#pragma unroll
  for (int j = 0; j < 4; ++j)
    w[j] = tile[rr + 4 * j][cc] | (tile[rr + 4 * j + 1][cc] << 8) | (tile[rr + 4 * j + 2][cc] << 16) |
           (static_cast<uint32_t>(tile[rr + 4 * j + 3][cc]) << 24);
  *reinterpret_cast<uint4*>(out + cc * ld + rr) = make_uint4(w[0], w[1], w[2], w[3]);
}

// The same for a tile cut by the matrix edges (or misaligned), one byte per thread and step.
__device__ __forceinline__ void store_tile_t_partial(const uint8_t (&tile)[kTile][kTile + 16], int tid, int64_t r0,
                                                     int64_t c0, int64_t rows, int64_t cols, uint8_t* q_t) {
  for (int i = tid; i < kTile * kTile; i += blockDim.x) {
    const int cc = i / kTile, rr = i % kTile;
    const int64_t r = r0 + rr, c = c0 + cc;
    if (r < rows && c < cols) q_t[c * rows + r] = tile[rr][cc];
  }
}

// Per-tensor quantize writing q [rows, cols] (if not null) and q_t [cols, rows]. One 256-thread
// block per 64x64 tile: each thread loads two 8-element chunks (16 B each) of two rows (each row
// looked up in its own part, so tiles may straddle parts), writes their codes to q (8 B stores) and
// to a shared tile, then writes 16 consecutive bytes of one q_t row. Partial or misaligned tiles
// take a per-element path. Bytes: n * sizeof(T) read, n (q_t) or 2n (q and q_t) written.
template <typename T>
__global__ void __launch_bounds__(256) quantize_tensor_t_kernel(
    Stack<T> x, int64_t rows, int64_t cols, bool vec, Fp8Format fmt, const float* scale,
    GivenAmax amax, float* scale_out, uint8_t* __restrict__ q, uint8_t* __restrict__ q_t) {
  __shared__ __align__(16) uint8_t tile[kTile][kTile + 16];
  const float inv = 1.0f / tensor_scale(scale, amax, scale_out, fmt);
  const float limit = limit_of(amax);
  const int64_t tiles_c = ceil_div(cols, kTile);
  const int64_t tiles = ceil_div(rows, kTile) * tiles_c;
  const int tid = threadIdx.x;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t r0 = (t / tiles_c) * kTile, c0 = (t % tiles_c) * kTile;
    const bool full = vec && r0 + kTile <= rows && c0 + kTile <= cols;
    if (full) {
      float v[2][8];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int id = tid + 256 * i, rr = id >> 3, cc = (id & 7) * 8;
        cuda::load8(x.row(r0 + rr) + c0 + cc, v[i]);
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int id = tid + 256 * i, rr = id >> 3, cc = (id & 7) * 8;
#pragma unroll
        for (int j = 0; j < 8; ++j) v[i][j] = scaled(v[i][j], inv, limit);
        const uint2 codes = cuda::encode8(v[i], fmt);
        if (q != nullptr) *reinterpret_cast<uint2*>(q + (r0 + rr) * cols + c0 + cc) = codes;
        *reinterpret_cast<uint2*>(&tile[rr][cc]) = codes;
      }
      __syncthreads();
      store_tile_t(tile, tid, q_t + c0 * rows + r0, rows);
    } else {
      for (int i = tid; i < kTile * kTile; i += blockDim.x) {
        const int rr = i / kTile, cc = i % kTile;
        const int64_t r = r0 + rr, c = c0 + cc;
        if (r < rows && c < cols) {
          const uint8_t code = encode_fp8(scaled(Elem<T>::load(x.row(r)[c]), inv, limit), fmt);
          if (q != nullptr) q[r * cols + c] = code;
          tile[rr][cc] = code;
        }
      }
      __syncthreads();
      store_tile_t_partial(tile, tid, r0, c0, rows, cols, q_t);
    }
    __syncthreads();
  }
}

// Byte transpose of stacked codes, tiled as quantize_tensor_t_kernel: one 256-thread block per 64x64
// tile; each thread loads 16 bytes of one row (its part looked up per row, so tiles may straddle
// parts) into a shared tile and writes 16 consecutive bytes of one q_t row. Partial or misaligned
// tiles take a per-element path. Bytes: n read, n written.
__global__ void __launch_bounds__(256) transpose_codes_kernel(Stack<uint8_t> x, int64_t rows, int64_t cols,
                                                              bool vec, uint8_t* __restrict__ q_t) {
  __shared__ __align__(16) uint8_t tile[kTile][kTile + 16];
  const int64_t tiles_c = ceil_div(cols, kTile);
  const int64_t tiles = ceil_div(rows, kTile) * tiles_c;
  const int tid = threadIdx.x;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t r0 = (t / tiles_c) * kTile, c0 = (t % tiles_c) * kTile;
    if (vec && r0 + kTile <= rows && c0 + kTile <= cols) {
      const int rr = tid >> 2, cc = (tid & 3) * 16;
      *reinterpret_cast<uint4*>(&tile[rr][cc]) = *reinterpret_cast<const uint4*>(x.row(r0 + rr) + c0 + cc);
      __syncthreads();
      store_tile_t(tile, tid, q_t + c0 * rows + r0, rows);
    } else {
      for (int i = tid; i < kTile * kTile; i += blockDim.x) {
        const int rr = i / kTile, cc = i % kTile;
        const int64_t r = r0 + rr, c = c0 + cc;
        if (r < rows && c < cols) tile[rr][cc] = x.row(r)[c];
      }
      __syncthreads();
      store_tile_t_partial(tile, tid, r0, c0, rows, cols, q_t);
    }
    __syncthreads();
  }
}

// Per-group quantize, G/8 consecutive lanes per group, 8 elements per lane, four 16-byte loads in
// flight per lane; the group's amax is a shuffle reduction over those lanes. Whole warps iterate
// together so shuffles never miss a lane.
// Bytes: n * sizeof(T) read, n + groups * scale bytes written.
template <typename T, int G>
__device__ __forceinline__ void quantize_group_chunk(float (&v)[8], bool active, int64_t c, int lane,
                                                     Fp8Format fmt, ScaleKind kind, void* scales,
                                                     uint8_t* q) {
  constexpr int L = G / 8;
  float m = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) m = fmaxf(m, finite_abs(v[i]));
  m = cuda::warp_max(m, L);
  if (!active) return;
  float s;
  if (kind == ScaleKind::kE8M0) {
    const uint8_t b = e8m0_scale_for(m, fmt);
    s = e8m0_to_float(b);
    if (lane % L == 0) static_cast<uint8_t*>(scales)[c / L] = b;
  } else {
    s = scale_for(m, fmt);
    if (lane % L == 0) static_cast<float*>(scales)[c / L] = s;
  }
  const float inv = 1.0f / s;
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] *= inv;
  reinterpret_cast<uint2*>(q)[c] = cuda::encode8(v, fmt);
}

template <typename T, int G>
__global__ void quantize_group_kernel(const T* __restrict__ x, int64_t n, Fp8Format fmt,
                                      ScaleKind kind, void* __restrict__ scales,
                                      uint8_t* __restrict__ q) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x >> 5);
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int64_t chunks = n / 8;
  const int64_t step = warps * 32;
  constexpr int kInFlight = 4;  // 16-byte loads issued per lane before the first is used
  for (int64_t base = warp * 32; base < chunks; base += kInFlight * step) {
    // Whole warps iterate together (the group amax is a shuffle over G/8 lanes); chunk counts are
    // multiples of G/8, so a group is either wholly active or wholly inactive.
    float v[kInFlight][8] = {};
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int64_t c = base + u * step + lane;
      if (c < chunks) cuda::load8(x + c * 8, v[u]);
    }
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int64_t c = base + u * step + lane;
      if (base + u * step < chunks) quantize_group_chunk<T, G>(v[u], c < chunks, c, lane, fmt, kind, scales, q);
    }
  }
}

// Unaligned fallback: one thread per group.
template <typename T>
__global__ void quantize_group_scalar_kernel(const T* __restrict__ x, int64_t n, int group,
                                             Fp8Format fmt, ScaleKind kind, void* scales,
                                             uint8_t* q) {
  const int64_t groups = n / group;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < groups;
       g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const T* xg = x + g * group;
    float m = 0.0f;
    for (int i = 0; i < group; ++i) m = fmaxf(m, finite_abs(Elem<T>::load(xg[i])));
    float s;
    if (kind == ScaleKind::kE8M0) {
      const uint8_t b = e8m0_scale_for(m, fmt);
      static_cast<uint8_t*>(scales)[g] = b;
      s = e8m0_to_float(b);
    } else {
      s = scale_for(m, fmt);
      static_cast<float*>(scales)[g] = s;
    }
    const float inv = 1.0f / s;
    for (int i = 0; i < group; ++i) q[g * group + i] = encode_fp8(Elem<T>::load(xg[i]) * inv, fmt);
  }
}

// Dequantize, per tensor (group == 0) or per group: 8 codes per thread per step.
// Bytes: n read + n * sizeof(T) written (+ scales).
template <typename T>
__global__ void dequantize_kernel(const uint8_t* __restrict__ q, int64_t n, bool vec, Fp8Format fmt,
                                  int group, ScaleKind kind, const void* __restrict__ scales,
                                  T* __restrict__ y) {
  auto scale_at = [&](int64_t i) -> float {
    if (group == 0) return *static_cast<const float*>(scales);
    const int64_t g = i / group;
    return kind == ScaleKind::kE8M0 ? e8m0_to_float(static_cast<const uint8_t*>(scales)[g])
                                    : static_cast<const float*>(scales)[g];
  };
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t chunks = vec ? n / 8 : 0;
  for (int64_t c = tid; c < chunks; c += stride) {
    float v[8];
    cuda::decode8(reinterpret_cast<const uint2*>(q)[c], fmt, v);
    const float s = scale_at(c * 8);  // groups are multiples of 8: one scale per chunk
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] *= s;
    cuda::store8(y + c * 8, v);
  }
  for (int64_t i = chunks * 8 + tid; i < n; i += stride) y[i] = Elem<T>::store(decode_fp8(q[i], fmt) * scale_at(i));
}

// DRE: one warp per group of 128, 4 elements per lane (one 16-byte load when the group is whole
// and aligned); the loads of the warp's next group are issued before this group's math.
// Bytes: 4n read, n + 5 per group written.
__device__ __forceinline__ void dre_load4(const float* x, int64_t i0, int64_t n, bool whole, float (&v)[4]) {
  if (whole) {
    const float4 a = *reinterpret_cast<const float4*>(x + i0);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = i0 + j < n ? x[i0 + j] : 0.0f;
  }
}

__global__ void dre_quantize_kernel(const float* __restrict__ x, int64_t n, bool vec, bool qvec, Fp8Format fmt,
                                    float log2_range, uint8_t* __restrict__ q,
                                    float* __restrict__ gmax, uint8_t* __restrict__ k16) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x >> 5);
  const int64_t groups = ceil_div(n, kDreGroupSize);
  int64_t g = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  float next[4];
  auto whole = [&](int64_t grp) { return vec && grp * kDreGroupSize + kDreGroupSize <= n; };
  if (g < groups) dre_load4(x, g * kDreGroupSize + lane * 4, n, whole(g), next);
  for (; g < groups; g += warps) {
    const int64_t i0 = g * kDreGroupSize + lane * 4;
    float v[4] = {next[0], next[1], next[2], next[3]};
    if (g + warps < groups) dre_load4(x, (g + warps) * kDreGroupSize + lane * 4, n, whole(g + warps), next);
    float mx = 0.0f, mn = INFINITY;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float a = fabsf(v[j]);
      if (dre_counts(a)) {
        mx = fmaxf(mx, a);
        if (a > 0.0f) mn = fminf(mn, a);
      }
    }
    mx = cuda::warp_max_nonneg(mx);  // finite magnitudes; mn may be +inf
    mn = cuda::warp_min_nonneg(mn);
    float mx2 = 0.0f;  // the largest finite |x| below mx (NaN compares false)
#pragma unroll
    for (int j = 0; j < 4; ++j) mx2 = fabsf(v[j]) < mx ? fmaxf(mx2, fabsf(v[j])) : mx2;
    mx2 = cuda::warp_max_nonneg(mx2);
    const DreNewGroup grp = dre_new_group(mx, mx2, mn, log2_range, fmt);
    if (lane == 0) {
      gmax[g] = grp.word;
      k16[g] = grp.k16;
    }
    uint8_t c[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) c[j] = dre_encode(v[j], grp.g, fmt);
    if (whole(g) && qvec) {
      *reinterpret_cast<uchar4*>(q + i0) = make_uchar4(c[0], c[1], c[2], c[3]);
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (i0 + j < n) q[i0 + j] = c[j];
    }
  }
}

// DRE decode: one warp per group, 4 codes per lane (4-byte load, 16-byte store when whole and
// aligned), code log2 from a shared-memory table. Bytes: n + 5 per group read, 4n written.
__global__ void dre_dequantize_kernel(const uint8_t* __restrict__ q, const float* __restrict__ gmax,
                                      const uint8_t* __restrict__ k16, int64_t n, bool vec,
                                      Fp8Format fmt, float* __restrict__ y) {
  __shared__ float lut[128];
  for (int i = threadIdx.x; i < 128; i += blockDim.x) lut[i] = i ? dre_log2_code(i, fmt) : 0.0f;
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x >> 5);
  const int64_t groups = ceil_div(n, kDreGroupSize);
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
       g < groups; g += warps) {
    const int64_t i0 = g * kDreGroupSize + lane * 4;
    const bool whole = vec && g * kDreGroupSize + kDreGroupSize <= n;
    uint8_t c[4];
    if (whole) {
      const uchar4 w = *reinterpret_cast<const uchar4*>(q + i0);
      c[0] = w.x; c[1] = w.y; c[2] = w.z; c[3] = w.w;
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) c[j] = i0 + j < n ? q[i0 + j] : 0;
    }
    const DreGroup grp = dre_group(gmax[g], k16[g], fmt);
    float v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = dre_decode(c[j], grp, fmt, lut);
    if (whole) {
      *reinterpret_cast<float4*>(y + i0) = make_float4(v[0], v[1], v[2], v[3]);
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (i0 + j < n) y[i0 + j] = v[j];
    }
  }
}

// amax_out: where the amax pass writes (null: none runs); given: the amax the scale comes from.
template <typename T>
void launch_quantize_stacked(const StackedRows& x, int64_t rows, Fp8Format fmt, const float* scale,
                             float* amax_out, const GivenAmax& given, float* scale_out, uint8_t* q, uint8_t* q_t,
                             cudaStream_t stream) {
  bool vec = false;
  const Stack<T> s = stack_of<T>(x, &vec);
  const int64_t cols = x.cols, n = rows * cols;
  if (amax_out != nullptr) {
    COAT_CUDA_CHECK(cudaMemsetAsync(amax_out, 0, sizeof(float), stream));
    // Runs for n == 0 too: the quantize launch then publishes amax = 0 and scale = 1.
    amax_kernel<T><<<grid_for(vec ? n / 8 + 1 : n, kThreads), kThreads, 0, stream>>>(s, n, vec, amax_out);
    COAT_CHECK_LAUNCH();
  }
  if (q_t != nullptr) {
    const int64_t tiles = ceil_div(rows, kTile) * ceil_div(cols, kTile);
    const bool tvec = vec && (q == nullptr || cuda::aligned(q, 8)) && cuda::aligned(q_t, 16) &&
                      cols % 8 == 0 && rows % 16 == 0;
    quantize_tensor_t_kernel<T><<<grid_for(tiles, 1, 8), kThreads, 0, stream>>>(
        s, rows, cols, tvec, fmt, scale, given, scale_out, q, q_t);
  } else {
    const bool qvec = vec && cuda::aligned(q, 8);
    quantize_tensor_kernel<T><<<grid_for(qvec ? n / 8 + 1 : n, kThreads), kThreads, 0, stream>>>(
        s, n, qvec, fmt, scale, given, scale_out, q);
  }
  COAT_CHECK_LAUNCH();
}

}  // namespace

void quantize_stacked(const StackedRows& x, Fp8Format fmt, const float* scale, float* amax,
                      float* scale_out, uint8_t* q, uint8_t* q_t, cudaStream_t stream) {
  const int64_t rows = detail::check_stacked(x, scale, amax, scale_out, q, q_t);
  if (rows * x.cols == 0 && amax == nullptr) return;
  dispatch_dtype(x.dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    launch_quantize_stacked<T>(x, rows, fmt, scale, amax, amax ? one_amax(amax) : no_amax(), scale_out, q, q_t,
                               stream);
  });
}

void quantize_stacked_from_amax(const StackedRows& x, Fp8Format fmt, const float* amax, float* scale_out,
                                uint8_t* q, uint8_t* q_t, cudaStream_t stream) {
  COAT_CHECK_ARG(amax != nullptr, "amax must not be null");
  const int64_t rows = detail::check_stacked(x, amax, amax, scale_out, q, q_t);
  dispatch_dtype(x.dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    // The kernels only read amax (to publish the scale, for n == 0 too).
    launch_quantize_stacked<T>(x, rows, fmt, nullptr, nullptr, one_amax(amax), scale_out, q, q_t, stream);
  });
}

void quantize_stacked_from_part_amax(const StackedRows& x, Fp8Format fmt, const float* const* part_amax,
                                     float* scale_out, uint8_t* q, uint8_t* q_t, cudaStream_t stream) {
  COAT_CHECK_ARG(part_amax != nullptr, "part_amax must not be null");
  GivenAmax given{{}, x.count, true};
  for (int p = 0; p < x.count && p < kMaxStackParts; ++p) {
    COAT_CHECK_ARG(part_amax[p] != nullptr, "part_amax[" + std::to_string(p) + "] must not be null");
    given.p[p] = part_amax[p];
  }
  const int64_t rows = detail::check_stacked(x, part_amax[0], part_amax[0], scale_out, q, q_t);
  dispatch_dtype(x.dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    launch_quantize_stacked<T>(x, rows, fmt, nullptr, nullptr, given, scale_out, q, q_t, stream);
  });
}

void amax_stacked(const StackedRows& x, float* amax, cudaStream_t stream) {
  COAT_CHECK_ARG(amax != nullptr, "amax must not be null");
  const int64_t n = detail::check_stacked_parts(x) * x.cols;
  COAT_CUDA_CHECK(cudaMemsetAsync(amax, 0, sizeof(float), stream));
  if (n == 0) return;
  dispatch_dtype(x.dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    bool vec = false;
    const Stack<T> s = stack_of<T>(x, &vec);
    amax_kernel<T><<<grid_for(vec ? n / 8 + 1 : n, kThreads), kThreads, 0, stream>>>(s, n, vec, amax);
    COAT_CHECK_LAUNCH();
  });
}

void transpose_stacked_codes(const StackedRows& x, uint8_t* q_t, cudaStream_t stream) {
  const int64_t rows = detail::check_stacked_codes(x, q_t);
  if (rows * x.cols == 0) return;
  bool vec = false;
  const Stack<uint8_t> s = stack_of<uint8_t>(x, &vec);
  // Whole 16-byte row segments and q_t rows: every part starts 16-byte aligned and holds whole rows.
  vec = vec && cuda::aligned(q_t, 16) && x.cols % 16 == 0 && rows % 16 == 0;
  const int64_t tiles = ceil_div(rows, kTile) * ceil_div(x.cols, kTile);
  transpose_codes_kernel<<<grid_for(tiles, 1, 8), kThreads, 0, stream>>>(s, rows, x.cols, vec, q_t);
  COAT_CHECK_LAUNCH();
}

void quantize_per_tensor(const void* x, DType x_dtype, int64_t rows, int64_t cols, Fp8Format fmt,
                         const float* scale, uint8_t* q, uint8_t* q_t, cudaStream_t stream) {
  detail::check_shape(rows, cols);
  detail::check_ptr(x, rows * cols, "x");
  detail::check_ptr(q, rows * cols, "q");
  COAT_CHECK_ARG(scale != nullptr, "scale must not be null");
  quantize_stacked(detail::one_part(x, x_dtype, rows, cols), fmt, scale, nullptr, nullptr, q, q_t,
                   stream);
}

void quantize_per_tensor_amax(const void* x, DType x_dtype, int64_t rows, int64_t cols,
                              Fp8Format fmt, float* amax, float* scale, uint8_t* q, uint8_t* q_t,
                              cudaStream_t stream) {
  detail::check_shape(rows, cols);
  detail::check_ptr(x, rows * cols, "x");
  detail::check_ptr(q, rows * cols, "q");
  COAT_CHECK_ARG(amax != nullptr && scale != nullptr, "amax and scale must not be null");
  quantize_stacked(detail::one_part(x, x_dtype, rows, cols), fmt, nullptr, amax, scale, q, q_t,
                   stream);
}

void dequantize_per_tensor(const uint8_t* q, Fp8Format fmt, int64_t n, const float* scale, void* y,
                           DType out_dtype, cudaStream_t stream) {
  COAT_CHECK_ARG(n >= 0, "n must be >= 0");
  detail::check_ptr(q, n, "q");
  detail::check_ptr(y, n, "y");
  COAT_CHECK_ARG(scale != nullptr, "scale must not be null");
  if (n == 0) return;
  dispatch_dtype(out_dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const bool vec = cuda::aligned(q, 8) && cuda::aligned(y, 16);
    dequantize_kernel<T><<<grid_for(vec ? n / 8 + 1 : n, kThreads), kThreads, 0, stream>>>(
        q, n, vec, fmt, 0, ScaleKind::kFloat32, scale, static_cast<T*>(y));
    COAT_CHECK_LAUNCH();
  });
}

void quantize_per_group(const void* x, DType x_dtype, int64_t rows, int64_t cols, int group,
                        Fp8Format fmt, ScaleKind scale_kind, void* scales, uint8_t* q,
                        cudaStream_t stream) {
  detail::check_shape(rows, cols);
  detail::check_group(cols, group);
  const int64_t n = rows * cols;
  detail::check_ptr(x, n, "x");
  detail::check_ptr(q, n, "q");
  detail::check_ptr(scales, n, "scales");
  if (n == 0) return;
  dispatch_dtype(x_dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* xt = static_cast<const T*>(x);
    if (!(cuda::aligned(x, 16) && cuda::aligned(q, 8))) {
      quantize_group_scalar_kernel<T><<<grid_for(n / group, kThreads), kThreads, 0, stream>>>(
          xt, n, group, fmt, scale_kind, scales, q);
    } else {
      const unsigned blocks = grid_for(n / 8, kThreads);
      switch (group) {
        case 16: quantize_group_kernel<T, 16><<<blocks, kThreads, 0, stream>>>(xt, n, fmt, scale_kind, scales, q); break;
        case 32: quantize_group_kernel<T, 32><<<blocks, kThreads, 0, stream>>>(xt, n, fmt, scale_kind, scales, q); break;
        case 64: quantize_group_kernel<T, 64><<<blocks, kThreads, 0, stream>>>(xt, n, fmt, scale_kind, scales, q); break;
        default: quantize_group_kernel<T, 128><<<blocks, kThreads, 0, stream>>>(xt, n, fmt, scale_kind, scales, q); break;
      }
    }
    COAT_CHECK_LAUNCH();
  });
}

void dequantize_per_group(const uint8_t* q, Fp8Format fmt, int64_t rows, int64_t cols, int group,
                          ScaleKind scale_kind, const void* scales, void* y, DType out_dtype,
                          cudaStream_t stream) {
  detail::check_shape(rows, cols);
  detail::check_group(cols, group);
  const int64_t n = rows * cols;
  detail::check_ptr(q, n, "q");
  detail::check_ptr(y, n, "y");
  detail::check_ptr(scales, n, "scales");
  if (n == 0) return;
  dispatch_dtype(out_dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const bool vec = cuda::aligned(q, 8) && cuda::aligned(y, 16);
    dequantize_kernel<T><<<grid_for(vec ? n / 8 + 1 : n, kThreads), kThreads, 0, stream>>>(
        q, n, vec, fmt, group, scale_kind, scales, static_cast<T*>(y));
    COAT_CHECK_LAUNCH();
  });
}

void dre_quantize(const float* x, int64_t n, Fp8Format fmt, float log2_range, uint8_t* q,
                  float* gmax, uint8_t* k16, cudaStream_t stream) {
  detail::check_dre(n, log2_range);
  detail::check_ptr(x, n, "x");
  detail::check_ptr(q, n, "q");
  detail::check_ptr(gmax, n, "gmax");
  detail::check_ptr(k16, n, "k16");
  if (n == 0) return;
  const bool vec = cuda::aligned(x, 16);
  const int64_t groups = ceil_div(n, kDreGroupSize);
  dre_quantize_kernel<<<grid_for(groups * 32, kThreads), kThreads, 0, stream>>>(
      x, n, vec, cuda::aligned(q, 4), fmt, log2_range, q, gmax, k16);
  COAT_CHECK_LAUNCH();
}

void dre_dequantize(const uint8_t* q, const float* gmax, const uint8_t* k16, int64_t n,
                    Fp8Format fmt, float* y, cudaStream_t stream) {
  COAT_CHECK_ARG(n >= 0, "n must be >= 0");
  detail::check_ptr(q, n, "q");
  detail::check_ptr(gmax, n, "gmax");
  detail::check_ptr(k16, n, "k16");
  detail::check_ptr(y, n, "y");
  if (n == 0) return;
  const bool vec = cuda::aligned(q, 4) && cuda::aligned(y, 16);
  dre_dequantize_kernel<<<grid_for(ceil_div(n, kDreGroupSize) * 32, kThreads), kThreads, 0, stream>>>(
      q, gmax, k16, n, vec, fmt, y);
  COAT_CHECK_LAUNCH();
}

}  // namespace coat
