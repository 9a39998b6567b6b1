#include "tensor_args.h"

#include <deque>

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

namespace {

PyObject* interned(const char* s) {
  PyObject* o = PyUnicode_InternFromString(s);
  if (o == nullptr) throw nb::python_error();
  return o;
}

// Attribute names, interned once (the GIL is held whenever a binding runs).
struct Names {
  PyObject* data_ptr = interned("data_ptr");
  PyObject* dtype = interned("dtype");
  PyObject* shape = interned("shape");
  PyObject* is_contiguous = interned("is_contiguous");
  PyObject* is_cuda = interned("is_cuda");
  PyObject* is_cpu = interned("is_cpu");
  PyObject* get_device = interned("get_device");
};
const Names& names() {
  static const Names n;
  return n;
}

nb::object attr(PyObject* o, PyObject* name) {
  PyObject* r = PyObject_GetAttr(o, name);
  if (r == nullptr) throw nb::python_error();
  return nb::steal(r);
}

nb::object call0(PyObject* o, PyObject* name) {
  PyObject* r = PyObject_CallMethodNoArgs(o, name);
  if (r == nullptr) throw nb::python_error();
  return nb::steal(r);
}

Kind kind_of_name(const std::string& s) {
  if (s == "torch.float32") return Kind::kFloat32;
  if (s == "torch.bfloat16") return Kind::kBFloat16;
  if (s == "torch.float16") return Kind::kFloat16;
  if (s == "torch.int64") return Kind::kInt64;
  // FP8 codes are bytes; their format travels as an explicit argument.
  if (s == "torch.uint8" || s == "torch.float8_e4m3fn" || s == "torch.float8_e5m2") return Kind::kUInt8;
  return Kind::kOther;
}

// dtype objects are process-lifetime singletons: map each once by identity. The name is kept for
// error messages ("got float64").
struct DtypeEntry {
  PyObject* obj;
  Kind kind;
  std::string name;
};
const DtypeEntry& dtype_entry(PyObject* dtype) {
  static std::deque<DtypeEntry> seen;  // deque: entries never move
  for (const auto& e : seen)
    if (e.obj == dtype) return e;
  std::string s = nb::str(nb::handle(dtype)).c_str();
  const Kind k = kind_of_name(s);
  if (s.rfind("torch.", 0) == 0) s = s.substr(6);
  Py_INCREF(dtype);
  seen.push_back({dtype, k, s});
  return seen.back();
}

bool truthy(const nb::object& o) {
  const int t = PyObject_IsTrue(o.ptr());
  if (t < 0) throw nb::python_error();
  return t == 1;
}

}  // namespace

View view_of(const TensorArg& a, const char* name) {
  const Names& n = names();
  PyObject* o = a.obj.ptr();
  View v;
  v.name = name;
  PyObject* is_cuda = PyObject_GetAttr(o, n.is_cuda);
  if (is_cuda == nullptr) {
    PyErr_Clear();
    throw_invalid(std::string(name) + " must be a torch.Tensor, got " + nb::type_name(a.obj.type()).c_str());
  }
  v.cuda = truthy(nb::steal(is_cuda));
  COAT_CHECK_ARG(v.cuda || truthy(attr(o, n.is_cpu)), std::string(name) + " must be a CPU or CUDA tensor");
  v.device = v.cuda ? static_cast<int>(PyLong_AsLong(call0(o, n.get_device).ptr())) : 0;
  const DtypeEntry& dt = dtype_entry(attr(o, n.dtype).ptr());
  v.kind = dt.kind;
  v.dtype_name = dt.name.c_str();
  const nb::object shape = attr(o, n.shape);
  const Py_ssize_t nd = PyTuple_Check(shape.ptr()) ? PyTuple_GET_SIZE(shape.ptr()) : -1;
  COAT_CHECK_ARG(nd >= 0, std::string(name) + " has no tuple shape");
  v.shape.resize(static_cast<size_t>(nd));
  v.numel = 1;
  for (Py_ssize_t i = 0; i < nd; ++i) {
    v.shape[static_cast<size_t>(i)] = PyLong_AsLongLong(PyTuple_GET_ITEM(shape.ptr(), i));
    v.numel *= v.shape[static_cast<size_t>(i)];
  }
  COAT_CHECK_ARG(truthy(call0(o, n.is_contiguous)),
                 std::string(name) + " must be contiguous (call " + name + ".contiguous() first)");
  v.data = reinterpret_cast<void*>(
      static_cast<uintptr_t>(PyLong_AsUnsignedLongLong(call0(o, n.data_ptr).ptr())));
  if (PyErr_Occurred()) throw nb::python_error();
  return v;
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

void expect_kind(const View& v, Kind k) {
  COAT_CHECK_ARG(v.kind == k, std::string(v.name) + " must be " + kind_name(k) + ", got " +
                                  v.dtype_name);
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
                 "scales must be float32 or uint8 (E8M0), got " + std::string(scales.dtype_name));
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
