// nanobind registration of the norm family (RMSNorm with an FP8 saved input).
#include <utility>

#include "coat/norm.h"
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

void rmsnorm_fwd_py(const Array& x_, const Array& w_, float eps, MutArray y_, MutArray rstd_,
                    std::optional<MutArray> q_, std::optional<MutArray> scales_, int fmt_, uintptr_t stream) {
  const View x = view_of(x_, "x"), w = view_of(w_, "weight"), y = view_of(y_, "y"),
             rstd = view_of(rstd_, "rstd");
  const DType dt = float_dtype(x);
  const DType wt = float_dtype(w);
  const Fp8Format fmt = fp8_format(fmt_);
  COAT_CHECK_ARG(!x.shape.empty(), "x must have at least one dimension");
  check_width(x, "for the FP8 RMSNorm");
  expect_numel(w, x.last_dim(), "one per element of the normalized dimension");
  expect_kind(y, x.kind);
  expect_same_shape(y, x);
  expect_kind(rstd, Kind::kFloat32);
  expect_numel(rstd, x.rows(), "one per row of x");
  const Fp8Output out = optional_fp8_output(q_, scales_, x, kNormGroup);
  const View &q = out.q, &scales = out.scales;
  const ScaleKind kind = out.kind;
  const bool cuda = out.given ? same_device({&x, &w, &y, &rstd, &q, &scales}) : same_device({&x, &w, &y, &rstd});
  auto* qd = static_cast<uint8_t*>(q.data);
  auto* rs = static_cast<float*>(rstd.data);
  if (cuda)
    COAT_GPU_CALL(rmsnorm_fwd(x.data, dt, w.data, wt, x.rows(), x.last_dim(), eps, y.data, rs, qd, scales.data, kind, fmt,
                stream_of(stream)));
  else
    ref::rmsnorm_fwd(x.data, dt, w.data, wt, x.rows(), x.last_dim(), eps, y.data, rs, qd, scales.data, kind, fmt);
}

// The tensors the FP8 path saves (q, its group scales, rstd) and the weight; returns the scale
// kind and the weight dtype.
std::pair<ScaleKind, DType> check_saved_input(const View& q, const View& scales, const View& rstd, const View& w) {
  expect_kind(q, Kind::kUInt8);
  COAT_CHECK_ARG(!q.shape.empty(), "q must have at least one dimension");
  check_width(q, "for the FP8 RMSNorm");
  const ScaleKind kind = check_group_scales(scales, q.numel, kNormGroup);
  expect_kind(rstd, Kind::kFloat32);
  expect_numel(rstd, q.rows(), "one per row of q");
  const DType wt = float_dtype(w);
  expect_numel(w, q.last_dim(), "one per element of the normalized dimension");
  return {kind, wt};
}

void rmsnorm_fwd_fp8_py(const Array& q_, const Array& scales_, const Array& rstd_, const Array& w_,
                        MutArray y_, int fmt_, uintptr_t stream) {
  const View q = view_of(q_, "q"), scales = view_of(scales_, "scales"), rstd = view_of(rstd_, "rstd"),
             w = view_of(w_, "weight"), y = view_of(y_, "y");
  const Fp8Format fmt = fp8_format(fmt_);
  const auto [kind, wt] = check_saved_input(q, scales, rstd, w);
  const DType yt = float_dtype(y);
  expect_same_shape(y, q);
  const auto* qd = static_cast<const uint8_t*>(q.data);
  const auto* rs = static_cast<const float*>(rstd.data);
  if (same_device({&q, &scales, &rstd, &w, &y}))
    COAT_GPU_CALL(rmsnorm_fwd_fp8(qd, scales.data, kind, fmt, rs, w.data, wt, q.rows(), q.last_dim(), y.data, yt, stream_of(stream)));
  else
    ref::rmsnorm_fwd_fp8(qd, scales.data, kind, fmt, rs, w.data, wt, q.rows(), q.last_dim(), y.data, yt);
}

void rmsnorm_bwd_py(const Array& q_, const Array& scales_, const Array& rstd_, const Array& w_,
                    const Array& dy_, MutArray dx_, MutArray ws_, MutArray dw_, int fmt_, uintptr_t stream) {
  const View q = view_of(q_, "q"), scales = view_of(scales_, "scales"), rstd = view_of(rstd_, "rstd"),
             w = view_of(w_, "weight"), dy = view_of(dy_, "dy"), dx = view_of(dx_, "dx"),
             ws = view_of(ws_, "workspace"), dw = view_of(dw_, "dw");
  const Fp8Format fmt = fp8_format(fmt_);
  const auto [kind, wt] = check_saved_input(q, scales, rstd, w);
  const DType dt = float_dtype(dy);
  expect_same_shape(dy, q);
  expect_kind(dx, dy.kind);
  expect_same_shape(dx, q);
  expect_kind(ws, Kind::kFloat32);
  expect_numel(ws, rmsnorm_bwd_parts(q.rows()) * q.last_dim(), "rmsnorm_bwd_parts(rows) x cols");
  expect_kind(dw, Kind::kFloat32);
  expect_numel(dw, q.last_dim(), "one per element of the normalized dimension");
  const auto* qd = static_cast<const uint8_t*>(q.data);
  const auto* rs = static_cast<const float*>(rstd.data);
  auto* wsd = static_cast<float*>(ws.data);
  auto* dwd = static_cast<float*>(dw.data);
  if (same_device({&q, &scales, &rstd, &w, &dy, &dx, &ws, &dw}))
    COAT_GPU_CALL(rmsnorm_bwd(qd, scales.data, kind, fmt, rs, w.data, wt, dy.data, dt, q.rows(), q.last_dim(), dx.data, wsd,
                dwd, stream_of(stream)));
  else
    ref::rmsnorm_bwd(qd, scales.data, kind, fmt, rs, w.data, wt, dy.data, dt, q.rows(), q.last_dim(), dx.data,
                     wsd, dwd);
}

int64_t rmsnorm_bwd_parts_py(int64_t rows) {
  COAT_CHECK_ARG(rows >= 0, "rows must be >= 0");
  return rmsnorm_bwd_parts(rows);
}

void register_norm(nb::module_& m) {
  m.def("rmsnorm_fwd", &rmsnorm_fwd_py, arg("x"), arg("weight"), arg("eps"), arg("y"), arg("rstd"),
        arg("q").none(), arg("scales").none(), arg("fmt"), arg("stream"));
  m.def("rmsnorm_fwd_fp8", &rmsnorm_fwd_fp8_py, arg("q"), arg("scales"), arg("rstd"), arg("weight"), arg("y"),
        arg("fmt"), arg("stream"));
  m.def("rmsnorm_bwd", &rmsnorm_bwd_py, arg("q"), arg("scales"), arg("rstd"), arg("weight"), arg("dy"),
        arg("dx"), arg("workspace"), arg("dw"), arg("fmt"), arg("stream"));
  m.def("rmsnorm_bwd_parts", &rmsnorm_bwd_parts_py, arg("rows"));
}

}  // namespace

COAT_REGISTER_BINDINGS(norm, register_norm);

}  // namespace bind
}  // namespace coat
