// CUDA fused AdamW step with 4-bit states (coat/adamw4.h): three launches for all tensors of a
// configuration. The per-element math is adamw4_math.h, shared with the CPU reference; this file
// is compiled with -ftz=true and keeps fma, and takes square roots, divisions and the encoders'
// reciprocals from the hardware (adamw4_math.h says what that changes against the reference).
//
// Work: a warp per group of 128 elements (the step: per pair of groups), a lane per 4 consecutive
// elements (one stochastic-rounding quad). The step waits on instructions and on memory latency,
// so the common case takes a lean path: whole groups of a tensor whose buffers allow vector access
// load 4 elements a lane at once, two groups' operands before either is used; m decodes through a
// 16-entry table in shared memory and encodes through a table of buckets (one load and one
// comparison), v arithmetically (adamw4_math.h), with 32-bit offsets, rows and columns. Groups at
// a tensor's end, misaligned views and rank-1 tensors with cols % 4 != 0 take the element-wise
// path; a warp whose next pairs stay inside its tensor steps them in a tight loop. Block, row and
// column maxima are taken on floats (nan_max) and reduced as raw bits, turned into keys once. The
// rank-1 statistics pass walks column strips (128 columns x 16 rows per warp) so that column maxima
// are reduced in registers and row maxima in lanes, and both reach memory once per strip.
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
constexpr int kStripRows = 16;  // rows of a statistics strip
constexpr int kBatch = 4;       // rows of a strip loaded before any is reduced
// Blocks per SM of the step kernel, which holds two groups' operands: 3 (80 registers, a few
// spilled) is the faster with every master. With an fp32 master, whose loads are twice the bytes,
// 2 (120 registers, none spilled) was the faster until the tight pair loop (benchmarks/RESULTS.md
// sections 49 and 51).
constexpr int kStepBlocks = 3;

using adamw4::groups_of;
using cuda::aligned;

// m's map and bucket table (adamw4_math.h, encode_m_table), per block in shared memory. The map's
// 16 words sit in 16 banks (any lookup pattern is conflict-free); the buckets' loads conflict only
// where a warp's values spread over buckets 32 apart.
struct Tables {
  float level[16];
  adamw4::MBucket bucket[adamw4::kMBuckets];
};

__device__ __forceinline__ void fill_tables(Tables& tb) {
  for (int i = threadIdx.x; i < adamw4::kMBuckets; i += blockDim.x) tb.bucket[i] = adamw4::m_bucket(i);
  if (threadIdx.x < adamw4::kCodes) tb.level[threadIdx.x] = adamw4::m_level(threadIdx.x);
  __syncthreads();
}

// m's map value at byte offset o (= 4 x code): the offset is extracted from the packed codes
// directly (a shift and a mask), where an index took a third instruction to scale.
__device__ __forceinline__ float level_at(const Tables& tb, uint32_t o) {
  return *reinterpret_cast<const float*>(reinterpret_cast<const char*>(tb.level) + o);
}

// Four consecutive elements of T as fp32 (a 16-byte or 8-byte access; p aligned to it).
template <typename T>
__device__ __forceinline__ void load4(const T* p, float (&v)[kPer]) {
  if constexpr (sizeof(T) == 4) {
    const float4 a = *reinterpret_cast<const float4*>(p);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
  } else {
    const uint2 raw = *reinterpret_cast<const uint2*>(p);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int k = 0; k < kPer; ++k) v[k] = Elem<T>::load(e[k]);
  }
}

// The same four as loaded (16 or 8 bytes), converted later: half the registers for 2-byte types.
template <typename T>
using Raw4 = std::conditional_t<sizeof(T) == 4, float4, uint2>;

template <typename T>
__device__ __forceinline__ Raw4<T> load4_raw(const T* p) {
  return *reinterpret_cast<const Raw4<T>*>(p);
}

template <typename T>
__device__ __forceinline__ void unpack4(const Raw4<T>& raw, float (&v)[kPer]) {
  if constexpr (sizeof(T) == 4) {
    v[0] = raw.x, v[1] = raw.y, v[2] = raw.z, v[3] = raw.w;
  } else {
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int k = 0; k < kPer; ++k) v[k] = Elem<T>::load(e[k]);
  }
}

