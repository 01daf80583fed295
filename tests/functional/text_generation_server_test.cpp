// tools/text_generation_server end to end: the gpt2 fixture converted with convert_checkpoint,
// served with a NullTokenizer (prompts are space-separated ids, so the fixture prompts are exact),
// queried over HTTP: Megatron's PUT /api and OpenAI's /v1/completions (plain and streamed) give the
// fixture's greedy continuations (beam search of width 1 too), concurrent clients all get theirs,
// bad requests get a 400 with a JSON error, and a client that hangs up mid-stream leaves the
// server serving; the server's pretrain_gpt flags are checked against the checkpoint.
#include <nlohmann/json.hpp>

#include "tests/functional/server_util.h"

namespace megatron::testing {
namespace {

using nlohmann::json;

class TextGenerationServer : public ::testing::Test {
 protected:
  static inline std::unique_ptr<ScratchDir> dir;
  static inline ServerProcess server;
  static inline int port = 0;
  static inline json cases;

  static void SetUpTestSuite() {
    ::signal(SIGPIPE, SIG_IGN);
    dir = std::make_unique<ScratchDir>("text_generation_server");
    cases = json::parse(read_file(fs::absolute(fixtures_dir()) / "generation.json")).at("models").at("gpt2");
    server.start(gpt2_checkpoint(dir->path), 0, dir->path / "server.log", {"--max-batch-size", "3"});
    ASSERT_TRUE(server.wait_healthy()) << "the server did not come up:\n" << server.output();
    port = server.port;
  }

  static void TearDownTestSuite() {
    EXPECT_EQ(server.stop(), 0) << server.output();
    dir.reset();
  }

  httplib::Client client() const { return server.client(); }
  std::string prompt(size_t i) const { return ids_text(cases[i].at("prompt").get<std::vector<int64_t>>()); }
  std::string greedy(size_t i) const { return ids_text(cases[i].at("greedy").get<std::vector<int64_t>>()); }

