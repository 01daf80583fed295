// For the GPU tests that run pretrain_gpt: each iteration's loss (MEGATRON_LOSS_LOG) of a run, and
// the comparison of two runs' losses.
#pragma once

#include <nlohmann/json.hpp>

#include "tests/functional/run_util.h"

namespace megatron::testing {

inline std::vector<std::string> with(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

/// Runs argv in dir (with `env` before it) and returns every iteration's loss; expects a clean
/// exit on the GPU and `iterations` losses.
inline std::vector<double> run_losses(const fs::path& dir, const std::string& name,
                                      const std::vector<std::string>& argv, const std::string& env,
                                      size_t iterations) {
  const fs::path log = dir / (name + ".jsonl");
  RunResult r = run(argv, dir, env + " MEGATRON_LOSS_LOG=" + shell_quote(log.string()));
  EXPECT_EQ(r.exit_code, 0) << name << ":\n" << r.output;
  EXPECT_NE(r.output.find("running on cuda"), std::string::npos) << name << ":\n" << r.output;
  std::vector<double> out;
  std::ifstream in(log);
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line).at("lm_loss").get<double>());
  EXPECT_EQ(out.size(), iterations) << name << ":\n" << r.output;
  return out;
}

/// Every loss within `rel` of the reference's, relative.
inline void expect_losses_close(const std::vector<double>& got, const std::vector<double>& want, double rel,
                                const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], rel * std::abs(want[i])) << what << " iteration " << i + 1;
  }
}

}  // namespace megatron::testing
