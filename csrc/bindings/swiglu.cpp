// nanobind registration of the swiglu family.
#include "coat/swiglu.h"
#include "ops.h"
#include "registry.h"
#include "tensor_args.h"

namespace coat {
namespace bind {
namespace {

using nb::arg;

// gate_up [.., 2 inter] -> inter, checking the width.
int64_t inter_of(const View& gu) {
  COAT_CHECK_ARG(!gu.shape.empty() && gu.last_dim() % (2 * kSwigluGroup) == 0,
                 std::string("the last dimension of ") + gu.name + " (" +
                     (gu.shape.empty() ? std::string("0-d") : std::to_string(gu.last_dim())) +
                     ") must be 2 x a multiple of 16 (gate and up halves)");
  return gu.last_dim() / 2;
}

std::vector<int64_t> h_shape(const View& gu, int64_t inter) {
  std::vector<int64_t> s = gu.shape;
  s.back() = inter;
  return s;
}

// (h, q, scales): h = act(gate) * up in gate_up's dtype (act: coat/swiglu.h's GatedAct id), and
// (with `quantize`) gate_up's FP8 copy in 1 x 16 groups (else q and scales are empty).
nb::tuple swiglu_fwd_py(const Array& gu_, bool quantize, int fmt_, bool e8m0, int act, uintptr_t stream) {
  const SwigluFwd r = swiglu_fwd(view_of(gu_, "gate_up"), gated_act_arg(act), quantize, fp8_format(fmt_), e8m0,
                                 stream_of(stream));
  return nb::make_tuple(r.h.tensor, r.saved.q.tensor, r.saved.scales.tensor);
}

// (dgate_up, h) in dh's dtype from the FP8 copy of gate_up; h (act(g) * u recomputed) is empty
// unless `recompute_h`.
nb::tuple swiglu_bwd_py(const Array& q_, const Array& scales_, const Array& dh_, bool recompute_h, int fmt_, int act,
                        uintptr_t stream) {
  const SwigluBwd r = swiglu_bwd(view_of(q_, "q"), view_of(scales_, "scales"), view_of(dh_, "dh"), gated_act_arg(act),
                                 recompute_h, fp8_format(fmt_), stream_of(stream));
  return nb::make_tuple(r.dgu.tensor, r.h.tensor);
}

void register_swiglu(nb::module_& m) {
  m.def("swiglu_fwd", &swiglu_fwd_py, restore_device(), arg("gate_up"), arg("quantize"), arg("fmt"), arg("e8m0"), arg("act"),
        arg("stream"));
  m.def("swiglu_bwd", &swiglu_bwd_py, restore_device(), arg("q"), arg("scales"), arg("dh"), arg("recompute_h"), arg("fmt"),
        arg("act"), arg("stream"));
}

}  // namespace

GatedAct gated_act_arg(int a) {
  COAT_CHECK_ARG(a == 0 || a == 1, "act must be 0 (silu) or 1 (gelu_tanh), got " + std::to_string(a));
  return static_cast<GatedAct>(a);
}

SwigluFwd swiglu_fwd(const View& gu, GatedAct act, bool quantize, Fp8Format fmt, bool e8m0, cudaStream_t stream,
                     bool want_amax) {
  const DType dt = float_dtype(gu);
  const int64_t inter = inter_of(gu);
  const bool cuda = same_device({&gu});
  SwigluFwd r;
  r.h = new_tensor(h_shape(gu, inter), new_dtype(dt), gu, "h");
  r.saved = new_fp8_output(quantize, fmt, e8m0, gu, kSwigluGroup);
  if (want_amax) r.amax = new_tensor({1}, NewDtype::kFloat32, gu, "amax");
  auto* am = want_amax ? static_cast<float*>(r.amax.view.data) : nullptr;
  const Fp8Output& out = r.saved;
  if (cuda)
    COAT_GPU_CALL(::coat::swiglu_fwd(gu.data, dt, act, gu.rows(), inter, r.h.view.data, out.codes(), out.scale_data(),
                                     out.kind, fmt, am, stream));
  else
    ref::swiglu_fwd(gu.data, dt, act, gu.rows(), inter, r.h.view.data, out.codes(), out.scale_data(), out.kind, fmt,
                    am);
  return r;
}

SwigluBwd swiglu_bwd(const View& q, const View& scales, const View& dh, GatedAct act, bool recompute_h, Fp8Format fmt,
                     cudaStream_t stream, bool want_amax) {
  expect_kind(q, Kind::kUInt8);
  const int64_t inter = inter_of(q);
  const ScaleKind kind = check_group_scales(scales, q.numel, kSwigluGroup);
  const DType dt = float_dtype(dh);
  const std::vector<int64_t> hs = h_shape(q, inter);
  COAT_CHECK_ARG(dh.shape == hs, std::string(dh.name) + " must have shape " + shape_str(hs) + ", got " +
                                     shape_str(dh.shape));
  const bool cuda = same_device({&q, &scales, &dh});
  SwigluBwd r;
  r.dgu = new_tensor(q.shape, new_dtype(dt), dh, "dgu");
  r.h = new_tensor(recompute_h ? hs : std::vector<int64_t>{0}, new_dtype(dt), dh, "h");
  void* hd = recompute_h ? r.h.view.data : nullptr;
  float *dam = nullptr, *ham = nullptr;
  if (want_amax) {
    r.dgu_amax = new_tensor({1}, NewDtype::kFloat32, dh, "dgu_amax");
    dam = static_cast<float*>(r.dgu_amax.view.data);
    if (recompute_h) {
      r.h_amax = new_tensor({1}, NewDtype::kFloat32, dh, "h_amax");
      ham = static_cast<float*>(r.h_amax.view.data);
    }
  }
  const auto* qd = static_cast<const uint8_t*>(q.data);
  if (cuda)
    COAT_GPU_CALL(::coat::swiglu_bwd(qd, scales.data, kind, fmt, dh.data, dt, act, q.rows(), inter, r.dgu.view.data,
                                     hd, dam, ham, stream));
  else
    ref::swiglu_bwd(qd, scales.data, kind, fmt, dh.data, dt, act, q.rows(), inter, r.dgu.view.data, hd, dam, ham);
  return r;
}

COAT_REGISTER_BINDINGS(swiglu, register_swiglu);

}  // namespace bind
}  // namespace coat
