// One binding call per FP8 layer block, the only path of coat's layers (coat/nn/block.py) on the
// CPU and the GPU alike: the forward or the backward of [pre-op ->] per-tensor quantize -> FP8 GEMM,
// chained here so that a block costs the host one Python call instead of four to seven. Each step
// is the single op's own body (ops.h), in the single ops' order, and every intermediate dies as
// early as it can (tests/python/test_block.py holds the block bit for bit against the single ops).
//
// The pre-op of a block (`pre`):
//   0 none:   the GEMM input is x itself; forward saves its transposed FP8 codes and scale for dW.
//             A pre-op without an FP8 kernel (widths that are not multiples of 16) runs in torch
//             before the block; its backward recomputes the GEMM input and hands it over
//             (`wgrad_input`), so nothing is saved for dW then (save_input_t false).
//   1 norm:   RMSNorm of x (FP8 saved input, 1 x 16 groups, and rstd), recomputed in backward;
//             `norm_kind` (coat::NormKind) says how its weight applies.
//   2 swiglu: act(gate) * up of a fused gate/up x (FP8 saved input, 1 x 16 groups); `act`
//             (coat::GatedAct) is the gate's activation.
// norm_kind and act default to the Llama kinds (scaled weight, SiLU); each is checked on every call
// and read only by the pre-op it belongs to.
//
// The weight comes from a source the caller picks (coat/nn/weights.py): the separate row blocks
// of the projection (q/k/v, gate/up, or one), quantized here afresh in each direction, or FP8
// codes the caller holds (a cache, FP8-frozen weights): forward's w_codes [N, K] with w_scale,
// backward's w_codes_t [K, N]. GEMMs take every shape (gemm_fp8_any) and write fp32, bf16 or fp16.
//
// The quantizers come from the caller's recipe: act_fmt for activations, weights and the saved
// pre-op inputs (E4M3 by default), grad_fmt for output gradients (E5M2); e8m0 picks the saved
// inputs' group scale kind.
// granularity (coat.nn.recipe GRANULARITIES): 0 "tensor", one scale per GEMM operand; 1 "row", per
// token for activations and gradients and per output channel for the weight (per input channel
// for the transposed weight of dX); 2 "block", 1 x 128 groups along K for activations and
// gradients and 128 x 128 tiles for the weight (DeepSeek-V3's). Row and block operands come from
// one read of their bf16 source (quantize_scaled), zero-padded to multiples of 16 on CUDA; the
// transposed ones for the backward GEMMs are quantized from that source too, never requantized
// from codes. They quantize the weight in each call (no caller's codes).
// producer_amax (group scaling, per-tensor granularity): the pre-op kernels (RMSNorm forward and
// its recompute, SwiGLU forward and backward) write the amax of what they produce in the same pass,
// so the GEMM inputs they make are quantized with no amax pass; the backward also takes d's amax
// from the caller (`dout_amax`: the SwiGLU backward of the block downstream wrote it) and returns
// dX's when its pre-op wrote it. Off, every per-tensor operand takes its own amax pass: the same
// codes and scales bit for bit (tests/python/test_block.py), kept to measure the difference.
// w_amax: one fp32 [1] per weight part, each part's max |.| as the optimizer step that wrote it
// recorded (coat/nn/weights.py): the weight's per-tensor codes are then made with no amax pass; a
// stale amax makes NaN codes (quantize.h quantize_stacked_from_part_amax), never clipped ones.
// want_stats: also return what coat.Fp8Stats reads that the block would otherwise free (the GEMM
// inputs made here and, per tensor, their scales; Fp8Stats quantizes row and block operands anew);
// it changes no result.
#include <nanobind/stl/vector.h>

#include <utility>

#include "enums.h"
#include "ops.h"
#include "registry.h"
#include "tensor_args.h"

