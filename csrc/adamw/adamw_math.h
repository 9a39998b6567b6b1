// Scalar pieces of the fused AdamW step, shared by the CPU reference and the CUDA kernel (plain
// IEEE arithmetic for the update, no contraction on either side) and by both state codecs: FP8 +
// DRE (fp8_states.h) and 4-bit (csrc/adamw4/adamw4_math.h).
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include "coat/adamw.h"
#include "common/dre.h"  // fast_div: the hardware-approximate division of the update
#include "common/fp8.h"

namespace coat {
namespace adamw {

// Per-tensor fp32 factors of one step, from fp64 hyperparameters and the step count t >= 1.
struct Scalars {
  float wd_factor;     // 1 - lr wd
  float w1;            // 1 - beta1 (torch's lerp weight)
  float beta2;
  float w2;            // 1 - beta2
  float eps;
  float step_size;     // lr / (1 - beta1^t)
  float inv_bc2_sqrt;  // 1 / sqrt(1 - beta2^t)
};

// b^e by repeated squaring: IEEE multiplications only, so host and device agree.
COAT_HD double pow_int(double b, uint64_t e) {
  double r = 1.0;
  while (e != 0) {
    if (e & 1u) r = r * b;
    b = b * b;
    e >>= 1;
  }
  return r;
}

// t comes from a float32 step tensor; anything below 1 (never written by coat) counts as 1 so that
// no bias correction divides by zero.
// The step count t as an integer: below 1 (and NaN) 1; from 2^64 (and +Inf) the largest count,
// where a plain cast would be undefined (beta^t is 0 there either way).
COAT_HD uint64_t step_count(float t) {
  if (!(t >= 1.0f)) return 1u;
  return t < 18446744073709551616.0f ? static_cast<uint64_t>(t) : ~uint64_t{0};
}

COAT_HD Scalars make_scalars(double lr, const AdamwConfig& c, uint64_t t) {
  Scalars s;
  s.wd_factor = static_cast<float>(1.0 - lr * c.weight_decay);
  s.w1 = static_cast<float>(1.0 - c.beta1);
  s.beta2 = static_cast<float>(c.beta2);
  s.w2 = static_cast<float>(1.0 - c.beta2);
  s.eps = static_cast<float>(c.eps);
  const double bc1 = 1.0 - pow_int(c.beta1, t);
  const double bc2 = 1.0 - pow_int(c.beta2, t);
  s.step_size = static_cast<float>(lr / bc1);
  s.inv_bc2_sqrt = static_cast<float>(1.0 / sqrt(bc2));
  return s;
}

// The factor gradients are multiplied by: 1 / GradScaler's scale (exact for its power-of-two
// scales, so the same as dividing), times 1 / the clipping scale, negated for maximize (exact).
// With only one of the two scales, one correctly rounded reciprocal of it.
COAT_HD float grad_multiplier(const AdamwConfig& c) {
  float s = c.amp_scale != nullptr ? 1.0f / *c.amp_scale : 1.0f;
  if (c.clip_scale != nullptr) s = c.amp_scale != nullptr ? s * (1.0f / *c.clip_scale) : 1.0f / *c.clip_scale;
  return c.maximize ? -s : s;
}

// The AdamW update of one element: returns the new parameter, updates m and v (fp32).
// torch.optim.AdamW's formula and order. On the device the square root and the division use the
// hardware approximations (~2 ulp; IEEE versions cost ~20 instructions each and the step is
// instruction-bound), on the host IEEE: CPU and GPU agree to a few ulp per step.
COAT_HD float update(float p, float g, float& m, float& v, const Scalars& s) {
  p = p * s.wd_factor;
  m = m + s.w1 * (g - m);
  v = v * s.beta2 + (s.w2 * g) * g;  // torch's addcmul order: g g alone overflows from |g| ~ 1.8e19
#if defined(__CUDA_ARCH__)
  float root;  // sqrt(0) = 0, sqrt(NaN) = NaN
  asm("sqrt.approx.ftz.f32 %0, %1;" : "=f"(root) : "f"(v));
#else
  const float root = sqrtf(v);
#endif
  const float denom = root * s.inv_bc2_sqrt + s.eps;
  p = p - s.step_size * fast_div(m, denom);
  // Moments below fp32's normal range are zero (signed) on both sides: the kernel is compiled with
  // -ftz=true, so its arithmetic flushes them; the host does it here. A v that small comes with an
  // m whose m / eps is below 1e-9 lr.
#if !defined(__CUDA_ARCH__)
  m = fabsf(m) < 1.17549435e-38f ? copysignf(0.0f, m) : m;  // NaN compares false and stays
  v = fabsf(v) < 1.17549435e-38f ? copysignf(0.0f, v) : v;
#endif
  return p;
}

// 64 random bits for the four consecutive elements 4q .. 4q+3 of a tensor at step t: a
// splitmix64-style mix of (seed, t, q). Element 4q + j takes bits [16 j, 16 j + 16).
COAT_HD uint64_t sr_bits(uint64_t seed, uint64_t t, uint64_t q) {
  uint64_t z = seed + 0x9E3779B97F4A7C15ull * (t + 1u);
  z ^= q * 0xD1B54A32D192ED03ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  z = (z + 0x9E3779B97F4A7C15ull) * 0xBF58476D1CE4E5B9ull;
  return z ^ (z >> 29);
}

// bf16 bits of x with stochastic rounding: add 16 random bits below the bf16 mantissa and
// truncate (the carry rounds the magnitude up with probability equal to the dropped fraction).
// NaN stays NaN, +-Inf stays, and a finite x never becomes Inf (the largest bf16 instead).
// Written as selects, not branches: the optimizer kernels run it for every element.
COAT_HD uint16_t bf16_sr(float x, uint32_t r16) {
  const uint32_t u = bits_of(x);
  const uint32_t a = u & 0x7FFFFFFFu;
  uint32_t b = (u + (r16 & 0xFFFFu)) >> 16;
  b = (b & 0x7FFFu) == 0x7F80u ? b - 1u : b;  // a finite x that carried into Inf
  b = a == 0x7F800000u ? u >> 16 : b;         // +-Inf stays
  b = a > 0x7F800000u ? (u >> 16) | 0x40u : b;  // NaN stays NaN (quiet)
  return static_cast<uint16_t>(b);
}

// bf16_sr of four consecutive values with quad r (value j takes r's bits [16 j, 16 j + 16)),
// packed two to a word (value 0 in the low half). Equal to four bf16_sr: below 0x7F7F0000 (the
// largest finite bf16 minus one step) |x| can neither carry into Inf nor be Inf or NaN, so a quad
// of such values (nearly all) is an add and a shift each; the select chain runs only otherwise.
COAT_HD void bf16_sr_quad(const float* x, uint64_t r, uint32_t& lo, uint32_t& hi) {
  uint32_t u[4], big = 0;
  for (int j = 0; j < 4; ++j) {
    u[j] = bits_of(x[j]);
    big |= (u[j] & 0x7FFFFFFFu) >= 0x7F7F0000u ? 1u : 0u;
  }
  uint32_t b[4];
  if (big == 0) {
    for (int j = 0; j < 4; ++j) b[j] = (u[j] + static_cast<uint32_t>((r >> (16 * j)) & 0xFFFFu)) >> 16;
  } else {
    for (int j = 0; j < 4; ++j) b[j] = bf16_sr(x[j], static_cast<uint32_t>(r >> (16 * j)));
  }
  lo = b[0] | (b[1] << 16);
  hi = b[2] | (b[3] << 16);
}

}  // namespace adamw

namespace detail {

// Checks shared by the CPU reference and the CUDA launcher: same rejections, same messages,
// before anything is written.
inline void check_adamw_config(int64_t n_tensors, int64_t n_groups, const AdamwConfig& c) {
  COAT_CHECK_ARG(n_tensors >= 0 && n_groups >= 0, "n_tensors and n_groups must be >= 0");
  auto finite = [](double x) { return x == x && x - x == 0.0; };
  COAT_CHECK_ARG(finite(c.lr) && c.lr >= 0.0, "lr must be finite and >= 0, got " + std::to_string(c.lr));
  COAT_CHECK_ARG(finite(c.beta1) && c.beta1 >= 0.0 && c.beta1 < 1.0,
                 "beta1 must be in [0, 1), got " + std::to_string(c.beta1));
  COAT_CHECK_ARG(finite(c.beta2) && c.beta2 >= 0.0 && c.beta2 < 1.0,
                 "beta2 must be in [0, 1), got " + std::to_string(c.beta2));
  COAT_CHECK_ARG(finite(c.eps) && c.eps >= 0.0, "eps must be finite and >= 0, got " + std::to_string(c.eps));
  COAT_CHECK_ARG(finite(c.weight_decay) && c.weight_decay >= 0.0,
                 "weight_decay must be finite and >= 0, got " + std::to_string(c.weight_decay));
  COAT_CHECK_ARG(c.m_log2_range > 0.0f && c.m_log2_range < 64.0f && c.v_log2_range > 0.0f &&
                     c.v_log2_range < 64.0f,
                 "log2_range must be in (0, 64)");
  const bool ok = (c.master == MasterKind::kNone && c.param_dtype == DType::kFloat32) ||
                  (c.master == MasterKind::kFp32 && c.param_dtype != DType::kFloat32) ||
                  (c.master == MasterKind::kBf16Sr && c.param_dtype == DType::kBFloat16);
  COAT_CHECK_ARG(ok, std::string("unsupported combination of param dtype ") + dtype_name(c.param_dtype) +
                         " and master kind " + std::to_string(static_cast<int>(c.master)) +
                         " (fp32 params: none; bf16/fp16 params: fp32 master; bf16 params: bf16_sr)");
}

}  // namespace detail
}  // namespace coat
