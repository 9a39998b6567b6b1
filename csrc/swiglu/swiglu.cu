// CUDA kernels of the swiglu family, compiled per activation: one thread per 16-column group of h,
// which is one FP8 group of the gate half and one of the up half, so group amaxes need no shuffles.
// 64-bit indices; inter is a multiple of 16 (checked), so groups never cross a row; unaligned
// buffers take scalar loads with the same arithmetic.
#include "common/cuda_utils.cuh"
#include "common/group_scale.h"
#include "swiglu_args.h"

namespace coat {
namespace {

using cuda::decode16;
using cuda::dispatch_dtype;
using cuda::load16;
using cuda::round_to;
using cuda::store16;

constexpr int kThreads = 256;
constexpr int G = kSwigluGroup;

// Both compile-time parameters at once: the element type T and the activation A.
template <typename F>
void dispatch2(DType t, GatedAct act, F&& f) {
  dispatch_dtype(t, [&](auto* tt) { detail::dispatch_act(act, [&](auto at) { f(tt, at); }); });
}

// Quantizes one 16-group with its own scale (stored at scales[gi]) into p.
__device__ __forceinline__ void quantize16(uint8_t* p, bool vec, const float (&v)[G], void* scales,
                                           int64_t gi, ScaleKind kind, Fp8Format fmt) {
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < G; ++i) amax = fmaxf(amax, finite_abs(v[i]));
  const float inv = 1.0f / store_group_scale(scales, gi, amax, kind, fmt);
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

// Forward: thread per 16-group of h, grid-stride. Bytes per h element: 2 sizeof(T) read,
// sizeof(T) + 2 (+ scales) written.
template <typename T, GatedAct A>
__global__ void swiglu_fwd_kernel(const T* __restrict__ gu, int64_t rows, int64_t inter, bool vec,
                                  T* __restrict__ h, uint8_t* __restrict__ q, void* __restrict__ scales,
                                  ScaleKind kind, Fp8Format fmt, float* __restrict__ h_amax) {
  const int64_t gpr = inter / G;  // groups of h per row
  const int64_t groups = rows * gpr;
  float hmax = 0.0f;  // over this thread's groups of h, as stored
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < groups;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = t / gpr, j = (t % gpr) * G;
    const int64_t ig = r * 2 * inter + j, iu = ig + inter;
    float g[G], u[G], o[G];
    load16(gu + ig, vec, g);
    load16(gu + iu, vec, u);
#pragma unroll
    for (int i = 0; i < G; ++i) {
      o[i] = round_to<T>(detail::act_value<A>(g[i])) * u[i];
      hmax = fmaxf(hmax, finite_abs(round_to<T>(o[i])));
    }
    store16(h + r * inter + j, vec, o);
    if (q != nullptr) {
      quantize16(q + ig, vec, g, scales, ig / G, kind, fmt);
      quantize16(q + iu, vec, u, scales, iu / G, kind, fmt);
    }
  }
  if (h_amax != nullptr) cuda::block_max_atomic(hmax, h_amax);
}

// Backward: thread per 16-group of dh. Bytes per h element: 2 (+ scales) + sizeof(T) read,
// 2 sizeof(T) (+ sizeof(T) for h) written.
template <typename T, GatedAct A>
__global__ void swiglu_bwd_kernel(const uint8_t* __restrict__ q, const void* __restrict__ scales,
                                  ScaleKind kind, Fp8Format fmt, const T* __restrict__ dh, int64_t rows,
                                  int64_t inter, bool vec, T* __restrict__ dgu, T* __restrict__ h,
                                  float* __restrict__ dgu_amax, float* __restrict__ h_amax) {
  const int64_t gpr = inter / G;
  const int64_t groups = rows * gpr;
  float dmax = 0.0f, hmax = 0.0f;  // over this thread's groups of dgu and h, as stored
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < groups;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = t / gpr, j = (t % gpr) * G;
    const int64_t ig = r * 2 * inter + j, iu = ig + inter;
    float g[G], u[G], d[G], dg[G], du[G];
    decode16(q + ig, vec, fmt, load_group_scale(scales, ig / G, kind), g);
    decode16(q + iu, vec, fmt, load_group_scale(scales, iu / G, kind), u);
    load16(dh + r * inter + j, vec, d);
#pragma unroll
    for (int i = 0; i < G; ++i) {
      const detail::ActGrad a = detail::act_grad<A>(g[i]);
      const float f = round_to<T>(a.f);
      dg[i] = d[i] * u[i] * a.df;
      du[i] = d[i] * f;
      g[i] = f * u[i];  // h, recomputed
      dmax = fmaxf(dmax, fmaxf(finite_abs(round_to<T>(dg[i])), finite_abs(round_to<T>(du[i]))));
      hmax = fmaxf(hmax, finite_abs(round_to<T>(g[i])));
    }
    store16(dgu + ig, vec, dg);
    store16(dgu + iu, vec, du);
    if (h != nullptr) store16(h + r * inter + j, vec, g);
  }
  if (dgu_amax != nullptr) cuda::block_max_atomic(dmax, dgu_amax);
  if (h_amax != nullptr) cuda::block_max_atomic(hmax, h_amax);
}

}  // namespace

