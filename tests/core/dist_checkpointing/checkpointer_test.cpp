// Checkpointer across parallel layouts: ranks are threads (make_local_group) with a ParallelState
// each, holding hand-built shards of a small model (a vocab-parallel embedding, SwiGLU's fc1 split
// in two chunks, a row-parallel fc2, tensor-parallel duplicates). A checkpoint saved with
// (tp=2, dp=2) loads with tp=1, tp=4, (tp=2, dp=2) and (tp=1, dp=2), weights and Adam state equal
// to the full tensors' slices; only the owners write (Note [Checkpoint ownership]); async saves are
// published at finalize(); format-1 checkpoints load into any layout; another model is an error.
#include "megatron/training/checkpointing.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "megatron/core/dist_checkpointing/safetensors.h"
#include "megatron/core/distributed/distributed_data_parallel.h"
#include "megatron/core/distributed/param_and_grad_buffer.h"
#include "tests/core/thread_ranks.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

namespace fs = std::filesystem;
using ::megatron::testing::random_tensor;

struct ParamDef {
  std::string name;
  Shape global;
  int dim;  // partition dim, -1: unsharded
  int chunks;
  bool tp_duplicate;
  bool shared_embedding_copy = false;
};

std::vector<ParamDef> model_defs(int64_t fc2_in = 8) {
  return {{"embedding.word_embeddings.weight", {8, 4}, 0, 1, false},
          {"decoder.layers.0.mlp.linear_fc1.weight", {16, 4}, 0, 2, false},
          {"decoder.layers.0.mlp.linear_fc2.weight", {4, fc2_in}, 1, 1, false},
          {"decoder.layers.0.mlp.linear_fc2.bias", {4}, -1, 1, true},
          {"decoder.final_layernorm.weight", {4}, -1, 1, true}};
}

/// The same model over two pipeline stages: the last stage holds a copy of the tied embeddings.
std::vector<ParamDef> stage_defs(int pp_rank) {
  const std::vector<ParamDef> all = model_defs();
  if (pp_rank == 0) return {all[0], all[1]};
  ParamDef tied = all[0];
  tied.shared_embedding_copy = true;
  return {all[2], all[3], all[4], tied};
}

// The full tensors: the fp32 master (the bf16 weights are it rounded) and the two Adam moments.
enum Kind { kMaster = 0, kExpAvg = 1, kExpAvgSq = 2 };
std::vector<float> global_values(const std::string& name, Kind kind, const Shape& shape) {
  uint64_t seed = 1469598103934665603ull;  // FNV-1a of the name
  for (char c : name) seed = (seed ^ uint8_t(c)) * 1099511628211ull;
  std::vector<float> v = random_tensor(shape, seed + kind).to_floats();
  if (kind == kExpAvgSq)
    for (float& x : v) x = std::fabs(x);
  return v;
}

ShardSpec spec_of(const ParamDef& d, int tp_size, int tp_rank) {
  if (d.dim < 0) return unsharded(d.global);
  ShardSpec s;
  s.global_shape = d.global;
  s.partition_dim = d.dim;
  s.size = tp_size;
  s.rank = tp_rank;
  s.chunks = d.chunks;
  return s;
}

/// `global` cut to `spec`'s local tensor.
Tensor local_of(const std::vector<float>& global, const ShardSpec& spec, DType dtype) {
  const Shape ls = local_shape(spec);
  std::vector<float> out(size_t(shape_numel(ls)));
  for (const ShardBox& b : shard_boxes(spec)) {
    for (const FlatRun& r : flat_runs(b, spec.global_shape, ls))
      for (int64_t i = 0; i < r.count; ++i) out[size_t(r.local_start + i)] = global[size_t(r.global_start + i)];
  }
  return Tensor::from_floats(out, ls, dtype);
}

/// One rank's model and optimizer: bf16 weights with fp32 masters, filled with the slices of the
/// full tensors or zero.
struct RankModel {
  std::vector<Parameter> params;
  std::vector<Parameter*> ptrs;
  std::unique_ptr<AdamOptimizer> optimizer;