template <typename T>
__device__ __forceinline__ Raw4<T> pack4(const float (&v)[kPer]) {
  if constexpr (sizeof(T) == 4) {
    return make_float4(v[0], v[1], v[2], v[3]);
  } else {
    uint2 raw;
    T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int k = 0; k < kPer; ++k) e[k] = Elem<T>::store(v[k]);
    return raw;
  }
}

template <typename T>
__device__ __forceinline__ void store4(T* p, const float (&v)[kPer]) {
  *reinterpret_cast<Raw4<T>*>(p) = pack4<T>(v);
}

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

// Whether a tensor's whole groups can take the vector path: every buffer aligned for 4 elements
// (a lane's first element is a multiple of 4, so its offset is too), 32-bit element indices, and
// for rank-1 v a lane's 4 elements in one row with their column maxima in one 16-byte word.
template <typename P, typename Gr, MasterKind M>
__device__ __forceinline__ bool vectorizable(const Adamw4Tensor& d) {
  bool ok = aligned(d.param, kPer * sizeof(P)) && aligned(d.grad, kPer * sizeof(Gr)) && d.numel < (int64_t{1} << 31);
  if constexpr (M == MasterKind::kFp32) ok = ok && aligned(d.master, 16);
  if (d.kind == Adamw4Kind::kFull) return ok && aligned(d.m, 16) && aligned(d.v, 16);
  ok = ok && aligned(d.m, 2) && aligned(d.v, 2);
  if (d.kind == Adamw4Kind::kRank1) ok = ok && d.rows % 4 == 0 && d.cols % 4 == 0 && aligned(d.v_scale, 16);
  return ok;
}

// A rank-1 tensor's buffers for step t.
struct Rank1 {
  const float* old_r;  // rows, then cols: what step t - 1 wrote
  float* new_r;
};

__device__ __forceinline__ Rank1 rank1_of(const Adamw4Tensor& d, uint64_t t) {
  return {d.v_scale + adamw4::old_buffer(t) * (d.rows + d.cols), d.v_scale + adamw4::new_buffer(t) * (d.rows + d.cols)};
}

// The descriptor of a warp's current group and its step's scalars, in shared memory (a slot per
// warp): in registers they would take ~40 of them and halve the occupancy. A warp's next group is
// usually in the same tensor, and the scalars cost ~20 fp64 operations (beta^t).
struct Current {
  Adamw4Tensor d;
  adamw::Scalars s;
  uint64_t t;
  int64_t end;       // one past the tensor's last group; -1: none yet
  int64_t full_end;  // one past the last group with all 128 elements
  bool vec;
  uint32_t cols_magic;  // rank-1 with vec: row = div_cols(element), no division instruction
  int cols_shift;
  uint32_t rows;        // rank-1 with vec: the row count, and
  Rank1 r1;             // the old and new statistics buffers of this step (every group reads both)
};

__device__ __forceinline__ void init(Current& cur) {
  if ((threadIdx.x & 31) == 0) {
    cur.d.group_begin = 0;
    cur.end = cur.full_end = -1;
    cur.vec = false;
  }
  __syncwarp();
}

// Make `cur` describe group g's tensor (warp-wide: every lane calls it with the same g).
template <typename P, typename Gr, MasterKind M>
__device__ __forceinline__ void seek(Current& cur, const Adamw4Tensor* tensors, int64_t n, int64_t g, double lr,
                                     const AdamwConfig& c) {
  if (g >= cur.d.group_begin && g < cur.end) return;
  const int64_t ti = find_tensor(tensors, n, g);
  const int lane = threadIdx.x & 31;
  __syncwarp();  // every lane is done with the previous tensor
  constexpr int kWords = sizeof(Adamw4Tensor) / 8;
  if (lane < kWords) reinterpret_cast<int64_t*>(&cur.d)[lane] = reinterpret_cast<const int64_t*>(tensors + ti)[lane];
  __syncwarp();
  if (lane == 0) {
    const Adamw4Tensor& d = cur.d;
    cur.end = d.group_begin + groups_of(d.numel);
    cur.full_end = d.group_begin + d.numel / G;
    cur.vec = vectorizable<P, Gr, M>(d);
    cur.t = adamw::step_count(*d.step);
    if (cur.vec && d.kind == Adamw4Kind::kRank1) {
      adamw4::make_magic(static_cast<uint32_t>(d.cols), cur.cols_magic, cur.cols_shift);
      cur.rows = static_cast<uint32_t>(d.rows);
      cur.r1 = rank1_of(d, cur.t);
    }
    cur.s = adamw::make_scalars(lr, c, cur.t);
  }
  __syncwarp();
}

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
// (maxima settle early, so most calls skip the atomic).
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

