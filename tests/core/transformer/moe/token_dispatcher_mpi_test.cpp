// The multi-rank token dispatchers (allgather, alltoall, flex) under mpirun, against one process:
// every rank routes its own random tokens, dispatches them, runs its local experts (SequentialMLP),
// combines, and runs all of it backward. The reference, in the same process, runs each rank's
// tokens through a one-rank router, dispatcher and every expert, with the same parameter values
// (copied by name: expert parameters carry their global index). Checked within 1e-5: each rank's
// output, input gradient and router-probability gradient, each expert's weight gradients (summed
// over the expert-data-parallel ranks that hold the same shard, compared with the reference's slice
// under expert tensor parallelism) and the router's weight gradient (summed over the world).
// Layouts: EP 2 and expert-TP 2 on 2 ranks; EP 4, EP 2 × expert-data 2, EP 2 × expert-TP 2 (and the
// same with attention TP 2) on 4; each with and without drop-and-pad. The whole MoELayer over the
// same layouts (output and input gradient), and the bad inputs, each one clear line.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "megatron/core/distributed/param_and_grad_buffer.h"
#include "megatron/core/parallel_state.h"
#include "megatron/core/transformer/moe/experts.h"
#include "megatron/core/transformer/moe/moe_layer.h"
#include "megatron/core/transformer/moe/router.h"
#include "megatron/core/transformer/moe/token_dispatcher.h"
#include "megatron/kernels/ops.h"
#include "tests/core/comm/mpi/mpi_test.h"
#include "tests/test_util.h"

namespace megatron::testing {
namespace {

constexpr int kExperts = 8, kTopk = 2;
constexpr int64_t kSeq = 4, kMicroBatch = 2, kTokens = kSeq * kMicroBatch, kHidden = 8, kFfn = 6;
const std::string kPrefix = "decoder.layers.0.mlp";

struct Layout {
  int tp, ep, etp;
};

TransformerConfig transformer_config(bool bias) {
  TransformerConfig tc;
  tc.num_layers = 1;
  tc.hidden_size = kHidden;
  tc.num_attention_heads = 2;
  tc.vocab_size = 16;
  tc.activation = "swiglu";
  tc.add_bias_linear = bias;
  tc.max_position_embeddings = 8;
  tc.finalize();
  return tc;
}

moe::RouterConfig router_config(bool capacity) {
  moe::RouterConfig rc;
  rc.num_experts = kExperts;
  rc.topk = kTopk;
  // Capacity 2 per expert (8 tokens · top-2 / 8 experts): popular experts drop tokens, the others
  // are padded by the dispatcher.
  if (capacity) rc.capacity_factor = 1.0f;
  return rc;
}

int64_t capacity_of(bool capacity) { return capacity ? moe::expert_capacity(kTokens * kTopk, kExperts, 1.0f) : 0; }

// One MoE block (router -> dispatcher -> experts -> combine) over the groups of `pg`.
struct Block {
  ParamAndGradBuffer params{DType::Float32, Device::cpu()};
  std::unique_ptr<moe::TopKRouter> router;
  std::unique_ptr<moe::MoETokenDispatcher> dispatcher;
  std::unique_ptr<moe::SequentialMLP> experts;

  Block(const std::string& type, bool capacity, bool bias, const ProcessGroupCollection& pg) {
    const TransformerConfig tc = transformer_config(bias);
    router = std::make_unique<moe::TopKRouter>(router_config(capacity), kHidden, params, kPrefix + ".router", 0, 1);
    moe::DispatcherConfig dc;
    dc.type = type;
    dc.num_experts = kExperts;
    dc.capacity = capacity_of(capacity);
    dispatcher = moe::make_token_dispatcher(dc, pg);
    experts = std::make_unique<moe::SequentialMLP>(
        tc, dispatcher->num_local_experts(), dispatcher->first_local_expert(), kFfn, params, kPrefix + ".experts", pg);
    params.allocate();
    params.zero_grad();
  }

