// Megatron's command line: flags, defaults, validation rules, the nearest-flag suggestion, and the
// iteration line's format.
#include "megatron/training/arguments.h"

#include <gtest/gtest.h>

#include <cstring>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>

#include "megatron/runtime/check.h"
#include "megatron/training/num_microbatches.h"
#include "megatron/training/training_log.h"
#include "tests/test_util.h"
#include "tests/training/parse_util.h"

namespace megatron {
namespace {

using testing::error_of;

using testing::parse;

std::vector<std::string> base() {
  return {"--num-layers",
          "2",
          "--hidden-size",
          "64",
          "--num-attention-heads",
          "4",
          "--seq-length",
          "32",
          "--micro-batch-size",
          "2",
          "--train-iters",
          "10",
          "--lr",
          "1e-3",
          "--mock-data",
          "--vocab-size",
          "100"};
}

TEST(Arguments, MegatronDefaults) {
  Arguments a = parse(base());
  validate_args(a);
  EXPECT_EQ(a.ffn_hidden_size, 256);
  EXPECT_EQ(a.num_query_groups, 4);
  EXPECT_EQ(a.max_position_embeddings, 32);
  EXPECT_EQ(a.global_batch_size, 2);
  EXPECT_EQ(a.make_vocab_size_divisible_by, 128);
  EXPECT_FLOAT_EQ(a.hidden_dropout, 0.1f);
  EXPECT_EQ(a.lr_decay_style, "linear");
  EXPECT_EQ(a.split, "1,1,1");  // mock data
  EXPECT_EQ(a.eval_interval, 1000);
  EXPECT_EQ(a.log_interval, 100);
  EXPECT_DOUBLE_EQ(a.start_weight_decay, 0.01);
}

TEST(Arguments, SwigluFfnSizeAndGqa) {
  auto f = base();
  for (const char* x : {"--swiglu", "--group-query-attention", "--num-query-groups", "2", "--hidden-size=4096",
                        "--num-attention-heads", "32"})
    f.push_back(x);
  Arguments a = parse(f);
  validate_args(a);
  EXPECT_EQ(a.ffn_hidden_size, 10880);  // int((4·4096·2/3)/64)·64, as Megatron
  EXPECT_EQ(a.num_query_groups, 2);
  TransformerConfig c = transformer_config_from_args(a, 32000);
  EXPECT_EQ(c.activation, "swiglu");
  EXPECT_EQ(c.padded_vocab_size, 32000);
}

TEST(Arguments, UnknownFlagNamesTheNearest) {
  auto f = base();
  f.push_back("--num-layer");
  f.push_back("3");
  std::string e = error_of([&] { parse(f); });
  EXPECT_NE(e.find("unknown flag --num-layer"), std::string::npos) << e;
  EXPECT_NE(e.find("did you mean --num-layers"), std::string::npos) << e;
  f = base();
  f.push_back("--hiden-size=8");
  e = error_of([&] { parse(f); });
  EXPECT_NE(e.find("did you mean --hidden-size"), std::string::npos) << e;
}

// Every unknown flag of a run in one line, each with a hint that does not mislead: a Megatron flag
// megatron.cpp does not implement says so (it is not "corrected" to another flag), a typo names
// the nearest flag, and a word close to no flag gets no suggestion.
TEST(Arguments, UnknownFlagsAreReportedAllAtOnce) {
  auto f = base();
  for (const char* x : {"--num-layer", "3", "--apply-wd-to-qk-layernorm", "--hiden-size=8", "--frobnicate-widgets", "2",
                        "--attention-output-gate"})
    f.push_back(x);
  const std::string e = error_of([&] { parse(f); });
  EXPECT_NE(e.find("5 unknown flags"), std::string::npos) << e;
  EXPECT_NE(e.find("--num-layer (did you mean --num-layers?)"), std::string::npos) << e;
  EXPECT_NE(e.find("--hiden-size (did you mean --hidden-size?)"), std::string::npos) << e;
  EXPECT_NE(e.find("--apply-wd-to-qk-layernorm (a Megatron flag that megatron.cpp does not support)"), std::string::npos)
      << e;
  EXPECT_NE(e.find("--attention-output-gate (a Megatron flag that megatron.cpp does not support)"), std::string::npos)
      << e;
  EXPECT_NE(e.find("--frobnicate-widgets (no similar flag)"), std::string::npos) << e;
  EXPECT_EQ(e.find("--overlap-param-gather"), std::string::npos) << "a misleading hint: " << e;
  EXPECT_EQ(e.find('\n'), std::string::npos) << e;
}

// Values that are given but wrong say what is wrong with them; "is required" is for a missing flag.
TEST(Arguments, BadValuesSayWhatIsWrongWithThem) {
  auto check = [](const std::string& flag, const std::string& value, const std::string& needle) {
    auto f = base();
    f.push_back(flag);
    f.push_back(value);
    const std::string e = error_of([&] {
      Arguments a = parse(f);
      validate_args(a);
    });
    EXPECT_NE(e.find(needle), std::string::npos) << flag << " " << value << ": " << e;
    EXPECT_EQ(e.find("is required"), std::string::npos) << flag << " " << value << ": " << e;
  };
  check("--num-layers", "-2", "--num-layers must be a positive integer, got -2");
  check("--hidden-size", "0", "--hidden-size must be a positive integer, got 0");
  check("--num-attention-heads", "0", "--num-attention-heads must be a positive integer, got 0");
  check("--micro-batch-size", "0", "--micro-batch-size must be a positive integer, got 0");
  check("--seq-length", "-1", "--seq-length must be a positive integer, got -1");
  check("--lr", "-1e-3", "--lr must be a finite number >= 0, got -0.001");
  check("--lr", "nan", "--lr must be a finite number >= 0, got nan");
  check("--min-lr", "inf", "--min-lr must be a finite number >= 0, got inf");
  check("--eval-iters", "-1", "--eval-iters must be an integer >= 0, got -1");
  check("--train-iters", "-5", "--train-iters must be an integer >= 0, got -5");
  // Missing ones are still "required".
  auto f = base();
  f.erase(f.begin(), f.begin() + 2);  // --num-layers 2
  const std::string e = error_of([&] {
    Arguments a = parse(f);
    validate_args(a);
  });
  EXPECT_NE(e.find("--num-layers is required"), std::string::npos) << e;
}

TEST(Arguments, SaveDirectoryIsCheckedAtStart) {
  const std::string file = ::testing::TempDir() + "/mg_save_is_a_file_" + std::to_string(::getpid());
  { std::ofstream(file) << "x"; }
  for (const std::string& save : {file + "/ckpt", std::string("/proc/mg-no-such-dir/ckpt")}) {
    auto f = base();
    f.push_back("--save");
    f.push_back(save);
    const std::string e = error_of([&] {
      Arguments a = parse(f);
      validate_args(a);
    });
    EXPECT_NE(e.find("--save"), std::string::npos) << e;
    EXPECT_NE(e.find(save), std::string::npos) << e;
    EXPECT_NE(e.find("writable"), std::string::npos) << e;
  }
  std::remove(file.c_str());
  const std::string ok = ::testing::TempDir() + "/mg_save_ok_" + std::to_string(::getpid()) + "/a/b";
  auto f = base();
  f.push_back("--save");
  f.push_back(ok);
  Arguments a = parse(f);
  EXPECT_NO_THROW(validate_args(a));
  std::filesystem::remove_all(::testing::TempDir() + "/mg_save_ok_" + std::to_string(::getpid()));
}

TEST(Arguments, AnOddWeightedDataPathIsOneLine) {
  auto f = base();
  f.erase(std::find(f.begin(), f.end(), "--mock-data"));
  for (const char* x : {"--data-path", "0.5", "D", "0.5"}) f.push_back(x);
  const std::string e = error_of([&] {
    Arguments a = parse(f);
    validate_args(a);
  });
  EXPECT_NE(e.find("--data-path"), std::string::npos) << e;
  EXPECT_NE(e.find("0.5 D 0.5"), std::string::npos) << e;
  EXPECT_NE(e.find("pairs"), std::string::npos) << e;
}

TEST(Arguments, UseCheckpointArgsNeedsLoad) {
  auto f = base();
  f.push_back("--use-checkpoint-args");
  const std::string e = error_of([&] {
    Arguments a = parse(f);
    validate_args(a);
  });
  EXPECT_NE(e.find("--use-checkpoint-args"), std::string::npos) << e;
  EXPECT_NE(e.find("--load"), std::string::npos) << e;
}

TEST(Arguments, InvalidCombinationsSayWhichRuleFailed) {
  auto check = [](std::vector<std::string> extra, const std::string& needle) {
    auto f = base();
    f.insert(f.end(), extra.begin(), extra.end());
    std::string e = error_of([&] {
      Arguments a = parse(f);
      validate_args(a);
    });
    EXPECT_NE(e.find(needle), std::string::npos) << "got: " << e;
  };
  check({"--global-batch-size", "3"}, "--global-batch-size (3) must be divisible by --micro-batch-size (2)");
  check({"--bf16", "--fp16"}, "--bf16 and --fp16");
  check({"--train-samples", "100"}, "exactly one of --train-iters and --train-samples");
  check({"--tensor-model-parallel-size", "2"}, "world size (1) is not divisible");
  check({"--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "3"}, "--lr-warmup-fraction and --lr-warmup-iters");
  check({"--max-position-embeddings", "16"}, "--max-position-embeddings (16) must be at least --seq-length (32)");
  check({"--recompute-granularity", "full"}, "--recompute-method");
  check({"--start-weight-decay", "0.1"}, "--weight-decay-incr-style");
  check({"--normalization", "BatchNorm"}, "bad command line");
  check({"--rampup-batch-size", "2", "2", "100"}, "sample-based training");
}

// RoPE scaling: Llama 3's (--use-rope-scaling) and YaRN's (--position-embedding-type yarn with
// Megatron's yarn flags) reach TransformerConfig; --rope-type is Megatron's multi-latent attention
// choice, so yarn there is refused with the flag to use instead.
TEST(Arguments, RopeScalingFlags) {
  auto with = [](std::vector<std::string> extra) {
    auto f = base();
    f.insert(f.end(), extra.begin(), extra.end());
    Arguments a = parse(f);
    validate_args(a);
    return a;
  };
  Arguments a = with({"--position-embedding-type", "rope", "--use-rope-scaling", "--rope-scaling-factor", "32"});
  TransformerConfig c = transformer_config_from_args(a, 100);
  EXPECT_TRUE(c.rope_scaling);
  EXPECT_EQ(c.rope_scaling_factor, 32.0f);
  EXPECT_FALSE(c.use_yarn());
  EXPECT_EQ(with({"--use-rotary-position-embeddings", "--use-rope-scaling"}).rope_scaling_factor, 8.0f);

  a = with({"--position-embedding-type", "yarn", "--rotary-scaling-factor", "4",
            "--yarn-original-max-position-embeddings", "64", "--yarn-beta-fast", "16", "--yarn-beta-slow", "2",
            "--mscale", "0.707", "--mscale-all-dim", "1", "--no-yarn-correction-range-round-to-int", "--rope-type",
            "rope"});
  c = transformer_config_from_args(a, 100);
  EXPECT_TRUE(c.use_rope() && c.use_yarn());
  EXPECT_EQ(c.yarn_rotary_scaling_factor, 4.0f);
  EXPECT_EQ(c.yarn_original_max_position_embeddings, 64);
  EXPECT_EQ(c.yarn_beta_fast, 16.0f);
  EXPECT_EQ(c.yarn_beta_slow, 2.0f);
  EXPECT_EQ(c.yarn_mscale, 0.707f);
  EXPECT_EQ(c.yarn_mscale_all_dim, 1.0f);
  EXPECT_FALSE(c.yarn_correction_range_round_to_int);
  c = transformer_config_from_args(with({"--position-embedding-type", "yarn", "--yarn-correction-range-round-to-int"}),
                                   100);
  EXPECT_TRUE(c.yarn_correction_range_round_to_int);
  EXPECT_EQ(c.yarn_original_max_position_embeddings, 4096);  // Megatron's YarnRotaryEmbedding defaults
  EXPECT_EQ(c.yarn_rotary_scaling_factor, 1.0f);

  auto refused = [&](std::vector<std::string> extra, const std::string& needle) {
    const std::string e = error_of([&] {
      Arguments r = with(extra);
      transformer_config_from_args(r, 100);
    });
    EXPECT_NE(e.find(needle), std::string::npos) << "got: " << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << "one line: " << e;
  };
  refused({"--position-embedding-type", "rope", "--rope-type", "yarn"},
          "--rope-type yarn is Megatron's choice for multi-latent attention; standard attention takes only rope: for "
          "YaRN give --position-embedding-type yarn");
  refused({"--rope-type", "ntk"}, "--rope-type: ntk not in {rope,yarn}");
  refused({"--position-embedding-type", "alibi"}, "--position-embedding-type: alibi not in");
  refused({"--use-rope-scaling"},
          "--use-rope-scaling (Llama 3's RoPE scaling) needs --position-embedding-type rope "
          "(got learned_absolute)");
  refused({"--position-embedding-type", "yarn", "--rotary-percent", "0.5"}, "drop --rotary-percent 0.5");
}

// Megatron's CUDA-graph flags: the full-iteration graph and what it refuses, each with its rule.
TEST(Arguments, CudaGraphFlags) {
  auto f = base();
  for (const char* x : {"--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration"}) f.push_back(x);
  Arguments a = parse(f);
  validate_args(a);
  EXPECT_EQ(a.cuda_graph_impl, "local");
  EXPECT_EQ(a.cuda_graph_warmup_steps, 3);  // Megatron's default

  auto check = [&](std::vector<std::string> extra, const std::string& needle, int world_size = 1) {
    auto g = base();
    g.insert(g.end(), extra.begin(), extra.end());
    std::string e = error_of([&] {
      Arguments b = parse(g);
      b.world_size = world_size;
      validate_args(b);
    });
    EXPECT_NE(e.find(needle), std::string::npos) << "got: " << e;
  };
  const std::vector<std::string> graph = {"--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration"};
  auto plus = [&](std::vector<std::string> extra) {
    std::vector<std::string> v = graph;
    v.insert(v.end(), extra.begin(), extra.end());
    return v;
  };
  check({"--cuda-graph-impl", "local"}, "give --cuda-graph-scope full_iteration");
  check({"--enable-cuda-graph"}, "give --cuda-graph-scope full_iteration");
  check({"--cuda-graph-impl", "local", "--cuda-graph-scope", "attn"}, "per-layer scopes are not built");
  check({"--external-cuda-graph"}, "needs TransformerEngine");
  check({"--cuda-graph-scope", "full_iteration"}, "--cuda-graph-scope needs --cuda-graph-impl local");
  check(plus({"--device", "cpu"}), "CUDA graphs need a GPU");
  check(plus({"--cuda-graph-warmup-steps", "0"}), "--cuda-graph-warmup-steps must be at least 1");
  check(plus({"--tensor-model-parallel-size", "2"}), "does not capture tensor, pipeline or context parallelism", 2);
  check(plus({"--pipeline-model-parallel-size", "2"}), "does not capture tensor, pipeline or context parallelism", 2);
  check(plus({"--overlap-grad-reduce"}), "--overlap-grad-reduce would launch the gradient reduction");
}

// --deterministic-mode over NCCL needs NCCL_ALGO, as in Megatron; one process or MPI does not.
TEST(Arguments, DeterministicModeAsksNcclForAFixedAlgorithm) {
  auto f = base();
  f.push_back("--deterministic-mode");
  Arguments a = parse(f);
  validate_args(a);
  EXPECT_TRUE(a.deterministic_mode);
  ::unsetenv("NCCL_ALGO");
  EXPECT_EQ(error_of([&] { check_deterministic_nccl(a, false); }), "");
  const std::string e = error_of([&] { check_deterministic_nccl(a, true); });
  EXPECT_NE(e.find("needs NCCL_ALGO set to one of Tree, Ring"), std::string::npos) << e;
  ::setenv("NCCL_ALGO", "Ring", 1);
  EXPECT_EQ(error_of([&] { check_deterministic_nccl(a, true); }), "");
  ::unsetenv("NCCL_ALGO");
  a.deterministic_mode = false;
  EXPECT_EQ(error_of([&] { check_deterministic_nccl(a, true); }), "");
}

// The parallel layout's rules, for a world of 8 ranks (the launcher's world size).
TEST(Arguments, ParallelLayoutRules) {
  auto check = [](std::vector<std::string> extra, const std::string& needle) {
    auto f = base();
    f.insert(f.end(), extra.begin(), extra.end());
    std::string e = error_of([&] {  // the arguments' rules, then the model config's (as pretrain_gpt)
      Arguments a = parse(f);
      a.world_size = 8;
      validate_args(a);
      transformer_config_from_args(a, 1000);
    });
    EXPECT_NE(e.find(needle), std::string::npos) << "got: " << e;
  };
  check({"--tensor-model-parallel-size", "3"}, "world size (8) is not divisible by tensor (3)");
  check({"--tensor-model-parallel-size", "8", "--sequence-parallel", "--seq-length", "36",
         "--max-position-embeddings", "36"},
        "--seq-length (36) must be divisible by --tensor-model-parallel-size (8)");
  check({"--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"},
        "must be divisible by --pipeline-model-parallel-size (2) x --num-layers-per-virtual-pipeline-stage (3)");
  check({"--overlap-param-gather"}, "--overlap-param-gather needs --use-distributed-optimizer");
  check({"--num-layers-per-virtual-pipeline-stage", "1"}, "needs --pipeline-model-parallel-size > 1");
  // Mixture of experts: the bad inputs Megatron refuses, one line each.
  check({"--num-experts", "4", "--moe-router-topk", "6"}, "--moe-router-topk (6) must be between 1 and --num-experts (4)");
  check({"--num-experts", "6", "--expert-model-parallel-size", "4"},
        "--num-experts (6) must be divisible by --expert-model-parallel-size (4)");
  check({"--num-experts", "8", "--expert-model-parallel-size", "3"},
        "world size (8) is not divisible by expert tensor (1) x expert model (3) x pipeline (1) parallel size");
  check({"--num-experts", "8", "--moe-expert-capacity-factor", "0"}, "--moe-expert-capacity-factor must be a positive");
  check({"--num-experts", "8", "--moe-expert-capacity-factor", "-1.5"}, "--moe-expert-capacity-factor must be a positive");
  check({"--num-experts", "8", "--moe-token-dispatcher-type", "deepep"}, "--moe-token-dispatcher-type");
  check({"--expert-model-parallel-size", "2"}, "--expert-model-parallel-size 2 needs --num-experts");
  check({"--num-experts", "8", "--tensor-model-parallel-size", "2"}, "MoE with tensor parallelism needs --sequence-parallel");
}

// A list flag given twice keeps its last occurrence (argparse's nargs='+'), the MoE flags parse
// into the config, and --help shows their group.
TEST(Arguments, MoeFlagsAndRepeatedListFlags) {
  auto f = base();
  for (const char* x : {"--num-experts", "8", "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff",
                        "1e-2", "--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss", "--moe-aux-loss-coeff",
                        "1e-3", "2e-3", "--moe-layer-freq", "([0]+[1]*1)", "--moe-expert-capacity-factor", "1.5"}) {
    f.push_back(x);
  }
  Arguments a = parse(f);
  EXPECT_EQ(a.moe_router_load_balancing_type, (std::vector<std::string>{"aux_loss", "seq_aux_loss"}));
  EXPECT_EQ(a.moe_aux_loss_coeff, (std::vector<float>{1e-3f, 2e-3f}));
  a.world_size = 1;
  validate_args(a);
  const TransformerConfig c = transformer_config_from_args(a, 100);
  EXPECT_EQ(c.num_moe_experts, 8);
  EXPECT_EQ(c.moe_expert_capacity_factor, 1.5f);
  EXPECT_EQ(c.moe_layer_pattern, (std::vector<int>{0, 1}));
  EXPECT_EQ(model_arguments_from_config(c).moe_expert_capacity_factor, "1.5");
}

TEST(Arguments, HelpListsGroups) {
  const char* argv[] = {"pretrain_gpt", "--help"};
  ::testing::internal::CaptureStdout();
  auto a = parse_args(2, argv, "test");
  std::string out = ::testing::internal::GetCapturedStdout();
  EXPECT_FALSE(a.has_value());
  for (const char* g : {"Model", "Parallelism", "Data", "Checkpoints", "Logging", "--num-layers", "--data-path",
                        "Mixture of experts:", "--moe-router-topk"}) {
    EXPECT_NE(out.find(g), std::string::npos) << g;
  }
}

// Every flag of Megatron's parser at the reference commit (megatron_flags.inc) is ours or refused:
// --help ends with the refused ones, each given one is one line, and the flags that would change
// what a user gets (FSDP sharding, W&B logging) say what to use instead.
TEST(Arguments, MegatronFlagsAreOursOrRefused) {
  const char* argv[] = {"pretrain_gpt", "--help"};
  ::testing::internal::CaptureStdout();
  EXPECT_FALSE(parse_args(2, argv, "test").has_value());
  const std::string out = ::testing::internal::GetCapturedStdout();
  const size_t footer = out.find("Megatron-LM flags megatron.cpp does not implement (");
  ASSERT_NE(footer, std::string::npos) << out;
  const std::string refused = out.substr(footer);
  for (const char* f : {"--use-torch-fsdp2", "--wandb-project", "--cache-mla-latents", "--attention-output-gate"})
    EXPECT_NE(refused.find(std::string(" ") + f), std::string::npos) << f;
  for (const char* f : {" --num-layers ", " --moe-router-topk ", " --log-world-size-to-tensorboard ",
                        " --calculate-per-token-loss ", " --decoupled-lr ", " --decoupled-min-lr ", " --grad-reduce-in-bf16 ",
                        " --logging-level "})
    EXPECT_TRUE(refused.find(f) == std::string::npos &&
                refused.find(std::string(f).substr(0, std::strlen(f) - 1) + "\n") == std::string::npos)
        << f << " is ours";
  auto refusal = [](const std::vector<std::string>& extra) {
    auto f = base();
    f.insert(f.end(), extra.begin(), extra.end());
    return error_of([&] { parse(f); });
  };
  std::string e = refusal({"--use-torch-fsdp2"});
  EXPECT_NE(e.find("--use-torch-fsdp2 (not supported: shard the optimizer state with --use-distributed-optimizer)"),
            std::string::npos)
      << e;
  e = refusal({"--wandb-project", "p", "--wandb-exp-name", "x"});
  EXPECT_NE(e.find("--wandb-project (not supported: Weights & Biases"), std::string::npos) << e;
  EXPECT_NE(e.find("--wandb-exp-name (not supported: Weights & Biases"), std::string::npos) << e;
  e = refusal({"--cache-mla-latents"});
  EXPECT_NE(e.find("--cache-mla-latents (a Megatron flag that megatron.cpp does not support)"), std::string::npos) << e;
  EXPECT_EQ(e.find('\n'), std::string::npos) << e;
}

// The flags of per-token loss, decoupled learning rates, bf16 reduction and the logging level:
// parsed into their fields; impossible values and combinations are one line naming the flag.
TEST(Arguments, PerTokenDecoupledBf16ReduceAndLoggingFlags) {
  auto f = base();
  for (const char* x : {"--calculate-per-token-loss", "--decoupled-lr", "3e-4", "--decoupled-min-lr", "3e-5",
                        "--grad-reduce-in-bf16", "--bf16", "--logging-level", "30"})
    f.push_back(x);
  Arguments a = parse(f);
  validate_args(a);
  EXPECT_TRUE(a.calculate_per_token_loss);
  EXPECT_EQ(a.decoupled_lr, 3e-4);
  EXPECT_EQ(a.decoupled_min_lr, 3e-5);
  EXPECT_TRUE(a.grad_reduce_in_bf16);
  EXPECT_EQ(a.logging_level, 30);
  EXPECT_TRUE(transformer_config_from_args(a, 1000).calculate_per_token_loss);
  auto error = [](const std::vector<std::string>& extra) {
    auto g = base();
    g.insert(g.end(), extra.begin(), extra.end());
    return error_of([&] {
      Arguments b = parse(g);
      validate_args(b);
    });
  };
  EXPECT_NE(error({"--grad-reduce-in-bf16"}).find("--grad-reduce-in-bf16 needs --bf16"), std::string::npos);
  EXPECT_NE(error({"--grad-reduce-in-bf16", "--fp16"}).find("which is fp16 here"), std::string::npos);
  EXPECT_NE(error({"--decoupled-lr", "-1"}).find("--decoupled-lr must be a finite number >= 0, got -1"), std::string::npos);
  EXPECT_NE(error({"--decoupled-min-lr", "nan"}).find("--decoupled-min-lr must be a finite number >= 0"), std::string::npos);
  EXPECT_NE(error({"--logging-level", "-2"}).find("--logging-level must be a Python logging level >= 0"), std::string::npos);
  EXPECT_NE(error({"--logging-level", "warning"}).find("--logging-level"), std::string::npos);
}

// Megatron's --empty-unused-memory-level (0..2), --no-position-embedding (rope only, as Megatron),
// --cross-entropy-loss-fusion (ours is fused: accepted).
TEST(Arguments, MemoryLevelPositionEmbeddingAndFusionFlags) {
  auto f = base();
  for (const char* x : {"--empty-unused-memory-level", "2", "--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl",
                        "native", "--position-embedding-type", "rope", "--no-position-embedding"})
    f.push_back(x);
  Arguments a = parse(f);
  validate_args(a);
  EXPECT_EQ(a.empty_unused_memory_level, 2);
  f = base();
  f.push_back("--empty-unused-memory-level");
  f.push_back("3");
  EXPECT_NE(error_of([&] { parse(f); }).find("--empty-unused-memory-level"), std::string::npos);
  f = base();
  f.push_back("--no-position-embedding");
  const std::string e = error_of([&] {
    Arguments b = parse(f);
    validate_args(b);
  });
  EXPECT_NE(e.find("--no-position-embedding is deprecated, use --position-embedding-type"), std::string::npos) << e;
}

TEST(Arguments, TensorBoardScalarFlags) {
  Arguments a = parse(base());
  EXPECT_TRUE(a.log_loss_scale_to_tensorboard);
  EXPECT_FALSE(a.log_world_size_to_tensorboard);
  auto f = base();
  f.push_back("--no-log-loss-scale-to-tensorboard");
  f.push_back("--log-world-size-to-tensorboard");
  a = parse(f);
  EXPECT_FALSE(a.log_loss_scale_to_tensorboard);
  EXPECT_TRUE(a.log_world_size_to_tensorboard);
}

TEST(TrainingLog, IterationLineHasMegatronsFormat) {
  IterationLogFields f;
  f.iteration = 10;
  f.train_iters = 100;
  f.consumed_samples = 160;
  f.elapsed_ms_per_iteration = 123.456;
  f.learning_rate = 3e-4;
  f.global_batch_size = 16;
  f.losses = {{"lm loss", 5.4321}};
  f.loss_scale = 1.0;
  f.grad_norm = 1.2345;
  std::string line = format_iteration_line(f);
  std::regex re(
      R"(^ \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}\] iteration       10/     100 \| consumed samples:          160 \| )"
      R"(elapsed time per iteration \(ms\): 123\.5 \| learning rate: 3\.000000E-04 \| global batch size:    16 \| )"
      R"(lm loss: 5\.432100E\+00 \| loss scale: 1\.0 \| grad norm: 1\.234 \| number of skipped iterations:   0 \| )"
      R"(number of nan iterations:   0 \|$)");
  EXPECT_TRUE(std::regex_match(line, re)) << line;
  EXPECT_EQ(format_validation_block("iteration 10", {{"lm loss", 2.0}}),
            std::string(94, '-') +
                "\n validation loss at iteration 10 | lm loss value: 2.000000E+00 | lm loss PPL: "
                "7.389056E+00 | \n" +
                std::string(94, '-'));
}

TEST(TrainingLog, FlopsFollowMegatronsFormula) {
  Arguments a = parse(base());
  validate_args(a);
  // 24·B·s·L·h² (1 + s/(6h)... ): check against a hand expansion of the causal formula.
  const double B = 2, s = 32, h = 64, L = 2, V = 128, f = 256;
  const double expected = B * s * (3 * 2 * h * f * 2 * L + L * 3 * 2 * (h * 3 * h + h * s + h * h) + 3 * 2 * h * V);
  EXPECT_DOUBLE_EQ(num_floating_point_operations(a, 128, 2), expected);
  // Megatron's MTP terms: one more layer per depth, its norms and eh_proj, one more logit pass.
  a.mtp_num_layers = 2;
  const double D = 2;
  const double with_mtp = B * s *
                          (3 * 2 * h * f * 2 * (L + D) + (L + D) * 3 * 2 * (h * 3 * h + h * s + h * h) +
                           3 * 2 * D * (3 * h + 2 * h * h) + 3 * 2 * h * V * (1 + D));
  EXPECT_DOUBLE_EQ(num_floating_point_operations(a, 128, 2), with_mtp);
}

TEST(NumMicroBatches, RampupFollowsMegatron) {
  NumMicroBatchesCalculator c(16, 2, 1, {4, 4, 96});
  EXPECT_EQ(c.current_global_batch_size(), 4);
  EXPECT_EQ(c.num_microbatches(), 2);
  c.update(32);  // 3 increments over 96 samples: one per 32
  EXPECT_EQ(c.current_global_batch_size(), 8);
  c.update(200);
  EXPECT_EQ(c.current_global_batch_size(), 16);
  EXPECT_EQ(c.num_microbatches(), 8);
}

}  // namespace
}  // namespace megatron

namespace megatron {
namespace {
// The weight-and-optimizer estimate of a Mixtral-8x7B layout counts the experts over expert-TP ×
// EP and their optimizer state over the expert-data ranks. The expected figures are Megatron's own
// compute_weight_and_optimizer_memory (theoretical_memory_usage.py at the reference commit) run on
// the same arguments.
TEST(TheoreticalMemory, CountsExpertsOverTheirOwnParallelism) {
  auto estimate = [](std::vector<std::string> extra) {
    std::vector<std::string> f = {"--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32",
                                  "--group-query-attention", "--num-query-groups", "8", "--ffn-hidden-size", "14336",
                                  "--swiglu", "--normalization", "RMSNorm", "--untie-embeddings-and-output-weights",
                                  "--disable-bias-linear", "--num-experts", "8", "--moe-router-topk", "2",
                                  "--moe-ffn-hidden-size", "14336", "--tensor-model-parallel-size", "2",
                                  "--sequence-parallel", "--pipeline-model-parallel-size", "4", "--seq-length", "4096",
                                  "--max-position-embeddings", "4096", "--micro-batch-size", "1", "--train-iters", "1",
                                  "--lr", "1e-4", "--mock-data", "--vocab-size", "32000"};
    f.insert(f.end(), extra.begin(), extra.end());
    Arguments a = testing::parse(f);
    a.world_size = 64;
    validate_args(a);
    return theoretical_memory(a, 32000, 1).weight_and_optimizer_mb;
  };
  EXPECT_NEAR(estimate({"--expert-model-parallel-size", "8", "--expert-tensor-parallel-size", "1",
                        "--use-distributed-optimizer"}),
              17799.10107421875, 0.01);
  EXPECT_NEAR(estimate({"--expert-model-parallel-size", "8", "--expert-tensor-parallel-size", "1"}), 28202.642578125,
              0.01);
  EXPECT_NEAR(estimate({"--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "2",
                        "--use-distributed-optimizer", "--moe-layer-freq", "([0]+[1]*31)",
                        "--moe-shared-expert-intermediate-size", "2048", "--moe-shared-expert-gate"}),
              18150.26953125, 0.01);
}
}  // namespace
}  // namespace megatron
