// The scaled (row / block) quantizer on the GPU (quantize.h quantize_scaled). One 256-thread block
// per 128 x 128 tile of X: warp w holds rows 16w..16w+15, lane l columns 4l..4l+3 (64 fp32 values
// per thread, one 8-byte load per row for bf16), so a 1x128 group is one warp-row and a 128x1 or
// 128x128 group one tile. Per output (q and/or q_t) the tile reduces its elements to group maxima
// in registers and shared memory, writes the scales, and quantizes from the same registers: one
// read of X. q is written 4 codes per store; q_t goes through a shared-memory transpose and is
// written 4 codes per store along its rows. kRow groups longer than a tile take a first launch of
// the same kernel that only reduces, publishing maxima with an integer atomicMax on the float bits
// (valid for non-negative floats), and a pass that turns them into scales.
// Bytes: R * cols * sizeof(T) read (twice with the first launch), R * cols per code output written.
#include "common/cuda_utils.cuh"
#include "common/scale_grid.h"
#include "quantize_args.h"
#include "stack.cuh"

namespace coat {
namespace {

constexpr int kB = static_cast<int>(kScaleBlock);  // the tile edge
constexpr int kThreads = 256;
constexpr int kRows = 16;  // rows per warp

// One output of a launch: its grid, its buffers, and whether its groups lie within a tile.
struct Out {
  ScaleGrid g;
  uint8_t* q;  // null: not made
  float* scale;
  bool local;
  bool transposed;
  int64_t k_blocks;  // kBlock128: blocks along its K (the padded layout's used entries per row)
  bool block128;
};

// The scales (or maxima) of a tile's groups for one output, by what its groups span in the tile.
enum class Span { kRow, kCol, kAll };
struct TileScales {
  float row[kRows];  // Span::kRow: per row of this warp
  float col[4];      // Span::kCol: per column of this lane
  float all;         // Span::kAll
};

__device__ __forceinline__ Span span_of(const ScaleGrid& g) {
  if (g.group_r == 1) return Span::kRow;  // one row, along the columns of the tile
  if (g.group_c == 1) return Span::kCol;
  return Span::kAll;
}

template <typename T>
__device__ __forceinline__ void load4(const T* p, float (&v)[4]) {
  if constexpr (sizeof(T) == 4) {
    const float4 a = *reinterpret_cast<const float4*>(p);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
  } else {
    const uint2 raw = *reinterpret_cast<const uint2*>(p);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = Elem<T>::load(e[j]);
  }
}

// The group maxima of the tile for a span (every thread gets those of its elements).
__device__ __forceinline__ void tile_max(Span sp, const float (&v)[kRows][4], float (*red)[kB], int warp,
                                         int lane, TileScales& t) {
  if (sp == Span::kRow) {
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      float m = 0.0f;
#pragma unroll
      for (int j = 0; j < 4; ++j) m = fmaxf(m, finite_abs(v[i][j]));
      t.row[i] = cuda::warp_max(m);
    }
    return;
  }
  float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int i = 0; i < kRows; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) c[j] = fmaxf(c[j], finite_abs(v[i][j]));
  if (sp == Span::kAll) {
    float m = fmaxf(fmaxf(c[0], c[1]), fmaxf(c[2], c[3]));
    m = cuda::warp_max(m);
    if (lane == 0) red[warp][0] = m;
    __syncthreads();
    float a = 0.0f;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) a = fmaxf(a, red[w][0]);
    t.all = a;
    __syncthreads();
    return;
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) red[warp][4 * lane + j] = c[j];
  __syncthreads();
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    float a = 0.0f;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) a = fmaxf(a, red[w][4 * lane + j]);
    t.col[j] = a;
  }
  __syncthreads();
}

// Calls f(slot, value) once per group of the tile that holds rows/columns inside the padded shape,
// with the value of t for it.
template <typename F>
__device__ __forceinline__ void for_each_group(Span sp, const TileScales& t, int64_t r0, int64_t c0, int warp,
                                               int lane, int64_t rows_pad, int64_t cols_pad, const ScaleGrid& g,
                                               F&& f) {
  if (sp == Span::kRow) {
    if (lane != 0) return;
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int64_t r = r0 + warp * kRows + i;
      if (r < rows_pad) f(g.index(r, c0), t.row[i]);
    }
  } else if (sp == Span::kCol) {
    if (warp != 0) return;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t c = c0 + 4 * lane + j;
      if (c < cols_pad) f(g.index(r0, c), t.col[j]);
    }
  } else if (warp == 0 && lane == 0) {
    f(g.index(r0, c0), t.all);
  }
}

