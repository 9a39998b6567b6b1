// CUDA fused AdamW step against the CPU reference: bit-identical parameters, masters and states
// for every (param, grad, master) combination, odd sizes, misaligned tensors and several steps.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "coat/adamw.h"
#include "common/fp8.h"

namespace coat {
namespace {

constexpr int G = kDreGroupSize;

#define CK(x) ASSERT_EQ((x), cudaSuccess)

// Host images of every buffer of one tensor; `off` elements of padding in front of each buffer
// make the device copies misaligned when off is odd (the kernel must take its scalar path).
struct Buffers {
  int64_t n, off;
  std::vector<uint8_t> param, grad, master, mq, vq, mk, vk;
  std::vector<float> mg, vg;
  float step = 0.0f;
};

struct Combo {
  DType p, g;
  MasterKind m;
};

std::vector<uint8_t> random_bytes_of(const std::vector<float>& x, DType t) {
  std::vector<uint8_t> out(x.size() * dtype_size(t));
  for (size_t i = 0; i < x.size(); ++i) {
    if (t == DType::kFloat32) std::memcpy(&out[4 * i], &x[i], 4);
    else {
      const uint16_t b = t == DType::kBFloat16 ? host_float_to_bf16(x[i]) : host_float_to_half(x[i]);
      std::memcpy(&out[2 * i], &b, 2);
    }
  }
  return out;
}

TEST(AdamwGpu, MatchesReferenceBitExactly) {
  const Combo combos[] = {{DType::kFloat32, DType::kFloat32, MasterKind::kNone},
                          {DType::kFloat32, DType::kBFloat16, MasterKind::kNone},
                          {DType::kBFloat16, DType::kBFloat16, MasterKind::kFp32},
                          {DType::kFloat16, DType::kFloat16, MasterKind::kFp32},
                          {DType::kBFloat16, DType::kFloat32, MasterKind::kBf16Sr}};
  const int64_t sizes[] = {1, 3, 128, 129, 1000, 70001, 4096 * 3};
  std::mt19937 rng(5);
  for (const Combo& cb : combos) {
    for (bool expansion : {true, false}) {
      AdamwConfig c;
      c.lr = 3e-3; c.beta1 = 0.9; c.beta2 = 0.95; c.weight_decay = 0.05;
      c.param_dtype = cb.p; c.grad_dtype = cb.g; c.master = cb.m; c.expansion = expansion;
      c.v_fmt = expansion ? Fp8Format::kE5M2 : Fp8Format::kE4M3;
      c.v_log2_range = dre_default_log2_range(c.v_fmt);
      std::vector<Buffers> host;
      int64_t groups = 0;
      for (int64_t n : sizes) {
        Buffers b;
        b.n = n;
        b.off = (n % 2) ? 1 : 0;
        std::normal_distribution<float> nd(0.0f, 1.0f);
        std::vector<float> p(n);
        for (auto& x : p) x = nd(rng);
        b.param = random_bytes_of(p, cb.p);
        if (cb.m == MasterKind::kFp32) b.master = random_bytes_of(p, DType::kFloat32);
        const int64_t ng = (n + G - 1) / G;
        b.mq.assign(n, 0); b.vq.assign(n, 0); b.mk.assign(ng, kDreUnitK16); b.vk.assign(ng, kDreUnitK16);
        b.mg.assign(ng, 0.0f); b.vg.assign(ng, 0.0f);
        groups += ng;
        host.push_back(std::move(b));
      }
      // Device copies (with the same padding) and the two descriptor tables.
      std::vector<void*> allocs;
      auto dev = [&](const void* src, size_t bytes, int64_t off_bytes) -> uint8_t* {
        uint8_t* d = nullptr;
        EXPECT_EQ(cudaMalloc(&d, bytes + off_bytes + 16), cudaSuccess);
        allocs.push_back(d);
        EXPECT_EQ(cudaMemcpy(d + off_bytes, src, bytes, cudaMemcpyHostToDevice), cudaSuccess);
        return d + off_bytes;
      };
      std::vector<AdamwTensor> dt, ht;
      std::vector<std::vector<uint8_t>> grads(host.size());
      int64_t begin = 0;
      for (size_t i = 0; i < host.size(); ++i) {
        Buffers& b = host[i];
        AdamwTensor h{}, d{};
        h.numel = d.numel = b.n;
        h.group_begin = d.group_begin = begin;
        h.seed = d.seed = 77 + i;
        const int64_t ps = dtype_size(cb.p), o = b.off;
        h.param = b.param.data(); d.param = dev(b.param.data(), b.param.size(), o * ps);
        if (cb.m == MasterKind::kFp32) {
          h.master = reinterpret_cast<float*>(b.master.data());
          d.master = reinterpret_cast<float*>(dev(b.master.data(), b.master.size(), o * 4));
        }
        h.m_q = b.mq.data(); d.m_q = dev(b.mq.data(), b.n, o);
        h.v_q = b.vq.data(); d.v_q = dev(b.vq.data(), b.n, o);
        h.m_k16 = b.mk.data(); d.m_k16 = dev(b.mk.data(), b.mk.size(), 0);
        h.v_k16 = b.vk.data(); d.v_k16 = dev(b.vk.data(), b.vk.size(), 0);
        h.m_gmax = b.mg.data(); d.m_gmax = reinterpret_cast<float*>(dev(b.mg.data(), b.mg.size() * 4, 0));
        h.v_gmax = b.vg.data(); d.v_gmax = reinterpret_cast<float*>(dev(b.vg.data(), b.vg.size() * 4, 0));
        h.step = &b.step; d.step = reinterpret_cast<float*>(dev(&b.step, 4, 0));
        grads[i].resize(b.n * dtype_size(cb.g));
        h.grad = grads[i].data(); d.grad = dev(grads[i].data(), grads[i].size(), o * dtype_size(cb.g));
        begin += (b.n + G - 1) / G;
        ht.push_back(h);
        dt.push_back(d);
      }
      AdamwTensor* dtab = reinterpret_cast<AdamwTensor*>(dev(dt.data(), dt.size() * sizeof(AdamwTensor), 0));
      for (int it = 1; it <= 3; ++it) {
        for (size_t i = 0; i < host.size(); ++i) {
          std::normal_distribution<float> nd(0.0f, 1e-2f * it);
          std::vector<float> g(host[i].n);
          for (auto& x : g) x = nd(rng);
          if (i == 2 && it == 2) g[5] = 0.0f;
          const std::vector<uint8_t> gb = random_bytes_of(g, cb.g);
          std::memcpy(grads[i].data(), gb.data(), gb.size());  // ht[i].grad points here
          host[i].step = static_cast<float>(it);
          CK(cudaMemcpy(const_cast<void*>(dt[i].grad), grads[i].data(), grads[i].size(), cudaMemcpyHostToDevice));
          CK(cudaMemcpy(const_cast<float*>(dt[i].step), &host[i].step, 4, cudaMemcpyHostToDevice));
        }
        ref::adamw_step(ht.data(), ht.size(), groups, c);
        adamw_step(dtab, dt.size(), groups, c, nullptr);
        CK(cudaDeviceSynchronize());
      }
      for (size_t i = 0; i < host.size(); ++i) {
        const Buffers& b = host[i];
        auto back = [&](const void* d, size_t bytes) {
          std::vector<uint8_t> out(bytes);
          EXPECT_EQ(cudaMemcpy(out.data(), d, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
          return out;
        };
        const std::string where = "tensor " + std::to_string(i) + " n=" + std::to_string(b.n) +
                                  " combo p" + std::to_string(int(cb.p)) + " m" + std::to_string(int(cb.m));
        EXPECT_EQ(back(dt[i].param, b.param.size()), b.param) << where;
        if (cb.m == MasterKind::kFp32) EXPECT_EQ(back(dt[i].master, b.master.size()), b.master) << where;
        EXPECT_EQ(back(dt[i].m_q, b.n), b.mq) << where;
        EXPECT_EQ(back(dt[i].v_q, b.n), b.vq) << where;
        EXPECT_EQ(back(dt[i].m_k16, b.mk.size()), b.mk) << where;
        EXPECT_EQ(back(dt[i].v_k16, b.vk.size()), b.vk) << where;
        std::vector<uint8_t> mg(b.mg.size() * 4);
        std::memcpy(mg.data(), b.mg.data(), mg.size());
        EXPECT_EQ(back(dt[i].m_gmax, mg.size()), mg) << where;
      }
      for (void* p : allocs) cudaFree(p);
    }
  }
}

}  // namespace
}  // namespace coat
