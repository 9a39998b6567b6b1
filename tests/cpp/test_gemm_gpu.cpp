// CUDA FP8 GEMM (cuBLASLt FP8 path and the bf16 path) against the CPU reference. The bf16 path
// accumulates in fp32 and differs by summation order only: fp32 outputs agree to
// (K + 8) * 2^-23 * sum |terms|, bf16 outputs to one bf16 ulp on top of that. Hopper's FP8 tensor
// cores add the products of one instruction's K slice with fewer mantissa bits (measured on an
// H200: up to 2^-14 of the sum of |terms|, m = 1, K = 16), so the FP8 path is held to 2^-13.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "coat/gemm.h"
#include "common/fp8.h"

namespace coat {
namespace {

#define CK(x) ASSERT_EQ((x), cudaSuccess)

template <typename T>
T* to_dev(const std::vector<T>& h) {
  T* d = nullptr;
  if (cudaMalloc(&d, std::max<size_t>(h.size(), 1) * sizeof(T)) != cudaSuccess) return nullptr;
  cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice);
  return d;
}

struct Case { int64_t m, n, k; Fp8Format fa; GemmOut out; bool bias, amax, force_bf16; };
// The CTest name of each case (gtest_discover_tests prints the parameter), e.g.
// m37_n48_k272_E4M3_to_bf16_bias_amax, not its bytes.
void PrintTo(const Case& c, std::ostream* os) {
  static const char* const kOut[] = {"fp32", "bf16", "e4m3"};
  *os << "m" << c.m << "_n" << c.n << "_k" << c.k << (c.fa == Fp8Format::kE4M3 ? "_E4M3" : "_E5M2")
      << "_to_" << kOut[static_cast<int>(c.out)] << (c.bias ? "_bias" : "") << (c.amax ? "_amax" : "")
      << (c.force_bf16 ? "_forced_bf16" : "");
}

class GemmGpu : public ::testing::TestWithParam<Case> {};

TEST_P(GemmGpu, MatchesReference) {
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) GTEST_SKIP() << "no CUDA device";
  const Case c = GetParam();
  std::mt19937 rng(123);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<uint8_t> a(c.m * c.k), b(c.n * c.k);
  for (auto& v : a) v = host_encode_fp8(nd(rng) * 30.0f, c.fa);
  for (auto& v : b) v = host_encode_fp8(nd(rng) * 30.0f, Fp8Format::kE4M3);
  std::vector<uint16_t> bias(c.n);
  for (auto& v : bias) v = host_float_to_bf16(nd(rng) * 50.0f);
  const std::vector<float> sa{0.013f}, sb{0.021f}, so{0.5f};
  const int esize = c.out == GemmOut::kFloat32 ? 4 : c.out == GemmOut::kBFloat16 ? 2 : 1;
  std::vector<uint8_t> out_ref(c.m * c.n * esize), out_gpu(out_ref.size());
  float amax_ref = 0, amax_gpu = -1;

  Fp8GemmArgs g;
  g.m = c.m; g.n = c.n; g.k = c.k;
  g.a = a.data(); g.a_fmt = c.fa; g.a_scale = sa.data();
  g.b = b.data(); g.b_fmt = Fp8Format::kE4M3; g.b_scale = sb.data();
  g.bias = c.bias ? bias.data() : nullptr;
  g.out = out_ref.data(); g.out_type = c.out;
  g.out_scale = c.out == GemmOut::kE4M3 ? so.data() : nullptr;
  g.amax = c.amax ? &amax_ref : nullptr;
  ref::gemm_fp8(g);

