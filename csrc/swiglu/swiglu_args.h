// Argument checks shared by the CPU reference and the CUDA launchers of the swiglu family.
#pragma once

#include <math.h>

#include <string>
#include <type_traits>

#include "coat/swiglu.h"
#include "common/fp8.h"

namespace coat {
namespace detail {

inline void check_swiglu_shape(int64_t rows, int64_t inter) {
  COAT_CHECK_ARG(rows >= 0 && inter >= 0, "rows and intermediate size must be >= 0, got " +
                                              std::to_string(rows) + " x " + std::to_string(inter));
  COAT_CHECK_ARG(inter % kSwigluGroup == 0, "the intermediate size (" + std::to_string(inter) +
                                                ") must be a multiple of 16 for the FP8 path");
}

inline void check_swiglu_ptr(const void* p, int64_t n, const char* name) {
  COAT_CHECK_ARG(n == 0 || p != nullptr, std::string(name) + " must not be null");
}

inline void check_gated_act(GatedAct act) {
  COAT_CHECK_ARG(act == GatedAct::kSilu || act == GatedAct::kGeluTanh,
                 "act must be 0 (silu) or 1 (gelu_tanh), got " + std::to_string(static_cast<int>(act)));
}

inline void check_swiglu_fwd(const void* gu, GatedAct act, int64_t rows, int64_t inter, const void* h,
                             const uint8_t* q, const void* scales) {
  check_gated_act(act);
  check_swiglu_shape(rows, inter);
  const int64_t n = rows * inter;
  check_swiglu_ptr(gu, n, "gate_up");
  check_swiglu_ptr(h, n, "h");
  COAT_CHECK_ARG(q == nullptr || scales != nullptr || n == 0, "scales must not be null when q is given");
}

inline void check_swiglu_bwd(const uint8_t* q, const void* scales, const void* dh, GatedAct act, int64_t rows,
                             int64_t inter, const void* dgu) {
  check_gated_act(act);
  check_swiglu_shape(rows, inter);
  const int64_t n = rows * inter;
  check_swiglu_ptr(q, n, "q");
  check_swiglu_ptr(scales, n, "scales");
  check_swiglu_ptr(dh, n, "dh");
  check_swiglu_ptr(dgu, n, "dgu");
}

// The SiLU pieces, identical on host and device up to exp's last-ulp difference.
COAT_HD float swiglu_sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

// The tanh-approximated GELU's constants, as torch rounds them to fp32: sqrt(2 / pi) and the cubic
// coefficient.
constexpr float kGeluBeta = 0.7978845608028654f;
constexpr float kGeluKappa = 0.044715f;

// t = tanh(beta (g + kappa g^3)), torch's order of operations; +-1 where g^3 overflows.
COAT_HD float gelu_tanh_t(float g) { return tanhf(kGeluBeta * (g + kGeluKappa * (g * g * g))); }

// act(g) and act'(g) of one gate value (coat/swiglu.h gives the formulas).
struct ActGrad {
  float f, df;
};

template <GatedAct A>
COAT_HD float act_value(float g) {
  if constexpr (A == GatedAct::kSilu) {
    return g * swiglu_sigmoid(g);
  } else {
    return 0.5f * g * (1.0f + gelu_tanh_t(g));
  }
}

template <GatedAct A>
COAT_HD ActGrad act_grad(float g) {
  if constexpr (A == GatedAct::kSilu) {
    const float s = swiglu_sigmoid(g);
    return {g * s, s * (1.0f + g * (1.0f - s))};
  } else {
    const float t = gelu_tanh_t(g);
    const float sech2 = 1.0f - t * t;
    // Saturated tanh: the term is 0, and g * g may be inf (|g| > ~1.8e19), which would make it NaN.
    const float right =
        sech2 == 0.0f ? 0.0f : 0.5f * g * sech2 * (kGeluBeta * (1.0f + 3.0f * kGeluKappa * (g * g)));
    return {0.5f * g * (1.0f + t), 0.5f * (1.0f + t) + right};
  }
}

// Calls f with std::integral_constant<GatedAct, act>: the kernels and the reference are compiled
// per activation, with no per-element branch.
template <typename F>
void dispatch_act(GatedAct act, F&& f) {
  check_gated_act(act);
  if (act == GatedAct::kGeluTanh) {
    f(std::integral_constant<GatedAct, GatedAct::kGeluTanh>{});
  } else {
    f(std::integral_constant<GatedAct, GatedAct::kSilu>{});
  }
}

}  // namespace detail
}  // namespace coat
