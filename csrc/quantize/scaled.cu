// The scaled (row / block) quantizer on the GPU (quantize.h quantize_scaled). One 512-thread block
// per 128 x 128 tile of X. Thread (warp w, lane l) holds 4 rows x 8 columns: rows 8w + 4h + i
// (h = l / 16, i < 4), columns 8 (l % 16) + j, loaded 16 bytes per row (a warp reads two 256-byte
// row segments per load), so a 1x128 group is one half-warp row, a 128x1 column one tile column
// and a 128x128 group the tile. Per output (q and/or q_t) the tile reduces its elements to group
// maxima (shuffles within a half-warp for rows; the thread's 4 rows, lane ^ 16, then shared memory
// across warps for columns), writes the scales and quantizes from the same registers with the
// paired hardware conversion: one read of X. q is written 8 codes per store (two full 128-byte
// rows per warp store); the 4 consecutive rows of a column are 4 consecutive bytes of q_t, staged
// in a 128 x 128-byte shared tile whose 4-byte chunks are XOR-swizzled by the column's lane so that
// both the writes and the row-wise reads-out are free of bank conflicts, then written out 16 bytes
// per thread, four whole 128-byte q_t rows per warp store. 64 registers per thread: two blocks (32 warps) per SM.
// kRow groups longer than a tile take a first launch of the same kernel that only reduces,
// publishing maxima with an integer atomicMax on the float bits (valid for non-negative floats),
// and a pass that turns them into scales.
// Bytes: R * cols * sizeof(T) read (twice with the first launch), R * cols per code output written.
#include <type_traits>
#include <utility>

#include "common/cuda_utils.cuh"
#include "common/scale_grid.h"
#include "quantize_args.h"
#include "stack.cuh"

namespace coat {
namespace {

constexpr int kB = static_cast<int>(kScaleBlock);  // the tile edge
constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kR = 4;  // rows per thread
constexpr int kC = 8;  // columns per thread

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

// What one group spans within a tile: one row, one column, or the whole tile (kNone: no output).
// The quantize launch takes its outputs' spans as template arguments, so that each instance holds
// and converts only what its groups need.
enum class Span { kNone, kRow, kCol, kAll };
// The scales (or maxima, or inverses) of the thread's elements' groups for one output, by span:
// s[i] of row i (kRow), s[j] of column j (kCol), s[0] (kAll). One array keeps registers low.
struct TileScales {
  float s[kC];
};

COAT_HD Span span_of(const ScaleGrid& g) {
  if (g.group_r == 1) return Span::kRow;
  if (g.group_c == 1) return Span::kCol;
  return Span::kAll;
}

// The tile's coordinates of this thread.
struct Pos {
  int warp, lane, half, seg;
  int64_t r0, c0;
  __device__ __forceinline__ int64_t row(int i) const { return r0 + 2 * kR * warp + kR * half + i; }
  __device__ __forceinline__ int64_t col(int j) const { return c0 + 8 * seg + j; }
};

// The group maxima of the tile for a span (every thread gets those of its elements).
__device__ __forceinline__ void tile_max(Span sp, const float (&v)[kR][kC], float (*red)[kB], const Pos& p,
                                         TileScales& t) {
  if (sp == Span::kRow) {
#pragma unroll
    for (int i = 0; i < kR; ++i) {
      float m = 0.0f;
#pragma unroll
      for (int j = 0; j < kC; ++j) m = fmaxf(m, finite_abs(v[i][j]));
      t.s[i] = cuda::warp_max(m, 16);  // the 16 lanes of this half hold the row's 128 columns
    }
    return;
  }
  float c[kC];
#pragma unroll
  for (int j = 0; j < kC; ++j) {
    c[j] = 0.0f;
#pragma unroll
    for (int i = 0; i < kR; ++i) c[j] = fmaxf(c[j], finite_abs(v[i][j]));
    c[j] = fmaxf(c[j], __shfl_xor_sync(0xffffffffu, c[j], 16));  // the other half's rows
  }
  if (sp == Span::kAll) {
    float m = 0.0f;
#pragma unroll
    for (int j = 0; j < kC; ++j) m = fmaxf(m, c[j]);
    m = cuda::warp_max(m);
    if (p.lane == 0) red[p.warp][0] = m;
    __syncthreads();
    float a = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) a = fmaxf(a, red[w][0]);
    t.s[0] = a;
    __syncthreads();
    return;
  }
  if (p.half == 0)
#pragma unroll
    for (int j = 0; j < kC; ++j) red[p.warp][8 * p.seg + j] = c[j];
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kC; ++j) {
    float a = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) a = fmaxf(a, red[w][8 * p.seg + j]);
    t.s[j] = a;
  }
  __syncthreads();
}