  Fp8GemmArgs d = g;
  d.a = to_dev(a); d.b = to_dev(b); d.a_scale = to_dev(sa); d.b_scale = to_dev(sb);
  d.bias = c.bias ? to_dev(bias) : nullptr;
  d.out_scale = g.out_scale ? to_dev(so) : nullptr;
  void* out_d = nullptr;
  CK(cudaMalloc(&out_d, std::max<size_t>(out_gpu.size(), 16)));
  d.out = out_d;
  float* amax_d = nullptr;
  CK(cudaMalloc(&amax_d, 4));
  d.amax = c.amax ? amax_d : nullptr;
  void* ws = nullptr;
  CK(cudaMalloc(&ws, kGemmDefaultWorkspace));
  const size_t sbytes = gemm_fp8_scratch_bytes(0, c.m, c.n, c.k, c.out, c.force_bf16);
  void* scratch = nullptr;
  if (sbytes) CK(cudaMalloc(&scratch, sbytes));
  gemm_fp8(d, ws, kGemmDefaultWorkspace, scratch, sbytes, c.force_bf16, nullptr);
  gemm_fp8(d, ws, kGemmDefaultWorkspace, scratch, sbytes, c.force_bf16, nullptr);  // cached plan
  CK(cudaDeviceSynchronize());
  CK(cudaMemcpy(out_gpu.data(), out_d, out_gpu.size(), cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(&amax_gpu, amax_d, 4, cudaMemcpyDeviceToHost));

  // Error bound from the magnitudes of the terms.
  for (int64_t i = 0; i < c.m; ++i)
    for (int64_t j = 0; j < c.n; ++j) {
      double mag = 0;
      for (int64_t t = 0; t < c.k; ++t)
        mag += std::fabs(double(decode_fp8(a[i * c.k + t], c.fa)) * decode_fp8(b[j * c.k + t], Fp8Format::kE4M3));
      mag = mag * sa[0] * sb[0] + (c.bias ? std::fabs(host_bf16_to_float(bias[j])) : 0.0);
      const bool tensor_cores = !c.force_bf16 && gemm_fp8_native(0);
      const double acc_tol = (tensor_cores ? std::ldexp(1.0, -13) : double(c.k + 8) * std::ldexp(1.0, -23)) * mag + 1e-30;
      const int64_t o = i * c.n + j;
      double r, x, tol;
      if (c.out == GemmOut::kFloat32) {
        r = reinterpret_cast<float*>(out_ref.data())[o];
        x = reinterpret_cast<float*>(out_gpu.data())[o];
        tol = acc_tol;
      } else if (c.out == GemmOut::kBFloat16) {
        r = host_bf16_to_float(reinterpret_cast<uint16_t*>(out_ref.data())[o]);
        x = host_bf16_to_float(reinterpret_cast<uint16_t*>(out_gpu.data())[o]);
        tol = std::ldexp(std::fabs(r), -7) + acc_tol;
      } else {
        r = decode_fp8(out_ref[o], Fp8Format::kE4M3) * so[0];
        x = decode_fp8(out_gpu[o], Fp8Format::kE4M3) * so[0];
        tol = std::ldexp(std::fabs(r), -3) + acc_tol + std::ldexp(1.0, -9) * so[0];
      }
      ASSERT_NEAR(x, r, tol) << "at (" << i << ", " << j << ")";
    }
  if (c.amax) EXPECT_NEAR(amax_gpu, amax_ref, std::ldexp(amax_ref, -7) + 1e-6);
  cudaFree(const_cast<uint8_t*>(d.a)); cudaFree(const_cast<uint8_t*>(d.b));
  cudaFree(const_cast<float*>(d.a_scale)); cudaFree(const_cast<float*>(d.b_scale));
  cudaFree(const_cast<void*>(d.bias)); cudaFree(const_cast<float*>(d.out_scale));
  cudaFree(out_d); cudaFree(amax_d); cudaFree(ws); cudaFree(scratch);
}

constexpr auto E4 = Fp8Format::kE4M3;
constexpr auto E5 = Fp8Format::kE5M2;
INSTANTIATE_TEST_SUITE_P(
    Shapes, GemmGpu,
    ::testing::Values(Case{1, 16, 16, E4, GemmOut::kFloat32, false, true, false},
                      Case{37, 48, 272, E4, GemmOut::kBFloat16, true, true, false},
                      Case{130, 96, 512, E5, GemmOut::kBFloat16, false, false, false},
                      Case{77, 64, 160, E5, GemmOut::kFloat32, false, true, false},
                      Case{45, 80, 208, E4, GemmOut::kE4M3, true, true, false},
                      Case{3, 32, 0, E4, GemmOut::kBFloat16, true, true, false},
                      Case{37, 48, 272, E4, GemmOut::kBFloat16, true, true, true},
                      Case{77, 64, 160, E5, GemmOut::kFloat32, false, true, true},
                      Case{45, 80, 208, E4, GemmOut::kE4M3, true, true, true}));

TEST(GemmGpuArgs, UnalignedShapesRaise) {
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) GTEST_SKIP() << "no CUDA device";
  Fp8GemmArgs g;
  float s = 1;
  g.m = 4; g.n = 24; g.k = 16;  // N % 16 != 0
  g.a_scale = &s; g.b_scale = &s;
  g.a = reinterpret_cast<const uint8_t*>(256); g.b = g.a;
  g.out = reinterpret_cast<void*>(256);
  EXPECT_THROW(gemm_fp8(g, nullptr, 0, nullptr, 0, false, nullptr), std::invalid_argument);
  g.n = 32; g.k = 20;
  EXPECT_THROW(gemm_fp8(g, nullptr, 0, nullptr, 0, false, nullptr), std::invalid_argument);
}

}  // namespace
}  // namespace coat
