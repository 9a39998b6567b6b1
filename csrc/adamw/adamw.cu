// CUDA fused AdamW step with FP8 (DRE) optimizer states: one launch for all tensors of a
// configuration. Numerics in coat/adamw.h; the per-element and per-group math is adamw_math.h and
// dre.h, shared with the CPU reference.
//
// The step moves ~16 bytes per parameter and should run near copy bandwidth (benchmarks/RESULTS.md
// section 4 has the history). It is bound by memory traffic, not by its arithmetic: a variant
// that skipped all the math ran no faster. What mattered most was how the bytes move:
// - every store covers whole 32-byte sectors. A group's metadata (4-byte max, 1-byte k16) stored
//   on its own left partial sectors that the memory system had to merge, which cost ~20% of the
//   step; so a warp takes runs of 16 consecutive pairs (32 groups) and writes their metadata at
//   once, a lane per group;
// - a lane owns 8 elements (two runs of 4, so that half-warps read and write whole sectors), 16
//   lanes a group of 128, a warp a pair of groups;
// - one persistent block of 16 warps per SM streams through a contiguous chunk; each warp keeps
//   the next pairs in flight with 16-byte cp.async copies into shared-memory stages, as deep as
//   shared memory allows;
// - the arithmetic stays off the critical path: decoding looks the log2 of each code up in
//   conflict-free shared tables (the stochastic-rounding step converts codes with the hardware and
//   takes the MUFU's log2 instead); exp2, log2 for encoding, sqrt and reciprocals come from the
//   MUFU; encoding converts pairs of values with one cvt; group max / non-zero min are redux.sync
//   reductions on the bits of non-negative floats; per-group floor and int <-> float conversions
//   use FMA-pipe bit tricks;
// - non-finite moments (a rare, warp-uniform case) take a slow path that keeps them out of the
//   group statistics and stores them as the NaN code.
#include <cfloat>
#include <cstdint>
#include <type_traits>

#include "adamw_math.h"
#include "fp8_states.h"
#include "coat/adamw.h"
#include "common/cuda_utils.cuh"
#include "common/dre.h"

namespace coat {
namespace {

constexpr int G = kDreGroupSize;
constexpr int kWarps = 16;      // one block of 16 warps per SM (measured against 2 x 8 and 1 x 24)
constexpr int kThreads = 32 * kWarps;
constexpr int kE = 8;           // elements per lane
constexpr int kPair = 2 * G;    // elements per warp step
static_assert(G == 16 * kE, "16 lanes per group");

__device__ __forceinline__ int64_t groups_of(int64_t n) { return (n + G - 1) / G; }

// 32-bit words holding kE elements of T.
template <typename T>
constexpr int kWords = kE * static_cast<int>(sizeof(T)) / 4;

// ---- packed words <-> fp32 --------------------------------------------------------------------

template <typename T>
__device__ __forceinline__ float unpack(const uint32_t* w, int j) {
  if constexpr (sizeof(T) == 4) {
    return __uint_as_float(w[j]);
  } else if constexpr (std::is_same_v<T, bf16_t>) {
    return __uint_as_float(j % 2 ? w[j / 2] & 0xFFFF0000u : w[j / 2] << 16);
  } else {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(j % 2 ? w[j / 2] >> 16 : w[j / 2])));
  }
}

template <typename T>
__device__ __forceinline__ void pack(const float (&x)[kE], uint32_t (&w)[kWords<T>]) {
#pragma unroll
  for (int i = 0; i < kWords<T>; ++i) {
    if constexpr (sizeof(T) == 4) {
      w[i] = __float_as_uint(x[i]);
    } else if constexpr (std::is_same_v<T, bf16_t>) {
      const __nv_bfloat162 b = __floats2bfloat162_rn(x[2 * i], x[2 * i + 1]);
      w[i] = *reinterpret_cast<const uint32_t*>(&b);
    } else {
      const __half2 h = __floats2half2_rn(x[2 * i], x[2 * i + 1]);
      w[i] = *reinterpret_cast<const uint32_t*>(&h);
    }
  }
}

// A lane's 8 elements are two chunks of 4, 64 elements apart (element j at offset j / 4 * 64 + j % 4
// from the lane's first): each 16-lane half-warp then reads and writes whole 32-byte sectors with
// 4-, 8- or 16-byte vector accesses (8 contiguous fp32 per lane would touch every sector twice).
constexpr int kChunkStride = 64;
__device__ __forceinline__ int64_t elem_offset(int j) { return j / 4 * kChunkStride + j % 4; }

// The two chunks of T at p (p + i0 aligned to 4 sizeof(T) bytes) from kWords<T> words. Plain
// write-back stores: marked streaming (st.global.cs, evict-first) the step measured 1-4% slower on
// the 7B set (paired runs on one H200), as if early evictions broke the L2's batching of writes.
template <typename T>
__device__ __forceinline__ void store_chunks(T* p, const uint32_t (&w)[kWords<T>]) {
  constexpr int N = sizeof(T);
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    T* q = p + c * kChunkStride;
    if constexpr (N == 4) {
      *reinterpret_cast<uint4*>(q) = make_uint4(w[4 * c], w[4 * c + 1], w[4 * c + 2], w[4 * c + 3]);
    } else if constexpr (N == 2) {
      *reinterpret_cast<uint2*>(q) = make_uint2(w[2 * c], w[2 * c + 1]);
    } else {
      *reinterpret_cast<unsigned int*>(q) = w[c];
    }
  }
}

// ---- FP8 codes <-> fp32, two at a time ----------------------------------------------------------

