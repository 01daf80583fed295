// InferenceEngine: greedy generation with the KV cache reproduces HuggingFace's (fixtures/
// generation.json: ids exactly, log-probabilities within 1e-4) for the fixture models, batched
// together; continuous batching, stop tokens, max length, seeds and validation.
#include "megatron/core/inference/generation.h"

#include <gtest/gtest.h>

#include <bit>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "megatron/core/dist_checkpointing/safetensors.h"
#include "megatron/core/models/gpt/hf_mapping.h"
#include "megatron/kernels/ops.h"
#include "tests/core/model_test_util.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

std::unique_ptr<GPTModel> load_fixture_model(const std::string& name) {
  safetensors::File file(testing::fixtures_dir() + "/" + name + "_model.safetensors");
  HFModelInfo info = config_from_hf(nlohmann::json::parse(file.metadata().at("config")), 1);
  TransformerConfig c = info.config;
  c.hidden_dropout = c.attention_dropout = 0.0f;
  auto model = std::make_unique<GPTModel>(c);
  load_model_state_dict(*model, hf_to_megatron(info, [&](const std::string& n) { return file.read(n); }), file.path());
  return model;
}

GenerationRequest greedy(std::vector<int64_t> prompt, int64_t max_new_tokens) {
  GenerationRequest r;
  r.prompt = std::move(prompt);
  r.max_new_tokens = max_new_tokens;
  r.sampling.greedy = true;
  return r;
}

class FixtureGeneration : public ::testing::TestWithParam<std::string> {};

TEST_P(FixtureGeneration, GreedyMatchesHuggingFace) {
  std::ifstream in(testing::fixtures_dir() + "/generation.json");
  ASSERT_TRUE(in) << "generation.json missing in " << testing::fixtures_dir();
  const nlohmann::json cases = nlohmann::json::parse(in).at("models").at(GetParam());
  auto model = load_fixture_model(GetParam());
  Context ctx;
  InferenceEngine engine(*model, ctx, model->config().vocab_size, {.max_batch_size = 2});  // 3 prompts: queued
  std::vector<GenerationRequest> requests;
  for (const auto& c : cases) {
    requests.push_back(greedy(c.at("prompt").get<std::vector<int64_t>>(), int64_t(c.at("greedy").size())));
  }
  std::vector<GenerationResult> results = engine.generate(requests);
  double worst = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    EXPECT_EQ(results[i].tokens, cases[i].at("greedy").get<std::vector<int64_t>>()) << "prompt " << i;
    EXPECT_EQ(results[i].finish_reason, "length");
    std::vector<double> ref = cases[i].at("logprobs").get<std::vector<double>>();
    ASSERT_EQ(results[i].logprobs.size(), ref.size());
    for (size_t t = 0; t < ref.size(); ++t) worst = std::max(worst, std::fabs(results[i].logprobs[t] - ref[t]));
  }
  std::printf("%s: max |logprob - HF| = %.3g\n", GetParam().c_str(), worst);
  EXPECT_LE(worst, 1e-4);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, FixtureGeneration, ::testing::Values("gpt2", "llama"),
                         [](const auto& info) { return info.param; });

struct Tiny {
  std::unique_ptr<GPTModel> model;
  Context ctx;
  Tiny() {
    TransformerConfig c;
    c.num_layers = 2;
    c.hidden_size = 32;
    c.num_attention_heads = 4;
    c.num_query_groups = 2;
    c.vocab_size = 50;
    c.make_vocab_size_divisible_by = 16;
    c.max_position_embeddings = 40;
    testing::use_llama_layers(c);
    c.hidden_dropout = c.attention_dropout = 0.0f;
    model = std::make_unique<GPTModel>(c);
    model->init_weights(3);
  }
};

GenerationRequest sampled(std::vector<int64_t> prompt, uint64_t seed) {
  GenerationRequest r;
  r.prompt = std::move(prompt);
  r.max_new_tokens = 12;
  r.sampling.temperature = 1.5f;
  r.sampling.seed = seed;
  return r;
}

