// nanobind registration of the FP8 GEMM family.
#include "coat/gemm.h"
#include "registry.h"
#include "tensor_args.h"

namespace coat {
namespace bind {
namespace {

using nb::arg;

GemmOut out_type_of(const View& out) {
  switch (out.kind) {
    case Kind::kFloat32: return GemmOut::kFloat32;
    case Kind::kBFloat16: return GemmOut::kBFloat16;
    case Kind::kUInt8: return GemmOut::kE4M3;
    default:
      throw_invalid(std::string("out must be float32, bfloat16 or uint8 (e4m3 codes), got ") +
                    out.dtype_name);
  }
}

void expect_2d(const View& v) {
  COAT_CHECK_ARG(v.shape.size() == 2, std::string(v.name) + " must be 2-D, got shape " +
                                          shape_str(v.shape));
}

void gemm_fp8_py(const Array& a_, int a_fmt, const Array& scale_a_, const Array& b_, int b_fmt,
                 const Array& scale_b_, std::optional<Array> bias_, MutArray out_,
                 std::optional<Array> out_scale_, std::optional<MutArray> amax_,
                 std::optional<MutArray> workspace_, std::optional<MutArray> scratch_,
                 bool force_bf16, bool fast_accum, uintptr_t stream) {
  const View a = view_of(a_, "a"), b = view_of(b_, "b"), sa = view_of(scale_a_, "scale_a"),
             sb = view_of(scale_b_, "scale_b"), out = view_of(out_, "out");
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
  g.out_type = out_type_of(out);
  COAT_CHECK_ARG(out.shape == std::vector<int64_t>({g.m, g.n}),
                 "out must have shape [M, N] = [" + std::to_string(g.m) + ", " + std::to_string(g.n) +
                     "], got " + shape_str(out.shape));
  std::vector<const View*> all{&a, &sa, &b, &sb, &out};
  View bias, out_scale, amax, ws, scratch;
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
  if (amax_) {
    amax = view_of(*amax_, "amax");
    expect_kind(amax, Kind::kFloat32);
    expect_numel(amax, 1, "one amax");
    all.push_back(&amax);
  }
  if (workspace_) {
    ws = view_of(*workspace_, "workspace");
    expect_kind(ws, Kind::kUInt8);
    all.push_back(&ws);
  }
  if (scratch_) {
    scratch = view_of(*scratch_, "scratch");
    expect_kind(scratch, Kind::kUInt8);
    all.push_back(&scratch);
  }
  g.a = static_cast<const uint8_t*>(a.data);
  g.a_fmt = fp8_format(a_fmt);
  g.a_scale = static_cast<const float*>(sa.data);
  g.b = static_cast<const uint8_t*>(b.data);
  g.b_fmt = fp8_format(b_fmt);
  g.b_scale = static_cast<const float*>(sb.data);
  g.bias = bias_ ? bias.data : nullptr;
  g.out = out.data;
  g.out_scale = out_scale_ ? static_cast<const float*>(out_scale.data) : nullptr;
  g.amax = amax_ ? static_cast<float*>(amax.data) : nullptr;
  g.fast_accum = fast_accum;
  // same_device takes an initializer_list; check pairwise against a instead.
  for (const View* v : all) same_device({&a, v});
  if (!a.cuda) {
    ref::gemm_fp8(g);
    return;
  }
#ifdef COAT_WITH_CUDA
  COAT_CHECK_ARG(workspace_.has_value(), "workspace is required for CUDA tensors");
  gemm_fp8(g, ws.data, static_cast<size_t>(ws.numel), scratch_ ? scratch.data : nullptr,
           scratch_ ? static_cast<size_t>(scratch.numel) : 0, force_bf16, stream_of(stream));
#else
  (void)force_bf16;
  (void)stream;
  require_cuda_build();
#endif
}

size_t gemm_fp8_scratch_bytes_py(int device, int64_t m, int64_t n, int64_t k, int out_type,
                                 bool force_bf16) {
  COAT_CHECK_ARG(out_type >= 0 && out_type <= 2, "out_type must be 0 (fp32), 1 (bf16) or 2 (e4m3)");
#ifdef COAT_WITH_CUDA
  return gemm_fp8_scratch_bytes(device, m, n, k, static_cast<GemmOut>(out_type), force_bf16);
#else
  (void)device; (void)m; (void)n; (void)k; (void)force_bf16;
  require_cuda_build();
  return 0;
#endif
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
        arg("scale_b"), arg("bias").none(), arg("out"), arg("out_scale").none(), arg("amax").none(),
        arg("workspace").none(), arg("scratch").none(), arg("force_bf16"), arg("fast_accum"),
        arg("stream"));
  m.def("gemm_fp8_scratch_bytes", &gemm_fp8_scratch_bytes_py, arg("device"), arg("m"), arg("n"),
        arg("k"), arg("out_type"), arg("force_bf16"));
  m.def("gemm_fp8_native", &gemm_fp8_native_py, arg("device"));
}

}  // namespace

COAT_REGISTER_BINDINGS(gemm, register_gemm);

}  // namespace bind
}  // namespace coat
