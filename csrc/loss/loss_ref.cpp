// CPU reference of cross_entropy_rows: plain passes per row (max, then the base-2 sum in double),
// the gradient pass as the kernel forms it (the kernel is built without fma contraction, so
// x log2 e rounds alike in both passes and the label's entry cancels exactly).
#include <cmath>
#include <limits>

#include "common/host_dispatch.h"
#include "loss_args.h"

namespace coat {
namespace ref {

void cross_entropy_rows(void* logits, DType dtype, int64_t rows, int64_t vocab, const int64_t* labels,
                        const float* inv, bool grad, float* lse, float* target) {
  detail::check_cross_entropy(logits, rows, vocab, labels, inv, grad, lse, target);
  dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const float scale = grad ? *inv : 0.0f;
    for (int64_t r = 0; r < rows; ++r) {
      T* x = static_cast<T*>(logits) + r * vocab;
      const int64_t label = labels[r];
      COAT_CHECK_ARG(label < vocab, "labels[" + std::to_string(r) + "] = " + std::to_string(label) +
                                        " is not below vocab " + std::to_string(vocab));
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < vocab; ++j) m = std::fmax(m, Elem<T>::load(x[j]) * detail::kLog2e);
      bool nan = false;
      for (int64_t j = 0; j < vocab; ++j) nan = nan || std::isnan(Elem<T>::load(x[j]));
      // The sum in double: a sequential fp32 sum over 128k terms would drift by ~1e-4 relative;
      // the kernel's tree of fp32 partial sums stays near fp32 rounding of the exact sum.
      double s = 0.0;
      if (m != -std::numeric_limits<float>::infinity())
        for (int64_t j = 0; j < vocab; ++j) s += std::exp2(Elem<T>::load(x[j]) * detail::kLog2e - m);
      const float lse2 = nan ? std::numeric_limits<float>::quiet_NaN() : m + static_cast<float>(std::log2(s));
      lse[r] = lse2 * detail::kLn2;
      target[r] = label >= 0 ? Elem<T>::load(x[label]) : 0.0f;
      if (!grad) continue;
      for (int64_t j = 0; j < vocab; ++j) {
        float g = 0.0f;
        if (label >= 0) g = std::exp2(Elem<T>::load(x[j]) * detail::kLog2e - lse2) * scale - (j == label ? scale : 0.0f);
        x[j] = Elem<T>::store(g);
      }
    }
  });
}

}  // namespace ref
}  // namespace coat
