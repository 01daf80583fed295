// A bounded mutation fuzzer of request bodies against a running tools/text_generation_server: valid
// PUT /api and POST /v1/completions bodies (plain and streamed) mutated at the byte level (flips,
// insertions of JSON punctuation and invalid UTF-8, deletions, duplications, truncation) and at the
// JSON level (a field set to a hostile value: huge or negative numbers, wrong types, long strings;
// or to a plausible one, in and just out of its range, so that tries reach generation),
// with a fixed seed and count. Each try is classified as a clean 4xx (a JSON error), a 200 (a
// well-formed completion or event stream), a 5xx, an unclean reply, a hang (no reply in 20 s) or a
// crash (the server gone); anything but the first two fails the test.
#include <fmt/format.h>

#include <map>
#include <nlohmann/json.hpp>
#include <random>

#include "tests/functional/server_util.h"

namespace megatron::testing {
namespace {

using nlohmann::json;

constexpr uint64_t kSeed = 20;
constexpr int kTries = 2000;

struct Seed {
  std::string method, path;
  json body;
};

std::vector<Seed> seeds() {
  return {
      {"PUT", "/api", {{"prompts", {"1 2 3", "4 5"}}, {"tokens_to_generate", 4}, {"temperature", 0}}},
      {"PUT",
       "/api",
       {{"prompts", {"7"}}, {"tokens_to_generate", 2}, {"logprobs", true}, {"top_k", 5}, {"random_seed", 3}}},
      {"POST", "/v1/completions", {{"prompt", "1 2 3"}, {"max_tokens", 4}, {"temperature", 0}}},
      {"POST", "/v1/completions", {{"prompt", {"9 8", "7"}}, {"max_tokens", 3}, {"stop", {" 5"}}, {"logprobs", 1}}},
      {"POST", "/v1/completions", {{"prompt", {1, 2, 3}}, {"max_tokens", 3}, {"stream", true}, {"echo", true}}},
      {"POST", "/v1/completions", {{"prompt", "4 4"}, {"max_tokens", 2}, {"top_p", 0.5}, {"seed", 1}, {"n", 1}}},
  };
}

const std::vector<json>& hostile_values() {
  static const std::vector<json> v = {nullptr,
                                      json::array(),
                                      json::object(),
                                      "",
                                      "x",
                                      std::string(3000, '9'),
                                      true,
                                      -1,
                                      0,
                                      63,
                                      64,
                                      1 << 30,
                                      INT64_MAX,
                                      INT64_MIN,
                                      18446744073709551615ull,
                                      1e308,
                                      -1e308,
                                      0.5,
                                      json::array({""}),
                                      json::array({1, -5}),
                                      json::array({511, 512}),
                                      json::array({json::array({1}), "2"}),
                                      json::array({nullptr})};
  return v;
}

// A value of the kind the field takes, in and just out of its range (so that more tries get past
// validation into generation: max_tokens 0, top_k beyond the vocabulary, stop strings, ...).
json plausible(const std::string& key, std::mt19937_64& rng) {
  auto uniform = [&](double lo, double hi) { return lo + (hi - lo) * double(rng() % 1000) / 999.0; };
  auto ids = [&] {
    json p = json::array();
    for (int k = 0, n = 1 + int(rng() % 8); k < n; ++k) p.push_back(int64_t(rng() % 530));
    return p;
  };
  if (key == "max_tokens" || key == "tokens_to_generate") return int64_t(rng() % 70);
  if (key == "temperature") return uniform(0, 2.5);
  if (key == "top_p") return uniform(0, 1.1);
  if (key == "top_k") return int64_t(rng() % 600);
  if (key == "seed" || key == "random_seed") return int64_t(rng() % 100000);
  if (key == "stop") return rng() % 2 ? json(" " + std::to_string(rng() % 512)) : json::array({" 1", "2 3"});
  if (key == "logprobs") return rng() % 2 ? json(bool(rng() % 2)) : json(int64_t(rng() % 25));
  if (key == "prompt") return rng() % 2 ? json(ids()) : json::array({ids(), "5 6"});
  if (key == "prompts") return json::array({"1 2", std::to_string(rng() % 600) + " 3"});
  if (key == "stream" || key == "echo" || key == "add_BOS") return bool(rng() % 2);
  return int64_t(rng() % 3);
}

std::string mutate(const Seed& seed, std::mt19937_64& rng) {
  auto pick = [&](size_t n) { return size_t(rng() % std::max<size_t>(n, 1)); };
  if (rng() % 3 == 0) {  // JSON level: one or two fields set to plausible values
    json body = seed.body;
    std::vector<std::string> keys;
    for (const auto& [k, v] : body.items()) keys.push_back(k);
    for (const char* k : {"max_tokens", "temperature", "top_p", "top_k", "stop", "logprobs", "stream", "echo"})
      if (seed.path == "/v1/completions") keys.push_back(k);
    for (int n = 1 + int(rng() % 2); n > 0; --n) {
      const std::string& key = keys[pick(keys.size())];
      body[key] = plausible(key, rng);
    }
    return body.dump();
  }
  if (rng() % 2 == 0) {  // JSON level: one field set to a hostile value (or a new field)
    json body = seed.body;
    std::vector<std::string> keys;
    for (const auto& [k, v] : body.items()) keys.push_back(k);
    keys.push_back("unknown_field");
    body[keys[pick(keys.size())]] = hostile_values()[pick(hostile_values().size())];
    return body.dump();
  }
  std::string s = seed.body.dump();
  static const std::string kBytes = std::string("{}[]\",:0-9e.\\ \xff\xc3\x80\x00", 18);
  const int ops = 1 + int(rng() % 3);
  for (int k = 0; k < ops && !s.empty(); ++k) {
    const size_t at = pick(s.size());
    switch (rng() % 6) {
      case 0: s[at] = char(s[at] ^ (1 << (rng() % 8))); break;
      case 1: s.insert(s.begin() + long(at), kBytes[pick(kBytes.size())]); break;
      case 2: s.erase(at, 1 + pick(8)); break;
      case 3: s.insert(at, s.substr(at, 1 + pick(16))); break;
      case 4: s.resize(at); break;
      default: s[at] = char(rng() & 0xff); break;
    }
  }
  return s;
}

// A 200 must be a completion object, Megatron's response, or a well-formed event stream.
bool well_formed_200(const Seed& seed, const httplib::Result& r) {
  if (r->get_header_value("Content-Type").find("text/event-stream") != std::string::npos)
    return r->body.size() >= 14 && r->body.compare(r->body.size() - 14, 14, "data: [DONE]\n\n") == 0;
  json j = json::parse(r->body, nullptr, false);
  if (!j.is_object()) return false;
  return seed.path == "/api" ? j.contains("text") : j.value("object", "") == "text_completion";
}

TEST(TextGenerationServerFuzz, MutatedBodiesGetACleanAnswer) {
  ::signal(SIGPIPE, SIG_IGN);
  ScratchDir dir("text_generation_server_fuzz");
  ServerProcess server;
  server.start(gpt2_checkpoint(dir.path), 0, dir.path / "server.log", {"--max-batch-size", "4"});
  ASSERT_TRUE(server.wait_healthy()) << server.output();

  std::mt19937_64 rng(kSeed);
  const std::vector<Seed> all = seeds();
  std::map<std::string, int> outcomes;
  std::vector<std::string> failures;
  const auto t0 = std::chrono::steady_clock::now();
  for (int t = 0; t < kTries && server.alive(); ++t) {
    const Seed& seed = all[size_t(rng() % all.size())];
    const std::string body = mutate(seed, rng);
    httplib::Client cli = server.client(20);
    auto r = seed.method == "PUT" ? cli.Put(seed.path, body, "application/json")
                                  : cli.Post(seed.path, body, "application/json");
    std::string outcome;
    if (!r) {
      outcome = server.alive() ? "hang" : "crash";
    } else if (r->status == 200) {
      outcome = well_formed_200(seed, r) ? "200" : "unclean 200";
    } else if (r->status >= 400 && r->status < 500) {
      outcome = is_json_error(r->body) ? "clean 4xx" : "unclean 4xx";
    } else {
      outcome = std::to_string(r->status);
    }
    ++outcomes[outcome];
    if (outcome != "200" && outcome != "clean 4xx" && failures.size() < 10)
      failures.push_back(outcome + " <- " + seed.method + " " + seed.path + " " + body.substr(0, 300));
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::string summary;
  int total = 0;
  for (const auto& [k, n] : outcomes) {
    summary += fmt::format("{}{}: {}", summary.empty() ? "" : ", ", k, n);
    total += n;
  }
  std::printf("HTTP body fuzzing, seed %llu: %d tries in %.1f s: %s\n", (unsigned long long)kSeed, total, secs,
              summary.c_str());
  EXPECT_EQ(total, kTries) << "the server died after " << total << " tries:\n" << server.output();
  EXPECT_EQ(outcomes["200"] + outcomes["clean 4xx"], total) << summary;
  for (const std::string& f : failures) ADD_FAILURE() << f;
  EXPECT_GT(outcomes["200"], 0);
  EXPECT_GT(outcomes["clean 4xx"], 0);
  EXPECT_EQ(server.stop(), 0) << server.output();
}

}  // namespace
}  // namespace megatron::testing
