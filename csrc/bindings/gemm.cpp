// nanobind registration of the FP8 GEMM family.
#include "coat/gemm.h"
#include "registry.h"
#include "tensor_args.h"

namespace coat {
namespace bind {
namespace {

using nb::arg;

GemmOut out_type_arg(int t) {
  COAT_CHECK_ARG(t >= 0 && t <= 2, "out_type must be 0 (float32), 1 (bfloat16) or 2 (e4m3), got " + std::to_string(t));
  return static_cast<GemmOut>(t);
}

NewDtype out_dtype(GemmOut t) {
  return t == GemmOut::kFloat32 ? NewDtype::kFloat32 : t == GemmOut::kBFloat16 ? NewDtype::kBFloat16 : NewDtype::kE4M3;
}

void expect_2d(const View& v) {
  COAT_CHECK_ARG(v.shape.size() == 2, std::string(v.name) + " must be 2-D, got shape " +
                                          shape_str(v.shape));
}

// (out [M, N] of out_type, amax or None): out = (a * scale_a) @ (b * scale_b).T (+ bias), and with
// want_amax its max |.| before the output rounding. CUDA needs `workspace` (cuBLASLt's, reused
// across calls); the bf16 path's scratch is made here.
nb::tuple gemm_fp8_py(const Array& a_, int a_fmt, const Array& scale_a_, const Array& b_, int b_fmt,
                      const Array& scale_b_, std::optional<Array> bias_, int out_type, std::optional<Array> out_scale_,
                      bool want_amax, std::optional<MutArray> workspace_, bool force_bf16, bool fast_accum,
                      uintptr_t stream) {
  const View a = view_of(a_, "a"), b = view_of(b_, "b"), sa = view_of(scale_a_, "scale_a"),
             sb = view_of(scale_b_, "scale_b");
  expect_kind(a, Kind::kUInt8);
  expect_kind(b, Kind::kUInt8);
  expect_2d(a);
  expect_2d(b);
  COAT_CHECK_ARG(a.shape[1] == b.shape[1], "b must have the K of a (a is " + shape_str(a.shape) +
                                               " = [M, K], b is " + shape_str(b.shape) + " = [N, K])");
  expect_kind(sa, Kind::kFloat32);
  expect_numel(sa, 1, "one per-tensor scale");
  expect_kind(sb, Kind::kFloat32);
  expect_numel(sb, 1, "one per-tensor scale");
  Fp8GemmArgs g;
  g.m = a.shape[0];
  g.n = b.shape[0];
  g.k = a.shape[1];
  g.out_type = out_type_arg(out_type);
  std::vector<const View*> all{&a, &sa, &b, &sb};
  View bias, out_scale, ws;
  if (bias_) {
    bias = view_of(*bias_, "bias");
    expect_kind(bias, Kind::kBFloat16);
    expect_numel(bias, g.n, "one per output column");
    all.push_back(&bias);
  }
  if (out_scale_) {
    out_scale = view_of(*out_scale_, "out_scale");
    expect_kind(out_scale, Kind::kFloat32);
    expect_numel(out_scale, 1, "one per-tensor scale");
    all.push_back(&out_scale);
  }
  if (workspace_) {
    ws = view_of(*workspace_, "workspace");
    expect_kind(ws, Kind::kUInt8);
    all.push_back(&ws);
  }
  // same_device takes an initializer_list; check pairwise against a instead.
  for (const View* v : all) same_device({&a, v});
  Created out = new_tensor({g.m, g.n}, out_dtype(g.out_type), a, "out");
  Created amax;
  if (want_amax) amax = new_tensor({1}, NewDtype::kFloat32, a, "amax");
  g.a = static_cast<const uint8_t*>(a.data);
  g.a_fmt = fp8_format(a_fmt);
  g.a_scale = static_cast<const float*>(sa.data);
  g.b = static_cast<const uint8_t*>(b.data);
  g.b_fmt = fp8_format(b_fmt);
  g.b_scale = static_cast<const float*>(sb.data);
  g.bias = bias_ ? bias.data : nullptr;
  g.out = out.view.data;
  g.out_scale = out_scale_ ? static_cast<const float*>(out_scale.data) : nullptr;
  g.amax = want_amax ? static_cast<float*>(amax.view.data) : nullptr;
  g.fast_accum = fast_accum;
  const nb::object amax_out = want_amax ? amax.tensor : nb::none();
  if (!a.cuda) {
    ref::gemm_fp8(g);
    return nb::make_tuple(out.tensor, amax_out);
  }
#ifdef COAT_WITH_CUDA
  COAT_CHECK_ARG(workspace_.has_value(), "workspace is required for CUDA tensors");
  const size_t need = gemm_fp8_scratch_bytes(a.device, g.m, g.n, g.k, g.out_type, force_bf16);
  nb::object keep;
  void* scratch = need ? new_scratch(static_cast<int64_t>(need), a, keep) : nullptr;
  gemm_fp8(g, ws.data, static_cast<size_t>(ws.numel), scratch, need, force_bf16, stream_of(stream));
#else
  (void)force_bf16;
  (void)stream;
  require_cuda_build();
#endif
  return nb::make_tuple(out.tensor, amax_out);
}

bool gemm_fp8_native_py(int device) {
#ifdef COAT_WITH_CUDA
  return gemm_fp8_native(device);
#else
  (void)device;
  return false;
#endif
}

void register_gemm(nb::module_& m) {
  m.attr("GEMM_WORKSPACE_BYTES") = kGemmDefaultWorkspace;
  m.def("gemm_fp8", &gemm_fp8_py, arg("a"), arg("a_fmt"), arg("scale_a"), arg("b"), arg("b_fmt"),
        arg("scale_b"), arg("bias").none(), arg("out_type"), arg("out_scale").none(), arg("want_amax"),
        arg("workspace").none(), arg("force_bf16"), arg("fast_accum"), arg("stream"));
  m.def("gemm_fp8_native", &gemm_fp8_native_py, arg("device"));
}

}  // namespace

COAT_REGISTER_BINDINGS(gemm, register_gemm);

}  // namespace bind
}  // namespace coat
