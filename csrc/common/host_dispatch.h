// Host-side counterparts of cuda::dispatch_dtype / cuda::round_to for the CPU references.
#pragma once

#include <algorithm>
#include <mutex>

#include "fp8.h"

namespace coat {
namespace ref {

// Calls f with a null pointer of the host element type of t (float, HostBf16 or HostFp16).
template <typename F>
void dispatch_dtype(DType t, F&& f) {
  switch (t) {
    case DType::kFloat32: f(static_cast<float*>(nullptr)); return;
    case DType::kBFloat16: f(static_cast<HostBf16*>(nullptr)); return;
    case DType::kFloat16: f(static_cast<HostFp16*>(nullptr)); return;
  }
  throw_invalid("unsupported dtype");
}

// v rounded to T and back: what a value becomes when stored as T.
template <typename T>
float round_to(float v) {
  return Elem<T>::load(Elem<T>::store(v));
}

// *at = max(*at, v), safe across the reference's worker threads (a step's param_amax, coat/adamw.h):
// one call per thread and tensor, so a lock costs nothing that matters.
inline void max_into(float* at, float v) {
  static std::mutex lock;
  const std::lock_guard<std::mutex> hold(lock);
  *at = std::max(*at, v);
}

}  // namespace ref
}  // namespace coat