void swiglu_fwd(const void* gu, DType dtype, GatedAct act, int64_t rows, int64_t inter, void* h, uint8_t* q,
                void* scales, ScaleKind scale_kind, Fp8Format fmt, float* h_amax, cudaStream_t stream) {
  detail::check_swiglu_fwd(gu, act, rows, inter, h, q, scales);
  const int64_t n = rows * inter;
  if (h_amax != nullptr) COAT_CUDA_CHECK(cudaMemsetAsync(h_amax, 0, sizeof(float), stream));
  if (n == 0) return;
  dispatch2(dtype, act, [&](auto* tt, auto at) {
    using T = std::remove_pointer_t<decltype(tt)>;
    const bool vec = cuda::aligned(gu, 16) && cuda::aligned(h, 16) && (q == nullptr || cuda::aligned(q, 16));
    swiglu_fwd_kernel<T, decltype(at)::value><<<cuda::grid_for(n / G, kThreads), kThreads, 0, stream>>>(
        static_cast<const T*>(gu), rows, inter, vec, static_cast<T*>(h), q, scales, scale_kind, fmt, h_amax);
    COAT_CHECK_LAUNCH();
  });
}

void swiglu_bwd(const uint8_t* q, const void* scales, ScaleKind scale_kind, Fp8Format fmt,
                const void* dh, DType dtype, GatedAct act, int64_t rows, int64_t inter, void* dgu, void* h,
                float* dgu_amax, float* h_amax, cudaStream_t stream) {
  detail::check_swiglu_bwd(q, scales, dh, act, rows, inter, dgu);
  const int64_t n = rows * inter;
  for (float* a : {dgu_amax, h_amax})
    if (a != nullptr) COAT_CUDA_CHECK(cudaMemsetAsync(a, 0, sizeof(float), stream));
  if (n == 0) return;
  dispatch2(dtype, act, [&](auto* tt, auto at) {
    using T = std::remove_pointer_t<decltype(tt)>;
    const bool vec = cuda::aligned(q, 16) && cuda::aligned(dh, 16) && cuda::aligned(dgu, 16) &&
                     (h == nullptr || cuda::aligned(h, 16));
    swiglu_bwd_kernel<T, decltype(at)::value><<<cuda::grid_for(n / G, kThreads), kThreads, 0, stream>>>(
        q, scales, scale_kind, fmt, static_cast<const T*>(dh), rows, inter, vec, static_cast<T*>(dgu),
        static_cast<T*>(h), dgu_amax, h_amax);
    COAT_CHECK_LAUNCH();
  });
}

}  // namespace coat
