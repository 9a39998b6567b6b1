// CUDA kernel of cross_entropy_rows: one block per row (grid-stride over rows). Pass 1 reads the row
// once for the target, the max and the base-2 sum (online: each thread keeps its own max and a sum
// relative to it, rescaled when the max grows; 8-element chunks of 16-byte loads), then a block
// reduction merges the (max, sum) pairs. Pass 2 (grad) reads the row again, mostly from L2, and
// writes the gradient over it. Bytes: 2 reads + 1 write of the row (1 read without grad).
#include <cmath>

#include "common/cuda_utils.cuh"
#include "loss_args.h"

namespace coat {
namespace {

using cuda::dispatch_dtype;
using cuda::grid_for;

constexpr int kThreads = 512;
constexpr float kNegInf = -INFINITY;

struct Acc {
  float m = kNegInf;  // max of x log2 e
  float s = 0.0f;     // sum of exp2(x log2 e - m)
  bool nan = false;
};

__device__ __forceinline__ void merge(Acc& a, float m, float s, bool nan) {
  a.nan = a.nan || nan;
  if (m == kNegInf) return;
  if (m > a.m) {
    a.s = a.s * exp2f(a.m - m) + s;  // exp2f(-inf) = 0 when a is empty
    a.m = m;
  } else {
    a.s += s * exp2f(m - a.m);
  }
}

// Every lane of the warp ends with the warp's merged (max, sum, nan).
__device__ __forceinline__ void warp_merge(Acc& a) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m = __shfl_xor_sync(0xffffffffu, a.m, o), s = __shfl_xor_sync(0xffffffffu, a.s, o);
    const bool n = __shfl_xor_sync(0xffffffffu, static_cast<int>(a.nan), o) != 0;
    merge(a, m, s, n);
  }
}

template <int N>
__device__ __forceinline__ void add(Acc& a, const float (&v)[N]) {
  float cm = kNegInf;
  bool nan = false;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    cm = fmaxf(cm, v[i] * detail::kLog2e);
    nan = nan || v[i] != v[i];
  }
  float cs = 0.0f;
  if (cm != kNegInf) {
#pragma unroll
    for (int i = 0; i < N; ++i) cs += exp2f(v[i] * detail::kLog2e - cm);
  }
  merge(a, cm, cs, nan);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) cross_entropy_kernel(T* logits, int64_t rows, int64_t vocab, bool vec,
                                                                 const int64_t* __restrict__ labels,
                                                                 const float* inv, bool grad, float* lse_out,
                                                                 float* target_out) {
  __shared__ float sm_m[kThreads / 32], sm_s[kThreads / 32];
  __shared__ int sm_nan[kThreads / 32];
  __shared__ float row_lse2;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const float scale = grad ? *inv : 0.0f;
  const int64_t chunks = vec ? vocab / 8 : 0;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    T* x = logits + r * vocab;
    const int64_t label = labels[r];
    if (tid == 0) target_out[r] = label >= 0 && label < vocab ? Elem<T>::load(x[label]) : 0.0f;
    Acc a;
    for (int64_t c = tid; c < chunks; c += kThreads) {
      float v[8];
      cuda::load8(x + c * 8, v);
      add(a, v);
    }
    for (int64_t j = chunks * 8 + tid; j < vocab; j += kThreads) {
      const float v[1] = {Elem<T>::load(x[j])};
      add(a, v);
    }
    // Block reduction of (m, s, nan): warps by shuffles, then warp 0 over the warps' results.
    warp_merge(a);
    if (lane == 0) {
      sm_m[warp] = a.m;
      sm_s[warp] = a.s;
      sm_nan[warp] = a.nan;
    }
    __syncthreads();
    if (warp == 0) {
      Acc b;
      if (lane < kThreads / 32) {
        b.m = sm_m[lane];
        b.s = sm_s[lane];
        b.nan = sm_nan[lane] != 0;
      }
      warp_merge(b);
      if (lane == 0) {
        const float lse2 = b.nan ? NAN : b.m + log2f(b.s);
        row_lse2 = lse2;
        lse_out[r] = lse2 * detail::kLn2;
      }
    }
    __syncthreads();
    if (grad) {
      const float lse2 = row_lse2;
      const bool valid = label >= 0;
      for (int64_t c = tid; c < chunks; c += kThreads) {
        float v[8];
        cuda::load8(x + c * 8, v);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int64_t j = c * 8 + i;
          v[i] = valid ? exp2f(v[i] * detail::kLog2e - lse2) * scale - (j == label ? scale : 0.0f) : 0.0f;
        }
        cuda::store8(x + c * 8, v);
      }
      for (int64_t j = chunks * 8 + tid; j < vocab; j += kThreads) {
        const float v = Elem<T>::load(x[j]);
        x[j] = Elem<T>::store(valid ? exp2f(v * detail::kLog2e - lse2) * scale - (j == label ? scale : 0.0f) : 0.0f);
      }
    }
    __syncthreads();  // the shared results are reused by the next row
  }
}

}  // namespace

void cross_entropy_rows(void* logits, DType dtype, int64_t rows, int64_t vocab, const int64_t* labels,
                        const float* inv, bool grad, float* lse, float* target, cudaStream_t stream) {
  detail::check_cross_entropy(logits, rows, vocab, labels, inv, grad, lse, target);
  if (rows == 0) return;
  dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* x = static_cast<T*>(logits);
    const bool vec = cuda::aligned(x, 16) && (vocab * static_cast<int64_t>(sizeof(T))) % 16 == 0;
    cross_entropy_kernel<T><<<grid_for(rows, 1, 4), kThreads, 0, stream>>>(x, rows, vocab, vec, labels, inv, grad,
                                                                          lse, target);
    COAT_CHECK_LAUNCH();
  });
}

}  // namespace coat
