// Checkpoints end to end: exact resume (data order, RNG, optimizer, schedule), async save equals
// sync save, atomicity under a kill during a save, resume from a checkpoint of the format before
// sharding, and the errors for another model's or a corrupt checkpoint.
#include <nlohmann/json.hpp>

#include "megatron/core/dist_checkpointing/safetensors.h"
#include "tests/functional/run_util.h"

namespace megatron::testing {
namespace {

// With dropout on, so the RNG state matters too.
std::vector<std::string> resume_flags(int iters) {
  return concat(tiny_gpt_flags(iters), {"--hidden-dropout", "0.1", "--attention-dropout", "0.1"});
}

TEST(Checkpoint, ResumeIsExact) {
  ScratchDir dir("resume");
  // 2N iterations in one run ...
  RunResult full = run(concat({bin("pretrain_gpt")}, resume_flags(12)), dir.path);
  ASSERT_EQ(full.exit_code, 0) << full.output;
  // ... equal N, stop, resume, N more.
  RunResult first =
      run(concat({bin("pretrain_gpt")},
                 concat(resume_flags(12), {"--save", "ckpt", "--save-interval", "6", "--exit-interval", "6"})),
          dir.path);
  ASSERT_EQ(first.exit_code, 0) << first.output;
  RunResult second = run(concat({bin("pretrain_gpt")}, concat(resume_flags(12), {"--load", "ckpt"})), dir.path);
  ASSERT_EQ(second.exit_code, 0) << second.output;
  for (const char* field : {"lm loss", "learning rate", "grad norm", "consumed samples"}) {
    std::vector<std::string> a = field_values(full.output, field);
    std::vector<std::string> b = field_values(first.output, field), c = field_values(second.output, field);
    b.insert(b.end(), c.begin(), c.end());
    ASSERT_EQ(a.size(), 12u) << field;
    EXPECT_EQ(a, b) << field << " differs between the single run and the resumed run";
  }
  EXPECT_NE(second.output.find("successfully loaded checkpoint from ckpt at iteration 6"), std::string::npos);
}

TEST(Checkpoint, AsyncSaveEqualsSyncSave) {
  ScratchDir dir("async");
  for (const char* mode : {"sync", "async"}) {
    auto flags = concat(resume_flags(4), {"--save", mode, "--save-interval", "2"});
    if (std::string(mode) == "async") flags.push_back("--async-save");
    RunResult r = run(concat({bin("pretrain_gpt")}, flags), dir.path);
    ASSERT_EQ(r.exit_code, 0) << r.output;
  }
  for (const char* iter : {"iter_0000002", "iter_0000004"}) {
    for (const char* file : {"model_rank00000.safetensors", "optim_rank00000.safetensors", "metadata.json"}) {
      const std::string a = read_file(dir.path / "sync" / iter / file), b = read_file(dir.path / "async" / iter / file);
      EXPECT_FALSE(a.empty()) << iter << "/" << file;
      EXPECT_EQ(a, b) << iter << "/" << file << " differs between sync and async saves";
    }
  }
  EXPECT_EQ(read_file(dir.path / "async/latest_checkpointed_iteration.txt"), "4");
}

TEST(Checkpoint, KillDuringSaveLeavesThePreviousCheckpoint) {
  ScratchDir dir("atomic");
  auto flags = concat(resume_flags(10), {"--save", "ckpt", "--save-interval", "5"});
  RunResult killed = run(concat({bin("pretrain_gpt")}, flags), dir.path, "MEGATRON_FAULT_INJECT=kill-during-save:2");
  EXPECT_EQ(killed.exit_code, 128 + SIGKILL) << killed.output;
  EXPECT_EQ(read_file(dir.path / "ckpt/latest_checkpointed_iteration.txt"), "5");
  EXPECT_FALSE(fs::exists(dir.path / "ckpt/iter_0000010")) << "a half-written checkpoint must not look complete";
  // The previous checkpoint is intact: training resumes from it.
  RunResult resumed = run(concat({bin("pretrain_gpt")}, concat(resume_flags(10), {"--load", "ckpt"})), dir.path);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("at iteration 5"), std::string::npos) << resumed.output;
  EXPECT_EQ(field_values(resumed.output, "lm loss").size(), 5u);
}

TEST(Checkpoint, Format1CheckpointResumesLikeTheCurrentFormat) {
  ScratchDir dir("format1");
  RunResult first =
      run(concat({bin("pretrain_gpt")},
                 concat(resume_flags(8), {"--save", "ckpt", "--save-interval", "4", "--exit-interval", "4"})),
          dir.path);
  ASSERT_EQ(first.exit_code, 0) << first.output;
  EXPECT_NE(first.output.find("wrote checkpoint ckpt/iter_0000004"), std::string::npos) << first.output;
  fs::copy(dir.path / "ckpt", dir.path / "old", fs::copy_options::recursive);
  // Rewrite the copy as the single-process format 1 wrote it: no shard metadata, version 1.
  const fs::path iter = dir.path / "old/iter_0000004";
  for (const char* file : {"model_rank00000.safetensors", "optim_rank00000.safetensors"}) {
    safetensors::File f((iter / file).string());
    EXPECT_TRUE(f.metadata().count("shards")) << file;
    std::vector<std::pair<std::string, Tensor>> tensors;
    for (const std::string& n : f.names()) tensors.emplace_back(n, f.read(n));
    safetensors::write((iter / file).string(), tensors, {{"format", "megatron.cpp"}});
  }
  nlohmann::json meta = nlohmann::json::parse(read_file(iter / "metadata.json"));
  EXPECT_EQ(meta["version"], 2);
  EXPECT_EQ(meta["parallel"]["tensor_model_parallel_size"], 1);
  meta["version"] = 1;
  meta.erase("parallel");
  meta.erase("checksums");  // format 1 had none (and the files were rewritten)
  std::ofstream(iter / "metadata.json") << meta.dump(2);

  RunResult current = run(concat({bin("pretrain_gpt")}, concat(resume_flags(8), {"--load", "ckpt"})), dir.path);
  RunResult old = run(concat({bin("pretrain_gpt")}, concat(resume_flags(8), {"--load", "old"})), dir.path);
  ASSERT_EQ(current.exit_code, 0) << current.output;
  ASSERT_EQ(old.exit_code, 0) << old.output;
  EXPECT_NE(old.output.find("read checkpoint old/iter_0000004"), std::string::npos) << old.output;
  for (const char* field : {"lm loss", "learning rate", "grad norm", "consumed samples"}) {
    EXPECT_EQ(field_values(current.output, field).size(), 4u) << field;
    EXPECT_EQ(field_values(current.output, field), field_values(old.output, field)) << field;
  }
}

TEST(Checkpoint, AnotherModelOrACorruptFileIsAClearError) {
  ScratchDir dir("bad_ckpt");
  RunResult r = run(concat({bin("pretrain_gpt")}, concat(tiny_gpt_flags(2), {"--save", "ckpt"})), dir.path);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // Another model shape.
  auto other = tiny_gpt_flags(4);
  for (size_t i = 0; i + 1 < other.size(); ++i)
    if (other[i] == "--hidden-size") other[i + 1] = "96";
  RunResult shape = run(concat({bin("pretrain_gpt")}, concat(other, {"--load", "ckpt"})), dir.path);
  EXPECT_NE(shape.exit_code, 0);
  EXPECT_NE(shape.output.find("saved from another model"), std::string::npos) << shape.output;
  EXPECT_NE(shape.output.find("embedding.word_embeddings.weight"), std::string::npos) << shape.output;
  // A truncated tensor file.
  const fs::path model = dir.path / "ckpt/iter_0000002/model_rank00000.safetensors";
  fs::resize_file(model, fs::file_size(model) / 2);
  RunResult corrupt = run(concat({bin("pretrain_gpt")}, concat(tiny_gpt_flags(4), {"--load", "ckpt"})), dir.path);
  EXPECT_NE(corrupt.exit_code, 0);
  EXPECT_NE(corrupt.output.find("model_rank00000.safetensors"), std::string::npos) << corrupt.output;
  // Missing metadata: an incomplete checkpoint.
  fs::remove(dir.path / "ckpt/iter_0000002/metadata.json");
  RunResult incomplete = run(concat({bin("pretrain_gpt")}, concat(tiny_gpt_flags(4), {"--load", "ckpt"})), dir.path);
  EXPECT_NE(incomplete.exit_code, 0);
  EXPECT_NE(incomplete.output.find("incomplete"), std::string::npos) << incomplete.output;
}

TEST(Checkpoint, FinetuneAndNoLoadOptim) {
  ScratchDir dir("finetune");
  ASSERT_EQ(run(concat({bin("pretrain_gpt")}, concat(tiny_gpt_flags(4), {"--save", "ckpt"})), dir.path).exit_code, 0);
  RunResult ft =
      run(concat({bin("pretrain_gpt")}, concat(tiny_gpt_flags(3), {"--load", "ckpt", "--finetune"})), dir.path);
  ASSERT_EQ(ft.exit_code, 0) << ft.output;
  EXPECT_NE(ft.output.find("at iteration 0"), std::string::npos) << "finetune starts at iteration 0";
  EXPECT_EQ(field_values(ft.output, "lm loss").size(), 3u);
  RunResult no_optim =
      run(concat({bin("pretrain_gpt")}, concat(tiny_gpt_flags(6), {"--load", "ckpt", "--no-load-optim"})), dir.path);
  ASSERT_EQ(no_optim.exit_code, 0) << no_optim.output;
  EXPECT_EQ(field_values(no_optim.output, "lm loss").size(), 2u);
}

}  // namespace
}  // namespace megatron::testing
