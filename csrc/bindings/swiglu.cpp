// nanobind registration of the swiglu family.
#include "coat/swiglu.h"
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

void expect_h_shape(const View& h, const View& gu, int64_t inter) {
  std::vector<int64_t> s = gu.shape;
  s.back() = inter;
  COAT_CHECK_ARG(h.shape == s, std::string(h.name) + " must have shape " + shape_str(s) + ", got " +
                                   shape_str(h.shape));
}

void swiglu_fwd_py(const Array& gu_, MutArray h_, std::optional<MutArray> q_, std::optional<MutArray> scales_,
                   int fmt_, uintptr_t stream) {
  const View gu = view_of(gu_, "gate_up"), h = view_of(h_, "h");
  const DType dt = float_dtype(gu);
  const Fp8Format fmt = fp8_format(fmt_);
  const int64_t inter = inter_of(gu);
  expect_kind(h, gu.kind);
  expect_h_shape(h, gu, inter);
  const Fp8Output out = optional_fp8_output(q_, scales_, gu, kSwigluGroup);
  const View &q = out.q, &scales = out.scales;
  const ScaleKind kind = out.kind;
  const bool cuda = out.given ? same_device({&gu, &h, &q, &scales}) : same_device({&gu, &h});
  auto* qd = static_cast<uint8_t*>(q.data);
  if (cuda)
    COAT_GPU_CALL(swiglu_fwd(gu.data, dt, gu.rows(), inter, h.data, qd, scales.data, kind, fmt, stream_of(stream)));
  else
    ref::swiglu_fwd(gu.data, dt, gu.rows(), inter, h.data, qd, scales.data, kind, fmt);
}

void swiglu_bwd_py(const Array& q_, const Array& scales_, const Array& dh_, MutArray dgu_,
                   std::optional<MutArray> h_, int fmt_, uintptr_t stream) {
  const View q = view_of(q_, "q"), scales = view_of(scales_, "scales"), dh = view_of(dh_, "dh"),
             dgu = view_of(dgu_, "dgu");
  const Fp8Format fmt = fp8_format(fmt_);
  expect_kind(q, Kind::kUInt8);
  const int64_t inter = inter_of(q);
  const ScaleKind kind = check_group_scales(scales, q.numel, kSwigluGroup);
  const DType dt = float_dtype(dh);
  expect_h_shape(dh, q, inter);
  expect_kind(dgu, dh.kind);
  expect_same_shape(dgu, q);
  View h;
  if (h_) {
    h = view_of(*h_, "h");
    expect_kind(h, dh.kind);
    expect_h_shape(h, q, inter);
  }
  const bool cuda = h_ ? same_device({&q, &scales, &dh, &dgu, &h}) : same_device({&q, &scales, &dh, &dgu});
  const auto* qd = static_cast<const uint8_t*>(q.data);
  if (cuda)
    COAT_GPU_CALL(swiglu_bwd(qd, scales.data, kind, fmt, dh.data, dt, q.rows(), inter, dgu.data, h.data, stream_of(stream)));
  else
    ref::swiglu_bwd(qd, scales.data, kind, fmt, dh.data, dt, q.rows(), inter, dgu.data, h.data);
}

void register_swiglu(nb::module_& m) {
  m.def("swiglu_fwd", &swiglu_fwd_py, arg("gate_up"), arg("h"), arg("q").none(), arg("scales").none(),
        arg("fmt"), arg("stream"));
  m.def("swiglu_bwd", &swiglu_bwd_py, arg("q"), arg("scales"), arg("dh"), arg("dgu"), arg("h").none(),
        arg("fmt"), arg("stream"));
}

}  // namespace

COAT_REGISTER_BINDINGS(swiglu, register_swiglu);

}  // namespace bind
}  // namespace coat
