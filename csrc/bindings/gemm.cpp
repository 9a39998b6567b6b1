// nanobind registration of the FP8 GEMM family.
#include "coat/gemm.h"
#include "ops.h"
#include "enums.h"
#include "registry.h"
#include "tensor_args.h"

namespace coat {
namespace bind {
namespace {

using nb::arg;

NewDtype out_dtype(GemmOut t) {
  return t == GemmOut::kFloat32 ? NewDtype::kFloat32 : t == GemmOut::kBFloat16 ? NewDtype::kBFloat16 : NewDtype::kE4M3;
}

// (out [M, N] of out_type, amax or None): out = (a * scale_a) @ (b * scale_b).T (+ bias), and with
// want_amax its max |.| before the output rounding. CUDA needs `workspace` (cuBLASLt's, reused
// across calls); the bf16 path's scratch is made here.
nb::tuple gemm_fp8_py(const Array& a_, int a_fmt, const Array& scale_a_, const Array& b_, int b_fmt,
                      const Array& scale_b_, std::optional<Array> bias_, int out_type, std::optional<Array> out_scale_,
                      bool want_amax, std::optional<MutArray> workspace_, bool force_bf16, bool fast_accum,
                      uintptr_t stream, int a_mode, int b_mode) {
  const View a = view_of(a_, "a"), b = view_of(b_, "b"), sa = view_of(scale_a_, "scale_a"),
             sb = view_of(scale_b_, "scale_b");
  View bias, out_scale, ws;
  GemmOptions opt;
  if (bias_) opt.bias = &(bias = view_of(*bias_, "bias"));
  if (out_scale_) opt.out_scale = &(out_scale = view_of(*out_scale_, "out_scale"));
  if (workspace_) opt.workspace = &(ws = view_of(*workspace_, "workspace"));
  opt.want_amax = want_amax;
  opt.force_bf16 = force_bf16;
  opt.fast_accum = fast_accum;
  opt.a_mode = scale_mode_arg(a_mode, "a_mode");
  opt.b_mode = scale_mode_arg(b_mode, "b_mode");
  const GemmResult r = gemm_fp8(a, fp8_format(a_fmt), sa, b, fp8_format(b_fmt), sb, gemm_out_type(out_type), opt,
                                stream_of(stream));
  return nb::make_tuple(r.out.tensor, want_amax ? r.amax.tensor : nb::none());
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
  m.def("gemm_fp8", &gemm_fp8_py, restore_device(), arg("a"), arg("a_fmt"), arg("scale_a"), arg("b"), arg("b_fmt"),
        arg("scale_b"), arg("bias").none(), arg("out_type"), arg("out_scale").none(), arg("want_amax"),
        arg("workspace").none(), arg("force_bf16"), arg("fast_accum"), arg("stream"), arg("a_mode") = 0,
        arg("b_mode") = 0);
  m.attr("SCALE_MODES") = enum_dict<ScaleMode>({{"tensor", ScaleMode::kTensor}, {"row", ScaleMode::kRow},
                                                {"1x128", ScaleMode::kVec128}, {"128x128", ScaleMode::kBlock128}});
  m.def("gemm_fp8_native", &gemm_fp8_native_py, restore_device(), arg("device"));
}

}  // namespace

GemmOut gemm_out_type(int t) {
  COAT_CHECK_ARG(t >= 0 && t <= 2, "out_type must be 0 (float32), 1 (bfloat16) or 2 (e4m3), got " + std::to_string(t));
  return static_cast<GemmOut>(t);
}

GemmResult gemm_fp8(const View& a, Fp8Format a_fmt, const View& sa, const View& b, Fp8Format b_fmt, const View& sb,
                    GemmOut out_type, const GemmOptions& opt, cudaStream_t stream) {
  expect_kind(a, Kind::kUInt8);
  expect_kind(b, Kind::kUInt8);
  expect_2d(a);
  expect_2d(b);
  COAT_CHECK_ARG(a.shape[1] == b.shape[1], "b must have the K of a (" + std::string(a.name) + " is " +
                                               shape_str(a.shape) + " = [M, K], " + b.name + " is " +
                                               shape_str(b.shape) + " = [N, K])");
  expect_kind(sa, Kind::kFloat32);
  expect_numel(sa, scale_count(opt.a_mode, a.shape[0], a.shape[1]),
               std::string("its ") + scale_mode_name(opt.a_mode) + " scales for " + shape_str(a.shape));
  expect_kind(sb, Kind::kFloat32);
  expect_numel(sb, scale_count(opt.b_mode, b.shape[0], b.shape[1]),
               std::string("its ") + scale_mode_name(opt.b_mode) + " scales for " + shape_str(b.shape));
  Fp8GemmArgs g;
  g.m = a.shape[0];
  g.n = b.shape[0];
  g.k = a.shape[1];
  g.out_type = out_type;
  for (const View* v : {&sa, &b, &sb}) same_device({&a, v});
  if (opt.bias) {
    expect_kind(*opt.bias, Kind::kBFloat16);
    expect_numel(*opt.bias, g.n, "one per output column");
    same_device({&a, opt.bias});
  }
  if (opt.out_scale) {
    expect_kind(*opt.out_scale, Kind::kFloat32);
    expect_numel(*opt.out_scale, 1, "one per-tensor scale");
    same_device({&a, opt.out_scale});
  }
  if (opt.workspace) {
    expect_kind(*opt.workspace, Kind::kUInt8);
    same_device({&a, opt.workspace});
  }
  GemmResult r;
  r.out = new_tensor({g.m, g.n}, out_dtype(g.out_type), a, "out");
  if (opt.want_amax) r.amax = new_tensor({1}, NewDtype::kFloat32, a, "amax");
  g.a = static_cast<const uint8_t*>(a.data);
  g.a_fmt = a_fmt;
  g.a_scale = static_cast<const float*>(sa.data);
  g.b = static_cast<const uint8_t*>(b.data);
  g.b_fmt = b_fmt;
  g.b_scale = static_cast<const float*>(sb.data);
  g.bias = opt.bias ? opt.bias->data : nullptr;
  g.out = r.out.view.data;
  g.out_scale = opt.out_scale ? static_cast<const float*>(opt.out_scale->data) : nullptr;
  g.amax = opt.want_amax ? static_cast<float*>(r.amax.view.data) : nullptr;
  g.fast_accum = opt.fast_accum;
  g.a_mode = opt.a_mode;
  g.b_mode = opt.b_mode;
  if (!a.cuda) {
    ref::gemm_fp8(g);
    return r;
  }
#ifdef COAT_WITH_CUDA
  COAT_CHECK_ARG(opt.workspace != nullptr, "workspace is required for CUDA tensors");
  const size_t need = gemm_fp8_scratch_bytes(a.device, g.m, g.n, g.k, g.out_type, opt.force_bf16);
  nb::object keep;
  void* scratch = need ? new_scratch(static_cast<int64_t>(need), a, keep) : nullptr;
  ::coat::gemm_fp8(g, opt.workspace->data, static_cast<size_t>(opt.workspace->numel), scratch, need, opt.force_bf16,
                   stream);
#else
  (void)stream;
  require_cuda_build();
#endif
  return r;
}

// Zero pad, GEMM, contiguous slice, cast: the steps coat.nn._fp8mm.fp8_mm takes for such shapes (the
// LM head's GEMMs), so that a block gives on the GPU what its single ops give there, bit for bit.
// The at:: ops run on torch's current stream, which is `stream` (the caller passes torch's).
Created gemm_fp8_any(const View& a, Fp8Format a_fmt, const View& sa, const View& b, Fp8Format b_fmt, const View& sb,
                     DType out, const GemmOptions& opt, cudaStream_t stream) {
  const GemmOut t = out == DType::kBFloat16 ? GemmOut::kBFloat16 : GemmOut::kFloat32;
  expect_2d(a);
  expect_2d(b);
  const int64_t m = a.shape[0], n = b.shape[0], k = a.shape[1];
  // Checked here, before any padding: zero columns padded onto the shorter operand would hide it.
  COAT_CHECK_ARG(b.shape[1] == k, "b must have the K of a (" + std::string(a.name) + " is " + shape_str(a.shape) +
                                      " = [M, K], " + b.name + " is " + shape_str(b.shape) + " = [N, K])");
  const int64_t kp = (k + 15) / 16 * 16, np = (n + 15) / 16 * 16;
  auto aligned = [](const View& v) { return reinterpret_cast<uintptr_t>(v.data) % 16 == 0; };
  Created r;
  // An empty result is made here: no GEMM, no alignment rule (N = 11 with no tokens is fine).
  if (m == 0 || n == 0)
    return new_tensor({m, n}, out == DType::kFloat16 ? NewDtype::kFloat16 : out_dtype(t), a, "out");
  // An empty K needs no cuBLASLt call (gemm_fp8 writes the [M, N] zeros itself, padded like any other).
  if (!a.cuda || (kp == k && np == n && aligned(a) && aligned(b))) {
    r = gemm_fp8(a, a_fmt, sa, b, b_fmt, sb, t, opt, stream).out;
  } else {
    Created ap = pad_2d(a, m, kp, a.name), bp = pad_2d(b, np, kp, b.name);
    r = gemm_fp8(ap.view, a_fmt, sa, bp.view, b_fmt, sb, t, opt, stream).out;
    if (np != n) r = narrow_2d(r.view, m, n, "out");
  }
  return out == DType::kFloat16 ? cast_to(r.view, NewDtype::kFloat16, "out") : r;
}

Created gemm_scaled(const Fp8Operand& a, const Fp8Operand& b, int64_t m, int64_t n, DType out, const GemmOptions& opt,
                    cudaStream_t stream) {
  if (a.mode == ScaleMode::kTensor && b.mode == ScaleMode::kTensor) {
    COAT_CHECK(a.q.shape[0] == m && b.q.shape[0] == n, "per-tensor operands are not padded");
    return gemm_fp8_any(a.q, a.fmt, a.scale, b.q, b.fmt, b.scale, out, opt, stream);
  }
  GemmOptions o = opt;
  o.a_mode = a.mode, o.b_mode = b.mode;
  const GemmOut t = out == DType::kBFloat16 ? GemmOut::kBFloat16 : GemmOut::kFloat32;
  Created r = gemm_fp8(a.q, a.fmt, a.scale, b.q, b.fmt, b.scale, t, o, stream).out;
  if (r.view.shape[0] != m || r.view.shape[1] != n) r = narrow_2d(r.view, m, n, "out");
  return out == DType::kFloat16 ? cast_to(r.view, NewDtype::kFloat16, "out") : r;
}

COAT_REGISTER_BINDINGS(gemm, register_gemm);

}  // namespace bind
}  // namespace coat