TEST(InferenceEngine, SeededSamplingIsReproducibleWhateverTheBatch) {
  Tiny t;
  InferenceEngine engine(*t.model, t.ctx, 50, {.max_batch_size = 4});
  GenerationResult alone = engine.generate({sampled({1, 2, 3}, 9)})[0];
  std::vector<GenerationResult> batch =
      engine.generate({sampled({7, 8, 9, 10, 11}, 5), sampled({1, 2, 3}, 9), sampled({4}, 1), sampled({1, 2, 3}, 10)});
  EXPECT_EQ(alone.tokens, batch[1].tokens);
  ASSERT_EQ(alone.logprobs.size(), batch[1].logprobs.size());
  for (size_t i = 0; i < alone.logprobs.size(); ++i) EXPECT_NEAR(alone.logprobs[i], batch[1].logprobs[i], 1e-5);
  EXPECT_NE(alone.tokens, batch[3].tokens) << "another seed draws other tokens";
}

TEST(InferenceEngine, StopTokensMaxLengthAndPromptLogprobs) {
  Tiny t;
  InferenceEngine engine(*t.model, t.ctx, 50, {.max_batch_size = 2});
  GenerationRequest r = greedy({3, 1, 4, 1, 5}, 10);
  r.prompt_logprobs = true;
  GenerationResult full = engine.generate({r})[0];
  ASSERT_EQ(full.tokens.size(), 10u);
  EXPECT_EQ(full.finish_reason, "length");
  EXPECT_EQ(full.prompt_logprobs.size(), 4u);
  r.stop_tokens = {full.tokens[3]};
  GenerationResult stopped = engine.generate({r})[0];
  const size_t first = size_t(std::find(full.tokens.begin(), full.tokens.end(), full.tokens[3]) - full.tokens.begin());
  EXPECT_EQ(stopped.finish_reason, "stop");
  EXPECT_EQ(stopped.tokens, std::vector<int64_t>(full.tokens.begin(), full.tokens.begin() + int64_t(first) + 1));
  // Cancelling from the token callback frees the slot; the queue keeps going.
  int seen = 0;
  std::string reason;
  engine.submit(
      r, [&](int64_t, double, const TopLogprobs&) { return ++seen < 2; }, [&](const GenerationResult& g) { reason = g.finish_reason; });
  while (engine.step()) {
  }
  EXPECT_EQ(seen, 2);
  EXPECT_EQ(reason, "cancelled");
  EXPECT_TRUE(engine.idle());
}

// Note [Prefill output rows]: a prefill that computes logits only for each prompt's last token
// (no prompt log-probabilities asked) generates what one computing every prompt row does: the same
// tokens, log-probabilities within rounding (BLAS may round a row differently in a GEMM of other M).
TEST(InferenceEngine, PrefillOfLastRowsOnlyMatchesPrefillOfAllRows) {
  Tiny t;
  auto requests = [](bool prompt_logprobs) {
    std::vector<GenerationRequest> rs = {sampled({7, 8, 9, 10, 11}, 5), sampled({1, 2, 3}, 9), sampled({4}, 1)};
    rs[1].sampling.greedy = true;
    for (GenerationRequest& r : rs) {
      r.prompt_logprobs = prompt_logprobs;
      r.top_logprobs = 3;
    }
    return rs;
  };
  InferenceEngine engine(*t.model, t.ctx, 50, {.max_batch_size = 4});
  std::vector<GenerationResult> last_rows = engine.generate(requests(false));
  std::vector<GenerationResult> all_rows = engine.generate(requests(true));
  std::vector<GenerationRequest> mixed = requests(false);
  mixed[1].prompt_logprobs = true;
  std::vector<GenerationResult> some_rows = engine.generate(mixed);
  for (size_t i = 0; i < last_rows.size(); ++i) {
    for (const GenerationResult* other : {&all_rows[i], &some_rows[i]}) {
      EXPECT_EQ(last_rows[i].tokens, other->tokens) << i;
      ASSERT_EQ(last_rows[i].logprobs.size(), other->logprobs.size());
      ASSERT_EQ(last_rows[i].top_logprobs.size(), other->top_logprobs.size());
      for (size_t k = 0; k < other->logprobs.size(); ++k) {
        EXPECT_NEAR(last_rows[i].logprobs[k], other->logprobs[k], 1e-6) << i << " " << k;
        for (size_t m = 0; m < other->top_logprobs[k].size(); ++m) {
          EXPECT_EQ(last_rows[i].top_logprobs[k][m].first, other->top_logprobs[k][m].first);
          EXPECT_NEAR(last_rows[i].top_logprobs[k][m].second, other->top_logprobs[k][m].second, 1e-6);
        }
      }
    }
    EXPECT_TRUE(last_rows[i].prompt_logprobs.empty());
    EXPECT_EQ(all_rows[i].prompt_logprobs.size(), requests(false)[i].prompt.size() - 1);
  }
  EXPECT_EQ(some_rows[1].prompt_logprobs, all_rows[1].prompt_logprobs);
  EXPECT_EQ(some_rows[1].prompt_top_logprobs, all_rows[1].prompt_top_logprobs);
  EXPECT_TRUE(some_rows[0].prompt_logprobs.empty());
}

