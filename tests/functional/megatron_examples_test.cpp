// Megatron-LM's example launch scripts (examples/{gpt3,llama,mixtral,gptoss,mamba}/) through
// build/bin/pretrain_gpt, shrunk to a CPU-sized model: the argument lists are the vendored copies in
// tests/fixtures/megatron_examples/ (scripts/megatron_examples.py extracted them from the scripts as
// bash expands them, and shrank them). The ones we run train 3 iterations to a finite loss; the ones
// we refuse fail at start with one line naming every flag we refuse (docs/megatron_examples.md says
// why for each).
#include <cmath>
#include <map>
#include <set>

#include "tests/functional/run_util.h"

namespace megatron::testing {
namespace {

const fs::path kFixtures = fs::path(MEGATRON_SOURCE_DIR) / "tests/fixtures/megatron_examples";

std::vector<std::string> read_args(const std::string& file) {
  std::ifstream in(kFixtures / file);
  EXPECT_TRUE(in.good()) << "missing fixture " << (kFixtures / file);
  std::vector<std::string> out;
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

// name -> the flags we refuse in its shrunk run (empty: it trains).
const std::map<std::string, std::vector<std::string>> kExpected = {
    {"gpt3", {"--step-batch-size-schedule"}},
    {"llama", {"--fp8-format"}},  // FP8 needs a Hopper GPU: refused at start on the CPU
    {"mixtral", {}},
    {"gptoss", {"--export-force-local-attention", "--enable-gpt-oss", "--disable-bf16-reduced-precision-matmul"}},
    {"mamba", {"--hybrid-layer-pattern", "--spec"}},
};

// What shrinking may change (scripts/megatron_examples.py's SIZES and DATA_FILES).
const std::set<std::string> kShrunk = {
    "--num-layers", "--hidden-size", "--ffn-hidden-size", "--moe-ffn-hidden-size", "--num-attention-heads",
    "--num-query-groups", "--kv-channels", "--seq-length", "--max-position-embeddings", "--num-experts",
    "--vocab-size", "--micro-batch-size", "--global-batch-size", "--train-iters", "--train-samples",
    "--log-interval", "--tensor-model-parallel-size", "--pipeline-model-parallel-size",
    "--expert-model-parallel-size", "--context-parallel-size", "--data-path", "--vocab-file", "--merge-file",
    "--tokenizer-model", "--tokenizer-type"};

// Each flag with the words after it up to the next flag.
std::vector<std::pair<std::string, std::vector<std::string>>> by_flag(const std::vector<std::string>& args) {
  std::vector<std::pair<std::string, std::vector<std::string>>> out;
  for (const std::string& a : args) {
    if (a.rfind("--", 0) == 0) {
      out.push_back({a, {}});
    } else if (!out.empty()) {
      out.back().second.push_back(a);
    }
  }
  return out;
}

// The shrunk run keeps every flag of the script with its value, except the sizes, parallel sizes and
// data files, and adds only mock data and --device cpu.
TEST(MegatronExamples, ShrunkArgumentsKeepEveryOtherFlag) {
  for (const auto& [name, refused] : kExpected) {
    SCOPED_TRACE(name);
    std::vector<std::string> script = read_args(name + ".args");
    ASSERT_FALSE(script.empty());
    EXPECT_TRUE(script[0] == "pretrain_gpt.py" || script[0].ends_with("pretrain_hybrid.py")) << script[0];
    const auto original = by_flag({script.begin() + 1, script.end()}), shrunk = by_flag(read_args(name + ".shrunk.args"));
    std::multimap<std::string, std::vector<std::string>> kept(shrunk.begin(), shrunk.end());
    for (const auto& [flag, values] : original) {
      if (kShrunk.count(flag)) continue;
      auto [lo, hi] = kept.equal_range(flag);
      bool found = false;
      for (auto it = lo; it != hi && !found; ++it) found = it->second == values;
      EXPECT_TRUE(found) << flag << " lost or changed in the shrunk run";
    }
    std::set<std::string> script_flags;
    for (const auto& [flag, values] : original) script_flags.insert(flag);
    for (const auto& [flag, values] : shrunk) {
      EXPECT_TRUE(script_flags.count(flag) || flag == "--device" || flag == "--mock-data" || flag == "--tokenizer-type" ||
                  flag == "--vocab-size")
          << flag << " added by the shrinking";
    }
    for (const std::string& f : refused) EXPECT_TRUE(script_flags.count(f)) << f << " is not in the script";
  }
}

TEST(MegatronExamples, RunOrRefuseWithOneLine) {
  for (const auto& [name, refused] : kExpected) {
    SCOPED_TRACE(name);
    ScratchDir dir("megatron_example_" + name);
    RunResult r = run(concat({bin("pretrain_gpt")}, read_args(name + ".shrunk.args")), dir.path);
    if (refused.empty()) {
      ASSERT_EQ(r.exit_code, 0) << r.output;
      const std::vector<std::string> losses = field_values(r.output, "lm loss");
      ASSERT_EQ(losses.size(), 3u) << r.output;
      for (const std::string& l : losses) EXPECT_TRUE(std::isfinite(std::stod(l))) << l;
      EXPECT_NEAR(std::stod(losses.front()), std::log(1024.0), 0.3) << "a fresh model's loss is about log(vocab)";
    } else {
      EXPECT_NE(r.exit_code, 0) << r.output;
      // One error line; nothing else but the "has no effect" warnings of flags read before it.
      std::vector<std::string> lines;
      std::istringstream in(r.output);
      for (std::string line; std::getline(in, line);)
        if (!line.empty() && line.rfind("warning: ", 0) != 0) lines.push_back(line);
      ASSERT_EQ(lines.size(), 1u) << r.output;
      ASSERT_EQ(lines[0].rfind("error: ", 0), 0u) << lines[0];
      if (lines[0].find("unknown flag") != std::string::npos) {
        const std::string head = refused.size() == 1 ? std::string("error: unknown flag ")
                                                     : "error: " + std::to_string(refused.size()) + " unknown flags: ";
        EXPECT_EQ(lines[0].rfind(head, 0), 0u) << "refuses exactly the expected flags: " << lines[0];
        for (const std::string& f : refused) EXPECT_NE(lines[0].find(f + " ("), std::string::npos) << f << ": " << lines[0];
      } else {  // a flag we read and refuse with its reason
        ASSERT_EQ(refused.size(), 1u) << lines[0];
        EXPECT_EQ(lines[0].rfind("error: " + refused[0] + " ", 0), 0u) << lines[0];
      }
    }
  }
}

}  // namespace
}  // namespace megatron::testing
