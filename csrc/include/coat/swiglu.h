// Gated activations, h = act(gate) * up (SwiGLU for act = silu, GeGLU for the tanh-approximated
// GELU), over the output of a fused gate/up projection, with the pre-activations saved in FP8 for
// backward (COAT precision flow).
//
// Layout: gu is [rows, 2 * inter], gate in columns [0, inter), up in [inter, 2 * inter) (one GEMM
// over the concatenated weights [W_gate; W_up] produces it). h and dh are [rows, inter]; dgu has
// gu's layout, so the fused gate/up backward is one GEMM.
//
// Numerics (T = the activation dtype, all math in fp32):
// - forward: h = T(T(act(g)) * u): the rounding of Hugging Face's act_fn(gate) * up in T, with
//     kSilu:     act(g) = g * s, s = 1 / (1 + exp(-g))  (torch.nn.functional.silu)
//     kGeluTanh: act(g) = 0.5 g (1 + t), t = tanh(k0 (g + 0.044715 g^3)), k0 = sqrt(2 / pi)
//                (torch.nn.functional.gelu(g, approximate="tanh"): transformers' "gelu_pytorch_tanh")
//   exp and tanh differ between the host libm and CUDA by an ulp or so, so h from the CPU and the
//   GPU can differ in the last bit of T (in absolute terms a little more where 1 + t cancels, g < -3,
//   and act(g) is tiny). Where g^3 overflows fp32, t = +-1 exactly, as in torch: act(g) = g or -0.
// - saved: gu in FP8 with one scale per 1 x 16 group, bit-identical to quantize_per_group(gu, 16);
//   it does not depend on the activation.
// - backward, from the FP8 copy (g~, u~): dg = dh * u~ * act'(g~), du = dh * T(act(g~)), with
//     kSilu:     act'(g) = s (1 + g (1 - s))
//     kGeluTanh: act'(g) = 0.5 (1 + t) + 0.5 g (1 - t^2) k0 (1 + 3 * 0.044715 g^2), the second term
//                taken as 0 where tanh saturates (1 - t^2 == 0), so that a g whose square overflows
//                fp32 gets the limit (1 or 0), not 0 * inf.
//   Optionally h = T(T(act(g~)) * u~) is recomputed for the down projection's weight gradient in
//   the same pass. NaN in g or u propagates to h and to both gradients.
// - inter must be a multiple of 16 (groups never straddle gate and up); the Python layer keeps a
//   plain BF16 SwiGLU for other widths. Rows may be 0. Pointers need no particular alignment.
// - Group scaling (COAT's just-in-time scaling): h_amax / dgu_amax, when not null, receive max |.|
//   over the finite values of h / dgu as stored (in their dtype), found in the pass that writes
//   them (each thread's 16-element group maxima reduce to one atomicMax per thread block), bit for
//   bit the amax quantize_per_tensor_amax would find by re-reading them. They feed
//   quantize_stacked_from_amax (coat/quantize.h): no amax pass over h or dgu.
#pragma once

#include <cstdint>

#include "coat/common.h"

namespace coat {

constexpr int kSwigluGroup = 16;

// The activation of the gate (see Numerics above).
enum class GatedAct : int { kSilu = 0, kGeluTanh = 1 };

// h [rows, inter] (dtype); q [rows, 2 inter] codes and scales [rows, 2 inter / 16] when q is not
// null; h_amax [1] when not null.
void swiglu_fwd(const void* gu, DType dtype, GatedAct act, int64_t rows, int64_t inter, void* h, uint8_t* q,
                void* scales, ScaleKind scale_kind, Fp8Format fmt, float* h_amax, cudaStream_t stream);

// dgu [rows, 2 inter] and (when not null) h [rows, inter], both in dh's dtype; dgu_amax and h_amax
// [1] when not null (h_amax is 0 without h).
void swiglu_bwd(const uint8_t* q, const void* scales, ScaleKind scale_kind, Fp8Format fmt,
                const void* dh, DType dtype, GatedAct act, int64_t rows, int64_t inter, void* dgu, void* h,
                float* dgu_amax, float* h_amax, cudaStream_t stream);

namespace ref {
void swiglu_fwd(const void* gu, DType dtype, GatedAct act, int64_t rows, int64_t inter, void* h, uint8_t* q,
                void* scales, ScaleKind scale_kind, Fp8Format fmt, float* h_amax = nullptr);
void swiglu_bwd(const uint8_t* q, const void* scales, ScaleKind scale_kind, Fp8Format fmt,
                const void* dh, DType dtype, GatedAct act, int64_t rows, int64_t inter, void* dgu, void* h,
                float* dgu_amax = nullptr, float* h_amax = nullptr);
}  // namespace ref

}  // namespace coat