  json complete(const json& body) const {
    auto r = client().Post("/v1/completions", body.dump(), "application/json");
    EXPECT_TRUE(r && r->status == 200) << (r ? r->body : "no response");
    return r ? json::parse(r->body) : json();
  }
};

TEST_F(TextGenerationServer, MegatronApiGivesTheFixtureGreedyContinuation) {
  json body = {{"prompts", {prompt(0), prompt(1), prompt(2)}},
               {"tokens_to_generate", 16},
               {"temperature", 0},
               {"logprobs", true}};
  auto r = client().Put("/api", body.dump(), "application/json");
  ASSERT_TRUE(r && r->status == 200) << (r ? r->body : "no response");
  json out = json::parse(r->body);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(out["text"][i], prompt(i) + " " + greedy(i));
    const size_t n = cases[i]["prompt"].size();
    EXPECT_EQ(out["segments"][i].size(), n + 16);
    std::vector<double> lp = out["logprobs"][i], ref = cases[i]["logprobs"];
    ASSERT_EQ(lp.size(), n - 1 + 16);
    for (size_t t = 0; t < 16; ++t) EXPECT_NEAR(lp[n - 1 + t], ref[t], 1e-4);
  }
}

// Megatron's beam_width: width 1 is the greedy continuation; wider, the beams best first.
TEST_F(TextGenerationServer, MegatronBeamSearch) {
  auto one = client().Put("/api", json{{"prompts", {prompt(0)}}, {"tokens_to_generate", 8}, {"beam_width", 1}}.dump(),
                          "application/json");
  ASSERT_TRUE(one && one->status == 200) << (one ? one->body : "no response");
  json out = json::parse(one->body);
  std::vector<int64_t> greedy8(cases[0]["greedy"].begin(), cases[0]["greedy"].begin() + 8);
  EXPECT_EQ(out["text"], json({prompt(0) + " " + ids_text(greedy8)}));
  double sum = 0;
  for (size_t t = 0; t < 8; ++t) sum += cases[0]["logprobs"][t].get<double>();
  EXPECT_NEAR(out["scores"][0].get<double>(), sum / 8, 1e-4);
  auto three = client().Put(
      "/api", json{{"prompts", {prompt(1)}}, {"tokens_to_generate", 6}, {"beam_width", 3}, {"length_penalty", 0.5}}.dump(),
      "application/json");
  ASSERT_TRUE(three && three->status == 200) << (three ? three->body : "no response");
  out = json::parse(three->body);
  ASSERT_EQ(out["text"].size(), 3u);
  ASSERT_EQ(out["segments"].size(), 3u);
  EXPECT_GE(out["scores"][0].get<double>(), out["scores"][1].get<double>());
  EXPECT_GE(out["scores"][1].get<double>(), out["scores"][2].get<double>());
  EXPECT_NE(out["text"][0], out["text"][1]);
  auto bad = client().Put("/api", json{{"prompts", {prompt(0)}}, {"beam_width", 2}, {"temperature", 0}}.dump(),
                          "application/json");
  ASSERT_TRUE(bad);
  EXPECT_EQ(bad->status, 400);
  EXPECT_EQ(error_message(bad->body), "temperature does not apply to beam search (beam_width): drop it");
}

TEST_F(TextGenerationServer, CompletionsStreamedEqualsPlain) {
  json body = {{"model", "gpt2"}, {"prompt", prompt(0)}, {"max_tokens", 16}, {"temperature", 0}, {"logprobs", 1}};
  json plain = complete(body);
  ASSERT_EQ(plain["object"], "text_completion");
  EXPECT_EQ(plain["choices"][0]["text"], greedy(0));
  EXPECT_EQ(plain["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(plain["usage"]["completion_tokens"], 16);
  EXPECT_NEAR(plain["choices"][0]["logprobs"]["token_logprobs"][0].get<double>(), cases[0]["logprobs"][0], 1e-4);

  body["stream"] = true;
  auto r = client().Post("/v1/completions", body.dump(), "application/json");
  ASSERT_TRUE(r && r->status == 200) << (r ? r->body : "no response");
  EXPECT_NE(r->get_header_value("Content-Type").find("text/event-stream"), std::string::npos);
  std::string text, finish;
  size_t events = 0;
  bool done = false;
  for (size_t pos = 0; pos < r->body.size();) {
    size_t end = r->body.find("\n\n", pos);
    ASSERT_NE(end, std::string::npos) << r->body;
    std::string event = r->body.substr(pos, end - pos);
    pos = end + 2;
    ASSERT_EQ(event.rfind("data: ", 0), 0u) << event;
    if (event == "data: [DONE]") {
      done = true;
      continue;
    }
    json chunk = json::parse(event.substr(6));
    text += chunk["choices"][0]["text"].get<std::string>();
    if (!chunk["choices"][0]["finish_reason"].is_null()) finish = chunk["choices"][0]["finish_reason"];
    ++events;
  }
  EXPECT_TRUE(done);
  EXPECT_GT(events, 2u);
  EXPECT_EQ(text, plain["choices"][0]["text"]);
  EXPECT_EQ(finish, "length");
}

TEST_F(TextGenerationServer, StopStringsAndSeeds) {
  json stopped = complete({{"prompt", prompt(0)}, {"max_tokens", 16}, {"temperature", 0}, {"stop", " 285"}});
  EXPECT_EQ(stopped["choices"][0]["text"], "54 54 54 54 54 54 54 54");
  EXPECT_EQ(stopped["choices"][0]["finish_reason"], "stop");
  json a = complete({{"prompt", prompt(1)}, {"max_tokens", 8}, {"temperature", 1.0}, {"top_k", 20}, {"seed", 7}});
  json b = complete({{"prompt", prompt(1)}, {"max_tokens", 8}, {"temperature", 1.0}, {"top_k", 20}, {"seed", 7}});
  EXPECT_EQ(a["choices"][0]["text"], b["choices"][0]["text"]);
}

TEST_F(TextGenerationServer, ConcurrentRequestsAreBatchedAndCorrect) {
  std::vector<std::thread> threads;
  std::vector<std::string> got(9);
  for (size_t k = 0; k < got.size(); ++k) {
    threads.emplace_back([&, k] {
      json body = {{"prompt", prompt(k % 3)}, {"max_tokens", 16}, {"temperature", 0}, {"stream", k % 2 == 1}};
      auto r = client().Post("/v1/completions", body.dump(), "application/json");
      if (!r || r->status != 200) return;
      if (k % 2 == 0) {
        got[k] = json::parse(r->body)["choices"][0]["text"];
        return;
      }
      for (size_t pos = 0; (pos = r->body.find("data: {", pos)) != std::string::npos; ++pos) {
        size_t end = r->body.find("\n\n", pos);
        got[k] += json::parse(r->body.substr(pos + 6, end - pos - 6))["choices"][0]["text"].get<std::string>();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (size_t k = 0; k < got.size(); ++k) EXPECT_EQ(got[k], greedy(k % 3)) << "client " << k;
}

TEST_F(TextGenerationServer, BadRequestsGet400AndTheServerStaysUp) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"/api", "{\"prompts\": [\"1 2\""},                                 // malformed JSON
      {"/api", R"({"prompts": [""]})"},                                   // empty prompt
      {"/api", R"({"prompts": []})"},                                     // no prompts
      {"/api", R"({"prompts": ["1 2"], "tokens_to_generate": 5000})"},    // too many tokens
      {"/api", R"({"prompts": ["1 2"], "colour": "red"})"},               // unknown field
      {"/api", R"({"prompts": ["1 2"], "temperature": -0.5})"},           // negative temperature
      {"/api", R"({"prompts": ["1 two"]})"},                              // not ids for this tokenizer
      {"/api", R"({"prompts": ["1 2 999"]})"},                            // outside the vocabulary
      {"/api", R"([1, 2])"},                                              // not an object
      {"/v1/completions", R"({"prompt": "", "max_tokens": 4})"},          // empty prompt
      {"/v1/completions", R"({"prompt": "1 2", "max_tokens": 64})"},      // too many tokens
      {"/v1/completions", R"({"prompt": "1 2", "temperature": -1})"},     // negative temperature
      {"/v1/completions", R"({"prompt": "1 2", "logit_bias": {}})"},      // unknown field
      {"/v1/completions", R"({"prompt": "1 2", "suffix": "3"})"},         // no fill-in-the-middle
      {"/v1/chat/completions", R"({"messages": [{"role": "user", "content": "1"}]})"},  // no chat template
      {"/v1/completions", R"({"prompt": "1 2", "max_tokens": "many"})"},  // wrong type
      {"/v1/completions", R"({"max_tokens": 4})"},                        // no prompt
      {"/v1/completions", "not json at all"},
  };
  for (const auto& [path, body] : bad) {
    auto r =
        path == "/api" ? client().Put(path, body, "application/json") : client().Post(path, body, "application/json");
    ASSERT_TRUE(r) << "no response to " << body;
    if (path == "/v1/chat/completions")
      EXPECT_NE(error_message(r->body).find("has no chat template"), std::string::npos) << r->body;
    EXPECT_EQ(r->status, 400) << body << " -> " << r->body;
    json err = json::parse(r->body, nullptr, false);
    if (path == "/api") {  // Megatron's: {"message": ...}; OpenAI's: {"error": {"message", "type", "code"}}
      EXPECT_TRUE(err.is_object() && err.size() == 1 && err["message"].is_string()) << r->body;
    } else {
      EXPECT_TRUE(err.is_object() && err["error"]["message"].is_string() &&
                  err["error"]["type"] == "invalid_request_error" && err["error"].contains("code"))
          << r->body;
    }
  }
  auto h = client().Get("/health");
  ASSERT_TRUE(h && h->status == 200);
  EXPECT_EQ(complete({{"prompt", prompt(1)}, {"max_tokens", 16}, {"temperature", 0}})["choices"][0]["text"], greedy(1));
}

// Raw sockets: start a long stream, read its first bytes, hang up.
TEST_F(TextGenerationServer, ClientHangingUpMidStreamFreesItsSlot) {
  for (int k = 0; k < 4; ++k) {  // more than --max-batch-size
    RawConnection c(port);
    ASSERT_TRUE(c.ok());
    const std::string body = R"({"prompt": "7", "max_tokens": 62, "temperature": 0.9, "stream": true})";
    ASSERT_TRUE(c.send(http_request("POST", "/v1/completions", body)));
    ASSERT_FALSE(c.read_until(30, "data: ").empty());
    c.close();
  }
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(complete({{"prompt", prompt(i)}, {"max_tokens", 16}, {"temperature", 0}})["choices"][0]["text"],
              greedy(i));
  }
}

// Note [Server arguments]: pretrain_gpt's flags are taken; the model's must match the checkpoint's.
TEST(TextGenerationServerArguments, TrainingFlagsAreAcceptedAndModelFlagsChecked) {
  ScratchDir dir("text_generation_server_args");
  const std::string ckpt = gpt2_checkpoint(dir.path);
  const std::vector<std::pair<std::vector<std::string>, std::string>> refused = {
      {{"--num-layers", "3"}, "error: --num-layers 3 does not match the checkpoint's 2"},
      {{"--hidden-size=32"}, "error: --hidden-size 32 does not match the checkpoint's 64"},
      {{"--tensor-model-parallel-size", "2"},
       "error: --tensor-model-parallel-size 2 runs on 2 ranks and 1 were launched: launch mpirun -np 2"},
      {{"--pipeline-model-parallel-size", "2"},
       "error: --pipeline-model-parallel-size 2: inference runs tensor parallelism only"},
      {{"--context-parallel-size", "2"}, "error: --context-parallel-size 2: generation decodes one token"},
      {{"--expert-model-parallel-size", "2"},
       "error: --expert-model-parallel-size 2: there is no expert-parallel inference"},
      {{"--num-layrs", "2"}, "error: unknown flag --num-layrs (did you mean --num-layers?)"},
      {{"--top_k", "5", "--top_p", "0.5"}, "error: set --top_k or --top_p, not both"},
  };
  for (const auto& [extra, message] : refused) {
    ServerProcess s;
    s.start(ckpt, 0, dir.path / "refused.log", extra);
    EXPECT_EQ(s.wait_exit(60), 1) << s.output();
    const std::string out = s.output();
    EXPECT_NE(out.find(message), std::string::npos) << out;
    EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1) << "one line: " << out;
  }
  // Matching model flags, flags that mean nothing for inference, and --temperature 0 as the default.
  const json cases = json::parse(read_file(fs::absolute(fixtures_dir()) / "generation.json")).at("models").at("gpt2");
  ServerProcess s;
  s.start(ckpt, 0, dir.path / "server.log",
          {"--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--micro-batch-size", "4",
           "--global-batch-size", "8", "--lr", "0.1", "--train-iters", "10", "--temperature", "0"});
  ASSERT_TRUE(s.wait_healthy()) << s.output();
  const std::string prompt = ids_text(cases[0].at("prompt").get<std::vector<int64_t>>());
  auto r = s.client().Put("/api", json{{"prompts", {prompt}}, {"tokens_to_generate", 16}}.dump(), "application/json");
  ASSERT_TRUE(r && r->status == 200) << (r ? r->body : "no response");
  EXPECT_EQ(json::parse(r->body)["text"][0], prompt + " " + ids_text(cases[0].at("greedy").get<std::vector<int64_t>>()));
  EXPECT_EQ(s.stop(), 0) << s.output();
}

}  // namespace
}  // namespace megatron::testing
