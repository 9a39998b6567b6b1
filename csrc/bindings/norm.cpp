// nanobind registration of the norm family (RMSNorm with an FP8 saved input).
#include <utility>

#include "coat/norm.h"
#include "ops.h"
#include "registry.h"
#include "tensor_args.h"

namespace coat {
namespace bind {
namespace {

using nb::arg;

void check_width(const View& v, const char* what) {
  COAT_CHECK_ARG(v.last_dim() % kNormGroup == 0, std::string("the last dimension of ") + v.name + " (" +
                                                      std::to_string(v.last_dim()) + ") must be a multiple of 16 " +
                                                      what);
}

// (y, rstd, q, scales) of x: y = rmsnorm(x) with the weight applied as `norm_kind` says
// (coat/norm.h), in x's dtype; fp32 rstd per row, and (with `quantize`) x's FP8 copy in 1 x 16
// groups (else q and scales are empty).
nb::tuple rmsnorm_fwd_py(const Array& x_, const Array& w_, float eps, bool quantize, int fmt_, bool e8m0,
                         int norm_kind, uintptr_t stream) {
  const NormFwd r = rmsnorm_fwd(view_of(x_, "x"), view_of(w_, "weight"), norm_kind_arg(norm_kind), eps, quantize,
                                fp8_format(fmt_), e8m0, stream_of(stream));
  return nb::make_tuple(r.y.tensor, r.rstd.tensor, r.saved.q.tensor, r.saved.scales.tensor);
}

// The tensors the FP8 path saves (q, its group scales, rstd) and the weight; returns the scale
// kind and the weight dtype.
std::pair<ScaleKind, DType> check_saved_input(const View& q, const View& scales, const View& rstd, const View& w) {
  expect_kind(q, Kind::kUInt8);
  COAT_CHECK_ARG(!q.shape.empty(), std::string(q.name) + " must have at least one dimension");
  check_width(q, "for the FP8 RMSNorm");
  const ScaleKind kind = check_group_scales(scales, q.numel, kNormGroup);
  expect_kind(rstd, Kind::kFloat32);
  expect_numel(rstd, q.rows(), std::string("one per row of ") + q.name);
  const DType wt = float_dtype(w);
  expect_numel(w, q.last_dim(), "one per element of the normalized dimension");
  return {kind, wt};
}

// y recomputed from the saved FP8 input, as the core dtype `dtype`.
nb::object rmsnorm_fwd_fp8_py(const Array& q_, const Array& scales_, const Array& rstd_, const Array& w_, int dtype,
                              int fmt_, int norm_kind, uintptr_t stream) {
  return rmsnorm_fwd_fp8(view_of(q_, "q"), view_of(scales_, "scales"), view_of(rstd_, "rstd"), view_of(w_, "weight"),
                         norm_kind_arg(norm_kind), dtype_arg(dtype), fp8_format(fmt_), stream_of(stream))
      .tensor;
}

// (dx in dy's dtype, dweight in fp32, reduced deterministically through a per-call workspace).
nb::tuple rmsnorm_bwd_py(const Array& q_, const Array& scales_, const Array& rstd_, const Array& w_, const Array& dy_,
                         int fmt_, int norm_kind, uintptr_t stream) {
  const NormBwd r = rmsnorm_bwd(view_of(q_, "q"), view_of(scales_, "scales"), view_of(rstd_, "rstd"),
                                view_of(w_, "weight"), norm_kind_arg(norm_kind), view_of(dy_, "dy"), fp8_format(fmt_),
                                stream_of(stream));
  return nb::make_tuple(r.dx.tensor, r.dw.tensor);
}

void register_norm(nb::module_& m) {
  m.def("rmsnorm_fwd", &rmsnorm_fwd_py, restore_device(), arg("x"), arg("weight"), arg("eps"), arg("quantize"), arg("fmt"),
        arg("e8m0"), arg("norm_kind"), arg("stream"));
  m.def("rmsnorm_fwd_fp8", &rmsnorm_fwd_fp8_py, restore_device(), arg("q"), arg("scales"), arg("rstd"), arg("weight"), arg("dtype"),
        arg("fmt"), arg("norm_kind"), arg("stream"));
  m.def("rmsnorm_bwd", &rmsnorm_bwd_py, restore_device(), arg("q"), arg("scales"), arg("rstd"), arg("weight"), arg("dy"), arg("fmt"),
        arg("norm_kind"), arg("stream"));
}

}  // namespace

NormKind norm_kind_arg(int k) {
  COAT_CHECK_ARG(k == 0 || k == 1, "norm_kind must be 0 (scaled) or 1 (unit_offset), got " + std::to_string(k));
  return static_cast<NormKind>(k);
}

NormFwd rmsnorm_fwd(const View& x, const View& w, NormKind kind, float eps, bool quantize, Fp8Format fmt, bool e8m0,
                    cudaStream_t stream, bool want_amax) {
  const DType dt = float_dtype(x);
  const DType wt = float_dtype(w);
  COAT_CHECK_ARG(!x.shape.empty(), std::string(x.name) + " must have at least one dimension");
  check_width(x, "for the FP8 RMSNorm");
  expect_numel(w, x.last_dim(), "one per element of the normalized dimension");
  const bool cuda = same_device({&x, &w});
  NormFwd r;
  r.y = new_tensor(x.shape, new_dtype(dt), x, "y");
  r.rstd = new_tensor(std::vector<int64_t>(x.shape.begin(), x.shape.end() - 1), NewDtype::kFloat32, x, "rstd");
  r.saved = new_fp8_output(quantize, fmt, e8m0, x, kNormGroup);
  if (want_amax) r.amax = new_tensor({1}, NewDtype::kFloat32, x, "amax");
  auto* am = want_amax ? static_cast<float*>(r.amax.view.data) : nullptr;
  auto* rs = static_cast<float*>(r.rstd.view.data);
  const Fp8Output& out = r.saved;
  if (cuda)
    COAT_GPU_CALL(::coat::rmsnorm_fwd(x.data, dt, w.data, wt, kind, x.rows(), x.last_dim(), eps, r.y.view.data, rs,
                                      out.codes(), out.scale_data(), out.kind, fmt, am, stream));
  else
    ref::rmsnorm_fwd(x.data, dt, w.data, wt, kind, x.rows(), x.last_dim(), eps, r.y.view.data, rs, out.codes(),
                     out.scale_data(), out.kind, fmt, am);
  return r;
}

Created rmsnorm_fwd_fp8(const View& q, const View& scales, const View& rstd, const View& w, NormKind kind, DType yt,
                        Fp8Format fmt, cudaStream_t stream, Created* y_amax) {
  const auto [skind, wt] = check_saved_input(q, scales, rstd, w);
  const bool cuda = same_device({&q, &scales, &rstd, &w});
  Created y = new_tensor(q.shape, new_dtype(yt), q, "y");
  if (y_amax != nullptr) *y_amax = new_tensor({1}, NewDtype::kFloat32, q, "amax");
  auto* am = y_amax != nullptr ? static_cast<float*>(y_amax->view.data) : nullptr;
  const auto* qd = static_cast<const uint8_t*>(q.data);
  const auto* rs = static_cast<const float*>(rstd.data);
  if (cuda)
    COAT_GPU_CALL(::coat::rmsnorm_fwd_fp8(qd, scales.data, skind, fmt, rs, w.data, wt, kind, q.rows(), q.last_dim(),
                                          y.view.data, yt, am, stream));
  else
    ref::rmsnorm_fwd_fp8(qd, scales.data, skind, fmt, rs, w.data, wt, kind, q.rows(), q.last_dim(), y.view.data, yt,
                         am);
  return y;
}

NormBwd rmsnorm_bwd(const View& q, const View& scales, const View& rstd, const View& w, NormKind kind, const View& dy,
                    Fp8Format fmt, cudaStream_t stream) {
  const auto [skind, wt] = check_saved_input(q, scales, rstd, w);
  const DType dt = float_dtype(dy);
  expect_same_shape(dy, q);
  const bool cuda = same_device({&q, &scales, &rstd, &w, &dy});
  NormBwd r;
  r.dx = new_tensor(dy.shape, new_dtype(dt), dy, "dx");
  // The workspace of the deterministic dw reduction dies with this call.
  Created ws = new_tensor({rmsnorm_bwd_parts(q.rows()), q.last_dim()}, NewDtype::kFloat32, q, "workspace");
  r.dw = new_tensor({q.last_dim()}, NewDtype::kFloat32, q, "dw");
  const auto* qd = static_cast<const uint8_t*>(q.data);
  const auto* rs = static_cast<const float*>(rstd.data);
  auto* wsd = static_cast<float*>(ws.view.data);
  auto* dwd = static_cast<float*>(r.dw.view.data);
  if (cuda)
    COAT_GPU_CALL(::coat::rmsnorm_bwd(qd, scales.data, skind, fmt, rs, w.data, wt, kind, dy.data, dt, q.rows(),
                                      q.last_dim(), r.dx.view.data, wsd, dwd, stream));
  else
    ref::rmsnorm_bwd(qd, scales.data, skind, fmt, rs, w.data, wt, kind, dy.data, dt, q.rows(), q.last_dim(),
                     r.dx.view.data, wsd, dwd);
  return r;
}

COAT_REGISTER_BINDINGS(norm, register_norm);

}  // namespace bind
}  // namespace coat