  RankModel(int tp_size, int tp_rank, bool filled, const std::vector<ParamDef>& defs = model_defs()) {
    for (const ParamDef& d : defs) {
      const ShardSpec spec = spec_of(d, tp_size, tp_rank);
      const Shape ls = local_shape(spec);
      Tensor data = filled ? local_of(global_values(d.name, kMaster, d.global), spec, DType::BFloat16)
                           : Tensor::zeros(ls, DType::BFloat16);
      Parameter p = make_parameter(d.name, data, Tensor::zeros(ls, DType::Float32));
      p.shard = spec;
      p.tp_duplicate = d.tp_duplicate;
      p.shared_embedding_copy = d.shared_embedding_copy;
      params.push_back(std::move(p));
    }
    for (Parameter& p : params) ptrs.push_back(&p);
    OptimizerConfig config;
    config.bf16 = true;
    config.lr = 1e-3;
    optimizer = std::make_unique<AdamOptimizer>(params, config);
    if (!filled) return;
    for (const Parameter& p : params) {
      AdamParamState& st = optimizer->state(p.name);
      st.master.copy_from(local_of(global_values(p.name, kMaster, p.shard.global_shape), p.shard, DType::Float32));
      st.exp_avg.copy_from(local_of(global_values(p.name, kExpAvg, p.shard.global_shape), p.shard, DType::Float32));
      st.exp_avg_sq.copy_from(
          local_of(global_values(p.name, kExpAvgSq, p.shard.global_shape), p.shard, DType::Float32));
    }
  }

  /// Every weight and Adam tensor equals its slice of the full tensors.
  void expect_equals_globals(const std::string& what) const {
    for (const Parameter& p : params) {
      const Shape& g = p.shard.global_shape;
      const std::vector<float> master = global_values(p.name, kMaster, g);
      EXPECT_EQ(p.data.to_floats(), local_of(master, p.shard, DType::BFloat16).to_floats()) << what << ": " << p.name;
      const AdamParamState& st = optimizer->state(p.name);
      EXPECT_EQ(st.master.to_floats(), local_of(master, p.shard, DType::Float32).to_floats())
          << what << ": master of " << p.name;
      EXPECT_EQ(st.exp_avg.to_floats(), local_of(global_values(p.name, kExpAvg, g), p.shard, DType::Float32).to_floats())
          << what << ": exp_avg of " << p.name;
      EXPECT_EQ(st.exp_avg_sq.to_floats(),
                local_of(global_values(p.name, kExpAvgSq, g), p.shard, DType::Float32).to_floats())
          << what << ": exp_avg_sq of " << p.name;
    }
  }
};

/// Runs `fn(parallel_state)` on `world` thread-ranks with tensor- and pipeline-parallel sizes `tp`
/// and `pp`; rethrows the first rank's exception.
void run_ranks(int world, int tp, const std::function<void(ParallelState&)>& fn, int pp = 1) {
  ParallelConfig config;
  config.tensor_model_parallel_size = tp;
  config.pipeline_model_parallel_size = pp;
  testing::run_thread_ranks(world, config, fn);
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

class CheckpointerLayouts : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() / ("mg_ckpt_layouts_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    args_.save = (dir_ / "ckpt").string();
  }
  void TearDown() override { fs::remove_all(dir_); }

  /// Saves the filled model at iteration `iteration` from `world` ranks with tensor-parallel size `tp`.
  void save(int world, int tp, int64_t iteration, bool async = false) {
    Arguments args = args_;
    args.async_save = async;
    run_ranks(world, tp, [&](ParallelState& ps) {
      RankModel m(tp, ps.tp_rank(), true);
      Context ctx;
      ctx.rng().seed = 77;
      ctx.rng().offset = 4096;
      Checkpointer ck(args, &ps);
      TrainingProgress progress{iteration, iteration * 10, 3, 1.5e9};
      ck.save(ctx, m.ptrs, m.optimizer.get(), nullptr, progress);
      if (async) {
        EXPECT_TRUE(ck.save_in_flight());
        ck.finalize();
      }
    });
  }

  /// Loads into every rank of (world, tp) and checks every tensor against the full ones.
  void load_and_check(int world, int tp, int64_t iteration) {
    run_ranks(world, tp, [&](ParallelState& ps) {
      RankModel m(tp, ps.tp_rank(), false);
      Context ctx;
      Checkpointer ck(args_, &ps);
      auto progress = ck.load(ctx, args_.save, m.ptrs, m.optimizer.get(), nullptr);
      ASSERT_TRUE(progress.has_value());
      EXPECT_EQ(progress->iteration, iteration);
      EXPECT_EQ(progress->consumed_train_samples, iteration * 10);
      EXPECT_EQ(ctx.rng().offset, 4096u);
      m.expect_equals_globals(fmt::format("world {} tp {}, {}", world, tp, ps.describe()));
    });
  }

  /// Loads into every rank of (world, tp) with models of `defs`; the messages of the ranks whose
  /// load threw, in the order they threw.
  std::vector<std::string> load_errors(int world, int tp, const std::vector<ParamDef>& defs = model_defs()) {
    std::mutex mu;
    std::vector<std::string> messages;
    run_ranks(world, tp, [&](ParallelState& ps) {
      RankModel m(tp, ps.tp_rank(), false, defs);
      Context ctx;
      Checkpointer ck(args_, &ps);
      try {
        ck.load(ctx, args_.save, m.ptrs, m.optimizer.get(), nullptr);
      } catch (const Error& e) {
        std::lock_guard<std::mutex> lock(mu);
        messages.push_back(e.what());
      }
    });
    return messages;
  }

  Arguments args_;
  fs::path dir_;
};

