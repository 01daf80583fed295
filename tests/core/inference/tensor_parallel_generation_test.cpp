// InferenceEngine under tensor parallelism (Note [Tensor-parallel inference]) in one process: the
// ranks are threads over a local communicator; rank 0 runs the engine with an InferenceGroup and
// the others follow. Generation (greedy with prompt and top-k log-probabilities, seeded sampling,
// more requests than slots) and beam search give the single-process tokens, and log-probabilities
// within 1e-5 (the row-parallel sums change order), for a GPT and a Llama-style model (GQA; at TP 4
// one query group per rank) from the same initialisation; each rank caches its own query groups.
// An idle leader's heartbeats keep the followers within their collective timeout. The same runs
// end to end under mpirun in tests/core/parallel/text_generation_server_tp_test.cpp.
#include <gtest/gtest.h>

#include <set>
#include <thread>

#include "megatron/core/inference/generation.h"
#include "megatron/core/parallel_state.h"
#include "megatron/runtime/check.h"
#include "tests/core/model_test_util.h"

namespace megatron {
namespace {

constexpr int64_t kVocab = 120;

TransformerConfig model_config(bool llama) {
  TransformerConfig c;
  c.num_layers = 2;
  c.hidden_size = 32;
  c.num_attention_heads = 4;
  c.vocab_size = kVocab;
  c.make_vocab_size_divisible_by = 32;  // 128 for TP 1, 2 and 4 alike
  c.max_position_embeddings = 32;
  c.hidden_dropout = c.attention_dropout = 0.0f;
  if (llama) {
    c.num_attention_heads = 8;
    c.num_query_groups = 4;
    testing::use_llama_layers(c);
    c.ffn_hidden_size = 48;
    c.seq_length = 32;
  }
  return c;
}

std::vector<GenerationRequest> requests() {
  std::vector<GenerationRequest> rs(4);
  rs[0].prompt = {5, 17, 99, 3, 42};
  rs[0].max_new_tokens = 10;
  rs[0].sampling.greedy = true;
  rs[0].prompt_logprobs = true;
  rs[0].top_logprobs = 3;
  rs[1].prompt = {7};
  rs[1].max_new_tokens = 12;
  rs[1].sampling.temperature = 0.8f;
  rs[1].sampling.top_k = 20;
  rs[1].sampling.seed = 11;
  rs[2].prompt = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  rs[2].max_new_tokens = 8;
  rs[2].sampling.greedy = true;
  rs[3].prompt = {64, 8};
  rs[3].max_new_tokens = 9;
  rs[3].sampling.top_p = 0.9f;
  rs[3].sampling.seed = 5;
  return rs;
}

struct Outcome {
  std::vector<GenerationResult> results;
  std::vector<BeamHypothesis> beams;
  int64_t cached_groups = 0;  // query groups in this rank's KV cache
};

// One rank (world: null for the single process); the followers return only cached_groups.
Outcome run_rank(std::unique_ptr<Communicator> world, int tp, bool llama) {
  std::unique_ptr<ParallelState> ps;
  if (world) {
    ParallelConfig pc;
    pc.tensor_model_parallel_size = tp;
    ps = std::make_unique<ParallelState>(std::move(world), pc);
  }
  Context ctx(Device::cpu(), 1234);
  TransformerConfig c = model_config(llama);
  c.tensor_model_parallel_size = tp;
  GPTModel model(c, Device::cpu(), ps.get());
  model.init_weights(1234);
  Outcome out;
  out.cached_groups = KVCache(model.config(), 1, 4, Device::cpu()).keys[0].size(2);
  std::unique_ptr<InferenceGroup> group;
  if (ps) group = std::make_unique<InferenceGroup>(ps->tensor());
  if (group && !group->leader()) {
    group->follow(model, ctx);
    return out;
  }
  InferenceEngine engine(model, ctx, kVocab, {.max_batch_size = 2, .group = group.get()});
  out.results = engine.generate(requests());
  BeamSearchRequest beam;
  beam.prompt = {9, 30, 2};
  beam.max_new_tokens = 5;
  beam.beam_size = 3;
  out.beams = engine.beam_search(beam);
  if (group) group->stop(ctx);
  return out;
}

std::vector<Outcome> run_tp(int tp, bool llama) {
  auto comms = make_local_group(tp);
  std::vector<Outcome> outcomes(static_cast<size_t>(tp));
  std::vector<std::string> errors(static_cast<size_t>(tp));
  std::vector<std::thread> threads;
  for (int r = 0; r < tp; ++r) {
    threads.emplace_back([&, r] {
      try {
        outcomes[size_t(r)] = run_rank(std::move(comms[size_t(r)]), tp, llama);
      } catch (const std::exception& e) {
        errors[size_t(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < tp; ++r) EXPECT_TRUE(errors[size_t(r)].empty()) << "rank " << r << ": " << errors[size_t(r)];
  return outcomes;
}

void expect_near(const std::vector<double>& got, const std::vector<double>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-5) << what << " at " << i;
}

struct Case {
  int tp;
  bool llama;
};

class TensorParallelGeneration : public ::testing::TestWithParam<Case> {};

TEST_P(TensorParallelGeneration, EqualsOneProcess) {
  const auto [tp, llama] = GetParam();
  const Outcome one = run_rank(nullptr, 1, llama);
  const std::vector<Outcome> ranks = run_tp(tp, llama);
  const Outcome& lead = ranks[0];
  constexpr int64_t groups = 4;  // Llama: 4 query groups of 2 heads; GPT: one group per head
  EXPECT_EQ(one.cached_groups, groups);
  for (const Outcome& r : ranks) EXPECT_EQ(r.cached_groups, groups / tp);
  // Not a degenerate model (uniform logits would make every layout agree): the samples vary, the
  // greedy tokens are not certain.
  ASSERT_EQ(one.results[1].tokens.size(), 12u);
  EXPECT_GT(std::set<int64_t>(one.results[1].tokens.begin(), one.results[1].tokens.end()).size(), 3u);
  EXPECT_LT(one.results[0].logprobs[0], -0.01);
  ASSERT_EQ(lead.results.size(), one.results.size());
  for (size_t i = 0; i < one.results.size(); ++i) {
    const GenerationResult &a = one.results[i], &b = lead.results[i];
    const std::string what = "request " + std::to_string(i);
    EXPECT_EQ(b.tokens, a.tokens) << what;
    EXPECT_EQ(b.finish_reason, a.finish_reason) << what;
    expect_near(b.logprobs, a.logprobs, what + " logprobs");
    expect_near(b.prompt_logprobs, a.prompt_logprobs, what + " prompt logprobs");
    ASSERT_EQ(b.top_logprobs.size(), a.top_logprobs.size()) << what;
    for (size_t t = 0; t < a.top_logprobs.size(); ++t) {
      ASSERT_EQ(b.top_logprobs[t].size(), a.top_logprobs[t].size());
      for (size_t k = 0; k < a.top_logprobs[t].size(); ++k) {
        EXPECT_EQ(b.top_logprobs[t][k].first, a.top_logprobs[t][k].first) << what << " top at " << t;
        EXPECT_NEAR(b.top_logprobs[t][k].second, a.top_logprobs[t][k].second, 1e-5) << what << " top at " << t;
      }
    }
  }
  ASSERT_EQ(lead.beams.size(), one.beams.size());
  for (size_t k = 0; k < one.beams.size(); ++k) {
    EXPECT_EQ(lead.beams[k].tokens, one.beams[k].tokens) << "beam " << k;
    EXPECT_NEAR(lead.beams[k].score, one.beams[k].score, 1e-5) << "beam " << k;
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, TensorParallelGeneration,
                         ::testing::Values(Case{2, false}, Case{2, true}, Case{4, true}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return std::string(info.param.llama ? "Llama" : "Gpt") + "Tp" +
                                  std::to_string(info.param.tp);
                         });

// An idle leader's heartbeats keep the followers waiting past their collective timeout; without
// them a follower's wait times out (the leader's stop then finds nobody).
TEST(InferenceGroup, HeartbeatsKeepAnIdleFollowerWaiting) {
  for (bool heartbeats : {true, false}) {
    auto comms = make_local_group(2);
    for (auto& c : comms) c->set_timeout(std::chrono::milliseconds(400));
    std::string leader_error, follower_error;
    std::thread follower([&] {
      try {
        Context ctx(Device::cpu(), 1);
        GPTModel model(model_config(false), Device::cpu());
        InferenceGroup(*comms[1]).follow(model, ctx);
      } catch (const std::exception& e) {
        follower_error = e.what();
      }
    });
    try {
      Context ctx(Device::cpu(), 1);
      InferenceGroup group(*comms[0]);
      EXPECT_EQ(group.heartbeat_interval(), std::chrono::milliseconds(100));
      for (int i = 0; i < 12; ++i) {  // idle for three timeouts
        std::this_thread::sleep_for(group.heartbeat_interval());
        if (heartbeats) group.heartbeat(ctx);
      }
      group.stop(ctx);
    } catch (const std::exception& e) {
      leader_error = e.what();
    }
    follower.join();
    if (heartbeats) {
      EXPECT_EQ(follower_error, "");
      EXPECT_EQ(leader_error, "");
    } else {
      EXPECT_NE(follower_error.find("broadcast"), std::string::npos) << follower_error;
    }
  }
}

}  // namespace
}  // namespace megatron