// Calls f(slot, value) once per group of the tile inside the padded shape, with t's value for it.
template <typename F>
__device__ __forceinline__ void for_each_group(Span sp, const TileScales& t, const Pos& p, int64_t rows_pad,
                                               int64_t cols_pad, const ScaleGrid& g, F&& f) {
  if (sp == Span::kRow) {
    if (p.seg != 0) return;
#pragma unroll
    for (int i = 0; i < kR; ++i)
      if (p.row(i) < rows_pad) f(g.index(p.row(i), p.c0), t.s[i]);
  } else if (sp == Span::kCol) {
    if (p.warp != 0 || p.half != 0) return;
#pragma unroll
    for (int j = 0; j < kC; ++j)
      if (p.col(j) < cols_pad) f(g.index(p.r0, p.col(j)), t.s[j]);
  } else if (p.warp == 0 && p.lane == 0) {
    f(g.index(p.r0, p.c0), t.s[0]);
  }
}

// The scales of o for this thread's elements: computed here (local groups; their scales are
// written) or read back from the first launch's results.
__device__ __forceinline__ void tile_scales(const Out& o, Span sp, Fp8Format fmt, const float (&v)[kR][kC],
                                            float (*red)[kB], const Pos& p, int64_t rows_pad, int64_t cols_pad,
                                            TileScales& t) {
  if (!o.local) {  // only kRow groups are ever longer than a tile; reads stay inside the padded shape
#pragma unroll
    for (int j = 0; j < kC; ++j) t.s[j] = 1.0f;
    if (sp == Span::kRow) {
#pragma unroll
      for (int i = 0; i < kR; ++i)
        if (p.row(i) < rows_pad) t.s[i] = o.scale[o.g.index(p.row(i), p.c0)];
    } else {
#pragma unroll
      for (int j = 0; j < kC; ++j)
        if (p.col(j) < cols_pad) t.s[j] = o.scale[o.g.index(p.r0, p.col(j))];
    }
    return;
  }
  tile_max(sp, v, red, p, t);
#pragma unroll
  for (int j = 0; j < kC; ++j) t.s[j] = scale_for(t.s[j], fmt);
  float* scale = o.scale;
  for_each_group(sp, t, p, rows_pad, cols_pad, o.g, [&](int64_t slot, float s) { scale[slot] = s; });
  if (o.block128 && p.warp == 0) {
    // The padding of the 128x128 layout's rows, written by the tile at the end of its K: 1.
    const int64_t kb = o.transposed ? p.r0 / kB : p.c0 / kB;
    if (kb == o.k_blocks - 1)
      for (int64_t e = o.k_blocks + p.lane; e < round_up4(o.k_blocks); e += 32)
        scale[o.transposed ? o.g.index(0, p.c0) + e : o.g.index(p.r0, 0) + e] = 1.0f;
  }
}

// 1 / scale of each of the thread's groups (what every element is multiplied by, rounded once).
__device__ __forceinline__ void invert(TileScales& t) {
#pragma unroll
  for (int j = 0; j < kC; ++j) t.s[j] = 1.0f / t.s[j];
}

__device__ __forceinline__ float inv_at(Span sp, const TileScales& t, int i, int j) {
  return sp == Span::kRow ? t.s[i] : sp == Span::kCol ? t.s[j] : t.s[0];
}

// Four FP8 codes in one word (two paired hardware conversions), first value in the low byte.
__device__ __forceinline__ uint32_t encode4(const float (&v)[kR], Fp8Format fmt) {
  const __nv_fp8_interpretation_t f = fmt == Fp8Format::kE4M3 ? __NV_E4M3 : __NV_E5M2;
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(v[0], v[1]), __NV_SATFINITE, f);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(v[2], v[3]), __NV_SATFINITE, f);
  return lo | (hi << 16);
}

template <typename T>
__device__ __forceinline__ void load_row8(const T* p, bool whole, int n, float (&v)[kC]) {
  if (whole) {
    cuda::load8(p, v);
  } else {
#pragma unroll
    for (int j = 0; j < kC; ++j) v[j] = j < n ? Elem<T>::load(p[j]) : 0.0f;
  }
}