// Note [Greedy rows on the device]: greedy requests without top log-probabilities take the argmax
// and its log-probability from ops::logits_summary; asking for one top log-probability sends the
// same requests down the host path. Same tokens, same log-probabilities to the bit (the CPU op sums
// in the host path's order), and the summary equals token_logprob on random rows.
TEST(InferenceEngine, GreedyRowsOnTheDeviceEqualTheHostPath) {
  Tiny t;
  auto requests = [](int top) {
    std::vector<GenerationRequest> rs = {sampled({7, 8, 9, 10, 11}, 6), sampled({1, 2, 3}, 9), sampled({4}, 3)};
    for (GenerationRequest& r : rs) {
      r.sampling.greedy = true;
      r.top_logprobs = top;
    }
    return rs;
  };
  InferenceEngine engine(*t.model, t.ctx, 50, {.max_batch_size = 2});
  const std::vector<GenerationResult> device = engine.generate(requests(0)), host = engine.generate(requests(1));
  for (size_t i = 0; i < device.size(); ++i) {
    EXPECT_EQ(device[i].tokens, host[i].tokens) << i;
    EXPECT_EQ(device[i].logprobs, host[i].logprobs) << i;
    EXPECT_EQ(device[i].finish_reason, host[i].finish_reason) << i;
  }

  const int64_t n = 4, cols = 64, vocab = 50;
  Tensor logits = testing::random_tensor({n, cols}, 11, 3.0f);
  Tensor argmax = Tensor::empty({n}, DType::Int64), max_logit = Tensor::empty({n}, DType::Float32);
  Tensor log_norm = Tensor::empty({n}, DType::Int64);
  ops::logits_summary(t.ctx, logits, vocab, argmax, max_logit, log_norm);
  const std::vector<float> x = logits.to_floats();
  for (int64_t r = 0; r < n; ++r) {
    const float* row = x.data() + r * cols;
    SamplingParams greedy;
    greedy.greedy = true;
    const int64_t best = sample_token(row, vocab, greedy, 0);
    EXPECT_EQ(argmax.to_ints()[size_t(r)], best);
    EXPECT_EQ(max_logit.to_floats()[size_t(r)], row[best]);
    EXPECT_EQ(-std::bit_cast<double>(log_norm.to_ints()[size_t(r)]), token_logprob(row, vocab, best)) << r;
  }
}

