// One binding call per FP8 layer block (coat/nn/fused.py, coat/nn/mlp.py): the forward or the
// backward of [pre-op ->] per-tensor quantize -> FP8 GEMM, chained here so that a block costs the
// host one Python call instead of four (forward) to seven (backward). Each step is the single op's
// own body (ops.h), in the single-op path's order, and every intermediate dies no later than it
// does there: the results are bit-identical to that path (tests/python/test_block.py) and the
// memory plan is unchanged.
//
// The pre-op of a block (`pre`):
//   0 none:   the GEMM input is x itself; forward saves its transposed FP8 codes and scale for dW.
//   1 norm:   RMSNorm of x (FP8 saved input, 1 x 16 groups, and rstd), recomputed in backward;
//             `norm_kind` (coat::NormKind) says how its weight applies.
//   2 swiglu: act(gate) * up of a fused gate/up x (FP8 saved input, 1 x 16 groups); `act`
//             (coat::GatedAct) is the gate's activation.
// norm_kind and act default to the Llama kinds (scaled weight, SiLU); each is checked on every call
// and read only by the pre-op it belongs to.
// The weights are the separate row blocks of the projection (q/k/v, gate/up, or one), quantized
// afresh in each direction (coat/nn/weights.py's default lifetime).
#include <nanobind/stl/vector.h>

#include "enums.h"
#include "ops.h"
#include "registry.h"
#include "tensor_args.h"

