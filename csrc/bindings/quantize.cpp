// nanobind registration of the quantize family.
#include "coat/operand_stats.h"
#include "coat/quantize.h"
#include "ops.h"
#include "registry.h"
#include "tensor_args.h"

#include <nanobind/stl/vector.h>
#include <nanobind/stl/string.h>

#include <vector>

namespace coat {
namespace bind {
namespace {

using nb::arg;

// [cols, rows] of x seen as [rows, cols] (its last dimension is cols): the transpose's shape.
std::vector<int64_t> t_shape(const View& x) { return {x.last_dim(), x.shape.empty() ? 1 : x.rows()}; }

const std::vector<int64_t> kEmpty{0};

void check_scale(const View& scale) {
  expect_kind(scale, Kind::kFloat32);
  expect_numel(scale, 1, "one per-tensor scale");
}

// (q, q_t or None) of x with a given scale.
nb::tuple quantize_per_tensor_py(const Array& x_, const Array& scale_, int fmt_, bool transpose,
                                 uintptr_t stream) {
  const View x = view_of(x_, "x"), scale = view_of(scale_, "scale");
  const DType dt = float_dtype(x);
  const Fp8Format fmt = fp8_format(fmt_);
  check_scale(scale);
  const bool cuda = same_device({&x, &scale});
  Created q = new_tensor(x.shape, NewDtype::kUInt8, x, "q");
  Created q_t;
  if (transpose) q_t = new_tensor(t_shape(x), NewDtype::kUInt8, x, "q_t");
  auto* qd = static_cast<uint8_t*>(q.view.data);
  auto* qt = transpose ? static_cast<uint8_t*>(q_t.view.data) : nullptr;
  const auto* s = static_cast<const float*>(scale.data);
  if (cuda)
    COAT_GPU_CALL(quantize_per_tensor(x.data, dt, x.rows(), x.last_dim(), fmt, s, qd, qt, stream_of(stream)));
  else
    ref::quantize_per_tensor(x.data, dt, x.rows(), x.last_dim(), fmt, s, qd, qt);
  return nb::make_tuple(q.tensor, transpose ? q_t.tensor : nb::none());
}

// (q, q_t (empty unless transpose), scale, amax) of x, its scale from max |x| on the device.
nb::tuple quantize_per_tensor_amax_py(const Array& x_, int fmt_, bool transpose, uintptr_t stream) {
  const View x = view_of(x_, "x");
  PerTensorFp8 r = quantize_amax(x, fp8_format(fmt_), transpose, stream_of(stream));
  if (!transpose) r.q_t = new_tensor(kEmpty, NewDtype::kUInt8, x, "q_t");
  return nb::make_tuple(r.q.tensor, r.q_t.tensor, r.scale.tensor, r.amax.tensor);
}

// y = q * scale as the core dtype `dtype` (0 fp32, 1 bf16, 2 fp16).
nb::object dequantize_per_tensor_py(const Array& q_, const Array& scale_, int fmt_, int dtype,
                                    uintptr_t stream) {
  const View q = view_of(q_, "q"), scale = view_of(scale_, "scale");
  const Fp8Format fmt = fp8_format(fmt_);
  expect_kind(q, Kind::kUInt8);
  check_scale(scale);
  const DType out = dtype_arg(dtype);
  const bool cuda = same_device({&q, &scale});
  Created y = new_tensor(q.shape, new_dtype(out), q, "y");
  const auto* s = static_cast<const float*>(scale.data);
  const auto* qd = static_cast<const uint8_t*>(q.data);
  if (cuda)
    COAT_GPU_CALL(dequantize_per_tensor(qd, fmt, q.numel, s, y.view.data, out, stream_of(stream)));
  else
    ref::dequantize_per_tensor(qd, fmt, q.numel, s, y.view.data, out);
  return y.tensor;
}

// parts: 1..4 row blocks [rows_i, cols] (float dtypes, or FP8 codes with `codes`), read as the
// stacked X [R, cols] (their device is checked against parts[0]; views_of_parts checked their count).
StackedRows stacked_of(const std::vector<View>& views, bool codes) {
  StackedRows x;
  for (size_t i = 0; i < views.size(); ++i) {
    const View& p = views[i];
    expect_2d(p);
    if (codes) {
      expect_kind(p, Kind::kUInt8);
    } else {
      const DType dt = float_dtype(p);
      if (i == 0) x.dtype = dt;
      COAT_CHECK_ARG(dt == x.dtype, std::string(p.name) + " is " + p.dtype_name + " but parts[0] is " +
                                        views[0].dtype_name + ": all parts must share one dtype");
    }
    if (i == 0) x.cols = p.shape[1];
    COAT_CHECK_ARG(p.shape[1] == x.cols, std::string(p.name) + " has " + std::to_string(p.shape[1]) +
                                             " columns but parts[0] has " + std::to_string(x.cols));
    same_device({&views[0], &p});
    x.data[i] = p.data;
    x.rows[i] = p.shape[0];
  }
  x.count = static_cast<int>(views.size());
  return x;
}

int64_t total_rows(const StackedRows& x) {
  int64_t rows = 0;
  for (int i = 0; i < x.count; ++i) rows += x.rows[i];
  return rows;
}

// Per-tensor FP8 of the stacked X with a given scale, or (scale_ None) with its scale from
// max |X| on the device: (q [R, cols] or empty, q_t [cols, R] or empty[, scale]).
nb::tuple quantize_stacked_py(const std::vector<Array>& parts_, std::optional<Array> scale_, int fmt_,
                              bool rowmajor, bool transpose, uintptr_t stream) {
  const std::vector<View> parts = views_of_parts(parts_);
  View scale;
  if (scale_) scale = view_of(*scale_, "scale");
  StackedFp8 r =
      quantize_stacked(parts, scale_ ? &scale : nullptr, fp8_format(fmt_), rowmajor, transpose, stream_of(stream));
  if (!rowmajor) r.q = new_tensor(kEmpty, NewDtype::kUInt8, parts[0], "q");
  if (!transpose) r.q_t = new_tensor(kEmpty, NewDtype::kUInt8, parts[0], "q_t");
  if (scale_) return nb::make_tuple(r.q.tensor, r.q_t.tensor);
  return nb::make_tuple(r.q.tensor, r.q_t.tensor, r.scale.tensor);
}

// parts: 1..4 row blocks [rows_i, cols] of FP8 codes; returns the transpose [cols, sum rows_i].
nb::object transpose_stacked_codes_py(const std::vector<Array>& parts_, uintptr_t stream) {
  const std::vector<View> parts = views_of_parts(parts_);
  const StackedRows x = stacked_of(parts, true);
  Created q_t = new_tensor({x.cols, total_rows(x)}, NewDtype::kUInt8, parts[0], "q_t");
  auto* qt = static_cast<uint8_t*>(q_t.view.data);
  if (parts[0].cuda)
    COAT_GPU_CALL(transpose_stacked_codes(x, qt, stream_of(stream)));
  else
    ref::transpose_stacked_codes(x, qt);
  return q_t.tensor;
}

// amax [1] (fp32): max |X| over the finite values of the stacked parts (float dtypes).
nb::object amax_stacked_py(const std::vector<Array>& parts_, uintptr_t stream) {
  const std::vector<View> parts = views_of_parts(parts_);
  const StackedRows x = stacked_of(parts, false);
  Created amax = new_tensor({1}, NewDtype::kFloat32, parts[0], "amax");
  auto* a = static_cast<float*>(amax.view.data);
  if (parts[0].cuda)
    COAT_GPU_CALL(amax_stacked(x, a, stream_of(stream)));
  else
    ref::amax_stacked(x, a);
  return amax.tensor;
}

// (q [R, cols], scale) of the stacked parts with the scale of the max of part_amax (quantize.h
// quantize_stacked_from_part_amax): the optimizer's amax of each part, as coat's layer block takes it.
nb::tuple quantize_stacked_from_part_amax_py(const std::vector<Array>& parts_, const std::vector<Array>& amax_,
                                             int fmt_, uintptr_t stream) {
  const std::vector<View> parts = views_of_parts(parts_);
  std::vector<View> amax;
  for (size_t i = 0; i < amax_.size(); ++i) amax.push_back(view_of(amax_[i], "part_amax"));
  StackedFp8 r = quantize_stacked_part_amax(parts, amax, fp8_format(fmt_), stream_of(stream));
  return nb::make_tuple(r.q.tensor, r.scale.tensor);
}

// amax [G] (fp32): amax_stacked of each group of stacked parts, in one call (FP8 all-gather's
// refresh of an FSDP2 unit: one binding call for all its weight groups, not one op per group).
nb::object amax_groups_py(const std::vector<std::vector<Array>>& groups, uintptr_t stream) {
  COAT_CHECK_ARG(!groups.empty(), "groups must hold at least one group");
  std::vector<std::vector<View>> views;
  for (const auto& g : groups) views.push_back(views_of_parts(g));
  Created amax = new_tensor({static_cast<int64_t>(groups.size())}, NewDtype::kFloat32, views[0][0], "amax");
  auto* a = static_cast<float*>(amax.view.data);
  for (size_t i = 0; i < views.size(); ++i) {
    same_device({&views[0][0], &views[i][0]});
    const StackedRows x = stacked_of(views[i], false);
    if (views[0][0].cuda)
      COAT_GPU_CALL(amax_stacked(x, a + i, stream_of(stream)));
    else
      ref::amax_stacked(x, a + i);
  }
  return amax.tensor;
}

// [(q_i [R_i, cols_i], scale_i)]: quantize_stacked_from_amax of each group with amax[i], in one call.
nb::list quantize_groups_from_amax_py(const std::vector<std::vector<Array>>& groups, const Array& amax_, int fmt_,
                                      uintptr_t stream) {
  const View amax = view_of(amax_, "amax");
  expect_kind(amax, Kind::kFloat32);
  expect_numel(amax, static_cast<int64_t>(groups.size()), "one fp32 amax per group");
  const Fp8Format fmt = fp8_format(fmt_);
  nb::list out;
  for (const auto& g : groups) {
    const std::vector<View> parts = views_of_parts(g);
    const StackedRows x = stacked_of(parts, false);
    const bool cuda = same_device({&parts[0], &amax});
    Created q = new_tensor({total_rows(x), x.cols}, NewDtype::kUInt8, parts[0], "q");
    Created scale = new_tensor({1}, NewDtype::kFloat32, parts[0], "scale");
    const float* a = static_cast<const float*>(amax.data) + out.size();
    auto* qd = static_cast<uint8_t*>(q.view.data);
    auto* s = static_cast<float*>(scale.view.data);
    if (cuda)
      COAT_GPU_CALL(quantize_stacked_from_amax(x, fmt, a, s, qd, nullptr, stream_of(stream)));
    else
      ref::quantize_stacked_from_amax(x, fmt, a, s, qd, nullptr);
    out.append(nb::make_tuple(q.tensor, scale.tensor));
  }
  return out;
}

// (q [R, cols], scale) of the stacked parts with the scale of a given amax (fp32 [1]): the codes
// and scale quantize_stacked computes when amax is the one it would find.
nb::tuple quantize_stacked_from_amax_py(const std::vector<Array>& parts_, const Array& amax_, int fmt_,
                                        uintptr_t stream) {
  const std::vector<View> parts = views_of_parts(parts_);
  const StackedRows x = stacked_of(parts, false);
  const View amax = view_of(amax_, "amax");
  expect_numel(amax, 1, "one fp32 amax");
  expect_kind(amax, Kind::kFloat32);
  const bool cuda = same_device({&parts[0], &amax});
  Created q = new_tensor({total_rows(x), x.cols}, NewDtype::kUInt8, parts[0], "q");
  Created scale = new_tensor({1}, NewDtype::kFloat32, parts[0], "scale");
  auto* qd = static_cast<uint8_t*>(q.view.data);
  const auto* a = static_cast<const float*>(amax.data);
  auto* s = static_cast<float*>(scale.view.data);
  if (cuda)
    COAT_GPU_CALL(quantize_stacked_from_amax(x, fp8_format(fmt_), a, s, qd, nullptr, stream_of(stream)));
  else
    ref::quantize_stacked_from_amax(x, fp8_format(fmt_), a, s, qd, nullptr);
  return nb::make_tuple(q.tensor, scale.tensor);
}

void check_group(const View& x, int group) {
  COAT_CHECK_ARG(group == 16 || group == 32 || group == 64 || group == 128,
                 "group_size must be 16, 32, 64 or 128, got " + std::to_string(group));
  COAT_CHECK_ARG(!x.shape.empty(), std::string(x.name) + " must have at least one dimension for per-group quantization");
  COAT_CHECK_ARG(x.last_dim() % group == 0,
                 "group_size " + std::to_string(group) + " does not divide the last dimension of " +
                     x.name + " (" + std::to_string(x.last_dim()) + ")");
}

// (q, scales [..., cols / group], fp32 or E8M0 bytes) of x in 1 x group groups.
nb::tuple quantize_per_group_py(const Array& x_, int group, int fmt_, int kind_, uintptr_t stream) {
  const View x = view_of(x_, "x");
  const DType dt = float_dtype(x);
  const Fp8Format fmt = fp8_format(fmt_);
  const ScaleKind kind = scale_kind(kind_);
  check_group(x, group);
  const bool cuda = same_device({&x});
  std::vector<int64_t> sshape = x.shape;
  sshape.back() /= group;
  Created q = new_tensor(x.shape, NewDtype::kUInt8, x, "q");
  Created scales = new_tensor(sshape, kind == ScaleKind::kE8M0 ? NewDtype::kUInt8 : NewDtype::kFloat32, x, "scales");
  auto* qd = static_cast<uint8_t*>(q.view.data);
  if (cuda)
    COAT_GPU_CALL(quantize_per_group(x.data, dt, x.rows(), x.last_dim(), group, fmt, kind, scales.view.data, qd,
                                     stream_of(stream)));
  else
    ref::quantize_per_group(x.data, dt, x.rows(), x.last_dim(), group, fmt, kind, scales.view.data, qd);
  return nb::make_tuple(q.tensor, scales.tensor);
}

// y = q * its group's scale as the core dtype `dtype`; the scale kind follows scales' dtype.
nb::object dequantize_per_group_py(const Array& q_, const Array& scales_, int group, int fmt_, int dtype,
                                   uintptr_t stream) {
  const View q = view_of(q_, "q"), scales = view_of(scales_, "scales");
  const Fp8Format fmt = fp8_format(fmt_);
  expect_kind(q, Kind::kUInt8);
  check_group(q, group);
  const ScaleKind kind = check_group_scales(scales, q.numel, group);
  const DType out = dtype_arg(dtype);
  const bool cuda = same_device({&q, &scales});
  Created y = new_tensor(q.shape, new_dtype(out), q, "y");
  const auto* qd = static_cast<const uint8_t*>(q.data);
  if (cuda)
    COAT_GPU_CALL(dequantize_per_group(qd, fmt, q.rows(), q.last_dim(), group, kind, scales.data, y.view.data, out,
                                       stream_of(stream)));
  else
    ref::dequantize_per_group(qd, fmt, q.rows(), q.last_dim(), group, kind, scales.data, y.view.data, out);
  return y.tensor;
}

void check_dre_meta(const View& gmax, const View& k16, int64_t n) {
  const int64_t groups = (n + kDreGroupSize - 1) / kDreGroupSize;
  expect_kind(gmax, Kind::kFloat32);
  expect_numel(gmax, groups, "one per group of 128");
  expect_kind(k16, Kind::kUInt8);
  expect_numel(k16, groups, "one per group of 128");
}

// (q, gmax, k16) of fp32 x: DRE codes and each 128-group's max and expansion exponent.
nb::tuple dre_quantize_py(const Array& x_, int fmt_, float log2_range, uintptr_t stream) {
  const View x = view_of(x_, "x");
  expect_kind(x, Kind::kFloat32);
  const Fp8Format fmt = fp8_format(fmt_);
  const bool cuda = same_device({&x});
  const int64_t groups = (x.numel + kDreGroupSize - 1) / kDreGroupSize;
  Created q = new_tensor(x.shape, NewDtype::kUInt8, x, "q");
  Created gmax = new_tensor({groups}, NewDtype::kFloat32, x, "gmax");
  Created k16 = new_tensor({groups}, NewDtype::kUInt8, x, "k16");
  const auto* xd = static_cast<const float*>(x.data);
  auto* qd = static_cast<uint8_t*>(q.view.data);
  auto* gd = static_cast<float*>(gmax.view.data);
  auto* kd = static_cast<uint8_t*>(k16.view.data);
  if (cuda)
    COAT_GPU_CALL(dre_quantize(xd, x.numel, fmt, log2_range, qd, gd, kd, stream_of(stream)));
  else
    ref::dre_quantize(xd, x.numel, fmt, log2_range, qd, gd, kd);
  return nb::make_tuple(q.tensor, gmax.tensor, k16.tensor);
}

// fp32 y decoded from DRE codes.
nb::object dre_dequantize_py(const Array& q_, const Array& gmax_, const Array& k16_, int fmt_, uintptr_t stream) {
  const View q = view_of(q_, "q"), gmax = view_of(gmax_, "gmax"), k16 = view_of(k16_, "k16");
  const Fp8Format fmt = fp8_format(fmt_);
  expect_kind(q, Kind::kUInt8);
  check_dre_meta(gmax, k16, q.numel);
  const bool cuda = same_device({&q, &gmax, &k16});
  Created y = new_tensor(q.shape, NewDtype::kFloat32, q, "y");
  const auto* qd = static_cast<const uint8_t*>(q.data);
  const auto* gd = static_cast<const float*>(gmax.data);
  const auto* kd = static_cast<const uint8_t*>(k16.data);
  auto* yd = static_cast<float*>(y.view.data);
  if (cuda)
    COAT_GPU_CALL(dre_dequantize(qd, gd, kd, q.numel, fmt, yd, stream_of(stream)));
  else
    ref::dre_dequantize(qd, gd, kd, q.numel, fmt, yd);
  return y.tensor;
}

// coat/operand_stats.h: adds x's statistics to counts (int64 [3]) and amax (fp32, one value), in place.
void fp8_operand_stats_py(const Array& x_, const Array& scale_, double half_sub, double clip, const Array& counts_,
                          const Array& amax_, uintptr_t stream) {
  const View x = view_of(x_, "x"), scale = view_of(scale_, "scale");
  const View counts = view_of(counts_, "counts"), amax = view_of(amax_, "amax");
  const DType dt = float_dtype(x);
  check_scale(scale);
  expect_kind(counts, Kind::kInt64);
  expect_numel(counts, 3, "the three counters");
  expect_kind(amax, Kind::kFloat32);
  expect_numel(amax, 1, "one amax");
  const bool cuda = same_device({&x, &scale, &counts, &amax});
  const auto* s = static_cast<const float*>(scale.data);
  auto* c = static_cast<int64_t*>(counts.data);
  auto* a = static_cast<float*>(amax.data);
  if (cuda)
    COAT_GPU_CALL(fp8_operand_stats(x.data, dt, x.numel, s, static_cast<float>(half_sub), static_cast<float>(clip), c, a,
                                    stream_of(stream)));
  else
    ref::fp8_operand_stats(x.data, dt, x.numel, s, static_cast<float>(half_sub), static_cast<float>(clip), c, a);
}

// (q or None, scale or None, q_t or None, scale_t or None): the stacked parts quantized as a GEMM
// operand [rows_pad, cols_pad] in `mode` and/or its transpose in `mode_t` (ScaleMode ids; -1: not
// made), zero-padded.
nb::tuple quantize_scaled_py(const std::vector<Array>& parts_, int64_t rows_pad, int64_t cols_pad, int fmt, int mode,
                             int mode_t, uintptr_t stream) {
  const std::vector<View> parts = views_of_parts(parts_);
  const bool make_q = mode >= 0, make_qt = mode_t >= 0;
  ScaledFp8 r = quantize_scaled(parts, rows_pad, cols_pad, fp8_format(fmt), make_q ? scale_mode_arg(mode, "mode") : ScaleMode::kRow,
                                make_qt ? scale_mode_arg(mode_t, "mode_t") : ScaleMode::kRow, make_q, make_qt,
                                stream_of(stream));
  auto obj = [](const Created& c) { return c.tensor.is_valid() ? c.tensor : nb::none(); };
  return nb::make_tuple(obj(r.q), obj(r.scale), obj(r.q_t), obj(r.scale_t));
}

void register_quantize(nb::module_& m) {
  m.def("quantize_scaled", &quantize_scaled_py, restore_device(), arg("parts"), arg("rows_pad"), arg("cols_pad"),
        arg("fmt"), arg("mode"), arg("mode_t"), arg("stream"));
  m.attr("DRE_GROUP_SIZE") = kDreGroupSize;
  m.attr("DRE_LOG2_RANGE_E4M3") = kDreLog2RangeE4M3;
  m.attr("DRE_LOG2_RANGE_E5M2") = kDreLog2RangeE5M2;
  m.def("quantize_per_tensor", &quantize_per_tensor_py, restore_device(), arg("x"), arg("scale"), arg("fmt"), arg("transpose"),
        arg("stream"));
  m.def("quantize_per_tensor_amax", &quantize_per_tensor_amax_py, restore_device(), arg("x"), arg("fmt"), arg("transpose"),
        arg("stream"));
  m.def("quantize_stacked", &quantize_stacked_py, restore_device(), arg("parts"), arg("scale").none(), arg("fmt"), arg("rowmajor"),
        arg("transpose"), arg("stream"));
  m.def("amax_stacked", &amax_stacked_py, restore_device(), arg("parts"), arg("stream"));
  m.def("amax_groups", &amax_groups_py, restore_device(), arg("groups"), arg("stream"));
  m.def("quantize_groups_from_amax", &quantize_groups_from_amax_py, restore_device(), arg("groups"), arg("amax"),
        arg("fmt"), arg("stream"));
  m.def("quantize_stacked_from_amax", &quantize_stacked_from_amax_py, restore_device(), arg("parts"), arg("amax"),
        arg("fmt"), arg("stream"));
  m.def("quantize_stacked_from_part_amax", &quantize_stacked_from_part_amax_py, restore_device(), arg("parts"),
        arg("part_amax"), arg("fmt"), arg("stream"));
  m.def("transpose_stacked_codes", &transpose_stacked_codes_py, restore_device(), arg("parts"), arg("stream"));
  m.def("dequantize_per_tensor", &dequantize_per_tensor_py, restore_device(), arg("q"), arg("scale"), arg("fmt"), arg("dtype"),
        arg("stream"));
  m.def("quantize_per_group", &quantize_per_group_py, restore_device(), arg("x"), arg("group_size"), arg("fmt"), arg("scale_kind"),
        arg("stream"));
  m.def("dequantize_per_group", &dequantize_per_group_py, restore_device(), arg("q"), arg("scales"), arg("group_size"), arg("fmt"),
        arg("dtype"), arg("stream"));
  m.def("dre_quantize", &dre_quantize_py, restore_device(), arg("x"), arg("fmt"), arg("log2_range"), arg("stream"));
  m.def("fp8_operand_stats", &fp8_operand_stats_py, restore_device(), arg("x"), arg("scale"), arg("half_sub"),
        arg("clip"), arg("counts"), arg("amax"), arg("stream"));
  m.def("dre_dequantize", &dre_dequantize_py, restore_device(), arg("q"), arg("gmax"), arg("k16"), arg("fmt"), arg("stream"));
}

}  // namespace

PerTensorFp8 quantize_amax(const View& x, Fp8Format fmt, bool transpose, cudaStream_t stream, const View* amax) {
  const DType dt = float_dtype(x);
  const bool cuda = amax != nullptr ? same_device({&x, amax}) : same_device({&x});
  PerTensorFp8 r;
  r.q = new_tensor(x.shape, NewDtype::kUInt8, x, "q");
  if (transpose) r.q_t = new_tensor(t_shape(x), NewDtype::kUInt8, x, "q_t");
  r.scale = new_tensor({1}, NewDtype::kFloat32, x, "scale");
  auto* qd = static_cast<uint8_t*>(r.q.view.data);
  auto* qt = transpose ? static_cast<uint8_t*>(r.q_t.view.data) : nullptr;
  auto* s = static_cast<float*>(r.scale.view.data);
  if (amax != nullptr) {  // the producer's: no amax pass
    expect_numel(*amax, 1, "one fp32 amax");
    expect_kind(*amax, Kind::kFloat32);
    StackedRows one;
    one.data[0] = x.data, one.rows[0] = x.rows(), one.count = 1, one.cols = x.last_dim(), one.dtype = dt;
    const auto* a = static_cast<const float*>(amax->data);
    if (cuda) COAT_GPU_CALL(::coat::quantize_stacked_from_amax(one, fmt, a, s, qd, qt, stream));
    else ref::quantize_stacked_from_amax(one, fmt, a, s, qd, qt);
    return r;
  }
  r.amax = new_tensor({1}, NewDtype::kFloat32, x, "amax");
  auto* a = static_cast<float*>(r.amax.view.data);
  if (cuda)
    COAT_GPU_CALL(::coat::quantize_per_tensor_amax(x.data, dt, x.rows(), x.last_dim(), fmt, a, s, qd, qt, stream));
  else
    ref::quantize_per_tensor_amax(x.data, dt, x.rows(), x.last_dim(), fmt, a, s, qd, qt);
  return r;
}

std::vector<View> views_of_parts(const std::vector<Array>& parts) {
  static const char* kNames[kMaxStackParts] = {"parts[0]", "parts[1]", "parts[2]", "parts[3]"};
  COAT_CHECK_ARG(!parts.empty() && parts.size() <= static_cast<size_t>(kMaxStackParts),
                 "parts must hold 1 to " + std::to_string(kMaxStackParts) + " tensors, got " +
                     std::to_string(parts.size()));
  std::vector<View> views;
  views.reserve(parts.size());
  for (size_t i = 0; i < parts.size(); ++i) views.push_back(view_of(parts[i], kNames[i]));
  return views;
}

StackedFp8 quantize_stacked(const std::vector<View>& parts, const View* scale, Fp8Format fmt, bool rowmajor,
                            bool transpose, cudaStream_t stream) {
  COAT_CHECK_ARG(rowmajor || transpose, "ask for rowmajor codes, transposed codes or both");
  const StackedRows x = stacked_of(parts, false);
  const View& p0 = parts[0];
  if (scale) {
    check_scale(*scale);
    same_device({&p0, scale});
  }
  const int64_t rows = total_rows(x);
  StackedFp8 r;
  if (rowmajor) r.q = new_tensor({rows, x.cols}, NewDtype::kUInt8, p0, "q");
  if (transpose) r.q_t = new_tensor({x.cols, rows}, NewDtype::kUInt8, p0, "q_t");
  if (!scale) {
    r.scale = new_tensor({1}, NewDtype::kFloat32, p0, "scale");
    r.amax = new_tensor({1}, NewDtype::kFloat32, p0, "amax");
  }
  const auto* sc = scale ? static_cast<const float*>(scale->data) : nullptr;
  auto* am = scale ? nullptr : static_cast<float*>(r.amax.view.data);
  auto* so = scale ? nullptr : static_cast<float*>(r.scale.view.data);
  auto* qd = rowmajor ? static_cast<uint8_t*>(r.q.view.data) : nullptr;
  auto* qtd = transpose ? static_cast<uint8_t*>(r.q_t.view.data) : nullptr;
  if (p0.cuda)
    COAT_GPU_CALL(::coat::quantize_stacked(x, fmt, sc, am, so, qd, qtd, stream));
  else
    ref::quantize_stacked(x, fmt, sc, am, so, qd, qtd);
  return r;
}

StackedFp8 quantize_stacked_part_amax(const std::vector<View>& parts, const std::vector<View>& part_amax,
                                      Fp8Format fmt, cudaStream_t stream) {
  const StackedRows x = stacked_of(parts, false);
  COAT_CHECK_ARG(part_amax.size() == parts.size(), "w_amax must hold one amax per weight: " +
                                                        std::to_string(parts.size()) + " weights, " +
                                                        std::to_string(part_amax.size()) + " amax tensors");
  const float* amax[kMaxStackParts] = {};
  for (size_t i = 0; i < part_amax.size(); ++i) {
    const View& a = part_amax[i];
    expect_numel(a, 1, "one fp32 amax");
    expect_kind(a, Kind::kFloat32);
    same_device({&parts[0], &a});
    amax[i] = static_cast<const float*>(a.data);
  }
  const View& p0 = parts[0];
  StackedFp8 r;
  r.q = new_tensor({total_rows(x), x.cols}, NewDtype::kUInt8, p0, "q");
  r.scale = new_tensor({1}, NewDtype::kFloat32, p0, "scale");
  auto* qd = static_cast<uint8_t*>(r.q.view.data);
  auto* so = static_cast<float*>(r.scale.view.data);
  if (p0.cuda)
    COAT_GPU_CALL(::coat::quantize_stacked_from_part_amax(x, fmt, amax, so, qd, nullptr, stream));
  else
    ref::quantize_stacked_from_part_amax(x, fmt, amax, so, qd, nullptr);
  return r;
}

ScaledFp8 quantize_scaled(const std::vector<View>& parts, int64_t rows_pad, int64_t cols_pad, Fp8Format fmt,
                          ScaleMode mode, ScaleMode mode_t, bool make_q, bool make_qt, cudaStream_t stream) {
  COAT_CHECK_ARG(make_q || make_qt, "ask for codes, transposed codes or both");
  const StackedRows x = stacked_of(parts, false);
  const View& p0 = parts[0];
  const int64_t rows = total_rows(x);
  COAT_CHECK_ARG(rows_pad >= rows && cols_pad >= x.cols,
                 "rows_pad and cols_pad must be at least X's [" + std::to_string(rows) + ", " + std::to_string(x.cols) +
                     "], got [" + std::to_string(rows_pad) + ", " + std::to_string(cols_pad) + "]");
  ScaledFp8 r;
  if (make_q) {
    r.q = new_tensor({rows_pad, cols_pad}, NewDtype::kUInt8, p0, "q");
    r.scale = new_tensor({scale_count(mode, rows_pad, cols_pad)}, NewDtype::kFloat32, p0, "scale");
  }
  if (make_qt) {
    r.q_t = new_tensor({cols_pad, rows_pad}, NewDtype::kUInt8, p0, "q_t");
    r.scale_t = new_tensor({scale_count(mode_t, cols_pad, rows_pad)}, NewDtype::kFloat32, p0, "scale_t");
  }
  auto* q = make_q ? static_cast<uint8_t*>(r.q.view.data) : nullptr;
  auto* s = make_q ? static_cast<float*>(r.scale.view.data) : nullptr;
  auto* qt = make_qt ? static_cast<uint8_t*>(r.q_t.view.data) : nullptr;
  auto* st = make_qt ? static_cast<float*>(r.scale_t.view.data) : nullptr;
  if (p0.cuda)
    COAT_GPU_CALL(::coat::quantize_scaled(x, rows_pad, cols_pad, fmt, mode, q, s, mode_t, qt, st, stream));
  else
    ref::quantize_scaled(x, rows_pad, cols_pad, fmt, mode, q, s, mode_t, qt, st);
  return r;
}

COAT_REGISTER_BINDINGS(quantize, register_quantize);

}  // namespace bind
}  // namespace coat