// ---- pass one: the rank-1 maxima of the new v ------------------------------------------------

// Whether a rank-1 tensor's statistics can walk strips: whole groups per row, gradients and codes
// aligned for a lane's 4 elements, and fewer than 2^31 elements (the strips' 32-bit offsets).
template <typename Gr>
__device__ __forceinline__ bool strips_ok(const Adamw4Tensor& d) {
  return d.cols % G == 0 && aligned(d.grad, kPer * sizeof(Gr)) && aligned(d.v, 2) && d.numel < (int64_t{1} << 31);
}

// One strip: rows [r0, r0 + 16) x columns [cg 128, cg 128 + 128). A lane keeps its 4 columns'
// maxima in registers; each row's maximum is a warp reduction and one atomic. Rows are loaded
// kBatch at a time before any is reduced (the atomics would otherwise order every load).
template <typename Gr>
__device__ __forceinline__ void stats_strip(const Adamw4Tensor& d, const Rank1& r1, int64_t u, int64_t per_row,
                                            const adamw::Scalars& s, float inv_gs) {
  // 32-bit rows, columns and offsets (strips_ok: numel < 2^31): a row's pointers are one wide
  // multiply-add each from their base, where 64-bit indices took ~20 instructions a row.
  const uint32_t lane = threadIdx.x & 31;
  const uint32_t rows = static_cast<uint32_t>(d.rows), cols = static_cast<uint32_t>(d.cols);
  const uint32_t rb = static_cast<uint32_t>(u / per_row);
  const uint32_t j = (static_cast<uint32_t>(u) - rb * static_cast<uint32_t>(per_row)) * G + lane * kPer;
  const uint32_t r0 = rb * kStripRows, r_end = r0 + kStripRows < rows ? r0 + kStripRows : rows;
  float oc[kPer];
  float cx[kPer] = {};  // the lane's columns' maxima so far (nan_max; keys at the end)
  uint32_t row_bits = 0;  // lane l < kStripRows: the maximum of row r0 + l (raw bits), its atomic at the end
#pragma unroll
  for (int k = 0; k < kPer; ++k) oc[k] = r1.old_r[rows + j + k];
  const auto* grad = static_cast<const Gr*>(d.grad);
  const auto* vq = static_cast<const uint8_t*>(d.v);
  for (uint32_t i0 = r0; i0 < r_end; i0 += kBatch) {
    float g[kBatch][kPer];
    uint32_t vw[kBatch];
    float ro[kBatch];
#pragma unroll
    for (uint32_t b = 0; b < kBatch; ++b) {
      const uint32_t i = i0 + b < r_end ? i0 + b : r_end - 1;  // past the strip: reload its last row (no effect on maxima)
      const uint32_t e = i * cols + j;
      load4(grad + e, g[b]);
      vw[b] = *reinterpret_cast<const uint16_t*>(vq + e / 2);
      ro[b] = r1.old_r[i];
    }
#pragma unroll
    for (uint32_t b = 0; b < kBatch; ++b) {
      float rx = 0.0f;
#pragma unroll
      for (int k = 0; k < kPer; ++k) {
        const float v_old = adamw4::decode_v((vw[b] >> (4 * k)) & 0xF, adamw4::rank1_scale(ro[b], oc[k]));
        const float v_new = fabsf(adamw4::new_v(v_old, g[b][k] * inv_gs, s));
        rx = adamw4::nan_max(rx, v_new);
        cx[k] = adamw4::nan_max(cx[k], v_new);
      }
      const uint32_t rb_bits = __reduce_max_sync(0xFFFFFFFFu, __float_as_uint(rx));
      row_bits = lane == i0 + b - r0 ? rb_bits : row_bits;
    }
  }
  static_assert(kStripRows <= 32, "a lane holds each row's maximum");
  if (lane < r_end - r0) {  // the strip's rows, one atomic each, all at once (rows past r_end were reloads)
    const uint32_t rk = adamw4::key_of_bits(row_bits);
    if (rk != 0) atomicMax(reinterpret_cast<unsigned int*>(r1.new_r + (r0 + lane)), rk);
  }
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    const uint32_t ck = adamw4::max_key(cx[k]);
    if (ck != 0) max_into(r1.new_r + (rows + j + k), ck);  // the buffers start at 0
  }
}

