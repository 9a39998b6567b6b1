// CUDA 4-bit AdamW step against the CPU reference, bit for bit: both evaluate the same IEEE
// operations in the same order (adamw4_math.h; the kernel is compiled with --fmad=false and IEEE
// division and square root), and maxima are exact in any order. Codes, scales, row / column maxima,
// parameters and masters must be identical; only NaN payloads may differ (the hardware's NaN is
// canonical, the host's keeps an operand's), so NaNs compare as NaNs.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "adamw4_slot.h"
#include "coat/adamw4.h"

namespace coat {
namespace {

using namespace test4;  // NOLINT

#define CK(x) ASSERT_EQ((x), cudaSuccess)

// Device copies of a slot's buffers, `off` bytes past an allocation's start (misaligned when odd).
struct DeviceSlot {
  std::vector<void*> allocs;
  Adamw4Tensor d{};

  void* copy(const void* src, size_t bytes, size_t off) {
    uint8_t* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, bytes + off + 16), cudaSuccess);
    allocs.push_back(p);
    if (bytes) {
      EXPECT_EQ(cudaMemcpy(p + off, src, bytes, cudaMemcpyHostToDevice), cudaSuccess);
    }
    return p + off;
  }
  DeviceSlot(Slot& s, int64_t begin, size_t off) {
    d = s.desc(begin, 4321);
    d.param = copy(s.param.data(), s.param.size(), off * dtype_size(s.pt));
    d.grad = copy(s.grad.data(), s.grad.size(), off * dtype_size(s.gt));
    if (s.with_master) d.master = static_cast<float*>(copy(s.master.data(), 4 * s.master.size(), 4 * off));
    // Packed 4-bit codes are read byte by byte (any offset); full-precision states are floats.
    const size_t state_off = s.kind == Adamw4Kind::kFull ? 4 * off : off;
    d.m = copy(s.m.data(), s.m.size(), state_off);
    d.v = copy(s.v.data(), s.v.size(), state_off);
    if (d.m_scale) d.m_scale = static_cast<float*>(copy(s.m_scale.data(), 4 * s.m_scale.size(), 0));
    if (d.v_scale) d.v_scale = static_cast<float*>(copy(s.v_scale.data(), 4 * s.v_scale.size(), 0));
    d.step = static_cast<float*>(copy(&s.step, 4, 0));
  }
  ~DeviceSlot() {
    for (void* p : allocs) cudaFree(p);
  }
  template <typename T>
  std::vector<T> back(const void* p, size_t n) const {
    std::vector<T> out(n);
    EXPECT_EQ(cudaMemcpy(out.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }
};

void expect_values_equal(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want, DType t,
                         const std::string& where) {
  for (size_t i = 0; i < want.size() / dtype_size(t); ++i) {
    const float a = value_at(got, i, t), b = value_at(want, i, t);
    if (std::isnan(b)) ASSERT_TRUE(std::isnan(a)) << where << " element " << i;
    else ASSERT_EQ(bits_of(a), bits_of(b)) << where << " element " << i << ": " << a << " vs " << b;
  }
}

void expect_floats_equal(const std::vector<float>& got, const std::vector<float>& want, const std::string& where) {
  ASSERT_EQ(got.size(), want.size()) << where;
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::isnan(want[i])) ASSERT_TRUE(std::isnan(got[i])) << where << " " << i;
    else ASSERT_EQ(bits_of(got[i]), bits_of(want[i])) << where << " " << i << ": " << got[i] << " vs " << want[i];
  }
}

struct Combo {
  DType p, g;
  MasterKind m;
};

