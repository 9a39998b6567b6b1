// Tensors at the nanobind layer. Arguments arrive as Python objects; `view_of` reads a
// torch.Tensor's metadata through torch's C++ API (csrc/bindings/torch_tensors.cpp, the one
// translation unit that includes torch headers) and checks it with the Python argument's name in
// every message; the core gets raw pointers. Outputs are created here too (`new_tensor`), by
// torch's caching allocator on the input's device, and returned to Python.
//
// Why through torch's C++ API: a coat op call on a small tensor must cost the host little more
// than a torch op does. Reading a tensor through its Python attributes (data_ptr(), shape, ...)
// costs ~2 us per tensor, and torch.empty from Python ~5 us per output, on the GPU machines' hosts;
// an op of 4-6 tensors then spends 30-40 us before its first launch. From C++ both cost well
// under 1 us. The price: the module is built against the installed torch, and is rebuilt when
// torch changes (coat/__init__.py refuses a mismatch with a clear message). The core
// (csrc/<family>/) stays torch-free. FP8 codes may come as uint8 or as float8_e4m3fn/e5m2
// tensors: both are one byte per element, and the format is always passed explicitly.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "coat/common.h"

namespace coat {
namespace bind {

namespace nb = nanobind;

// A tensor argument, read by view_of (the caster only rejects None, so that
// std::optional<TensorArg> maps None to nullopt).
struct TensorArg {
  nb::handle obj;
};
using Array = TensorArg;     // read by the kernel
using MutArray = TensorArg;  // written by the kernel

enum class Kind { kFloat32, kBFloat16, kFloat16, kUInt8, kInt64, kOther };

struct View {
  void* data = nullptr;
  Kind kind = Kind::kOther;
  const char* dtype_name = "";  // torch's name, for messages ("float64")
  bool cuda = false;
  int device = 0;
  std::vector<int64_t> shape;
  int64_t numel = 1;
  const char* name = "";

  int64_t last_dim() const { return shape.empty() ? 1 : shape.back(); }
  int64_t rows() const { return shape.empty() ? 1 : numel / (shape.back() == 0 ? 1 : shape.back()); }
};

const char* kind_name(Kind k);
std::string shape_str(const std::vector<int64_t>& s);

// Reads a tensor argument: requires C-contiguous layout and a CPU or CUDA device.
View view_of(const TensorArg& a, const char* name);

// dtypes of the tensors a binding creates.
enum class NewDtype { kUInt8, kFloat32, kBFloat16, kFloat16, kE4M3, kE5M2 };
NewDtype new_dtype(DType d);        // a float dtype of the core
NewDtype new_dtype(Fp8Format f);    // float8_e4m3fn / float8_e5m2 codes
NewDtype new_dtype_like(const View& v);  // v's own dtype (float or uint8)

// An output created by a binding: the torch.Tensor handed back to Python and its view for the
// core (contiguous, on `like`'s device, uninitialized).
struct Created {
  nb::object tensor;
  View view;
};
Created new_tensor(const std::vector<int64_t>& shape, NewDtype dtype, const View& like, const char* name);
// Torch ops a layer block runs around coat's GEMM (csrc/bindings/block.cpp), on v's device and
// torch's current stream: a zero-padded copy of 2-D v as [rows, cols] (rows, cols >= v's), a
// contiguous copy of v[:rows, :cols], v converted to `dtype` (float or uint8 views only).
Created pad_2d(const View& v, int64_t rows, int64_t cols, const char* name);
Created narrow_2d(const View& v, int64_t rows, int64_t cols, const char* name);
Created cast_to(const View& v, NewDtype dtype, const char* name);
// Scratch for one call: torch's caching allocator takes it back when the call returns, and hands
// it out again only to work queued after this call's kernels on the same stream.
inline void* new_scratch(int64_t bytes, const View& like, nb::object& keep) {
  Created c = new_tensor({bytes}, NewDtype::kUInt8, like, "scratch");
  keep = std::move(c.tensor);
  return c.view.data;
}

// x must hold fp32, bf16 or fp16.
DType float_dtype(const View& v);
void expect_kind(const View& v, Kind k);
void expect_numel(const View& v, int64_t n, const std::string& what);
void expect_same_shape(const View& v, const View& ref);
void expect_2d(const View& v);
// All views on the device of the first; returns whether that is CUDA (and makes it current).
bool same_device(std::initializer_list<const View*> views);
Fp8Format fp8_format(int f);
// The core dtype for its id from Python (0 float32, 1 bfloat16, 2 float16).
DType dtype_arg(int d);
ScaleKind scale_kind(int k);
// A ScaleMode (coat/common.h) for its id, the argument named in the message.
ScaleMode scale_mode_arg(int m, const char* name);
inline cudaStream_t stream_of(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

// Scales of FP8 codes quantized in 1x`group` groups: fp32 or E8M0 bytes, one per group of `numel`.
ScaleKind check_group_scales(const View& scales, int64_t numel, int64_t group);

// The optional FP8 output of a fused kernel: codes shaped like `like` (float8 of `fmt`) and their
// 1 x `group` scales (E8M0 bytes or fp32); when not asked for, empty tensors of shape [0] (null
// pointers for the core).
struct Fp8Output {
  Created q, scales;
  ScaleKind kind = ScaleKind::kFloat32;
  bool given = false;
  uint8_t* codes() const { return given ? static_cast<uint8_t*>(q.view.data) : nullptr; }
  void* scale_data() const { return given ? scales.view.data : nullptr; }
};
Fp8Output new_fp8_output(bool given, Fp8Format fmt, bool e8m0, const View& like, int64_t group);

// Raises when the build has no CUDA kernels and a CUDA tensor was passed.
void require_cuda_build();

// Wraps a call of a CUDA launcher: a build without CUDA has no launchers to link against.
#ifdef COAT_WITH_CUDA
#define COAT_GPU_CALL(...) __VA_ARGS__
#else
#define COAT_GPU_CALL(...) ::coat::bind::require_cuda_build()
#endif

}  // namespace bind
}  // namespace coat

namespace nanobind {
namespace detail {
template <>
struct type_caster<coat::bind::TensorArg> {
  NB_TYPE_CASTER(coat::bind::TensorArg, const_name("torch.Tensor"))
  bool from_python(handle src, uint8_t, cleanup_list*) noexcept {
    if (src.is_none()) return false;
    value.obj = src;
    return true;
  }
  static handle from_cpp(const coat::bind::TensorArg& v, rv_policy, cleanup_list*) noexcept {
    return v.obj.inc_ref();
  }
};
}  // namespace detail
}  // namespace nanobind