// Megatron's stop_on_eol rules (stop sequences), prevent_newline_after_colon (a banned pair) and
// OpenAI's penalties, each checked against the unconstrained run's own log-probabilities.
TEST(InferenceEngine, StopSequencesBannedPairsPenaltiesAndTopLogprobs) {
  Tiny t;
  InferenceEngine engine(*t.model, t.ctx, 50, {.max_batch_size = 2});
  GenerationRequest r = greedy({3, 1, 4, 1, 5}, 10);
  r.top_logprobs = 50;  // the whole vocabulary
  r.prompt_logprobs = true;
  GenerationResult full = engine.generate({r})[0];
  ASSERT_EQ(full.top_logprobs.size(), 10u);
  ASSERT_EQ(full.prompt_top_logprobs.size(), 4u);
  for (size_t i = 0; i < 10; ++i) {
    ASSERT_EQ(full.top_logprobs[i].size(), 50u);
    EXPECT_EQ(full.top_logprobs[i][0].first, full.tokens[i]) << "greedy picks the most likely";
    EXPECT_NEAR(full.top_logprobs[i][0].second, full.logprobs[i], 1e-9);
    for (size_t k = 1; k < 50; ++k) EXPECT_LE(full.top_logprobs[i][k].second, full.top_logprobs[i][k - 1].second);
  }

  // A stop sequence ends the run at its first occurrence that ends on a generated token.
  GenerationRequest s = r;
  s.top_logprobs = 0;
  s.stop_sequences = {{full.tokens[2], full.tokens[3]}};
  std::vector<int64_t> ids = r.prompt;
  size_t expect = 0;
  for (size_t i = 0; i < full.tokens.size(); ++i) {
    ids.push_back(full.tokens[i]);
    if (ids[ids.size() - 2] == full.tokens[2] && ids.back() == full.tokens[3]) {
      expect = i + 1;
      break;
    }
  }
  GenerationResult stopped = engine.generate({s})[0];
  EXPECT_EQ(stopped.finish_reason, "stop");
  EXPECT_EQ(stopped.tokens, std::vector<int64_t>(full.tokens.begin(), full.tokens.begin() + int64_t(expect)));

  // Banning token b right after token a: the step after a takes the next most likely token.
  ASSERT_NE(full.tokens[0], r.prompt.back());
  GenerationRequest b = r;
  b.banned_after = {{full.tokens[0], full.tokens[1]}};
  GenerationResult banned = engine.generate({b})[0];
  EXPECT_EQ(banned.tokens[0], full.tokens[0]);
  EXPECT_EQ(banned.tokens[1], full.top_logprobs[1][1].first);
  EXPECT_NEAR(banned.logprobs[1], full.top_logprobs[1][1].second, 1e-9) << "logprobs stay the model's";

  // Penalties: every greedy step maximises logprob - count * frequency - [count > 0] * presence.
  for (auto [frequency, presence] : {std::pair{1.5f, 0.0f}, std::pair{0.0f, 2.0f}, std::pair{-0.5f, 1.0f}}) {
    GenerationRequest p = r;
    p.sampling.frequency_penalty = frequency;
    p.sampling.presence_penalty = presence;
    GenerationResult g = engine.generate({p})[0];
    std::map<int64_t, int> count;
    for (size_t i = 0; i < g.tokens.size(); ++i) {
      int64_t best = -1;
      double best_score = -1e300;
      for (const auto& [tok, lp] : g.top_logprobs[i]) {
        const double score = lp - count[tok] * frequency - (count[tok] > 0 ? presence : 0.0f);
        if (score > best_score) best = tok, best_score = score;
      }
      EXPECT_EQ(g.tokens[i], best) << "step " << i << " frequency " << frequency << " presence " << presence;
      ++count[g.tokens[i]];
    }
  }
  GenerationRequest bad = r;
  bad.sampling.presence_penalty = 2.5f;
  EXPECT_THROW(engine.validate(bad), Error);
}

