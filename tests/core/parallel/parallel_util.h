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

// The run flags after the model flags of kLlama and the other small models: sequences of 32, a global
// batch of 16 in microbatches of 2 from mock data (--vocab-size 1000), no dropout, the CPU.
inline const std::vector<std::string> kSmallRun = {
    "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size",
    "16", "--lr", "1e-3", "--vocab-size", "1000", "--mock-data", "--hidden-dropout", "0", "--attention-dropout",
    "0", "--log-interval", "1", "--eval-iters", "0", "--seed", "1234", "--device", "cpu", "--split", "100,0,0",
    "--adam-eps", "1e-4"};

// Llama-style: RoPE, RMSNorm, SwiGLU (fc1 split in two blocks), GQA, no biases, untied output.
inline const std::vector<std::string> kLlama =
    concat({"--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--group-query-attention",
            "--num-query-groups", "2", "--ffn-hidden-size", "96", "--swiglu", "--normalization", "RMSNorm",
            "--position-embedding-type", "rope", "--disable-bias-linear", "--untie-embeddings-and-output-weights"},
           kSmallRun);

// The mpirun command line that starts `np` ranks (yielding when idle: the ranks outnumber the cores).
inline std::vector<std::string> mpirun_command(int np) {
  std::vector<std::string> argv = {"mpirun", "-np", std::to_string(np), "--oversubscribe", "--mca",
                                   "mpi_yield_when_idle", "1"};
  if (::geteuid() == 0) argv.push_back("--allow-run-as-root");
  return argv;
}

// Runs pretrain_gpt on `np` ranks (np 1: directly, no launcher) and reads its loss log.
inline TrainRun train(const fs::path& dir, const std::string& name, int np, const std::vector<std::string>& args) {
  const fs::path log = dir / (name + ".jsonl");
  std::vector<std::string> argv;
  if (np > 1) argv = mpirun_command(np);
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

// The single-process reference of a layout: `model` trained for 5 iterations, saved in <dir>/<name>.
inline TrainRun train_single(const fs::path& dir, const std::string& name, const std::vector<std::string>& model) {
  return train(dir, name, 1, concat(model, {"--train-iters", "5", "--save", (dir / name).string()}));
}

inline void expect_close(const std::vector<double>& got, const std::vector<double>& want, const std::string& what,
                  size_t offset = 0) {
  ASSERT_EQ(got.size() + offset, want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], want[i + offset], 1e-6 * std::abs(want[i + offset]))
        << what << " at iteration " << i + offset + 1;
  }
}

// The folder of a checkpoint directory's latest iteration.
inline fs::path latest_iteration_dir(const fs::path& d) {
  std::string it = read_file(d / "latest_checkpointed_iteration.txt");
  while (!it.empty() && std::isspace(static_cast<unsigned char>(it.back()))) it.pop_back();
  char buf[32];
  std::snprintf(buf, sizeof(buf), "iter_%07d", std::stoi(it));
  return d / buf;
}

// The weights of two checkpoints (any layouts): the whole model within 1e-6 of its norm, every tensor
// within 1e-5 of its own (Note [Comparing weights across layouts] in
// tests/core/models/gpt_parallel_test.cpp, which is also why the runs use --adam-eps 1e-4).
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

// A parallel layout: its name (also its run's folder), its process count and its flags.
struct Layout {
  std::string name;
  int np;
  std::vector<std::string> flags;
};

// Trains `layout` of `model` for 5 iterations in <dir>/<layout name> and compares it with `single`, the
// single-process run saved in <dir>/<single_dir>: every iteration's loss, grad norm and aux losses,
// and the final weights.
inline void expect_layout_equals_single(const fs::path& dir, const std::vector<std::string>& model,
                                        const TrainRun& single, const std::string& single_dir, const Layout& layout) {
  ASSERT_EQ(single.losses.size(), 5u) << single.output;
  const fs::path save = dir / layout.name;
  TrainRun r = train(dir, layout.name, layout.np,
                     concat(concat(model, layout.flags), {"--train-iters", "5", "--save", save.string()}));
  expect_close(r.losses, single.losses, layout.name + " loss");
  expect_close(r.grad_norms, single.grad_norms, layout.name + " grad norm");
  ASSERT_EQ(r.aux.size(), single.aux.size()) << layout.name;
  for (const auto& [name, values] : single.aux) expect_close(r.aux[name], values, layout.name + " " + name);
  expect_same_weights(save, dir / single_dir, layout.name);
}

// A checkpoint saved by one layout at iteration 3 of a 5-iteration schedule (--exit-interval) and
// resumed by another.
struct Reshard {
  std::string name;
  int np_save;
  std::vector<std::string> save_flags;
  int np_load;
  std::vector<std::string> load_flags;
};

// Runs `c` with `model`, checkpointing in `ckpt`: iterations 4 and 5 give the losses (and aux losses)
// of `single`, the single-process run saved in <dir>/<single_dir>, and the final weights are its.
inline void expect_reshard_equals_single(const fs::path& dir, const fs::path& ckpt,
                                         const std::vector<std::string>& model, const TrainRun& single,
                                         const std::string& single_dir, const Reshard& c) {
  train(dir, c.name + "_save", c.np_save,
        concat(concat(model, c.save_flags), {"--train-iters", "5", "--exit-interval", "3", "--save", ckpt.string()}));
  TrainRun resumed = train(dir, c.name + "_load", c.np_load,
                           concat(concat(model, c.load_flags),
                                  {"--train-iters", "5", "--load", ckpt.string(), "--save", ckpt.string()}));
  expect_close(resumed.losses, single.losses, c.name, 3);
  for (const auto& [name, values] : single.aux) expect_close(resumed.aux[name], values, c.name + " " + name, 3);
  expect_same_weights(ckpt, dir / single_dir, c.name);
}

}  // namespace megatron::testing