void run_combo(const Combo& cb) {
  struct Shape {
    int64_t r, c;
    Adamw4Kind k;
  };
  const Shape shapes[] = {{1, 1, Adamw4Kind::kRank1},     {3, 5000, Adamw4Kind::kRank1}, {5000, 3, Adamw4Kind::kRank1},
                          {129, 257, Adamw4Kind::kRank1},  {600, 700, Adamw4Kind::kRank1}, {129, 257, Adamw4Kind::kBlock},
                          {1, 70001, Adamw4Kind::kBlock},  {1, 1, Adamw4Kind::kFull},    {7, 300, Adamw4Kind::kFull},
                          // The kernel's vector paths (whole groups, aligned views: the even slots):
                          // statistics strips (cols % 128 == 0, a partial last strip, rows % 4 != 0),
                          // rank-1 with cols % 4 == 0 only, blocks, full states.
                          {48, 384, Adamw4Kind::kRank1},   {48, 384, Adamw4Kind::kRank1},
                          {40, 256, Adamw4Kind::kRank1},   {40, 256, Adamw4Kind::kRank1},
                          {37, 384, Adamw4Kind::kRank1},   {37, 384, Adamw4Kind::kRank1},
                          {64, 100, Adamw4Kind::kRank1},   {64, 100, Adamw4Kind::kRank1},
                          {3, 8196, Adamw4Kind::kBlock},   {3, 8196, Adamw4Kind::kBlock},
                          {16, 256, Adamw4Kind::kFull},    {16, 256, Adamw4Kind::kFull}};
  std::vector<Slot> host;
  for (const Shape& sh : shapes) host.emplace_back(sh.r, sh.c, sh.k, cb.p, cb.g, cb.m == MasterKind::kFp32);
  std::vector<std::unique_ptr<DeviceSlot>> dev;
  std::vector<Adamw4Tensor> ht, dt;
  int64_t groups = 0;
  std::vector<int64_t> begins;
  for (size_t i = 0; i < host.size(); ++i) {
    begins.push_back(groups);
    dev.push_back(std::make_unique<DeviceSlot>(host[i], groups, i % 2));
    ht.push_back(host[i].desc(groups, 4321));
    dt.push_back(dev.back()->d);
    groups += groups_of(host[i].n);
  }
  Adamw4Tensor* dtab = nullptr;
  CK(cudaMalloc(&dtab, dt.size() * sizeof(Adamw4Tensor)));
  CK(cudaMemcpy(dtab, dt.data(), dt.size() * sizeof(Adamw4Tensor), cudaMemcpyHostToDevice));
  AdamwConfig c = config(cb.p, cb.g, cb.m);
  c.cpu_threads = 4;
  for (int it = 1; it <= 4; ++it) {
    for (size_t i = 0; i < host.size(); ++i) {
      std::vector<float> g = normal(host[i].n, 1e-2f * it, 100 * it + i);
      if (it == 2) {
        for (int64_t e = 0; e < host[i].n; e += 5) g[e] = 0.0f;
      }
      if (it == 3 && i == 4) g[1234] = std::numeric_limits<float>::quiet_NaN();
      if (it == 3 && i == 6) g[77] = 3e30f;  // v overflows: a NaN block scale
      host[i].set_grad(g);  // a new buffer: the host descriptor must point at it
      host[i].step = static_cast<float>(it);
      ht[i] = host[i].desc(begins[i], 4321);
      CK(cudaMemcpy(const_cast<void*>(dt[i].grad), host[i].grad.data(), host[i].grad.size(), cudaMemcpyHostToDevice));
      CK(cudaMemcpy(const_cast<float*>(dt[i].step), &host[i].step, 4, cudaMemcpyHostToDevice));
    }
    ref::adamw4_step(ht.data(), ht.size(), groups, c);
    adamw4_step(dtab, dt.size(), groups, c, nullptr);
    CK(cudaDeviceSynchronize());
    for (size_t i = 0; i < host.size(); ++i) {
      const Slot& h = host[i];
      const DeviceSlot& d = *dev[i];
      const std::string where = "step " + std::to_string(it) + " tensor " + std::to_string(i) + " (" +
                                std::to_string(h.rows) + "x" + std::to_string(h.cols) + ", kind " +
                                std::to_string(static_cast<int>(h.kind)) + ", master " +
                                std::to_string(static_cast<int>(cb.m)) + ")";
      expect_values_equal(d.back<uint8_t>(d.d.param, h.param.size()), h.param, cb.p, where + " param");
      if (h.with_master) expect_floats_equal(d.back<float>(d.d.master, h.n), h.master, where + " master");
      if (h.kind == Adamw4Kind::kFull) {
        expect_values_equal(d.back<uint8_t>(d.d.m, h.m.size()), h.m, DType::kFloat32, where + " m");
        expect_values_equal(d.back<uint8_t>(d.d.v, h.v.size()), h.v, DType::kFloat32, where + " v");
        continue;
      }
      ASSERT_EQ(d.back<uint8_t>(d.d.m, h.m.size()), h.m) << where << " m codes";
      ASSERT_EQ(d.back<uint8_t>(d.d.v, h.v.size()), h.v) << where << " v codes";
      expect_floats_equal(d.back<float>(d.d.m_scale, h.m_scale.size()), h.m_scale, where + " m absmax");
      expect_floats_equal(d.back<float>(d.d.v_scale, h.v_scale.size()), h.v_scale, where + " v scales");
    }
  }
  CK(cudaFree(dtab));
}

TEST(Adamw4Gpu, MatchesReferenceBitForBit) {
  const Combo combos[] = {{DType::kFloat32, DType::kFloat32, MasterKind::kNone},
                          {DType::kFloat32, DType::kBFloat16, MasterKind::kNone},
                          {DType::kBFloat16, DType::kBFloat16, MasterKind::kFp32},
                          {DType::kFloat16, DType::kFloat16, MasterKind::kFp32},
                          {DType::kBFloat16, DType::kFloat32, MasterKind::kBf16Sr},
                          {DType::kBFloat16, DType::kBFloat16, MasterKind::kBf16Sr}};
  for (const Combo& cb : combos) {
    run_combo(cb);
    if (HasFatalFailure()) return;
  }
}

TEST(Adamw4Gpu, FoundInfWritesNothing) {
  Slot s(600, 700, Adamw4Kind::kRank1);
  s.step = 1.0f;
  DeviceSlot d(s, 0, 0);
  Adamw4Tensor* dtab = nullptr;
  CK(cudaMalloc(&dtab, sizeof(Adamw4Tensor)));
  CK(cudaMemcpy(dtab, &d.d, sizeof(Adamw4Tensor), cudaMemcpyHostToDevice));
  float one = 1.0f;
  float* found = static_cast<float*>(d.copy(&one, 4, 0));
  AdamwConfig c = config();
  c.found_inf = found;
  adamw4_step(dtab, 1, groups_of(s.n), c, nullptr);
  CK(cudaDeviceSynchronize());
  EXPECT_EQ(d.back<uint8_t>(d.d.param, s.param.size()), s.param);
  EXPECT_EQ(d.back<float>(d.d.v_scale, s.v_scale.size()), s.v_scale);
  EXPECT_EQ(d.back<uint8_t>(d.d.v, s.v.size()), s.v);
  CK(cudaFree(dtab));
}

}  // namespace
}  // namespace coat
