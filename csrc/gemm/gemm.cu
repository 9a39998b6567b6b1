// FP8 GEMM on cuBLASLt, plus the small kernels around it (bf16 decode for devices without FP8
// tensor cores, amax of a bf16/fp32 output, the K == 0 / FP8-output finishing pass).
//
// Row-major Y[M,N] = A[M,K] B[N,K]^T is column-major Y^T[N,M] = B_cm^T A_cm with both operands
// K-contiguous: cuBLASLt's A is our b (TRANSA = T, K x N, ld K), its B is our a (TRANSB = N,
// K x M, ld K), D is N x M with ld N. That "TN" form is the one cuBLASLt FP8 kernels require.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "common/cuda_utils.cuh"
#include "gemm_args.h"

#define COAT_CUBLAS_CHECK(expr)                                                                  \
  do {                                                                                           \
    const cublasStatus_t st_ = (expr);                                                           \
    if (st_ != CUBLAS_STATUS_SUCCESS)                                                            \
      ::coat::throw_error(std::string(#expr) + ": " + cublasLtGetStatusName(st_) + " (" +        \
                              cublasLtGetStatusString(st_) + ")",                                \
                          __FILE__, __LINE__);                                                   \
  } while (0)

namespace coat {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxDevices = 64;
constexpr size_t kMaxPlans = 256;

// ---- kernels ----------------------------------------------------------------------------------

// Device scalars in the workspace's reserved head: [0] = 1/out_scale (cuBLASLt's D scale is a
// quantization multiplier), [1] = alpha = a_scale * b_scale and [2] = beta = 0 for the bf16 path's
// device pointer mode. One thread; 12 bytes written.
__global__ void prep_scalars_kernel(const float* a_scale, const float* b_scale,
                                    const float* out_scale, float* head) {
  head[0] = out_scale ? 1.0f / *out_scale : 1.0f;
  head[1] = *a_scale * *b_scale;
  head[2] = 0.0f;
}

// FP8 codes -> bf16, exactly (every FP8 value is a bf16 value). Thread t converts 8-code chunks
// t, t + stride, ...: 8 bytes read, 16 written per chunk; the scalar tail covers n % 8 and
// unaligned pointers.
__global__ void decode_bf16_kernel(const uint8_t* __restrict__ q, int64_t n, Fp8Format fmt,
                                   bool vec, bf16_t* __restrict__ y) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t chunks = vec ? n / 8 : 0;
  for (int64_t c = tid; c < chunks; c += stride) {
    float v[8];
    cuda::decode8(reinterpret_cast<const uint2*>(q)[c], fmt, v);
    cuda::store8(y + c * 8, v);
  }
  for (int64_t i = chunks * 8 + tid; i < n; i += stride) y[i] = __float2bfloat16_rn(decode_fp8(q[i], fmt));
}

// amax of a stored bf16/fp32 output [n elements]. Grid-stride, one element per thread step:
// n * sizeof(T) bytes read.
template <typename T>
__global__ void amax_kernel(const T* __restrict__ y, int64_t n, float* amax) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  float m = 0.0f;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    m = fmaxf(m, finite_abs(Elem<T>::load(y[i])));
  cuda::block_max_atomic(m, amax);
}

// Finishing pass for what cuBLASLt does not produce directly: v = acc[i] (or 0 when acc is null,
// K == 0) + bias[i % n_cols], amax, and the store as out_type (E4M3 codes use 1/out_scale). Thread
// per element, grid-stride: 4 (acc) + 2 (bias, cached) bytes read, 1-4 written per element.
__global__ void finish_kernel(const float* __restrict__ acc, const bf16_t* __restrict__ bias,
                              int64_t total, int64_t n_cols, GemmOut out_type,
                              const float* out_scale, void* __restrict__ out, float* amax) {
  const float inv = out_type == GemmOut::kE4M3 ? 1.0f / *out_scale : 1.0f;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  float m = 0.0f;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += stride) {
    float v = acc ? acc[i] : 0.0f;
    if (bias) v += __bfloat162float(bias[i % n_cols]);
    m = fmaxf(m, finite_abs(v));
    switch (out_type) {
      case GemmOut::kFloat32: static_cast<float*>(out)[i] = v; break;
      case GemmOut::kBFloat16: static_cast<bf16_t*>(out)[i] = __float2bfloat16_rn(v); break;
      case GemmOut::kE4M3: static_cast<uint8_t*>(out)[i] = encode_fp8(v * inv, Fp8Format::kE4M3); break;
    }
  }
  if (amax) cuda::block_max_atomic(m, amax);
}

