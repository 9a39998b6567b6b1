// CPU reference of the FP8 GEMM: decode both operands exactly to fp32 (table lookup), fp32 dot
// products over K, then alpha = a_scale * b_scale, bias and the output rounding -- the same
// sequence cuBLASLt applies, so CPU and GPU differ by summation order only.
//
// Cache blocking: tiles of kMB rows of A x kNB rows of B x kKB of K are decoded into small fp32
// panels (2 x 64 KiB) and multiplied with a 1 x 4 register block (one A row against four B rows,
// eight partial sums each: vectorizable without reassociating anything the compiler must keep).
// `coat train` on a CPU runs through here, so it is blocked rather than naive; it is single-threaded.
#include <algorithm>
#include <cmath>
#include <vector>

#include "common/fp8.h"
#include "gemm_args.h"

namespace coat {
namespace ref {
namespace {

constexpr int64_t kMB = 64, kNB = 64, kKB = 256, kLanes = 8;

struct Lut {
  float v[256];
  explicit Lut(Fp8Format f) {
    for (int c = 0; c < 256; ++c) v[c] = decode_fp8(static_cast<uint8_t>(c), f);
  }
};

// Sum of the eight lanes in a fixed tree order.
inline float reduce8(const float* s) {
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

// acc[j] += dot(a, b_j) for four rows b0..b3 of length n.
inline void dot1x4(const float* a, const float* b0, const float* b1, const float* b2,
                   const float* b3, int64_t n, float* acc) {
  float s0[kLanes] = {0}, s1[kLanes] = {0}, s2[kLanes] = {0}, s3[kLanes] = {0};
  int64_t t = 0;
  for (; t + kLanes <= n; t += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const float x = a[t + l];
      s0[l] += x * b0[t + l];
      s1[l] += x * b1[t + l];
      s2[l] += x * b2[t + l];
      s3[l] += x * b3[t + l];
    }
  }
  for (; t < n; ++t) {
    s0[0] += a[t] * b0[t];
    s1[0] += a[t] * b1[t];
    s2[0] += a[t] * b2[t];
    s3[0] += a[t] * b3[t];
  }
  acc[0] += reduce8(s0);
  acc[1] += reduce8(s1);
  acc[2] += reduce8(s2);
  acc[3] += reduce8(s3);
}

inline float dot1(const float* a, const float* b, int64_t n) {
  float s[kLanes] = {0};
  int64_t t = 0;
  for (; t + kLanes <= n; t += kLanes)
    for (int l = 0; l < kLanes; ++l) s[l] += a[t + l] * b[t + l];
  for (; t < n; ++t) s[0] += a[t] * b[t];
  return reduce8(s);
}

void decode_panel(const uint8_t* q, int64_t ld, int64_t rows, int64_t k0, int64_t kb,
                  const Lut& lut, float* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* src = q + r * ld + k0;
    for (int64_t t = 0; t < kb; ++t) dst[r * kb + t] = lut.v[src[t]];
  }
}

}  // namespace

void gemm_fp8(const Fp8GemmArgs& g) {
  detail::check_gemm(g);
  const int64_t M = g.m, N = g.n, K = g.k;
  float amax = 0.0f;
  if (M == 0 || N == 0) {
    if (g.amax) *g.amax = 0.0f;
    return;
  }
  const Lut lut_a(g.a_fmt), lut_b(g.b_fmt);
  const float alpha = g.a_scale[0] * g.b_scale[0];
  const float inv_out = g.out_type == GemmOut::kE4M3 ? 1.0f / g.out_scale[0] : 1.0f;
  const auto* bias = static_cast<const uint16_t*>(g.bias);

  std::vector<float> pa(static_cast<size_t>(kMB * kKB)), pb(static_cast<size_t>(kNB * kKB));
  std::vector<float> acc(static_cast<size_t>(kMB * kNB));
  for (int64_t i0 = 0; i0 < M; i0 += kMB) {
    const int64_t mb = std::min(kMB, M - i0);
    for (int64_t j0 = 0; j0 < N; j0 += kNB) {
      const int64_t nb = std::min(kNB, N - j0);
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t k0 = 0; k0 < K; k0 += kKB) {
        const int64_t kb = std::min(kKB, K - k0);
        decode_panel(g.a + i0 * K, K, mb, k0, kb, lut_a, pa.data());
        decode_panel(g.b + j0 * K, K, nb, k0, kb, lut_b, pb.data());
        for (int64_t i = 0; i < mb; ++i) {
          const float* ar = pa.data() + i * kb;
          float* ac = acc.data() + i * kNB;
          int64_t j = 0;
          for (; j + 4 <= nb; j += 4) {
            const float* b = pb.data() + j * kb;
            dot1x4(ar, b, b + kb, b + 2 * kb, b + 3 * kb, kb, ac + j);
          }
          for (; j < nb; ++j) ac[j] += dot1(ar, pb.data() + j * kb, kb);
        }
      }
      // Epilogue: alpha, bias, amax, output rounding.
      for (int64_t i = 0; i < mb; ++i) {
        for (int64_t j = 0; j < nb; ++j) {
          float v = acc[i * kNB + j] * alpha;
          if (bias) v += host_bf16_to_float(bias[j0 + j]);
          const float av = std::fabs(v);
          if (av <= 3.4028234663852886e38f) amax = std::max(amax, av);
          const int64_t o = (i0 + i) * N + (j0 + j);
          switch (g.out_type) {
            case GemmOut::kFloat32: static_cast<float*>(g.out)[o] = v; break;
            case GemmOut::kBFloat16: static_cast<uint16_t*>(g.out)[o] = host_float_to_bf16(v); break;
            case GemmOut::kE4M3:
              static_cast<uint8_t*>(g.out)[o] = host_encode_fp8(v * inv_out, Fp8Format::kE4M3);
              break;
          }
        }
      }
    }
  }
  if (g.amax) *g.amax = amax;
}

}  // namespace ref
}  // namespace coat
