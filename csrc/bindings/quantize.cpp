// nanobind registration of the quantize family.
#include "coat/quantize.h"
#include "registry.h"
#include "tensor_args.h"

#include <nanobind/stl/vector.h>

#include <vector>

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

// parts: 1..4 row blocks [rows_i, cols] of one float dtype (fused projections' weights). Either
// `scale` (given; no amax pass) or `amax` and `scale_out` (computed on the device).
void quantize_stacked_py(const std::vector<Array>& parts_, std::optional<Array> scale_,
                         std::optional<MutArray> amax_, std::optional<MutArray> scale_out_,
                         std::optional<MutArray> q_, std::optional<MutArray> q_t_, int fmt_,
                         uintptr_t stream) {
  static const char* kNames[kMaxStackParts] = {"parts[0]", "parts[1]", "parts[2]", "parts[3]"};
  COAT_CHECK_ARG(!parts_.empty() && parts_.size() <= static_cast<size_t>(kMaxStackParts),
                 "parts must hold 1 to " + std::to_string(kMaxStackParts) + " tensors, got " +
                     std::to_string(parts_.size()));
  COAT_CHECK_ARG(scale_.has_value() != amax_.has_value(),
                 "give either scale (a given scale) or amax and scale_out (computed), not both");
  COAT_CHECK_ARG(amax_.has_value() == scale_out_.has_value(), "amax and scale_out must be given together");
  COAT_CHECK_ARG(q_.has_value() || q_t_.has_value(), "q and q_t must not both be None");
  StackedRows x;
  std::vector<View> parts;
  parts.reserve(parts_.size());
  for (size_t i = 0; i < parts_.size(); ++i) {
    parts.push_back(view_of(parts_[i], kNames[i]));
    const View& p = parts.back();
    COAT_CHECK_ARG(p.shape.size() == 2, std::string(p.name) + " must be 2-D, got shape " + shape_str(p.shape));
    const DType dt = float_dtype(p);
    if (i == 0) {
      x.dtype = dt;
      x.cols = p.shape[1];
    }
    COAT_CHECK_ARG(dt == x.dtype, std::string(p.name) + " is " + p.dtype_name + " but parts[0] is " +
                                      parts[0].dtype_name + ": all parts must share one dtype");
    COAT_CHECK_ARG(p.shape[1] == x.cols, std::string(p.name) + " has " + std::to_string(p.shape[1]) +
                                             " columns but parts[0] has " + std::to_string(x.cols));
    x.data[i] = p.data;
    x.rows[i] = p.shape[0];
  }
  x.count = static_cast<int>(parts.size());
  int64_t rows = 0;
  for (int i = 0; i < x.count; ++i) rows += x.rows[i];
  std::vector<const View*> all;
  for (const View& p : parts) all.push_back(&p);
  View scale, amax, scale_out, q, q_t;
  auto scalar = [&](const std::optional<MutArray>& a, View& v, const char* name) {
    if (!a) return;
    v = view_of(*a, name);
    expect_kind(v, Kind::kFloat32);
    expect_numel(v, 1, "one per-tensor value");
    all.push_back(&v);
  };
  scalar(scale_, scale, "scale");
  scalar(amax_, amax, "amax");
  scalar(scale_out_, scale_out, "scale_out");
  if (q_) {
    q = view_of(*q_, "q");
    expect_kind(q, Kind::kUInt8);
    COAT_CHECK_ARG(q.shape == std::vector<int64_t>({rows, x.cols}),
                   "q must have shape [R, cols] = [" + std::to_string(rows) + ", " +
                       std::to_string(x.cols) + "], got " + shape_str(q.shape));
    all.push_back(&q);
  }
  if (q_t_) {
    q_t = view_of(*q_t_, "q_t");
    expect_kind(q_t, Kind::kUInt8);
    COAT_CHECK_ARG(q_t.shape == std::vector<int64_t>({x.cols, rows}),
                   "q_t must have shape [cols, R] = [" + std::to_string(x.cols) + ", " +
                       std::to_string(rows) + "], got " + shape_str(q_t.shape));
    all.push_back(&q_t);
  }
  for (const View* v : all) same_device({all[0], v});
  const Fp8Format fmt = fp8_format(fmt_);
  const auto* sc = static_cast<const float*>(scale.data);
  auto* am = static_cast<float*>(amax.data);
  auto* so = static_cast<float*>(scale_out.data);
  auto* qd = static_cast<uint8_t*>(q.data);
  auto* qtd = static_cast<uint8_t*>(q_t.data);
  if (all[0]->cuda)
    COAT_GPU_CALL(quantize_stacked(x, fmt, sc, am, so, qd, qtd, stream_of(stream)));
  else
    ref::quantize_stacked(x, fmt, sc, am, so, qd, qtd);
}

// parts: 1..4 row blocks [rows_i, cols] of FP8 codes (uint8 views); q_t: [cols, sum rows_i].
void transpose_stacked_codes_py(const std::vector<Array>& parts_, MutArray q_t_, uintptr_t stream) {
  static const char* kNames[kMaxStackParts] = {"parts[0]", "parts[1]", "parts[2]", "parts[3]"};
  COAT_CHECK_ARG(!parts_.empty() && parts_.size() <= static_cast<size_t>(kMaxStackParts),
                 "parts must hold 1 to " + std::to_string(kMaxStackParts) + " tensors, got " +
                     std::to_string(parts_.size()));
  StackedRows x;
  std::vector<View> views;
  views.reserve(parts_.size() + 1);
  int64_t rows = 0;
  for (size_t i = 0; i < parts_.size(); ++i) {
    views.push_back(view_of(parts_[i], kNames[i]));
    const View& p = views.back();
    COAT_CHECK_ARG(p.shape.size() == 2, std::string(p.name) + " must be 2-D, got shape " + shape_str(p.shape));
    expect_kind(p, Kind::kUInt8);
    if (i == 0) x.cols = p.shape[1];
    COAT_CHECK_ARG(p.shape[1] == x.cols, std::string(p.name) + " has " + std::to_string(p.shape[1]) +
                                             " columns but parts[0] has " + std::to_string(x.cols));
    x.data[i] = p.data;
    x.rows[i] = p.shape[0];
    rows += p.shape[0];
  }
  x.count = static_cast<int>(parts_.size());
  views.push_back(view_of(q_t_, "q_t"));
  const View& q_t = views.back();
  expect_kind(q_t, Kind::kUInt8);
  COAT_CHECK_ARG(q_t.shape.size() == 2 && q_t.shape[0] == x.cols && q_t.shape[1] == rows,
                 "q_t must have shape [" + std::to_string(x.cols) + ", " + std::to_string(rows) + "], got " +
                     shape_str(q_t.shape));
  std::vector<const View*> all;
  for (const View& v : views) all.push_back(&v);
  auto* qt = static_cast<uint8_t*>(q_t.data);
  for (const View* v : all) same_device({all[0], v});
  if (all[0]->cuda)
    COAT_GPU_CALL(transpose_stacked_codes(x, qt, stream_of(stream)));
  else
    ref::transpose_stacked_codes(x, qt);
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
  m.def("quantize_stacked", &quantize_stacked_py, arg("parts"), arg("scale").none(),
        arg("amax").none(), arg("scale_out").none(), arg("q").none(), arg("q_t").none(),
        arg("fmt"), arg("stream"));
  m.def("transpose_stacked_codes", &transpose_stacked_codes_py, arg("parts"), arg("q_t"), arg("stream"));
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
