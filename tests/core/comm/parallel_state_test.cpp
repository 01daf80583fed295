// ParallelState: Megatron's rank order tp-cp-ep-dp-pp and its groups, checked against the example in
// Megatron-Core's initialize_model_parallel docstring (16 GPUs, TP 2, PP 4: tensor groups [g0, g1],
// [g2, g3], ...; pipeline groups [g0, g4, g8, g12], ...; data groups [g0, g2], [g1, g3], [g4, g6],
// ...), plus the embedding group and the divisibility errors. Ranks are threads (make_local_group).
#include <gtest/gtest.h>

#include <functional>
#include <mutex>
#include <thread>

#include "megatron/core/parallel_state.h"

namespace megatron {
namespace {

struct Seen {
  std::vector<int> tp, pp, dp, mp, embedding;
  int tp_rank = -1, pp_rank = -1, dp_rank = -1;
  bool first = false, last = false;
};

std::vector<Seen> build(int world, const ParallelConfig& c) {
  auto comms = make_local_group(world);
  std::vector<Seen> seen(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r]() {
      ParallelState ps(std::move(comms[size_t(r)]), c);
      Seen& s = seen[size_t(r)];
      s.tp = ps.tensor().global_ranks();
      s.pp = ps.pipeline().global_ranks();
      s.dp = ps.data().global_ranks();
      s.mp = ps.model().global_ranks();
      if (ps.embedding()) s.embedding = ps.embedding()->global_ranks();
      s.tp_rank = ps.tp_rank(), s.pp_rank = ps.pp_rank(), s.dp_rank = ps.dp_rank();
      s.first = ps.is_pipeline_first_stage(), s.last = ps.is_pipeline_last_stage();
      EXPECT_EQ(ps.world_rank_of(ps.tp_rank(), ps.cp_rank(), ps.dp_rank(), ps.pp_rank()), r);
    });
  }
  for (auto& t : threads) t.join();
  return seen;
}

TEST(ParallelState, MegatronDocstringExample) {
  ParallelConfig c;
  c.tensor_model_parallel_size = 2;
  c.pipeline_model_parallel_size = 4;
  const std::vector<Seen> seen = build(16, c);
  EXPECT_EQ(seen[0].tp, (std::vector<int>{0, 1}));
  EXPECT_EQ(seen[3].tp, (std::vector<int>{2, 3}));
  EXPECT_EQ(seen[0].pp, (std::vector<int>{0, 4, 8, 12}));
  EXPECT_EQ(seen[13].pp, (std::vector<int>{1, 5, 9, 13}));
  EXPECT_EQ(seen[0].dp, (std::vector<int>{0, 2}));
  EXPECT_EQ(seen[1].dp, (std::vector<int>{1, 3}));
  EXPECT_EQ(seen[6].dp, (std::vector<int>{4, 6}));
  EXPECT_EQ(seen[0].mp, (std::vector<int>{0, 1, 4, 5, 8, 9, 12, 13}));
  EXPECT_EQ(seen[0].embedding, (std::vector<int>{0, 12}));
  EXPECT_EQ(seen[13].embedding, (std::vector<int>{1, 13}));
  EXPECT_TRUE(seen[4].embedding.empty());  // a middle stage
  EXPECT_EQ(seen[9].tp_rank, 1);
  EXPECT_EQ(seen[9].dp_rank, 0);
  EXPECT_EQ(seen[9].pp_rank, 2);
  EXPECT_TRUE(seen[1].first && !seen[1].last);
  EXPECT_TRUE(seen[15].last && !seen[15].first);
}

TEST(ParallelState, WorldSizeMustDivide) {
  auto comms = make_local_group(3);
  std::vector<std::string> errors(3);
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r]() {
      ParallelConfig c;
      c.tensor_model_parallel_size = 2;
      try {
        ParallelState ps(std::move(comms[size_t(r)]), c);
      } catch (const Error& e) {
        errors[size_t(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("world size 3 is not divisible by --tensor-model-parallel-size (2)"), std::string::npos) << e;
  }
}

TEST(ParallelState, VirtualStagesNeedPipelineParallelism) {
  auto comms = make_local_group(1);
  ParallelConfig c;
  c.virtual_pipeline_model_parallel_size = 2;
  EXPECT_THROW(ParallelState(std::move(comms[0]), c), Error);
}

}  // namespace
}  // namespace megatron
