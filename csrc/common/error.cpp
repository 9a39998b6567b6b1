#include "coat/common.h"

#ifdef COAT_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace coat {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat16: return "float16";
  }
  return "?";
}

const char* fp8_name(Fp8Format f) { return f == Fp8Format::kE4M3 ? "e4m3" : "e5m2"; }
const char* scale_mode_name(ScaleMode m) {
  switch (m) {
    case ScaleMode::kTensor: return "tensor";
    case ScaleMode::kRow: return "row";
    case ScaleMode::kVec128: return "1x128";
    case ScaleMode::kBlock128: return "128x128";
  }
  return "?";
}

Error::Error(const std::string& what, const char* file, int line)
    : std::runtime_error(what + " (" + file + ":" + std::to_string(line) + ")") {}

void throw_invalid(const std::string& msg) { throw std::invalid_argument(msg); }

void throw_error(const std::string& msg, const char* file, int line) { throw Error(msg, file, line); }

bool built_with_cuda() {
#ifdef COAT_WITH_CUDA
  return true;
#else
  return false;
#endif
}

void set_current_device(int device) {
#ifdef COAT_WITH_CUDA
  int cur = -1;
  if (cudaGetDevice(&cur) == cudaSuccess && cur == device) return;
  const cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess)
    throw_error(std::string("cudaSetDevice: ") + cudaGetErrorString(err), __FILE__, __LINE__);
#else
  (void)device;
  throw_invalid("coat was built without CUDA; reinstall it on a machine with nvcc to use GPU tensors");
#endif
}

int current_device() noexcept {
#ifdef COAT_WITH_CUDA
  int cur = -1;
  return cudaGetDevice(&cur) == cudaSuccess ? cur : -1;
#else
  return -1;
#endif
}

DeviceRestore::~DeviceRestore() {
#ifdef COAT_WITH_CUDA
  int cur = -1;
  if (device_ >= 0 && cudaGetDevice(&cur) == cudaSuccess && cur != device_) (void)cudaSetDevice(device_);
#endif
}

}  // namespace coat
