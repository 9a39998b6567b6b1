// CPU reference of the FP8 GEMM: decode both operands exactly to fp32 (table lookup), sum the
// (exact) products over K in fp32, then alpha = a_scale * b_scale, bias and the output rounding --
// the sequence cuBLASLt applies, so CPU and GPU differ by summation order only. Here every output
// is the plain sequential sum over k = 0..K-1, whatever the blocking. Row scales multiply the
// finished sum as alpha does (alpha = sa[i] * sb[j]); 1x128 and 128x128 scales vary along K, so
// those operands are decoded with their scales applied (code * scale, rounded to fp32 once).
//
// Cache blocking: tiles of kMB rows of A x kNB rows of B x kKB of K are decoded into fp32 panels
// (64 KiB each; B's transposed so the inner loop runs along N) and multiplied by a 4 x 8 register
// block. `coat train` on a CPU runs through here, so it is blocked rather than naive; one thread.
#include <algorithm>
#include <cmath>
#include <vector>

#include "common/fp8.h"
#include "common/scale_grid.h"
#include "gemm_args.h"

namespace coat {
namespace ref {
namespace {

constexpr int64_t kMB = 64, kNB = 64, kKB = 256;

struct Lut {
  float v[256];
  explicit Lut(Fp8Format f) {
    for (int c = 0; c < 256; ++c) v[c] = decode_fp8(static_cast<uint8_t>(c), f);
  }
};

// An operand's scales where they vary along K (1x128, 128x128): applied while decoding.
struct KScales {
  const float* s = nullptr;  // null: none (per-tensor or row scales, applied after the sum)
  ScaleGrid g;
  float at(int64_t r, int64_t k) const { return s[g.index(r, k)]; }
};

// Row panel: dst[r * kb + t] = value of q[r0 + r, k0 + t] (q points at row r0).
void decode_rows(const uint8_t* q, int64_t ld, int64_t r0, int64_t rows, int64_t k0, int64_t kb, const Lut& lut,
                 const KScales& ks, float* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* src = q + r * ld + k0;
    for (int64_t t = 0; t < kb; ++t)
      dst[r * kb + t] = ks.s ? lut.v[src[t]] * ks.at(r0 + r, k0 + t) : lut.v[src[t]];
  }
}

// Transposed panel: dst[t * kNB + r] = value of q[r0 + r, k0 + t], so the inner loop runs along N.
void decode_cols(const uint8_t* q, int64_t ld, int64_t r0, int64_t rows, int64_t k0, int64_t kb, const Lut& lut,
                 const KScales& ks, float* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* src = q + r * ld + k0;
    for (int64_t t = 0; t < kb; ++t)
      dst[t * kNB + r] = ks.s ? lut.v[src[t]] * ks.at(r0 + r, k0 + t) : lut.v[src[t]];
  }
}

KScales k_scales(ScaleMode m, const float* s, int64_t rows, int64_t k) {
  KScales ks;
  if (m == ScaleMode::kVec128 || m == ScaleMode::kBlock128) ks.s = s, ks.g = scale_grid(m, false, rows, k);
  return ks;
}

// acc[i][j] += sum_t a[i][t] * b[t][j] for a 4 x 8 block, t in order: eight independent
// accumulator vectors the compiler keeps in registers (no reassociation involved).
inline void micro_4x8(const float* pa, int64_t kb, const float* pb, float* acc) {
  float c[4][8];
  for (int r = 0; r < 4; ++r)
    for (int j = 0; j < 8; ++j) c[r][j] = acc[r * kNB + j];
  for (int64_t t = 0; t < kb; ++t) {
    const float* b = pb + t * kNB;
    const float a0 = pa[t], a1 = pa[kb + t], a2 = pa[2 * kb + t], a3 = pa[3 * kb + t];
    for (int j = 0; j < 8; ++j) {
      c[0][j] += a0 * b[j];
      c[1][j] += a1 * b[j];
      c[2][j] += a2 * b[j];
      c[3][j] += a3 * b[j];
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int j = 0; j < 8; ++j) acc[r * kNB + j] = c[r][j];
}

// Same sums, one element at a time (edges of the tile).
inline void scalar_1x1(const float* pa, int64_t kb, const float* pb, float* acc) {
  float c = *acc;
  for (int64_t t = 0; t < kb; ++t) c += pa[t] * pb[t * kNB];
  *acc = c;
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
  const bool row = g.a_mode == ScaleMode::kRow;
  const bool along_k = !row && g.a_mode != ScaleMode::kTensor;
  const float alpha = along_k ? 1.0f : row ? 0.0f : g.a_scale[0] * g.b_scale[0];
  const KScales ks_a = k_scales(g.a_mode, g.a_scale, M, K), ks_b = k_scales(g.b_mode, g.b_scale, N, K);
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
        decode_rows(g.a + i0 * K, K, i0, mb, k0, kb, lut_a, ks_a, pa.data());
        decode_cols(g.b + j0 * K, K, j0, nb, k0, kb, lut_b, ks_b, pb.data());
        const int64_t mb4 = mb / 4 * 4, nb8 = nb / 8 * 8;
        for (int64_t i = 0; i < mb4; i += 4)
          for (int64_t j = 0; j < nb8; j += 8)
            micro_4x8(pa.data() + i * kb, kb, pb.data() + j, acc.data() + i * kNB + j);
        for (int64_t i = 0; i < mb; ++i)
          for (int64_t j = (i < mb4 ? nb8 : 0); j < nb; ++j)
            scalar_1x1(pa.data() + i * kb, kb, pb.data() + j, acc.data() + i * kNB + j);
      }
      // Epilogue: alpha, bias, amax, output rounding.
      for (int64_t i = 0; i < mb; ++i) {
        for (int64_t j = 0; j < nb; ++j) {
          float v = acc[i * kNB + j] * (row ? g.a_scale[i0 + i] * g.b_scale[j0 + j] : alpha);
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
