// ParallelState: Megatron's rank orders and their groups, checked against the example in
// Megatron-Core's initialize_model_parallel docstring (16 GPUs, TP 2, PP 4: tensor groups [g0, g1],
// [g2, g3], ...; pipeline groups [g0, g4, g8, g12], ...; data groups [g0, g2], [g1, g3], [g4, g6],
// ...), the expert groups of four layouts written out from Megatron's RankGenerator, plus the
// embedding group and the divisibility errors. Ranks are threads (make_local_group).
#include <gtest/gtest.h>

#include <functional>
#include <mutex>
#include <thread>

#include "megatron/core/parallel_state.h"
#include "megatron/core/process_groups_config.h"

namespace megatron {
namespace {

struct Seen {
  std::vector<int> tp, pp, dp, cp, dp_cp, tp_cp, mp, embedding;
  std::vector<int> ep, etp, edp, etp_ep, etp_ep_pp;
  std::vector<int> pg_tp_ep;  // ProcessGroupCollection::from(ps).tp_ep (empty: null, a one-rank group)
  int pg_tp_ep_rank = -1;
  int tp_rank = -1, pp_rank = -1, dp_rank = -1, cp_rank = -1;
  int ep_rank = -1, etp_rank = -1, edp_rank = -1;
  int ep_size = -1, etp_size = -1, edp_size = -1;
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
      s.cp = ps.context().global_ranks();
      s.dp_cp = ps.data_context().global_ranks();
      s.tp_cp = ps.tensor_context().global_ranks();
      s.mp = ps.model().global_ranks();
      if (ps.embedding()) s.embedding = ps.embedding()->global_ranks();
      s.ep = ps.expert_model().global_ranks();
      s.etp = ps.expert_tensor().global_ranks();
      s.edp = ps.expert_data().global_ranks();
      s.etp_ep = ps.expert_tensor_and_model().global_ranks();
      s.etp_ep_pp = ps.expert_tensor_model_pipeline().global_ranks();
      const ProcessGroupCollection pg = ProcessGroupCollection::from(ps);
      if (pg.tp_ep) s.pg_tp_ep = pg.tp_ep->global_ranks(), s.pg_tp_ep_rank = pg.tp_ep->rank();
      s.tp_rank = ps.tp_rank(), s.pp_rank = ps.pp_rank(), s.dp_rank = ps.dp_rank(), s.cp_rank = ps.cp_rank();
      s.ep_rank = ps.ep_rank(), s.etp_rank = ps.etp_rank(), s.edp_rank = ps.edp_rank();
      s.ep_size = ps.ep_size(), s.etp_size = ps.etp_size(), s.edp_size = ps.edp_size();
      s.first = ps.is_pipeline_first_stage(), s.last = ps.is_pipeline_last_stage();
      EXPECT_EQ(ps.world_rank_of(ps.tp_rank(), ps.cp_rank(), ps.dp_rank(), ps.pp_rank()), r);
      EXPECT_EQ(ps.expert_world_rank_of(ps.etp_rank(), ps.ep_rank(), ps.edp_rank(), ps.pp_rank()), r);
      // A rank's coordinate is its place in the group of that dimension.
      EXPECT_EQ(ps.expert_model().rank(), ps.ep_rank());
      EXPECT_EQ(ps.expert_tensor().rank(), ps.etp_rank());
      EXPECT_EQ(ps.expert_data().rank(), ps.edp_rank());
      EXPECT_EQ(ps.expert_model().size(), ps.ep_size());
      EXPECT_EQ(ps.expert_tensor().size(), ps.etp_size());
      EXPECT_EQ(ps.expert_data().size(), ps.edp_size());
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

// The groups of one kind, as Megatron's RankGenerator.get_ranks(token) lists them.
using Groups = std::vector<std::vector<int>>;

// Every rank's group of one kind equals the listed group that holds it; the list is a partition of
// the world (so a typo in a hand-written list shows too).
void expect_groups(const std::vector<Seen>& seen, std::vector<int> Seen::*kind, const Groups& groups,
                   const char* name) {
  std::vector<int> count(seen.size(), 0);
  for (const auto& g : groups) {
    for (int r : g) {
      ASSERT_TRUE(r >= 0 && r < int(seen.size())) << name << ": rank " << r;
      ++count[size_t(r)];
      EXPECT_EQ(seen[size_t(r)].*kind, g) << name << " group of rank " << r;
    }
  }
  for (size_t r = 0; r < count.size(); ++r) EXPECT_EQ(count[r], 1) << name << ": rank " << r << " listed";
}

Groups singletons(int world) {
  Groups g;
  for (int r = 0; r < world; ++r) g.push_back({r});
  return g;
}

// Megatron builds the groups with generate_masked_orthogonal_rank_groups over the order
// "tp-cp-ep-dp-pp": the dense generator with ep = 1, the expert one with cp = 1 and
// tp = expert-TP. A dimension's stride is the product of the sizes before it; a group holds the
// ranks whose other coordinates are fixed, in increasing order. The layouts below apply it by hand.

TEST(ParallelState, ExpertGroupsWorld16Tp2Pp2Ep4Etp1) {
  // Dense sizes tp 2, cp 1, dp 4, pp 2: strides tp 1, dp 2, pp 8. Expert sizes etp 1, ep 4,
  // edp 16 / (1·4·2) = 2, pp 2: strides ep 1, edp 4, pp 8.
  ParallelConfig c;
  c.tensor_model_parallel_size = 2;
  c.pipeline_model_parallel_size = 2;
  c.expert_model_parallel_size = 4;
  c.expert_tensor_parallel_size = 1;
  const std::vector<Seen> seen = build(16, c);
  expect_groups(seen, &Seen::tp, {{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}}, "tp");
  expect_groups(seen, &Seen::cp, singletons(16), "cp");
  expect_groups(seen, &Seen::dp, {{0, 2, 4, 6}, {1, 3, 5, 7}, {8, 10, 12, 14}, {9, 11, 13, 15}}, "dp");
  expect_groups(seen, &Seen::pp, {{0, 8}, {1, 9}, {2, 10}, {3, 11}, {4, 12}, {5, 13}, {6, 14}, {7, 15}}, "pp");
  expect_groups(seen, &Seen::mp, {{0, 1, 8, 9}, {2, 3, 10, 11}, {4, 5, 12, 13}, {6, 7, 14, 15}}, "tp-pp");
  expect_groups(seen, &Seen::ep, {{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}}, "ep");
  expect_groups(seen, &Seen::etp, singletons(16), "expert tp");
  expect_groups(seen, &Seen::edp, {{0, 4}, {1, 5}, {2, 6}, {3, 7}, {8, 12}, {9, 13}, {10, 14}, {11, 15}}, "expert dp");
  expect_groups(seen, &Seen::etp_ep, {{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}}, "tp-ep");
  expect_groups(seen, &Seen::etp_ep_pp, {{0, 1, 2, 3, 8, 9, 10, 11}, {4, 5, 6, 7, 12, 13, 14, 15}}, "tp-ep-pp");
  EXPECT_EQ(seen[13].ep_rank, 1);
  EXPECT_EQ(seen[13].edp_rank, 1);
  EXPECT_EQ(seen[13].etp_rank, 0);
  EXPECT_EQ(seen[13].edp_size, 2);
}

TEST(ParallelState, ExpertGroupsWorld8Tp2Ep2Etp2) {
  // Dense sizes tp 2, dp 4: strides tp 1, dp 2. Expert sizes etp 2, ep 2, edp 8 / (2·2·1) = 2:
  // strides etp 1, ep 2, edp 4.
  ParallelConfig c;
  c.tensor_model_parallel_size = 2;
  c.expert_model_parallel_size = 2;
  c.expert_tensor_parallel_size = 2;
  const std::vector<Seen> seen = build(8, c);
  expect_groups(seen, &Seen::tp, {{0, 1}, {2, 3}, {4, 5}, {6, 7}}, "tp");
  expect_groups(seen, &Seen::dp, {{0, 2, 4, 6}, {1, 3, 5, 7}}, "dp");
  expect_groups(seen, &Seen::pp, singletons(8), "pp");
  expect_groups(seen, &Seen::etp, {{0, 1}, {2, 3}, {4, 5}, {6, 7}}, "expert tp");
  expect_groups(seen, &Seen::ep, {{0, 2}, {1, 3}, {4, 6}, {5, 7}}, "ep");
  expect_groups(seen, &Seen::edp, {{0, 4}, {1, 5}, {2, 6}, {3, 7}}, "expert dp");
  expect_groups(seen, &Seen::etp_ep, {{0, 1, 2, 3}, {4, 5, 6, 7}}, "tp-ep");
  expect_groups(seen, &Seen::etp_ep_pp, {{0, 1, 2, 3}, {4, 5, 6, 7}}, "tp-ep-pp");
  EXPECT_EQ(seen[6].etp_rank, 0);
  EXPECT_EQ(seen[6].ep_rank, 1);
  EXPECT_EQ(seen[6].edp_rank, 1);
  EXPECT_EQ(seen[6].etp_size, 2);
}

// The collection's tp_ep (the token dispatchers' group) is expert-tensor-and-model, its rank
// etp + ETP·ep; null when that group has one rank.
TEST(ParallelState, CollectionTpEpIsExpertTensorAndModel) {
  ParallelConfig c;
  c.tensor_model_parallel_size = 2;
  c.expert_model_parallel_size = 2;
  c.expert_tensor_parallel_size = 2;
  std::vector<Seen> seen = build(8, c);
  expect_groups(seen, &Seen::pg_tp_ep, {{0, 1, 2, 3}, {4, 5, 6, 7}}, "collection tp-ep");
  for (const Seen& s : seen) EXPECT_EQ(s.pg_tp_ep_rank, s.etp_rank + 2 * s.ep_rank);
  c.tensor_model_parallel_size = 1;
  c.expert_tensor_parallel_size = 1;
  c.expert_model_parallel_size = 4;
  seen = build(8, c);
  expect_groups(seen, &Seen::pg_tp_ep, {{0, 1, 2, 3}, {4, 5, 6, 7}}, "collection tp-ep, etp 1");
  for (const Seen& s : seen) EXPECT_EQ(s.pg_tp_ep_rank, s.ep_rank);
  c.expert_model_parallel_size = 1;
  seen = build(4, c);
  for (const Seen& s : seen) EXPECT_TRUE(s.pg_tp_ep.empty()) << "one-rank groups are null";
}

TEST(ParallelState, ExpertGroupsWorld8Cp2Ep4) {
  // Dense sizes tp 1, cp 2, dp 4: strides cp 1, dp 2. Expert sizes etp 1 (TP's), ep 4,
  // edp 8 / 4 = 2: strides ep 1, edp 4. The experts fold CP into EP.
  ParallelConfig c;
  c.context_parallel_size = 2;
  c.expert_model_parallel_size = 4;
  const std::vector<Seen> seen = build(8, c);
  expect_groups(seen, &Seen::tp, singletons(8), "tp");
  expect_groups(seen, &Seen::cp, {{0, 1}, {2, 3}, {4, 5}, {6, 7}}, "cp");
  expect_groups(seen, &Seen::dp, {{0, 2, 4, 6}, {1, 3, 5, 7}}, "dp");
  expect_groups(seen, &Seen::dp_cp, {{0, 1, 2, 3, 4, 5, 6, 7}}, "dp-cp");
  expect_groups(seen, &Seen::tp_cp, {{0, 1}, {2, 3}, {4, 5}, {6, 7}}, "tp-cp");
  expect_groups(seen, &Seen::mp, singletons(8), "tp-pp");
  expect_groups(seen, &Seen::ep, {{0, 1, 2, 3}, {4, 5, 6, 7}}, "ep");
  expect_groups(seen, &Seen::etp, singletons(8), "expert tp");
  expect_groups(seen, &Seen::edp, {{0, 4}, {1, 5}, {2, 6}, {3, 7}}, "expert dp");
  expect_groups(seen, &Seen::etp_ep, {{0, 1, 2, 3}, {4, 5, 6, 7}}, "tp-ep");
  expect_groups(seen, &Seen::etp_ep_pp, {{0, 1, 2, 3}, {4, 5, 6, 7}}, "tp-ep-pp");
  EXPECT_EQ(seen[5].cp_rank, 1);
  EXPECT_EQ(seen[5].dp_rank, 2);
  EXPECT_EQ(seen[5].ep_rank, 1);
  EXPECT_EQ(seen[5].edp_rank, 1);
  EXPECT_EQ(seen[5].etp_size, 1);
}

TEST(ParallelState, ExpertGroupsWorld16Tp2Cp2Pp2Ep2Etp1) {
  // Dense sizes tp 2, cp 2, dp 16 / (2·2·2) = 2, pp 2: strides tp 1, cp 2, dp 4, pp 8. Expert
  // sizes etp 1, ep 2, edp 16 / (1·2·2) = 4, pp 2: strides ep 1, edp 2, pp 8.
  ParallelConfig c;
  c.tensor_model_parallel_size = 2;
  c.context_parallel_size = 2;
  c.pipeline_model_parallel_size = 2;
  c.expert_model_parallel_size = 2;
  c.expert_tensor_parallel_size = 1;
  const std::vector<Seen> seen = build(16, c);
  expect_groups(seen, &Seen::tp, {{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}}, "tp");
  expect_groups(seen, &Seen::cp, {{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}}, "cp");
  expect_groups(seen, &Seen::dp, {{0, 4}, {1, 5}, {2, 6}, {3, 7}, {8, 12}, {9, 13}, {10, 14}, {11, 15}}, "dp");
  expect_groups(seen, &Seen::pp, {{0, 8}, {1, 9}, {2, 10}, {3, 11}, {4, 12}, {5, 13}, {6, 14}, {7, 15}}, "pp");
  expect_groups(seen, &Seen::dp_cp, {{0, 2, 4, 6}, {1, 3, 5, 7}, {8, 10, 12, 14}, {9, 11, 13, 15}}, "dp-cp");
  expect_groups(seen, &Seen::tp_cp, {{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}}, "tp-cp");
  expect_groups(seen, &Seen::mp, {{0, 1, 8, 9}, {2, 3, 10, 11}, {4, 5, 12, 13}, {6, 7, 14, 15}}, "tp-pp");
  expect_groups(seen, &Seen::embedding, {{0, 8}, {1, 9}, {2, 10}, {3, 11}, {4, 12}, {5, 13}, {6, 14}, {7, 15}},
                "embedding");
  expect_groups(seen, &Seen::ep, {{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}}, "ep");
  expect_groups(seen, &Seen::etp, singletons(16), "expert tp");
  expect_groups(seen, &Seen::edp, {{0, 2, 4, 6}, {1, 3, 5, 7}, {8, 10, 12, 14}, {9, 11, 13, 15}}, "expert dp");
  expect_groups(seen, &Seen::etp_ep, {{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}}, "tp-ep");
  expect_groups(seen, &Seen::etp_ep_pp, {{0, 1, 8, 9}, {2, 3, 10, 11}, {4, 5, 12, 13}, {6, 7, 14, 15}}, "tp-ep-pp");
  EXPECT_EQ(seen[11].tp_rank, 1);
  EXPECT_EQ(seen[11].cp_rank, 1);
  EXPECT_EQ(seen[11].dp_rank, 0);
  EXPECT_EQ(seen[11].pp_rank, 1);
  EXPECT_EQ(seen[11].ep_rank, 1);
  EXPECT_EQ(seen[11].edp_rank, 1);
  EXPECT_EQ(seen[11].edp_size, 4);
}

TEST(ParallelState, DenseExpertGroupsAreTheDenseGroups) {
  // EP 1 and expert-TP = TP (the default): expert-tensor is tensor, expert-data is data-context,
  // expert-tensor-model-pipeline is model; each expert-model group is one rank.
  ParallelConfig c;
  c.tensor_model_parallel_size = 2;
  c.context_parallel_size = 2;
  c.pipeline_model_parallel_size = 2;
  const std::vector<Seen> seen = build(16, c);
  for (const Seen& s : seen) {
    EXPECT_EQ(s.etp, s.tp);
    EXPECT_EQ(s.etp_ep, s.tp);
    EXPECT_EQ(s.etp_ep_pp, s.mp);
    EXPECT_EQ(s.edp, s.dp_cp);
    EXPECT_EQ(s.ep_size, 1);
    EXPECT_EQ(s.etp_size, 2);
    EXPECT_EQ(s.edp_size, 4);
  }
  expect_groups(seen, &Seen::ep, singletons(16), "ep");
}

// Every rank of a world of `world` ranks builds `c`; returns each rank's error ("" if none).
std::vector<std::string> errors_of(int world, const ParallelConfig& c) {
  auto comms = make_local_group(world);
  std::vector<std::string> errors(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r]() {
      try {
        ParallelState ps(std::move(comms[size_t(r)]), c);
      } catch (const Error& e) {
        errors[size_t(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

TEST(ParallelState, ExpertSizesMustDivideTheWorld) {
  ParallelConfig c;
  c.pipeline_model_parallel_size = 2;
  c.expert_model_parallel_size = 3;
  for (const std::string& e : errors_of(8, c)) {
    EXPECT_EQ(e,
              "world size 8 is not divisible by --expert-tensor-parallel-size (1) x --expert-model-parallel-size (3) x "
              "--pipeline-model-parallel-size (2): launch a multiple of 6 processes or change the expert sizes");
  }
  c.expert_model_parallel_size = 1;
  c.expert_tensor_parallel_size = -1;
  for (const std::string& e : errors_of(2, c)) {
    EXPECT_EQ(e, "--expert-tensor-parallel-size -1: use a size >= 1, or leave it unset for the tensor-parallel size");
  }
}

TEST(ParallelState, WorldSizeMustDivide) {
  ParallelConfig c;
  c.tensor_model_parallel_size = 2;
  for (const std::string& e : errors_of(3, c)) {
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
