// SwiGLU, h = silu(gate) * up, over the output of a fused gate/up projection, with the
// pre-activations saved in FP8 for backward (COAT precision flow).
//
// Layout: gu is [rows, 2 * inter], gate in columns [0, inter), up in [inter, 2 * inter) (one GEMM
// over the concatenated weights [W_gate; W_up] produces it). h and dh are [rows, inter]; dgu has
// gu's layout, so the fused gate/up backward is one GEMM.
//
// Numerics (T = the activation dtype, sigmoid and exp in fp32):
// - forward: h = T(T(silu(g)) * u), silu(g) = g / (1 + exp(-g)): the rounding of Hugging Face's
//   act_fn(gate) * up in T. exp differs between the host libm and CUDA's expf by at most an ulp, so
//   h from the CPU and the GPU can differ in the last bit of T.
// - saved: gu in FP8 with one scale per 1 x 16 group, bit-identical to quantize_per_group(gu, 16).
// - backward, from the FP8 copy (g~, u~): s = sigmoid(g~), dg = dh * u~ * s * (1 + g~ (1 - s)),
//   du = dh * T(silu(g~)); optionally h = T(T(silu(g~)) * u~) recomputed for the down projection's
//   weight gradient in the same pass.
// - inter must be a multiple of 16 (groups never straddle gate and up); the Python layer keeps a
//   plain BF16 SwiGLU for other widths. Rows may be 0. Pointers need no particular alignment.
#pragma once

#include <cstdint>

#include "coat/common.h"

namespace coat {

constexpr int kSwigluGroup = 16;

// h [rows, inter] (dtype); q [rows, 2 inter] codes and scales [rows, 2 inter / 16] when q is not null.
void swiglu_fwd(const void* gu, DType dtype, int64_t rows, int64_t inter, void* h, uint8_t* q,
                void* scales, ScaleKind scale_kind, Fp8Format fmt, cudaStream_t stream);

// dgu [rows, 2 inter] and (when not null) h [rows, inter], both in dh's dtype.
void swiglu_bwd(const uint8_t* q, const void* scales, ScaleKind scale_kind, Fp8Format fmt,
                const void* dh, DType dtype, int64_t rows, int64_t inter, void* dgu, void* h,
                cudaStream_t stream);

namespace ref {
void swiglu_fwd(const void* gu, DType dtype, int64_t rows, int64_t inter, void* h, uint8_t* q,
                void* scales, ScaleKind scale_kind, Fp8Format fmt);
void swiglu_bwd(const uint8_t* q, const void* scales, ScaleKind scale_kind, Fp8Format fmt,
                const void* dh, DType dtype, int64_t rows, int64_t inter, void* dgu, void* h);
}  // namespace ref

}  // namespace coat