// ---- cuBLASLt state ---------------------------------------------------------------------------

struct DeviceState {
  std::once_flag once;
  cublasLtHandle_t handle = nullptr;
  int cc = 0;  // 10 * major + minor
};

DeviceState& device_state(int dev) {
  COAT_CHECK(dev >= 0 && dev < kMaxDevices, "device index out of range");
  // Leaked on purpose: handles must outlive every static destructor that might still run a GEMM.
  static DeviceState* states = new DeviceState[kMaxDevices];
  DeviceState& s = states[dev];
  std::call_once(s.once, [&] {
    int major = 0, minor = 0;
    COAT_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    COAT_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
    s.cc = major * 10 + minor;
    COAT_CUBLAS_CHECK(cublasLtCreate(&s.handle));  // the current device is `dev`
  });
  return s;
}

int device_now() {
  int dev = 0;
  COAT_CUDA_CHECK(cudaGetDevice(&dev));
  return dev;
}

uint32_t alignment_of(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  uint32_t al = 256;
  while (al > 1 && a % al != 0) al >>= 1;
  return al;
}

cudaDataType_t fp8_type(Fp8Format f) { return f == Fp8Format::kE4M3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2; }

// cuBLASLt's scale mode of a coat ScaleMode (the layouts are the same, coat/common.h).
int32_t lt_scale_mode(ScaleMode m) {
  switch (m) {
    case ScaleMode::kTensor: return CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
    case ScaleMode::kRow: return CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
    case ScaleMode::kVec128: return CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    case ScaleMode::kBlock128: return CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
  }
  return CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
}

// Everything the heuristic's choice depends on.
using PlanKey = std::tuple<int, int64_t, int64_t, int64_t, int, int, int, bool, bool, bool,
                           uint32_t, uint32_t, uint32_t, uint32_t, size_t, bool, int, int>;

// Descriptors and the chosen algorithm of one problem. The descriptor carries per-call pointers
// (scales, bias, amax), so a call holds `mu` from setting them until cublasLtMatmul is enqueued.
struct Plan {
  std::mutex mu;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr, ld = nullptr;
  cublasLtMatmulAlgo_t algo{};
  ~Plan() {
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (lc) cublasLtMatrixLayoutDestroy(lc);
    if (ld) cublasLtMatrixLayoutDestroy(ld);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

// FIFO-bounded map of plans; shared_ptr keeps an evicted plan alive for a call still using it.
struct PlanCache {
  std::mutex mu;
  std::map<PlanKey, std::shared_ptr<Plan>> plans;
  std::list<PlanKey> order;
};
PlanCache& plan_cache() {
  static PlanCache* c = new PlanCache;  // leaked: see device_state
  return *c;
}

template <typename T>
void set_attr(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t a, const T& v) {
  COAT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, a, &v, sizeof(v)));
}

// What one cuBLASLt call needs, whichever path (FP8 or bf16) builds it.
struct LtCall {
  bool bf16_path;
  const void *a_op, *b_op;  // cuBLASLt A (our b) and B (our a)
  const float *a_op_scale, *b_op_scale;
  const void* bias;
  void* d;
  cudaDataType_t d_type;
  const float* d_scale;  // quantization multiplier for FP8 D
  float* amax;           // fused amax (FP8 D only)
  const float* alpha_dev;  // bf16 path: device alpha, beta
};

