// Argument checking for the nanobind layer: tensors arrive as Python objects with torch.Tensor's
// interface (data_ptr(), dtype, shape, is_contiguous(), is_cuda / is_cpu, get_device()), are
// validated with the Python argument's name in every message, and are handed to the core as raw
// pointers. std::invalid_argument surfaces in Python as ValueError.
//
// Why not DLPack: torch's Tensor.__dlpack__ is Python code that checks devices and streams on
// every call (3-15 us per tensor on CUDA, more than the kernels it feeds on small shapes); the
// handful of attribute reads here cost ~0.5 us per tensor and still need no torch headers, so one
// build works with any recent torch. FP8 codes may come as uint8 or as float8_e4m3fn/e5m2 tensors:
// both are one byte per element, and the format is always passed explicitly.
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

// A tensor argument, read lazily by view_of (the caster only rejects None, so that
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

// x must hold fp32, bf16 or fp16.
DType float_dtype(const View& v);
void expect_kind(const View& v, Kind k);
void expect_numel(const View& v, int64_t n, const std::string& what);
void expect_same_shape(const View& v, const View& ref);
// All views on the device of the first; returns whether that is CUDA (and makes it current).
bool same_device(std::initializer_list<const View*> views);
Fp8Format fp8_format(int f);
ScaleKind scale_kind(int k);
inline cudaStream_t stream_of(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

// Scales of FP8 codes quantized in 1x`group` groups: fp32 or E8M0 bytes, one per group of `numel`.
ScaleKind check_group_scales(const View& scales, int64_t numel, int64_t group);

// An optional FP8 output of a fused kernel: codes shaped like `like` plus their 1x`group` scales,
// given both or neither (given = false, null pointers, fp32 scale kind).
struct Fp8Output {
  View q, scales;
  ScaleKind kind = ScaleKind::kFloat32;
  bool given = false;
};
Fp8Output optional_fp8_output(const std::optional<MutArray>& q, const std::optional<MutArray>& scales,
                              const View& like, int64_t group);

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
