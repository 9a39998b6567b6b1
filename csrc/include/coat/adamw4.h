// Fused AdamW step with 4-bit optimizer states ("Memory Efficient Optimizers with 4-bit States",
// Li, Chen, Zhu, NeurIPS 2023), one launch for many parameter tensors.
//
// States of one tensor, by kind (Adamw4Kind, chosen by coat/optim/adamw4bit.py):
//   kFull:   m and v in fp32 (tensors of <= 4096 elements: their states cost little, and 4 bits would
//            cost them most accuracy).
//   kBlock:  m and v as 4-bit codes, two per byte (element 2i in the low nibble of byte i), in blocks
//            of 128 consecutive elements with one fp32 absmax per block and moment.
//   kRank1:  m as in kBlock; v as 4-bit codes scaled per element by min(row max, column max) of the
//            tensor viewed as rows x cols (rank-1 normalization). The maxima are double-buffered:
//            v_scale holds [2][rows + cols] floats; step t decodes with buffer (t - 1) % 2 (what step
//            t - 1 wrote) and writes the new maxima into buffer t % 2.
//
// Maps (normalized value -> code -> value; adamw4_math.h holds the tables):
//   m: the signed dynamic-exponent map of the paper: 0, +-0.0055, +-0.0325, +-0.0775, +-0.2125,
//      +-0.4375, +-0.6625, +-0.8875 and +1 (16 values; -1 is not representable: the most negative
//      value of a block decodes as -0.8875 absmax, as in the paper's map).
//   v: linear without zero, T(i) = (i + 1) / 16: a non-zero v never decodes to 0, so a step never
//      divides an m by eps alone (the paper's zero-point problem). A v decodes to 0 only where its
//      scale is 0, i.e. where its whole block (row or column) is 0.
// Encoding rounds the normalized value x = value * (1 / scale) (two correctly rounded operations)
// to the nearest map value (ties up), by comparison against fp32 midpoints. A scale that is 0,
// subnormal or NaN encodes every element of its block (row, column) as m's zero code, v's code 0.
//
// Per element, in fp32 IEEE arithmetic (torch.optim.AdamW's order, decoupled weight decay):
//   g = grad * adamw::grad_multiplier(cfg); p = p (1 - lr wd); m = m + (1 - b1)(g - m); v = v b2 + ((1 - b2) g) g
//   p = p - step_size * (m / (sqrt(v) inv_bc2_sqrt + eps))
// with the scalars of coat/adamw.h (adamw::make_scalars). The update uses the unquantized new m and
// v, which are then encoded with the new block absmax (m; v of kBlock) or the new row / column
// maxima (v of kRank1). The kernel computes those maxima in a first pass over the gradients and the
// old v codes (v's update needs nothing else), with atomic max on the bits of non-negative floats,
// then runs the step in a second pass: no fp32 copy of v exists at any time.
//
// The update is coat/adamw.h's (adamw::update): the CPU reference computes it in IEEE arithmetic,
// the CUDA kernel with fma, flushed subnormals and the hardware's square root, division and
// reciprocal (the encoders'), as the FP8 step does. They agree to a few fp32 ulp, and a code may
// sit one step away where its normalized moment lies on a midpoint (tests/cpp/test_adamw4_gpu.cpp).
//
// Non-finite moments: 4-bit codes have no NaN. A NaN or +-Inf moment (from a non-finite gradient)
// sets its block's scale (m, kBlock v) or its row's and column's maxima (kRank1 v) to NaN, so the
// whole block (row and column) decodes to NaN at the next step; the element's own parameter is
// non-finite already at this step (the update uses the unquantized moments). kFull states keep the
// non-finite values themselves. Never silently clamped; coat.optim's nonfinite="raise" refuses
// before anything is written.
//
// Parameters: as coat/adamw.h (MasterKind): fp32 in place, bf16/fp16 with an fp32 master, or bf16
// with stochastic rounding (the same random bits as coat::adamw_step for the same seed, t and index).
#pragma once

#include <cstdint>

#include "coat/adamw.h"
#include "coat/common.h"

namespace coat {

enum class Adamw4Kind : int64_t { kFull = 0, kBlock = 1, kRank1 = 2 };

constexpr int kAdamw4Block = 128;     // elements per absmax block and per work group
constexpr int64_t kAdamw4MinNumel = 4097;  // smaller tensors keep fp32 states (kFull)

// One parameter tensor: 16 64-bit words (coat/optim/adamw4bit.py builds them).
struct Adamw4Tensor {
  void* param;          // numel elements of the parameter dtype
  const void* grad;     // numel elements of the gradient dtype
  float* master;        // numel fp32 (kFp32), else null
  void* m;              // kFull: numel fp32; else ceil(numel / 2) bytes of codes
  float* m_scale;       // kBlock / kRank1: ceil(numel / 128) absmax; kFull: null
  void* v;              // as m
  float* v_scale;       // kBlock: ceil(numel / 128) absmax; kRank1: [2][rows + cols]; kFull: null
  const float* step;    // step count t >= 1 (float32 scalar, incremented by the caller)
  int64_t numel;        // > 0
  int64_t group_begin;  // index of this tensor's first group of 128 in the launch
  uint64_t seed;        // stochastic-rounding seed (kBf16Sr)
  Adamw4Kind kind;
  int64_t rows, cols;   // kRank1: rows * cols == numel; else 0
  float* param_amax;    // null, or as AdamwTensor::param_amax (coat/adamw.h)
  int64_t reserved;     // zero
};
static_assert(sizeof(Adamw4Tensor) == 16 * 8, "Adamw4Tensor is 16 words: Python builds it");

// One step over n_tensors descriptors (device memory) covering n_groups groups of 128 elements.
// Reads of cfg: lr, lr_tensor, beta1, beta2, eps, weight_decay, amp_scale, clip_scale, maximize, found_inf, param_dtype,
// grad_dtype, master, cpu_threads (the FP8 fields are not used). Three launches on `stream` (clear
// the new rank-1 maxima, compute them, step); no host synchronisation; CUDA-graph capturable.
void adamw4_step(const Adamw4Tensor* tensors, int64_t n_tensors, int64_t n_groups, const AdamwConfig& cfg,
                 cudaStream_t stream);

namespace ref {
// Same, on host memory. Checks every descriptor before writing anything.
void adamw4_step(const Adamw4Tensor* tensors, int64_t n_tensors, int64_t n_groups, const AdamwConfig& cfg);
}  // namespace ref

}  // namespace coat