std::shared_ptr<Plan> get_plan(const PlanKey& key, const Fp8GemmArgs& g, const LtCall& c,
                               cublasLtHandle_t handle, size_t ws_bytes) {
  PlanCache& cache = plan_cache();
  {
    std::lock_guard<std::mutex> lock(cache.mu);
    auto it = cache.plans.find(key);
    if (it != cache.plans.end()) return it->second;
  }
  auto p = std::make_shared<Plan>();
  const cudaDataType_t ta = c.bf16_path ? CUDA_R_16BF : fp8_type(g.b_fmt);
  const cudaDataType_t tb = c.bf16_path ? CUDA_R_16BF : fp8_type(g.a_fmt);
  // C is never read (beta = 0) but its type must be one cuBLASLt pairs with D: bf16 for FP8 D.
  const cudaDataType_t tc = c.d_type == CUDA_R_8F_E4M3 ? CUDA_R_16BF : c.d_type;
  COAT_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  set_attr(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T);
  set_attr(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N);
  if (c.bf16_path) {
    set_attr(p->desc, CUBLASLT_MATMUL_DESC_POINTER_MODE, CUBLASLT_POINTER_MODE_DEVICE);
  } else {
    // Without fast accumulation, partial sums are promoted to fp32 periodically (the default).
    const int8_t fast_accum = g.fast_accum ? 1 : 0;
    set_attr(p->desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, fast_accum);
    set_attr(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(c.a_op_scale));
    set_attr(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(c.b_op_scale));
    if (g.a_mode != ScaleMode::kTensor) {  // cuBLASLt's A is our b
      set_attr(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, lt_scale_mode(g.b_mode));
      set_attr(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, lt_scale_mode(g.a_mode));
    }
    if (c.d_type == CUDA_R_8F_E4M3)
      set_attr(p->desc, CUBLASLT_MATMUL_DESC_D_SCALE_POINTER, static_cast<const void*>(c.d_scale));
    if (c.amax) set_attr(p->desc, CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, static_cast<void*>(c.amax));
  }
  if (c.bias) {
    set_attr(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_EPILOGUE_BIAS);
    set_attr(p->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, CUDA_R_16BF);
    set_attr(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, c.bias);
  }
  const auto K = static_cast<uint64_t>(g.k), N = static_cast<uint64_t>(g.n),
             M = static_cast<uint64_t>(g.m);
  COAT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->la, ta, K, N, g.k));
  COAT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->lb, tb, K, M, g.k));
  COAT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->lc, tc, N, M, g.n));
  COAT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->ld, c.d_type, N, M, g.n));

  cublasLtMatmulPreference_t pref = nullptr;
  COAT_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  std::unique_ptr<cublasLtMatmulPreferenceOpaque_t, decltype(&cublasLtMatmulPreferenceDestroy)>
      pref_guard(pref, &cublasLtMatmulPreferenceDestroy);
  auto set_pref = [&](cublasLtMatmulPreferenceAttributes_t a, auto v) {
    COAT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, a, &v, sizeof(v)));
  };
  set_pref(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, static_cast<uint64_t>(ws_bytes));
  set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, alignment_of(c.a_op));
  set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, alignment_of(c.b_op));
  set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, alignment_of(c.d));
  set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, alignment_of(c.d));
  cublasLtMatmulHeuristicResult_t res{};
  int found = 0;
  COAT_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(handle, p->desc, p->la, p->lb, p->lc, p->ld, pref,
                                                   1, &res, &found));
  if (found == 0)
    throw_error("cuBLASLt found no kernel for the FP8 GEMM M=" + std::to_string(g.m) +
                    " N=" + std::to_string(g.n) + " K=" + std::to_string(g.k) +
                    (c.bf16_path ? " (bf16 path)" : ""),
                __FILE__, __LINE__);
  p->algo = res.algo;

  std::lock_guard<std::mutex> lock(cache.mu);
  auto it = cache.plans.find(key);
  if (it != cache.plans.end()) return it->second;  // another thread won the race
  cache.plans.emplace(key, p);
  cache.order.push_back(key);
  while (cache.order.size() > kMaxPlans) {
    cache.plans.erase(cache.order.front());
    cache.order.pop_front();
  }
  return p;
}