// The FP8 values of 8 codes (two words), signed. An E5M2 code is the high byte of the fp16 of the
// same value; E4M3 goes through the packed hardware conversion to f16x2.
template <Fp8Format F>
__device__ __forceinline__ void fp8x8_to_float(const uint32_t (&w)[2], float (&q)[kE]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t c = w[i / 2];
    uint32_t h2;
    if constexpr (F == Fp8Format::kE5M2) {
      h2 = __byte_perm(c, 0u, i % 2 ? 0x3424 : 0x1404);
    } else {
      const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2(
          static_cast<__nv_fp8x2_storage_t>(i % 2 ? c >> 16 : c & 0xFFFFu), __NV_E4M3);
      h2 = static_cast<uint32_t>(r.x) | (static_cast<uint32_t>(r.y) << 16);
    }
    const __half2 h = *reinterpret_cast<const __half2*>(&h2);
    q[2 * i] = __low2float(h);
    q[2 * i + 1] = __high2float(h);
  }
}

// Decode tables: log2(|q| / fmt_max) of each code magnitude (dre_fast_lut_entry, the CPU
// reference's table), 32 copies interleaved so that lane l always reads bank l: a warp's lookups
// never conflict whatever the codes. Looking the log2 up instead of taking it from the MUFU halves
// the special-function work of decoding (the MUFU pipe was the busiest) at the price of integer
// work; the stochastic-rounding step, whose hash already loads the integer pipes, measured slower
// with it (35.8 against 32.7 ms on the 7B set) and keeps the MUFU decode above.
constexpr int kLutCopies = 32;
constexpr int kLutFloats = 128 * kLutCopies;
template <MasterKind M>
constexpr bool kLutDecode = M != MasterKind::kBf16Sr;

// The 8 decoded values of a lane's codes (two words): mx 2^((lut[code] + off) / k) (the top code: out),
// signed for m (kSigned);
// v is never negative, so its sign bit is not looked at (a negative NaN code is NaN either way).
template <bool kSigned, bool kSplit>
__device__ __forceinline__ void decode8(const uint32_t (&w)[2], const float* lut_lane, const DreGroupFast& g,
                                        float (&x)[kE]) {
#pragma unroll
  for (int j = 0; j < kE; ++j) {
    const uint32_t c = w[j / 4];
    const int b = j % 4;
    // Byte offset of entry (code & 0x7F) in the lane's column: (code & 0x7F) * 128.
    const uint32_t off = (b == 0 ? c << 7 : c >> (8 * b - 7)) & 0x3F80u;
    const float t = *reinterpret_cast<const float*>(reinterpret_cast<const char*>(lut_lane) + off);
    float a;
    if constexpr (kSplit) a = t == 0.0f ? g.out : g.mx * fast_exp2((t + g.off) * g.inv_k);  // t == 0: top code
    else a = g.mx * fast_exp2(t * g.inv_k);
    if constexpr (kSigned) a = __uint_as_float(__float_as_uint(a) | ((b == 3 ? c : c << (24 - 8 * b)) & 0x80000000u));
    x[j] = a;
  }
}

// Codes of 8 values (round to nearest even, finite values saturate, NaN -> 0x7F), two words.
template <Fp8Format F>
__device__ __forceinline__ void float_to_fp8x8(const float (&y)[kE], uint32_t (&w)[2]) {
  constexpr __nv_fp8_interpretation_t kind = F == Fp8Format::kE4M3 ? __NV_E4M3 : __NV_E5M2;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(y[4 * i], y[4 * i + 1]), __NV_SATFINITE, kind);
    const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(y[4 * i + 2], y[4 * i + 3]), __NV_SATFINITE, kind);
    w[i] = lo | (hi << 16);
  }
}

// ---- half-warp reductions (lanes 0-15 and 16-31 each reduce their own group) ------------------

__device__ __forceinline__ uint32_t half_max(uint32_t x, bool upper) {
  const uint32_t lo = __reduce_max_sync(0xFFFFFFFFu, upper ? 0u : x);
  const uint32_t hi = __reduce_max_sync(0xFFFFFFFFu, upper ? x : 0u);
  return upper ? hi : lo;
}

__device__ __forceinline__ uint32_t half_min(uint32_t x, bool upper) {
  const uint32_t lo = __reduce_min_sync(0xFFFFFFFFu, upper ? 0xFFFFFFFFu : x);
  const uint32_t hi = __reduce_min_sync(0xFFFFFFFFu, upper ? x : 0xFFFFFFFFu);
  return upper ? hi : lo;
}

// ---- one warp step: a pair of groups ------------------------------------------------------------

// A lane's inputs for one pair: its 8 elements (fp32 master or parameter, gradient, m and v codes)
// as raw words, and its group's old metadata. Loaded ahead of use (registers only).
template <typename Src, typename Gr>
struct LaneIn {
  uint32_t p[kWords<Src>];
  uint32_t g[kWords<Gr>];
  uint32_t mq[kWords<uint8_t>], vq[kWords<uint8_t>];
  float m_mx, v_mx;
  uint32_t m_k16, v_k16;
};

// Where a lane's elements are: pair j of a tensor; lanes 0-15 take group 2j, lanes 16-31 group
// 2j + 1; `ok` = the group is this block's to update.
struct LanePos {
  int64_t i0;  // first element (then elem_offset(j))
  int64_t lg;  // group within the tensor
  bool ok;
};

// kInterior: a pair known to lie inside the block's share.
template <bool kInterior>
__device__ __forceinline__ LanePos lane_pos(int64_t j, int lane, int64_t lb, int64_t le) {
  LanePos at;
  at.i0 = j * kPair + (lane >> 4) * G + (lane & 15) * 4;
  at.lg = 2 * j + (lane >> 4);
  at.ok = kInterior || (at.lg >= lb && at.lg < le);
  return at;
}

