// Helpers shared by the tests: fixtures location, tolerant comparisons, random tensors.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
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

/// The mixture-of-experts fixtures (routing fixtures, HF MoE model folders with their io files):
/// $MEGATRON_MOE_FIXTURES, else <fixtures_dir()>/moe when it holds the MoE models, else the copy in
/// tests/fixtures/moe.
inline std::string moe_fixtures_dir() {
  if (const char* e = std::getenv("MEGATRON_MOE_FIXTURES"); e && *e) return e;
  const std::string shared = fixtures_dir() + "/moe";
  if (std::filesystem::exists(shared + "/mixtral/config.json")) return shared;
  return std::string(MEGATRON_SOURCE_DIR) + "/tests/fixtures/moe";
}

/// Every HF model fixture of `dir`: each <name>/ folder with a config.json that has a
/// <name>_io.safetensors beside it, sorted.
inline std::vector<std::string> model_fixtures_in(const std::string& dir) {
  std::vector<std::string> out;
  if (!std::filesystem::is_directory(dir)) return out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (e.is_directory() && std::filesystem::exists(e.path() / "config.json") &&
        std::filesystem::exists(dir + "/" + name + "_io.safetensors"))
      out.push_back(name);
  }
  std::sort(out.begin(), out.end());
  return out;
}

/// Every MoE model fixture (model_fixtures_in(moe_fixtures_dir())).
inline std::vector<std::string> moe_model_fixtures() { return model_fixtures_in(moe_fixtures_dir()); }

/// The architecture fixtures (HF DeepSeek-V3 and GPT-OSS folders with their io files):
/// $MEGATRON_ARCH_FIXTURES, else <fixtures_dir()>/arch when it holds them, else the copy in
/// tests/fixtures/arch.
inline std::string arch_fixtures_dir() {
  if (const char* e = std::getenv("MEGATRON_ARCH_FIXTURES"); e && *e) return e;
  const std::string shared = fixtures_dir() + "/arch";
  if (!model_fixtures_in(shared).empty()) return shared;
  return std::string(MEGATRON_SOURCE_DIR) + "/tests/fixtures/arch";
}

/// The folders HuggingFace golden fixtures are read from, in order of preference: fixtures_dir(),
/// then the repository's tests/fixtures (fixtures newer than a shared folder live there).
inline std::vector<std::string> golden_fixture_dirs() {
  return {fixtures_dir(), std::string(MEGATRON_SOURCE_DIR) + "/tests/fixtures"};
}

/// The first folder that holds both files of golden fixture `name` (<name>_model.safetensors and
/// <name>_io.safetensors), else fixtures_dir().
inline std::string golden_fixture_dir_of(const std::string& name) {
  for (const std::string& dir : golden_fixture_dirs()) {
    if (std::filesystem::exists(dir + "/" + name + "_model.safetensors") &&
        std::filesystem::exists(dir + "/" + name + "_io.safetensors"))
      return dir;
  }
  return fixtures_dir();
}

/// Every golden fixture name: each <name>_model.safetensors with its <name>_io.safetensors in the
/// golden fixture folders, sorted, once.
inline std::vector<std::string> golden_fixture_models() {
  const std::string suffix = "_model.safetensors";
  std::vector<std::string> names;
  for (const std::string& dir : golden_fixture_dirs()) {
    if (!std::filesystem::is_directory(dir)) continue;
    for (const auto& e : std::filesystem::directory_iterator(dir)) {
      const std::string f = e.path().filename().string();
      if (f.size() <= suffix.size() || f.compare(f.size() - suffix.size(), suffix.size(), suffix) != 0) continue;
      const std::string name = f.substr(0, f.size() - suffix.size());
      if (std::filesystem::exists(dir + "/" + name + "_io.safetensors")) names.push_back(name);
    }
  }
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
  return names;
}

/// A tensor of normal(0, std) values from a Philox stream (reproducible).
inline Tensor random_tensor(const Shape& shape, uint64_t seed, float std = 1.0f, DType dtype = DType::Float32) {
  std::vector<float> v(size_t(shape_numel(shape)));
  for (size_t i = 0; i < v.size(); ++i) v[i] = std * philox_normal(seed, 0, i);
  return Tensor::from_floats(v, shape, dtype);
}

/// [b, s] token ids uniform in [0, vocab) from a Philox stream (reproducible).
inline Tensor random_ids(int64_t b, int64_t s, int64_t vocab, uint64_t seed) {
  std::vector<int64_t> ids(size_t(b * s));
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = int64_t(philox_element(seed, 0, i) % uint64_t(vocab));
  return Tensor::from_ints(ids, {b, s});
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

/// Expects `fn` to throw a megatron::Error whose message is one line that mentions `needle`.
template <typename Fn>
void expect_one_line_error(Fn&& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one mentioning '" << needle << "'";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(needle), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << "one line: " << msg;
  }
}

}  // namespace megatron::testing
