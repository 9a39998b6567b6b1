// The bodies of the op bindings at the View level: each checks its arguments (messages name them
// as Python does), creates its outputs on the input's device and runs the core on `stream` (or its
// CPU reference). The single-op bindings (quantize.cpp, gemm.cpp, norm.cpp, swiglu.cpp) wrap them
// for Python one by one; block.cpp chains them into one call per layer block. One body per op: a
// block runs exactly what the single ops run, in the same order.
#pragma once

#include <vector>

#include "coat/common.h"
#include "coat/gemm.h"
#include "coat/norm.h"
#include "coat/quantize.h"
#include "coat/swiglu.h"
#include "tensor_args.h"

namespace coat {
namespace bind {

// ---- quantize ------------------------------------------------------------------------------------

// Per-tensor FP8 of x seen as [rows, cols], its scale from max |x| on the device. q_t ([cols, rows])
// is made only with `transpose` (outputs not asked for are not made: the Python-facing wrappers
// return empty [0] tensors in their place).
// With `amax` (the one its producer wrote: group scaling), no amax pass is run and amax is not made.
struct PerTensorFp8 {
  Created q, q_t, scale, amax;
};
PerTensorFp8 quantize_amax(const View& x, Fp8Format fmt, bool transpose, cudaStream_t stream,
                           const View* amax = nullptr);

// Per-tensor FP8 of the stacked row blocks `parts` (float dtypes) with the given scale, or (scale
// null) with its scale from their max |.|. q [R, cols] / q_t [cols, R] are made only when asked
// for; scale (created) and amax only when no scale was given.
struct StackedFp8 {
  Created q, q_t, scale, amax;
};
std::vector<View> views_of_parts(const std::vector<Array>& parts);
StackedFp8 quantize_stacked(const std::vector<View>& parts, const View* scale, Fp8Format fmt, bool rowmajor,
                            bool transpose, cudaStream_t stream);
// Row-major codes and scale of the stacked parts with the scale of the max of part_amax (one fp32
// [1] per part, the optimizer's; quantize.h quantize_stacked_from_part_amax): no amax pass.
StackedFp8 quantize_stacked_part_amax(const std::vector<View>& parts, const std::vector<View>& part_amax,
                                      Fp8Format fmt, cudaStream_t stream);

// Scaled (row / block) FP8 of the stacked row blocks `parts` (float dtypes) as a GEMM operand
// [rows_pad, cols_pad] in `mode` and/or its transpose in `mode_t` (quantize.h quantize_scaled):
// q / scale made with make_q, q_t / scale_t with make_qt.
struct ScaledFp8 {
  Created q, scale, q_t, scale_t;
};
ScaledFp8 quantize_scaled(const std::vector<View>& parts, int64_t rows_pad, int64_t cols_pad, Fp8Format fmt,
                          ScaleMode mode, ScaleMode mode_t, bool make_q, bool make_qt, cudaStream_t stream);
// The padded extent of a scaled operand's dimension: a multiple of 16 on CUDA (cuBLASLt's FP8
// alignment of K and N, and of the tokens with row or block scales), as is on the CPU.
inline int64_t scaled_pad(int64_t n, bool cuda) { return cuda ? (n + 15) / 16 * 16 : n; }

// ---- gemm ----------------------------------------------------------------------------------------

struct GemmOptions {
  const View* bias = nullptr;
  const View* out_scale = nullptr;  // FP8 output only
  bool want_amax = false;
  const View* workspace = nullptr;  // cuBLASLt's, required on CUDA
  bool force_bf16 = false;
  bool fast_accum = false;
  ScaleMode a_mode = ScaleMode::kTensor, b_mode = ScaleMode::kTensor;  // gemm_fp8's operands
};
struct GemmResult {
  Created out, amax;  // amax only with want_amax
};
// out [M, N] = (a * scale_a) @ (b * scale_b).T for FP8 codes a [M, K] and b [N, K].
GemmResult gemm_fp8(const View& a, Fp8Format a_fmt, const View& scale_a, const View& b, Fp8Format b_fmt,
                    const View& scale_b, GemmOut out_type, const GemmOptions& opt, cudaStream_t stream);
GemmOut gemm_out_type(int t);
// The GEMM of a layer block, for every shape and float output dtype: on CUDA, K and N are
// zero-padded to multiples of 16 where cuBLASLt FP8 needs it (zero codes add nothing to the sums)
// and the result sliced back; a float16 result is the fp32 one rounded once (coat's GEMM writes
// fp32 and bf16). On the CPU the reference takes every shape as it is.
Created gemm_fp8_any(const View& a, Fp8Format a_fmt, const View& scale_a, const View& b, Fp8Format b_fmt,
                     const View& scale_b, DType out, const GemmOptions& opt, cudaStream_t stream);

// An FP8 GEMM operand: codes [rows, K], their format, and the scales of their mode.
struct Fp8Operand {
  View q, scale;
  ScaleMode mode = ScaleMode::kTensor;
  Fp8Format fmt = Fp8Format::kE4M3;
};
// out [m, n] = a @ b.T: per tensor as gemm_fp8_any; row/block operands come padded (a [>= m, K],
// b [>= n, K], from quantize_scaled) and the result is cut to [m, n].
Created gemm_scaled(const Fp8Operand& a, const Fp8Operand& b, int64_t m, int64_t n, DType out, const GemmOptions& opt,
                    cudaStream_t stream);

// ---- norm ----------------------------------------------------------------------------------------

// want_amax (group scaling): also y's amax [1] from the pass that writes y (coat/norm.h).
struct NormFwd {
  Created y, rstd, amax;
  Fp8Output saved;  // x's FP8 copy in 1 x 16 groups (empty unless asked for)
};
// The norm kind for its id from Python (coat/_ops/enums.py NORM_KINDS).
NormKind norm_kind_arg(int k);
NormFwd rmsnorm_fwd(const View& x, const View& w, NormKind kind, float eps, bool quantize, Fp8Format fmt, bool e8m0,
                    cudaStream_t stream, bool want_amax = false);
// y recomputed from the saved FP8 input (q, scales, rstd) as `dtype`; with y_amax, y's amax too.
Created rmsnorm_fwd_fp8(const View& q, const View& scales, const View& rstd, const View& w, NormKind kind,
                        DType dtype, Fp8Format fmt, cudaStream_t stream, Created* y_amax = nullptr);
struct NormBwd {
  Created dx, dw;  // dx in dy's dtype, dw fp32
};
NormBwd rmsnorm_bwd(const View& q, const View& scales, const View& rstd, const View& w, NormKind kind,
                    const View& dy, Fp8Format fmt, cudaStream_t stream);

// ---- swiglu --------------------------------------------------------------------------------------

// want_amax (group scaling): also the amax [1] of h (forward), of dgu and of the recomputed h
// (backward), each from the pass that writes it (coat/swiglu.h).
struct SwigluFwd {
  Created h, amax;
  Fp8Output saved;  // gate_up's FP8 copy in 1 x 16 groups (empty unless asked for)
};
// The gate's activation for its id from Python (coat/_ops/enums.py GATED_ACTS).
GatedAct gated_act_arg(int a);
SwigluFwd swiglu_fwd(const View& gate_up, GatedAct act, bool quantize, Fp8Format fmt, bool e8m0,
                     cudaStream_t stream, bool want_amax = false);
struct SwigluBwd {
  Created dgu, h, dgu_amax, h_amax;  // h (and h_amax) empty unless recompute_h
};
SwigluBwd swiglu_bwd(const View& q, const View& scales, const View& dh, GatedAct act, bool recompute_h,
                     Fp8Format fmt, cudaStream_t stream, bool want_amax = false);

}  // namespace bind
}  // namespace coat