template <MasterKind M, typename P>
__device__ __forceinline__ const void* src_of(const AdamwTensor& d) {
  if constexpr (M == MasterKind::kFp32) return d.master;
  else return d.param;
}

template <typename Src, typename Gr>
__device__ __forceinline__ void load_meta(const AdamwTensor& d, const LanePos& at, LaneIn<Src, Gr>& in) {
  in.m_mx = at.ok ? __ldcs(d.m_gmax + at.lg) : 0.0f;
  in.v_mx = at.ok ? __ldcs(d.v_gmax + at.lg) : 0.0f;
  in.m_k16 = at.ok ? __ldcs(d.m_k16 + at.lg) : kDreUnitK16;
  in.v_k16 = at.ok ? __ldcs(d.v_k16 + at.lg) : kDreUnitK16;
}

// ---- the vector path: cp.async into per-lane slots of shared memory ---------------------------
// A warp keeps kDepth pairs in flight without spending registers on them. Its lanes copy chunks
// that other lanes of the same warp read, so each stage is handed over by cp.async.wait_group and
// a __syncwarp (which also orders the previous reads of a slot before its refill).

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

template <int kBytes>
__device__ __forceinline__ void cp_async(uint32_t dst, const void* src) {
  if constexpr (kBytes == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(dst), "l"(src), "n"(kBytes) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// One warp's stage (one pair): the pair's 256 elements of each array and its metadata. A 16-byte
// global chunk holds whole 4-element runs of consecutive lanes, and is placed so that all runs of
// chunk c (c = 0, 1) lie lane-major in 32 consecutive slots: lane l's run c of T is at
// (c * 32 + l) * 4 sizeof(T), and a warp's reads are conflict-free. The metadata are 8 words,
// [m_gmax, v_gmax, m_k16 word, v_k16 word] of the pair's first group, then of its second.
template <typename Src, typename Gr>
struct Stage {
  static constexpr int kSrc = 0;
  static constexpr int kGr = kSrc + kPair * static_cast<int>(sizeof(Src));
  static constexpr int kM = kGr + kPair * static_cast<int>(sizeof(Gr));
  static constexpr int kV = kM + kPair;
  static constexpr int kMeta = kV + kPair;
  static constexpr int kBytes = kMeta + 32;
};

// Pairs per warp in shared-memory stages (kDepth - 1 in flight ahead): the deepest up to 6 that
// fits an SM's 228 KB next to the decode tables (kLut) and the per-warp buffers. The step is
// bound by memory traffic, so more bytes in flight is what counts.
template <typename Src, typename Gr, bool kLut>
constexpr int depth_for() {
  int d = 6;
  while (d > 2 && kWarps * d * Stage<Src, Gr>::kBytes + (kLut ? 2 * kLutFloats * 4 : 0) + kWarps * 512 + 1024 > 228 * 1024)
    --d;
  return d;
}
template <typename Src, typename Gr, bool kLut>
constexpr int kDepthFor = depth_for<Src, Gr, kLut>();

// Shared memory of the stages of a block.
template <typename Src, typename Gr, bool kLut>
constexpr int kStagesBytes = kWarps * kDepthFor<Src, Gr, kLut> * Stage<Src, Gr>::kBytes;

// Stage offset of the 16-byte chunk that starts at element e of a pair (elements of kT bytes).
__device__ __forceinline__ int stage_slot(int e, int kT) { return ((e / 64 % 2) * 2 + e / G) * 64 * kT + (e % 64) * kT; }

// Start the 16-byte copies of one array's block of a pair at `src` into the stage at dst: lane l
// copies chunks l, l + 32, ...
template <typename T>
__device__ __forceinline__ void issue_array(uint32_t dst, const T* src, int lane) {
  constexpr int kT = static_cast<int>(sizeof(T));
  constexpr int kChunks = kPair * kT / 16;
  static_assert(kChunks % 32 == 0, "whole warps of chunks");
#pragma unroll
  for (int r = 0; r < kChunks / 32; ++r) {
    const int e = (lane + 32 * r) * 16 / kT;
    cp_async<16>(dst + stage_slot(e, kT), src + e);
  }
}

// Start the copies of pair j into stage st. The k16 bytes come as the aligned word holding both
// of the pair's (the caller keeps the pair within the group count rounded down to 4, so the word
// is in bounds).
template <typename P, typename Src, typename Gr, MasterKind M>
__device__ __forceinline__ void issue_stage(const AdamwTensor& d, int64_t j, uint32_t st, int lane) {
  using S = Stage<Src, Gr>;
  const int64_t e0 = j * kPair;
  issue_array(st + S::kSrc, static_cast<const Src*>(src_of<M, P>(d)) + e0, lane);
  issue_array(st + S::kGr, static_cast<const Gr*>(d.grad) + e0, lane);
  // m's codes (lanes 0-15) and v's (lanes 16-31) in one instruction: 16 chunks each.
  const int e = (lane & 15) * 16;
  cp_async<16>(st + (lane < 16 ? S::kM : S::kV) + stage_slot(e, 1), (lane < 16 ? d.m_q : d.v_q) + e0 + e);
  if (lane < 8) {
    const int f = lane & 3;
    const int64_t lg = 2 * j + (lane >> 2);
    const void* w = f == 0   ? static_cast<const void*>(d.m_gmax + lg)
                    : f == 1 ? static_cast<const void*>(d.v_gmax + lg)
                    : f == 2 ? static_cast<const void*>(d.m_k16 + (2 * j & ~int64_t{3}))
                             : static_cast<const void*>(d.v_k16 + (2 * j & ~int64_t{3}));
    cp_async<4>(st + S::kMeta + 4 * lane, w);
  }
}

template <typename T>
__device__ __forceinline__ void read_runs(const uint8_t* arr, int lane, uint32_t (&w)[kWords<T>]) {
  constexpr int kRun = 4 * static_cast<int>(sizeof(T));
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    const uint8_t* r = arr + (c * 32 + lane) * kRun;
    if constexpr (kRun == 16) {
      const uint4 a = *reinterpret_cast<const uint4*>(r);
      w[4 * c] = a.x; w[4 * c + 1] = a.y; w[4 * c + 2] = a.z; w[4 * c + 3] = a.w;
    } else if constexpr (kRun == 8) {
      const uint2 a = *reinterpret_cast<const uint2*>(r);
      w[2 * c] = a.x; w[2 * c + 1] = a.y;
    } else {
      w[c] = *reinterpret_cast<const uint32_t*>(r);
    }
  }
}

template <typename Src, typename Gr>
__device__ __forceinline__ void read_stage(const uint8_t* st, const LanePos& at, int lane, LaneIn<Src, Gr>& in) {
  using S = Stage<Src, Gr>;
  read_runs<Src>(st + S::kSrc, lane, in.p);
  read_runs<Gr>(st + S::kGr, lane, in.g);
  read_runs<uint8_t>(st + S::kM, lane, in.mq);
  read_runs<uint8_t>(st + S::kV, lane, in.vq);
  const uint4 mt = *reinterpret_cast<const uint4*>(st + S::kMeta + 16 * (lane >> 4));
  in.m_mx = __uint_as_float(mt.x);
  in.v_mx = __uint_as_float(mt.y);
  const int sh = 8 * static_cast<int>(at.lg & 3);
  in.m_k16 = (mt.z >> sh) & 0xFFu;
  in.v_k16 = (mt.w >> sh) & 0xFFu;
}

// Any group (partial, unaligned, or not this block's): element by element; absent elements read as
// zero codes and zero values, which stay zero and never enter the group statistics.
template <typename P, typename Src, typename Gr, MasterKind M>
__device__ __forceinline__ void load_any(const AdamwTensor& d, const LanePos& at, LaneIn<Src, Gr>& in) {
  const auto* src = static_cast<const Src*>(src_of<M, P>(d));
  const auto* grad = static_cast<const Gr*>(d.grad);
#pragma unroll
  for (int i = 0; i < kWords<Src>; ++i) in.p[i] = 0;
#pragma unroll
  for (int i = 0; i < kWords<Gr>; ++i) in.g[i] = 0;
  in.mq[0] = in.mq[1] = in.vq[0] = in.vq[1] = 0;
#pragma unroll
  for (int j = 0; j < kE; ++j) {
    const int64_t i = at.i0 + elem_offset(j);
    if (!at.ok || i >= d.numel) continue;
    if constexpr (sizeof(Src) == 4) in.p[j] = reinterpret_cast<const uint32_t*>(src)[i];
    else in.p[j / 2] |= uint32_t(reinterpret_cast<const uint16_t*>(src)[i]) << (16 * (j % 2));
    if constexpr (sizeof(Gr) == 4) in.g[j] = reinterpret_cast<const uint32_t*>(grad)[i];
    else in.g[j / 2] |= uint32_t(reinterpret_cast<const uint16_t*>(grad)[i]) << (16 * (j % 2));
    in.mq[j / 4] |= uint32_t(d.m_q[i]) << (8 * (j % 4));
    in.vq[j / 4] |= uint32_t(d.v_q[i]) << (8 * (j % 4));
  }
  load_meta(d, at, in);
}

// Per-tensor values of one step.
struct TensorStep {
  adamw::Scalars s;
  uint64_t t;
  float inv_gs;
};

template <bool kFull>
__device__ __forceinline__ void store_codes(const AdamwTensor& d, const LanePos& at, const uint32_t (&mq)[2],
                                            const uint32_t (&vq)[2]) {
  if constexpr (kFull) {
    store_chunks(d.m_q + at.i0, mq);
    store_chunks(d.v_q + at.i0, vq);
  } else {
#pragma unroll
    for (int j = 0; j < kE; ++j) {
      const int64_t i = at.i0 + elem_offset(j);
      if (!at.ok || i >= d.numel) continue;
      d.m_q[i] = static_cast<uint8_t>(mq[j / 4] >> (8 * (j % 4)));
      d.v_q[i] = static_cast<uint8_t>(vq[j / 4] >> (8 * (j % 4)));
    }
  }
}

// A group's new metadata (the same in all 16 lanes of its half-warp); m_mx, v_mx: gmax words.
struct GroupMeta {
  float m_mx, v_mx;
  uint32_t m_k16, v_k16;
};

// A lane's 8 values of m and of v from their codes and their groups' old metadata (kSplit: the
// warp holds a split group).
template <MasterKind M, Fp8Format MF, Fp8Format VF, bool kSplit, typename Src, typename Gr>
__device__ __forceinline__ void decode_pair(const LaneIn<Src, Gr>& in, const float* lut, float (&m)[kE],
                                            float (&v)[kE]) {
  const DreTop mt = kSplit ? dre_top(in.m_mx, MF) : DreTop{in.m_mx, in.m_mx, 0.0f};
  const DreTop vt = kSplit ? dre_top(in.v_mx, VF) : DreTop{in.v_mx, in.v_mx, 0.0f};
  const DreGroupFast mg = dre_group_fast_l(mt, fast_log2(mt.mx), static_cast<uint8_t>(in.m_k16), MF);
  const DreGroupFast vg = dre_group_fast_l(vt, fast_log2(vt.mx), static_cast<uint8_t>(in.v_k16), VF);
  if constexpr (kLutDecode<M>) {
    decode8<true, kSplit>(in.mq, lut + (threadIdx.x & 31), mg, m);
    decode8<false, kSplit>(in.vq, lut + kLutFloats + (threadIdx.x & 31), vg, v);
  } else {
    fp8x8_to_float<MF>(in.mq, m);
    fp8x8_to_float<VF>(in.vq, v);
#pragma unroll
    for (int j = 0; j < kE; ++j) {
      m[j] = dre_decode_value_fast<kSplit>(m[j], mg, MF);
      v[j] = dre_decode_value_fast<kSplit>(v[j], vg, VF);
    }
  }
}

// The codes of a lane's 8 finite values of m and of v in their new groups (kSplit: the warp may
// hold a split group); m and v are overwritten.
template <Fp8Format MF, Fp8Format VF, bool kSplit>
__device__ __forceinline__ void encode_pair(float (&m)[kE], float (&v)[kE], const DreGroupFast& mg,
                                            const DreGroupFast& vg, uint32_t (&mq)[2], uint32_t (&vq)[2]) {
#pragma unroll
  for (int j = 0; j < kE; ++j) {
    m[j] = dre_encode_value_fast<kSplit>(m[j], mg, MF);
    v[j] = dre_encode_value_fast<kSplit>(v[j], vg, VF);
  }
  float_to_fp8x8<MF>(m, mq);
  float_to_fp8x8<VF>(v, vq);
}

// Decode -> AdamW -> new group max / non-zero min -> k16 -> encode -> store, for a lane's 8
// elements; returns the group's new metadata for the caller to store. kFull: a full group of an
// aligned tensor (vector stores); else element-wise, guarded.
template <typename P, typename Src, typename Gr, MasterKind M, Fp8Format MF, Fp8Format VF, bool kFull>
__device__ __forceinline__ GroupMeta step_pair(const AdamwTensor& d, const LanePos& at, const LaneIn<Src, Gr>& in,
                                          const TensorStep& ts, const AdamwConfig& c, const float* lut, float& pmax) {
  const bool upper = (threadIdx.x & 31) >= 16;
  // Split groups (dre.h) are rare: the warp takes the split-aware decoding only when one of its
  // four states holds one (a negative gmax word), and the plain one otherwise.
  const bool split_old =
      __any_sync(0xFFFFFFFFu, ((__float_as_uint(in.m_mx) | __float_as_uint(in.v_mx)) & 0x80000000u) != 0);
  float p[kE], m[kE], v[kE];
  if (split_old) {
    decode_pair<M, MF, VF, true>(in, lut, m, v);
  } else {
    decode_pair<M, MF, VF, false>(in, lut, m, v);
  }
  // Statistics over |x|: max as a float, non-zero min as min over 2 bits(x) - 1 (unsigned: drops
  // the sign, and zero wraps to the largest value). NaN never wins either.
  float m_hi = 0.0f, v_hi = 0.0f;
  uint32_t m_lo2 = 0xFFFFFFFFu, v_lo2 = 0xFFFFFFFFu;
#pragma unroll
  for (int j = 0; j < kE; ++j) {
    const float g = unpack<Gr>(in.g, j) * ts.inv_gs;
    p[j] = adamw::update(unpack<Src>(in.p, j), g, m[j], v[j], ts.s);
    m_hi = fmaxf(m_hi, fabsf(m[j]));
    v_hi = fmaxf(v_hi, fabsf(v[j]));
    m_lo2 = min(m_lo2, __float_as_uint(m[j]) * 2u - 1u);
    v_lo2 = min(v_lo2, __float_as_uint(v[j]) * 2u - 1u);
  }
  // The parameter first: its registers are free before the reductions.
  uint32_t pw[kWords<P>];
  if constexpr (M == MasterKind::kBf16Sr) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // element 4q + i takes bits [16 i, 16 i + 16) of quad q's hash
      const uint64_t r = adamw::sr_bits(d.seed, ts.t, static_cast<uint64_t>((at.i0 + h * kChunkStride) >> 2));
      adamw::bf16_sr_quad(p + 4 * h, r, pw[2 * h], pw[2 * h + 1]);
    }
  } else {
    pack<P>(p, pw);
  }
  if (d.param_amax != nullptr) {  // the written values' max |.| (AdamwTensor::param_amax); warp-uniform
    if constexpr (kFull && std::is_same_v<P, bf16_t>) {  // one packed 16-bit max per pair (common/fp8.h)
      pmax = fmaxf(pmax, fmaxf(bf16x4_finite_amax(pw[0], pw[1]), bf16x4_finite_amax(pw[2], pw[3])));
    } else {
#pragma unroll
      for (int j = 0; j < kE; ++j)
        if (kFull || (at.ok && at.i0 + elem_offset(j) < d.numel)) pmax = fmaxf(pmax, finite_abs(unpack<P>(pw, j)));
    }
  }
  if constexpr (kFull) {
    if constexpr (M == MasterKind::kFp32) {
      uint32_t mw[kE];
      pack<float>(p, mw);
      store_chunks(d.master + at.i0, mw);
    }
    store_chunks(static_cast<P*>(d.param) + at.i0, pw);
  } else {
#pragma unroll
    for (int j = 0; j < kE; ++j) {
      const int64_t i = at.i0 + elem_offset(j);
      if (!at.ok || i >= d.numel) continue;
      if constexpr (M == MasterKind::kFp32) d.master[i] = p[j];
      if constexpr (sizeof(P) == 4) reinterpret_cast<uint32_t*>(d.param)[i] = pw[j];
      else reinterpret_cast<uint16_t*>(d.param)[i] = static_cast<uint16_t>(pw[j / 2] >> (16 * (j % 2)));
    }
  }
  float m_lane = m_hi, v_lane = v_hi;  // this lane's maxima
  m_hi = __uint_as_float(half_max(__float_as_uint(m_hi), upper));
  v_hi = __uint_as_float(half_max(__float_as_uint(v_hi), upper));
  float m_lo = __uint_as_float((half_min(m_lo2, upper) + 1u) >> 1);  // 0: no non-zero value
  float v_lo = __uint_as_float((half_min(v_lo2, upper) + 1u) >> 1);
  // An infinite moment (from an infinite gradient) must neither set the group max nor be saturated.
  const bool nonfinite = __any_sync(0xFFFFFFFFu, !(m_hi <= FLT_MAX) || !(v_hi <= FLT_MAX));
  if (nonfinite) {
    float mh = 0.0f, ml = INFINITY, vh = 0.0f, vl = INFINITY;
#pragma unroll
    for (int j = 0; j < kE; ++j) {
      adamw::group_minmax(m[j], mh, ml);
      adamw::group_minmax(v[j], vh, vl);
    }
    m_hi = __uint_as_float(half_max(__float_as_uint(mh), upper));
    m_lo = __uint_as_float(half_min(__float_as_uint(ml), upper));
    v_hi = __uint_as_float(half_max(__float_as_uint(vh), upper));
    v_lo = __uint_as_float(half_min(__float_as_uint(vl), upper));
    m_lane = mh;
    v_lane = vh;
  }
  // A group splits where its max is >= kDreSplitRatio times the largest of the others (dre.h):
  // the warp finds the exact second maximum only where its lanes' maxima leave that possible.
  // A lane whose max lies in (max / kDreSplitRatio, max) rules its group's split out.
  const uint32_t half = upper ? 0xFFFF0000u : 0x0000FFFFu;
  const uint32_t m_no = __ballot_sync(0xFFFFFFFFu, m_lane < m_hi && kDreSplitRatio * m_lane > m_hi) & half;
  const uint32_t v_no = __ballot_sync(0xFFFFFFFFu, v_lane < v_hi && kDreSplitRatio * v_lane > v_hi) & half;
  const bool may_split = __any_sync(0xFFFFFFFFu, (m_no == 0 && m_hi >= kDreSplitRatio * FLT_MIN) ||
                                                     (v_no == 0 && v_hi >= kDreSplitRatio * FLT_MIN));
  DreNewGroupFast m_new, v_new;
  if (may_split) {
    float m_2 = 0.0f, v_2 = 0.0f;
#pragma unroll
    for (int j = 0; j < kE; ++j) {
      adamw::group_second(m[j], m_hi, m_2);
      adamw::group_second(v[j], v_hi, v_2);
    }
    m_2 = __uint_as_float(half_max(__float_as_uint(m_2), upper));
    v_2 = __uint_as_float(half_max(__float_as_uint(v_2), upper));
    m_new = adamw::new_group(m_hi, m_2, m_lo, c.expansion, c.m_log2_range, MF);
    v_new = adamw::new_group(v_hi, v_2, v_lo, c.expansion, c.v_log2_range, VF);
  } else {
    m_new = dre_new_whole_group_fast(m_hi, m_lo, c.expansion ? c.m_log2_range : 0.0f, MF);
    v_new = dre_new_whole_group_fast(v_hi, v_lo, c.expansion ? c.v_log2_range : 0.0f, VF);
  }
  uint32_t mq[2], vq[2];
  if (!nonfinite && !may_split) {
    encode_pair<MF, VF, false>(m, v, m_new.g, v_new.g, mq, vq);
  } else if (!nonfinite) {
    encode_pair<MF, VF, true>(m, v, m_new.g, v_new.g, mq, vq);
  } else {
    mq[0] = mq[1] = vq[0] = vq[1] = 0;
#pragma unroll
    for (int j = 0; j < kE; ++j) {
      mq[j / 4] |= uint32_t(adamw::encode_state(m[j], m_new.g, MF)) << (8 * (j % 4));
      vq[j / 4] |= uint32_t(adamw::encode_state(v[j], v_new.g, VF)) << (8 * (j % 4));
    }
  }
  store_codes<kFull>(d, at, mq, vq);
  return {m_new.word, v_new.word, m_new.k16, v_new.k16};
}

