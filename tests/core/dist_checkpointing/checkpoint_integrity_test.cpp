// Checkpoints that detect corruption: a checksum per file verified on load (byte flips inside the
// tensor data), the progress fields and the tracker checked as Megatron's, stale temporary
// directories of dead processes removed by the next save, and a bounded mutation fuzzer over
// metadata.json and safetensors headers (tests/fuzz_util.h).
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "megatron/core/dist_checkpointing/safetensors.h"
#include "megatron/core/dist_checkpointing/sharded.h"
#include "megatron/core/parameter.h"
#include "megatron/training/checkpointing.h"
#include "tests/fuzz_util.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

namespace fs = std::filesystem;
using ::megatron::testing::error_of;
using ::megatron::testing::random_tensor;

std::string read_bytes(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

void write_bytes(const fs::path& p, const std::string& bytes) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), std::streamsize(bytes.size()));
}

/// A two-parameter model with Adam state.
struct TinyModel {
  std::vector<Parameter> params;
  std::vector<Parameter*> ptrs;
  std::unique_ptr<AdamOptimizer> optimizer;
  explicit TinyModel(bool filled) {
    params.push_back(make_parameter("decoder.layers.0.mlp.linear_fc1.weight",
                                    filled ? random_tensor({64, 32}, 1) : Tensor::zeros({64, 32}, DType::Float32),
                                    Tensor::zeros({64, 32}, DType::Float32)));
    params.push_back(make_parameter("decoder.final_layernorm.weight",
                                    filled ? random_tensor({32}, 2) : Tensor::zeros({32}, DType::Float32),
                                    Tensor::zeros({32}, DType::Float32)));
    for (Parameter& p : params) ptrs.push_back(&p);
    OptimizerConfig config;
    config.lr = 1e-3;
    optimizer = std::make_unique<AdamOptimizer>(params, config);
  }
};

class CheckpointIntegrity : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() / ("mg_ckpt_integrity_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    args_.save = (dir_ / "ckpt").string();
  }
  void TearDown() override { fs::remove_all(dir_); }

  void save(int64_t iteration) {
    TinyModel m(true);
    Context ctx;
    Checkpointer ck(args_);
    ck.save(ctx, m.ptrs, m.optimizer.get(), nullptr, TrainingProgress{iteration, iteration * 8, 0, 0.0});
  }
  std::optional<TrainingProgress> load(const Arguments& args) {
    TinyModel m(false);
    Context ctx;
    Checkpointer ck(args);
    return ck.load(ctx, args.save, m.ptrs, m.optimizer.get(), nullptr);
  }
  std::string load_error() {
    return error_of([&] { load(args_); });
  }
  fs::path iter_dir(int64_t iteration) const { return fs::path(args_.save) / checkpoint_dir_name(iteration); }
  fs::path tracker() const { return fs::path(args_.save) / "latest_checkpointed_iteration.txt"; }

  nlohmann::json metadata(int64_t iteration) const {
    return nlohmann::json::parse(read_bytes(iter_dir(iteration) / "metadata.json"));
  }
  void set_metadata(int64_t iteration, const nlohmann::json& j) {
    write_bytes(iter_dir(iteration) / "metadata.json", j.dump(2));
  }

  Arguments args_;
  fs::path dir_;
};

// Note [Checkpoint checksums]: 15 of 15 byte flips inside tensor data used to load silently.
TEST_F(CheckpointIntegrity, ByteFlipsInTensorDataAreDetectedNamingTheFile) {
  save(3);
  ASSERT_TRUE(load(args_).has_value());
  for (const char* file : {"model_rank00000.safetensors", "optim_rank00000.safetensors"}) {
    const fs::path path = iter_dir(3) / file;
    const std::string good = read_bytes(path);
    uint64_t header = 0;
    for (int i = 7; i >= 0; --i) header = (header << 8) | uint8_t(good[size_t(i)]);
    const size_t data_begin = 8 + size_t(header), data_size = good.size() - data_begin;
    for (int k = 0; k < 15; ++k) {
      std::string bad = good;
      const size_t at = data_begin + (data_size * size_t(k)) / 15 + 1;
      bad[at] = char(bad[at] ^ 0x10);
      write_bytes(path, bad);
      const std::string e = load_error();
      EXPECT_NE(e.find(file), std::string::npos) << file << " flip at byte " << at << ": " << e;
      EXPECT_NE(e.find("checksum"), std::string::npos) << e;
    }
    write_bytes(path, good);
  }
  EXPECT_TRUE(metadata(3).contains("checksums"));
  ASSERT_TRUE(load(args_).has_value());
}

TEST_F(CheckpointIntegrity, ProgressFieldsAreCheckedOneLineEach) {
  save(4);
  const nlohmann::json good = metadata(4);
  auto expect_refused = [&](const std::function<void(nlohmann::json&)>& edit, const std::vector<std::string>& needles) {
    nlohmann::json j = good;
    edit(j);
    set_metadata(4, j);
    const std::string e = load_error();
    EXPECT_FALSE(e.empty()) << j.dump().substr(0, 200);
    for (const std::string& n : needles) EXPECT_NE(e.find(n), std::string::npos) << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << "one line: " << e;
  };
  expect_refused([](auto& j) { j["iteration"] = -1; }, {"iteration", "-1"});
  expect_refused([](auto& j) { j["iteration"] = 5; }, {"iteration", "5", "iter_0000004"});
  expect_refused([](auto& j) { j.erase("iteration"); }, {"iteration"});
  expect_refused([](auto& j) { j["iteration"] = "4"; }, {"iteration"});
  expect_refused([](auto& j) { j["consumed_train_samples"] = 2.5; }, {"consumed_train_samples", "2.5"});
  expect_refused([](auto& j) { j["consumed_valid_samples"] = -8; }, {"consumed_valid_samples", "-8"});
  expect_refused([](auto& j) { j["floating_point_operations_so_far"] = "many"; }, {"floating_point_operations_so_far"});
  set_metadata(4, good);
  auto p = load(args_);
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->iteration, 4);
  EXPECT_EQ(p->consumed_train_samples, 32);
}

