// tools/text_generation_server's OpenAI surface and Megatron's /api fields, end to end: the gpt2
// fixture served with a byte-level HuggingFace tokenizer folder that carries a chat template
// (server_util.h: byte_level_tokenizer). Chat answers equal completions of the rendered prompt,
// streamed or not; n, best_of, echo + logprobs, stream_options.include_usage, /v1/models; /api's
// stop_on_eol, no_log; and, through $MEGATRON_PYTHON (default python3), the official openai client
// (tests/functional/openai_client_check.py) and lm-eval-harness's local-completions model
// (tests/functional/lm_eval_check.py), each skipped with a message when the package is missing.
#include <nlohmann/json.hpp>

#include "tests/functional/server_util.h"

namespace megatron::testing {
namespace {

using nlohmann::json;

// "user:hi\nassistant:" for one user message: short, since the fixture has 64 positions.
const char* kTemplate =
    "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}";

class OpenAIServer : public ::testing::Test {
 protected:
  static inline std::unique_ptr<ScratchDir> dir;
  static inline ServerProcess server;
  static inline std::string ckpt, tokenizer;

  static void SetUpTestSuite() {
    ::signal(SIGPIPE, SIG_IGN);
    dir = std::make_unique<ScratchDir>("text_generation_server_openai");
    ckpt = gpt2_checkpoint(dir->path);
    tokenizer = byte_level_tokenizer(dir->path / "tok", kTemplate);
    server.start(ckpt, 0, dir->path / "server.log", {"--max-batch-size", "4", "--inference-flask-server-logging"},
                 {"--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tokenizer});
    ASSERT_TRUE(server.wait_healthy()) << "the server did not come up:\n" << server.output();
  }

  static void TearDownTestSuite() {
    EXPECT_EQ(server.stop(), 0) << server.output();
    dir.reset();
  }

  static json post(const std::string& path, const json& body) {
    auto r = server.client().Post(path, body.dump(), "application/json");
    EXPECT_TRUE(r && r->status == 200) << path << " " << body.dump() << " -> " << (r ? r->body : "no response");
    return r && r->status == 200 ? json::parse(r->body) : json::object();
  }

  // The data: events of a streamed reply, [DONE] excluded (checked to be last).
  static std::vector<json> events(const std::string& path, const json& body) {
    auto r = server.client().Post(path, body.dump(), "application/json");
    EXPECT_TRUE(r && r->status == 200) << (r ? r->body : "no response");
    std::vector<json> out;
    if (!r) return out;
    bool done = false;
    for (size_t pos = 0; pos < r->body.size();) {
      const size_t end = r->body.find("\n\n", pos);
      EXPECT_NE(end, std::string::npos) << r->body;
      if (end == std::string::npos) break;
      const std::string e = r->body.substr(pos, end - pos);
      pos = end + 2;
      EXPECT_FALSE(done) << "an event after [DONE]";
      if (e == "data: [DONE]") {
        done = true;
        continue;
      }
      out.push_back(json::parse(e.substr(6)));
    }
    EXPECT_TRUE(done) << r->body;
    return out;
  }

  static int run_python(const std::string& script, const std::vector<std::string>& args, std::string& output) {
    const char* py = std::getenv("MEGATRON_PYTHON");
    std::vector<std::string> argv = {py && *py ? py : "python3",
                                     (fs::path(MEGATRON_SOURCE_DIR) / "tests/functional" / script).string()};
    argv.insert(argv.end(), args.begin(), args.end());
    RunResult r = run(argv, dir->path);
    output = r.output;
    return r.exit_code;
  }
};

TEST_F(OpenAIServer, ModelsListsTheServedModel) {
  auto r = server.client().Get("/v1/models");
  ASSERT_TRUE(r && r->status == 200);
  json m = json::parse(r->body);
  EXPECT_EQ(m["object"], "list");
  ASSERT_EQ(m["data"].size(), 1u);
  EXPECT_EQ(m["data"][0]["id"], ckpt);
  EXPECT_EQ(m["data"][0]["object"], "model");
}

TEST_F(OpenAIServer, ChatIsACompletionOfTheRenderedPromptStreamedOrNot) {
  const json messages = {{{"role", "system"}, {"content", "be"}}, {{"role", "user"}, {"content", "hi"}}};
  json chat = post("/v1/chat/completions", {{"messages", messages}, {"max_tokens", 12}, {"temperature", 0}});
  json cmpl = post("/v1/completions", {{"prompt", "system:be\nuser:hi\nassistant:"}, {"max_tokens", 12}, {"temperature", 0}});
  EXPECT_EQ(chat["object"], "chat.completion");
  EXPECT_EQ(chat["id"].get<std::string>().rfind("chatcmpl-", 0), 0u);
  ASSERT_EQ(chat["choices"].size(), 1u);
  EXPECT_EQ(chat["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(chat["choices"][0]["message"]["content"], cmpl["choices"][0]["text"]);
  EXPECT_EQ(chat["choices"][0]["finish_reason"], cmpl["choices"][0]["finish_reason"]);
  EXPECT_EQ(chat["usage"]["prompt_tokens"], 28);  // "system:be\nuser:hi\nassistant:", one byte a token
  EXPECT_EQ(chat["usage"], cmpl["usage"]);

  std::vector<json> chunks = events("/v1/chat/completions", {{"messages", messages},
                                                             {"max_tokens", 12},
                                                             {"temperature", 0},
                                                             {"stream", true},
                                                             {"stream_options", {{"include_usage", true}}}});
  ASSERT_GE(chunks.size(), 3u);
  EXPECT_EQ(chunks[0]["object"], "chat.completion.chunk");
  EXPECT_EQ(chunks[0]["choices"][0]["delta"]["role"], "assistant");
  std::string content, finish;
  for (size_t i = 0; i + 1 < chunks.size(); ++i) {
    ASSERT_EQ(chunks[i]["choices"].size(), 1u) << chunks[i].dump();
    EXPECT_TRUE(chunks[i].contains("usage") && chunks[i]["usage"].is_null()) << chunks[i].dump();
    const json& d = chunks[i]["choices"][0]["delta"];
    if (d.contains("content")) content += d["content"].get<std::string>();
    if (!chunks[i]["choices"][0]["finish_reason"].is_null()) finish = chunks[i]["choices"][0]["finish_reason"];
  }
  EXPECT_EQ(content, chat["choices"][0]["message"]["content"]);
  EXPECT_EQ(finish, chat["choices"][0]["finish_reason"]);
  EXPECT_TRUE(chunks.back()["choices"].empty()) << chunks.back().dump();
  EXPECT_EQ(chunks.back()["usage"], chat["usage"]);

  // Completions stream their usage the same way; without stream_options no chunk carries usage.
  std::vector<json> plain = events("/v1/completions", {{"prompt", "u:hi\na:"}, {"max_tokens", 4}, {"stream", true}});
  for (const json& c : plain) EXPECT_FALSE(c.contains("usage")) << c.dump();
}

TEST_F(OpenAIServer, NChoicesAreSeedsAndBestOfKeepsTheLikeliest) {
  const json base = {{"prompt", "u:hi\na:"}, {"max_tokens", 8}, {"temperature", 1.0}, {"seed", 5}, {"logprobs", 0}};
  std::vector<std::string> alone;
  std::vector<double> score;
  for (int j = 0; j < 3; ++j) {
    json one = base;
    one["seed"] = 5 + j;
    json r = post("/v1/completions", one);
    alone.push_back(r["choices"][0]["text"]);
    double s = 0;
    for (const json& x : r["choices"][0]["logprobs"]["token_logprobs"]) s += x.get<double>();
    score.push_back(s);
  }
  json n3 = base;
  n3["n"] = 3;
  json r = post("/v1/completions", n3);
  ASSERT_EQ(r["choices"].size(), 3u);
  for (int j = 0; j < 3; ++j) {
    EXPECT_EQ(r["choices"][j]["index"], j);
    EXPECT_EQ(r["choices"][j]["text"], alone[size_t(j)]) << "choice " << j << " is sample seed + " << j;
  }
  EXPECT_EQ(r["usage"]["prompt_tokens"], 7);
  json best = base;
  best["best_of"] = 3;
  r = post("/v1/completions", best);
  ASSERT_EQ(r["choices"].size(), 1u);
  const size_t top = size_t(std::max_element(score.begin(), score.end()) - score.begin());
  EXPECT_EQ(r["choices"][0]["text"], alone[top]);
  // Two prompts, n = 2: indices prompt * n + k.
  json two = base;
  two["prompt"] = {"u:hi\na:", "u:yo\na:"};
  two["n"] = 2;
  r = post("/v1/completions", two);
  ASSERT_EQ(r["choices"].size(), 4u);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(r["choices"][i]["index"], i);
  EXPECT_EQ(r["choices"][0]["text"], alone[0]);
  EXPECT_EQ(r["choices"][1]["text"], alone[1]);
}

// lm-eval-harness's loglikelihood request: echo, logprobs, max_tokens 0 (or 1).
TEST_F(OpenAIServer, EchoWithLogprobsScoresThePrompt) {
  const std::string prompt = "The cat sat on the mat.";
  json r = post("/v1/completions",
                {{"prompt", prompt}, {"echo", true}, {"logprobs", 2}, {"max_tokens", 0}, {"temperature", 0}});
  const json& c = r["choices"][0];
  EXPECT_EQ(c["text"], prompt);
  const json& lp = c["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), prompt.size());  // one byte a token
  std::string joined;
  for (const json& t : lp["tokens"]) joined += t.get<std::string>();
  EXPECT_EQ(joined, prompt);
  EXPECT_TRUE(lp["token_logprobs"][0].is_null());
  EXPECT_TRUE(lp["top_logprobs"][0].is_null());
  EXPECT_EQ(lp["text_offset"][5], 5);
  // The same values as Megatron's /api prompt logprobs.
  auto api = server.client().Put("/api", json{{"prompts", {prompt}}, {"tokens_to_generate", 0}, {"logprobs", true},
                                              {"no_log", true}}.dump(),
                                 "application/json");
  ASSERT_TRUE(api && api->status == 200) << (api ? api->body : "");
  const json ref = json::parse(api->body)["logprobs"][0];
  ASSERT_EQ(ref.size(), prompt.size() - 1);
  for (size_t i = 1; i < prompt.size(); ++i) {
    const double v = lp["token_logprobs"][i];
    EXPECT_NEAR(v, ref[i - 1].get<double>(), 1e-9);
    const json& top = lp["top_logprobs"][i];
    ASSERT_TRUE(top.is_object() && top.size() >= 1 && top.size() <= 2) << top.dump();
    double best = -1e300;
    for (const auto& [tok, x] : top.items()) best = std::max(best, x.get<double>());
    EXPECT_GE(best, v - 1e-12) << "the top entry is at least as likely as the actual token";
  }
}

TEST_F(OpenAIServer, MegatronStopOnEolAndNoLog) {
  // Greedy with and without stop_on_eol: the stopped text is the plain one cut after its first newline.
  const json body = {{"prompts", {"u:hi\na:"}}, {"tokens_to_generate", 40}, {"temperature", 0}};
  auto plain = server.client().Put("/api", body.dump(), "application/json");
  json eol = body;
  eol["stop_on_eol"] = true;
  eol["no_log"] = true;
  auto stopped = server.client().Put("/api", eol.dump(), "application/json");
  ASSERT_TRUE(plain && plain->status == 200 && stopped && stopped->status == 200);
  const std::string full = json::parse(plain->body)["text"][0], cut = json::parse(stopped->body)["text"][0];
  const size_t nl = full.find('\n', 7);
  EXPECT_EQ(cut, nl == std::string::npos ? full : full.substr(0, nl + (full.compare(nl, 2, "\n\n") == 0 ? 2 : 1)));
  // --inference-flask-server-logging logs the first request, not the one with no_log.
  const std::string log = server.output();
  EXPECT_NE(log.find("\"tokens_to_generate\":40}"), std::string::npos) << log;
  EXPECT_EQ(log.find("\"stop_on_eol\":true"), std::string::npos) << log;
  EXPECT_NE(log.find("start time: "), std::string::npos) << log;
  // An empty prompt with add_BOS is Megatron's BOS (the eod token) alone.
  auto bos = server.client().Put(
      "/api", json{{"prompts", {""}}, {"add_BOS", true}, {"tokens_to_generate", 3}, {"temperature", 0}}.dump(),
      "application/json");
  ASSERT_TRUE(bos && bos->status == 200) << (bos ? bos->body : "");
  EXPECT_EQ(json::parse(bos->body)["segments"][0][0], "<|endoftext|>");
  EXPECT_GE(json::parse(bos->body)["segments"][0].size(), 2u);  // then 1 to 3 generated (eod stops)
  // prevent_newline_after_colon: sampled text never has ":\n" after the prompt.
  for (int seed = 0; seed < 8; ++seed) {
    auto colon = server.client().Put("/api",
                                     json{{"prompts", {"a:b:c:"}},
                                          {"tokens_to_generate", 24},
                                          {"temperature", 1.0},
                                          {"random_seed", seed},
                                          {"prevent_newline_after_colon", true}}
                                         .dump(),
                                     "application/json");
    ASSERT_TRUE(colon && colon->status == 200) << (colon ? colon->body : "");
    const std::string text = json::parse(colon->body)["text"][0];
    EXPECT_EQ(text.find(":\n", 5), std::string::npos) << text;
  }
  // Megatron's error shape: status 400, {"message": ...}.
  auto bad = server.client().Put("/api", R"({"prompts": "hi"})", "application/json");
  ASSERT_TRUE(bad);
  EXPECT_EQ(bad->status, 400);
  EXPECT_EQ(json::parse(bad->body), json({{"message", "prompts is not a list of strings"}}));
}

TEST_F(OpenAIServer, OfficialOpenAIClient) {
  std::string out;
  if (run_python("openai_client_check.py", {"--probe"}, out) != 0)
    GTEST_SKIP() << "the openai package is not importable by $MEGATRON_PYTHON (pip install openai): " << out;
  EXPECT_EQ(run_python("openai_client_check.py",
                       {"--base-url", "http://127.0.0.1:" + std::to_string(server.port) + "/v1", "--model", ckpt}, out),
            0)
      << out;
  std::printf("%s", out.c_str());
}

TEST_F(OpenAIServer, LmEvalLocalCompletionsMatchesOurOwnScores) {
  std::string out;
  if (run_python("lm_eval_check.py", {"--probe"}, out) != 0)
    GTEST_SKIP() << "lm_eval with its API extras and transformers is not importable by $MEGATRON_PYTHON (pip install \"lm_eval[api]\"): " << out;
  EXPECT_EQ(run_python("lm_eval_check.py",
                       {"--base-url", "http://127.0.0.1:" + std::to_string(server.port), "--model", ckpt,
                        "--tokenizer", tokenizer, "--workdir", (dir->path / "lm_eval").string()},
                       out),
            0)
      << out;
  std::printf("%s", out.c_str());
}

}  // namespace
}  // namespace megatron::testing