namespace coat {
namespace bind {
namespace {

using nb::arg;

constexpr Fp8Format kAct = Fp8Format::kE4M3;   // activations and weights (coat.nn.recipe.ACT_DTYPE)
constexpr Fp8Format kGrad = Fp8Format::kE5M2;  // output gradients (GRAD_DTYPE)

enum class Pre : int { kNone = 0, kNorm = 1, kSwiglu = 2 };

Pre pre_arg(int p) {
  COAT_CHECK_ARG(p >= 0 && p <= 2, "pre must be 0 (none), 1 (norm) or 2 (swiglu), got " + std::to_string(p));
  return static_cast<Pre>(p);
}

nb::object or_none(const Created& c) { return c.tensor.is_valid() ? c.tensor : nb::none(); }

// (out [M, N], w_scale, s0, s1, s2): s = (x's FP8 codes, their group scales, rstd) with a norm,
// (codes, scales, None) with swiglu, (x's transposed codes or None, x's scale, None) without.
// save_input_t: without a pre-op, whether dW will need x (a weight trains).
nb::tuple block_fwd_py(const Array& x_, int pre_, std::optional<Array> norm_w_, float eps, bool e8m0,
                       const std::vector<Array>& weights_, bool save_input_t, int out_type, bool fast_accum,
                       const Array& workspace_, bool force_bf16, uintptr_t stream_, int norm_kind_, int act_) {
  const Pre pre = pre_arg(pre_);
  const NormKind norm_kind = norm_kind_arg(norm_kind_);
  const GatedAct act = gated_act_arg(act_);
  const View x = view_of(x_, "x");
  expect_2d(x);
  const View ws = view_of(workspace_, "workspace");
  const std::vector<View> weights = views_of_parts(weights_);
  const cudaStream_t stream = stream_of(stream_);
  const int64_t k = pre == Pre::kSwiglu ? x.last_dim() / 2 : x.last_dim();  // the GEMM's K
  COAT_CHECK_ARG(weights[0].shape.size() == 2 && weights[0].shape[1] == k,
                 "weights[0] has shape " + shape_str(weights[0].shape) + " but the GEMM input has K = " +
                     std::to_string(k) + " columns");
  GemmOptions opt;
  opt.workspace = &ws;
  opt.force_bf16 = force_bf16;
  opt.fast_accum = fast_accum;

  Created y, s0, s1, s2;  // the GEMM input in x's dtype (with a pre-op) and what is saved
  if (pre == Pre::kNorm) {
    COAT_CHECK_ARG(norm_w_.has_value(), "norm_weight is required with pre=1 (norm)");
    NormFwd n = rmsnorm_fwd(x, view_of(*norm_w_, "norm_weight"), norm_kind, eps, true, kAct, e8m0, stream);
    y = std::move(n.y);
    s0 = std::move(n.saved.q), s1 = std::move(n.saved.scales), s2 = std::move(n.rstd);
  } else if (pre == Pre::kSwiglu) {
    SwigluFwd sw = swiglu_fwd(x, act, true, kAct, e8m0, stream);
    y = std::move(sw.h);
    s0 = std::move(sw.saved.q), s1 = std::move(sw.saved.scales);
  }
  const View& in = pre == Pre::kNone ? x : y.view;
  PerTensorFp8 q = quantize_amax(in, kAct, pre == Pre::kNone && save_input_t, stream);
  y = Created();  // not needed after its quantization: freed before the weights' codes are made
  if (pre == Pre::kNone) s0 = std::move(q.q_t), s1 = q.scale;
  StackedFp8 w = quantize_stacked(weights, nullptr, kAct, true, false, stream);
  GemmResult out = gemm_fp8(q.q.view, kAct, q.scale.view, w.q.view, kAct, w.scale.view, gemm_out_type(out_type), opt,
                            stream);
  return nb::make_tuple(out.out.tensor, w.scale.tensor, or_none(s0), s1.tensor, or_none(s2));
}

// (dx, dnorm_weight or None, dw or None) of a block from the output gradient d [M, N] (in the
// forward's output dtype), what the forward saved (s0, s1, s2) and the weights' forward scale.
// y_dtype: the dtype of the recomputed GEMM input (x's); wgrad_type: dw's GEMM output type.
nb::tuple block_bwd_py(const Array& d_, int pre_, bool need_w, const std::vector<Array>& weights_,
                       const Array& w_scale_, std::optional<Array> s0_, std::optional<Array> s1_,
                       std::optional<Array> s2_,
                       std::optional<Array> norm_w_, int y_dtype, int wgrad_type, const Array& workspace_,
                       bool force_bf16, uintptr_t stream_, int norm_kind_, int act_) {
  const Pre pre = pre_arg(pre_);
  const NormKind norm_kind = norm_kind_arg(norm_kind_);
  const GatedAct act = gated_act_arg(act_);
  const View d = view_of(d_, "dout");
  expect_2d(d);
  const DType dt = float_dtype(d);
  COAT_CHECK_ARG(dt != DType::kFloat16, "dout must be float32 or bfloat16, got float16");
  const View ws = view_of(workspace_, "workspace");
  const View w_scale = view_of(w_scale_, "w_scale");
  // What the forward saved; without a pre-op only dW reads it (nothing is saved when no weight trains).
  View s0, s1, s2, norm_w;
  if (pre != Pre::kNone || need_w) {
    COAT_CHECK_ARG(s0_.has_value() && s1_.has_value(), "saved[0] and saved[1] are required here");
    s0 = view_of(*s0_, "saved[0]");
    s1 = view_of(*s1_, "saved[1]");
  }
  if (pre == Pre::kNorm) {
    COAT_CHECK_ARG(s2_.has_value() && norm_w_.has_value(), "pre=1 (norm) needs saved[2] (rstd) and norm_weight");
    s2 = view_of(*s2_, "saved[2]");
    norm_w = view_of(*norm_w_, "norm_weight");
  }
  const std::vector<View> weights = views_of_parts(weights_);
  const cudaStream_t stream = stream_of(stream_);
  GemmOptions opt;
  opt.workspace = &ws;
  opt.force_bf16 = force_bf16;
  const GemmOut d_type = dt == DType::kFloat32 ? GemmOut::kFloat32 : GemmOut::kBFloat16;

  PerTensorFp8 dq = quantize_amax(d, kGrad, need_w, stream);
  Created dy;  // dX of the GEMM: [M, K]
  {
    StackedFp8 w_t = quantize_stacked(weights, &w_scale, kAct, false, true, stream);
    dy = gemm_fp8(dq.q.view, kGrad, dq.scale.view, w_t.q_t.view, kAct, w_scale, d_type, opt, stream).out;
  }  // the transposed weight codes die with their GEMM
  dq.q = Created();

  // dW = dq^T @ (the GEMM input), its FP8 transpose made from what was saved (or saved as is).
  auto wgrad = [&](const View& in_t, const View& in_scale) {
    return gemm_fp8(dq.q_t.view, kGrad, dq.scale.view, in_t, kAct, in_scale, gemm_out_type(wgrad_type), opt, stream)
        .out;
  };
  auto wgrad_of = [&](Created in) {
    PerTensorFp8 t = quantize_amax(in.view, kAct, true, stream);
    in = Created(), t.q = Created();  // only the transposed codes are read
    return wgrad(t.q_t.view, t.scale.view);
  };
  Created dw, dx, dnorm;
  if (pre == Pre::kNorm) {
    if (need_w) dw = wgrad_of(rmsnorm_fwd_fp8(s0, s1, s2, norm_w, norm_kind, dtype_arg(y_dtype), kAct, stream));
    NormBwd nb_ = rmsnorm_bwd(s0, s1, s2, norm_w, norm_kind, dy.view, kAct, stream);
    dx = std::move(nb_.dx), dnorm = std::move(nb_.dw);
  } else if (pre == Pre::kSwiglu) {
    SwigluBwd sb = swiglu_bwd(s0, s1, dy.view, act, need_w, kAct, stream);
    dy = Created();
    dx = std::move(sb.dgu);
    if (need_w) dw = wgrad_of(std::move(sb.h));
  } else {
    if (need_w) dw = wgrad(s0, s1);
    dx = std::move(dy);
  }
  return nb::make_tuple(dx.tensor, or_none(dnorm), or_none(dw));
}

void register_block(nb::module_& m) {
  m.attr("BLOCK_PRE") = enum_dict<Pre>({{"none", Pre::kNone}, {"norm", Pre::kNorm}, {"swiglu", Pre::kSwiglu}});
  const int scaled = static_cast<int>(NormKind::kScaled), silu = static_cast<int>(GatedAct::kSilu);
  m.def("block_fwd", &block_fwd_py, restore_device(), arg("x"), arg("pre"), arg("norm_weight").none(), arg("eps"), arg("e8m0"),
        arg("weights"), arg("save_input_t"), arg("out_type"), arg("fast_accum"), arg("workspace"), arg("force_bf16"),
        arg("stream"), arg("norm_kind") = scaled, arg("act") = silu);
  m.def("block_bwd", &block_bwd_py, restore_device(), arg("dout"), arg("pre"), arg("need_w"), arg("weights"), arg("w_scale"),
        arg("s0").none(), arg("s1").none(), arg("s2").none(), arg("norm_weight").none(), arg("y_dtype"), arg("wgrad_type"),
        arg("workspace"), arg("force_bf16"), arg("stream"), arg("norm_kind") = scaled, arg("act") = silu);
}

}  // namespace

COAT_REGISTER_BINDINGS(block, register_block);

}  // namespace bind
}  // namespace coat
