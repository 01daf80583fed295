// tools/text_generation_server against hostile or unlucky clients: more slow connections than HTTP
// threads, a huge request beside a small one, clients that hang up or half-close, oversized and
// chunked bodies, invalid UTF-8, wrong methods and paths, a second server on the same port. Every
// wait is bounded, so a regression fails instead of hanging.
#include <atomic>
#include <nlohmann/json.hpp>

#include "tests/functional/server_util.h"

namespace megatron::testing {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

constexpr int kHttpThreads = 4;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// The body after the last response head of a raw reply (interim 1xx responses come first).
std::string reply_body(const std::string& reply) {
  const size_t head = reply.rfind("HTTP/1.1 ");
  const size_t end = head == std::string::npos ? std::string::npos : reply.find("\r\n\r\n", head);
  return end == std::string::npos ? "" : reply.substr(end + 4);
}

class ServerHardening : public ::testing::Test {
 protected:
  static inline std::unique_ptr<ScratchDir> dir;
  static inline ServerProcess server;
  static inline int port = 0;
  static inline std::string ckpt;
  static inline json cases;

  static void SetUpTestSuite() {
    ::signal(SIGPIPE, SIG_IGN);
    dir = std::make_unique<ScratchDir>("text_generation_server_hardening");
    cases = json::parse(read_file(fs::absolute(fixtures_dir()) / "generation.json")).at("models").at("gpt2");
    ckpt = gpt2_checkpoint(dir->path);
    server.start(ckpt, 0, dir->path / "server.log",
                 {"--max-batch-size", "3", "--http-threads", std::to_string(kHttpThreads)});
    ASSERT_TRUE(server.wait_healthy()) << "the server did not come up:\n" << server.output();
    port = server.port;
  }

  static void TearDownTestSuite() {
    EXPECT_EQ(server.stop(), 0) << server.output();
    dir.reset();
  }

  void TearDown() override { ASSERT_TRUE(server.alive()) << server.output(); }

  std::string prompt(size_t i) const { return ids_text(cases[i].at("prompt").get<std::vector<int64_t>>()); }
  std::string greedy(size_t i) const { return ids_text(cases[i].at("greedy").get<std::vector<int64_t>>()); }

  // A request that keeps the engine busy: 128 prompts (the cap) of 62 sampled tokens each.
  static json big_request(bool stream = false) {
    json prompts = json::array();
    for (int k = 0; k < 128; ++k) prompts.push_back(std::to_string(1 + k) + " 7");
    return {{"prompt", prompts}, {"max_tokens", 62}, {"temperature", 0.9}, {"seed", 5}, {"stream", stream}};
  }

  // prompts_in_flight from /health, or -1.
  static int64_t in_flight() {
    auto r = server.client(5).Get("/health");
    if (!r || r->status != 200) return -1;
    json h = json::parse(r->body, nullptr, false);
    return h.is_object() && h.contains("prompts_in_flight") ? h["prompts_in_flight"].get<int64_t>() : -1;
  }

