// Every cuBLASLt heuristic candidate for coat's FP8 GEMMs at Llama-2-7B shapes (M = 4096 tokens), per
// scale mode, timed on random FP8 data; with EXH=1, also the block and row modes' algorithm with every
// tile, custom option and CTA swizzle cuBLASLt accepts (benchmarks/RESULTS.md section 54). Standalone:
//   nvcc -O2 -std=c++17 -arch=sm_90a benchmarks/probe_cublaslt.cu -o probe -lcublasLt && ./probe [REPS] [CANDIDATES]
// "a" is the algorithm id, "t" the tile, "s" the stages, "k" split-K, "w" swizzle, "c" cluster, "o" the
// custom option. Our operand a (activations, gradients) is cuBLASLt's B, the weight b its A ("TN").
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
__global__ void fill(uint8_t* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed; h ^= h >> 15; h *= 2246822519u; h ^= h >> 13;
    p[i] = uint8_t((h & 0x80) | (0x20 + (h >> 8) % 0x40));
  }
}
#define CK(x) do { auto e = (x); if ((int)e != 0) { printf("ERR %s:%d %d\n", __FILE__, __LINE__, (int)e); exit(1);} } while (0)

struct Mode { const char* name; int a_mode, b_mode; bool fast; };  // a: our activation operand (cuBLASLt B), b: weight (cuBLASLt A)
// -1: scalar
static int lt(int m) { return m < 0 ? CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F : m; }