// The scales of o for this tile: computed here (local groups; their scales are written) or read
// back from the first launch's results.
__device__ __forceinline__ void tile_scales(const Out& o, Fp8Format fmt, const float (&v)[kRows][4],
                                            float (*red)[kB], int64_t r0, int64_t c0, int warp, int lane,
                                            int64_t rows_pad, int64_t cols_pad, TileScales& t) {
  const Span sp = span_of(o.g);
  if (!o.local) {
    // Only kRow groups are ever longer than a tile; reads stay inside the padded shape.
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int64_t r = r0 + warp * kRows + i;
      t.row[i] = sp == Span::kRow && r < rows_pad ? o.scale[o.g.index(r, c0)] : 1.0f;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t c = c0 + 4 * lane + j;
      t.col[j] = sp == Span::kCol && c < cols_pad ? o.scale[o.g.index(r0, c)] : 1.0f;
    }
    t.all = 1.0f;
    return;
  }
  tile_max(sp, v, red, warp, lane, t);
#pragma unroll
  for (int i = 0; i < kRows; ++i) t.row[i] = scale_for(t.row[i], fmt);
#pragma unroll
  for (int j = 0; j < 4; ++j) t.col[j] = scale_for(t.col[j], fmt);
  t.all = scale_for(t.all, fmt);
  float* scale = o.scale;
  for_each_group(sp, t, r0, c0, warp, lane, rows_pad, cols_pad, o.g, [&](int64_t slot, float s) { scale[slot] = s; });
  if (o.block128 && warp == 0) {
    // The padding of the 128x128 layout's rows, written by the tile at the end of its K: 1.
    const int64_t kb = o.transposed ? r0 / kB : c0 / kB;
    if (kb == o.k_blocks - 1)
      for (int64_t e = o.k_blocks + lane; e < round_up4(o.k_blocks); e += 32)
        scale[o.transposed ? o.g.index(0, c0) + e : o.g.index(r0, 0) + e] = 1.0f;
  }
}

__device__ __forceinline__ float scale_at(Span sp, const TileScales& t, int i, int j) {
  return sp == Span::kRow ? t.row[i] : sp == Span::kCol ? t.col[j] : t.all;
}

template <typename T, bool kMaxOnly>
__global__ void __launch_bounds__(kThreads) scaled_kernel(Stack<T> x, int64_t rows, int64_t cols, int64_t rows_pad,
                                                          int64_t cols_pad, bool vec, Fp8Format fmt, Out o,
                                                          Out ot) {
  __shared__ float red[kThreads / 32][kB];
  __shared__ __align__(16) uint8_t tile_t[kB][kB + 4];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kB, c0 = static_cast<int64_t>(blockIdx.x) * kB;
  const int64_t cb = c0 + 4 * lane;
  float v[kRows][4];
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int64_t r = r0 + warp * kRows + i;
#pragma unroll
    for (int j = 0; j < 4; ++j) v[i][j] = 0.0f;
    if (r >= rows || cb >= cols) continue;
    const T* p = x.row(r) + cb;
    if (vec && cb + 4 <= cols) {
      load4(p, v[i]);
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (cb + j < cols) v[i][j] = Elem<T>::load(p[j]);
    }
  }

  if constexpr (kMaxOnly) {
    auto publish = [&](const Out& out) {
      if (out.q == nullptr || out.local) return;
      const Span sp = span_of(out.g);
      TileScales t{};
      tile_max(sp, v, red, warp, lane, t);
      int* m = reinterpret_cast<int*>(out.scale);
      for_each_group(sp, t, r0, c0, warp, lane, rows_pad, cols_pad, out.g,
                     [&](int64_t slot, float a) { atomicMax(m + slot, __float_as_int(a)); });
    };
    publish(o);
    publish(ot);
  } else {
    if (o.q != nullptr) {
      TileScales t{};
      tile_scales(o, fmt, v, red, r0, c0, warp, lane, rows_pad, cols_pad, t);
      const Span sp = span_of(o.g);
      const bool vstore = cols_pad % 4 == 0 && cuda::aligned(o.q, 4) && cb + 4 <= cols_pad;
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        const int64_t r = r0 + warp * kRows + i;
        if (r >= rows_pad || cb >= cols_pad) continue;
        uint32_t w = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j)
          w |= static_cast<uint32_t>(encode_fp8(v[i][j] * (1.0f / scale_at(sp, t, i, j)), fmt)) << (8 * j);
        uint8_t* dst = o.q + r * cols_pad + cb;
        if (vstore) {
          *reinterpret_cast<uint32_t*>(dst) = w;
        } else {
#pragma unroll
          for (int j = 0; j < 4; ++j)
            if (cb + j < cols_pad) dst[j] = static_cast<uint8_t>(w >> (8 * j));
        }
      }
    }
    if (ot.q != nullptr) {
      TileScales t{};
      tile_scales(ot, fmt, v, red, r0, c0, warp, lane, rows_pad, cols_pad, t);
      const Span sp = span_of(ot.g);
#pragma unroll
      for (int i = 0; i < kRows; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
          tile_t[4 * lane + j][warp * kRows + i] = encode_fp8(v[i][j] * (1.0f / scale_at(sp, t, i, j)), fmt);
      __syncthreads();
      // q_t rows c0 + 16 warp + i, bytes r0 + 4 lane .. + 3 of each.
      const int64_t rb = r0 + 4 * lane;
      const bool vstore = rows_pad % 4 == 0 && cuda::aligned(ot.q, 4) && rb + 4 <= rows_pad;
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        const int64_t c = c0 + warp * kRows + i;
        if (c >= cols_pad || rb >= rows_pad) continue;
        const uint32_t w = *reinterpret_cast<const uint32_t*>(&tile_t[warp * kRows + i][4 * lane]);
        uint8_t* dst = ot.q + c * rows_pad + rb;
        if (vstore) {
          *reinterpret_cast<uint32_t*>(dst) = w;
        } else {
#pragma unroll
          for (int j = 0; j < 4; ++j)
            if (rb + j < rows_pad) dst[j] = static_cast<uint8_t>(w >> (8 * j));
        }
      }
    }
  }
}

