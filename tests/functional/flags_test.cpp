// pretrain_gpt with Megatron flags whose effect is seen end to end in one process:
//   - --decoupled-lr / --decoupled-min-lr: the word embeddings and the output layer follow their
//     own schedule: at 0 they keep their initial values while the decoder trains (checkpoints read
//     back), and equal to --lr / --min-lr the run is the run without the flags, bit for bit.
//   - Megatron's startup output (the layout line, the arguments block, the dataset target sizes,
//     the datetime lines) and --logging-level / MEGATRON_LOGGING_LEVEL: INFO log lines and our
//     warnings come and go with the level, print_rank_0 output stays; bad levels are one line.
#include <gtest/gtest.h>

#include <regex>
#include <sstream>

#include "tests/core/parallel/parallel_util.h"

namespace megatron::testing {
namespace {

const std::vector<std::string> kUntied = concat(kGpt, {"--untie-embeddings-and-output-weights", "--train-iters", "3"});

// The tensors of the latest checkpoint in `dir`.
std::map<std::string, std::vector<float>> checkpoint_tensors(const fs::path& dir) {
  std::string it = read_file(dir / "latest_checkpointed_iteration.txt");
  while (!it.empty() && std::isspace(static_cast<unsigned char>(it.back()))) it.pop_back();
  char name[32];
  std::snprintf(name, sizeof(name), "iter_%07d", std::stoi(it));
  dist_checkpointing::ShardIndex index((dir / name).string(), "model");
  std::map<std::string, std::vector<float>> out;
  for (const std::string& n : index.names()) {
    Tensor t = Tensor::empty(index.tensor(n).shape, DType::Float32);
    index.load_into(n, ShardSpec{}, t);
    out[n] = t.to_floats();
  }
  return out;
}

TEST(DecoupledLr, EmbeddingAndOutputFollowTheirOwnSchedule) {
  ScratchDir dir("decoupled_lr");
  // Everything frozen: the initial weights.
  train(dir.path, "frozen", 1, concat(kUntied, {"--lr", "0", "--min-lr", "0", "--save", (dir.path / "frozen").string()}));
  // The decoder trains at --lr; the embedding and output layer at a decoupled 0.
  const TrainRun zero = train(dir.path, "decoupled_zero", 1,
                              concat(kUntied, {"--decoupled-lr", "0", "--decoupled-min-lr", "0", "--save",
                                               (dir.path / "decoupled_zero").string()}));
  ASSERT_EQ(zero.losses.size(), 3u) << zero.output;
  const auto init = checkpoint_tensors(dir.path / "frozen"), trained = checkpoint_tensors(dir.path / "decoupled_zero");
  ASSERT_EQ(init.size(), trained.size());
  for (const auto& [name, values] : init) {
    const bool decoupled = name == "embedding.word_embeddings.weight" || name == "output_layer.weight";
    if (decoupled) {
      EXPECT_EQ(trained.at(name), values) << name << " moved at a decoupled learning rate of 0";
    } else if (name.find("linear_fc1.weight") != std::string::npos) {
      EXPECT_NE(trained.at(name), values) << name << " did not train at --lr";
    }
  }
  EXPECT_TRUE(init.count("output_layer.weight"));

  // A decoupled schedule equal to the default one changes nothing.
  const TrainRun plain = train(dir.path, "plain", 1, kUntied);
  const TrainRun same = train(dir.path, "decoupled_same", 1,
                              concat(kUntied, {"--decoupled-lr", "1e-3", "--decoupled-min-lr", "1e-4"}));
  ASSERT_EQ(plain.losses.size(), 3u) << plain.output;
  EXPECT_EQ(same.losses, plain.losses);
  EXPECT_EQ(same.grad_norms, plain.grad_norms);
  // A higher decoupled rate changes the later losses.
  const TrainRun high = train(dir.path, "decoupled_high", 1, concat(kUntied, {"--decoupled-lr", "1e-2"}));
  ASSERT_EQ(high.losses.size(), 3u) << high.output;
  EXPECT_EQ(high.losses[0], plain.losses[0]);
  EXPECT_NE(high.losses[2], plain.losses[2]);
}

// A short mock-data run: 3 iterations of 4 samples, evaluation every 2 iterations for 2 iterations.
std::vector<std::string> startup_run(const std::vector<std::string>& extra) {
  return concat({bin("pretrain_gpt"), "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                 "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
                 "--global-batch-size", "4", "--lr", "1e-3", "--vocab-size", "200", "--mock-data", "--log-interval", "1",
                 "--eval-iters", "2", "--eval-interval", "2", "--train-iters", "3", "--device", "cpu",
                 "--use-flash-attn"},
                extra);
}

std::vector<std::string> lines_of(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream in(s);
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

// The index of the first line equal to `line` (starting with it when `prefix`), or -1.
int find_line(const std::vector<std::string>& lines, const std::string& line, bool prefix = false) {
  for (size_t i = 0; i < lines.size(); ++i)
    if (prefix ? lines[i].rfind(line, 0) == 0 : lines[i] == line) return int(i);
  return -1;
}

TEST(StartupOutput, MegatronsLinesInMegatronsOrder) {
  ScratchDir dir("startup_output");
  const RunResult r = run(startup_run({"--calculate-per-token-loss", "--decoupled-lr", "2e-3"}), dir.path);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::vector<std::string> lines = lines_of(r.output);
  // Megatron's validate_args line and _print_args block.
  const int world = find_line(lines,
                              "using world size: 1, data-parallel size: 1, context-parallel size: 1, hierarchical "
                              "context-parallel sizes: None, tensor-model-parallel size: 1, pipeline-model-parallel size: 1");
  const int begin = find_line(lines, "------------------------ arguments ------------------------");
  const int end = find_line(lines, "-------------------- end of arguments ---------------------");
  ASSERT_GE(world, 0) << r.output;
  ASSERT_GT(begin, world) << r.output;
  ASSERT_GT(end, begin + 100) << r.output;
  const std::regex row(R"(  (\w+) (\.*) (.+))");
  std::map<std::string, std::string> values;
  std::string previous;
  for (int i = begin + 1; i < end; ++i) {
    std::smatch m;
    ASSERT_TRUE(std::regex_match(lines[size_t(i)], m, row)) << lines[size_t(i)];
    EXPECT_EQ(m[1].length() + m[2].length(), 48u) << "dots to column 48: " << lines[size_t(i)];
    std::string lower = lines[size_t(i)];
    std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return char(std::tolower(c)); });
    EXPECT_LE(previous, lower) << "sorted case-insensitively";
    previous = lower;
    values[m[1]] = m[3];
  }
  EXPECT_EQ(values["num_layers"], "2");
  EXPECT_EQ(values["lr"], "0.001");
  EXPECT_EQ(values["decoupled_lr"], "0.002");
  EXPECT_EQ(values["decoupled_min_lr"], "None");
  EXPECT_EQ(values["calculate_per_token_loss"], "True");
  EXPECT_EQ(values["grad_reduce_in_bf16"], "False");
  EXPECT_EQ(values["adam_eps"], "1e-08");
  EXPECT_EQ(values["clip_grad"], "1.0");
  EXPECT_EQ(values["moe_router_load_balancing_type"], "['aux_loss']");
  EXPECT_EQ(values["data_path"], "None");
  EXPECT_EQ(values["world_size"], "1");
  EXPECT_EQ(values.count("use_flash_attn"), 0u) << "accepted without effect: not ours, not listed";