int main(int argc, char** argv) {
  int reps = argc > 1 ? atoi(argv[1]) : 20;
  int want = argc > 2 ? atoi(argv[2]) : 16;
  cublasLtHandle_t h; CK(cublasLtCreate(&h));
  size_t ws_bytes = 64 << 20;
  void* ws; CK(cudaMalloc(&ws, ws_bytes));
  size_t big = size_t(22016) * 11008;
  void *A, *B, *D; float* S;
  CK(cudaMalloc(&A, big)); CK(cudaMalloc(&B, big)); CK(cudaMalloc(&D, big * 2));
  fill<<<1024, 256>>>((uint8_t*)A, big, 1); fill<<<1024, 256>>>((uint8_t*)B, big, 2); CK(cudaDeviceSynchronize());
  size_t ns = 8 << 20; CK(cudaMalloc(&S, ns * 4));
  std::vector<float> ones(ns, 1.0f); CK(cudaMemcpy(S, ones.data(), ns * 4, cudaMemcpyHostToDevice));
  float* S2; CK(cudaMalloc(&S2, ns * 4)); CK(cudaMemcpy(S2, ones.data(), ns * 4, cudaMemcpyHostToDevice));
  const int M = 4096;
  struct G { const char* name; int m, n, k; bool grad; };
  std::vector<G> gs;
  int NK[4][2] = {{12288, 4096}, {4096, 4096}, {22016, 4096}, {4096, 11008}};
  const char* nm[4] = {"qkv", "o", "gate_up", "down"};
  for (int i = 0; i < 4; ++i) {
    int N = NK[i][0], K = NK[i][1];
    gs.push_back({strdup((std::string(nm[i]) + " fwd").c_str()), M, N, K, false});
    gs.push_back({strdup((std::string(nm[i]) + " dX").c_str()), M, K, N, true});
    gs.push_back({strdup((std::string(nm[i]) + " dW").c_str()), N, K, M, true});
  }
  const int VEC = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F, BLK = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F,
            ROW = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  for (auto& g : gs) {
    bool dw = strstr(g.name, "dW") != nullptr;
    std::vector<Mode> modes = {{"tensor", -1, -1, !g.grad}, {"row", ROW, ROW, !g.grad}};
    if (dw) { modes.push_back({"block v*v", VEC, VEC, false}); modes.push_back({"block v*B", VEC, BLK, false}); modes.push_back({"block B*v", BLK, VEC, false}); }
    else modes.push_back({"block", VEC, BLK, false});
    for (auto& md : modes) {
      cublasLtMatmulDesc_t desc; CK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
      cublasOperation_t T = CUBLAS_OP_T, N_ = CUBLAS_OP_N;
      CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &T, sizeof(T)));
      CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &N_, sizeof(N_)));
      int8_t fa = md.fast ? 1 : 0;
      CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fa, sizeof(fa)));
      const void* sa = S; const void* sb = S2;
      CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof(sa)));
      CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof(sb)));
      if (md.a_mode >= 0) {
        int32_t am = lt(md.b_mode), bm = lt(md.a_mode);
        CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &am, sizeof(am)));
        CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &bm, sizeof(bm)));
      }
      cudaDataType_t ta = CUDA_R_8F_E4M3, tb = (g.grad && md.a_mode < 0) ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3;
      cublasLtMatrixLayout_t la, lb, lc;
      CK(cublasLtMatrixLayoutCreate(&la, ta, g.k, g.n, g.k));
      CK(cublasLtMatrixLayoutCreate(&lb, tb, g.k, g.m, g.k));
      CK(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, g.n, g.m, g.n));
      cublasLtMatmulPreference_t pref; CK(cublasLtMatmulPreferenceCreate(&pref));
      uint64_t wsb = ws_bytes;
      CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof(wsb)));
      std::vector<cublasLtMatmulHeuristicResult_t> res(want);
      int found = 0;
      auto st = cublasLtMatmulAlgoGetHeuristic(h, desc, la, lb, lc, lc, pref, want, res.data(), &found);
      if (st != 0 || found == 0) { printf("%-12s %-10s no algo (st %d)\n", g.name, md.name, (int)st); continue; }
      double flop = 2.0 * g.m * g.n * g.k;
      float one = 1, zero = 0;
      double best = 0, first = 0; int bi = -1;
      std::string all;
      for (int i = 0; i < found; ++i) {
        auto run = [&]() { return cublasLtMatmul(h, desc, &one, A, la, B, lb, &zero, nullptr, lc, D, lc, &res[i].algo, ws, ws_bytes, 0); };
        if (run() != 0) { all += " x"; continue; }
        for (int w = 0; w < 3; ++w) run();
        CK(cudaEventRecord(e0));
        for (int r = 0; r < reps; ++r) run();
        CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1));
        float ms; CK(cudaEventElapsedTime(&ms, e0, e1));
        double tf = flop * reps / (ms * 1e-3) / 1e12;
        if (i == 0) first = tf;
        if (tf > best) { best = tf; bi = i; }
        int id = 0, tile = 0, stages = 0, sk = 0, sw = 0, cl = 0, co = 0; size_t wr;
        cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof id, &wr);
        cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof tile, &wr);
        cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof stages, &wr);
        cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &sk, sizeof sk, &wr);
        cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &sw, sizeof sw, &wr);
        cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cl, sizeof cl, &wr);
        cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, &co, sizeof co, &wr);
        char buf[96]; snprintf(buf, sizeof buf, " %.0f[a%d t%d s%d k%d w%d c%d o%d]", tf, id, tile, stages, sk, sw, cl, co); all += buf;
      }
      if (md.a_mode >= 0 && getenv("EXH")) {
        uint32_t tl[] = {17,18,19,20,21,23,24,28,29,31,32,116,165,184,197,201,208,209,247,248,400};
        int tried = 0, ok = 0; double eb = 0; char ebs[160] = "";
        for (uint32_t tile : tl) for (uint32_t co = 0; co < 8; ++co) for (uint32_t sw = 0; sw < 2; ++sw) {
          cublasLtMatmulAlgo_t algo = res[0].algo;
          cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, 4);
          cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, &co, 4);
          cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &sw, 4);
          cublasLtMatmulHeuristicResult_t chk{};
          ++tried;
          if (cublasLtMatmulAlgoCheck(h, desc, la, lb, lc, lc, &algo, &chk) != 0) continue;
          if (chk.workspaceSize > ws_bytes) continue;
          auto run = [&]() { return cublasLtMatmul(h, desc, &one, A, la, B, lb, &zero, nullptr, lc, D, lc, &algo, ws, ws_bytes, 0); };
          if (run() != 0) { cudaGetLastError(); continue; }
          ++ok;
          run();
          CK(cudaEventRecord(e0)); for (int r = 0; r < 10; ++r) run(); CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1));
          float ms; CK(cudaEventElapsedTime(&ms, e0, e1));
          double tf = flop * 10 / (ms * 1e-3) / 1e12;
          char b2[48]; snprintf(b2, sizeof b2, " t%uo%uw%u:%.0f", tile, co, sw, tf);
          if (tf > eb) { eb = tf; snprintf(ebs, sizeof ebs, "t%u o%u w%u", tile, co, sw); }
          if (getenv("VERB")) printf("   %s\n", b2);
        }
        printf("%-12s %-10s EXH tried %d ran %d best %.0f [%s]\n", g.name, md.name, tried, ok, eb, ebs);
        fflush(stdout);
      }
      printf("%-12s %-10s found %2d first %6.0f best %6.0f (#%d) |%s\n", g.name, md.name, found, first, best, bi, all.c_str());
      fflush(stdout);
      cublasLtMatmulPreferenceDestroy(pref); cublasLtMatrixLayoutDestroy(la); cublasLtMatrixLayoutDestroy(lb);
      cublasLtMatrixLayoutDestroy(lc); cublasLtMatmulDescDestroy(desc);
    }
  }
  return 0;
}