// A group's metadata straight to global memory (lanes 0 and 16 for their groups). Scattered
// 1- and 4-byte stores cost the memory system far more than their size (partial sectors), so
// the vector path gathers whole runs first (RunMeta).
__device__ __forceinline__ void store_meta(const AdamwTensor& d, const LanePos& at, const GroupMeta& g) {
  if (at.ok && (threadIdx.x & 15) == 0) {
    d.m_gmax[at.lg] = g.m_mx;
    d.m_k16[at.lg] = static_cast<uint8_t>(g.m_k16);
    d.v_gmax[at.lg] = g.v_mx;
    d.v_k16[at.lg] = static_cast<uint8_t>(g.v_k16);
  }
}

// A warp's metadata for a run of kRun consecutive pairs (2 kRun = 32 groups, sector-aligned):
// gathered in shared memory, then written by the whole warp as full sectors (a lane per group).
constexpr int kRun = 16;
struct RunMeta {
  float m_mx[2 * kRun], v_mx[2 * kRun];
  uint8_t m_k16[2 * kRun], v_k16[2 * kRun];
};

__device__ __forceinline__ void gather_meta(RunMeta& r, int i, const GroupMeta& g) {
  if ((threadIdx.x & 15) == 0) {
    const int s = 2 * i + ((threadIdx.x >> 4) & 1);
    r.m_mx[s] = g.m_mx;
    r.v_mx[s] = g.v_mx;
    r.m_k16[s] = static_cast<uint8_t>(g.m_k16);
    r.v_k16[s] = static_cast<uint8_t>(g.v_k16);
  }
}