  // The rest of the startup, in Megatron's order; the target sizes are get_train_valid_test_num_samples':
  // train 3·4, validation (3 // 2 + 1)·2·4, test 2·4.
  std::vector<std::pair<std::string, bool>> order = {
      {"INFO:megatron.core.num_microbatches_calculator:setting number of microbatches to constant 2", false},
      {"> building NullTokenizer tokenizer ...", false},
      {"> initialized tensor model parallel with size 1", false},
      {"> initialized pipeline model parallel with size 1", false},
      {"> setting random seeds to 1234 ...", false},
      {"time to initialize megatron (seconds): ", true},
      {"[after megatron is initialized] datetime: ", true},
      {"building GPT model ...", false},
      {"[after model, optimizer, and learning rate scheduler are built] datetime: ", true},
      {"> building train, validation, and test datasets ...", false},
      {" > datasets target sizes (minimum size):", false},
      {"    train:      12", false},
      {"    validation: 16", false},
      {"    test:       8", false},
      {"> building train, validation, and test datasets for GPT ...", false},
      {"> finished creating GPT datasets ...", false},
      {"[after dataloaders are built] datetime: ", true},
      {"done with setup ...", false},
      {"training ...", false},
      {"[before the start of training step] datetime: ", true},
  };
  int last = end;
  for (const auto& [line, prefix] : order) {
    const int at = find_line(lines, line, prefix);
    EXPECT_GT(at, last) << "'" << line << "' missing or out of order\n" << r.output;
    if (at > last) last = at;
  }
  // print_datetime's microseconds.
  const std::regex stamp(R"(\[after dataloaders are built\] datetime: \d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6} )");
  EXPECT_TRUE(std::regex_match(lines[size_t(find_line(lines, "[after dataloaders are built]", true))], stamp));
}

TEST(LoggingLevel, ControlsLogLinesAndWarnings) {
  ScratchDir dir("logging_level");
  const std::string info = "INFO:megatron.core.num_microbatches_calculator:", warning = "warning: --use-flash-attn";
  const std::string args_block = "------------------------ arguments ------------------------";
  auto check = [&](const std::vector<std::string>& flags, const std::string& env, bool want_info, bool want_warning) {
    SCOPED_TRACE(::testing::Message() << "env '" << env << "' flags " << ::testing::PrintToString(flags));
    const RunResult r = run(startup_run(flags), dir.path, env);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(r.output.find(info) != std::string::npos, want_info) << r.output;
    EXPECT_EQ(r.output.find(warning) != std::string::npos, want_warning) << r.output;
    // Megatron's print_rank_0 output is not logging: it stays at every level.
    EXPECT_NE(r.output.find(args_block), std::string::npos);
    EXPECT_EQ(field_values(r.output, "lm loss").size(), 3u);
  };
  check({}, "", true, true);                                 // default INFO
  check({"--logging-level", "10"}, "", true, true);          // DEBUG
  check({"--logging-level", "30"}, "", false, true);         // WARNING
  check({"--logging-level", "40"}, "", false, false);        // ERROR
  check({}, "MEGATRON_LOGGING_LEVEL=30", false, true);        // the environment, as Megatron's setup_logging
  check({"--logging-level", "20"}, "MEGATRON_LOGGING_LEVEL=50", true, true);  // the flag wins
  const RunResult set = run(startup_run({"--logging-level", "20"}), dir.path);
  EXPECT_NE(set.output.find("INFO:megatron.training.initialize:Setting logging level to 20"), std::string::npos)
      << set.output;

  // Bad levels: one line, non-zero exit.
  for (const auto& [flags, env, message] :
       std::vector<std::tuple<std::vector<std::string>, std::string, std::string>>{
           {{"--logging-level", "info"}, "", "--logging-level"},
           {{"--logging-level", "-5"}, "", "--logging-level must be a Python logging level >= 0"},
           {{}, "MEGATRON_LOGGING_LEVEL=verbose", "MEGATRON_LOGGING_LEVEL=verbose must be a Python logging level"}}) {
    const RunResult r = run(startup_run(flags), dir.path, env);
    EXPECT_NE(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find(message), std::string::npos) << r.output;
    std::string out = r.output;
    while (!out.empty() && out.back() == '\n') out.pop_back();
    EXPECT_EQ(out.find('\n'), std::string::npos) << "one line: " << r.output;
  }
}

}  // namespace
}  // namespace megatron::testing
