// tools/text_generation_server under mpirun with --tensor-model-parallel-size 2 (Note [Server ranks],
// Note [Tensor-parallel inference]) answers as the single-process server on the same checkpoint:
// the same greedy tokens on Megatron's /api and OpenAI's /v1/completions, their log-probabilities
// (prompt, generated, top-k) within kLogprobTolerance — tensor parallelism sums the row-parallel
// projections in another order (fp32: the two differ by ~1e-7) — the same seeded samples and the
// same beams. For the GPT-2 fixture (learned positions, GeLU, tied output) and the Llama one (RoPE,
// GQA with one query group per rank, SwiGLU, untied output), converted from HuggingFace (a TP 1
// checkpoint), and for a checkpoint saved by pretrain_gpt with TP 2. SIGTERM to rank 0 ends every
// rank with status 0; SIGTERM to mpirun ends the job (mpirun's status is then 1). tools/generate
// under mpirun prints what one process prints.
#include <nlohmann/json.hpp>

#include <chrono>
#include <sstream>
#include <thread>

#include "tests/core/parallel/parallel_util.h"
#include "tests/functional/server_util.h"

namespace megatron::testing {
namespace {

using nlohmann::json;

constexpr double kLogprobTolerance = 1e-5;

// The process of MPI rank `rank` among mpirun's children (OMPI_COMM_WORLD_RANK in its environment); -1 if none.
pid_t mpi_rank_pid(pid_t mpirun_pid, int rank) {
  const std::string want = "OMPI_COMM_WORLD_RANK=" + std::to_string(rank);
  for (const auto& entry : fs::directory_iterator("/proc")) {
    const std::string name = entry.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream stat(entry.path() / "stat");
    std::string line;
    std::getline(stat, line);
    const size_t close = line.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(line.substr(close + 2));
    std::string state;
    pid_t parent = 0;
    rest >> state >> parent;
    if (parent != mpirun_pid) continue;
    std::ifstream env(entry.path() / "environ", std::ios::binary);
    for (std::string var; std::getline(env, var, '\0');)
      if (var == want) return pid_t(std::stoi(name));
  }
  return -1;
}

// Whether `pid` runs (an ended process not yet reaped, a zombie, does not).
bool running(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return false;
  const size_t close = line.rfind(')');
  return close != std::string::npos && close + 2 < line.size() && line[close + 2] != 'Z';
}

// Whether `pid` has stopped running within `seconds`: mpirun can return while a signalled rank is
// still tearing down (on a loaded machine, for a moment), so "left running" means still running after that.
bool stops_within(pid_t pid, double seconds) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (running(pid)) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return true;
}

void expect_near_all(const json& got, const json& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    if (want[i].is_null()) {
      EXPECT_TRUE(got[i].is_null()) << what << " at " << i;
    } else {
      EXPECT_NEAR(got[i].get<double>(), want[i].get<double>(), kLogprobTolerance) << what << " at " << i;
    }
  }
}

// The single-process server and the two-rank tensor-parallel one on the same checkpoint.
struct ServerPair {
  ServerProcess one, tp;

  void start(const std::string& ckpt, const fs::path& dir, const std::vector<std::string>& tokenizer,
             const std::vector<std::string>& tp_flags) {
    one.start(ckpt, 0, dir / "one.log", {"--max-batch-size", "3"}, tokenizer);
    std::vector<std::string> flags = {"--max-batch-size", "3", "--tensor-model-parallel-size", "2"};
    flags.insert(flags.end(), tp_flags.begin(), tp_flags.end());
    tp.start(ckpt, 0, dir / "tp.log", flags, tokenizer, mpirun_command(2));
    ASSERT_TRUE(one.wait_healthy(60)) << one.output();
    ASSERT_TRUE(tp.wait_healthy(60)) << tp.output();
    EXPECT_NE(tp.output().find("tensor-parallel size 2"), std::string::npos) << tp.output();
  }