TEST_F(CheckpointIntegrity, TheTrackerHoldsOneDecimalIntegerOrRelease) {
  save(4);
  for (const char* bad : {"4 5", "00004", "+4", "-4", "4x", "", "  ", "release4", "99999999999999999999999"}) {
    write_bytes(tracker(), bad);
    const std::string e = load_error();
    EXPECT_NE(e.find("latest_checkpointed_iteration.txt"), std::string::npos) << "'" << bad << "': " << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  }
  for (const char* good : {"4", "4\n", " 4 \n"}) {  // Megatron strips the whitespace around the number
    write_bytes(tracker(), good);
    auto p = load(args_);
    ASSERT_TRUE(p.has_value()) << "'" << good << "'";
    EXPECT_EQ(p->iteration, 4);
  }
  write_bytes(tracker(), "release");
  const std::string e = load_error();
  EXPECT_NE(e.find("release"), std::string::npos) << e;  // there is no release/ directory
}

pid_t a_dead_pid() {
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(0);
  ::waitpid(pid, nullptr, 0);
  return pid;
}

// Note [Stale temporary checkpoints]: iter_N.tmp-PID folders left by a crash are removed by the next
// save when PID is no longer running; a live process's folder (a save in progress) is left alone.
TEST_F(CheckpointIntegrity, TheNextSaveRemovesTemporaryDirectoriesOfDeadProcesses) {
  fs::create_directories(args_.save);
  const fs::path dead = fs::path(args_.save) / fmt::format("iter_0000002.tmp-{}", a_dead_pid());
  const fs::path live = fs::path(args_.save) / fmt::format("iter_0000003.tmp-{}", ::getppid());
  const fs::path other = fs::path(args_.save) / "notes.tmp-1";
  for (const fs::path& d : {dead, live, other}) {
    fs::create_directories(d);
    write_bytes(d / "model_rank00000.safetensors", "partial");
  }
  save(5);
  EXPECT_FALSE(fs::exists(dead)) << "the dead process's temporary checkpoint is left";
  EXPECT_TRUE(fs::exists(live)) << "a live process's temporary checkpoint was removed";
  EXPECT_TRUE(fs::exists(other)) << "a folder that is not a temporary checkpoint was removed";
  ASSERT_TRUE(load(args_).has_value());
}

// ---- fuzzing -------------------------------------------------------------------------------------

TEST_F(CheckpointIntegrity, FuzzMetadataJson) {
  save(3);
  const std::string seed = read_bytes(iter_dir(3) / "metadata.json");
  auto r = testing::fuzz("checkpoint metadata.json", seed, 300, 40, [&](const std::string& meta) {
    write_bytes(iter_dir(3) / "metadata.json", meta);
    load(args_);
  });
  testing::expect_no_crash_or_hang(r);
}

TEST_F(CheckpointIntegrity, FuzzTrackerFile) {
  save(3);
  auto r = testing::fuzz("latest_checkpointed_iteration.txt", "3", 100, 41, [&](const std::string& t) {
    write_bytes(tracker(), t);
    load(args_);
  });
  testing::expect_no_crash_or_hang(r);
}

// The safetensors reader and the shard index over it: a file of three dtypes with its shard
// metadata, one tensor empty; each accepted mutation is read completely.
TEST_F(CheckpointIntegrity, FuzzSafetensorsHeader) {
  const fs::path seed_dir = dir_ / "seed", fuzz_dir = dir_ / "fuzz";
  fs::create_directories(seed_dir);
  fs::create_directories(fuzz_dir);
  dist_checkpointing::save_shards(seed_dir.string(), "model", 0,
                                  {{"w", random_tensor({3, 4}, 5), ShardSpec{}},
                                   {"b16", random_tensor({5}, 6, 1.0f, DType::BFloat16), ShardSpec{}},
                                   {"ids", Tensor::from_floats({1, 2, 3}, {3}, DType::Int64), ShardSpec{}},
                                   {"empty", Tensor::zeros({0, 2}, DType::Float32), ShardSpec{}}},
                                  {{"format", "megatron.cpp"}});
  const std::string seed = read_bytes(seed_dir / "model_rank00000.safetensors");
  auto target = [&](const std::string& bytes) {
    write_bytes(fuzz_dir / "model_rank00000.safetensors", bytes);
    safetensors::File f((fuzz_dir / "model_rank00000.safetensors").string());
    for (const std::string& name : f.names()) {
      Tensor t = f.read(name);
      try {
        (void)f.view(name);
      } catch (const Error&) {  // unaligned: read() only
      }
    }
    dist_checkpointing::ShardIndex index(fuzz_dir.string(), "model");
    for (const std::string& name : index.names()) {
      Tensor whole = Tensor::empty(index.tensor(name).shape, DType::Float32);
      index.load_into(name, ShardSpec{}, whole);
    }
  };
  ASSERT_NO_THROW(target(seed));
  auto r = testing::fuzz("safetensors", seed, 400, 42, target);
  testing::expect_no_crash_or_hang(r);
}

}  // namespace
}  // namespace megatron
