#include "tensor_args.h"

namespace coat {
namespace bind {

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kFloat32: return "float32";
    case Kind::kBFloat16: return "bfloat16";
    case Kind::kFloat16: return "float16";
    case Kind::kUInt8: return "uint8";
    default: return "an unsupported dtype";
  }
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

static Kind kind_of(nb::dlpack::dtype t) {
  using C = nb::dlpack::dtype_code;
  if (t.lanes != 1) return Kind::kOther;
  if (t.code == static_cast<uint8_t>(C::Float) && t.bits == 32) return Kind::kFloat32;
  if (t.code == static_cast<uint8_t>(C::Float) && t.bits == 16) return Kind::kFloat16;
  if (t.code == static_cast<uint8_t>(C::Bfloat) && t.bits == 16) return Kind::kBFloat16;
  if (t.code == static_cast<uint8_t>(C::UInt) && t.bits == 8) return Kind::kUInt8;
  return Kind::kOther;
}

template <typename A>
View view_of(const A& a, const char* name) {
  View v;
  v.name = name;
  v.data = const_cast<void*>(static_cast<const void*>(a.data()));
  v.kind = kind_of(a.dtype());
  const int dt = a.device_type();
  COAT_CHECK_ARG(dt == nb::device::cpu::value || dt == nb::device::cuda::value,
                 std::string(name) + " must be a CPU or CUDA tensor");
  v.cuda = dt == nb::device::cuda::value;
  v.device = a.device_id();
  int64_t expect = 1;
  v.shape.resize(a.ndim());
  for (size_t i = 0; i < a.ndim(); ++i) v.shape[i] = static_cast<int64_t>(a.shape(i));
  v.numel = 1;
  for (int64_t s : v.shape) v.numel *= s;
  // C-contiguous: strides (in elements) are the suffix products, ignoring size-1 dims.
  for (size_t i = a.ndim(); i-- > 0;) {
    if (v.shape[i] != 1 && v.numel != 0)
      COAT_CHECK_ARG(a.stride(i) == expect, std::string(name) + " must be contiguous (call " + name +
                                                ".contiguous() first)");
    expect *= v.shape[i];
  }
  return v;
}
template View view_of<Array>(const Array&, const char*);
template View view_of<MutArray>(const MutArray&, const char*);

DType float_dtype(const View& v) {
  switch (v.kind) {
    case Kind::kFloat32: return DType::kFloat32;
    case Kind::kBFloat16: return DType::kBFloat16;
    case Kind::kFloat16: return DType::kFloat16;
    default:
      throw_invalid(std::string(v.name) + " must be float32, bfloat16 or float16, got " +
                    kind_name(v.kind));
  }
}

void expect_kind(const View& v, Kind k) {
  COAT_CHECK_ARG(v.kind == k, std::string(v.name) + " must be " + kind_name(k) + ", got " +
                                  kind_name(v.kind));
}

void expect_numel(const View& v, int64_t n, const std::string& what) {
  COAT_CHECK_ARG(v.numel == n, std::string(v.name) + " must have " + std::to_string(n) +
                                   " elements (" + what + "), got shape " + shape_str(v.shape));
}

void expect_same_shape(const View& v, const View& ref) {
  COAT_CHECK_ARG(v.shape == ref.shape, std::string(v.name) + " must have the shape of " + ref.name +
                                           " " + shape_str(ref.shape) + ", got " +
                                           shape_str(v.shape));
}

ScaleKind check_group_scales(const View& scales, int64_t numel, int64_t group) {
  COAT_CHECK_ARG(scales.kind == Kind::kFloat32 || scales.kind == Kind::kUInt8,
                 "scales must be float32 or uint8 (E8M0), got " + std::string(kind_name(scales.kind)));
  expect_numel(scales, numel / group, "one per group of " + std::to_string(group));
  return scales.kind == Kind::kUInt8 ? ScaleKind::kE8M0 : ScaleKind::kFloat32;
}

Fp8Output optional_fp8_output(const std::optional<MutArray>& q, const std::optional<MutArray>& scales,
                              const View& like, int64_t group) {
  COAT_CHECK_ARG(q.has_value() == scales.has_value(), "q and scales must be given together");
  Fp8Output out;
  if (!q) return out;
  out.given = true;
  out.q = view_of(*q, "q");
  out.scales = view_of(*scales, "scales");
  expect_kind(out.q, Kind::kUInt8);
  expect_same_shape(out.q, like);
  out.kind = check_group_scales(out.scales, like.numel, group);
  return out;
}

void require_cuda_build() {
  COAT_CHECK_ARG(built_with_cuda(),
                 "coat was built without CUDA kernels; reinstall it where nvcc is available to use "
                 "CUDA tensors");
}

bool same_device(std::initializer_list<const View*> views) {
  const View* first = *views.begin();
  for (const View* v : views) {
    COAT_CHECK_ARG(v->cuda == first->cuda && v->device == first->device,
                   std::string(v->name) + " is on a different device than " + first->name);
  }
  if (first->cuda) {
    require_cuda_build();
    set_current_device(first->device);
  }
  return first->cuda;
}

Fp8Format fp8_format(int f) {
  COAT_CHECK_ARG(f == 0 || f == 1, "fmt must be 0 (e4m3) or 1 (e5m2), got " + std::to_string(f));
  return static_cast<Fp8Format>(f);
}

ScaleKind scale_kind(int k) {
  COAT_CHECK_ARG(k == 0 || k == 1, "scale kind must be 0 (fp32) or 1 (e8m0)");
  return static_cast<ScaleKind>(k);
}

}  // namespace bind
}  // namespace coat