  struct Result {
    std::vector<float> y, grad_x, grad_probs;
    std::vector<int64_t> tokens_per_expert;
  };
  Result run(Context& ctx, const Tensor& x, const Tensor& grad_y) {
    moe::TopKRouter::Saved rs;
    const moe::TopKRouter::Output routed = router->forward(ctx, x, kSeq, kMicroBatch, nullptr, rs);
    std::unique_ptr<moe::MoETokenDispatcher::Saved> ds;
    const moe::MoETokenDispatcher::Dispatched d = dispatcher->dispatch(ctx, x, routed.probs, routed.routing_map, ds);
    moe::SequentialMLP::Saved es;
    const Tensor expert_out = experts->forward(ctx, d.tokens, d.probs, d.tokens_per_expert, es);
    Result r;
    r.y = dispatcher->combine(ctx, expert_out, *ds).to_floats();
    r.tokens_per_expert = d.tokens_per_expert;
    const Tensor grad_expert_out = dispatcher->combine_backward(ctx, grad_y, *ds);
    Tensor grad_row_probs;
    const Tensor grad_rows = experts->backward(ctx, grad_expert_out, es, grad_row_probs);
    Tensor grad_x, grad_probs;
    dispatcher->dispatch_backward(ctx, grad_rows, grad_row_probs, *ds, grad_x, grad_probs);
    ops::add(ctx, grad_x, router->backward(ctx, grad_probs, rs), grad_x);
    r.grad_x = grad_x.to_floats();
    r.grad_probs = grad_probs.to_floats();
    return r;
  }
};

// fn(global flat index, local flat index) for every element of p's shard (all of p when unsharded).
void for_each_shard_element(const Parameter& p, const std::function<void(int64_t global, int64_t local)>& fn) {
  const ShardSpec spec = p.shard.global_shape.empty() ? unsharded(p.data.shape()) : p.shard;
  for (const ShardBox& box : shard_boxes(spec))
    for (const FlatRun& run : flat_runs(box, spec.global_shape, p.data.shape()))
      for (int64_t k = 0; k < run.count; ++k) fn(run.global_start + k, run.local_start + k);
}

// The reference's values (one rank, every expert) into the parallel block's shards, by name.
void copy_by_name(const ParamAndGradBuffer& from, ParamAndGradBuffer& to) {
  for (Parameter* p : to.parameters()) {
    const Parameter* q = from.find(p->name);
    ASSERT_NE(q, nullptr) << p->name;
    const std::vector<float> full = q->data.to_floats();
    std::vector<float> local(size_t(p->data.numel()));
    for_each_shard_element(*p, [&](int64_t g, int64_t lo) { local[size_t(lo)] = full[size_t(g)]; });
    p->data.copy_from(Tensor::from_floats(local, p->data.shape()));
  }
}

void expect_near(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int bad = 0;
  for (size_t i = 0; i < got.size() && bad < 5; ++i) {
    if (!(std::fabs(got[i] - want[i]) <= 1e-5f * std::max(1.0f, std::fabs(want[i])))) {
      ADD_FAILURE() << what << "[" << i << "] " << got[i] << " vs " << want[i];
      ++bad;
    }
  }
}

std::string name_of(const std::string& type, bool capacity, const Layout& l) {
  return fmt::format("{} dispatcher{}, tp {} ep {} etp {}", type, capacity ? " (drop-and-pad)" : "", l.tp, l.ep, l.etp);
}

void check_against_one_rank(const std::string& type, bool capacity, const Layout& l) {
  Communicator& world = mpi_world();
  const int n = world.size(), me = world.rank();
  SCOPED_TRACE(name_of(type, capacity, l));
  ParallelConfig pc;
  pc.tensor_model_parallel_size = l.tp;
  pc.expert_model_parallel_size = l.ep;
  pc.expert_tensor_parallel_size = l.etp;
  ParallelState ps(world.split(0, me, "world"), pc);
  const ProcessGroupCollection pg = ProcessGroupCollection::from(ps);
  const bool bias = l.etp == 1;  // expert biases need expert-TP 1
  Context ctx;

  // The reference: all experts on one rank, its values given to the parallel block by name.
  Block ref(type, capacity, bias, ProcessGroupCollection{});
  ref.params.init_weights(11, 0.5f, 1, false);
  for (Parameter* q : ref.params.parameters())
    if (q->name.ends_with(".bias")) q->data.copy_from(random_tensor(q->data.shape(), 40));
  Block par(type, capacity, bias, pg);
  ASSERT_EQ(par.dispatcher->num_local_experts(), kExperts / l.ep);
  EXPECT_EQ(par.dispatcher->first_local_expert(), ps.ep_rank() * (kExperts / l.ep));
  copy_by_name(ref.params, par.params);

  // Every rank's tokens and output gradients; this rank runs its own, the reference all of them.
  std::vector<Block::Result> want;
  for (int r = 0; r < n; ++r)
    want.push_back(ref.run(ctx, random_tensor({kTokens, kHidden}, 100 + uint64_t(r)),
                           random_tensor({kTokens, kHidden}, 200 + uint64_t(r))));
  const Block::Result got = par.run(ctx, random_tensor({kTokens, kHidden}, 100 + uint64_t(me)),
                                    random_tensor({kTokens, kHidden}, 200 + uint64_t(me)));
  expect_near(got.y, want[size_t(me)].y, "output");
  expect_near(got.grad_x, want[size_t(me)].grad_x, "input gradient");
  expect_near(got.grad_probs, want[size_t(me)].grad_probs, "router probabilities' gradient");
  if (capacity) {  // fixed splits: `capacity` rows per local expert from every expert-TP x EP rank
    EXPECT_EQ(got.tokens_per_expert, std::vector<int64_t>(size_t(kExperts / l.ep), capacity_of(true) * l.ep * l.etp));
  }

  // Weight gradients: the experts' summed over the ranks holding the same shard (expert data
  // parallel), the router's over the world (each rank routed its own tokens).
  int experts_checked = 0;
  for (Parameter* p : par.params.parameters()) {
    const bool router = p->name.starts_with(kPrefix + ".router");
    Tensor g = p->main_grad.clone();
    (router ? world : ps.expert_data()).all_reduce(ctx, g)->wait();
    const std::vector<float> full = ref.params.find(p->name)->main_grad.to_floats(), local = g.to_floats();
    std::vector<float> want_local(local.size());
    for_each_shard_element(*p, [&](int64_t gi, int64_t lo) { want_local[size_t(lo)] = full[size_t(gi)]; });
    expect_near(local, want_local, p->name + " gradient");
    experts_checked += router ? 0 : 1;
  }
  EXPECT_EQ(experts_checked, (kExperts / l.ep) * (bias ? 4 : 2));
}

std::vector<Layout> layouts(int world) {
  if (world == 2) return {{1, 2, 1}, {1, 1, 2}};
  if (world == 4) return {{1, 4, 1}, {1, 2, 1}, {1, 2, 2}, {2, 2, 2}};
  return {};
}

class Dispatchers : public ::testing::TestWithParam<std::string> {};

TEST_P(Dispatchers, MatchOneRankDropless) {
  for (const Layout& l : layouts(mpi_world().size())) check_against_one_rank(GetParam(), false, l);
}
TEST_P(Dispatchers, MatchOneRankDropAndPad) {
  for (const Layout& l : layouts(mpi_world().size())) check_against_one_rank(GetParam(), true, l);
}
// The whole MoELayer (which builds its dispatcher from the collection): output and input gradient.
TEST_P(Dispatchers, MoELayerMatchesOneRank) {
  Communicator& world = mpi_world();
  const int me = world.rank();
  for (const Layout& l : layouts(world.size())) {
    SCOPED_TRACE(name_of(GetParam(), false, l));
    ParallelConfig pc;
    pc.tensor_model_parallel_size = l.tp;
    pc.expert_model_parallel_size = l.ep;
    pc.expert_tensor_parallel_size = l.etp;
    ParallelState ps(world.split(0, me, "world"), pc);
    const TransformerConfig tc = transformer_config(false);
    moe::MoEConfig mc;
    mc.router = router_config(false);
    mc.router.aux_loss_coeff = 0.0f;
    mc.ffn_hidden_size = kFfn;
    mc.dispatcher = GetParam();
    ParamAndGradBuffer ref_params(DType::Float32, Device::cpu()), par_params(DType::Float32, Device::cpu());
    moe::MoELayer ref(tc, mc, ref_params, kPrefix, 0);
    moe::MoELayer par(tc, mc, par_params, kPrefix, 0, ProcessGroupCollection::from(ps));
    ref_params.allocate();
    par_params.allocate();
    ref_params.init_weights(12, 0.5f, 1, false);
    copy_by_name(ref_params, par_params);
    ref_params.zero_grad();
    par_params.zero_grad();
    EXPECT_EQ(par.num_local_experts(), kExperts / l.ep);
    Context ctx;
    const Tensor x = random_tensor({kTokens, kHidden}, 300 + uint64_t(me));
    const Tensor w = random_tensor({kTokens, kHidden}, 400 + uint64_t(me));
    moe::MoELayer::Saved rs, ps_saved;
    const std::vector<float> want = ref.forward(ctx, x, kSeq, kMicroBatch, nullptr, rs).to_floats();
    const std::vector<float> got = par.forward(ctx, x, kSeq, kMicroBatch, nullptr, ps_saved).to_floats();
    expect_near(got, want, "MoELayer output");
    expect_near(par.backward(ctx, w, ps_saved).to_floats(), ref.backward(ctx, w, rs).to_floats(),
                "MoELayer input gradient");
  }
}

INSTANTIATE_TEST_SUITE_P(Kinds, Dispatchers, ::testing::Values("allgather", "alltoall", "flex"));

TEST(Dispatchers, BadInputIsOneClearLine) {
  Communicator& world = mpi_world();
  ParallelConfig pc;
  pc.expert_model_parallel_size = world.size();
  ParallelState ps(world.split(0, world.rank(), "world"), pc);
  const ProcessGroupCollection pg = ProcessGroupCollection::from(ps);
  moe::DispatcherConfig dc;
  dc.type = "alltoall";
  dc.num_experts = 2 * world.size() + 1;
  EXPECT_EQ(error_of([&] { moe::make_token_dispatcher(dc, pg); }),
            fmt::format("--num-experts ({}) must be divisible by --expert-model-parallel-size ({})", dc.num_experts,
                        world.size()));
  dc.num_experts = 2 * world.size();
  dc.type = "deepep";
  EXPECT_EQ(error_of([&] { moe::make_token_dispatcher(dc, pg); }),
            "unknown --moe-token-dispatcher-type deepep: use allgather, alltoall or flex");
  dc.type = "flex";
  dc.capacity = -1;
  EXPECT_EQ(error_of([&] { moe::make_token_dispatcher(dc, pg); }), "expert capacity -1 must be >= 0 (0: no padding)");
  dc.capacity = 0;
  auto d = moe::make_token_dispatcher(dc, pg);
  Context ctx;
  std::unique_ptr<moe::MoETokenDispatcher::Saved> saved;
  const Tensor x = Tensor::zeros({4, 2}, DType::Float32), probs = Tensor::zeros({4, 3}, DType::Float32);
  const Tensor map = Tensor::zeros({4, 3}, DType::UInt8);
  EXPECT_EQ(error_of([&] { d->dispatch(ctx, x, probs, map, saved); }),
            fmt::format("routing map [4, 3] for {} experts", dc.num_experts));
}

// EP 2 × expert-TP 2 needs the combined group; a collection without it is refused in one line.
TEST(Dispatchers, ExpertTensorAndModelGroupIsRequired) {
  Communicator& world = mpi_world();
  if (world.size() != 4) GTEST_SKIP() << "needs 4 ranks";
  ParallelConfig pc;
  pc.expert_model_parallel_size = 2;
  pc.expert_tensor_parallel_size = 2;
  ParallelState ps(world.split(0, world.rank(), "world"), pc);
  ProcessGroupCollection pg = ProcessGroupCollection::from(ps);
  ASSERT_NE(pg.tp_ep, nullptr);
  EXPECT_EQ(pg.tp_ep->global_ranks(), ps.expert_tensor_and_model().global_ranks());
  EXPECT_EQ(pg.tp_ep->rank(), ps.etp_rank() + 2 * ps.ep_rank());
  pg.tp_ep = nullptr;
  moe::DispatcherConfig dc;
  dc.type = "alltoall";
  dc.num_experts = 4;
  EXPECT_EQ(error_of([&] { moe::make_token_dispatcher(dc, pg); }),
            "the token dispatcher over 2 expert-parallel x 2 expert-tensor-parallel ranks needs their combined group "
            "(ProcessGroupCollection::tp_ep; ProcessGroupCollection::from(ParallelState) sets it)");
}

}  // namespace
}  // namespace megatron::testing