// One group of a rank-1 tensor that cannot walk strips, element by element.
template <typename Gr>
__device__ __forceinline__ void stats_group(const Adamw4Tensor& d, const Rank1& r1, int64_t lg,
                                            const adamw::Scalars& s, float inv_gs) {
  const int lane = threadIdx.x & 31;
  const int64_t begin = lg * G, e0 = begin + lane * kPer;
  const int64_t end = begin + G < d.numel ? begin + G : d.numel;
  const bool one_row = begin / d.cols == (end - 1) / d.cols;
  uint32_t row_key = 0;
  RowCol rc = row_col(d, e0);
  for (int k = 0; k < kPer; ++k, rc.next(d.cols)) {
    const int64_t e = e0 + k;
    if (e >= end) break;
    const float v_old = adamw4::decode_v(adamw4::nibble(static_cast<const uint8_t*>(d.v), e),
                                         adamw4::rank1_scale(r1.old_r[rc.i], r1.old_r[d.rows + rc.j]));
    const float g_e = Elem<Gr>::load(static_cast<const Gr*>(d.grad)[e]) * inv_gs;
    const uint32_t key = adamw4::max_key(adamw4::new_v(v_old, g_e, s));
    if (key == 0) continue;
    max_into(r1.new_r + d.rows + rc.j, key);
    if (one_row) row_key = adamw4::umax(row_key, key);
    else max_into(r1.new_r + rc.i, key);
  }
  if (one_row) {
    row_key = __reduce_max_sync(0xFFFFFFFFu, row_key);
    if (lane == 0 && row_key != 0) max_into(r1.new_r + begin / d.cols, row_key);
  }
}

// Pass one over the rank-1 tensors. Work units (strips, or groups where strips do not apply) of
// all rank-1 tensors form one sequence dealt round-robin to the warps, as one grid-stride loop
// would: every warp walks the descriptors and counts the units before each tensor.
template <typename Gr>
__global__ void __launch_bounds__(kThreads, 4) stats_kernel(const Adamw4Tensor* __restrict__ tensors, int64_t n_tensors,
                                                         AdamwConfig c) {
  if (skipped(c)) return;
  const double lr = c.lr_tensor != nullptr ? static_cast<double>(*c.lr_tensor) : c.lr;
  const float inv_gs = adamw::grad_multiplier(c);
  const int64_t n_warps = static_cast<int64_t>(gridDim.x) * kWarps;
  const int64_t warp = blockIdx.x * int64_t{kWarps} + (threadIdx.x >> 5);
  int64_t before = 0;  // units of the rank-1 tensors before ti
  for (int64_t ti = 0; ti < n_tensors; ++ti) {
    if (tensors[ti].kind != Adamw4Kind::kRank1) continue;
    const Adamw4Tensor d = tensors[ti];
    const bool strips = strips_ok<Gr>(d);
    const int64_t per_row = d.cols / G;
    const int64_t units = strips ? (d.rows + kStripRows - 1) / kStripRows * per_row : groups_of(d.numel);
    int64_t u = ((warp - before) % n_warps + n_warps) % n_warps;  // this warp's first unit here
    before += units;
    if (u >= units) continue;
    const uint64_t t = adamw::step_count(*d.step);
    const adamw::Scalars s = adamw::make_scalars(lr, c, t);
    const Rank1 r1 = rank1_of(d, t);
    for (; u < units; u += n_warps) {
      if (strips) stats_strip<Gr>(d, r1, u, per_row, s, inv_gs);
      else stats_group<Gr>(d, r1, u, s, inv_gs);
    }
  }
}

// ---- pass two: the step ------------------------------------------------------------------------

// A lane's 4 new moments encoded and stored (kBlock / kRank1) with the group's absmax (lane 0):
// the element-wise path (any group).
__device__ __forceinline__ void store_codes(const Adamw4Tensor& d, int64_t lg, int64_t e0, const float (&m)[kPer],
                                            const float (&v)[kPer], uint64_t t, const Tables& tb) {
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
    mc[k] = adamw4::encode_m_table(m[k], ms, adamw4::recip(ms), tb.bucket);
    vc[k] = adamw4::encode_v_fast(v[k], vs, adamw4::recip(vs));
  }
  auto* mq = static_cast<uint8_t*>(d.m);
  auto* vq = static_cast<uint8_t*>(d.v);
  for (int k = 0; k < kPer; k += 2) {
    if (e0 + k >= n) break;
    mq[(e0 + k) / 2] = static_cast<uint8_t>(mc[k] | (mc[k + 1] << 4));
    vq[(e0 + k) / 2] = static_cast<uint8_t>(vc[k] | (vc[k + 1] << 4));
  }
}

