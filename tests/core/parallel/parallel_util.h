// What the layout tests share: pretrain_gpt runs (single process or under mpirun) read back from
// their loss logs, the models they train, and the comparisons of losses and checkpointed weights.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <nlohmann/json.hpp>

#include "megatron/core/dist_checkpointing/sharded.h"
#include "tests/functional/run_util.h"

namespace megatron::testing {

struct TrainRun {
  std::vector<double> losses;
  std::vector<double> grad_norms;
  std::map<std::string, std::vector<double>> aux;  // per iteration: load_balancing_loss, mtp_1 loss, ...
  std::string output;
};

inline const std::vector<std::string> kGpt = {
    "--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
    "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "16",
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1",
    "--weight-decay", "0.1", "--clip-grad", "1.0", "--vocab-size", "1000", "--mock-data",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1", "--eval-iters", "0",
    "--seed", "1234", "--device", "cpu", "--split", "100,0,0", "--adam-eps", "1e-4"};

// Llama-style: RoPE, RMSNorm, SwiGLU (fc1 split in two blocks), GQA, no biases, untied output.
inline const std::vector<std::string> kLlama = {
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--group-query-attention",
    "--num-query-groups", "2", "--ffn-hidden-size", "96", "--swiglu", "--normalization", "RMSNorm",
    "--position-embedding-type", "rope", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
    "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size",
    "16", "--lr", "1e-3", "--vocab-size", "1000", "--mock-data", "--hidden-dropout", "0", "--attention-dropout",
    "0", "--log-interval", "1", "--eval-iters", "0", "--seed", "1234", "--device", "cpu", "--split", "100,0,0",
    "--adam-eps", "1e-4"};

// Runs pretrain_gpt on `np` ranks (np 1: directly, no launcher) and reads its loss log.
inline TrainRun train(const fs::path& dir, const std::string& name, int np, const std::vector<std::string>& args) {
  const fs::path log = dir / (name + ".jsonl");
  std::vector<std::string> argv;
  if (np > 1) {
    argv = {"mpirun", "-np", std::to_string(np), "--oversubscribe", "--mca", "mpi_yield_when_idle", "1"};
    if (::geteuid() == 0) argv.push_back("--allow-run-as-root");
  }
  argv.push_back(bin("pretrain_gpt"));
  argv.insert(argv.end(), args.begin(), args.end());
  RunResult r = run(argv, dir, "MEGATRON_LOSS_LOG=" + shell_quote(log.string()) + " OMP_NUM_THREADS=1");
  EXPECT_EQ(r.exit_code, 0) << name << ":\n" << r.output;
  TrainRun out;
  out.output = r.output;
  std::ifstream in(log);
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    out.losses.push_back(j.at("lm_loss").get<double>());
    out.grad_norms.push_back(j.at("grad_norm").get<double>());
    for (const auto& [key, value] : j.items()) {
      if (key.find("load_balancing_loss") != std::string::npos || key.rfind("mtp_", 0) == 0) {
        out.aux[key].push_back(value.get<double>());
      }
    }
  }
  return out;
}

inline void expect_close(const std::vector<double>& got, const std::vector<double>& want, const std::string& what,
                  size_t offset = 0) {
  ASSERT_EQ(got.size() + offset, want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], want[i + offset], 1e-6 * std::abs(want[i + offset]))
        << what << " at iteration " << i + offset + 1;
  }
}

// The weights of two checkpoints (any layouts): the whole model within 1e-6 of its norm, every tensor
// within 1e-5 of its own (Note [Comparing weights across layouts] in
// tests/core/models/gpt_parallel_test.cpp, which is also why the runs use --adam-eps 1e-4).
// The folder of a checkpoint directory's latest iteration.
inline fs::path latest_iteration_dir(const fs::path& d) {
  std::string it = read_file(d / "latest_checkpointed_iteration.txt");
  while (!it.empty() && std::isspace(static_cast<unsigned char>(it.back()))) it.pop_back();
  char buf[32];
  std::snprintf(buf, sizeof(buf), "iter_%07d", std::stoi(it));
  return d / buf;
}

inline void expect_same_weights(const fs::path& a, const fs::path& b, const std::string& what) {
  auto latest = latest_iteration_dir;
  dist_checkpointing::ShardIndex ia(latest(a).string(), "model"), ib(latest(b).string(), "model");
  ASSERT_EQ(ia.names(), ib.names()) << what;
  double total_diff = 0, total_norm = 0;
  for (const std::string& name : ia.names()) {
    const Shape shape = ia.tensor(name).shape;
    Tensor ta = Tensor::empty(shape, DType::Float32), tb = Tensor::empty(shape, DType::Float32);
    ia.load_into(name, ShardSpec{}, ta);
    ib.load_into(name, ShardSpec{}, tb);
    const std::vector<float> va = ta.to_floats(), vb = tb.to_floats();
    double diff = 0, norm = 0;
    for (size_t i = 0; i < va.size(); ++i) {
      diff += double(va[i] - vb[i]) * double(va[i] - vb[i]);
      norm += double(vb[i]) * double(vb[i]);
    }
    EXPECT_LE(std::sqrt(diff), 1e-5 * std::sqrt(norm)) << what << ": " << name;
    total_diff += diff;
    total_norm += norm;
  }
  EXPECT_LE(std::sqrt(total_diff), 1e-6 * std::sqrt(total_norm)) << what;
}

}  // namespace megatron::testing
