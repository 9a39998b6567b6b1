// Host images of one tensor of the 4-bit AdamW step (coat/adamw4.h) with its states, shared by the
// CPU reference tests and the GPU test: every buffer as bytes, so the GPU test copies them as is.
#pragma once

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "coat/adamw4.h"
#include "common/fp8.h"

namespace coat {
namespace test4 {

constexpr int G = kAdamw4Block;

inline int64_t groups_of(int64_t n) { return (n + G - 1) / G; }

inline std::vector<uint8_t> bytes_of(const std::vector<float>& x, DType t) {
  std::vector<uint8_t> out(x.size() * dtype_size(t));
  for (size_t i = 0; i < x.size(); ++i) {
    if (t == DType::kFloat32) {
      std::memcpy(&out[4 * i], &x[i], 4);
    } else {
      const uint16_t b = t == DType::kBFloat16 ? host_float_to_bf16(x[i]) : host_float_to_half(x[i]);
      std::memcpy(&out[2 * i], &b, 2);
    }
  }
  return out;
}

inline float value_at(const std::vector<uint8_t>& bytes, size_t i, DType t) {
  if (t == DType::kFloat32) {
    float f;
    std::memcpy(&f, &bytes[4 * i], 4);
    return f;
  }
  uint16_t b;
  std::memcpy(&b, &bytes[2 * i], 2);
  return t == DType::kBFloat16 ? host_bf16_to_float(b) : host_half_to_float(b);
}

inline std::vector<float> normal(int64_t n, float scale, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> x(n);
  for (auto& v : x) v = nd(rng);
  return x;
}

// One tensor: kind, shape (rows x cols for kRank1), dtypes, and every buffer.
struct Slot {
  int64_t n, rows, cols;
  Adamw4Kind kind;
  DType pt, gt;
  bool with_master;
  std::vector<uint8_t> param, grad, m, v;  // m, v: fp32 bytes (kFull) or packed codes
  std::vector<float> master, m_scale, v_scale;
  float step = 0.0f;

  Slot(int64_t rows_, int64_t cols_, Adamw4Kind k, DType p = DType::kFloat32, DType g = DType::kFloat32,
       bool master_ = false)
      : n(rows_ * cols_), rows(rows_), cols(cols_), kind(k), pt(p), gt(g), with_master(master_) {
    const size_t state = k == Adamw4Kind::kFull ? 4 * n : (n + 1) / 2;
    m.assign(state, 0);
    v.assign(state, 0);
    if (k != Adamw4Kind::kFull) {
      m_scale.assign(groups_of(n), 0.0f);
      v_scale.assign(k == Adamw4Kind::kRank1 ? 2 * (rows + cols) : groups_of(n), 0.0f);
    }
    set_param(normal(n, 1.0f, 11 + static_cast<uint32_t>(n)));
    set_grad(normal(n, 1e-2f, 12 + static_cast<uint32_t>(n)));
  }

  void set_param(const std::vector<float>& x) {
    param = bytes_of(x, pt);
    if (with_master) master = x;
  }
  void set_grad(const std::vector<float>& x) { grad = bytes_of(x, gt); }
  float p(int64_t i) const { return with_master ? master[i] : value_at(param, i, pt); }

  Adamw4Tensor desc(int64_t begin, uint64_t seed = 1234) {
    Adamw4Tensor d{};
    d.param = param.data();
    d.grad = grad.data();
    d.master = with_master ? master.data() : nullptr;
    d.m = m.data();
    d.v = v.data();
    d.m_scale = kind == Adamw4Kind::kFull ? nullptr : m_scale.data();
    d.v_scale = kind == Adamw4Kind::kFull ? nullptr : v_scale.data();
    d.step = &step;
    d.numel = n;
    d.group_begin = begin;
    d.seed = seed;
    d.kind = kind;
    d.rows = kind == Adamw4Kind::kRank1 ? rows : 0;
    d.cols = kind == Adamw4Kind::kRank1 ? cols : 0;
    return d;
  }
};

// Descriptors of several slots, one launch.
inline std::vector<Adamw4Tensor> descs_of(std::vector<Slot>& slots, int64_t& n_groups) {
  std::vector<Adamw4Tensor> ds;
  n_groups = 0;
  for (Slot& s : slots) {
    ds.push_back(s.desc(n_groups));
    n_groups += groups_of(s.n);
  }
  return ds;
}

inline AdamwConfig config(DType p = DType::kFloat32, DType g = DType::kFloat32, MasterKind m = MasterKind::kNone) {
  AdamwConfig c;
  c.lr = 1e-2;
  c.beta1 = 0.9;
  c.beta2 = 0.95;
  c.eps = 1e-8;
  c.weight_decay = 0.1;
  c.param_dtype = p;
  c.grad_dtype = g;
  c.master = m;
  return c;
}

}  // namespace test4
}  // namespace coat