// A lane's new parameters (and master) written; n: how many of its 4 elements exist. I: the
// index type (the vector path's 32-bit offsets save the 64-bit address arithmetic).
// pmax: folds in the largest finite |value| written (as stored) when d.param_amax is set.
template <typename P, MasterKind M, typename I>
__device__ __forceinline__ void store_params(const Adamw4Tensor& d, I e0, int n, const float (&p)[kPer],
                                             uint64_t t, bool vec, float& pmax) {
  auto* param = static_cast<P*>(d.param);
  if constexpr (M == MasterKind::kBf16Sr) {
    uint32_t lo, hi;  // the four bf16 values, two to a word
    adamw::bf16_sr_quad(p, adamw::sr_bits(d.seed, t, static_cast<uint64_t>(e0 / 4)), lo, hi);
    if (d.param_amax != nullptr) {
      if (n == kPer) {
        pmax = fmaxf(pmax, bf16x4_finite_amax(lo, hi));
      } else {
        const float b[kPer] = {__uint_as_float(lo << 16), __uint_as_float(lo & 0xFFFF0000u), __uint_as_float(hi << 16),
                               __uint_as_float(hi & 0xFFFF0000u)};
        for (int k = 0; k < n; ++k) pmax = fmaxf(pmax, finite_abs(b[k]));
      }
    }
    auto* out = reinterpret_cast<uint16_t*>(param) + e0;
    if (vec) {
      *reinterpret_cast<uint2*>(out) = make_uint2(lo, hi);
    } else {
      const uint16_t b[kPer] = {static_cast<uint16_t>(lo), static_cast<uint16_t>(lo >> 16), static_cast<uint16_t>(hi),
                                static_cast<uint16_t>(hi >> 16)};
      for (int k = 0; k < n; ++k) out[k] = b[k];
    }
  } else {
    if (vec) {
      if constexpr (M == MasterKind::kFp32) store4(d.master + e0, p);
      const Raw4<P> raw = pack4<P>(p);
      *reinterpret_cast<Raw4<P>*>(param + e0) = raw;
      if constexpr (std::is_same_v<P, bf16_t>) {
        if (d.param_amax != nullptr) pmax = fmaxf(pmax, bf16x4_finite_amax(raw.x, raw.y));
        return;
      }
    } else {
      for (int k = 0; k < n; ++k) {
        if constexpr (M == MasterKind::kFp32) d.master[e0 + k] = p[k];
        param[e0 + k] = Elem<P>::store(p[k]);
      }
    }
    if (d.param_amax != nullptr)
#pragma unroll
      for (int k = 0; k < kPer; ++k)
        if (k < n) pmax = fmaxf(pmax, finite_abs(Elem<P>::load(Elem<P>::store(p[k]))));
  }
}

// A warp's largest |parameter| written into its tensor's param_amax: one atomic per warp and
// tensor (warp-wide: every lane calls it).
__device__ __forceinline__ void flush_pmax(const Current& cur, float pmax) {
  if (cur.end < 0 || cur.d.param_amax == nullptr) return;
  const uint32_t mx = __reduce_max_sync(0xFFFFFFFFu, __float_as_uint(pmax));
  if ((threadIdx.x & 31) == 0 && mx != 0u) atomicMax(reinterpret_cast<unsigned int*>(cur.d.param_amax), mx);
}