// Beam search (beam_search.h) against a search written here over the engine's own next-token
// distributions (a fresh prefill per sequence, no cache copies): same beams, same scores.
TEST(BeamSearch, MatchesANaiveSearchAndGreedyAtWidthOne) {
  Tiny t;
  InferenceEngine engine(*t.model, t.ctx, 50, {.max_batch_size = 4});
  auto next_logprobs = [&](const std::vector<int64_t>& seq) {
    GenerationRequest r = greedy(seq, 1);
    r.top_logprobs = 50;
    const GenerationResult result = engine.generate({r})[0];
    std::vector<double> lp(50);
    for (const auto& [tok, v] : result.top_logprobs[0]) lp[size_t(tok)] = v;
    return lp;
  };
  const std::vector<int64_t> prompt = {3, 1, 4, 1, 5};
  // Width 1 is greedy; the score is the mean logprob (length_penalty 1).
  GenerationResult greedy_run = engine.generate({greedy(prompt, 6)})[0];
  auto one = engine.beam_search({.prompt = prompt, .max_new_tokens = 6, .beam_size = 1});
  ASSERT_EQ(one.size(), 1u);
  std::vector<int64_t> expect = prompt;
  expect.insert(expect.end(), greedy_run.tokens.begin(), greedy_run.tokens.end());
  EXPECT_EQ(one[0].tokens, expect);
  double sum = 0;
  for (double x : greedy_run.logprobs) sum += x;
  EXPECT_NEAR(one[0].score, sum / 6, 1e-6);

  // Width 3, 4 steps, no stop token, length_penalty 2: the 3 best extensions of all beams each step.
  const int beams = 3, steps = 4;
  std::vector<std::pair<std::vector<int64_t>, double>> live = {{prompt, 0.0}};
  for (int s = 0; s < steps; ++s) {
    std::vector<std::pair<std::vector<int64_t>, double>> cand;
    for (const auto& [seq, score] : live) {
      const std::vector<double> lp = next_logprobs(seq);
      for (int64_t v = 0; v < 50; ++v) {
        cand.push_back({seq, score + lp[size_t(v)]});
        cand.back().first.push_back(v);
      }
    }
    std::stable_sort(cand.begin(), cand.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
    cand.resize(beams);
    live = cand;
  }
  auto got = engine.beam_search({.prompt = prompt, .max_new_tokens = steps, .beam_size = beams, .length_penalty = 2.0});
  ASSERT_EQ(got.size(), size_t(beams));
  for (int k = 0; k < beams; ++k) {
    EXPECT_EQ(got[size_t(k)].tokens, live[size_t(k)].first) << "beam " << k;
    EXPECT_NEAR(got[size_t(k)].score, live[size_t(k)].second / (steps * steps), 1e-6) << "beam " << k;
  }

  // A stop token ranked first at the first step finishes the prompt alone (length 1), and nothing
  // can beat it: the search ends there.
  auto stopped = engine.beam_search({.prompt = prompt, .max_new_tokens = 6, .beam_size = 1, .stop_token = greedy_run.tokens[0]});
  ASSERT_EQ(stopped.size(), 1u);
  EXPECT_EQ(stopped[0].tokens, prompt);
  EXPECT_NEAR(stopped[0].score, greedy_run.logprobs[0], 1e-6);
  EXPECT_THROW(engine.beam_search({.prompt = prompt, .max_new_tokens = 0, .beam_size = 2}), Error);
  EXPECT_THROW(engine.beam_search({.prompt = prompt, .max_new_tokens = 40, .beam_size = 2}), Error);
}

// Note [Fair admission]: a group of six requests submitted first and a one-request group after
// it, two slots: the late group gets the second slot at once instead of waiting for four others.
TEST(InferenceEngine, GroupsAreAdmittedRoundRobin) {
  Tiny t;
  InferenceEngine engine(*t.model, t.ctx, 50, {.max_batch_size = 2});
  std::vector<std::string> first_token;  // "a0", "b0", ... in the order their first token came
  auto submit = [&](const std::string& name, uint64_t group, int64_t len) {
    GenerationRequest r = sampled({1, 2, 3}, 7);
    r.max_new_tokens = len;
    r.group = group;
    engine.submit(r, [&, name, n = 0](int64_t, double, const TopLogprobs&) mutable {
      if (n++ == 0) first_token.push_back(name);
      return true;
    });
  };
  for (int k = 0; k < 6; ++k) submit("a" + std::to_string(k), 1, 4);
  submit("b0", 2, 4);
  while (engine.step()) {
  }
  ASSERT_EQ(first_token.size(), 7u);
  EXPECT_EQ(first_token[0], "a0");
  EXPECT_EQ(first_token[1], "b0");
  EXPECT_EQ(first_token[2], "a1");
  // Group 0 (the default) keeps plain FIFO order.
  first_token.clear();
  for (int k = 0; k < 3; ++k) submit("c" + std::to_string(k), 0, 2);
  while (engine.step()) {
  }
  EXPECT_EQ(first_token, (std::vector<std::string>{"c0", "c1", "c2"}));
}

TEST(InferenceEngine, ACancelledFlagEndsWaitingAndActiveRequests) {
  Tiny t;
  InferenceEngine engine(*t.model, t.ctx, 50, {.max_batch_size = 1});
  auto flag = std::make_shared<std::atomic<bool>>(false);
  std::vector<GenerationResult> done(3);
  std::vector<int> tokens(3, 0);
  for (size_t i = 0; i < 3; ++i) {
    GenerationRequest r = sampled({4, 5}, i);
    r.max_new_tokens = 20;
    if (i < 2) r.cancelled = flag;  // the first (active) and the second (waiting)
    engine.submit(
        r, [&, i](int64_t, double, const TopLogprobs&) { return ++tokens[i] > 0; }, [&, i](const GenerationResult& g) { done[i] = g; });
  }
  engine.step();
  engine.step();
  const int before = tokens[0];  // prefill and decode steps of the first
  EXPECT_GT(before, 0);
  EXPECT_EQ(engine.waiting_count(), 2);
  flag->store(true);
  while (engine.step()) {
  }
  EXPECT_EQ(done[0].finish_reason, "cancelled");
  EXPECT_EQ(tokens[0], before) << "no token after the flag was set";
  EXPECT_EQ(done[1].finish_reason, "cancelled");
  EXPECT_EQ(tokens[1], 0) << "a cancelled waiting request is never computed";
  EXPECT_EQ(done[2].finish_reason, "length");
  EXPECT_EQ(tokens[2], 20);
  EXPECT_TRUE(engine.idle());
}

TEST(InferenceEngine, InvalidRequestsAreClearErrors) {
  Tiny t;
  InferenceEngine engine(*t.model, t.ctx, 50, {.max_batch_size = 2});
  GenerationRequest r;
  EXPECT_THROW(engine.validate(r), Error);  // empty prompt
  r.prompt = {1, 2, 60};
  EXPECT_THROW(engine.validate(r), Error);  // outside the vocabulary
  r.prompt = std::vector<int64_t>(30, 1);
  r.max_new_tokens = 11;
  EXPECT_THROW(engine.validate(r), Error);  // 41 > 40 positions
  r.max_new_tokens = 10;
  EXPECT_NO_THROW(engine.validate(r));
  r.sampling.temperature = -1.0f;
  EXPECT_THROW(engine.validate(r), Error);
}

TEST(Sampling, TopKAndTopPRestrictTheSupport) {
  // Probabilities ∝ exp(logits): token 3 > 1 > 4 > 0 > 2.
  const std::vector<float> logits = {0.5f, 2.0f, 0.1f, 2.5f, 1.0f};
  std::set<int64_t> top2, nucleus, all;
  for (uint64_t step = 0; step < 400; ++step) {
    top2.insert(sample_token(logits.data(), 5, {.top_k = 2, .seed = 1}, step));
    nucleus.insert(sample_token(logits.data(), 5, {.top_p = 0.7f, .seed = 2}, step));
    all.insert(sample_token(logits.data(), 5, {.seed = 3}, step));
  }
  EXPECT_EQ(top2, (std::set<int64_t>{1, 3}));
  // p = softmax: 3 -> 0.49, 1 -> 0.30 (cumulative 0.79 >= 0.7): the nucleus is {3, 1}.
  EXPECT_EQ(nucleus, (std::set<int64_t>{1, 3}));
  EXPECT_EQ(all.size(), 5u);
  EXPECT_EQ(sample_token(logits.data(), 5, {.greedy = true}, 0), 3);
  EXPECT_EQ(sample_token(logits.data(), 5, {.top_k = 1}, 0), 3);
  EXPECT_EQ(sample_token(logits.data(), 5, {.seed = 4}, 17), sample_token(logits.data(), 5, {.seed = 4}, 17));
}

TEST(Sampling, TopPDecaysToItsBoundAndPenaltiesShiftLogits) {
  const SamplingParams p{.top_p = 0.9f, .top_p_decay = 0.5f, .top_p_bound = 0.3f};
  EXPECT_FLOAT_EQ(top_p_at(p, 0), 0.9f);
  EXPECT_FLOAT_EQ(top_p_at(p, 1), 0.45f);
  EXPECT_FLOAT_EQ(top_p_at(p, 2), 0.3f);
  EXPECT_FLOAT_EQ(top_p_at(SamplingParams{.top_p = 0.9f, .top_p_decay = 0.5f}, 3), 0.9f * 0.125f);
  // Decayed to 0.3 at step 2: only the most likely token (p = 0.49) is left.
  const std::vector<float> logits = {0.5f, 2.0f, 0.1f, 2.5f, 1.0f};
  for (uint64_t seed = 0; seed < 50; ++seed) {
    SamplingParams q = p;
    q.seed = seed;
    EXPECT_EQ(sample_token(logits.data(), 5, q, 2), 3);
  }
  std::vector<float> l = {1.0f, 1.0f, 1.0f};
  apply_penalties(l.data(), 3, {0, 0, 2}, {.frequency_penalty = 0.5f, .presence_penalty = 0.25f});
  EXPECT_FLOAT_EQ(l[0], 1.0f - 2 * 0.5f - 0.25f);
  EXPECT_FLOAT_EQ(l[1], 1.0f);
  EXPECT_FLOAT_EQ(l[2], 1.0f - 0.5f - 0.25f);
  auto top = top_logprobs(logits.data(), 5, 2);
  ASSERT_EQ(top.size(), 2u);
  EXPECT_EQ(top[0].first, 3);
  EXPECT_EQ(top[1].first, 1);
  EXPECT_NEAR(top[1].second, token_logprob(logits.data(), 5, 1), 1e-12);
}

TEST(Sampling, LogprobIsLogSoftmax) {
  const std::vector<float> logits = {1.0f, 2.0f, 3.0f};
  const double z = std::log(std::exp(1.0) + std::exp(2.0) + std::exp(3.0));
  EXPECT_NEAR(token_logprob(logits.data(), 3, 1), 2.0 - z, 1e-12);
}

}  // namespace
}  // namespace megatron