TEST_F(CheckpointerLayouts, SavedWithTp2Dp2LoadsInEveryLayout) {
  save(/*world=*/4, /*tp=*/2, 7);
  const fs::path ck = dir_ / "ckpt" / "iter_0000007";
  EXPECT_EQ(read_text(dir_ / "ckpt/latest_checkpointed_iteration.txt"), "7");
  // Only data-parallel rank 0 writes (world ranks 0 and 1); no temporary directory is left.
  for (const char* stem : {"model", "optim"}) {
    EXPECT_TRUE(fs::exists(ck / fmt::format("{}_rank00000.safetensors", stem)));
    EXPECT_TRUE(fs::exists(ck / fmt::format("{}_rank00001.safetensors", stem)));
    EXPECT_FALSE(fs::exists(ck / fmt::format("{}_rank00002.safetensors", stem)));
    EXPECT_FALSE(fs::exists(ck / fmt::format("{}_rank00003.safetensors", stem)));
  }
  for (const auto& e : fs::directory_iterator(dir_ / "ckpt"))
    EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << e.path();
  // Tensor-parallel duplicates are written by tp rank 0 alone.
  safetensors::File rank1((ck / "model_rank00001.safetensors").string());
  EXPECT_FALSE(rank1.contains("decoder.final_layernorm.weight"));
  EXPECT_FALSE(rank1.contains("decoder.layers.0.mlp.linear_fc2.bias"));
  EXPECT_EQ(rank1.entry("decoder.layers.0.mlp.linear_fc1.weight").shape, (Shape{8, 4}));
  EXPECT_EQ(rank1.entry("decoder.layers.0.mlp.linear_fc1.weight").dtype, DType::BFloat16);

  const nlohmann::json meta = nlohmann::json::parse(read_text(ck / "metadata.json"));
  EXPECT_EQ(meta["version"], 2);
  EXPECT_EQ(meta["parallel"]["tensor_model_parallel_size"], 2);
  EXPECT_EQ(meta["parallel"]["data_parallel_size"], 2);
  EXPECT_EQ(meta["parallel"]["world_size"], 4);
  const auto& fc1 = meta["tensors"]["decoder.layers.0.mlp.linear_fc1.weight"];
  EXPECT_EQ(fc1["shape"], nlohmann::json({16, 4}));
  EXPECT_EQ(fc1["shards"].size(), 4u);  // two ranks x two chunks
  EXPECT_EQ(meta["tensors"]["decoder.layers.0.mlp.linear_fc2.weight.exp_avg"]["shape"], nlohmann::json({4, 8}));
  EXPECT_EQ(meta["tensors"]["decoder.final_layernorm.weight"]["shards"].size(), 1u);

  load_and_check(/*world=*/1, /*tp=*/1, 7);
  load_and_check(/*world=*/4, /*tp=*/4, 7);
  load_and_check(/*world=*/4, /*tp=*/2, 7);
  load_and_check(/*world=*/2, /*tp=*/1, 7);
}

TEST_F(CheckpointerLayouts, SingleProcessCheckpointLoadsWithTp4) {
  {
    RankModel m(1, 0, true);
    Context ctx;
    ctx.rng().offset = 4096;
    Checkpointer ck(args_);
    ck.save(ctx, m.ptrs, m.optimizer.get(), nullptr, TrainingProgress{3, 30, 0, 0});
  }
  load_and_check(/*world=*/4, /*tp=*/4, 3);
  // A single process restores the seed too.
  RankModel m(1, 0, false);
  Context ctx;
  Checkpointer ck(args_);
  ASSERT_TRUE(ck.load(ctx, args_.save, m.ptrs, m.optimizer.get(), nullptr).has_value());
  m.expect_equals_globals("single process");
}