// The element-wise path: any group (a tensor's last, misaligned views, rank-1 with cols % 4 != 0).
template <typename P, typename Gr, MasterKind M>
__device__ __noinline__ void step_group(const Adamw4Tensor& d, int64_t lg, uint64_t t, const adamw::Scalars& s,
                                        float inv_gs, const Tables& tb, float& pmax) {
  const int64_t e0 = lg * G + (threadIdx.x & 31) * kPer;
  const auto* param = static_cast<const P*>(d.param);
  float p[kPer] = {}, m[kPer] = {}, v[kPer] = {};
  RowCol rc = row_col(d, e0);
  int n = 0;
  for (int k = 0; k < kPer; ++k, rc.next(d.cols)) {
    const int64_t e = e0 + k;
    if (e >= d.numel) break;
    const adamw4::Moments o = adamw4::old_moments(d, lg, e, rc.i, rc.j, t);
    m[k] = o.m;
    v[k] = o.v;
    const float p0 = M == MasterKind::kFp32 ? d.master[e] : Elem<P>::load(param[e]);
    p[k] = adamw::update(p0, Elem<Gr>::load(static_cast<const Gr*>(d.grad)[e]) * inv_gs, m[k], v[k], s);
    n = k + 1;
  }
  if (d.kind == Adamw4Kind::kFull) {
    for (int k = 0; k < n; ++k) {
      static_cast<float*>(d.m)[e0 + k] = m[k];
      static_cast<float*>(d.v)[e0 + k] = v[k];
    }
  } else {
    store_codes(d, lg, e0, m, v, t, tb);  // warp-wide: every lane takes part
  }
  if (n > 0) store_params<P, M>(d, e0, n, p, t, false, pmax);
}

// The vector path: whole groups of a vectorizable tensor, a group's operands loaded first
// (load_vec) and used after (finish_vec), so that a warp can have two groups' loads in flight
// before it waits on any: the step waits on memory latency as much as on instructions. 32-bit
// offsets (vectorizable: numel < 2^31): a pointer is one wide multiply-add from its base.
// kWithFull: the instantiation also handles kFull tensors (their fp32 moments cost 8 registers).
template <typename P, typename Gr, MasterKind M>
struct VecIn {
  using Src = std::conditional_t<M == MasterKind::kFp32, float, P>;
  uint32_t e0, ug;            // the lane's first element, the group
  Raw4<Src> p;                // parameter (or master) and gradient, as loaded
  Raw4<Gr> g;
  float m[kPer], v[kPer];     // kFull: the moments
  uint32_t mw, vw;            // otherwise: the lane's codes,
  float ms, vs;               // m's block absmax, v's block absmax (kBlock) or row maximum (kRank1),
  float4 cs;                  // kRank1: the old column maxima of the lane's columns
  uint32_t i, j;              // kRank1: row and first column
};

template <typename P, typename Gr, MasterKind M, bool kWithFull>
__device__ __forceinline__ VecIn<P, Gr, M> load_vec(const Current& cur, int64_t lg) {
  const Adamw4Tensor& d = cur.d;
  VecIn<P, Gr, M> in;
  in.ug = static_cast<uint32_t>(lg);
  in.e0 = in.ug * G + (threadIdx.x & 31) * kPer;
  if constexpr (M == MasterKind::kFp32) in.p = load4_raw(d.master + in.e0);
  else in.p = load4_raw(static_cast<const P*>(d.param) + in.e0);
  in.g = load4_raw(static_cast<const Gr*>(d.grad) + in.e0);
  if constexpr (kWithFull) {
    if (d.kind == Adamw4Kind::kFull) {
      load4(static_cast<const float*>(d.m) + in.e0, in.m);
      load4(static_cast<const float*>(d.v) + in.e0, in.v);
      return in;
    }
  }
  in.mw = *reinterpret_cast<const uint16_t*>(static_cast<const uint8_t*>(d.m) + in.e0 / 2);
  in.vw = *reinterpret_cast<const uint16_t*>(static_cast<const uint8_t*>(d.v) + in.e0 / 2);
  in.ms = d.m_scale[in.ug];
  if (d.kind == Adamw4Kind::kBlock) {
    in.vs = d.v_scale[in.ug];
  } else {  // rank-1: the lane's 4 elements share a row
    const uint32_t cols = static_cast<uint32_t>(d.cols);
    in.i = adamw4::div_magic(in.e0, cols, cur.cols_magic, cur.cols_shift);
    in.j = in.e0 - in.i * cols;
    in.vs = cur.r1.old_r[in.i];
    in.cs = *reinterpret_cast<const float4*>(cur.r1.old_r + (cur.rows + in.j));
  }
  return in;
}