void run_lt(const Fp8GemmArgs& g, const LtCall& c, DeviceState& ds, int dev, void* ws,
            size_t ws_bytes, cudaStream_t stream) {
  const PlanKey key{dev,
                    g.m,
                    g.n,
                    g.k,
                    c.bf16_path ? -1 : static_cast<int>(g.a_fmt),
                    c.bf16_path ? -1 : static_cast<int>(g.b_fmt),
                    static_cast<int>(c.d_type),
                    c.bias != nullptr,
                    c.amax != nullptr,
                    c.bf16_path,
                    alignment_of(c.a_op),
                    alignment_of(c.b_op),
                    alignment_of(c.d),
                    alignment_of(c.bias),
                    ws_bytes,
                    !c.bf16_path && g.fast_accum,
                    static_cast<int>(g.a_mode),
                    static_cast<int>(g.b_mode)};
  std::shared_ptr<Plan> p = get_plan(key, g, c, ds.handle, ws_bytes);
  std::lock_guard<std::mutex> lock(p->mu);
  if (!c.bf16_path) {
    set_attr(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(c.a_op_scale));
    set_attr(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(c.b_op_scale));
    if (c.d_type == CUDA_R_8F_E4M3)
      set_attr(p->desc, CUBLASLT_MATMUL_DESC_D_SCALE_POINTER, static_cast<const void*>(c.d_scale));
    if (c.amax) set_attr(p->desc, CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, static_cast<void*>(c.amax));
  }
  if (c.bias) set_attr(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, c.bias);
  static const float kOne = 1.0f, kZero = 0.0f;
  const void* alpha = c.bf16_path ? static_cast<const void*>(c.alpha_dev) : &kOne;
  const void* beta = c.bf16_path ? static_cast<const void*>(c.alpha_dev + 1) : &kZero;
  // C is never needed (beta = 0). The FP8 path passes none (its C type differs from D's for FP8
  // output); the bf16 path's beta lives on the device, so it gets a valid C: D itself, same layout.
  const void* cptr = c.bf16_path ? c.d : nullptr;
  COAT_CUBLAS_CHECK(cublasLtMatmul(ds.handle, p->desc, alpha, c.a_op, p->la, c.b_op, p->lb, beta,
                                   cptr, p->lc, c.d, p->ld, &p->algo, ws, ws_bytes, stream));
}

size_t align256(size_t x) { return (x + 255) & ~size_t(255); }

bool use_bf16_path(const DeviceState& ds, bool force_bf16) { return force_bf16 || ds.cc < 89; }

}  // namespace

bool gemm_fp8_native(int device) {
  const DeviceRestore keep;
  set_current_device(device);
  return !use_bf16_path(device_state(device), false);
}

size_t gemm_fp8_scratch_bytes(int device, int64_t m, int64_t n, int64_t k, GemmOut out_type,
                              bool force_bf16) {
  COAT_CHECK_ARG(m >= 0 && n >= 0 && k >= 0, "GEMM sizes must be >= 0");
  const DeviceRestore keep;
  set_current_device(device);
  if (!use_bf16_path(device_state(device), force_bf16) || m == 0 || n == 0 || k == 0) return 0;
  size_t bytes = align256(static_cast<size_t>(m * k) * 2) + align256(static_cast<size_t>(n * k) * 2);
  if (out_type == GemmOut::kE4M3) bytes += align256(static_cast<size_t>(m * n) * 4);
  return bytes;
}