TEST_F(CheckpointerLayouts, AsyncSaveIsPublishedAtFinalize) {
  Arguments args = args_;
  args.async_save = true;
  run_ranks(2, 2, [&](ParallelState& ps) {
    RankModel m(2, ps.tp_rank(), true);
    Context ctx;
    ctx.rng().offset = 4096;
    Checkpointer ck(args, &ps);
    ck.save(ctx, m.ptrs, m.optimizer.get(), nullptr, TrainingProgress{5, 50, 0, 0});
    // Not visible before every rank has finished writing and rank 0 has published it.
    EXPECT_FALSE(fs::exists(dir_ / "ckpt/latest_checkpointed_iteration.txt"));
    ck.save(ctx, m.ptrs, m.optimizer.get(), nullptr, TrainingProgress{6, 60, 0, 0});  // publishes 5 first
    EXPECT_EQ(read_text(dir_ / "ckpt/latest_checkpointed_iteration.txt"), "5");
    ck.finalize();
    EXPECT_EQ(read_text(dir_ / "ckpt/latest_checkpointed_iteration.txt"), "6");
  });
  EXPECT_TRUE(fs::exists(dir_ / "ckpt/iter_0000005/metadata.json"));
  load_and_check(/*world=*/1, /*tp=*/1, 6);
  load_and_check(/*world=*/2, /*tp=*/1, 6);
}

TEST_F(CheckpointerLayouts, Format1CheckpointLoadsIntoTp2) {
  // What the single-process build before sharding wrote: whole tensors, no shard metadata, version 1.
  const fs::path ck = dir_ / "ckpt" / "iter_0000004";
  fs::create_directories(ck);
  const std::vector<ParamDef> defs = model_defs();
  std::vector<std::pair<std::string, Tensor>> model, optim;
  for (const ParamDef& d : defs) {
    const Shape& g = d.global;
    model.emplace_back(d.name, Tensor::from_floats(global_values(d.name, kMaster, g), g, DType::BFloat16));
    optim.emplace_back(d.name + ".master", Tensor::from_floats(global_values(d.name, kMaster, g), g));
    optim.emplace_back(d.name + ".exp_avg", Tensor::from_floats(global_values(d.name, kExpAvg, g), g));
    optim.emplace_back(d.name + ".exp_avg_sq", Tensor::from_floats(global_values(d.name, kExpAvgSq, g), g));
  }
  safetensors::write((ck / "model_rank00000.safetensors").string(), model, {{"format", "megatron.cpp"}});
  safetensors::write((ck / "optim_rank00000.safetensors").string(), optim, {{"format", "megatron.cpp"}});
  std::ofstream(ck / "metadata.json") << nlohmann::json{{"format", "megatron.cpp"},
                                                        {"version", 1},
                                                        {"iteration", 4},
                                                        {"consumed_train_samples", 40},
                                                        {"optimizer", {{"step", 4}, {"lr", 1e-3}, {"weight_decay", 0.01}}},
                                                        {"rng", {{"seed", 1}, {"offset", 4096}}},
                                                        {"tensors", nlohmann::json::object()}}
                                                            .dump();
  std::ofstream(dir_ / "ckpt/latest_checkpointed_iteration.txt") << "4";
  load_and_check(/*world=*/2, /*tp=*/2, 4);
}