template <typename P, typename Gr, MasterKind M, bool kWithFull>
__device__ __forceinline__ void finish_vec(const Current& cur, VecIn<P, Gr, M>& in, float inv_gs, const Tables& tb,
                                           float& pmax) {
  const Adamw4Tensor& d = cur.d;
  float p[kPer], g[kPer];
  unpack4<typename VecIn<P, Gr, M>::Src>(in.p, p);
  unpack4<Gr>(in.g, g);
  const bool full = kWithFull && d.kind == Adamw4Kind::kFull;
  float* m = in.m;
  float* v = in.v;
  if (!full) {
    float vs[kPer];
    if (d.kind == Adamw4Kind::kBlock) {
      vs[0] = vs[1] = vs[2] = vs[3] = in.vs;
    } else {
      vs[0] = adamw4::rank1_scale(in.vs, in.cs.x), vs[1] = adamw4::rank1_scale(in.vs, in.cs.y);
      vs[2] = adamw4::rank1_scale(in.vs, in.cs.z), vs[3] = adamw4::rank1_scale(in.vs, in.cs.w);
    }
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      m[k] = level_at(tb, ((in.mw << 2) >> (4 * k)) & 0x3C) * in.ms;  // decode_m
      v[k] = adamw4::decode_v((in.vw >> (4 * k)) & 0xF, vs[k]);
    }
  }
#pragma unroll
  for (int k = 0; k < kPer; ++k) p[k] = adamw::update(p[k], g[k] * inv_gs, m[k], v[k], cur.s);
  if (full) {
    store4(static_cast<float*>(d.m) + in.e0, in.m);
    store4(static_cast<float*>(d.v) + in.e0, in.v);
  } else {
    float mx = 0.0f, vx = 0.0f;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      mx = adamw4::nan_max(mx, fabsf(m[k]));
      vx = adamw4::nan_max(vx, fabsf(v[k]));
    }
    const float ms = float_of(adamw4::key_of_bits(__reduce_max_sync(0xFFFFFFFFu, __float_as_uint(mx))));
    float vs[kPer], rv[kPer];  // v's scales and their reciprocals
    if (d.kind == Adamw4Kind::kBlock) {
      vs[0] = vs[1] = vs[2] = vs[3] = float_of(adamw4::key_of_bits(__reduce_max_sync(0xFFFFFFFFu, __float_as_uint(vx))));
      rv[0] = rv[1] = rv[2] = rv[3] = adamw4::recip(vs[0]);
      if ((threadIdx.x & 31) == 0) d.v_scale[in.ug] = vs[0];
    } else {
      const float r = cur.r1.new_r[in.i];
      const float4 cs = *reinterpret_cast<const float4*>(cur.r1.new_r + (cur.rows + in.j));
      vs[0] = adamw4::rank1_scale(r, cs.x), vs[1] = adamw4::rank1_scale(r, cs.y);
      vs[2] = adamw4::rank1_scale(r, cs.z), vs[3] = adamw4::rank1_scale(r, cs.w);
#pragma unroll
      for (int k = 0; k < kPer; ++k) rv[k] = adamw4::recip(vs[k]);
    }
    if ((threadIdx.x & 31) == 0) d.m_scale[in.ug] = ms;
    const float rm = adamw4::recip(ms);
    uint32_t mc = 0, vc = 0;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      mc |= static_cast<uint32_t>(adamw4::encode_m_table(m[k], ms, rm, tb.bucket)) << (4 * k);
      vc |= static_cast<uint32_t>(adamw4::encode_v_fast(v[k], vs[k], rv[k])) << (4 * k);
    }
    *reinterpret_cast<uint16_t*>(static_cast<uint8_t*>(d.m) + in.e0 / 2) = static_cast<uint16_t>(mc);
    *reinterpret_cast<uint16_t*>(static_cast<uint8_t*>(d.v) + in.e0 / 2) = static_cast<uint16_t>(vc);
  }
  store_params<P, M>(d, in.e0, kPer, p, cur.t, true, pmax);
}

