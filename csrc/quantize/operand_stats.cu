// coat/operand_stats.h on the GPU: one grid-stride pass, counts reduced per warp then added with
// 64-bit atomics, amax with an integer atomicMax on the float bits (|x| >= 0; NaN's bits 0x7fc00000
// exceed +inf's, so a NaN wins as torch.maximum's does).
#include <cuda_runtime.h>

#include "coat/operand_stats.h"
#include "common/cuda_utils.cuh"
#include "common/fp8.h"

namespace coat {
namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kThreads) operand_stats_kernel(const T* __restrict__ x, int64_t n,
                                                                 const float* __restrict__ scale, float half_sub,
                                                                 float clip, unsigned long long* counts, int* amax) {
  const float inv = 1.0f / __ldg(scale);
  unsigned long long nonzero = 0, under = 0, sat = 0;
  int m = 0;  // the bits of the largest |x| (non-negative floats order as their bits)
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float v = Elem<T>::load(x[i]);
    const float mag = fabsf(v);
    const float a = __fmul_rn(mag, inv);
    const bool nz = v != 0.0f;
    nonzero += nz;
    under += nz && a <= half_sub;
    sat += a >= clip;
    m = max(m, isnan(mag) ? 0x7fc00000 : __float_as_int(mag));
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    nonzero += __shfl_down_sync(0xffffffffu, nonzero, off);
    under += __shfl_down_sync(0xffffffffu, under, off);
    sat += __shfl_down_sync(0xffffffffu, sat, off);
    m = max(m, __shfl_down_sync(0xffffffffu, m, off));
  }
  if ((threadIdx.x & 31) == 0) {
    if (nonzero) atomicAdd(counts + 0, nonzero);
    if (under) atomicAdd(counts + 1, under);
    if (sat) atomicAdd(counts + 2, sat);
    atomicMax(amax, m);
  }
}

}  // namespace

void fp8_operand_stats(const void* x, DType dtype, int64_t n, const float* scale, float half_sub, float clip,
                       int64_t* counts, float* amax, cudaStream_t stream) {
  if (n <= 0) return;
  static_assert(sizeof(unsigned long long) == sizeof(int64_t), "64-bit counters");
  cuda::dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    operand_stats_kernel<T><<<cuda::grid_for(n, kThreads), kThreads, 0, stream>>>(
        static_cast<const T*>(x), n, scale, half_sub, clip, reinterpret_cast<unsigned long long*>(counts),
        reinterpret_cast<int*>(amax));
    COAT_CHECK_LAUNCH();
  });
}

}  // namespace coat