template <typename T, bool kMaxOnly, Span SQ, Span ST>
__global__ void __launch_bounds__(kThreads, 2) scaled_kernel(Stack<T> x, int64_t rows, int64_t cols, int64_t rows_pad,
                                                          int64_t cols_pad, bool vec, Fp8Format fmt, Out o,
                                                          Out ot) {
  __shared__ float red[kWarps][kB];
  __shared__ __align__(16) uint32_t tile_t[kB][kB / 4];  // q_t's 128 rows of 32 swizzled 4-byte chunks
  Pos p;
  p.warp = threadIdx.x >> 5, p.lane = threadIdx.x & 31, p.half = p.lane >> 4, p.seg = p.lane & 15;
  p.r0 = static_cast<int64_t>(blockIdx.y) * kB, p.c0 = static_cast<int64_t>(blockIdx.x) * kB;
  const int64_t cb = p.col(0);
  const bool whole_cols = vec && cb + kC <= cols;
  float v[kR][kC];
#pragma unroll
  for (int i = 0; i < kR; ++i) {
    const int64_t r = p.row(i);
    if (r < rows && cb < cols) {
      load_row8(x.row(r) + cb, whole_cols, static_cast<int>(cols - cb), v[i]);
    } else {
#pragma unroll
      for (int j = 0; j < kC; ++j) v[i][j] = 0.0f;
    }
  }

  if constexpr (kMaxOnly) {
    auto publish = [&](const Out& out) {
      if (out.q == nullptr || out.local) return;
      const Span sp = span_of(out.g);
      TileScales t{};
      tile_max(sp, v, red, p, t);
      int* m = reinterpret_cast<int*>(out.scale);
      for_each_group(sp, t, p, rows_pad, cols_pad, out.g,
                     [&](int64_t slot, float a) { atomicMax(m + slot, __float_as_int(a)); });
    };
    publish(o);
    publish(ot);
  } else {
    if constexpr (SQ != Span::kNone) {
      constexpr Span sp = SQ;
      TileScales t{};
      tile_scales(o, sp, fmt, v, red, p, rows_pad, cols_pad, t);
      invert(t);
      const bool vstore = cols_pad % 8 == 0 && cuda::aligned(o.q, 8) && cb + kC <= cols_pad;
#pragma unroll
      for (int i = 0; i < kR; ++i) {
        const int64_t r = p.row(i);
        if (r >= rows_pad || cb >= cols_pad) continue;
        float w[kC];
#pragma unroll
        for (int j = 0; j < kC; ++j) w[j] = v[i][j] * inv_at(sp, t, i, j);
        const uint2 codes = cuda::encode8(w, fmt);
        uint8_t* dst = o.q + r * cols_pad + cb;
        if (vstore) {
          *reinterpret_cast<uint2*>(dst) = codes;
        } else {
          const uint8_t* b = reinterpret_cast<const uint8_t*>(&codes);
          for (int j = 0; j < kC && cb + j < cols_pad; ++j) dst[j] = b[j];
        }
      }
    }
    if constexpr (ST != Span::kNone) {
      constexpr Span sp = ST;
      TileScales t{};
      tile_scales(ot, sp, fmt, v, red, p, rows_pad, cols_pad, t);
      invert(t);
      // Column j's 4 rows are the 4-byte chunk (2 warp + half) of q_t's tile row 8 seg + j, stored
      // at chunk ^ 2 seg: the 32 lanes' chunks cover the 32 banks once.
#pragma unroll
      for (int j = 0; j < kC; ++j) {
        float w[kR];
#pragma unroll
        for (int i = 0; i < kR; ++i) w[i] = v[i][j] * inv_at(sp, t, i, j);
        tile_t[8 * p.seg + j][(2 * p.warp + p.half) ^ (2 * p.seg)] = encode4(w, fmt);
      }
      __syncthreads();
      // Out: 16 bytes per thread, 8 threads per q_t row (four whole rows per warp store). The row's
      // 16-byte group g sits at g ^ (s >> 1) with its halves swapped when s is odd (s = the row's
      // writer lane, row / 8): one conflict-free 16-byte shared load.
#pragma unroll
      for (int k = 0; k < kB * 8 / kThreads; ++k) {
        const int idx = static_cast<int>(threadIdx.x) + kThreads * k, cl = idx >> 3, g = idx & 7, sw = cl >> 3;
        const int64_t c = p.c0 + cl, rb = p.r0 + 16 * g;
        if (c >= cols_pad || rb >= rows_pad) continue;
        uint4 w = reinterpret_cast<const uint4*>(tile_t[cl])[g ^ (sw >> 1)];
        if (sw & 1) w = make_uint4(w.z, w.w, w.x, w.y);
        uint8_t* dst = ot.q + c * rows_pad + rb;
        if (rows_pad % 16 == 0 && cuda::aligned(ot.q, 16)) {
          *reinterpret_cast<uint4*>(dst) = w;
        } else {
          const uint8_t* b = reinterpret_cast<const uint8_t*>(&w);
          for (int i = 0; i < 16 && rb + i < rows_pad; ++i) dst[i] = b[i];
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

// The quantize launch for its outputs' spans: q's are row (1x128, row) or tile (128x128) spans, q_t's
// column (128x1, per-channel) or tile spans.
template <typename T>
void launch_quantize(dim3 grid, cudaStream_t stream, const Stack<T>& s, int64_t rows, int64_t cols, int64_t rows_pad,
                     int64_t cols_pad, bool vec, Fp8Format fmt, const Out& o, const Out& ot) {
  const Span sq = o.q ? span_of(o.g) : Span::kNone, st = ot.q ? span_of(ot.g) : Span::kNone;
  auto go = [&](auto q_tag, auto t_tag) {
    constexpr Span SQ = decltype(q_tag)::value, ST = decltype(t_tag)::value;
    scaled_kernel<T, false, SQ, ST><<<grid, kThreads, 0, stream>>>(s, rows, cols, rows_pad, cols_pad, vec, fmt, o, ot);
  };
  using None = std::integral_constant<Span, Span::kNone>;
  using Row = std::integral_constant<Span, Span::kRow>;
  using Col = std::integral_constant<Span, Span::kCol>;
  using All = std::integral_constant<Span, Span::kAll>;
  auto with_q = [&](auto t_tag) {
    if (sq == Span::kRow) go(Row{}, t_tag);
    else if (sq == Span::kAll) go(All{}, t_tag);
    else go(None{}, t_tag);
  };
  COAT_CHECK(sq != Span::kCol && st != Span::kRow, "a q grid spans rows or tiles, a q_t grid columns or tiles");
  if (st == Span::kCol) with_q(Col{});
  else if (st == Span::kAll) with_q(All{});
  else with_q(None{});
  COAT_CHECK_LAUNCH();
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
  if (rows_pad == 0 || cols_pad == 0) {  // no element, but a row mode still has scales: all-zero groups, 1
    const int64_t n = scale ? scale_count(mode, rows_pad, cols_pad) : 0;
    const int64_t nt = scale_t ? scale_count(mode_t, cols_pad, rows_pad) : 0;
    for (const auto& [s, count] : {std::pair<float*, int64_t>{scale, n}, {scale_t, nt}}) {
      if (count == 0) continue;
      COAT_CUDA_CHECK(cudaMemsetAsync(s, 0, static_cast<size_t>(count) * sizeof(float), stream));
      finish_scales_kernel<<<cuda::grid_for(count, kThreads), kThreads, 0, stream>>>(s, count, fmt);
      COAT_CHECK_LAUNCH();
    }
    return;
  }
  const Out o = out_of(mode, false, rows_pad, cols_pad, q, scale);
  const Out ot = out_of(mode_t, true, rows_pad, cols_pad, q_t, scale_t);
  const dim3 grid(static_cast<unsigned>(blocks_of(cols_pad)), static_cast<unsigned>(blocks_of(rows_pad)));
  COAT_CHECK_ARG(blocks_of(rows_pad) < 65536, "X has too many rows for one scaled quantization (" +
                                                  std::to_string(rows_pad) + "); split it");
  cuda::dispatch_dtype(x.dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    bool vec = false;
    const Stack<T> s = stack_of<T>(x, &vec);
    vec = vec && x.cols % 8 == 0;  // 16-byte row segments (8 elements; two float4 for fp32)
    const bool first = (q != nullptr && !o.local) || (q_t != nullptr && !ot.local);
    if (first) {
      for (const Out* out : {&o, &ot}) {
        if (out->q == nullptr || out->local) continue;
        const int64_t n = out->transposed ? scale_count(mode_t, cols_pad, rows_pad)
                                          : scale_count(mode, rows_pad, cols_pad);
        COAT_CUDA_CHECK(cudaMemsetAsync(out->scale, 0, static_cast<size_t>(n) * sizeof(float), stream));
      }
      scaled_kernel<T, true, Span::kNone, Span::kNone>
          <<<grid, kThreads, 0, stream>>>(s, rows, x.cols, rows_pad, cols_pad, vec, fmt, o, ot);
      COAT_CHECK_LAUNCH();
      for (const Out* out : {&o, &ot}) {
        if (out->q == nullptr || out->local) continue;
        const int64_t n = out->transposed ? scale_count(mode_t, cols_pad, rows_pad)
                                          : scale_count(mode, rows_pad, cols_pad);
        finish_scales_kernel<<<cuda::grid_for(n, kThreads), kThreads, 0, stream>>>(out->scale, n, fmt);
        COAT_CHECK_LAUNCH();
      }
    }
    launch_quantize<T>(grid, stream, s, rows, x.cols, rows_pad, cols_pad, vec, fmt, o, ot);
  });
}

}  // namespace coat