__device__ __forceinline__ void flush_meta(const AdamwTensor& d, const RunMeta& r, int64_t g0, int lane) {
  __syncwarp();
  d.m_gmax[g0 + lane] = r.m_mx[lane];
  d.v_gmax[g0 + lane] = r.v_mx[lane];
  d.m_k16[g0 + lane] = r.m_k16[lane];
  d.v_k16[g0 + lane] = r.v_k16[lane];
  __syncwarp();
}

// Block b updates the groups [b chunk, (b + 1) chunk) of the launch's numbering. Within each tensor
// those are split into pairs (local groups 2j, 2j + 1); warp w takes pairs w, w + 8, ... of the
// block's share. Pairs wholly inside the share and made of full groups of an aligned tensor take
// the vector path, pipelined kDepth deep; the rest (at most one pair at each end of a share, the
// tensor's partial last group, unaligned tensors) take the element-wise path.
template <typename P, typename Gr, MasterKind M, Fp8Format MF, Fp8Format VF>
__global__ void __launch_bounds__(kThreads, 1)
    adamw_kernel(const AdamwTensor* __restrict__ tensors, int64_t n_tensors, int64_t n_groups, int64_t chunk,
                 AdamwConfig c) {
  using Src = std::conditional_t<M == MasterKind::kFp32, float, P>;
  constexpr int kStageBytes = Stage<Src, Gr>::kBytes;
  constexpr int kDepth = kDepthFor<Src, Gr, kLutDecode<M>>;
  extern __shared__ __align__(16) uint8_t smem[];  // kDepth stages per warp
  if (c.found_inf != nullptr && *c.found_inf != 0.0f) return;
  const int64_t cb = static_cast<int64_t>(blockIdx.x) * chunk;
  const int64_t ce = cb + chunk < n_groups ? cb + chunk : n_groups;
  if (cb >= ce) return;
  const float* lut = nullptr;
  if constexpr (kLutDecode<M>) {
    __shared__ float tables[2 * kLutFloats];  // m's table, then v's
    for (int i = threadIdx.x; i < 2 * kLutFloats; i += kThreads)
      tables[i] = dre_fast_lut_entry((i / kLutCopies) % 128, i < kLutFloats ? MF : VF);
    __syncthreads();
    lut = tables;
  }
  const double lr = c.lr_tensor != nullptr ? static_cast<double>(*c.lr_tensor) : c.lr;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const uint32_t stage0 = smem_addr(smem + warp * kDepth * kStageBytes);
  // The per-tensor values live in shared memory (one copy per warp, reloaded for every pair):
  // held in registers, the compiler rematerialises them from the fp64 hyperparameters each time.
  __shared__ TensorStep warp_ts[kWarps];
  TensorStep& ts = warp_ts[warp];
  __shared__ RunMeta run_meta[kWarps];
  RunMeta& run = run_meta[warp];
  const float inv_gs = adamw::grad_multiplier(c);

  int64_t lo = 0, hi = n_tensors - 1;  // the last descriptor with group_begin <= cb
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) >> 1;
    if (tensors[mid].group_begin <= cb) lo = mid; else hi = mid - 1;
  }
  for (int64_t ti = lo; ti < n_tensors; ++ti) {
    const AdamwTensor d = tensors[ti];
    if (d.group_begin >= ce) break;
    const int64_t ng = groups_of(d.numel);
    const int64_t lb = (cb > d.group_begin ? cb : d.group_begin) - d.group_begin;
    const int64_t le = (ce < d.group_begin + ng ? ce : d.group_begin + ng) - d.group_begin;
    __syncwarp();  // every lane is done with the previous tensor's values
    if (lane == 0) {
      ts.t = adamw::step_count(*d.step);
      ts.s = adamw::make_scalars(lr, c, ts.t);
      ts.inv_gs = inv_gs;
    }
    __syncwarp();
    // Staged arrays are copied in 16-byte chunks; stores are 4-element vectors.
    const bool aligned = cuda::aligned(src_of<M, P>(d), 16) && cuda::aligned(d.grad, 16) && cuda::aligned(d.m_q, 16) &&
                         cuda::aligned(d.v_q, 16) && cuda::aligned(d.param, 4 * sizeof(P)) &&
                         cuda::aligned(d.m_k16, 4) && cuda::aligned(d.v_k16, 4);
    // Vector-path groups end: full groups, whose k16 word is within the group count.
    int64_t full = aligned ? d.numel / G : 0;
    full = full < (ng & ~int64_t{3}) ? full : (ng & ~int64_t{3});
    full = full < le ? full : le;
    float pmax = 0.0f;  // this lane's largest finite |parameter| written (param_amax)
    const int64_t in_lo = (lb + 1) / 2;
    const int64_t in_hi = full / 2 > in_lo ? full / 2 : in_lo;

    // The vector-path pairs [in_lo, in_hi): runs of kRun pairs aligned to kRun in the tensor
    // ([ra, rb); warp w takes runs w, w + kWarps, ...), whose metadata go out as whole sectors, and
    // the pairs before and after them ([in_lo, ra), [rb, in_hi); round-robin), whose metadata are
    // stored directly. A warp walks its runs' pairs, then its others: k < n_mine, kDepth - 1
    // ahead in flight.
    const int64_t up = (in_lo + kRun - 1) / kRun * kRun;
    const int64_t ra = up < in_hi ? up : in_hi;
    const int64_t down = in_hi / kRun * kRun;
    const int64_t rb = down > ra ? down : ra;
    const int64_t n_runs = (rb - ra) / kRun;
    const int64_t n_body = (warp < n_runs ? (n_runs - warp + kWarps - 1) / kWarps : 0) * kRun;
    const int64_t n_head = ra - in_lo, n_x = n_head + (in_hi - rb);
    const int64_t n_mine = n_body + (warp < n_x ? (n_x - warp + kWarps - 1) / kWarps : 0);
    auto pair_of = [&](int64_t k) -> int64_t {
      if (k < n_body) return ra + kRun * (warp + kWarps * (k / kRun)) + k % kRun;
      const int64_t e = warp + kWarps * (k - n_body);
      return e < n_head ? in_lo + e : rb + (e - n_head);
    };
#pragma unroll
    for (int k = 0; k < kDepth - 1; ++k) {
      if (k < n_mine) issue_stage<P, Src, Gr, M>(d, pair_of(k), stage0 + k * kStageBytes, lane);
      cp_async_commit();
    }
    for (int64_t k = 0; k < n_mine; ++k) {
      cp_async_wait<kDepth - 2>();  // stage k has landed (the kDepth - 2 after it may not have)
      __syncwarp();                 // ... for every lane's copies
      const int64_t j = pair_of(k);
      const LanePos at = lane_pos<true>(j, lane, lb, le);
      LaneIn<Src, Gr> in;
      read_stage(smem + warp * kDepth * kStageBytes + (k % kDepth) * kStageBytes, at, lane, in);
      // Refill the slot read in the previous iteration while this one's shared loads are in flight.
      const int64_t kn = k + kDepth - 1;
      if (kn < n_mine)
        issue_stage<P, Src, Gr, M>(d, pair_of(kn), stage0 + static_cast<uint32_t>(kn % kDepth) * kStageBytes, lane);
      cp_async_commit();
      const GroupMeta g = step_pair<P, Src, Gr, M, MF, VF, true>(d, at, in, ts, c, lut, pmax);
      if (k < n_body) {
        gather_meta(run, static_cast<int>(k % kRun), g);
        if (k % kRun == kRun - 1) flush_meta(d, run, 2 * (j - (kRun - 1)), lane);
      } else {
        store_meta(d, at, g);
      }
    }
    auto edge = [&](int64_t jj) {
      const LanePos at = lane_pos<false>(jj, lane, lb, le);
      LaneIn<Src, Gr> in;
      load_any<P, Src, Gr, M>(d, at, in);
      store_meta(d, at, step_pair<P, Src, Gr, M, MF, VF, false>(d, at, in, ts, c, lut, pmax));
    };
    if (lb % 2 == 1 && warp == kWarps - 1) edge(lb / 2);
    for (int64_t jj = in_hi + warp; jj < (le + 1) / 2; jj += kWarps) edge(jj);
    if (d.param_amax != nullptr) {  // one atomic per warp and tensor (the warp is converged here)
      const uint32_t mx = __reduce_max_sync(0xFFFFFFFFu, __float_as_uint(pmax));
      if (lane == 0 && mx != 0u) atomicMax(reinterpret_cast<unsigned int*>(d.param_amax), mx);
    }
  }
}

