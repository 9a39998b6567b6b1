// CUDA 4-bit AdamW step against the CPU reference, to the contract of coat/adamw4.h: the kernel
// keeps fma, flushes subnormals and takes square roots, divisions and the encoders' reciprocals
// from the hardware, the reference is IEEE. Every step starts both from the reference's state;
// then parameters agree to an ulp of their storage type (a few fp32 ulp can round a 16-bit value
// the other way) plus a few ulp of the update, masters, full-precision moments, block scales and
// row / column maxima to 2^-18 relative, and a code differs by at most one step, in few elements
// (where its normalized moment lies on a midpoint). NaNs compare as NaNs.
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
  // The host's current state (everything but the gradient and the step, set per step).
  void upload(const Slot& s) {
    const auto put = [](void* to, const void* from, size_t bytes) {
      if (bytes) EXPECT_EQ(cudaMemcpy(to, from, bytes, cudaMemcpyHostToDevice), cudaSuccess);
    };
    put(d.param, s.param.data(), s.param.size());
    if (s.with_master) put(d.master, s.master.data(), 4 * s.master.size());
    put(d.m, s.m.data(), s.m.size());
    put(d.v, s.v.data(), s.v.size());
    if (d.m_scale) put(d.m_scale, s.m_scale.data(), 4 * s.m_scale.size());
    if (d.v_scale) put(d.v_scale, s.v_scale.data(), 4 * s.v_scale.size());
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

// Parameters and full-precision moments: one ulp of the storage type relative (2^-18 for fp32),
// plus `abs` (for parameters 2^-16 lr, the update's own few ulp: p near zero has few ulp; for m a
// few ulp of its inputs, as m + (1 - b1)(g - m) can cancel).
void expect_values_close(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want, DType t, double abs,
                         const std::string& where) {
  const double rel = t == DType::kFloat32 ? std::ldexp(1.0, -18) : t == DType::kBFloat16 ? std::ldexp(1.0, -7)
                                                                                            : std::ldexp(1.0, -10);
  for (size_t i = 0; i < want.size() / dtype_size(t); ++i) {
    const double a = value_at(got, i, t), b = value_at(want, i, t);
    if (std::isnan(b)) ASSERT_TRUE(std::isnan(a)) << where << " element " << i;
    else ASSERT_LE(std::fabs(a - b), rel * std::fabs(b) + abs) << where << " element " << i << ": " << a << " vs " << b;
  }
}

// Masters (abs as above), scales and maxima (abs 0: the largest of a few-ulp-apart set is itself a
// few ulp apart).
void expect_floats_close(const std::vector<float>& got, const std::vector<float>& want, const std::string& where,
                         double abs = 0.0) {
  ASSERT_EQ(got.size(), want.size()) << where;
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::isnan(want[i])) ASSERT_TRUE(std::isnan(got[i])) << where << " " << i;
    else ASSERT_LE(std::fabs(got[i] - want[i]), std::ldexp(std::fabs(want[i]), -18) + abs) << where << " " << i << ": " << got[i] << " vs " << want[i];
  }
}

// Packed codes: each nibble within one step, and at most 1% of them (plus 2) off at all.
void expect_codes_close(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want, const std::string& where) {
  ASSERT_EQ(got.size(), want.size()) << where;
  size_t off = 0;
  for (size_t i = 0; i < 2 * want.size(); ++i) {
    const int a = (got[i / 2] >> (4 * (i % 2))) & 0xF, b = (want[i / 2] >> (4 * (i % 2))) & 0xF;
    ASSERT_LE(std::abs(a - b), 1) << where << " code " << i;
    off += a != b;
  }
  EXPECT_LE(off, 2 + want.size() / 50) << where << ": codes differ in many elements";
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
                          // statistics strips (cols % 128 == 0, partial last strips, rows % 4 != 0),
                          // rank-1 with cols % 4 == 0 only, blocks, full states.
                          {48, 384, Adamw4Kind::kRank1},   {48, 384, Adamw4Kind::kRank1},
                          {40, 256, Adamw4Kind::kRank1},   {40, 256, Adamw4Kind::kRank1},
                          {37, 384, Adamw4Kind::kRank1},   {37, 384, Adamw4Kind::kRank1},
                          {37, 512, Adamw4Kind::kRank1},   {37, 512, Adamw4Kind::kRank1},
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
      dev[i]->upload(host[i]);
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
      expect_values_close(d.back<uint8_t>(d.d.param, h.param.size()), h.param, cb.p, std::ldexp(c.lr, -16), where + " param");
      if (h.with_master) expect_floats_close(d.back<float>(d.d.master, h.n), h.master, where + " master", std::ldexp(c.lr, -16));
      if (h.kind == Adamw4Kind::kFull) {
        expect_values_close(d.back<uint8_t>(d.d.m, h.m.size()), h.m, DType::kFloat32, 1e-9, where + " m");
        expect_values_close(d.back<uint8_t>(d.d.v, h.v.size()), h.v, DType::kFloat32, 1e-12, where + " v");
        continue;
      }
      expect_codes_close(d.back<uint8_t>(d.d.m, h.m.size()), h.m, where + " m codes");
      expect_codes_close(d.back<uint8_t>(d.d.v, h.v.size()), h.v, where + " v codes");
      expect_floats_close(d.back<float>(d.d.m_scale, h.m_scale.size()), h.m_scale, where + " m absmax");
      expect_floats_close(d.back<float>(d.d.v_scale, h.v_scale.size()), h.v_scale, where + " v scales");
    }
  }
  CK(cudaFree(dtab));
}

TEST(Adamw4Gpu, MatchesReferenceToItsContract) {
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