  // The same request to both; both must answer 200.
  std::pair<json, json> ask(const std::string& method, const std::string& path, const json& body) {
    auto send = [&](ServerProcess& s) {
      httplib::Client cli = s.client();
      auto r = method == "PUT" ? cli.Put(path, body.dump(), "application/json")
                               : cli.Post(path, body.dump(), "application/json");
      EXPECT_TRUE(r && r->status == 200) << path << ": " << (r ? r->body : "no response");
      return r && r->status == 200 ? json::parse(r->body) : json();
    };
    return {send(one), send(tp)};
  }

  // SIGTERM: the single server ends cleanly; so does the tensor-parallel one's rank 0, whose stop
  // ends the other rank's loop, so that mpirun (which forwards no signal here) exits with 0.
  void stop() {
    EXPECT_EQ(one.stop(), 0) << one.output();
    const pid_t rank0 = mpi_rank_pid(tp.pid, 0);
    ASSERT_GT(rank0, 0) << "no rank 0 under mpirun " << tp.pid;
    ::kill(rank0, SIGTERM);
    const int code = tp.wait_exit(30);
    EXPECT_EQ(code, 0) << tp.output();
    if (code == -1) tp.stop();
    EXPECT_NE(tp.output().find("shutting down"), std::string::npos) << tp.output();
  }
};

// Every endpoint's answers agree between the two servers.
void expect_same_answers(ServerPair& servers, const std::vector<std::string>& prompts) {
  {  // /api: greedy, with the log-probabilities of the prompt and generated tokens
    auto [one, tp] = servers.ask(
        "PUT", "/api", {{"prompts", prompts}, {"tokens_to_generate", 12}, {"temperature", 0}, {"logprobs", true}});
    EXPECT_EQ(tp["text"], one["text"]);
    EXPECT_EQ(tp["segments"], one["segments"]);
    for (size_t i = 0; i < prompts.size(); ++i)
      expect_near_all(tp["logprobs"][i], one["logprobs"][i], "/api logprobs of prompt " + std::to_string(i));
  }
  {  // /v1/completions: greedy with top-3 log-probabilities, prompt echoed with its own
    auto [one, tp] = servers.ask("POST", "/v1/completions",
                                 {{"prompt", prompts}, {"max_tokens", 10}, {"temperature", 0}, {"logprobs", 3},
                                  {"echo", true}});
    ASSERT_EQ(tp["choices"].size(), prompts.size());
    for (size_t i = 0; i < prompts.size(); ++i) {
      const json &a = one["choices"][i], &b = tp["choices"][i];
      EXPECT_EQ(b["text"], a["text"]);
      EXPECT_EQ(b["logprobs"]["tokens"], a["logprobs"]["tokens"]);
      expect_near_all(b["logprobs"]["token_logprobs"], a["logprobs"]["token_logprobs"], "/v1 token_logprobs");
      ASSERT_EQ(b["logprobs"]["top_logprobs"].size(), a["logprobs"]["top_logprobs"].size());
      for (size_t t = 0; t < a["logprobs"]["top_logprobs"].size(); ++t) {
        const json &ta = a["logprobs"]["top_logprobs"][t], &tb = b["logprobs"]["top_logprobs"][t];
        if (ta.is_null()) continue;
        for (const auto& [token, lp] : ta.items()) {
          ASSERT_TRUE(tb.contains(token)) << "top token " << token << " at " << t;
          EXPECT_NEAR(tb[token].get<double>(), lp.get<double>(), kLogprobTolerance);
        }
      }
    }
  }
  {  // seeded sampling: the same draws from the same distributions
    auto [one, tp] = servers.ask("POST", "/v1/completions",
                                 {{"prompt", prompts[0]}, {"max_tokens", 16}, {"temperature", 0.9}, {"top_p", 0.95},
                                  {"seed", 7}, {"n", 2}});
    ASSERT_EQ(tp["choices"].size(), 2u);
    for (size_t i = 0; i < 2; ++i) EXPECT_EQ(tp["choices"][i]["text"], one["choices"][i]["text"]);
  }
  {  // beam search: its own cache, its slot copies announced to the other rank
    auto [one, tp] = servers.ask("PUT", "/api", {{"prompts", {prompts[1]}}, {"tokens_to_generate", 6},
                                                 {"beam_width", 3}, {"length_penalty", 0.5}});
    EXPECT_EQ(tp["text"], one["text"]);
    expect_near_all(tp["scores"], one["scores"], "beam scores");
  }
}

