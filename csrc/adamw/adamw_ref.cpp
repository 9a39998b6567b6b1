// CPU reference of the fused AdamW step (coat/adamw.h). A real path, not only a test oracle:
// `coat train` on a machine without a GPU steps with it, so large steps are split over threads
// (groups are independent).
#include <algorithm>
#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "adamw_math.h"
#include "fp8_states.h"
#include "coat/adamw.h"
#include "common/dre.h"
#include "common/fp8.h"
#include "common/host_dispatch.h"

namespace coat {
namespace ref {
namespace {

constexpr int G = kDreGroupSize;

int64_t groups_of(int64_t n) { return (n + G - 1) / G; }

// code_log2 tables of both formats, built once.
const float* lq_table(Fp8Format fmt) {
  struct Tables {
    float t[2][128];
    Tables() {
      for (int f = 0; f < 2; ++f)
        for (int i = 0; i < 128; ++i) t[f][i] = adamw::code_log2(i, static_cast<Fp8Format>(f));
    }
  };
  static const Tables tables;
  return tables.t[static_cast<int>(fmt)];
}

// One group's step; returns the largest finite |parameter| it wrote (as stored).
template <typename P, typename Gr, MasterKind M>
float step_group(const AdamwTensor& d, int64_t lg, const adamw::Scalars& s, const AdamwConfig& c,
                 float inv_gs, uint64_t t) {
  const int64_t begin = lg * G;
  const int n = static_cast<int>(std::min<int64_t>(G, d.numel - begin));
  auto* param = static_cast<P*>(d.param) + begin;
  const auto* grad = static_cast<const Gr*>(d.grad) + begin;
  const float* lq_m = lq_table(c.m_fmt);
  const float* lq_v = lq_table(c.v_fmt);
  float p[G], m[G], v[G];
  const DreGroupFast m_old = dre_group_fast(d.m_gmax[lg], d.m_k16[lg], c.m_fmt);
  const DreGroupFast v_old = dre_group_fast(d.v_gmax[lg], d.v_k16[lg], c.v_fmt);
  float m_hi = 0.0f, m_lo = INFINITY, v_hi = 0.0f, v_lo = INFINITY;
  for (int i = 0; i < n; ++i) {
    const float g = Elem<Gr>::load(grad[i]) * inv_gs;
    m[i] = adamw::decode_state(d.m_q[begin + i], m_old, lq_m);
    v[i] = adamw::decode_state(d.v_q[begin + i], v_old, lq_v);
    const float p0 = M == MasterKind::kFp32 ? d.master[begin + i] : Elem<P>::load(param[i]);
    p[i] = adamw::update(p0, g, m[i], v[i], s);
    adamw::group_minmax(m[i], m_hi, m_lo);
    adamw::group_minmax(v[i], v_hi, v_lo);
  }
  float m_2 = 0.0f, v_2 = 0.0f;
  for (int i = 0; i < n; ++i) {
    adamw::group_second(m[i], m_hi, m_2);
    adamw::group_second(v[i], v_hi, v_2);
  }
  const DreNewGroupFast m_new = adamw::new_group(m_hi, m_2, m_lo, c.expansion, c.m_log2_range, c.m_fmt);
  const DreNewGroupFast v_new = adamw::new_group(v_hi, v_2, v_lo, c.expansion, c.v_log2_range, c.v_fmt);
  d.m_gmax[lg] = m_new.word;
  d.m_k16[lg] = m_new.k16;
  d.v_gmax[lg] = v_new.word;
  d.v_k16[lg] = v_new.k16;
  for (int i = 0; i < n; ++i) {
    d.m_q[begin + i] = adamw::encode_state(m[i], m_new.g, c.m_fmt);
    d.v_q[begin + i] = adamw::encode_state(v[i], v_new.g, c.v_fmt);
  }
  if constexpr (M == MasterKind::kBf16Sr) {
    // begin is a multiple of 4, so the quads are the kernel's (element index / 4).
    for (int i = 0; i < n; i += 4) {
      const uint64_t r = adamw::sr_bits(d.seed, t, static_cast<uint64_t>((begin + i) / 4));
      for (int j = 0; j < 4 && i + j < n; ++j)
        param[i + j] = P{adamw::bf16_sr(p[i + j], static_cast<uint32_t>(r >> (16 * j)))};
    }
  } else {
    for (int i = 0; i < n; ++i) {
      if constexpr (M == MasterKind::kFp32) d.master[begin + i] = p[i];
      param[i] = Elem<P>::store(p[i]);
    }
  }
  float pmax = 0.0f;
  for (int i = 0; i < n; ++i) pmax = std::max(pmax, finite_abs(Elem<P>::load(param[i])));
  return pmax;
}

template <typename P, typename Gr, MasterKind M>
void step_range(const AdamwTensor* tensors, int64_t n_tensors, int64_t g0, int64_t g1,
                double lr, const AdamwConfig& c, float inv_gs) {
  // First tensor whose groups reach past g0.
  int64_t ti = std::upper_bound(tensors, tensors + n_tensors, g0,
                                [](int64_t g, const AdamwTensor& d) { return g < d.group_begin; }) -
               tensors - 1;
  for (; ti < n_tensors; ++ti) {
    const AdamwTensor& d = tensors[ti];
    const int64_t b = std::max(g0, d.group_begin), e = std::min(g1, d.group_begin + groups_of(d.numel));
    if (b >= g1) break;
    const uint64_t t = adamw::step_count(*d.step);
    const adamw::Scalars s = adamw::make_scalars(lr, c, t);
    float pmax = 0.0f;
    for (int64_t g = b; g < e; ++g) pmax = std::max(pmax, step_group<P, Gr, M>(d, g - d.group_begin, s, c, inv_gs, t));
    if (d.param_amax != nullptr && b < e) max_into(d.param_amax, pmax);
  }
}

template <typename P, typename Gr, MasterKind M>
void run(const AdamwTensor* tensors, int64_t n_tensors, int64_t n_groups, double lr,
         const AdamwConfig& c, float inv_gs) {
  // ~1 us per group: threads pay off from a few thousand groups on.
  const int64_t want = std::min<int64_t>(c.cpu_threads, n_groups / 2048);
  if (want <= 1) return step_range<P, Gr, M>(tensors, n_tensors, 0, n_groups, lr, c, inv_gs);
  std::vector<std::thread> pool;
  const int64_t per = (n_groups + want - 1) / want;
  for (int64_t w = 1; w < want; ++w) {
    const int64_t g0 = w * per, g1 = std::min(n_groups, g0 + per);
    if (g0 < g1) pool.emplace_back(step_range<P, Gr, M>, tensors, n_tensors, g0, g1, lr, std::cref(c), inv_gs);
  }
  step_range<P, Gr, M>(tensors, n_tensors, 0, std::min(per, n_groups), lr, c, inv_gs);
  for (auto& th : pool) th.join();
}

template <typename P, MasterKind M>
void dispatch_grad(const AdamwTensor* t, int64_t nt, int64_t ng, double lr, const AdamwConfig& c, float gs) {
  switch (c.grad_dtype) {
    case DType::kFloat32: return run<P, float, M>(t, nt, ng, lr, c, gs);
    case DType::kBFloat16: return run<P, HostBf16, M>(t, nt, ng, lr, c, gs);
    case DType::kFloat16: return run<P, HostFp16, M>(t, nt, ng, lr, c, gs);
  }
}

void check_tensors(const AdamwTensor* tensors, int64_t n_tensors, int64_t n_groups, MasterKind master) {
  COAT_CHECK_ARG(n_tensors == 0 || tensors != nullptr, "tensors must not be null");
  int64_t next = 0;
  for (int64_t i = 0; i < n_tensors; ++i) {
    const AdamwTensor& d = tensors[i];
    const std::string at = "tensor descriptor " + std::to_string(i);
    COAT_CHECK_ARG(d.numel > 0, at + ": numel must be > 0");
    COAT_CHECK_ARG(d.group_begin == next, at + ": group_begin must be " + std::to_string(next));
    COAT_CHECK_ARG(d.param && d.grad && d.m_q && d.m_gmax && d.m_k16 && d.v_q && d.v_gmax && d.v_k16 && d.step,
                   at + ": null pointer");
    COAT_CHECK_ARG((master == MasterKind::kFp32) == (d.master != nullptr),
                   at + ": master must be given exactly for an fp32 master");
    next += groups_of(d.numel);
  }
  COAT_CHECK_ARG(next == n_groups, "n_groups is " + std::to_string(n_groups) + " but the descriptors cover " +
                                       std::to_string(next));
}

}  // namespace

void adamw_step(const AdamwTensor* tensors, int64_t n_tensors, int64_t n_groups, const AdamwConfig& c) {
  detail::check_adamw_config(n_tensors, n_groups, c);
  check_tensors(tensors, n_tensors, n_groups, c.master);
  if (c.found_inf != nullptr && *c.found_inf != 0.0f) return;
  const double lr = c.lr_tensor != nullptr ? static_cast<double>(*c.lr_tensor) : c.lr;
  const float gs = adamw::grad_multiplier(c);
  switch (c.master) {
    case MasterKind::kNone: return dispatch_grad<float, MasterKind::kNone>(tensors, n_tensors, n_groups, lr, c, gs);
    case MasterKind::kBf16Sr:
      return dispatch_grad<HostBf16, MasterKind::kBf16Sr>(tensors, n_tensors, n_groups, lr, c, gs);
    case MasterKind::kFp32:
      if (c.param_dtype == DType::kBFloat16)
        return dispatch_grad<HostBf16, MasterKind::kFp32>(tensors, n_tensors, n_groups, lr, c, gs);
      return dispatch_grad<HostFp16, MasterKind::kFp32>(tensors, n_tensors, n_groups, lr, c, gs);
  }
}

}  // namespace ref
}  // namespace coat
