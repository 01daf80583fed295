// Megatron's FP8 flags: names, defaults, and the rules that refuse a combination (one line each).
#include <gtest/gtest.h>

#include "megatron/core/fp8_utils.h"
#include "megatron/training/arguments.h"
#include "tests/test_util.h"
#include "tests/training/parse_util.h"

namespace megatron {
namespace {

using testing::error_of;
using testing::parse;

std::vector<std::string> base(std::vector<std::string> extra) {
  std::vector<std::string> f = {"--num-layers", "4",  "--hidden-size",  "128", "--num-attention-heads", "4",
                                "--seq-length", "32", "--micro-batch-size", "2", "--train-iters",      "10",
                                "--lr",         "1e-3", "--mock-data",    "--vocab-size", "100"};
  f.insert(f.end(), extra.begin(), extra.end());
  return f;
}

std::string validate_error(std::vector<std::string> extra) {
  return error_of([&] {
    Arguments a = parse(base(extra));
    validate_args(a);
  });
}

TEST(Fp8Arguments, MegatronDefaults) {
  Arguments a = parse(base({}));
  const Fp8Config c = fp8_config_from_args(a);
  EXPECT_FALSE(c.enabled());
  EXPECT_EQ(c.recipe, Fp8Recipe::Delayed);
  EXPECT_EQ(c.margin, 0);
  EXPECT_EQ(c.interval, 1);
  EXPECT_EQ(c.amax_history_len, 1);
  EXPECT_FALSE(c.amax_compute_max);
  EXPECT_FALSE(c.first_last_layers_bf16);
  EXPECT_EQ(c.num_layers_at_start_in_bf16, 1);
  EXPECT_EQ(c.num_layers_at_end_in_bf16, 1);
  EXPECT_FALSE(c.param_gather);
  EXPECT_TRUE(c.wgrad);
  EXPECT_FALSE(parse(base({})).disable_parameter_transpose_cache);
  EXPECT_EQ(validate_error({}), "");
}

// --no-fp8-wgrad (argparse's) and --disable-fp8-wgrad (the config field's flag) both clear
// fp8_wgrad; --disable-parameter-transpose-cache reaches the arguments (Note [FP8 weight cache]).
TEST(Fp8Arguments, WgradAndTransposeCacheFlags) {
  for (const char* flag : {"--no-fp8-wgrad", "--disable-fp8-wgrad"}) {
    EXPECT_FALSE(fp8_config_from_args(parse(base({"--fp8-format", "e4m3", flag}))).wgrad) << flag;
  }
  EXPECT_TRUE(parse(base({"--disable-parameter-transpose-cache"})).disable_parameter_transpose_cache);
}

TEST(Fp8Arguments, FlagsReachTheConfig) {
  Arguments a = parse(base({"--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--fp8-margin", "2",
                            "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max", "--fp8-interval", "3",
                            "--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "2",
                            "--num-layers-at-end-in-bf16", "0", "--fp8-param-gather"}));
  const Fp8Config c = fp8_config_from_args(a);
  EXPECT_EQ(c.format, "hybrid");
  EXPECT_EQ(c.recipe, Fp8Recipe::Tensorwise);
  EXPECT_EQ(c.margin, 2);
  EXPECT_EQ(c.amax_history_len, 1024);
  EXPECT_TRUE(c.amax_compute_max);
  EXPECT_EQ(c.interval, 3);
  EXPECT_TRUE(c.first_last_layers_bf16);
  EXPECT_EQ(c.num_layers_at_start_in_bf16, 2);
  EXPECT_EQ(c.num_layers_at_end_in_bf16, 0);
  EXPECT_TRUE(c.param_gather);
}

TEST(Fp8Arguments, BadCombinationsSayWhichRuleFailed) {
  auto check = [](std::vector<std::string> extra, const std::string& needle) {
    const std::string e = validate_error(extra);
    EXPECT_NE(e.find(needle), std::string::npos) << "got: " << e;
  };
  EXPECT_EQ(validate_error({"--fp8-format", "e4m3"}), "");
  EXPECT_EQ(validate_error({"--fp8-format", "hybrid", "--fp8-recipe", "blockwise"}), "");
  check({"--fp8-format", "e4m3", "--fp16"}, "train FP8 with --bf16");
  check({"--fp8-format", "e4m3", "--fp8-recipe", "mxfp8"}, "needs a Blackwell GPU");
  check({"--fp8-format", "e4m3", "--first-last-layers-bf16"}, "does not work with --fp8-recipe delayed");
  check({"--fp8-format", "e4m3", "--fp8-recipe", "blockwise", "--hidden-size", "96"}, "multiples of the 128 block");
  // the experts run in FP8 too (Note [FP8 experts]): their widths follow the block
  EXPECT_EQ(validate_error({"--fp8-format", "hybrid", "--fp8-recipe", "blockwise", "--num-experts", "4",
                            "--moe-ffn-hidden-size", "256", "--moe-shared-expert-intermediate-size", "128"}),
            "");
  check({"--fp8-format", "hybrid", "--fp8-recipe", "blockwise", "--num-experts", "4", "--moe-ffn-hidden-size", "96"},
        "--fp8-recipe blockwise needs --moe-ffn-hidden-size (96) and --moe-shared-expert-intermediate-size (0)");
  check({"--fp8-format", "hybrid", "--fp8-recipe", "blockwise", "--num-experts", "4", "--moe-ffn-hidden-size", "128",
         "--moe-shared-expert-intermediate-size", "64"},
        "--moe-shared-expert-intermediate-size (64) to be multiples of the 128 block");
  check({"--fp8-param-gather"}, "--fp8-param-gather needs --fp8-format");
  check({"--fp8-format", "e4m3", "--fp8-param-gather"}, "only works with the distributed optimizer");
  EXPECT_EQ(validate_error({"--fp8-format", "e4m3", "--fp8-param-gather", "--use-distributed-optimizer"}), "");
  EXPECT_EQ(validate_error({"--fp8-format", "e4m3", "--fp8-recipe", "tensorwise", "--fp8-param-gather",
                            "--use-distributed-optimizer"}),
            "");
  EXPECT_EQ(validate_error({"--fp8-format", "e4m3", "--fp8-recipe", "blockwise", "--fp8-param-gather",
                            "--use-distributed-optimizer"}),
            "");
  check({"--fp8-format", "e4m3", "--fp8-param-gather", "--use-distributed-optimizer", "--cuda-graph-impl", "local",
         "--cuda-graph-scope", "full_iteration"},
        "--fp8-param-gather with --cuda-graph-impl local is not supported");
  check({"--fp8-format", "e4m3", "--fp8-amax-history-len", "0"}, "--fp8-amax-history-len must be at least 1");
  // a value outside the choices is a parse error naming the flag
  std::vector<const char*> argv = {"pretrain_gpt", "--fp8-format", "e5m2"};
  EXPECT_NE(error_of([&] { parse_args(int(argv.size()), argv.data(), "test"); }), "");
}

}  // namespace
}  // namespace megatron
