// End-to-end runs of build/bin/pretrain_gpt on the CPU: the loss falls on real text, every exit
// condition, TensorBoard files that TensorBoard reads, and bad input.
#include <nlohmann/json.hpp>

#include <sstream>

#include "tests/functional/run_util.h"

namespace megatron::testing {
namespace {

TEST(Train, LossFallsOnRealText) {
  ScratchDir dir("loss_falls");
  RunResult r = run(concat({bin("pretrain_gpt")}, tiny_gpt_flags(60)), dir.path);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::vector<std::string> losses = field_values(r.output, "lm loss");
  ASSERT_EQ(losses.size(), 60u) << r.output;
  const double first = std::stod(losses.front()), last = std::stod(losses.back());
  EXPECT_GT(first, 6.5) << "a fresh model's loss is about log(vocab) = 6.9";
  EXPECT_LT(last, first - 0.8) << "the loss should fall on real text: " << losses.front() << " -> " << losses.back();
  EXPECT_NE(r.output.find("validation loss at iteration 60 on validation set"), std::string::npos);
  EXPECT_NE(r.output.find("Theoretical memory footprints: weight and optimizer="), std::string::npos);
}

// A small Mixtral-style model on real text: the loss falls, the load-balancing loss stays near its
// balanced value of 1, and --moe-per-layer-logging prints each MoE layer's tokens per expert, which
// stay balanced (no expert gets more than 3x the mean) with the aux loss on.
TEST(Train, MixtralStyleMoELossFallsWithBalancedExperts) {
  ScratchDir dir("moe_loss_falls");
  std::vector<std::string> flags = tiny_gpt_flags(60);
  for (const char* f : {"--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64",
                        "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3", "--moe-per-layer-logging",
                        "--moe-token-dispatcher-type", "alltoall", "--swiglu", "--disable-bias-linear",
                        "--normalization", "RMSNorm", "--position-embedding-type", "rope",
                        "--untie-embeddings-and-output-weights", "--log-interval", "10", "--tensorboard-dir", "tb"}) {
    flags.push_back(f);
  }
  RunResult r = run(concat({bin("pretrain_gpt")}, flags), dir.path);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::vector<std::string> losses = field_values(r.output, "lm loss"), lb = field_values(r.output, "load_balancing_loss");
  ASSERT_EQ(losses.size(), 6u) << r.output;
  ASSERT_EQ(lb.size(), 6u) << r.output;
  EXPECT_LT(std::stod(losses.back()), std::stod(losses.front()) - 0.5) << losses.front() << " -> " << losses.back();
  for (const std::string& v : lb) {
    EXPECT_GT(std::stod(v), 0.99) << "the switch loss is at least 1 (its balanced value)";
    EXPECT_LT(std::stod(v), 1.5) << "the aux loss keeps the experts balanced";
  }
  int lines = 0;
  for (size_t at = r.output.find(" tokens per expert:"); at != std::string::npos;
       at = r.output.find(" tokens per expert:", at + 1)) {
    const size_t open = r.output.find("(max/mean ", at);
    ASSERT_NE(open, std::string::npos) << r.output;
    EXPECT_LT(std::stod(r.output.substr(open + 10)), 3.0) << r.output.substr(at, 120);
    ++lines;
  }
  EXPECT_EQ(lines, 2 * 6) << "two MoE layers, six log lines";
  std::printf("moe: lm loss %s -> %s, load_balancing_loss %s -> %s\n", losses.front().c_str(), losses.back().c_str(),
              lb.front().c_str(), lb.back().c_str());
}

// Multi-token prediction on real text (--mtp-num-layers 1): Megatron's "mtp_1 loss" in every
// iteration line after the lm loss, falling with it; TensorBoard gets it under that name each
// iteration; evaluation reports the lm loss only.
TEST(Train, MultiTokenPredictionLossIsLoggedAndFalls) {
  ScratchDir dir("mtp_loss_falls");
  RunResult r = run(concat({bin("pretrain_gpt")}, concat(tiny_gpt_flags(40), {"--mtp-num-layers", "1", "--log-interval",
                                                                              "5", "--tensorboard-dir", "tb",
                                                                              "--eval-interval", "20"})),
                    dir.path);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::vector<std::string> lm = field_values(r.output, "lm loss"), mtp = field_values(r.output, "mtp_1 loss");
  ASSERT_EQ(lm.size(), 8u) << r.output;
  ASSERT_EQ(mtp.size(), 8u) << r.output;
  EXPECT_NE(r.output.find("| lm loss: "), std::string::npos);
  EXPECT_LT(r.output.find("| lm loss: "), r.output.find("| mtp_1 loss: "));
  EXPECT_LT(std::stod(mtp.back()), std::stod(mtp.front()) - 0.5) << mtp.front() << " -> " << mtp.back();
  EXPECT_NE(mtp.back(), lm.back()) << "the MTP loss scores another target than the lm loss";
  const size_t validation = r.output.find("validation loss at iteration 20");
  ASSERT_NE(validation, std::string::npos) << r.output;
  const std::string block = r.output.substr(validation, r.output.find('\n', validation) - validation);
  EXPECT_EQ(block.find("mtp"), std::string::npos) << block;
  const std::string script =
      "from tensorboard.backend.event_processing.event_accumulator import EventAccumulator\n"
      "ea = EventAccumulator('tb'); ea.Reload()\n"
      "print('STEPS', len(ea.Scalars('mtp_1 loss')))\n";
  std::ofstream(dir.path / "read_tb.py") << script;
  RunResult py = run({"python3", "read_tb.py"}, dir.path);
  ASSERT_EQ(py.exit_code, 0) << py.output;
  EXPECT_NE(py.output.find("STEPS 40"), std::string::npos) << py.output;
  std::printf("mtp: lm loss %s -> %s, mtp_1 loss %s -> %s\n", lm.front().c_str(), lm.back().c_str(),
              mtp.front().c_str(), mtp.back().c_str());
}

TEST(Train, ExitInterval) {
  ScratchDir dir("exit_interval");
  RunResult r =
      run(concat({bin("pretrain_gpt")},
                 concat(tiny_gpt_flags(20), {"--exit-interval", "4", "--save", "ckpt", "--save-interval", "100"})),
          dir.path);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(field_values(r.output, "lm loss").size(), 4u);
  EXPECT_NE(r.output.find("exiting program at iteration 4"), std::string::npos) << r.output;
  EXPECT_EQ(read_file(dir.path / "ckpt/latest_checkpointed_iteration.txt"), "4");
}

TEST(Train, ExitDuration) {
  ScratchDir dir("exit_duration");
  RunResult r =
      run(concat({bin("pretrain_gpt")}, concat(tiny_gpt_flags(20), {"--exit-duration-in-mins", "0.00001"})), dir.path);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(field_values(r.output, "lm loss").size(), 1u);
  EXPECT_NE(r.output.find("exiting program after"), std::string::npos) << r.output;
}

TEST(Train, SigtermSavesThenExits) {
  ScratchDir dir("sigterm");
  const fs::path log = dir.path / "log.txt";
  std::vector<std::string> argv =
      concat({bin("pretrain_gpt")},
             concat(tiny_gpt_flags(100000), {"--exit-signal-handler", "--save", "ckpt", "--save-interval", "100000"}));
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    if (chdir(dir.path.c_str()) != 0) _exit(127);
    FILE* f = freopen(log.c_str(), "w", stdout);
    (void)f;
    dup2(fileno(stdout), 2);
    std::vector<char*> cargv;
    for (auto& a : argv) cargv.push_back(a.data());
    cargv.push_back(nullptr);
    execv(cargv[0], cargv.data());
    _exit(127);
  }
  // Wait until a few iterations have run, then send SIGTERM.
  for (int i = 0; i < 600 && field_values(read_file(log), "lm loss").size() < 3; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  kill(pid, SIGTERM);
  int status = 0;
  waitpid(pid, &status, 0);
  const std::string out = read_file(log);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << out;
  EXPECT_NE(out.find("exiting program after receiving SIGTERM"), std::string::npos) << out;
  const std::string latest = read_file(dir.path / "ckpt/latest_checkpointed_iteration.txt");
  ASSERT_FALSE(latest.empty());
  EXPECT_EQ(std::to_string(field_values(out, "lm loss").size()), latest);
}

TEST(Train, TensorBoardEventsAreReadByTensorBoard) {
  ScratchDir dir("tensorboard");
  RunResult r =
      run(concat({bin("pretrain_gpt")}, concat(tiny_gpt_flags(6), {"--tensorboard-dir", "tb", "--eval-interval", "3",
                                                                   "--log-memory-to-tensorboard"})),
          dir.path);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string script =
      "from tensorboard.backend.event_processing.event_accumulator import EventAccumulator\n"
      "ea = EventAccumulator('tb'); ea.Reload()\n"
      "tags = ea.Tags()['scalars']\n"
      "for t in ['lm loss', 'learning-rate', 'grad-norm', 'batch-size', 'lm loss validation', "
      "'mem-allocated-bytes', 'loss-scale']:\n"
      "    assert t in tags, (t, tags)\n"
      "ev = ea.Scalars('lm loss')\n"
      "assert [e.step for e in ev] == [1, 2, 3, 4, 5, 6], [e.step for e in ev]\n"
      "print('LOSSES', ' '.join('%.6E' % e.value for e in ev))\n";
  std::ofstream(dir.path / "read_tb.py") << script;
  RunResult py = run({"python3", "read_tb.py"}, dir.path);
  ASSERT_EQ(py.exit_code, 0) << "the tensorboard package must be installed (scripts/setup): " << py.output;
  // The values TensorBoard read are the printed losses (stored as float32).
  std::vector<std::string> printed = field_values(r.output, "lm loss");
  std::istringstream in(py.output.substr(py.output.find("LOSSES") + 7));
  for (const std::string& p : printed) {
    std::string v;
    in >> v;
    EXPECT_NEAR(std::stod(v), std::stod(p), 1e-5 * std::stod(p));
  }
}

// Note [TensorBoard values]: with --tensorboard-log-interval 2 and --log-interval 3, TensorBoard
// gets each even iteration's own loss (the per-iteration values MEGATRON_LOSS_LOG records), not the
// printed 3-iteration averages; --log-timers-to-tensorboard adds the printed timers as "<name>-time";
// --log-world-size-to-tensorboard adds world-size, --no-log-loss-scale-to-tensorboard drops loss-scale.
TEST(Train, TensorBoardTakesEachIntervalsOwnIterationValues) {
  ScratchDir dir("tensorboard_interval");
  const fs::path log = dir.path / "losses.jsonl";
  RunResult r = run(concat({bin("pretrain_gpt")},
                           concat(tiny_gpt_flags(6), {"--tensorboard-dir", "tb", "--tensorboard-log-interval", "2",
                                                      "--log-interval", "3", "--log-timers-to-tensorboard",
                                                      "--timing-log-level", "2", "--log-memory-to-tensorboard",
                                                      "--log-world-size-to-tensorboard",
                                                      "--no-log-loss-scale-to-tensorboard"})),
                    dir.path, "MEGATRON_LOSS_LOG=" + shell_quote(log.string()));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::vector<double> per_iteration;
  std::ifstream in(log);
  for (std::string line; std::getline(in, line);) {
    per_iteration.push_back(nlohmann::json::parse(line).at("lm_loss").get<double>());
  }
  ASSERT_EQ(per_iteration.size(), 6u);
  const std::string script =
      "from tensorboard.backend.event_processing.event_accumulator import EventAccumulator\n"
      "ea = EventAccumulator('tb'); ea.Reload()\n"
      "tags = ea.Tags()['scalars']\n"
      "for t in ['forward-backward-time', 'optimizer-time', 'mem-allocated-count', 'mem-reserved-bytes', "
      "'iteration-time', 'world-size']:\n"
      "    assert t in tags, (t, tags)\n"
      "assert 'loss-scale' not in tags, tags\n"
      "assert [e.value for e in ea.Scalars('world-size')] == [1.0, 1.0, 1.0]\n"
      "r, a = ea.Scalars('mem-reserved-bytes'), ea.Scalars('mem-allocated-bytes')\n"
      "assert all(x.value >= y.value > 0 for x, y in zip(r, a)), (r, a)\n"
      "print('STEPS', ' '.join(str(e.step) for e in ea.Scalars('lm loss')))\n"
      "print('TIMESTEPS', ' '.join(str(e.step) for e in ea.Scalars('iteration-time')))\n"
      "print('LOSSES', ' '.join('%.9E' % e.value for e in ea.Scalars('lm loss')))\n";
  std::ofstream(dir.path / "read_tb.py") << script;
  RunResult py = run({"python3", "read_tb.py"}, dir.path);
  ASSERT_EQ(py.exit_code, 0) << py.output;
  EXPECT_NE(py.output.find("STEPS 2 4 6"), std::string::npos) << py.output;
  EXPECT_NE(py.output.find("TIMESTEPS 3 6"), std::string::npos) << py.output;
  std::istringstream values(py.output.substr(py.output.find("LOSSES") + 7));
  for (size_t i : {1u, 3u, 5u}) {  // iterations 2, 4, 6: their own losses, stored as float32
    std::string v;
    values >> v;
    EXPECT_NEAR(std::stod(v), per_iteration[i], 1e-6 * per_iteration[i]) << "iteration " << i + 1;
  }
}

// Packed documents on real text (--reset-attention-mask, --reset-position-ids, --eod-mask-loss):
// attention within documents, the loss falls; a tokenizer without an end-of-document token is one line.
TEST(Train, PackedDocumentsTrainOnRealText) {
  ScratchDir dir("packed");
  RunResult r = run(concat(concat({bin("pretrain_gpt")}, tiny_gpt_flags(40)),
                           {"--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"}),
                    dir.path);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::vector<std::string> losses = field_values(r.output, "lm loss");
  ASSERT_EQ(losses.size(), 40u) << r.output;
  EXPECT_LT(std::stod(losses.back()), std::stod(losses.front()) - 0.5) << losses.front() << " -> " << losses.back();

  const fs::path tok = dir.path / "tok-no-eos";
  fs::create_directories(tok);
  const fs::path src = fs::path(data_fixtures_dir()) / "tok-gpt2";
  fs::copy_file(src / "vocab.json", tok / "vocab.json");
  fs::copy_file(src / "merges.txt", tok / "merges.txt");
  std::ofstream(tok / "tokenizer_config.json")
      << R"({"tokenizer_class": "GPT2Tokenizer", "eos_token": null, "bos_token": null, "unk_token": null})";
  RunResult bad = run({bin("pretrain_gpt"), "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
                       "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1",
                       "--lr", "1e-3", "--mock-data", "--device", "cpu", "--tokenizer-type", "HuggingFaceTokenizer",
                       "--tokenizer-model", tok.string(), "--reset-attention-mask"},
                      dir.path);
  EXPECT_NE(bad.exit_code, 0) << bad.output;
  EXPECT_NE(bad.output.find("--reset-attention-mask finds documents by their end-of-document token"),
            std::string::npos)
      << bad.output;
}

// --eval-iters 0 is Megatron's ordinary way to turn evaluation off; with --data-path and the default
// split it ended with "no sample to load: the dataset is empty".
TEST(Train, EvalItersZeroTurnsEvaluationOff) {
  ScratchDir dir("eval_iters_0");
  std::vector<std::string> flags;
  const std::vector<std::string> tiny = tiny_gpt_flags(3);
  for (size_t i = 0; i < tiny.size(); ++i) {
    if (tiny[i] == "--split") {
      ++i;  // the default split, 969,30,1
      continue;
    }
    flags.push_back(tiny[i]);
  }
  for (size_t i = 0; i + 1 < flags.size(); ++i) {
    if (flags[i] == "--eval-iters") flags[i + 1] = "0";
    if (flags[i] == "--eval-interval") flags[i + 1] = "1";
  }
  RunResult r = run(concat({bin("pretrain_gpt")}, flags), dir.path);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(field_values(r.output, "lm loss").size(), 3u) << r.output;
  EXPECT_EQ(r.output.find("validation loss"), std::string::npos) << r.output;
}

// --profile: iterations [start, end) bracketed; the op table names the model's ops and its shares
// add up to the profiled wall time (the ops' times plus the gaps between them).
TEST(Train, ProfilePrintsWhereTheTimeWent) {
  ScratchDir dir("profile");
  RunResult r = run(concat({bin("pretrain_gpt")},
                           concat(tiny_gpt_flags(5), {"--profile", "--profile-step-start", "1", "--profile-step-end", "3"})),
                    dir.path);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const size_t at = r.output.find(" > profile of rank 0, iterations 2 to 3 (");
  ASSERT_NE(at, std::string::npos) << r.output;
  std::istringstream table(r.output.substr(at));
  std::string line;
  std::getline(table, line);  // the heading
  std::getline(table, line);  // the columns
  double share = 0;
  bool linear = false, adam = false;
  while (std::getline(table, line) && line.rfind("(iteration, wall)", 0) != 0) {
    linear |= line.rfind("linear_forward ", 0) == 0;
    adam |= line.rfind("adamw_step ", 0) == 0;
    const size_t pct = line.find('%');
    ASSERT_NE(pct, std::string::npos) << line;
    share += std::stod(line.substr(line.rfind(' ', pct - 1) + 1, pct));
  }
  EXPECT_TRUE(linear && adam) << r.output.substr(at);
  EXPECT_NEAR(share, 100.0, 1.0) << r.output.substr(at);
  RunResult bad = run(concat({bin("pretrain_gpt")},
                             concat(tiny_gpt_flags(2), {"--profile", "--profile-step-start", "3", "--profile-step-end", "3"})),
                      dir.path);
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("--profile needs 0 <= --profile-step-start < --profile-step-end"), std::string::npos)
      << bad.output;
}

TEST(Cli, BadInputGivesOneClearLine) {
  ScratchDir dir("cli");
  auto expect_error = [&](std::vector<std::string> flags, const std::string& needle) {
    RunResult r = run(concat({bin("pretrain_gpt")}, flags), dir.path);
    EXPECT_NE(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find(needle), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("terminate called"), std::string::npos) << r.output;
  };
  expect_error(concat(tiny_gpt_flags(2), {"--num-layer", "3"}), "did you mean --num-layers");
  expect_error(concat(tiny_gpt_flags(2), {"--global-batch-size", "6"}), "must be divisible by --micro-batch-size");
  auto flags = tiny_gpt_flags(2);
  for (auto& f : flags)
    if (f.find("shakespeare_spm_text_document") != std::string::npos) f = "/nonexistent/corpus_text_document";
  expect_error(flags, "/nonexistent/corpus_text_document");
  flags = tiny_gpt_flags(2);
  for (auto& f : flags)
    if (f.find("tok-spm.model") != std::string::npos) f = "/nonexistent/tok.model";
  expect_error(flags, "/nonexistent/tok.model");
  // What the MTP block does not support is refused at start, naming the flag.
  expect_error(concat(tiny_gpt_flags(2), {"--mtp-num-layers", "-1"}), "--mtp-num-layers must be a positive number");
  expect_error(concat(tiny_gpt_flags(2), {"--mtp-num-layers", "1", "--reset-attention-mask", "--micro-batch-size", "1"}),
               "--mtp-num-layers with --reset-attention-mask is not supported");
  RunResult help = run({bin("pretrain_gpt"), "--help"}, dir.path);
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_NE(help.output.find("Parallelism"), std::string::npos);
}

}  // namespace
}  // namespace megatron::testing
