// nanobind registration of the quantize family.
#include "coat/quantize.h"
#include "registry.h"
#include "tensor_args.h"

namespace coat {
namespace bind {
namespace {

using nb::arg;

void quantize_per_tensor_py(const Array& x_, const Array& scale_, MutArray q_,
                            std::optional<MutArray> q_t_, int fmt_, uintptr_t stream) {
  const View x = view_of(x_, "x"), scale = view_of(scale_, "scale"), q = view_of(q_, "q");
  const DType dt = float_dtype(x);
  const Fp8Format fmt = fp8_format(fmt_);
  expect_kind(scale, Kind::kFloat32);
  expect_numel(scale, 1, "one per-tensor scale");
  expect_kind(q, Kind::kUInt8);
  expect_same_shape(q, x);
  View q_t;
  if (q_t_) {
    q_t = view_of(*q_t_, "q_t");
    expect_kind(q_t, Kind::kUInt8);
    expect_numel(q_t, x.numel, "the transpose of x");
  }
  const bool cuda = q_t_ ? same_device({&x, &scale, &q, &q_t}) : same_device({&x, &scale, &q});
  auto* qt = static_cast<uint8_t*>(q_t.data);
  if (cuda)
    COAT_GPU_CALL(quantize_per_tensor(x.data, dt, x.rows(), x.last_dim(), fmt, static_cast<const float*>(scale.data),
                        static_cast<uint8_t*>(q.data), qt, stream_of(stream)));
  else
    ref::quantize_per_tensor(x.data, dt, x.rows(), x.last_dim(), fmt,
                             static_cast<const float*>(scale.data), static_cast<uint8_t*>(q.data), qt);
}

void quantize_per_tensor_amax_py(const Array& x_, MutArray amax_, MutArray scale_, MutArray q_,
                                 std::optional<MutArray> q_t_, int fmt_, uintptr_t stream) {
  const View x = view_of(x_, "x"), amax = view_of(amax_, "amax"), scale = view_of(scale_, "scale"),
             q = view_of(q_, "q");
  const DType dt = float_dtype(x);
  const Fp8Format fmt = fp8_format(fmt_);
  expect_kind(amax, Kind::kFloat32);
  expect_numel(amax, 1, "one amax");
  expect_kind(scale, Kind::kFloat32);
  expect_numel(scale, 1, "one per-tensor scale");
  expect_kind(q, Kind::kUInt8);
  expect_same_shape(q, x);
  View q_t;
  if (q_t_) {
    q_t = view_of(*q_t_, "q_t");
    expect_kind(q_t, Kind::kUInt8);
    expect_numel(q_t, x.numel, "the transpose of x");
  }
  const bool cuda =
      q_t_ ? same_device({&x, &amax, &scale, &q, &q_t}) : same_device({&x, &amax, &scale, &q});
  auto* qt = static_cast<uint8_t*>(q_t.data);
  auto* a = static_cast<float*>(amax.data);
  auto* s = static_cast<float*>(scale.data);
  if (cuda)
    COAT_GPU_CALL(quantize_per_tensor_amax(x.data, dt, x.rows(), x.last_dim(), fmt, a, s,
                             static_cast<uint8_t*>(q.data), qt, stream_of(stream)));
  else
    ref::quantize_per_tensor_amax(x.data, dt, x.rows(), x.last_dim(), fmt, a, s,
                                  static_cast<uint8_t*>(q.data), qt);
}

void dequantize_per_tensor_py(const Array& q_, const Array& scale_, MutArray y_, int fmt_,
                              uintptr_t stream) {
  const View q = view_of(q_, "q"), scale = view_of(scale_, "scale"), y = view_of(y_, "y");
  const Fp8Format fmt = fp8_format(fmt_);
  expect_kind(q, Kind::kUInt8);
  expect_kind(scale, Kind::kFloat32);
  expect_numel(scale, 1, "one per-tensor scale");
  const DType out = float_dtype(y);
  expect_same_shape(y, q);
  const auto* s = static_cast<const float*>(scale.data);
  const auto* qd = static_cast<const uint8_t*>(q.data);
  if (same_device({&q, &scale, &y}))
    COAT_GPU_CALL(dequantize_per_tensor(qd, fmt, q.numel, s, y.data, out, stream_of(stream)));
  else
    ref::dequantize_per_tensor(qd, fmt, q.numel, s, y.data, out);
}

void check_group_args(const View& x, const View& scales, int group, ScaleKind kind) {
  COAT_CHECK_ARG(group == 16 || group == 32 || group == 64 || group == 128,
                 "group_size must be 16, 32, 64 or 128, got " + std::to_string(group));
  COAT_CHECK_ARG(x.last_dim() % group == 0,
                 "group_size " + std::to_string(group) + " does not divide the last dimension of " +
                     x.name + " (" + std::to_string(x.last_dim()) + ")");
  expect_kind(scales, kind == ScaleKind::kE8M0 ? Kind::kUInt8 : Kind::kFloat32);
  expect_numel(scales, x.numel / group, "one per group of " + std::to_string(group));
}

void quantize_per_group_py(const Array& x_, MutArray scales_, MutArray q_, int group, int fmt_,
                           int kind_, uintptr_t stream) {
  const View x = view_of(x_, "x"), scales = view_of(scales_, "scales"), q = view_of(q_, "q");
  const DType dt = float_dtype(x);
  const Fp8Format fmt = fp8_format(fmt_);
  const ScaleKind kind = scale_kind(kind_);
  check_group_args(x, scales, group, kind);
  expect_kind(q, Kind::kUInt8);
  expect_same_shape(q, x);
  auto* qd = static_cast<uint8_t*>(q.data);
  if (same_device({&x, &scales, &q}))
    COAT_GPU_CALL(quantize_per_group(x.data, dt, x.rows(), x.last_dim(), group, fmt, kind, scales.data, qd,
                       stream_of(stream)));
  else
    ref::quantize_per_group(x.data, dt, x.rows(), x.last_dim(), group, fmt, kind, scales.data, qd);
}

void dequantize_per_group_py(const Array& q_, const Array& scales_, MutArray y_, int group,
                             int fmt_, int kind_, uintptr_t stream) {
  const View q = view_of(q_, "q"), scales = view_of(scales_, "scales"), y = view_of(y_, "y");
  const Fp8Format fmt = fp8_format(fmt_);
  const ScaleKind kind = scale_kind(kind_);
  expect_kind(q, Kind::kUInt8);
  check_group_args(q, scales, group, kind);
  const DType out = float_dtype(y);
  expect_same_shape(y, q);
  const auto* qd = static_cast<const uint8_t*>(q.data);
  if (same_device({&q, &scales, &y}))
    COAT_GPU_CALL(dequantize_per_group(qd, fmt, q.rows(), q.last_dim(), group, kind, scales.data, y.data, out,
                         stream_of(stream)));
  else
    ref::dequantize_per_group(qd, fmt, q.rows(), q.last_dim(), group, kind, scales.data, y.data, out);
}

void check_dre_meta(const View& gmax, const View& k16, int64_t n) {
  const int64_t groups = (n + kDreGroupSize - 1) / kDreGroupSize;
  expect_kind(gmax, Kind::kFloat32);
  expect_numel(gmax, groups, "one per group of 128");
  expect_kind(k16, Kind::kUInt8);
  expect_numel(k16, groups, "one per group of 128");
}

void dre_quantize_py(const Array& x_, MutArray q_, MutArray gmax_, MutArray k16_, int fmt_,
                     float log2_range, uintptr_t stream) {
  const View x = view_of(x_, "x"), q = view_of(q_, "q"), gmax = view_of(gmax_, "gmax"),
             k16 = view_of(k16_, "k16");
  expect_kind(x, Kind::kFloat32);
  const Fp8Format fmt = fp8_format(fmt_);
  expect_kind(q, Kind::kUInt8);
  expect_numel(q, x.numel, "one code per element of x");
  check_dre_meta(gmax, k16, x.numel);
  const auto* xd = static_cast<const float*>(x.data);
  auto* qd = static_cast<uint8_t*>(q.data);
  auto* gd = static_cast<float*>(gmax.data);
  auto* kd = static_cast<uint8_t*>(k16.data);
  if (same_device({&x, &q, &gmax, &k16}))
    COAT_GPU_CALL(dre_quantize(xd, x.numel, fmt, log2_range, qd, gd, kd, stream_of(stream)));
  else
    ref::dre_quantize(xd, x.numel, fmt, log2_range, qd, gd, kd);
}

void dre_dequantize_py(const Array& q_, const Array& gmax_, const Array& k16_, MutArray y_,
                       int fmt_, uintptr_t stream) {
  const View q = view_of(q_, "q"), gmax = view_of(gmax_, "gmax"), k16 = view_of(k16_, "k16"),
             y = view_of(y_, "y");
  const Fp8Format fmt = fp8_format(fmt_);
  expect_kind(q, Kind::kUInt8);
  check_dre_meta(gmax, k16, q.numel);
  expect_kind(y, Kind::kFloat32);
  expect_numel(y, q.numel, "one value per code");
  const auto* qd = static_cast<const uint8_t*>(q.data);
  const auto* gd = static_cast<const float*>(gmax.data);
  const auto* kd = static_cast<const uint8_t*>(k16.data);
  auto* yd = static_cast<float*>(y.data);
  if (same_device({&q, &gmax, &k16, &y}))
    COAT_GPU_CALL(dre_dequantize(qd, gd, kd, q.numel, fmt, yd, stream_of(stream)));
  else
    ref::dre_dequantize(qd, gd, kd, q.numel, fmt, yd);
}

void register_quantize(nb::module_& m) {
  m.attr("DRE_GROUP_SIZE") = kDreGroupSize;
  m.attr("DRE_LOG2_RANGE_E4M3") = kDreLog2RangeE4M3;
  m.attr("DRE_LOG2_RANGE_E5M2") = kDreLog2RangeE5M2;
  m.def("quantize_per_tensor", &quantize_per_tensor_py, arg("x"), arg("scale"), arg("q"),
        arg("q_t").none(), arg("fmt"), arg("stream"));
  m.def("quantize_per_tensor_amax", &quantize_per_tensor_amax_py, arg("x"), arg("amax"),
        arg("scale"), arg("q"), arg("q_t").none(), arg("fmt"), arg("stream"));
  m.def("dequantize_per_tensor", &dequantize_per_tensor_py, arg("q"), arg("scale"), arg("y"),
        arg("fmt"), arg("stream"));
  m.def("quantize_per_group", &quantize_per_group_py, arg("x"), arg("scales"), arg("q"),
        arg("group_size"), arg("fmt"), arg("scale_kind"), arg("stream"));
  m.def("dequantize_per_group", &dequantize_per_group_py, arg("q"), arg("scales"), arg("y"),
        arg("group_size"), arg("fmt"), arg("scale_kind"), arg("stream"));
  m.def("dre_quantize", &dre_quantize_py, arg("x"), arg("q"), arg("gmax"), arg("k16"), arg("fmt"),
        arg("log2_range"), arg("stream"));
  m.def("dre_dequantize", &dre_dequantize_py, arg("q"), arg("gmax"), arg("k16"), arg("y"),
        arg("fmt"), arg("stream"));
}

}  // namespace

COAT_REGISTER_BINDINGS(quantize, register_quantize);

}  // namespace bind
}  // namespace coat