// Pass two: a warp per pair of groups decodes the old moments, applies the update, encodes the new
// moments and writes the parameter (and master). Per element: param and grad (2-4 B each), master (8 B if
// any), codes 2 x 0.5 B read and written (kFull: 16 B of fp32).
template <typename P, typename Gr, MasterKind M>
__global__ void __launch_bounds__(kThreads, kStepBlocks) step_kernel(const Adamw4Tensor* __restrict__ tensors, int64_t n_tensors,
                                                        int64_t n_groups, AdamwConfig c) {
  __shared__ Tables tb;
  __shared__ Current slots[kWarps];
  fill_tables(tb);
  if (skipped(c)) return;
  const double lr = c.lr_tensor != nullptr ? static_cast<double>(*c.lr_tensor) : c.lr;
  const float inv_gs = adamw::grad_multiplier(c);
  const int64_t n_warps = static_cast<int64_t>(gridDim.x) * kWarps;
  Current& cur = slots[threadIdx.x >> 5];
  init(cur);
  float pmax = 0.0f;  // this lane's largest |parameter| written in the current tensor (param_amax)
  // A warp per pair of groups 2q, 2q + 1: together on the vector path where both are whole groups
  // of one tensor with codes, one after the other otherwise.
  for (int64_t q = blockIdx.x * int64_t{kWarps} + (threadIdx.x >> 5); 2 * q < n_groups; q += n_warps) {
    if (2 * q >= cur.d.group_begin && 2 * q + 1 < cur.full_end && cur.vec && cur.d.kind != Adamw4Kind::kFull) {
      // The common case: this pair and the warp's next ones are whole vector groups of the tensor
      // it already describes. Stepped in a loop of 32-bit local indices (vectorizable: < 2^31
      // elements) that checks only the tensor's end, where the general loop below re-tests the
      // tensor, the path and the pair for every group (about a tenth of the step's instructions).
      const int64_t first = cur.d.group_begin;
      const uint32_t stride = static_cast<uint32_t>(2 * n_warps), lim = static_cast<uint32_t>(cur.full_end - first);
      uint32_t lg = static_cast<uint32_t>(2 * q - first);
      do {
        auto a = load_vec<P, Gr, M, false>(cur, lg), b = load_vec<P, Gr, M, false>(cur, lg + 1);
        finish_vec<P, Gr, M, false>(cur, a, inv_gs, tb, pmax);
        finish_vec<P, Gr, M, false>(cur, b, inv_gs, tb, pmax);
        lg += stride;
      } while (lg + 1 < lim);
      q = (first + lg) / 2 - n_warps;  // the pair after the last one stepped, less the loop's increment
      continue;
    }
    for (int64_t g = 2 * q; g < 2 * q + 2 && g < n_groups; ++g) {
      if (g < cur.d.group_begin || g >= cur.end) {  // warp-uniform: a new tensor
        flush_pmax(cur, pmax);
        pmax = 0.0f;
      }
      seek<P, Gr, M>(cur, tensors, n_tensors, g, lr, c);
      const int64_t lg = g - cur.d.group_begin;
      if (g == 2 * q && cur.vec && g + 1 < cur.full_end && cur.d.kind != Adamw4Kind::kFull) {
        auto a = load_vec<P, Gr, M, false>(cur, lg), b = load_vec<P, Gr, M, false>(cur, lg + 1);
        finish_vec<P, Gr, M, false>(cur, a, inv_gs, tb, pmax);
        finish_vec<P, Gr, M, false>(cur, b, inv_gs, tb, pmax);
        break;
      }
      if (cur.vec && g < cur.full_end) {
        auto a = load_vec<P, Gr, M, true>(cur, lg);
        finish_vec<P, Gr, M, true>(cur, a, inv_gs, tb, pmax);
      } else {
        step_group<P, Gr, M>(cur.d, lg, cur.t, cur.s, inv_gs, tb, pmax);
      }
    }
  }
  flush_pmax(cur, pmax);
}

template <typename P, typename Gr, MasterKind M>
void launch(const Adamw4Tensor* tensors, int64_t n_tensors, int64_t n_groups, const AdamwConfig& c,
            cudaStream_t stream) {
  const unsigned clear_grid = static_cast<unsigned>(n_tensors < 1024 ? n_tensors : 1024);
  clear_kernel<<<clear_grid, 256, 0, stream>>>(tensors, n_tensors, c);
  COAT_CHECK_LAUNCH();
  // A warp per group or strip (statistics) or pair of groups (step); as many blocks as fit at once
  // (4 per SM at 64 registers, kStepBlocks for the step), so the grid-stride loops end together
  // instead of in a second, partial wave.
  const unsigned grid = cuda::grid_for(n_groups, kWarps, 4);
  stats_kernel<Gr><<<grid, kThreads, 0, stream>>>(tensors, n_tensors, c);
  COAT_CHECK_LAUNCH();
  const unsigned step_grid = cuda::grid_for((n_groups + 1) / 2, kWarps, kStepBlocks);
  step_kernel<P, Gr, M><<<step_grid, kThreads, 0, stream>>>(tensors, n_tensors, n_groups, c);
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