// Maxima (as float bits) -> scales, in place.
__global__ void finish_scales_kernel(float* s, int64_t n, Fp8Format fmt) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    s[i] = scale_for(s[i], fmt);
}

Out out_of(ScaleMode m, bool transposed, int64_t rows_pad, int64_t cols_pad, uint8_t* q, float* scale) {
  Out o{};
  o.g = scale_grid(m, transposed, rows_pad, cols_pad);
  o.q = q;
  o.scale = scale;
  o.transposed = transposed;
  o.local = o.g.tile_local(rows_pad, cols_pad);
  o.block128 = m == ScaleMode::kBlock128;
  o.k_blocks = blocks_of(transposed ? rows_pad : cols_pad);
  return o;
}

}  // namespace

void quantize_scaled(const StackedRows& x, int64_t rows_pad, int64_t cols_pad, Fp8Format fmt,
                     ScaleMode mode, uint8_t* q, float* scale, ScaleMode mode_t, uint8_t* q_t,
                     float* scale_t, cudaStream_t stream) {
  const int64_t rows = detail::check_scaled(x, rows_pad, cols_pad, mode, q, scale, mode_t, q_t, scale_t);
  if (rows_pad == 0 || cols_pad == 0) return;
  const Out o = out_of(mode, false, rows_pad, cols_pad, q, scale);
  const Out ot = out_of(mode_t, true, rows_pad, cols_pad, q_t, scale_t);
  const dim3 grid(static_cast<unsigned>(blocks_of(cols_pad)), static_cast<unsigned>(blocks_of(rows_pad)));
  COAT_CHECK_ARG(blocks_of(rows_pad) < 65536, "X has too many rows for one scaled quantization (" +
                                                  std::to_string(rows_pad) + "); split it");
  cuda::dispatch_dtype(x.dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    bool vec = false;
    const Stack<T> s = stack_of<T>(x, &vec);
    vec = vec && x.cols % 4 == 0;
    const bool first = (q != nullptr && !o.local) || (q_t != nullptr && !ot.local);
    if (first) {
      for (const Out* out : {&o, &ot}) {
        if (out->q == nullptr || out->local) continue;
        const int64_t n = out->transposed ? scale_count(mode_t, cols_pad, rows_pad)
                                          : scale_count(mode, rows_pad, cols_pad);
        COAT_CUDA_CHECK(cudaMemsetAsync(out->scale, 0, static_cast<size_t>(n) * sizeof(float), stream));
      }
      scaled_kernel<T, true><<<grid, kThreads, 0, stream>>>(s, rows, x.cols, rows_pad, cols_pad, vec, fmt, o, ot);
      COAT_CHECK_LAUNCH();
      for (const Out* out : {&o, &ot}) {
        if (out->q == nullptr || out->local) continue;
        const int64_t n = out->transposed ? scale_count(mode_t, cols_pad, rows_pad)
                                          : scale_count(mode, rows_pad, cols_pad);
        finish_scales_kernel<<<cuda::grid_for(n, kThreads), kThreads, 0, stream>>>(out->scale, n, fmt);
        COAT_CHECK_LAUNCH();
      }
    }
    scaled_kernel<T, false><<<grid, kThreads, 0, stream>>>(s, rows, x.cols, rows_pad, cols_pad, vec, fmt, o, ot);
    COAT_CHECK_LAUNCH();
  });
}

}  // namespace coat