class TensorParallelServer : public ::testing::TestWithParam<std::string> {};

TEST_P(TensorParallelServer, AnswersAsTheSingleProcessServer) {
  ::signal(SIGPIPE, SIG_IGN);
  const std::string model = GetParam();
  ScratchDir dir("text_generation_server_tp_" + model);
  const std::string ckpt = fixture_checkpoint(dir.path, model);
  const json cases = json::parse(read_file(fs::absolute(fixtures_dir()) / "generation.json")).at("models").at(model);
  std::vector<std::string> prompts;
  for (const json& c : cases) prompts.push_back(ids_text(c.at("prompt").get<std::vector<int64_t>>()));
  ServerPair servers;
  // As Megatron's server scripts launch it: training flags (matching the checkpoint, or meaningless
  // for inference, --sequence-parallel among them: inference runs without) are accepted.
  servers.start(ckpt, dir.path, {"--tokenizer-type", "NullTokenizer", "--vocab-size", "512"},
                {"--num-layers", "2", "--micro-batch-size", "4", "--global-batch-size", "8", "--sequence-parallel"});
  expect_same_answers(servers, prompts);
  // And the fixture's own greedy continuation (HuggingFace's).
  auto [one, tp] = servers.ask("PUT", "/api", {{"prompts", {prompts[0]}}, {"tokens_to_generate", 16}, {"temperature", 0}});
  EXPECT_EQ(tp["text"][0], prompts[0] + " " + ids_text(cases[0].at("greedy").get<std::vector<int64_t>>()));
  servers.stop();
}

