// The bindings' one contact with torch's C++ API: reading tensor arguments (view_of) and creating
// output tensors (new_tensor). See tensor_args.h for why. Built against the installed torch; the
// module records that torch's version (TORCH_VERSION) so coat can refuse a mismatch at import.
#include <torch/csrc/autograd/python_variable.h>

#include <ATen/EmptyTensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>
#include <c10/core/Allocator.h>

#include "registry.h"
#include "tensor_args.h"

namespace coat {
namespace bind {
namespace {

// torch's Python names of dtypes ("float64"), for messages.
const char* torch_dtype_name(at::ScalarType st) {
  switch (st) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kByte: return "uint8";
    case at::kChar: return "int8";
    case at::kShort: return "int16";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    case at::kBool: return "bool";
    case at::kFloat8_e4m3fn: return "float8_e4m3fn";
    case at::kFloat8_e5m2: return "float8_e5m2";
    case at::kComplexFloat: return "complex64";
    case at::kComplexDouble: return "complex128";
    default: return c10::toString(st);
  }
}

Kind kind_of(at::ScalarType st) {
  switch (st) {
    case at::kFloat: return Kind::kFloat32;
    case at::kBFloat16: return Kind::kBFloat16;
    case at::kHalf: return Kind::kFloat16;
    case at::kLong: return Kind::kInt64;
    // FP8 codes are bytes; their format travels as an explicit argument.
    case at::kByte:
    case at::kFloat8_e4m3fn:
    case at::kFloat8_e5m2: return Kind::kUInt8;
    default: return Kind::kOther;
  }
}

at::ScalarType scalar_type(NewDtype d) {
  switch (d) {
    case NewDtype::kUInt8: return at::kByte;
    case NewDtype::kFloat32: return at::kFloat;
    case NewDtype::kBFloat16: return at::kBFloat16;
    case NewDtype::kFloat16: return at::kHalf;
    case NewDtype::kE4M3: return at::kFloat8_e4m3fn;
    default: return at::kFloat8_e5m2;
  }
}

void fill(View& v, const at::Tensor& t, const char* name) {
  v.name = name;
  const at::Device dev = t.device();
  v.cuda = dev.is_cuda();
  COAT_CHECK_ARG(v.cuda || dev.is_cpu(),
                 std::string(name) + " must be a CPU or CUDA tensor, got one on " + dev.str());
  v.device = v.cuda ? dev.index() : 0;
  const at::ScalarType st = t.scalar_type();
  v.kind = kind_of(st);
  v.dtype_name = torch_dtype_name(st);
  const auto sizes = t.sizes();
  v.shape.assign(sizes.begin(), sizes.end());
  v.numel = t.numel();
  COAT_CHECK_ARG(t.is_contiguous(), std::string(name) + " must be contiguous (call " + name + ".contiguous() first)");
  v.data = t.data_ptr();
}

}  // namespace

View view_of(const TensorArg& a, const char* name) {
  PyObject* o = a.obj.ptr();
  if (!THPVariable_Check(o))
    throw_invalid(std::string(name) + " must be a torch.Tensor, got " + nb::type_name(a.obj.type()).c_str());
  View v;
  try {
    fill(v, THPVariable_Unpack(o), name);
  } catch (const c10::Error& e) {  // e.g. a tensor subclass without storage of its own
    throw_invalid(std::string(name) + ": " + e.what_without_backtrace());
  }
  return v;
}

// A binding's output made by torch (new_tensor, the helpers below): the tensor and its view.
Created created_of(at::Tensor t, const char* name);

// torch's CUDA caching allocator as torch registers it (null if this torch has none).
c10::Allocator* cuda_allocator() {
  static c10::Allocator* const a = []() -> c10::Allocator* {
    try {
      return c10::GetAllocator(c10::DeviceType::CUDA);
    } catch (const c10::Error&) {
      return nullptr;
    }
  }();
  return a;
}

Created new_tensor(const std::vector<int64_t>& shape, NewDtype dtype, const View& like, const char* name) {
  // What at::empty does, without its trip through the dispatcher (a block call makes ~13 outputs
  // and intermediates): the caching allocator on the current device, which is made `like`'s.
  at::Tensor t;
  c10::Allocator* cuda = like.cuda ? cuda_allocator() : nullptr;
  if (cuda != nullptr) {
    set_current_device(like.device);
    t = at::detail::empty_generic(shape, cuda, c10::DispatchKeySet(c10::DispatchKey::CUDA), scalar_type(dtype),
                                  std::nullopt);
  } else if (!like.cuda) {
    t = at::detail::empty_cpu(shape, scalar_type(dtype));
  } else {
    t = at::empty(shape, at::TensorOptions().dtype(scalar_type(dtype)).device(
                             at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(like.device))));
  }
  return created_of(std::move(t), name);
}

// ---- the few torch ops a layer block needs around coat's GEMM (see tensor_args.h) ----------------

namespace {

at::ScalarType at_type(const View& v) {
  switch (v.kind) {
    case Kind::kFloat32: return at::kFloat;
    case Kind::kBFloat16: return at::kBFloat16;
    case Kind::kFloat16: return at::kHalf;
    case Kind::kUInt8: return at::kByte;
    default: throw_invalid(std::string(v.name) + ": no torch view of dtype " + v.dtype_name);
  }
  return at::kByte;
}

// v as an at::Tensor over its memory (no copy); ops on it run on torch's current stream, the one
// the block's kernels use.
at::TensorOptions options_of(const View& v) {
  at::TensorOptions o = at::TensorOptions().dtype(at_type(v));
  if (v.cuda) {
    set_current_device(v.device);
    o = o.device(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(v.device)));
  }
  return o;
}

at::Tensor tensor_of(const View& v) { return at::from_blob(v.data, v.shape, options_of(v)); }

}  // namespace

Created created_of(at::Tensor t, const char* name) {
  Created c;
  fill(c.view, t, name);
  c.tensor = nb::steal(THPVariable_Wrap(std::move(t)));
  if (!c.tensor.is_valid()) throw nb::python_error();
  return c;
}

Created pad_2d(const View& v, int64_t rows, int64_t cols, const char* name) {
  at::Tensor out = at::zeros({rows, cols}, options_of(v));
  if (v.numel != 0) out.narrow(0, 0, v.shape[0]).narrow(1, 0, v.shape[1]).copy_(tensor_of(v));
  return created_of(std::move(out), name);
}

// An empty view may have no memory (a null data pointer), which at::from_blob refuses on CUDA: the
// helpers below make their empty results directly.
Created narrow_2d(const View& v, int64_t rows, int64_t cols, const char* name) {
  if (rows * cols == 0 || v.numel == 0) return new_tensor({rows, cols}, new_dtype_like(v), v, name);
  // clone, not contiguous(): with one row the narrowed view already counts as contiguous, and
  // contiguous() would hand back a view of v's memory, which the caller frees (tensor_of owns nothing).
  return created_of(tensor_of(v).narrow(0, 0, rows).narrow(1, 0, cols).clone(at::MemoryFormat::Contiguous), name);
}

Created cast_to(const View& v, NewDtype dtype, const char* name) {
  if (v.numel == 0) return new_tensor(v.shape, dtype, v, name);
  return created_of(tensor_of(v).to(scalar_type(dtype), /*non_blocking=*/false, /*copy=*/true), name);  // never a view
}

namespace {

void register_torch_tensors(nb::module_& m) { m.attr("TORCH_VERSION") = COAT_TORCH_VERSION; }

}  // namespace

COAT_REGISTER_BINDINGS(torch_tensors, register_torch_tensors);

}  // namespace bind
}  // namespace coat