void gemm_fp8(const Fp8GemmArgs& g, void* workspace, size_t workspace_bytes, void* scratch,
              size_t scratch_bytes, bool force_bf16, cudaStream_t stream) {
  detail::check_gemm(g);
  detail::check_gemm_cuda(g);
  COAT_CHECK_ARG(workspace != nullptr && workspace_bytes >= kGemmWorkspaceReserve &&
                     alignment_of(workspace) == 256,
                 "workspace must be a 256-byte aligned device buffer of at least " +
                     std::to_string(kGemmWorkspaceReserve) + " bytes");
  const int dev = device_now();
  DeviceState& ds = device_state(dev);
  const bool bf16_path = use_bf16_path(ds, force_bf16);
  if (g.a_mode != ScaleMode::kTensor)
    COAT_CHECK_ARG(!bf16_path && ds.cc == 90,
                   std::string("row and block FP8 scaling run on sm_90 GPUs (Hopper) only: cuBLASLt has no ") +
                       (bf16_path ? "bf16 fallback" : "such kernels on compute capability " +
                                                          std::to_string(ds.cc / 10) + "." + std::to_string(ds.cc % 10)) +
                       " for them; use per-tensor scaling (granularity='tensor')");
  const size_t need = gemm_fp8_scratch_bytes(dev, g.m, g.n, g.k, g.out_type, force_bf16);
  COAT_CHECK_ARG(scratch_bytes >= need && (need == 0 || scratch != nullptr),
                 "scratch must hold " + std::to_string(need) + " bytes for this GEMM on this device "
                 "(gemm_fp8_scratch_bytes), got " + std::to_string(scratch_bytes));
  const int64_t total = g.m * g.n;
  if (g.amax) COAT_CUDA_CHECK(cudaMemsetAsync(g.amax, 0, sizeof(float), stream));
  if (total == 0) return;
  const auto* bias = static_cast<const bf16_t*>(g.bias);
  if (g.k == 0) {  // Y = bias (or 0): no GEMM to run
    finish_kernel<<<cuda::grid_for(total, kThreads), kThreads, 0, stream>>>(
        nullptr, bias, total, g.n, g.out_type, g.out_scale, g.out, g.amax);
    COAT_CHECK_LAUNCH();
    return;
  }
  auto* head = static_cast<float*>(workspace);
  void* lt_ws = static_cast<uint8_t*>(workspace) + kGemmWorkspaceReserve;
  const size_t lt_ws_bytes = workspace_bytes - kGemmWorkspaceReserve;
  const bool fp8_out = g.out_type == GemmOut::kE4M3;
  if (fp8_out || bf16_path) {
    prep_scalars_kernel<<<1, 1, 0, stream>>>(g.a_scale, g.b_scale, g.out_scale, head);
    COAT_CHECK_LAUNCH();
  }

  LtCall c{};
  c.bf16_path = bf16_path;
  c.bias = g.bias;
  c.d = g.out;
  c.d_type = g.out_type == GemmOut::kFloat32 ? CUDA_R_32F
             : g.out_type == GemmOut::kBFloat16 ? CUDA_R_16BF
                                                 : CUDA_R_8F_E4M3;
  if (!bf16_path) {
    c.a_op = g.b;
    c.b_op = g.a;
    c.a_op_scale = g.b_scale;
    c.b_op_scale = g.a_scale;
    c.d_scale = head;  // 1 / out_scale
    c.amax = fp8_out ? g.amax : nullptr;
    run_lt(g, c, ds, dev, lt_ws, lt_ws_bytes, stream);
  } else {
    // Decode both operands exactly to bf16, then a bf16 GEMM with alpha = a_scale * b_scale.
    auto* base = static_cast<uint8_t*>(scratch);
    auto* a16 = reinterpret_cast<bf16_t*>(base);
    auto* b16 = reinterpret_cast<bf16_t*>(base + align256(static_cast<size_t>(g.m * g.k) * 2));
    auto* acc = reinterpret_cast<float*>(reinterpret_cast<uint8_t*>(b16) +
                                         align256(static_cast<size_t>(g.n * g.k) * 2));
    const bool vec = cuda::aligned(g.a, 8) && cuda::aligned(g.b, 8) && cuda::aligned(scratch, 16);
    decode_bf16_kernel<<<cuda::grid_for(g.m * g.k / 8 + 1, kThreads), kThreads, 0, stream>>>(
        g.a, g.m * g.k, g.a_fmt, vec, a16);
    COAT_CHECK_LAUNCH();
    decode_bf16_kernel<<<cuda::grid_for(g.n * g.k / 8 + 1, kThreads), kThreads, 0, stream>>>(
        g.b, g.n * g.k, g.b_fmt, vec, b16);
    COAT_CHECK_LAUNCH();
    c.a_op = b16;
    c.b_op = a16;
    c.alpha_dev = head + 1;
    if (fp8_out) {  // fp32 result first; bias, amax and the E4M3 store in the finishing pass
      c.d = acc;
      c.d_type = CUDA_R_32F;
      c.bias = nullptr;
    }
    run_lt(g, c, ds, dev, lt_ws, lt_ws_bytes, stream);
    if (fp8_out) {
      finish_kernel<<<cuda::grid_for(total, kThreads), kThreads, 0, stream>>>(
          acc, bias, total, g.n, g.out_type, g.out_scale, g.out, g.amax);
      COAT_CHECK_LAUNCH();
      return;
    }
  }
  if (g.amax && !fp8_out) {  // cuBLASLt has no amax for bf16/fp32 D with FP8 inputs
    const unsigned grid = cuda::grid_for(total, kThreads, 4);
    if (g.out_type == GemmOut::kFloat32)
      amax_kernel<<<grid, kThreads, 0, stream>>>(static_cast<const float*>(g.out), total, g.amax);
    else
      amax_kernel<<<grid, kThreads, 0, stream>>>(static_cast<const bf16_t*>(g.out), total, g.amax);
    COAT_CHECK_LAUNCH();
  }
}

}  // namespace coat
