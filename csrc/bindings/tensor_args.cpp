#include "tensor_args.h"

namespace coat {
namespace bind {

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kFloat32: return "float32";
    case Kind::kBFloat16: return "bfloat16";
    case Kind::kFloat16: return "float16";
    case Kind::kUInt8: return "uint8";
    case Kind::kInt64: return "int64";
    default: return "an unsupported dtype";
  }
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

DType float_dtype(const View& v) {
  switch (v.kind) {
    case Kind::kFloat32: return DType::kFloat32;
    case Kind::kBFloat16: return DType::kBFloat16;
    case Kind::kFloat16: return DType::kFloat16;
    default:
      throw_invalid(std::string(v.name) + " must be float32, bfloat16 or float16, got " +
                    v.dtype_name);
  }
}

NewDtype new_dtype(DType d) {
  switch (d) {
    case DType::kFloat32: return NewDtype::kFloat32;
    case DType::kBFloat16: return NewDtype::kBFloat16;
    default: return NewDtype::kFloat16;
  }
}

NewDtype new_dtype(Fp8Format f) { return f == Fp8Format::kE4M3 ? NewDtype::kE4M3 : NewDtype::kE5M2; }

NewDtype new_dtype_like(const View& v) {
  return v.kind == Kind::kUInt8 ? NewDtype::kUInt8 : new_dtype(float_dtype(v));
}

void expect_kind(const View& v, Kind k) {
  COAT_CHECK_ARG(v.kind == k, std::string(v.name) + " must be " + kind_name(k) + ", got " +
                                  v.dtype_name);
}

void expect_numel(const View& v, int64_t n, const std::string& what) {
  COAT_CHECK_ARG(v.numel == n, std::string(v.name) + " must have " + std::to_string(n) +
                                   " elements (" + what + "), got shape " + shape_str(v.shape));
}

void expect_2d(const View& v) {
  COAT_CHECK_ARG(v.shape.size() == 2, std::string(v.name) + " must be 2-D, got shape " + shape_str(v.shape));
}

void expect_same_shape(const View& v, const View& ref) {
  COAT_CHECK_ARG(v.shape == ref.shape, std::string(v.name) + " must have the shape of " + ref.name +
                                           " " + shape_str(ref.shape) + ", got " +
                                           shape_str(v.shape));
}

ScaleKind check_group_scales(const View& scales, int64_t numel, int64_t group) {
  COAT_CHECK_ARG(scales.kind == Kind::kFloat32 || scales.kind == Kind::kUInt8,
                 "scales must be float32 or uint8 (E8M0), got " + std::string(scales.dtype_name));
  expect_numel(scales, numel / group, "one per group of " + std::to_string(group));
  return scales.kind == Kind::kUInt8 ? ScaleKind::kE8M0 : ScaleKind::kFloat32;
}

Fp8Output new_fp8_output(bool given, Fp8Format fmt, bool e8m0, const View& like, int64_t group) {
  Fp8Output out;
  out.given = given;
  out.kind = e8m0 ? ScaleKind::kE8M0 : ScaleKind::kFloat32;
  if (!given) {
    out.q = new_tensor({0}, new_dtype(fmt), like, "q");
    out.scales = new_tensor({0}, NewDtype::kFloat32, like, "scales");
    return out;
  }
  COAT_CHECK_ARG(!like.shape.empty() && like.last_dim() % group == 0,
                 std::string("the last dimension of ") + like.name + " must be a multiple of " + std::to_string(group));
  std::vector<int64_t> sshape = like.shape;
  sshape.back() /= group;
  out.q = new_tensor(like.shape, new_dtype(fmt), like, "q");
  out.scales = new_tensor(sshape, e8m0 ? NewDtype::kUInt8 : NewDtype::kFloat32, like, "scales");
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

DType dtype_arg(int d) {
  COAT_CHECK_ARG(d >= 0 && d <= 2, "dtype must be 0 (float32), 1 (bfloat16) or 2 (float16), got " + std::to_string(d));
  return static_cast<DType>(d);
}

Fp8Format fp8_format(int f) {
  COAT_CHECK_ARG(f == 0 || f == 1, "fmt must be 0 (e4m3) or 1 (e5m2), got " + std::to_string(f));
  return static_cast<Fp8Format>(f);
}

ScaleMode scale_mode_arg(int m, const char* name) {
  COAT_CHECK_ARG(m >= 0 && m <= 3, std::string(name) + " must be 0 (tensor), 1 (row), 2 (1x128) or 3 (128x128), got " +
                                       std::to_string(m));
  return static_cast<ScaleMode>(m);
}

ScaleKind scale_kind(int k) {
  COAT_CHECK_ARG(k == 0 || k == 1, "scale kind must be 0 (fp32) or 1 (e8m0)");
  return static_cast<ScaleKind>(k);
}

}  // namespace bind
}  // namespace coat
