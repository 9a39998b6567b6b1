// CUDA helpers: error checks, vector types, warp reductions.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "coat/common.h"
#include "fp8.h"

#define COAT_CUDA_CHECK(expr)                                                                  \
  do {                                                                                         \
    cudaError_t err_ = (expr);                                                                 \
    if (err_ != cudaSuccess)                                                                   \
      ::coat::throw_error(std::string(#expr) + ": " + cudaGetErrorString(err_), __FILE__,      \
                          __LINE__);                                                           \
  } while (0)

// Check a kernel launch (configuration errors surface here; faults surface at the next sync).
#define COAT_CHECK_LAUNCH() COAT_CUDA_CHECK(cudaGetLastError())

namespace coat {
namespace cuda {

__host__ __device__ inline bool aligned(const void* p, size_t bytes) {
  return (reinterpret_cast<uintptr_t>(p) % bytes) == 0;
}

// Per-device caches (attributes, function settings) hold this many devices.
constexpr int kMaxDevices = 64;

// Multiprocessor count of the current device, cached: launchers ask on every call.
inline int sm_count() {
  static int cache[kMaxDevices] = {0};
  int dev = 0;
  COAT_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 0 || dev >= kMaxDevices) {
    int n = 0;  // beyond the cache: ask every time
    COAT_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    return n;
  }
  if (cache[dev] == 0) {
    int n = 0;
    COAT_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    cache[dev] = n;
  }
  return cache[dev];
}

// Grid for a grid-stride loop over `work` items with `threads` per block: enough blocks to fill the
// device a few times over, never more than the work needs.
inline unsigned grid_for(int64_t work, int threads, int blocks_per_sm = 8) {
  const int64_t need = (work + threads - 1) / threads;
  const int64_t cap = static_cast<int64_t>(sm_count()) * blocks_per_sm;
  const int64_t g = need < cap ? need : cap;
  return static_cast<unsigned>(g > 0 ? g : 1);
}

template <typename T>
__device__ __forceinline__ T warp_max(T v, int width = 32) {
#pragma unroll
  for (int o = width / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o, width));
  return v;
}

template <typename T>
__device__ __forceinline__ T warp_min(T v, int width = 32) {
#pragma unroll
  for (int o = width / 2; o > 0; o >>= 1) v = fminf(v, __shfl_xor_sync(0xffffffffu, v, o, width));
  return v;
}

// Block-wide max of non-negative floats folded into *out with an integer atomicMax on the bits
// (order-preserving for non-negative floats); *out must be zeroed beforehand. Every thread of the
// block calls it. `part` is one buffer per kernel, shared by every call in it (the SwiGLU backward
// makes two, dgu's max then h's): the first barrier keeps a call's writes behind the previous
// call's reads, which warp 0 may still be doing while the other warps have moved on.
__device__ __forceinline__ void block_max_atomic(float m, float* out) {
  __shared__ float part[32];
  m = warp_max(m);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x < 32) {
    m = threadIdx.x < (blockDim.x >> 5) ? part[threadIdx.x] : 0.0f;
    m = warp_max(m);
    if (threadIdx.x == 0) atomicMax(reinterpret_cast<int*>(out), __float_as_int(m));
  }
}

// Max / min over the full warp of non-negative floats (+inf allowed, no NaN): their bit patterns
// order like unsigned integers, so one redux.sync (sm_80+) replaces five shuffle rounds.
__device__ __forceinline__ float warp_max_nonneg(float v) {
  return __uint_as_float(__reduce_max_sync(0xffffffffu, __float_as_uint(v)));
}
__device__ __forceinline__ float warp_min_nonneg(float v) {
  return __uint_as_float(__reduce_min_sync(0xffffffffu, __float_as_uint(v)));
}

// Eight elements of T loaded as fp32 (16 bytes of bf16/fp16, 32 bytes of fp32).
template <typename T>
__device__ __forceinline__ void load8(const T* p, float (&v)[8]) {
  if constexpr (sizeof(T) == 4) {
    const float4 a = reinterpret_cast<const float4*>(p)[0];
    const float4 b = reinterpret_cast<const float4*>(p)[1];
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
  } else {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = Elem<T>::load(e[i]);
  }
}

template <typename T>
__device__ __forceinline__ void store8(T* p, const float (&v)[8]) {
  if constexpr (sizeof(T) == 4) {
    reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else {
    uint4 raw;
    T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) e[i] = Elem<T>::store(v[i]);
    *reinterpret_cast<uint4*>(p) = raw;
  }
}

// Eight FP8 codes packed into 8 bytes, with the paired hardware conversion where available.
__device__ __forceinline__ uint2 encode8(const float (&v)[8], Fp8Format fmt) {
  uint32_t w[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    uint32_t acc = 0;
#pragma unroll
    for (int i = 0; i < 4; i += 2) {
      const __nv_fp8x2_storage_t pair = __nv_cvt_float2_to_fp8x2(
          make_float2(v[4 * h + i], v[4 * h + i + 1]), __NV_SATFINITE,
          fmt == Fp8Format::kE4M3 ? __NV_E4M3 : __NV_E5M2);
      acc |= static_cast<uint32_t>(pair) << (8 * i);
    }
    w[h] = acc;
  }
  return make_uint2(w[0], w[1]);
}

__device__ __forceinline__ void decode8(uint2 raw, Fp8Format fmt, float (&v)[8]) {
  const uint8_t* b = reinterpret_cast<const uint8_t*>(&raw);
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = decode_fp8(b[i], fmt);
}

// Calls f with a null pointer of the device element type of t (float, bf16_t or fp16_t).
template <typename F>
void dispatch_dtype(DType t, F&& f) {
  switch (t) {
    case DType::kFloat32: f(static_cast<float*>(nullptr)); return;
    case DType::kBFloat16: f(static_cast<bf16_t*>(nullptr)); return;
    case DType::kFloat16: f(static_cast<fp16_t*>(nullptr)); return;
  }
  throw_invalid("unsupported dtype");
}

// v rounded to T and back: what a value becomes when stored as T.
template <typename T>
__device__ __forceinline__ float round_to(float v) {
  return Elem<T>::load(Elem<T>::store(v));
}

// 16 consecutive elements (one 1x16 FP8 group) as fp32: two vector accesses when aligned, else
// scalar ones with the same arithmetic.
template <typename T>
__device__ __forceinline__ void load16(const T* p, bool vec, float (&v)[16]) {
  if (vec) {
    float a[8], b[8];
    load8(p, a);
    load8(p + 8, b);
#pragma unroll
    for (int i = 0; i < 8; ++i) { v[i] = a[i]; v[8 + i] = b[i]; }
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = Elem<T>::load(p[i]);
  }
}

template <typename T>
__device__ __forceinline__ void store16(T* p, bool vec, const float (&v)[16]) {
  if (vec) {
    float a[8], b[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) { a[i] = v[i]; b[i] = v[8 + i]; }
    store8(p, a);
    store8(p + 8, b);
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i) p[i] = Elem<T>::store(v[i]);
  }
}

// 16 FP8 codes times their group scale.
__device__ __forceinline__ void decode16(const uint8_t* p, bool vec, Fp8Format fmt, float s, float (&v)[16]) {
  if (vec) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    float a[8], b[8];
    decode8(make_uint2(raw.x, raw.y), fmt, a);
    decode8(make_uint2(raw.z, raw.w), fmt, b);
#pragma unroll
    for (int i = 0; i < 8; ++i) { v[i] = a[i] * s; v[8 + i] = b[i] * s; }
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = decode_fp8(p[i], fmt) * s;
  }
}

}  // namespace cuda
}  // namespace coat
