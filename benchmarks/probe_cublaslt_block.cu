// Block-scaled FP8 GEMMs (1x128 activations/gradients, 128x128 weights; for dW also 1x128 x 128x128
// either way) against per-tensor, at Llama-2-7B shapes (M = 4096 tokens): cuBLASLt's heuristic choice
// and every tile / custom option / swizzle variant of it that cuBLASLt accepts, timed in 3 interleaved
// rounds of 15 on random FP8 data, medians (benchmarks/RESULTS.md section 54). Standalone:
//   nvcc -O2 -std=c++17 -arch=sm_90a benchmarks/probe_cublaslt_block.cu -o probe -lcublasLt && ./probe
// "v*B": our a (cuBLASLt B) in 1x128 groups, our b (cuBLASLt A) in 128x128 tiles.
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <string>
#include <algorithm>
#define CK(x) do { auto e = (x); if ((int)e != 0) { printf("ERR %s:%d %d\n", __FILE__, __LINE__, (int)e); exit(1);} } while (0)
__global__ void fill(uint8_t* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed; h ^= h >> 15; h *= 2246822519u; h ^= h >> 13;
    p[i] = uint8_t((h & 0x80) | (0x20 + (h >> 8) % 0x40));
  }
}
cublasLtHandle_t h; void *A, *B, *D, *ws; float *S, *S2; size_t ws_bytes = 64 << 20;
struct Cfg { std::string name; cublasLtMatmulDesc_t desc; cublasLtMatrixLayout_t la, lb, lc; cublasLtMatmulAlgo_t algo; std::vector<float> t; };
Cfg make(int m, int n, int k, int amode, int bmode, bool fast, bool e5) {
  Cfg c; CK(cublasLtMatmulDescCreate(&c.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t T = CUBLAS_OP_T, N_ = CUBLAS_OP_N;
  CK(cublasLtMatmulDescSetAttribute(c.desc, CUBLASLT_MATMUL_DESC_TRANSA, &T, sizeof(T)));
  CK(cublasLtMatmulDescSetAttribute(c.desc, CUBLASLT_MATMUL_DESC_TRANSB, &N_, sizeof(N_)));
  int8_t fa = fast; CK(cublasLtMatmulDescSetAttribute(c.desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fa, 1));
  const void* sa = S; const void* sb = S2;
  CK(cublasLtMatmulDescSetAttribute(c.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof(sa)));
  CK(cublasLtMatmulDescSetAttribute(c.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof(sb)));
  if (amode >= 0) {
    int32_t am = bmode, bm = amode;  // cuBLASLt A is our weight operand b
    CK(cublasLtMatmulDescSetAttribute(c.desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &am, 4));
    CK(cublasLtMatmulDescSetAttribute(c.desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &bm, 4));
  }
  CK(cublasLtMatrixLayoutCreate(&c.la, CUDA_R_8F_E4M3, k, n, k));
  CK(cublasLtMatrixLayoutCreate(&c.lb, e5 ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3, k, m, k));
  CK(cublasLtMatrixLayoutCreate(&c.lc, CUDA_R_16BF, n, m, n));
  cublasLtMatmulPreference_t pref; CK(cublasLtMatmulPreferenceCreate(&pref));
  uint64_t wsb = ws_bytes;
  CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof(wsb)));
  cublasLtMatmulHeuristicResult_t r; int found = 0;
  CK(cublasLtMatmulAlgoGetHeuristic(h, c.desc, c.la, c.lb, c.lc, c.lc, pref, 1, &r, &found));
  if (!found) { printf("no algo\n"); exit(1); }
  c.algo = r.algo;
  return c;
}
float one = 1, zero = 0;
float time_cfg(Cfg& c, int reps) {
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  auto run = [&]() { return cublasLtMatmul(h, c.desc, &one, A, c.la, B, c.lb, &zero, nullptr, c.lc, D, c.lc, &c.algo, ws, ws_bytes, 0); };
  for (int i = 0; i < 2; ++i) CK(run());
  cudaEventRecord(e0); for (int i = 0; i < reps; ++i) run(); cudaEventRecord(e1); cudaEventSynchronize(e1);
  float ms; cudaEventElapsedTime(&ms, e0, e1); cudaEventDestroy(e0); cudaEventDestroy(e1);
  return ms / reps;
}
int main() {
  CK(cublasLtCreate(&h)); CK(cudaMalloc(&ws, ws_bytes));
  size_t big = size_t(22016) * 11008;
  CK(cudaMalloc(&A, big)); CK(cudaMalloc(&B, big)); CK(cudaMalloc(&D, big * 2));
  fill<<<1024, 256>>>((uint8_t*)A, big, 1); fill<<<1024, 256>>>((uint8_t*)B, big, 2);
  size_t ns = 8 << 20; CK(cudaMalloc(&S, ns * 4)); CK(cudaMalloc(&S2, ns * 4));
  std::vector<float> ones(ns, 1.0f); CK(cudaMemcpy(S, ones.data(), ns * 4, cudaMemcpyHostToDevice)); CK(cudaMemcpy(S2, ones.data(), ns * 4, cudaMemcpyHostToDevice));
  const int VEC = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F, BLK = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
  const int M = 4096; int NK[4][2] = {{12288, 4096}, {4096, 4096}, {22016, 4096}, {4096, 11008}};
  const char* nm[4] = {"qkv", "o", "gate_up", "down"};
  uint32_t tl[] = {17,18,19,20,21,23,24,28,29,31,32,116,165,184,197,201,208,209,247,248,400};
  for (int gi = 0; gi < 4; ++gi) for (int pass = 0; pass < 3; ++pass) {
    int N = NK[gi][0], K = NK[gi][1];
    int m = pass == 2 ? N : M, n = pass == 0 ? N : K, k = pass == 0 ? K : pass == 1 ? N : M;
    const char* pn[3] = {"fwd", "dX", "dW"};
    std::vector<Cfg> cs;
    cs.push_back(make(m, n, k, -1, -1, pass == 0, pass != 0)); cs.back().name = "tensor#0";
    std::vector<std::pair<int,int>> bm = pass == 2 ? std::vector<std::pair<int,int>>{{VEC, VEC}, {VEC, BLK}, {BLK, VEC}} : std::vector<std::pair<int,int>>{{VEC, BLK}};
    for (auto [am, bmm] : bm) {
      Cfg base = make(m, n, k, am, bmm, false, false);
      std::string mn = am == VEC && bmm == VEC ? "v*v" : am == VEC ? "v*B" : "B*v";
      base.name = mn + "#0"; cs.push_back(base);
      for (uint32_t tile : tl) for (uint32_t co = 0; co < 8; ++co) for (uint32_t sw = 0; sw < 2; ++sw) {
        Cfg c = base; // shares desc/layouts
        cublasLtMatmulAlgoConfigSetAttribute(&c.algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, 4);
        cublasLtMatmulAlgoConfigSetAttribute(&c.algo, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, &co, 4);
        cublasLtMatmulAlgoConfigSetAttribute(&c.algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &sw, 4);
        cublasLtMatmulHeuristicResult_t chk{};
        if (cublasLtMatmulAlgoCheck(h, c.desc, c.la, c.lb, c.lc, c.lc, &c.algo, &chk) != 0 || chk.workspaceSize > ws_bytes) continue;
        if (cublasLtMatmul(h, c.desc, &one, A, c.la, B, c.lb, &zero, nullptr, c.lc, D, c.lc, &c.algo, ws, ws_bytes, 0) != 0) { cudaGetLastError(); continue; }
        c.name = mn + " t" + std::to_string(tile) + "o" + std::to_string(co) + "w" + std::to_string(sw);
        cs.push_back(c);
      }
    }
    for (int round = 0; round < 3; ++round) for (auto& c : cs) c.t.push_back(time_cfg(c, 15));
    double flop = 2.0 * m * n * k;
    auto med = [](std::vector<float> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
    double tt = flop / (med(cs[0].t) * 1e-3) / 1e12;
    printf("%s %s: tensor %.0f TF/s (%zu configs)\n", nm[gi], pn[pass], tt, cs.size());
    std::vector<std::pair<double, std::string>> rows;
    for (size_t i = 1; i < cs.size(); ++i) rows.push_back({flop / (med(cs[i].t) * 1e-3) / 1e12, cs[i].name});
    std::sort(rows.rbegin(), rows.rend());
    for (auto& r : rows) if (r.second.find("#0") != std::string::npos) printf("   default %-14s %.0f (%.3f)\n", r.second.c_str(), r.first, r.first / tt);
    for (size_t i = 0; i < rows.size() && i < 4; ++i) printf("   top%zu   %-14s %.0f (%.3f)\n", i, rows[i].second.c_str(), rows[i].first, rows[i].first / tt);
    fflush(stdout);
  }
}
