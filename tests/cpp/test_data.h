// Test data shared by the C++ tests.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace coat_test {

// n normal values (mean 0, standard deviation `scale`) from a fixed seed.
inline std::vector<float> randn(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

}  // namespace coat_test
