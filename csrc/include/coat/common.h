// coat core: shared types, error handling and the stream handle type.
//
// The core is torch-free and never allocates: callers pass every output and workspace buffer.
// GPU entry points take a cudaStream_t; CPU references live in namespace coat::ref with the same
// signature minus the stream.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

// The CUDA runtime defines cudaStream_t exactly like this; repeating the typedef lets headers name
// the stream type in builds without the CUDA toolkit.
typedef struct CUstream_st* cudaStream_t;

namespace coat {

// Element types coat reads and writes in full precision.
enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// FP8 formats. E4M3 is float8_e4m3fn (max 448, no infinity); E5M2 is float8_e5m2 (max 57344).
enum class Fp8Format : int { kE4M3 = 0, kE5M2 = 1 };

// How a per-group scale is stored: fp32, or a power of two as a biased exponent byte (E8M0:
// value 2^(b - 127)), exact to apply and one byte per group.
enum class ScaleKind : int { kFloat32 = 0, kE8M0 = 1 };

// How an FP8 GEMM operand [rows, K] (K: the contraction) is scaled: one fp32 dequantization
// multiplier per group, stored in the layout cuBLASLt's scale mode of the same name reads on Hopper
// (docs/scaling.md):
//   kTensor   one scale                                 [1]
//   kRow      one per row (OUTER_VEC_32F)               [rows]
//   kVec128   one per 1 x 128 along K (VEC128_32F)      [ceil(K/128)][rows], rows fastest
//   kBlock128 one per 128 x 128 tile (BLK128x128_32F)   [ceil(rows/128)][round_up(ceil(K/128), 4)];
//             the padding entries of each row of that grid hold 1 and are never read
enum class ScaleMode : int { kTensor = 0, kRow = 1, kVec128 = 2, kBlock128 = 3 };
constexpr int64_t kScaleBlock = 128;

// The number of fp32 scales of an operand [rows, k] in mode m.
inline int64_t scale_count(ScaleMode m, int64_t rows, int64_t k) {
  const int64_t kb = (k + kScaleBlock - 1) / kScaleBlock;
  switch (m) {
    case ScaleMode::kTensor: return 1;
    case ScaleMode::kRow: return rows;
    case ScaleMode::kVec128: return kb * rows;
    case ScaleMode::kBlock128: return (rows + kScaleBlock - 1) / kScaleBlock * ((kb + 3) / 4 * 4);
  }
  return 0;
}
const char* scale_mode_name(ScaleMode m);

inline int dtype_size(DType t) { return t == DType::kFloat32 ? 4 : 2; }
const char* dtype_name(DType t);
const char* fp8_name(Fp8Format f);

// A failed CUDA/cuBLAS call or broken internal invariant. Bad arguments throw std::invalid_argument.
class Error : public std::runtime_error {
 public:
  Error(const std::string& what, const char* file, int line);
};

[[noreturn]] void throw_invalid(const std::string& msg);
[[noreturn]] void throw_error(const std::string& msg, const char* file, int line);

// True when this build carries the CUDA kernels.
bool built_with_cuda();

// Make `device` current for this thread's CUDA runtime calls (throws in a build without CUDA).
void set_current_device(int device);

// This thread's current CUDA device; -1 in a build without CUDA or where none can be read.
int current_device() noexcept;

// Puts back, on scope exit, the CUDA device that was current at construction (if coat changed it):
// every binding call runs under one, so a call on cuda:1 tensors leaves the caller on cuda:0.
class DeviceRestore {
 public:
  DeviceRestore() noexcept : device_(current_device()) {}
  ~DeviceRestore();
  DeviceRestore(const DeviceRestore&) = delete;
  DeviceRestore& operator=(const DeviceRestore&) = delete;

 private:
  int device_;
};

}  // namespace coat

// COAT_CHECK_ARG: argument validation -> std::invalid_argument (Python ValueError).
#define COAT_CHECK_ARG(cond, msg)                                         \
  do {                                                                    \
    if (!(cond)) ::coat::throw_invalid(std::string(msg));                 \
  } while (0)

// COAT_CHECK: internal invariant -> coat::Error with file:line.
#define COAT_CHECK(cond, msg)                                                  \
  do {                                                                         \
    if (!(cond)) ::coat::throw_error(std::string(msg), __FILE__, __LINE__);    \
  } while (0)