template <typename P, typename Gr, MasterKind M>
void launch_formats(const AdamwTensor* tensors, int64_t n_tensors, int64_t n_groups, const AdamwConfig& c,
                    cudaStream_t stream) {
  // Persistent blocks (one per SM), each with a contiguous chunk of groups (even, so most pairs
  // are whole).
  const int64_t cap = static_cast<int64_t>(cuda::sm_count());
  const int64_t want = (n_groups + 2 * kWarps - 1) / (2 * kWarps);
  const int64_t blocks = want < cap ? want : cap;
  int64_t chunk = (n_groups + blocks - 1) / blocks;
  chunk += chunk % 2;
  const unsigned grid = static_cast<unsigned>((n_groups + chunk - 1) / chunk);
  constexpr auto E4 = Fp8Format::kE4M3, E5 = Fp8Format::kE5M2;
  const bool m4 = c.m_fmt == E4, v4 = c.v_fmt == E4;
  auto* kernel = m4 ? (v4 ? adamw_kernel<P, Gr, M, E4, E4> : adamw_kernel<P, Gr, M, E4, E5>)
                    : (v4 ? adamw_kernel<P, Gr, M, E5, E4> : adamw_kernel<P, Gr, M, E5, E5>);
  using Src = std::conditional_t<M == MasterKind::kFp32, float, P>;
  constexpr int smem = kStagesBytes<Src, Gr, kLutDecode<M>>;
  // Function attributes are set per device (each device has its own context): per device and
  // format pair, once. Racing threads set the same values (benign).
  static bool configured[cuda::kMaxDevices][4] = {};
  const int dev = current_device();
  COAT_CHECK(dev >= 0 && dev < cuda::kMaxDevices, "adamw_step: CUDA device " + std::to_string(dev) + " out of range");
  bool& done = configured[dev][(m4 ? 0 : 2) + (v4 ? 0 : 1)];
  if (!done) {
    COAT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    // The block needs nearly all of it (stages + decode tables).
    COAT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                         cudaSharedmemCarveoutMaxShared));
    done = true;
  }
  kernel<<<grid, kThreads, smem, stream>>>(tensors, n_tensors, n_groups, chunk, c);
  COAT_CHECK_LAUNCH();
}

template <typename P, MasterKind M>
void launch(const AdamwTensor* tensors, int64_t n_tensors, int64_t n_groups, const AdamwConfig& c,
            cudaStream_t stream) {
  switch (c.grad_dtype) {
    case DType::kFloat32: return launch_formats<P, float, M>(tensors, n_tensors, n_groups, c, stream);
    case DType::kBFloat16: return launch_formats<P, bf16_t, M>(tensors, n_tensors, n_groups, c, stream);
    case DType::kFloat16: return launch_formats<P, fp16_t, M>(tensors, n_tensors, n_groups, c, stream);
  }
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