INSTANTIATE_TEST_SUITE_P(Fixtures, TensorParallelServer, ::testing::Values("gpt2", "llama"),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

// Ctrl-C / SIGTERM to mpirun (which forwards it to every rank): rank 0 stops and tells the other
// rank to leave its loop; no rank is left running.
TEST(TensorParallelServerShutdown, SignalToMpirunEndsEveryRank) {
  ScratchDir dir("text_generation_server_tp_signal");
  ServerProcess tp;
  tp.start(fixture_checkpoint(dir.path, "gpt2"), 0, dir.path / "tp.log", {"--tensor-model-parallel-size", "2"},
           {"--tokenizer-type", "NullTokenizer", "--vocab-size", "512"}, mpirun_command(2));
  ASSERT_TRUE(tp.wait_healthy(60)) << tp.output();
  const pid_t ranks[] = {mpi_rank_pid(tp.pid, 0), mpi_rank_pid(tp.pid, 1)};
  ASSERT_GT(ranks[0], 0);
  ASSERT_GT(ranks[1], 0);
  ::kill(tp.pid, SIGTERM);
  EXPECT_NE(tp.wait_exit(30), -1) << tp.output();
  if (tp.pid > 0) tp.stop();
  for (pid_t r : ranks) EXPECT_TRUE(stops_within(r, 10)) << "rank process " << r << " is still running";
  EXPECT_NE(tp.output().find("shutting down"), std::string::npos) << tp.output();
}

// The built-in launcher, as for pretrain_gpt: --nproc-per-node 2 starts the ranks itself (on CPU
// through mpirun) and forwards SIGTERM to them.
TEST(TensorParallelServerShutdown, BuiltInLauncher) {
  ScratchDir dir("text_generation_server_tp_launcher");
  const json cases = json::parse(read_file(fs::absolute(fixtures_dir()) / "generation.json")).at("models").at("gpt2");
  ServerProcess tp;
  tp.start(fixture_checkpoint(dir.path, "gpt2"), 0, dir.path / "tp.log",
           {"--tensor-model-parallel-size", "2", "--nproc-per-node", "2"});
  ASSERT_TRUE(tp.wait_healthy(60)) << tp.output();
  const std::string prompt = ids_text(cases[0].at("prompt").get<std::vector<int64_t>>());
  auto r = tp.client().Put("/api", json{{"prompts", {prompt}}, {"tokens_to_generate", 16}, {"temperature", 0}}.dump(),
                           "application/json");
  ASSERT_TRUE(r && r->status == 200) << (r ? r->body : "no response");
  EXPECT_EQ(json::parse(r->body)["text"][0], prompt + " " + ids_text(cases[0].at("greedy").get<std::vector<int64_t>>()));
  ::kill(tp.pid, SIGTERM);
  const int code = tp.wait_exit(20);  // on CPU mpirun's status (1 when signalled); on GPU 0
  EXPECT_TRUE(code == 0 || code == 1) << code << "\n" << tp.output();
  if (code == -1) tp.stop();
  EXPECT_NE(tp.output().find("shutting down"), std::string::npos) << tp.output();
}

// tools/generate shares the path: on two ranks with TP 2 it prints what one process prints.
TEST(TensorParallelGenerate, PrintsWhatOneProcessPrints) {
  ScratchDir dir("generate_tp");
  const std::string ckpt = fixture_checkpoint(dir.path, "llama");
  const json cases = json::parse(read_file(fs::absolute(fixtures_dir()) / "generation.json")).at("models").at("llama");
  std::vector<std::string> args = {bin("generate"), "--load", ckpt, "--tokenizer-type", "NullTokenizer",
                                   "--vocab-size", "512", "--device", "cpu", "--greedy", "--max-new-tokens", "16"};
  for (const json& c : cases) {
    args.push_back("--prompt");
    args.push_back(ids_text(c.at("prompt").get<std::vector<int64_t>>()));
  }
  // The generated lines: each starts with its prompt.
  auto texts = [&](const std::string& output) {
    std::vector<std::string> out;
    std::istringstream in(output);
    for (std::string line; std::getline(in, line);) {
      for (const json& c : cases) {
        if (line.rfind(ids_text(c.at("prompt").get<std::vector<int64_t>>()) + " ", 0) == 0) {
          out.push_back(line);
          break;
        }
      }
    }
    return out;
  };
  RunResult one = run(args, dir.path, "OMP_NUM_THREADS=1");
  ASSERT_EQ(one.exit_code, 0) << one.output;
  std::vector<std::string> tp_args = mpirun_command(2);
  tp_args.insert(tp_args.end(), args.begin(), args.end());
  for (const char* a : {"--tensor-model-parallel-size", "2"}) tp_args.push_back(a);
  RunResult tp = run(tp_args, dir.path, "OMP_NUM_THREADS=1");
  ASSERT_EQ(tp.exit_code, 0) << tp.output;
  ASSERT_EQ(texts(one.output).size(), cases.size()) << one.output;
  EXPECT_EQ(texts(tp.output), texts(one.output)) << tp.output;
  EXPECT_EQ(texts(tp.output)[0], ids_text(cases[0].at("prompt").get<std::vector<int64_t>>()) + " " +
                                     ids_text(cases[0].at("greedy").get<std::vector<int64_t>>()));
}

// A checkpoint saved by a tensor-parallel training run (pretrain_gpt, TP 2, Llama-style) serves alike
// on one rank and on two.
TEST(TensorParallelServerCheckpoint, SavedWithTensorParallelism) {
  ::signal(SIGPIPE, SIG_IGN);
  ScratchDir dir("text_generation_server_tp_saved");
  std::vector<std::string> args = kLlama;
  for (const char* a : {"--tensor-model-parallel-size", "2", "--train-iters", "2", "--save", "ckpt",
                        "--save-interval", "2"})
    args.push_back(a);
  train(dir.path, "train", 2, args);
  ASSERT_TRUE(fs::exists(dir.path / "ckpt/latest_checkpointed_iteration.txt"));
  ServerPair servers;
  servers.start((dir.path / "ckpt").string(), dir.path, {"--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"},
                {});
  expect_same_answers(servers, {"5 17 300 2 41", "999 0 12", "7"});
  servers.stop();
}

}  // namespace
}  // namespace megatron::testing
