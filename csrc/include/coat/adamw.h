// Fused AdamW step with FP8 optimizer states (COAT): m and v stored in the Dynamic Range
// Expansion format of coat/quantize.h (dre_quantize), one launch for many parameter tensors.
//
// Per element, in fp32 (the order of torch.optim.AdamW, decoupled weight decay):
//   g  = grad * (1 / amp_scale) * (1 / clip_scale), negated for maximize   (each when given; see
//        adamw::grad_multiplier: with one of the two scales, exactly grad * (1 / that scale))
//   p  = p * (1 - lr * weight_decay)
//   m  = m + (1 - beta1) (g - m)                 (torch's lerp)
//   v  = v * beta2 + (1 - beta2) g g
//   p  = p - step_size * m / (sqrt(v) * inv_bc2_sqrt + eps)
// with step_size = lr / (1 - beta1^t) and inv_bc2_sqrt = 1 / sqrt(1 - beta2^t) evaluated in fp64
// (beta^t by repeated squaring: identical on host and device) from the tensor's step count t, read
// from device memory *after* the caller has incremented it. The update uses the unquantized new m
// and v (as COAT does); then each group of 128 elements of m and of v is re-encoded with a new gmax
// and exponent k16 (dre_k16; k16 = 16 when expansion is off, i.e. plain per-group FP8 with scale
// gmax / fmt_max), a group with one element far above the rest split as dre_quantize splits it
// (coat/quantize.h). m or v values that are NaN or +-Inf are stored as the NaN code, so a non-finite
// gradient shows up in the state and the parameter (as with torch.optim.AdamW) instead of being
// clamped silently.
//
// Parameters: fp32 (updated in place, no master), or bf16/fp16 with an fp32 master (the master is
// updated and the parameter written from it, round-to-nearest-even), or bf16 without master,
// written with stochastic rounding (kBf16Sr): the fp32 result gets a uniform 16-bit random integer
// added below the bf16 mantissa before truncation, so E[bf16(x)] = x. The random bits are a
// counter-based hash of (seed, t, element index / 4): the CPU reference and the kernel round
// identically, and a resumed run (same seed, same t) continues bit-identically.
//
// Everything is deterministic (no atomics; a resumed run continues bit-identically). The CPU
// reference (coat::ref::adamw_step) and the kernel run the same formulas in the same order, but the
// kernel takes log2/exp2, the square root and the reciprocal from the hardware's approximations
// (the step is bound by instruction issue otherwise): the two agree to a few ulp in the fp32
// values, and an FP8 code differs by one step only where a value sits on a rounding boundary.
#pragma once

#include <cstdint>

#include "coat/common.h"
#include "coat/quantize.h"

namespace coat {

// How the updated fp32 value reaches the parameter.
enum class MasterKind : int {
  kNone = 0,    // fp32 parameter, updated in place
  kFp32 = 1,    // bf16/fp16 parameter plus an fp32 master copy
  kBf16Sr = 2,  // bf16 parameter, no master, stochastic rounding
};

// One parameter tensor (or the local shard of one): 16 64-bit words, the layout Python builds
// (coat/optim/_kernel.py). All pointers live on the device of the step (host memory for the CPU
// reference). State buffers hold ceil(numel / 128) groups; groups never straddle tensors.
struct AdamwTensor {
  void* param;          // numel elements of the parameter dtype
  const void* grad;     // numel elements of the gradient dtype
  float* master;        // numel fp32 (kFp32), else null
  uint8_t* m_q;         // numel FP8 codes of m
  float* m_gmax;        // per group: largest |m| (a split group's word: coat/quantize.h)
  uint8_t* m_k16;       // per group: 16 k
  uint8_t* v_q;
  float* v_gmax;
  uint8_t* v_k16;
  const float* step;    // the tensor's step count t >= 1 (a float32 scalar, as torch keeps it)
  int64_t numel;        // > 0
  int64_t group_begin;  // index of this tensor's first group in the launch (prefix sum)
  uint64_t seed;        // stochastic-rounding seed (kBf16Sr)
  // Null, or one fp32 the caller zeroed: the step max-folds into it the largest finite |value| of
  // the parameter it writes (as stored, after rounding), so that the next FP8 quantization of the
  // weight needs no amax pass (coat/nn/weights.py, quantize.h quantize_stacked_from_part_amax).
  float* param_amax;
  int64_t reserved[2];  // zero
};
static_assert(sizeof(AdamwTensor) == 16 * 8, "AdamwTensor is 16 words: Python builds it");

// Hyperparameters and dtypes shared by all tensors of one launch (one parameter group and one
// (param, grad, master) combination).
struct AdamwConfig {
  // fp64 as Python passes them; the per-step scalars are derived in fp64, then rounded to fp32.
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  const float* lr_tensor = nullptr;   // when set, *lr_tensor replaces lr (read on the device)
  // What the gradients are multiplied by, three separate things (adamw::grad_multiplier):
  const float* amp_scale = nullptr;   // GradScaler's scale: gradients * (1 / *amp_scale)
  const float* clip_scale = nullptr;  // gradient clipping (release's): gradients * (1 / *clip_scale)
  bool maximize = false;              // ascend: gradients negated
  const float* found_inf = nullptr;   // when set and non-zero, nothing is written at all
  DType param_dtype = DType::kFloat32;
  DType grad_dtype = DType::kFloat32;
  MasterKind master = MasterKind::kNone;
  Fp8Format m_fmt = Fp8Format::kE4M3;
  Fp8Format v_fmt = Fp8Format::kE4M3;
  bool expansion = true;
  float m_log2_range = kDreLog2RangeE4M3;
  float v_log2_range = kDreLog2RangeE4M3;
  int cpu_threads = 1;  // CPU reference only: worker threads for large steps
};

// One AdamW step over n_tensors descriptors (device memory) covering n_groups groups in total
// (the last tensor's group_begin + its group count). No host synchronisation; CUDA-graph
// capturable. Rejects configurations that are not listed under MasterKind.
void adamw_step(const AdamwTensor* tensors, int64_t n_tensors, int64_t n_groups,
                const AdamwConfig& cfg, cudaStream_t stream);

namespace ref {
// Same, on host memory. Checks the descriptors (group prefix, null pointers) before writing.
void adamw_step(const AdamwTensor* tensors, int64_t n_tensors, int64_t n_groups,
                const AdamwConfig& cfg);
}  // namespace ref

}  // namespace coat