namespace coat {
namespace bind {
namespace {

using nb::arg;

enum class Pre : int { kNone = 0, kNorm = 1, kSwiglu = 2 };

// The scale modes of a granularity: activations and gradients, and the weight.
struct Modes {
  ScaleMode act = ScaleMode::kTensor, weight = ScaleMode::kTensor;
  bool scaled() const { return act != ScaleMode::kTensor; }
};
Modes modes_of(int g, bool caller_codes) {
  COAT_CHECK_ARG(g >= 0 && g <= 2, "granularity must be 0 (tensor), 1 (row) or 2 (block), got " + std::to_string(g));
  if (g == 0) return {};
  COAT_CHECK_ARG(!caller_codes, "row and block scaling quantize the weight in each call: the weight cache and "
                                "FP8-frozen weights take per-tensor scaling (granularity 'tensor')");
  return g == 1 ? Modes{ScaleMode::kRow, ScaleMode::kRow} : Modes{ScaleMode::kVec128, ScaleMode::kBlock128};
}

// The rows of the stacked weight (its N).
int64_t rows_of(const std::vector<View>& parts) {
  int64_t n = 0;
  for (const View& p : parts) n += p.shape[0];
  return n;
}

Pre pre_arg(int p) {
  COAT_CHECK_ARG(p >= 0 && p <= 2, "pre must be 0 (none), 1 (norm) or 2 (swiglu), got " + std::to_string(p));
  return static_cast<Pre>(p);
}

nb::object or_none(const Created& c) { return c.tensor.is_valid() ? c.tensor : nb::none(); }

// The producer's amax when it wrote one (group scaling), else null (quantize_amax runs an amax pass).
const View* amax_of(const Created& amax) { return amax.tensor.is_valid() ? &amax.view : nullptr; }

GemmOptions gemm_options(const std::optional<Array>& workspace, View& ws, bool force_bf16) {
  GemmOptions opt;
  if (workspace) opt.workspace = &(ws = view_of(*workspace, "workspace"));
  opt.force_bf16 = force_bf16;
  return opt;
}

// The weight of a block: the caller's codes (and scale), or codes made here from `weights`.
struct BlockWeight {
  std::vector<View> parts;  // empty when the caller's codes are used
  View codes, scale;
  StackedFp8 made;
};

BlockWeight weight_arg(const std::vector<Array>& weights, const std::optional<Array>& codes, const Array* scale,
                       const char* codes_name) {
  BlockWeight w;
  if (codes) {
    w.codes = view_of(*codes, codes_name);
    expect_2d(w.codes);
    expect_kind(w.codes, Kind::kUInt8);
  } else {
    w.parts = views_of_parts(weights);
  }
  if (scale != nullptr) w.scale = view_of(*scale, "w_scale");
  return w;
}

// (out [M, N], w_scale or None, s0, s1, s2, stat_in or None, stat_scale or None):
// s = (x's FP8 codes, their group scales, rstd) with a norm, (codes, scales, None) with swiglu,
// (x's transposed codes or None, x's scale, None) without. w_scale: the scale of the codes made
// here (None with the caller's codes). stat_*: with want_stats and a pre-op, its output (the GEMM
// input) and that input's per-tensor scale.
// save_input_t: without a pre-op, whether dW will read x's codes (a weight trains, x not recomputed).
nb::tuple block_fwd_py(const Array& x_, int pre_, std::optional<Array> norm_w_, float eps, bool e8m0,
                       const std::vector<Array>& weights_, std::optional<Array> w_codes_,
                       std::optional<Array> w_scale_, bool save_input_t, int out_dtype, bool fast_accum,
                       std::optional<Array> workspace_, bool force_bf16, uintptr_t stream_, int norm_kind_, int act_,
                       bool want_stats, int act_fmt, int granularity, bool producer_amax,
                       std::optional<std::vector<Array>> w_amax_) {
  const Pre pre = pre_arg(pre_);
  const Modes md = modes_of(granularity, w_codes_.has_value());
  COAT_CHECK_ARG(!w_amax_ || (!w_codes_ && !md.scaled()),
                 "w_amax (the weights' amax from the optimizer) is for weights quantized here per tensor: not "
                 "with w_codes, nor with row or block granularity");
  const bool emit_amax = producer_amax && !md.scaled();
  const NormKind norm_kind = norm_kind_arg(norm_kind_);
  const GatedAct act = gated_act_arg(act_);
  const DType out_type = dtype_arg(out_dtype);
  const Fp8Format fa = fp8_format(act_fmt);
  const View x = view_of(x_, "x");
  expect_2d(x);
  COAT_CHECK_ARG(w_codes_.has_value() == w_scale_.has_value(), "w_codes and w_scale are given together or not at all");
  BlockWeight w = weight_arg(weights_, w_codes_, w_scale_ ? &*w_scale_ : nullptr, "w_codes");
  const cudaStream_t stream = stream_of(stream_);
  const int64_t k = pre == Pre::kSwiglu ? x.last_dim() / 2 : x.last_dim();  // the GEMM's K
  const View& w0 = w_codes_ ? w.codes : w.parts[0];
  COAT_CHECK_ARG(w0.shape.size() == 2 && w0.shape[1] == k,
                 std::string(w_codes_ ? "w_codes" : "weights[0]") + " has shape " + shape_str(w0.shape) +
                     " but the GEMM input has K = " + std::to_string(k) + " columns");
  View ws;
  GemmOptions opt = gemm_options(workspace_, ws, force_bf16);
  opt.fast_accum = fast_accum;

  Created y, y_amax, s0, s1, s2;  // the GEMM input in x's dtype (with a pre-op), its amax, what is saved
  if (pre == Pre::kNorm) {
    COAT_CHECK_ARG(norm_w_.has_value(), "norm_weight is required with pre=1 (norm)");
    NormFwd n = rmsnorm_fwd(x, view_of(*norm_w_, "norm_weight"), norm_kind, eps, true, fa, e8m0, stream, emit_amax);
    y = std::move(n.y), y_amax = std::move(n.amax);
    s0 = std::move(n.saved.q), s1 = std::move(n.saved.scales), s2 = std::move(n.rstd);
  } else if (pre == Pre::kSwiglu) {
    SwigluFwd sw = swiglu_fwd(x, act, true, fa, e8m0, stream, emit_amax);
    y = std::move(sw.h), y_amax = std::move(sw.amax);
    s0 = std::move(sw.saved.q), s1 = std::move(sw.saved.scales);
  }
  const View& in = pre == Pre::kNone ? x : y.view;
  if (md.scaled()) {
    const int64_t m = in.shape[0], n = rows_of(w.parts);
    const int64_t mp = scaled_pad(m, in.cuda), kp = scaled_pad(k, in.cuda), np = scaled_pad(n, in.cuda);
    ScaledFp8 xq = quantize_scaled({in}, mp, kp, fa, md.act, md.act, true, pre == Pre::kNone && save_input_t, stream);
    Created stat_in = want_stats ? std::move(y) : Created();  // the pre-op's output, for Fp8Stats
    y = Created();
    if (pre == Pre::kNone) s0 = std::move(xq.q_t), s1 = std::move(xq.scale_t);
    ScaledFp8 wq = quantize_scaled(w.parts, np, kp, fa, md.weight, md.weight, true, false, stream);
    opt.fast_accum = fast_accum && md.act != ScaleMode::kVec128;  // block GEMMs accumulate in split fp32 only
    Created out = gemm_scaled({xq.q.view, xq.scale.view, md.act, fa}, {wq.q.view, wq.scale.view, md.weight, fa}, m, n,
                              out_type, opt, stream);
    return nb::make_tuple(out.tensor, wq.scale.tensor, or_none(s0), or_none(s1), or_none(s2), or_none(stat_in),
                          nb::none());
  }
  PerTensorFp8 q = quantize_amax(in, fa, pre == Pre::kNone && save_input_t, stream, amax_of(y_amax));
  // Not needed after its quantization: freed before the weight's codes are made (unless read by stats).
  Created stat_in = want_stats ? std::move(y) : Created();
  y = Created();
  if (pre == Pre::kNone) s0 = std::move(q.q_t), s1 = q.scale;
  if (w_amax_) {
    std::vector<View> amax;
    for (const Array& a : *w_amax_) amax.push_back(view_of(a, "w_amax"));
    w.made = quantize_stacked_part_amax(w.parts, amax, fa, stream);
    w.codes = w.made.q.view, w.scale = w.made.scale.view;
  } else if (!w_codes_) {
    w.made = quantize_stacked(w.parts, nullptr, fa, true, false, stream);
    w.codes = w.made.q.view, w.scale = w.made.scale.view;
  }
  Created out = gemm_fp8_any(q.q.view, fa, q.scale.view, w.codes, fa, w.scale, out_type, opt, stream);
  const bool stat_scale = want_stats && pre != Pre::kNone;
  return nb::make_tuple(out.tensor, or_none(w.made.scale), or_none(s0), s1.tensor, or_none(s2), or_none(stat_in),
                        stat_scale ? q.scale.tensor : nb::none());
}

// What block_bwd reads that the forward saved.
struct Saved {
  View s0, s1, s2, norm_w;
};

Saved saved_args(Pre pre, bool need_saved, const std::optional<Array>& s0, const std::optional<Array>& s1,
                 const std::optional<Array>& s2, const std::optional<Array>& norm_w) {
  Saved s;
  if (need_saved) {
    COAT_CHECK_ARG(s0.has_value() && s1.has_value(), "saved[0] and saved[1] are required here");
    s.s0 = view_of(*s0, "saved[0]");
    s.s1 = view_of(*s1, "saved[1]");
  }
  if (pre == Pre::kNorm) {
    COAT_CHECK_ARG(s2.has_value() && norm_w.has_value(), "pre=1 (norm) needs saved[2] (rstd) and norm_weight");
    s.s2 = view_of(*s2, "saved[2]");
    s.norm_w = view_of(*norm_w, "norm_weight");
  }
  return s;
}

// (dx, dnorm_weight or None, dw or None, d_scale, stat_in or None, stat_scale or None, dx_amax or
// None) of a block
// from the output gradient d [M, N] (in the forward's output dtype), what the forward saved
// (s0, s1, s2) and the weight's forward scale. d_scale: d's per-tensor E5M2 scale. stat_*: with
// want_stats and need_w, the GEMM input recomputed for dW (None when it is `wgrad_input`, which
// the caller holds) and its scale. y_dtype: the dtype of the recomputed GEMM input (x's);
// wgrad_dtype: dw's dtype. wgrad_input (pre 0 only): the GEMM input, recomputed by the caller.
// dout_amax: d's amax [1] from its producer, or None; dx_amax: dx's, when the pre-op wrote it
// (SwiGLU with producer_amax), for the block that dx feeds.
nb::tuple block_bwd_py(const Array& d_, int pre_, bool need_w, const std::vector<Array>& weights_,
                       const Array& w_scale_, std::optional<Array> w_codes_t_, std::optional<Array> s0_,
                       std::optional<Array> s1_, std::optional<Array> s2_, std::optional<Array> norm_w_,
                       std::optional<Array> wgrad_input_, int y_dtype, int wgrad_dtype,
                       std::optional<Array> workspace_, bool force_bf16, uintptr_t stream_, int norm_kind_, int act_,
                       bool want_stats, int act_fmt, int grad_fmt, int granularity, bool producer_amax,
                       std::optional<Array> dout_amax_) {
  const Pre pre = pre_arg(pre_);
  const Modes md = modes_of(granularity, w_codes_t_.has_value());
  const bool emit_amax = producer_amax && !md.scaled();
  const NormKind norm_kind = norm_kind_arg(norm_kind_);
  const GatedAct act = gated_act_arg(act_);
  const DType wgrad_type = dtype_arg(wgrad_dtype);
  const Fp8Format fa = fp8_format(act_fmt), fg = fp8_format(grad_fmt);
  const View d = view_of(d_, "dout");
  expect_2d(d);
  const DType dt = float_dtype(d);
  COAT_CHECK_ARG(!wgrad_input_ || pre == Pre::kNone, "wgrad_input is only taken with pre=0 (none)");
  // Without a pre-op only dW reads what was saved (nothing is saved when no weight trains).
  const bool recomputed = wgrad_input_.has_value();
  const Saved s = saved_args(pre, pre != Pre::kNone || (need_w && !recomputed), s0_, s1_, s2_, norm_w_);
  BlockWeight w = weight_arg(weights_, w_codes_t_, &w_scale_, "w_codes_t");
  // The weight's [N, K] (w_codes_t is [K, N]): dout must have its N columns, wgrad_input its K.
  int64_t n = 0, k = 0;
  if (w_codes_t_) {
    expect_2d(w.codes);
    k = w.codes.shape[0], n = w.codes.shape[1];
  } else {
    for (const View& p : w.parts) expect_2d(p);
    n = rows_of(w.parts), k = w.parts[0].shape[1];
  }
  COAT_CHECK_ARG(d.shape[1] == n, "dout has shape " + shape_str(d.shape) + " but the weight has N = " +
                                      std::to_string(n) + " rows: dout must be [M, " + std::to_string(n) + "]");
  if (wgrad_input_) {
    const View in = view_of(*wgrad_input_, "wgrad_input");
    COAT_CHECK_ARG(in.shape.size() == 2 && in.shape[0] == d.shape[0] && in.shape[1] == k,
                   "wgrad_input has shape " + shape_str(in.shape) + " but must be [M, K] = [" +
                       std::to_string(d.shape[0]) + ", " + std::to_string(k) + "]");
  }
  const cudaStream_t stream = stream_of(stream_);
  View ws;
  const GemmOptions opt = gemm_options(workspace_, ws, force_bf16);

  // The output gradient for dX = dq @ W (dq_a, W^T as wt) and for dW = dq^T @ (the GEMM input).
  const bool cuda = d.cuda;
  const int64_t m = d.shape[0], mp = scaled_pad(m, cuda), np = scaled_pad(n, cuda), kp = scaled_pad(k, cuda);
  PerTensorFp8 dq;
  ScaledFp8 dqs;
  Fp8Operand dq_a, dq_t;
  if (md.scaled()) {
    dqs = quantize_scaled({d}, mp, np, fg, md.act, md.act, true, need_w, stream);
    dq_a = {dqs.q.view, dqs.scale.view, md.act, fg};
    if (need_w) dq_t = {dqs.q_t.view, dqs.scale_t.view, md.act, fg};
  } else {
    View da;
    const bool given = emit_amax && dout_amax_.has_value();
    if (given) da = view_of(*dout_amax_, "dout_amax");
    dq = quantize_amax(d, fg, need_w, stream, given ? &da : nullptr);
    dq_a = {dq.q.view, dq.scale.view, ScaleMode::kTensor, fg};
    if (need_w) dq_t = {dq.q_t.view, dq.scale.view, ScaleMode::kTensor, fg};
  }
  Created dy;  // dX of the GEMM: [M, K]
  if (md.scaled()) {
    ScaledFp8 wt = quantize_scaled(w.parts, np, kp, fa, md.weight, md.weight, false, true, stream);
    dy = gemm_scaled(dq_a, {wt.q_t.view, wt.scale_t.view, md.weight, fa}, m, k, dt, opt, stream);
    dqs.q = Created(), dqs.scale = Created();
  } else {
    if (!w_codes_t_) w.made = quantize_stacked(w.parts, &w.scale, fa, false, true, stream);
    dy = gemm_fp8_any(dq.q.view, fg, dq.scale.view, w_codes_t_ ? w.codes : w.made.q_t.view, fa, w.scale, dt,
                      opt, stream);
    w.made = StackedFp8();  // the transposed weight codes die with their GEMM
    dq.q = Created();
  }

  // dW = dq^T @ (the GEMM input), its FP8 transpose made from what was saved (or saved as is).
  Created stat_in, stat_scale;
  auto wgrad = [&](const View& in_t, const View& in_scale) {
    return gemm_scaled(dq_t, {in_t, in_scale, md.act, fa}, n, k, wgrad_type, opt, stream);
  };
  // The transposed codes and scales of a GEMM input in hand (only the transposed codes are read).
  // The transposed codes and scales of a GEMM input in hand (only the transposed codes are read),
  // with the amax its producer wrote if any.
  auto codes_t = [&](const View& in, const View* amax) -> std::pair<Created, Created> {
    if (md.scaled()) {
      ScaledFp8 t = quantize_scaled({in}, mp, kp, fa, md.act, md.act, false, true, stream);
      return {std::move(t.q_t), std::move(t.scale_t)};
    }
    PerTensorFp8 t = quantize_amax(in, fa, true, stream, amax);
    if (want_stats) stat_scale = t.scale;
    return {std::move(t.q_t), std::move(t.scale)};
  };
  auto wgrad_of = [&](Created in, Created amax) {  // a recomputed input, freed before its GEMM (unless read by stats)
    auto [qt, st] = codes_t(in.view, amax_of(amax));
    if (want_stats) stat_in = std::move(in);
    in = Created();
    return wgrad(qt.view, st.view);
  };
  Created dw, dx, dnorm, dx_amax;
  if (pre == Pre::kNorm) {
    if (need_w) {
      Created y_amax;
      Created y = rmsnorm_fwd_fp8(s.s0, s.s1, s.s2, s.norm_w, norm_kind, dtype_arg(y_dtype), fa, stream,
                                  emit_amax ? &y_amax : nullptr);
      dw = wgrad_of(std::move(y), std::move(y_amax));
    }
    NormBwd nb_ = rmsnorm_bwd(s.s0, s.s1, s.s2, s.norm_w, norm_kind, dy.view, fa, stream);
    dx = std::move(nb_.dx), dnorm = std::move(nb_.dw);
  } else if (pre == Pre::kSwiglu) {
    SwigluBwd sb = swiglu_bwd(s.s0, s.s1, dy.view, act, need_w, fa, stream, emit_amax);
    dy = Created();
    dx = std::move(sb.dgu), dx_amax = std::move(sb.dgu_amax);
    if (need_w) dw = wgrad_of(std::move(sb.h), std::move(sb.h_amax));
  } else {
    if (need_w && recomputed) {
      auto [qt, st] = codes_t(view_of(*wgrad_input_, "wgrad_input"), nullptr);
      dw = wgrad(qt.view, st.view);
    } else if (need_w) {
      if (md.scaled())
        COAT_CHECK_ARG(s.s0.shape.size() == 2 && s.s0.shape[0] == kp && s.s0.shape[1] == mp,
                       "saved[0] has shape " + shape_str(s.s0.shape) + " but this backward's input codes are [" +
                           std::to_string(kp) + ", " + std::to_string(mp) + "]: pass the forward's outputs "
                           "and the forward's granularity");
      dw = wgrad(s.s0, s.s1);
    }
    dx = std::move(dy);
  }
  return nb::make_tuple(dx.tensor, or_none(dnorm), or_none(dw), md.scaled() ? nb::none() : dq.scale.tensor,
                        or_none(stat_in), or_none(stat_scale), or_none(dx_amax));
}

void register_block(nb::module_& m) {
  m.attr("BLOCK_PRE") = enum_dict<Pre>({{"none", Pre::kNone}, {"norm", Pre::kNorm}, {"swiglu", Pre::kSwiglu}});
  const int scaled = static_cast<int>(NormKind::kScaled), silu = static_cast<int>(GatedAct::kSilu);
  const int e4m3 = static_cast<int>(Fp8Format::kE4M3), e5m2 = static_cast<int>(Fp8Format::kE5M2);
  m.def("block_fwd", &block_fwd_py, restore_device(), arg("x"), arg("pre"), arg("norm_weight").none(), arg("eps"),
        arg("e8m0"), arg("weights"), arg("w_codes").none(), arg("w_scale").none(), arg("save_input_t"),
        arg("out_dtype"), arg("fast_accum"), arg("workspace").none(), arg("force_bf16"), arg("stream"),
        arg("norm_kind") = scaled, arg("act") = silu, arg("want_stats") = false, arg("act_fmt") = e4m3,
        arg("granularity") = 0, arg("producer_amax") = true, arg("w_amax").none() = nb::none());
  m.def("block_bwd", &block_bwd_py, restore_device(), arg("dout"), arg("pre"), arg("need_w"), arg("weights"),
        arg("w_scale"), arg("w_codes_t").none(), arg("s0").none(), arg("s1").none(), arg("s2").none(),
        arg("norm_weight").none(), arg("wgrad_input").none(), arg("y_dtype"), arg("wgrad_dtype"),
        arg("workspace").none(), arg("force_bf16"), arg("stream"), arg("norm_kind") = scaled, arg("act") = silu,
        arg("want_stats") = false, arg("act_fmt") = e4m3, arg("grad_fmt") = e5m2, arg("granularity") = 0,
        arg("producer_amax") = true, arg("dout_amax").none() = nb::none());
}

}  // namespace

COAT_REGISTER_BINDINGS(block, register_block);

}  // namespace bind
}  // namespace coat
