// CPU reference of the 4-bit AdamW step (coat/adamw4.h). A real path, not only a test oracle: the
// step of coat.optim.AdamW4bit on CPU tensors. Pass one (the rank-1 maxima of the new v) runs per
// tensor; pass two (the step) splits its groups over threads (groups are independent).
#include <algorithm>
#include <array>
#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "adamw4_math.h"
#include "coat/adamw4.h"
#include "common/fp8.h"
#include "common/host_dispatch.h"

namespace coat {
namespace ref {
namespace {

constexpr int G = kAdamw4Block;
using adamw4::groups_of;

// Rank-1 maxima of step t's new v into the new buffer (the old one decodes the codes).
template <typename Gr>
void rank1_stats(const Adamw4Tensor& d, const AdamwConfig& c, double lr, float inv_gs) {
  const uint64_t t = adamw::step_count(*d.step);
  const adamw::Scalars s = adamw::make_scalars(lr, c, t);
  const float* old_r = d.v_scale + adamw4::old_buffer(t) * (d.rows + d.cols);
  const float* old_c = old_r + d.rows;
  auto* new_r = reinterpret_cast<uint32_t*>(d.v_scale + adamw4::new_buffer(t) * (d.rows + d.cols));
  uint32_t* new_c = new_r + d.rows;
  std::fill(new_r, new_r + d.rows + d.cols, 0u);
  const auto* grad = static_cast<const Gr*>(d.grad);
  const auto* codes = static_cast<const uint8_t*>(d.v);
  for (int64_t i = 0, e = 0; i < d.rows; ++i) {
    uint32_t row = 0;
    for (int64_t j = 0; j < d.cols; ++j, ++e) {
      const float v_old = adamw4::decode_v(adamw4::nibble(codes, e), adamw4::rank1_scale(old_r[i], old_c[j]));
      const uint32_t k = adamw4::max_key(adamw4::new_v(v_old, Elem<Gr>::load(grad[e]) * inv_gs, s));
      row = adamw4::umax(row, k);
      new_c[j] = adamw4::umax(new_c[j], k);
    }
    new_r[i] = row;
  }
}

// m's bucket table (encode_m_table).
const adamw4::MBucket* m_buckets() {
  static const std::array<adamw4::MBucket, adamw4::kMBuckets> table = [] {
    std::array<adamw4::MBucket, adamw4::kMBuckets> t{};
    for (int i = 0; i < adamw4::kMBuckets; ++i) t[i] = adamw4::m_bucket(i);
    return t;
  }();
  return table.data();
}

// Encode a group's new moments (n elements from `begin`) and write its block scales.
void store_states(const Adamw4Tensor& d, int64_t lg, int64_t begin, int n, const float* m, const float* v,
                  uint64_t t) {
  if (d.kind == Adamw4Kind::kFull) {
    std::copy(m, m + n, static_cast<float*>(d.m) + begin);
    std::copy(v, v + n, static_cast<float*>(d.v) + begin);
    return;
  }
  uint32_t mk = 0, vk = 0;
  for (int i = 0; i < n; ++i) {
    mk = adamw4::umax(mk, adamw4::max_key(m[i]));
    vk = adamw4::umax(vk, adamw4::max_key(v[i]));
  }
  const float ms = float_of(mk), rm = adamw4::recip(ms);
  d.m_scale[lg] = ms;
  if (d.kind == Adamw4Kind::kBlock) d.v_scale[lg] = float_of(vk);
  auto* mq = static_cast<uint8_t*>(d.m) + begin / 2;
  auto* vq = static_cast<uint8_t*>(d.v) + begin / 2;
  for (int i = 0; i < n; i += 2) {
    int mc[2] = {0, 0}, vc[2] = {0, 0};  // an odd tensor's last high nibble stays 0
    for (int h = 0; h < 2 && i + h < n; ++h) {
      const int64_t e = begin + i + h;
      const int64_t cols = d.kind == Adamw4Kind::kRank1 ? d.cols : 1;
      const float vs = adamw4::v_scale_of(d, lg, e / cols, e % cols, adamw4::new_buffer(t));
      mc[h] = adamw4::encode_m_table(m[i + h], ms, rm, m_buckets());
      vc[h] = adamw4::encode_v_fast(v[i + h], vs, adamw4::recip(vs));
    }
    mq[i / 2] = static_cast<uint8_t>(mc[0] | (mc[1] << 4));
    vq[i / 2] = static_cast<uint8_t>(vc[0] | (vc[1] << 4));
  }
}

// One group's step; returns the largest finite |parameter| it wrote (as stored).
template <typename P, typename Gr, MasterKind M>
float step_group(const Adamw4Tensor& d, int64_t lg, const adamw::Scalars& s, float inv_gs, uint64_t t) {
  const int64_t begin = lg * G;
  const int n = static_cast<int>(std::min<int64_t>(G, d.numel - begin));
  auto* param = static_cast<P*>(d.param) + begin;
  const auto* grad = static_cast<const Gr*>(d.grad) + begin;
  float p[G], m[G] = {}, v[G] = {};  // zeroed: only the first n are read, which -Wmaybe-uninitialized cannot see
  for (int i = 0; i < n; ++i) {
    const int64_t e = begin + i, cols = d.kind == Adamw4Kind::kRank1 ? d.cols : 1;
    const adamw4::Moments o = adamw4::old_moments(d, lg, e, e / cols, e % cols, t);
    m[i] = o.m;
    v[i] = o.v;
    const float p0 = M == MasterKind::kFp32 ? d.master[begin + i] : Elem<P>::load(param[i]);
    p[i] = adamw::update(p0, Elem<Gr>::load(grad[i]) * inv_gs, m[i], v[i], s);
  }
  store_states(d, lg, begin, n, m, v, t);
  if constexpr (M == MasterKind::kBf16Sr) {
    for (int i = 0; i < n; i += 4) {  // begin is a multiple of 4: the quads of coat::adamw_step
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
void step_range(const Adamw4Tensor* tensors, int64_t n_tensors, int64_t g0, int64_t g1, double lr,
                const AdamwConfig& c, float inv_gs) {
  int64_t ti = std::upper_bound(tensors, tensors + n_tensors, g0,
                                [](int64_t g, const Adamw4Tensor& d) { return g < d.group_begin; }) -
               tensors - 1;
  for (; ti < n_tensors; ++ti) {
    const Adamw4Tensor& d = tensors[ti];
    const int64_t b = std::max(g0, d.group_begin), e = std::min(g1, d.group_begin + groups_of(d.numel));
    if (b >= g1) break;
    const uint64_t t = adamw::step_count(*d.step);
    const adamw::Scalars s = adamw::make_scalars(lr, c, t);
    float pmax = 0.0f;
    for (int64_t g = b; g < e; ++g) pmax = std::max(pmax, step_group<P, Gr, M>(d, g - d.group_begin, s, inv_gs, t));
    if (d.param_amax != nullptr && b < e) max_into(d.param_amax, pmax);
  }
}

template <typename P, typename Gr, MasterKind M>
void run(const Adamw4Tensor* tensors, int64_t n_tensors, int64_t n_groups, double lr, const AdamwConfig& c,
         float inv_gs) {
  for (int64_t i = 0; i < n_tensors; ++i)
    if (tensors[i].kind == Adamw4Kind::kRank1) rank1_stats<Gr>(tensors[i], c, lr, inv_gs);
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
void dispatch_grad(const Adamw4Tensor* t, int64_t nt, int64_t ng, double lr, const AdamwConfig& c, float gs) {
  switch (c.grad_dtype) {
    case DType::kFloat32: return run<P, float, M>(t, nt, ng, lr, c, gs);
    case DType::kBFloat16: return run<P, HostBf16, M>(t, nt, ng, lr, c, gs);
    case DType::kFloat16: return run<P, HostFp16, M>(t, nt, ng, lr, c, gs);
  }
}

}  // namespace

void adamw4_step(const Adamw4Tensor* tensors, int64_t n_tensors, int64_t n_groups, const AdamwConfig& c) {
  detail::check_adamw_config(n_tensors, n_groups, c);
  COAT_CHECK_ARG(n_tensors == 0 || tensors != nullptr, "tensors must not be null");
  int64_t next = 0;
  for (int64_t i = 0; i < n_tensors; ++i) {
    detail::check_adamw4_descriptor(tensors[i], i, next, c.master);
    next += groups_of(tensors[i].numel);
  }
  COAT_CHECK_ARG(next == n_groups, "n_groups is " + std::to_string(n_groups) + " but the descriptors cover " +
                                       std::to_string(next));
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
