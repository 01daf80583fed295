// Helpers shared by the tests: fixtures location, tolerant comparisons, random tensors.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "megatron/runtime/check.h"
#include "megatron/runtime/philox.h"
#include "megatron/runtime/tensor.h"

namespace megatron::testing {

/// The HuggingFace fixture folder: $MEGATRON_FIXTURES, else the build's default (../shared/fixtures).
inline std::string fixtures_dir() {
  if (const char* e = std::getenv("MEGATRON_FIXTURES"); e && *e) return e;
  if (const char* d = std::getenv("MEGATRON_FIXTURES_DEFAULT"); d && *d) return d;
  return "../shared/fixtures";
}

/// The Megatron data oracle (fixtures/megatron_data): $MEGATRON_DATA_FIXTURES, else
/// <fixtures_dir()>/megatron_data, else the copy in tests/fixtures/megatron_data.
inline std::string data_fixtures_dir() {
  if (const char* e = std::getenv("MEGATRON_DATA_FIXTURES"); e && *e) return e;
  std::string shared = fixtures_dir() + "/megatron_data";
  if (std::filesystem::is_directory(shared)) return shared;
  return std::string(MEGATRON_SOURCE_DIR) + "/tests/fixtures/megatron_data";
}

/// A tensor of normal(0, std) values from a Philox stream (reproducible).
inline Tensor random_tensor(const Shape& shape, uint64_t seed, float std = 1.0f, DType dtype = DType::Float32) {
  std::vector<float> v(size_t(shape_numel(shape)));
  for (size_t i = 0; i < v.size(); ++i) v[i] = std * philox_normal(seed, 0, i);
  return Tensor::from_floats(v, shape, dtype);
}

/// Largest |a-b| / max(|b|, floor) — relative error with a floor for values near zero.
inline double max_rel_error(const std::vector<float>& a, const std::vector<float>& b, double floor = 1e-3) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    double d = std::fabs(double(a[i]) - double(b[i])) / std::max(std::fabs(double(b[i])), floor);
    worst = std::max(worst, d);
  }
  return worst;
}

inline double max_abs_error(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) worst = std::max(worst, std::fabs(double(a[i]) - b[i]));
  return worst;
}

/// The message of the megatron::Error `fn` throws; empty when it throws none.
template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace megatron::testing