  // Waits (at most `seconds`) for the server to have nothing in flight; `strict`: /health must say so.
  static bool drained(double seconds, bool strict = true) {
    for (auto t0 = Clock::now(); seconds_since(t0) < seconds;) {
      const int64_t n = in_flight();
      if (n == 0 || (!strict && n < 0)) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  }
};

TEST_F(ServerHardening, SlowClientsDoNotLockOutHealthOrTheEngine) {
  // Three times as many connections as HTTP threads, each trickling a header line every 200 ms
  // and never finishing its request.
  std::vector<RawConnection> slow;
  slow.reserve(3 * kHttpThreads);
  for (int k = 0; k < 3 * kHttpThreads; ++k) {
    slow.emplace_back(port);
    ASSERT_TRUE(slow.back().ok());
    ASSERT_TRUE(slow.back().send("GET /health HTTP/1.1\r\n"));
  }
  std::atomic<bool> stop{false};
  std::thread trickle([&] {
    for (int line = 0; !stop && line < 100; ++line) {
      for (RawConnection& c : slow) c.send("X-Slow-" + std::to_string(line) + ": 1\r\n");
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(600));
  httplib::Client cli("127.0.0.1", port);
  cli.set_connection_timeout(2, 0);
  cli.set_read_timeout(2, 0);
  const auto t0 = Clock::now();
  auto health = cli.Get("/health");
  const double health_s = seconds_since(t0);
  json body = {{"prompt", prompt(0)}, {"max_tokens", 16}, {"temperature", 0}};
  auto completion = server.client(10).Post("/v1/completions", body.dump(), "application/json");
  stop = true;
  trickle.join();
  ASSERT_TRUE(health && health->status == 200) << "/health unanswered beside " << slow.size() << " slow clients";
  EXPECT_LT(health_s, 1.0);
  ASSERT_TRUE(completion && completion->status == 200) << "no completion beside the slow clients";
  EXPECT_EQ(json::parse(completion->body)["choices"][0]["text"], greedy(0));
}

TEST_F(ServerHardening, OnePromptCapForBothEndpoints) {
  json prompts = json::array();
  for (int k = 0; k < 129; ++k) prompts.push_back("1 2");
  auto api = server.client().Put("/api", json{{"prompts", prompts}, {"tokens_to_generate", 1}}.dump(),
                                 "application/json");
  auto cmpl = server.client().Post("/v1/completions", json{{"prompt", prompts}, {"max_tokens", 1}}.dump(),
                                   "application/json");
  for (const auto* r : {&api, &cmpl}) {
    ASSERT_TRUE(*r);
    EXPECT_EQ((*r)->status, 400) << (*r)->body;
    ASSERT_TRUE(is_json_error((*r)->body)) << (*r)->body;
    const std::string error = error_message((*r)->body);
    EXPECT_NE(error.find(r == &api ? "Maximum number of prompts is 128" : "at most 128 prompts"), std::string::npos)
        << error;
    EXPECT_NE(error.find("--max-prompts-per-request"), std::string::npos) << error;
  }
  prompts.erase(prompts.begin());  // 128: accepted by both
  api = server.client().Put("/api", json{{"prompts", prompts}, {"tokens_to_generate", 1}}.dump(), "application/json");
  cmpl = server.client().Post("/v1/completions", json{{"prompt", prompts}, {"max_tokens", 1}}.dump(),
                              "application/json");
  ASSERT_TRUE(api && cmpl);
  EXPECT_EQ(api->status, 200) << api->body;
  EXPECT_EQ(cmpl->status, 200) << cmpl->body;
}

TEST_F(ServerHardening, AHugeRequestDoesNotStarveASmallOne) {
  ASSERT_TRUE(drained(10, /*strict=*/false));
  std::atomic<bool> big_done{false};
  bool big_ok = false;
  const auto t0 = Clock::now();
  std::thread big([&] {
    auto r = server.client(600).Post("/v1/completions", big_request().dump(), "application/json");
    big_ok = r && r->status == 200;
    big_done = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const bool big_running = !big_done;
  json body = {{"prompt", prompt(1)}, {"max_tokens", 16}, {"temperature", 0}};
  auto small = server.client(600).Post("/v1/completions", body.dump(), "application/json");
  const double small_s = seconds_since(t0);
  const bool big_finished_first = big_done;
  big.join();
  const double big_s = seconds_since(t0);
  std::printf("big request (128 x 62 tokens): %.2f s; the small one beside it: %.2f s\n", big_s, small_s);
  ASSERT_TRUE(big_running) << "the big request ended within 0.2 s: make it bigger";
  ASSERT_TRUE(small && small->status == 200);
  EXPECT_EQ(json::parse(small->body)["choices"][0]["text"], greedy(1));
  EXPECT_TRUE(big_ok);
  EXPECT_FALSE(big_finished_first) << "the small request waited for all of the big one";
  EXPECT_LT(small_s, 0.5 * big_s);
}

TEST_F(ServerHardening, ANonStreamingClientThatHangsUpIsCancelled) {
  ASSERT_TRUE(drained(10));
  for (const char* path : {"/v1/completions", "/api"}) {
    RawConnection c(port);
    ASSERT_TRUE(c.ok());
    json body = big_request();
    if (std::string(path) == "/api")
      body = {{"prompts", body["prompt"]}, {"tokens_to_generate", 62}, {"temperature", 0.9}};
    ASSERT_TRUE(c.send(http_request(std::string(path) == "/api" ? "PUT" : "POST", path, body.dump())));
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    EXPECT_GT(in_flight(), 0) << path;
    c.close();
    const auto t0 = Clock::now();
    EXPECT_TRUE(drained(3)) << path << ": the prompts of a client that hung up are still computed";
    std::printf("%s: cancelled %.2f s after the client hung up\n", path, seconds_since(t0));
  }
}

TEST_F(ServerHardening, AHalfClosedClientStillGetsItsReply) {
  for (bool stream : {false, true}) {
    RawConnection c(port);
    ASSERT_TRUE(c.ok());
    json body = {{"prompt", prompt(0)}, {"max_tokens", 16}, {"temperature", 0}, {"stream", stream}};
    ASSERT_TRUE(c.send(http_request("POST", "/v1/completions", body.dump())));
    ASSERT_EQ(::shutdown(c.fd, SHUT_WR), 0);
    const std::string reply = c.read_until(30, stream ? "data: [DONE]" : "");
    ASSERT_NE(reply.find("HTTP/1.1 200 OK"), std::string::npos) << "stream " << stream << ": " << reply;
    if (stream) {
      EXPECT_NE(reply.find("data: [DONE]"), std::string::npos) << reply;
    } else {
      json out = json::parse(reply_body(reply), nullptr, false);
      ASSERT_TRUE(out.is_object()) << reply;
      EXPECT_EQ(out["choices"][0]["text"], greedy(0));
    }
  }
  // Long enough for the server to see the FIN while it waits (Note [Hang-up probe]): an interim
  // 100 Continue, then the reply.
  RawConnection c(port);
  json prompts = json::array();
  for (int k = 0; k < 48; ++k) prompts.push_back(prompt(k % 3));
  json body = {{"prompt", prompts}, {"max_tokens", 40}, {"temperature", 0}};
  ASSERT_TRUE(c.send(http_request("POST", "/v1/completions", body.dump())));
  ASSERT_EQ(::shutdown(c.fd, SHUT_WR), 0);
  const std::string reply = c.read_until(60);
  ASSERT_NE(reply.find("HTTP/1.1 200 OK"), std::string::npos) << reply.substr(0, 500);
  json out = json::parse(reply_body(reply), nullptr, false);
  ASSERT_TRUE(out.is_object()) << reply.substr(0, 500);
  EXPECT_EQ(out["choices"].size(), 48u);
  std::printf("a half-closed client's reply began with: %s\n", reply.substr(0, reply.find("\r\n")).c_str());
}

TEST_F(ServerHardening, BodiesBeyondTheLimitAre413AndChunkedBodies411) {
  // The default --max-request-bytes is 8 MiB.
  const std::string big = R"({"prompt": "1 2", "max_tokens": 1, "user": ")" + std::string(9 << 20, 'x') + R"("})";
  auto r = server.client().Post("/v1/completions", big, "application/json");
  ASSERT_TRUE(r) << "no reply to a 9 MiB body";
  EXPECT_EQ(r->status, 413);
  EXPECT_TRUE(is_json_error(r->body)) << r->body;

  RawConnection c(port);
  ASSERT_TRUE(c.send("POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n"
                     "5\r\nhello\r\n0\r\n\r\n"));
  const std::string reply = c.read_until(10);
  EXPECT_EQ(reply.rfind("HTTP/1.1 411", 0), 0u) << reply;
  EXPECT_TRUE(is_json_error(reply_body(reply))) << reply;
}

TEST_F(ServerHardening, InvalidUtf8Is400WithAJsonErrorAndNoInternals) {
  const std::vector<std::string> bodies = {"{\"prompt\": \"1 \xff 2\", \"max_tokens\": 1}", "\xff\xfe\xfd",
                                           "{\"prompt\": \"1 2\", \"model\": \"\xc3\x28\", \"max_tokens\": 1}"};
  for (const std::string& body : bodies) {
    for (const char* path : {"/v1/completions", "/api"}) {
      auto r = std::string(path) == "/api" ? server.client().Put(path, body, "application/json")
                                           : server.client().Post(path, body, "application/json");
      ASSERT_TRUE(r) << path;
      EXPECT_EQ(r->status, 400) << path << " " << r->body;
      EXPECT_TRUE(is_json_error(r->body)) << path << " " << r->body;
      for (const auto& [name, value] : r->headers) EXPECT_EQ(name.find("EXCEPTION"), std::string::npos) << name;
    }
  }
}

TEST_F(ServerHardening, WrongMethodIs405WithAllowAndEveryErrorIsJson) {
  const std::vector<std::tuple<std::string, std::string, std::string>> wrong = {
      {"GET", "/api", "PUT"},
      {"POST", "/api", "PUT"},
      {"GET", "/v1/completions", "POST"},
      {"DELETE", "/v1/completions", "POST"},
      {"POST", "/health", "GET, HEAD"},
  };
  for (const auto& [method, path, allow] : wrong) {
    RawConnection c(port);
    ASSERT_TRUE(c.send(http_request(method, path, method == "GET" ? "" : "{}")));
    const std::string reply = c.read_until(10, "}");
    EXPECT_EQ(reply.rfind("HTTP/1.1 405", 0), 0u) << method << " " << path << ": " << reply;
    EXPECT_NE(reply.find("\r\nAllow: " + allow + "\r\n"), std::string::npos) << reply;
    EXPECT_TRUE(is_json_error(reply_body(reply))) << reply;
  }
  auto missing = server.client().Get("/nowhere");
  ASSERT_TRUE(missing);
  EXPECT_EQ(missing->status, 404);
  EXPECT_TRUE(is_json_error(missing->body)) << missing->body;
  for (const std::string raw : {"BREW /api HTTP/1.1\r\nHost: x\r\n\r\n", "GET /health HTTP/9\r\n\r\n"}) {
    RawConnection c(port);
    ASSERT_TRUE(c.send(raw));
    const std::string reply = c.read_until(10, "}");
    EXPECT_EQ(reply.rfind("HTTP/1.1 4", 0), 0u) << raw << " -> " << reply;
    EXPECT_TRUE(is_json_error(reply_body(reply))) << raw << " -> " << reply;
  }
}

TEST_F(ServerHardening, ASecondServerOnTheSamePortFailsWithOneLine) {
  ServerProcess second;
  second.start(ckpt, port, dir->path / "second.log");
  const int code = second.wait_exit(20);
  if (code == -1) second.stop();
  const std::string out = second.output();
  EXPECT_NE(code, -1) << "the second server is still running:\n" << out;
  EXPECT_NE(code, 0) << out;
  EXPECT_EQ(out.find("serving"), std::string::npos) << out;
  EXPECT_NE(out.find("cannot listen on 127.0.0.1:" + std::to_string(port)), std::string::npos) << out;
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1) << out;
  auto h = server.client(5).Get("/health");
  EXPECT_TRUE(h && h->status == 200);
}

}  // namespace
}  // namespace megatron::testing