TEST_F(CheckpointerLayouts, PipelineStagesSaveTheirOwnLayersAndLoadIntoOneStage) {
  // (tp=2, pp=2): world ranks 0-1 hold stage 0 (embedding, fc1), ranks 2-3 stage 1 (fc2, norms
  // and the tied embeddings' copy, which is not written).
  run_ranks(
      4, 2,
      [&](ParallelState& ps) {
        RankModel m(2, ps.tp_rank(), true, stage_defs(ps.pp_rank()));
        Context ctx;
        ctx.rng().offset = 4096;
        Checkpointer ck(args_, &ps);
        ck.save(ctx, m.ptrs, m.optimizer.get(), nullptr, TrainingProgress{9, 90, 0, 0});
      },
      /*pp=*/2);
  safetensors::File stage1((dir_ / "ckpt/iter_0000009/model_rank00002.safetensors").string());
  EXPECT_FALSE(stage1.contains("embedding.word_embeddings.weight"));
  EXPECT_TRUE(stage1.contains("decoder.final_layernorm.weight"));
  EXPECT_FALSE(fs::exists(dir_ / "ckpt/iter_0000009/model_rank00003.safetensors.tmp"));
  load_and_check(/*world=*/2, /*tp=*/2, 9);
  // And back into two stages with tp=1: the last stage's tied copy is read from the embeddings.
  run_ranks(
      2, 1,
      [&](ParallelState& ps) {
        RankModel m(1, 0, false, stage_defs(ps.pp_rank()));
        Context ctx;
        Checkpointer ck(args_, &ps);
        ASSERT_TRUE(ck.load(ctx, args_.save, m.ptrs, m.optimizer.get(), nullptr).has_value());
        m.expect_equals_globals(ps.describe());
      },
      /*pp=*/2);
}

// With the distributed optimizer each data-parallel rank holds a flat shard of the Adam state;
// gather_state assembles it for the writer and scatter_state keeps the reader's shard, so a
// checkpoint moves between DP sizes and to and from the plain optimizer.
TEST_F(CheckpointerLayouts, DistributedOptimizerStateMovesBetweenDataParallelSizes) {
  struct DdpRank {
    ParamAndGradBuffer buf{DType::BFloat16, Device::cpu()};
    std::unique_ptr<DistributedDataParallel> ddp;
    std::unique_ptr<AdamOptimizer> optimizer;
    DdpRank(ParallelState& ps, bool fill) {
      DDPConfig cfg;
      cfg.use_distributed_optimizer = true;
      cfg.bucket_size = 20;
      buf.add("a.weight", {7, 5}, false, ParamInit::Normal);
      buf.add("a.bias", {7}, true, ParamInit::Normal);
      buf.add("b.weight", {3, 11}, false, ParamInit::Normal);
      buf.allocate(cfg, ps.dp_size());
      buf.init_weights(fill ? 1234 : 99, 0.5f, 2, false);
      ddp = std::make_unique<DistributedDataParallel>(ps, std::vector<ParamAndGradBuffer*>{&buf}, cfg);
      OptimizerConfig oc;
      oc.bf16 = true;
      oc.lr = 1e-3;
      optimizer = std::make_unique<AdamOptimizer>(ddp->parameters(), oc, *ddp);
    }
    // The full state every rank agrees on: masters are the weights, moments from the name.
    static AdamParamState full_state(const Parameter& p) {
      const std::vector<float> w = p.data.to_floats();
      return {Tensor::from_floats(w, p.data.shape()),
              Tensor::from_floats(global_values(p.name, kExpAvg, p.data.shape()), p.data.shape()),
              Tensor::from_floats(global_values(p.name, kExpAvgSq, p.data.shape()), p.data.shape())};
    }
  };
  std::map<std::string, std::vector<float>> weights;
  std::mutex mu;
  run_ranks(2, 1, [&](ParallelState& ps) {
    DdpRank r(ps, true);
    Context ctx;
    ctx.rng().offset = 4096;
    for (Parameter* p : r.buf.parameters()) r.optimizer->scatter_state(ctx, p->name, DdpRank::full_state(*p));
    if (ps.rank() == 0) {
      std::lock_guard<std::mutex> lock(mu);
      for (Parameter* p : r.buf.parameters()) weights[p->name] = p->data.to_floats();
    }
    Checkpointer ck(args_, &ps);
    ck.save(ctx, r.buf.parameters(), r.optimizer.get(), nullptr, TrainingProgress{2, 20, 0, 0});
  });
  // Only dp rank 0 wrote, the whole state.
  EXPECT_FALSE(fs::exists(dir_ / "ckpt/iter_0000002/optim_rank00001.safetensors"));
  safetensors::File optim((dir_ / "ckpt/iter_0000002/optim_rank00000.safetensors").string());
  EXPECT_EQ(optim.entry("a.weight.exp_avg").shape, (Shape{7, 5}));

  for (int dp : {4, 1}) {
    run_ranks(dp, 1, [&](ParallelState& ps) {
      DdpRank r(ps, false);
      Context ctx;
      Checkpointer ck(args_, &ps);
      ASSERT_TRUE(ck.load(ctx, args_.save, r.buf.parameters(), r.optimizer.get(), nullptr).has_value());
      for (Parameter* p : r.buf.parameters()) {
        EXPECT_EQ(p->data.to_floats(), weights.at(p->name)) << "dp " << dp << ": " << p->name;
        const AdamParamState got = r.optimizer->gather_state(ctx, p->name);
        EXPECT_EQ(got.master.to_floats(), weights.at(p->name)) << "dp " << dp << ": master of " << p->name;
        EXPECT_EQ(got.exp_avg.to_floats(), global_values(p->name, kExpAvg, p->data.shape()))
            << "dp " << dp << ": exp_avg of " << p->name;
        EXPECT_EQ(got.exp_avg_sq.to_floats(), global_values(p->name, kExpAvgSq, p->data.shape()))
            << "dp " << dp << ": exp_avg_sq of " << p->name;
      }
    });
  }
}

TEST_F(CheckpointerLayouts, AnotherModelIsAnErrorOnEveryRank) {
  save(/*world=*/2, /*tp=*/2, 2);
  const std::vector<std::string> messages = load_errors(/*world=*/2, /*tp=*/2, model_defs(/*fc2_in=*/10));
  ASSERT_EQ(messages.size(), 2u);
  // A vocabulary padded for another tensor-parallel size says which flag restores it.
  RankModel vocab(1, 0, false,
                  {{"embedding.word_embeddings.weight", {12, 4}, 0, 1, false}});
  Context ctx;
  Checkpointer ck(args_);
  try {
    ck.load(ctx, args_.save, vocab.ptrs, nullptr, nullptr);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("[8, 4] there, [12, 4] in this model"), std::string::npos) << msg;
    EXPECT_NE(msg.find("--make-vocab-size-divisible-by so that it is 8 rows"), std::string::npos) << msg;
  }
  for (const std::string& msg : messages) {
    for (const char* word :
         {"saved from another model", "decoder.layers.0.mlp.linear_fc2.weight", "[4, 8] there", "[4, 10] in this model"})
      EXPECT_NE(msg.find(word), std::string::npos) << "'" << word << "' not in: " << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
}

// Note [Checkpoint checksums]: every rank's checksums reach metadata.json through rank 0; a flipped
// byte in one rank's file fails the load on every rank (no rank left waiting in a collective), and
// the ranks that read the file name it.
TEST_F(CheckpointerLayouts, ACorruptRankFileFailsTheLoadOnEveryRank) {
  save(/*world=*/4, /*tp=*/2, 2);
  const nlohmann::json meta = nlohmann::json::parse(read_text(dir_ / "ckpt/iter_0000002/metadata.json"));
  ASSERT_TRUE(meta.contains("checksums")) << meta.dump();
  EXPECT_EQ(meta["checksums"]["files"].size(), 4u) << "dp rank 0 of each tp rank writes model and optim files";
  load_and_check(/*world=*/2, /*tp=*/2, 2);
  const fs::path file = dir_ / "ckpt/iter_0000002/model_rank00001.safetensors";
  std::string bytes = read_text(file);
  bytes[bytes.size() - 3] = char(bytes[bytes.size() - 3] ^ 1);
  std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes;
  const std::vector<std::string> messages = load_errors(/*world=*/2, /*tp=*/2);
  ASSERT_EQ(messages.size(), 2u);
  bool named = false;
  for (const std::string& msg : messages) named = named || msg.find("model_rank00001.safetensors") != std::string::npos;
  EXPECT_TRUE(named) << messages[0] << " | " << messages[1];
}

TEST_F(CheckpointerLayouts, AMissingRankFileIsAnErrorNamingTheTensor) {
  save(/*world=*/2, /*tp=*/2, 2);
  fs::remove(dir_ / "ckpt/iter_0000002/model_rank00001.safetensors");
  RankModel m(1, 0, false);
  Context ctx;
  Checkpointer ck(args_);
  try {
    ck.load(ctx, args_.save, m.ptrs, m.optimizer.get(), nullptr);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("not fully covered"), std::string::npos) << msg;
    // The first tensor (by name) with a hole: rows [4, 8) of fc1 were rank 1's first chunk.
    EXPECT_NE(msg.find("'decoder.layers.0.mlp.linear_fc1.weight' [16, 4]"), std::string::npos) << msg;
    EXPECT_NE(msg.find("offset [4, 0] of shape [4, 4]"), std::string::npos) << msg;
  }
}

}  // namespace
}  // namespace megatron
