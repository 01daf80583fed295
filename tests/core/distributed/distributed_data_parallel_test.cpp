// Data parallelism on thread-ranks (make_local_group): gradient reduction per bucket (all-reduce to
// the mean, or reduce-scatter to the owned shard), overlapped launches driven by the gradient hooks,
// finalize_model_grads over the tensor-parallel and embedding groups, and the distributed optimizer
// against the single-process AdamOptimizer on the mean gradient.
#include "megatron/core/distributed/distributed_data_parallel.h"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <map>

#include "megatron/core/optimizer/optimizer.h"
#include "megatron/runtime/philox.h"
#include "tests/core/thread_ranks.h"

namespace megatron {
namespace {

using testing::run_thread_ranks;

// Five parameters of odd sizes (layout order: c, norm, b, a.bias, a.weight).
struct ToyModel {
  ParamAndGradBuffer buf;
  ToyModel(DType dtype, const DDPConfig& cfg, int dp) : buf(dtype, Device::cpu()) {
    buf.add("a.weight", {7, 5}, false, ParamInit::Normal);
    buf.add("a.bias", {7}, true, ParamInit::Normal);
    buf.add("b.weight", {3, 11}, false, ParamInit::Normal);
    buf.add("norm.weight", {13}, true, ParamInit::Normal);
    buf.add("c.weight", {9, 4}, false, ParamInit::ScaledNormal);
    buf.allocate(cfg, dp);
    buf.init_weights(1234, 0.5f, 2, false);
  }
  Parameter& param(const std::string& name) { return *buf.find(name); }
};

size_t param_index(const std::string& name) {
  static const std::vector<std::string> order = {"a.weight", "a.bias", "b.weight", "norm.weight", "c.weight"};
  return size_t(std::find(order.begin(), order.end(), name) - order.begin());
}

// Rank r's gradient of a parameter at a step.
std::vector<float> local_grad(const Parameter& p, int rank, int step) {
  std::vector<float> g(size_t(p.data.numel()));
  for (size_t i = 0; i < g.size(); ++i)
    g[i] = 0.3f * philox_normal(uint64_t(1000 * step + rank), param_index(p.name), i) + 0.01f * float(rank);
  return g;
}

// The mean as the reduction computes it: each rank's values times 1/dp, added in rank order.
std::vector<float> mean_grad(const Parameter& p, int dp, int step) {
  std::vector<float> acc;
  for (int r = 0; r < dp; ++r) {
    std::vector<float> g = local_grad(p, r, step);
    if (acc.empty()) acc.assign(g.size(), 0.0f);
    for (size_t i = 0; i < g.size(); ++i) acc[i] = r == 0 ? g[i] * (1.0f / float(dp)) : acc[i] + g[i] * (1.0f / float(dp));
  }
  return acc;
}

void set_grad(Parameter& p, const std::vector<float>& g) { p.main_grad.copy_from(Tensor::from_floats(g, {int64_t(g.size())})); }

std::vector<float> slice(const std::vector<float>& v, ParamShard s) {
  return {v.begin() + s.start, v.begin() + s.start + s.count};
}

void expect_near(const std::vector<float>& got, const std::vector<float>& want, double tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_NEAR(got[i], want[i], tol * std::max(1.0, double(std::fabs(want[i])))) << what << "[" << i << "]";
}

DDPConfig ddp_config(bool dist_opt, int64_t bucket_size = 40) {
  DDPConfig c;
  c.use_distributed_optimizer = dist_opt;
  c.bucket_size = bucket_size;
  return c;
}

TEST(DistributedDataParallel, FinishGradSyncGivesTheMeanOrTheOwnedShard) {
  for (int dp : {2, 3, 4}) {
    for (bool dist_opt : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "dp " << dp << (dist_opt ? " distributed optimizer" : " all-reduce"));
      run_thread_ranks(dp, [&](ParallelState& ps) {
        Context ctx;
        ToyModel m(DType::Float32, ddp_config(dist_opt), dp);
        DistributedDataParallel ddp(ps, {&m.buf}, ddp_config(dist_opt));
        ddp.zero_grad(ctx);
        for (Parameter* p : m.buf.parameters()) set_grad(*p, local_grad(*p, ps.dp_rank(), 0));
        ddp.finish_grad_sync(ctx);
        for (Parameter* p : m.buf.parameters()) {
          const std::vector<float> want = mean_grad(*p, dp, 0);
          const ParamShard own = ddp.owned_shard(p->name);
          if (!dist_opt) EXPECT_EQ(own.count, p->data.numel()) << p->name;
          expect_near(slice(p->main_grad.to_floats(), own), slice(want, own), 1e-6, p->name);
        }
      });
    }
  }
}

TEST(DistributedDataParallel, ShardsCoverEveryParameterOnce) {
  for (int dp : {2, 3, 4}) {
    run_thread_ranks(dp, [&](ParallelState& ps) {
      ToyModel m(DType::Float32, ddp_config(true, 20), dp);
      DistributedDataParallel ddp(ps, {&m.buf}, ddp_config(true, 20));
      if (ps.rank() != 0) return;
      for (Parameter* p : m.buf.parameters()) {
        std::vector<int> seen(size_t(p->data.numel()), 0);
        for (int r = 0; r < dp; ++r) {
          const ParamShard s = ddp.shard(p->name, r);
          for (int64_t i = s.start; i < s.start + s.count; ++i) ++seen[size_t(i)];
        }
        EXPECT_EQ(seen, std::vector<int>(seen.size(), 1)) << p->name;
      }
    });
  }
}

TEST(DistributedDataParallel, OverlapLaunchesBucketsInOrderDuringTheLastMicrobatch) {
  for (bool dist_opt : {false, true}) {
    SCOPED_TRACE(dist_opt ? "distributed optimizer" : "all-reduce");
    const int dp = 2;
    run_thread_ranks(dp, [&](ParallelState& ps) {
      Context ctx;
      DDPConfig cfg = ddp_config(dist_opt);
      cfg.overlap_grad_reduce = true;
      ToyModel m(DType::Float32, cfg, dp);
      DistributedDataParallel ddp(ps, {&m.buf}, cfg);
      ASSERT_EQ(m.buf.buckets().size(), 3u);  // {c, norm}, {b, a.bias}, {a.weight}
      ddp.set_expected_accumulations(&m.param("norm.weight"), 2);
      ddp.zero_grad(ctx);
      const int rank = ps.dp_rank();
      // The local backend completes a collective when it is called: a launched bucket holds the mean
      // (on the owned shard; a rank that owns none of the parameter sees nothing either way).
      auto matches_mean = [&](const std::string& name, bool if_none) {
        Parameter& p = m.param(name);
        const ParamShard own = ddp.owned_shard(name);
        if (own.count == 0) return if_none;
        const std::vector<float> got = slice(p.main_grad.to_floats(), own);
        const std::vector<float> mean = slice(mean_grad(p, dp, 0), own);
        for (size_t i = 0; i < got.size(); ++i)
          if (std::fabs(got[i] - mean[i]) > 1e-6f * std::max(1.0f, std::fabs(mean[i]))) return false;
        return true;
      };
      auto reduced = [&](const std::string& name) { return matches_mean(name, true); };
      auto local = [&](const std::string& name) { return !matches_mean(name, false); };
      // Two microbatches: each accumulates half of the local gradient; norm.weight twice a quarter.
      auto backward = [&](Parameter& p, float part) {
        std::vector<float> g = local_grad(p, rank, 0), cur = p.main_grad.to_floats();
        for (size_t i = 0; i < g.size(); ++i) cur[i] += part * g[i];
        set_grad(p, cur);
        notify_grad_accumulated(ctx, &p);
      };
      auto microbatch = [&](const std::function<void(const std::string&)>& after_param) {
        for (const char* name : {"c.weight", "norm.weight", "norm.weight", "b.weight", "a.bias", "a.weight"}) {
          backward(m.param(name), std::string(name) == "norm.weight" ? 0.25f : 0.5f);
          after_param(name);
        }
      };
      ddp.disable_grad_sync();
      microbatch([&](const std::string&) {});
      EXPECT_TRUE(local("c.weight"));  // nothing launched outside the last microbatch
      ddp.enable_grad_sync();
      int norm_calls = 0;
      microbatch([&](const std::string& name) {
        if (name == "norm.weight" && ++norm_calls == 1) {
          EXPECT_TRUE(local("c.weight")) << "launched before norm.weight's second accumulation";
        } else if (name == "norm.weight") {
          EXPECT_TRUE(reduced("c.weight"));
          EXPECT_TRUE(reduced("norm.weight"));
          EXPECT_TRUE(local("b.weight"));
        } else if (name == "a.bias") {
          EXPECT_TRUE(reduced("b.weight"));
          EXPECT_TRUE(local("a.weight"));
        } else if (name == "a.weight") {
          EXPECT_TRUE(reduced("a.weight"));
        }
      });
      ddp.finish_grad_sync(ctx);
      for (Parameter* p : m.buf.parameters()) EXPECT_TRUE(reduced(p->name)) << p->name;
    });
  }
}

TEST(DistributedDataParallel, ACompleteBucketWaitsForTheEarlierOnes) {
  const int dp = 2;
  run_thread_ranks(dp, [&](ParallelState& ps) {
    Context ctx;
    DDPConfig cfg = ddp_config(false);
    cfg.overlap_grad_reduce = true;
    ToyModel m(DType::Float32, cfg, dp);
    DistributedDataParallel ddp(ps, {&m.buf}, cfg);
    ddp.zero_grad(ctx);
    for (Parameter* p : m.buf.parameters()) set_grad(*p, local_grad(*p, ps.dp_rank(), 0));
    const std::vector<float> local_b = m.param("b.weight").main_grad.to_floats();
    notify_grad_accumulated(ctx, &m.param("b.weight"));
    notify_grad_accumulated(ctx, &m.param("a.bias"));  // bucket 1 complete, bucket 0 not
    EXPECT_EQ(m.param("b.weight").main_grad.to_floats(), local_b);
    ddp.finish_grad_sync(ctx);  // launches 0, 1 (already complete) and 2 in order
    expect_near(m.param("b.weight").main_grad.to_floats(), mean_grad(m.param("b.weight"), dp, 0), 1e-6, "b.weight");
    expect_near(m.param("a.weight").main_grad.to_floats(), mean_grad(m.param("a.weight"), dp, 0), 1e-6, "a.weight");
  });
}

TEST(DistributedDataParallel, FinalizeReducesSequenceParallelAndEmbeddingGrads) {
  // tp 2 with sequence parallelism: sequence_parallel grads are summed over the tensor group.
  ParallelConfig tp2;
  tp2.tensor_model_parallel_size = 2;
  tp2.sequence_parallel = true;
  for (bool dist_opt : {false, true}) {
    run_thread_ranks(4, tp2, [&](ParallelState& ps) {  // tp 2 x dp 2
      Context ctx;
      ParamAndGradBuffer buf(DType::Float32, Device::cpu());
      Parameter* ln = buf.add("ln.weight", {11}, true, ParamInit::Ones);
      ln->sequence_parallel = true;
      Parameter* w = buf.add("w", {5, 3}, false, ParamInit::Normal);
      buf.allocate(ddp_config(dist_opt, 0), ps.data_context().size());
      DistributedDataParallel ddp(ps, {&buf}, ddp_config(dist_opt, 0));
      ddp.zero_grad(ctx);
      auto value = [](int tp, int dp, int i) { return float(1 + tp) * 0.5f + float(dp) + 0.125f * float(i); };
      std::vector<float> gl(11), gw(15);
      for (int i = 0; i < 11; ++i) gl[size_t(i)] = value(ps.tp_rank(), ps.dp_rank(), i);
      for (int i = 0; i < 15; ++i) gw[size_t(i)] = value(ps.tp_rank(), ps.dp_rank(), i);
      set_grad(*ln, gl);
      set_grad(*w, gw);
      finalize_model_grads(ctx, ddp);
      const ParamShard own_ln = ddp.owned_shard("ln.weight"), own_w = ddp.owned_shard("w");
      std::vector<float> want_ln(11), want_w(15);
      for (int i = 0; i < 11; ++i)  // mean over dp, then sum over tp
        want_ln[size_t(i)] = (value(0, 0, i) + value(0, 1, i)) / 2 + (value(1, 0, i) + value(1, 1, i)) / 2;
      for (int i = 0; i < 15; ++i) want_w[size_t(i)] = (value(ps.tp_rank(), 0, i) + value(ps.tp_rank(), 1, i)) / 2;
      expect_near(slice(ln->main_grad.to_floats(), own_ln), slice(want_ln, own_ln), 1e-6, "ln.weight");
      expect_near(slice(w->main_grad.to_floats(), own_w), slice(want_w, own_w), 1e-6, "w");
    });
  }
  // pp 2: the first stage's word embeddings and the last stage's copy are summed.
  ParallelConfig pp2;
  pp2.pipeline_model_parallel_size = 2;
  for (bool dist_opt : {false, true}) {
    run_thread_ranks(4, pp2, [&](ParallelState& ps) {  // dp 2 x pp 2
      Context ctx;
      ParamAndGradBuffer buf(DType::Float32, Device::cpu());
      const bool first = ps.pp_rank() == 0;
      Parameter* emb = buf.add(first ? "embedding.word_embeddings.weight" : "output_layer.weight", {6, 5}, false,
                               ParamInit::Normal);
      (first ? emb->in_embedding_group : emb->shared_embedding_copy) = true;
      buf.add(first ? "layer0.weight" : "layer1.weight", {first ? 7 : 9, 3}, false, ParamInit::Normal);
      buf.allocate(ddp_config(dist_opt, 0), ps.data_context().size());
      DistributedDataParallel ddp(ps, {&buf}, ddp_config(dist_opt, 0));
      ddp.zero_grad(ctx);
      auto value = [](int pp, int dp, int i) { return float(pp) * 3.0f + float(dp) + 0.25f * float(i); };
      std::vector<float> g(30);
      for (int i = 0; i < 30; ++i) g[size_t(i)] = value(ps.pp_rank(), ps.dp_rank(), i);
      set_grad(*emb, g);
      finalize_model_grads(ctx, ddp);
      std::vector<float> want(30);
      for (int i = 0; i < 30; ++i)
        want[size_t(i)] = (value(0, 0, i) + value(0, 1, i)) / 2 + (value(1, 0, i) + value(1, 1, i)) / 2;
      const ParamShard own = ddp.owned_shard(emb->name);
      expect_near(slice(emb->main_grad.to_floats(), own), slice(want, own), 1e-6, emb->name);
    });
  }
}

// --grad-reduce-in-bf16 (Note [Gradient reduction dtype]): a bf16 model's buckets reduce through a
// bf16 buffer; the reduced fp32 gradients are bf16 values (every element exactly representable),
// within bf16 rounding of the fp32 mean. An fp32 model keeps reducing in fp32.
TEST(DistributedDataParallel, GradReduceInBf16ReducesThroughABf16Buffer) {
  for (int dp : {2, 3}) {
    for (bool dist_opt : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "dp " << dp << (dist_opt ? " distributed optimizer" : " all-reduce"));
      run_thread_ranks(dp, [&](ParallelState& ps) {
        Context ctx;
        DDPConfig cfg = ddp_config(dist_opt);
        cfg.grad_reduce_in_fp32 = false;
        ToyModel m(DType::BFloat16, cfg, dp);
        DistributedDataParallel ddp(ps, {&m.buf}, cfg);
        ASSERT_EQ(ddp.num_buffers(), 1);
        EXPECT_EQ(ddp.buffer(0).grad_reduce_buffer().dtype(), DType::BFloat16);
        EXPECT_EQ(ddp.buffer(0).grad_buffer().dtype(), DType::Float32);  // accumulation stays fp32
        for (const Bucket& b : ddp.buffer(0).buckets()) EXPECT_EQ(b.reduce_data.dtype(), DType::BFloat16);
        ddp.zero_grad(ctx);
        for (Parameter* p : m.buf.parameters()) set_grad(*p, local_grad(*p, ps.dp_rank(), 0));
        ddp.finish_grad_sync(ctx);
        int64_t inexact_in_fp32 = 0, owned = 0;
        for (Parameter* p : m.buf.parameters()) {
          const ParamShard own = ddp.owned_shard(p->name);
          const std::vector<float> got = slice(p->main_grad.to_floats(), own);
          const std::vector<float> want = slice(mean_grad(*p, dp, 0), own);
          // Each rank's term and each partial sum rounds once to bf16 (relative 2^-9 each): at most
          // dp + (dp - 1) roundings of values no larger than Σ_r |g_r| / dp.
          std::vector<float> magnitude(size_t(p->data.numel()), 0.0f);
          for (int r = 0; r < dp; ++r) {
            const std::vector<float> g = local_grad(*p, r, 0);
            for (size_t i = 0; i < g.size(); ++i) magnitude[i] += std::fabs(g[i]) / float(dp);
          }
          magnitude = slice(magnitude, own);
          for (size_t i = 0; i < got.size(); ++i) {
            EXPECT_EQ(to_float(to_bf16(got[i])), got[i]) << p->name << "[" << i << "] is not a bf16 value";
            EXPECT_NEAR(got[i], want[i], double(2 * dp) * std::ldexp(double(magnitude[i]), -9)) << p->name << "[" << i << "]";
            inexact_in_fp32 += to_float(to_bf16(want[i])) != want[i];
          }
          owned += int64_t(got.size());
        }
        if (owned > 0) EXPECT_GT(inexact_in_fp32, 0);  // the fp32 mean is not bf16: the test sees the rounding
      });
    }
  }
  run_thread_ranks(2, [&](ParallelState& ps) {
    DDPConfig cfg = ddp_config(false);
    cfg.grad_reduce_in_fp32 = false;
    ToyModel m(DType::Float32, cfg, 2);
    DistributedDataParallel ddp(ps, {&m.buf}, cfg);
    EXPECT_EQ(ddp.buffer(0).grad_reduce_buffer().dtype(), DType::Float32);
  });
}

// --calculate-per-token-loss (Note [Per-token loss]): the reduction sums over the data-parallel
// ranks, and finalize_model_grads divides by the token count the last pipeline stage gives.
TEST(DistributedDataParallel, PerTokenLossSumsThenDividesByTheTokens) {
  for (bool dist_opt : {false, true}) {
    run_thread_ranks(2, [&](ParallelState& ps) {
      Context ctx;
      DDPConfig cfg = ddp_config(dist_opt);
      cfg.calculate_per_token_loss = true;
      ToyModel m(DType::Float32, cfg, 2);
      DistributedDataParallel ddp(ps, {&m.buf}, cfg);
      ddp.zero_grad(ctx);
      for (Parameter* p : m.buf.parameters()) set_grad(*p, local_grad(*p, ps.dp_rank(), 0));
      finalize_model_grads(ctx, ddp, 5.0);
      for (Parameter* p : m.buf.parameters()) {
        std::vector<float> want = mean_grad(*p, 1, 0), other = local_grad(*p, 1, 0);
        for (size_t i = 0; i < want.size(); ++i) want[i] = (want[i] + other[i]) / 5.0f;
        const ParamShard own = ddp.owned_shard(p->name);
        expect_near(slice(p->main_grad.to_floats(), own), slice(want, own), 1e-6, p->name);
      }
    });
  }
  ParallelConfig pp2;
  pp2.pipeline_model_parallel_size = 2;
  run_thread_ranks(2, pp2, [&](ParallelState& ps) {  // only the last stage knows the tokens
    Context ctx;
    DDPConfig cfg = ddp_config(false);
    cfg.calculate_per_token_loss = true;
    ParamAndGradBuffer buf(DType::Float32, Device::cpu());
    Parameter* w = buf.add(ps.pp_rank() == 0 ? "layer0.weight" : "layer1.weight", {4}, false, ParamInit::Normal);
    buf.allocate(cfg, 1);
    DistributedDataParallel ddp(ps, {&buf}, cfg);
    ddp.zero_grad(ctx);
    set_grad(*w, {8, 4, 2, 1});
    finalize_model_grads(ctx, ddp, ps.pp_rank() == 1 ? 4.0 : 0.0);
    expect_near(w->main_grad.to_floats(), {2, 1, 0.5f, 0.25f}, 1e-7, w->name);
  });
}

// ---- the optimizer over DDP -------------------------------------------------------------------------

OptimizerConfig adam_config(DType dtype) {
  OptimizerConfig c;
  c.lr = 1e-2;
  c.weight_decay = 0.1;
  c.adam_beta1 = 0.9;
  c.adam_beta2 = 0.95;
  c.clip_grad = 0.5;  // below the toy's grad norm: clipping is active
  c.bf16 = dtype == DType::BFloat16;
  c.fp16 = dtype == DType::Float16;
  return c;
}

TEST(DistributedOptimizer, MatchesSingleProcessAdamOnTheMeanGradient) {
  for (DType dtype : {DType::Float32, DType::BFloat16}) {
    for (int dp : {2, 4}) {
      for (bool dist_opt : {true, false}) {
        for (bool overlap : {false, true}) {
          if (overlap && !dist_opt) continue;
          SCOPED_TRACE(::testing::Message() << to_string(dtype) << " dp " << dp << (dist_opt ? " dist-opt" : "")
                                            << (overlap ? " overlap-param-gather" : ""));
          run_thread_ranks(dp, [&](ParallelState& ps) {
            Context ctx;
            DDPConfig cfg = ddp_config(dist_opt);
            cfg.overlap_param_gather = overlap;
            ToyModel m(dtype, cfg, dp);
            DistributedDataParallel ddp(ps, {&m.buf}, cfg);
            AdamOptimizer opt(ddp.parameters(), adam_config(dtype), ddp);
            EXPECT_EQ(opt.distributed(), dist_opt);
            ToyModel ref(dtype, DDPConfig{}, 1);
            std::vector<Parameter> ref_params;
            for (Parameter* p : ref.buf.parameters()) ref_params.push_back(*p);
            AdamOptimizer ref_opt(ref_params, adam_config(dtype));
            ref_opt.set_grad_buffer(ref.buf.grad_buffer());
            for (int step = 0; step < 3; ++step) {
              ddp.zero_grad(ctx);
              for (Parameter* p : m.buf.parameters()) set_grad(*p, local_grad(*p, ps.dp_rank(), step));
              finalize_model_grads(ctx, ddp);
              const OptimizerStepResult r = opt.step(ctx);
              ddp.finish_param_sync(ctx);
              for (Parameter* p : ref.buf.parameters()) set_grad(*p, mean_grad(*p, dp, step));
              const OptimizerStepResult want = ref_opt.step(ctx);
              ASSERT_TRUE(r.update_successful);
              EXPECT_NEAR(*r.grad_norm, *want.grad_norm, 1e-6 * *want.grad_norm);
              EXPECT_GT(*want.grad_norm, 0.5);
            }
            EXPECT_NEAR(opt.params_norm(ctx), ref_opt.params_norm(ctx), 1e-6 * ref_opt.params_norm(ctx));
            for (Parameter* p : m.buf.parameters()) {
              const AdamParamState got = opt.gather_state(ctx, p->name);
              const AdamParamState& want = ref_opt.state(p->name);
              expect_near(got.master.to_floats(), want.master.to_floats(), 1e-6, p->name + " master");
              expect_near(got.exp_avg.to_floats(), want.exp_avg.to_floats(), 1e-6, p->name + " exp_avg");
              expect_near(got.exp_avg_sq.to_floats(), want.exp_avg_sq.to_floats(), 1e-6, p->name + " exp_avg_sq");
              // The model's parameter: the master rounded to its dtype (one bf16 ulp where the
              // masters differ in their last fp32 bits next to a rounding boundary).
              expect_near(p->data.to_floats(), ref.param(p->name).data.to_floats(),
                          dtype == DType::Float32 ? 1e-6 : 1e-2, p->name);
            }
          });
        }
      }
    }
  }
}

TEST(DistributedOptimizer, GatherAndScatterStateRoundTrip) {
  const int dp = 4;
  run_thread_ranks(dp, [&](ParallelState& ps) {
    Context ctx;
    ToyModel m(DType::BFloat16, ddp_config(true, 20), dp);
    DistributedDataParallel ddp(ps, {&m.buf}, ddp_config(true, 20));
    AdamOptimizer opt(ddp.parameters(), adam_config(DType::BFloat16), ddp);
    // A full state every rank agrees on, scattered, then gathered back.
    std::map<std::string, AdamParamState> full;
    for (Parameter* p : m.buf.parameters()) {
      AdamParamState s;
      const int64_t n = p->data.numel();
      std::vector<float> a(static_cast<size_t>(n)), b(a), c(a);
      for (int64_t i = 0; i < n; ++i) {
        a[size_t(i)] = philox_normal(5, param_index(p->name), uint64_t(i));
        b[size_t(i)] = 0.1f * float(i);
        c[size_t(i)] = 0.01f * float(i * i);
      }
      s.master = Tensor::from_floats(a, p->data.shape());
      s.exp_avg = Tensor::from_floats(b, p->data.shape());
      s.exp_avg_sq = Tensor::from_floats(c, p->data.shape());
      opt.scatter_state(ctx, p->name, s);
      const ParamShard own = ddp.owned_shard(p->name);
      EXPECT_EQ(opt.state(p->name).master.numel(), own.count);
      full[p->name] = s;
    }
    opt.copy_main_params_to_model_params(ctx);
    for (Parameter* p : m.buf.parameters()) {
      const AdamParamState got = opt.gather_state(ctx, p->name);
      EXPECT_EQ(got.master.shape(), p->data.shape());
      EXPECT_EQ(got.master.to_floats(), full[p->name].master.to_floats()) << p->name;
      EXPECT_EQ(got.exp_avg.to_floats(), full[p->name].exp_avg.to_floats()) << p->name;
      EXPECT_EQ(got.exp_avg_sq.to_floats(), full[p->name].exp_avg_sq.to_floats()) << p->name;
      // Every rank's model holds the whole (all-gathered) parameters.
      EXPECT_EQ(p->data.to_floats(), full[p->name].master.to(DType::BFloat16).to_floats()) << p->name;
    }
    // reload_model_params takes the masters back from the model (rounded to bf16).
    opt.reload_model_params();
    const ParamShard own = ddp.owned_shard("a.weight");
    EXPECT_EQ(opt.state("a.weight").master.to_floats(),
              slice(full["a.weight"].master.to(DType::BFloat16).to_floats(), own));
  });
}

TEST(DistributedOptimizer, FoundInfOnOneRankSkipsTheStepEverywhere) {
  for (bool dist_opt : {true, false}) {
    const int dp = 2;
    run_thread_ranks(dp, [&](ParallelState& ps) {
      Context ctx;
      ToyModel m(DType::Float16, ddp_config(dist_opt), dp);
      DistributedDataParallel ddp(ps, {&m.buf}, ddp_config(dist_opt));
      AdamOptimizer opt(ddp.parameters(), adam_config(DType::Float16), ddp);
      ASSERT_NE(opt.grad_scaler(), nullptr);
      const std::vector<float> before = m.param("a.weight").data.to_floats();
      for (int step = 0; step < 2; ++step) {
        ddp.zero_grad(ctx);
        for (Parameter* p : m.buf.parameters()) set_grad(*p, local_grad(*p, ps.dp_rank(), step));
        // Rank 1's backward overflows: in step 0 in c.weight, whose elements rank 0 owns under the
        // distributed optimizer (bucket [0, 128): c at 0, norm.weight at 64), in step 1 in norm.weight,
        // which rank 1 owns.
        if (ps.dp_rank() == 1) {
          Parameter& p = m.param(step == 0 ? "c.weight" : "norm.weight");
          std::vector<float> g = p.main_grad.to_floats();
          g[0] = INFINITY;
          set_grad(p, g);
        }
        finalize_model_grads(ctx, ddp);
        const OptimizerStepResult r = opt.step(ctx);
        EXPECT_FALSE(r.update_successful);
        EXPECT_FALSE(r.grad_norm.has_value());
      }
      EXPECT_EQ(opt.step_count(), 0);
      EXPECT_EQ(m.param("a.weight").data.to_floats(), before);
      EXPECT_LT(opt.loss_scale(), 4294967296.0f);  // two overflows: hysteresis 2 spent, scale backed off
    });
  }
}

TEST(DistributedOptimizer, TensorParallelDuplicatesAreCountedOnce) {
  for (int dp : {1, 2}) {
    for (bool dist_opt : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "tp 2 dp " << dp << (dist_opt ? " dist-opt" : ""));
      ParallelConfig pc;
      pc.tensor_model_parallel_size = 2;
      run_thread_ranks(2 * dp, pc, [&](ParallelState& ps) {
        Context ctx;
        ParamAndGradBuffer buf(DType::Float32, Device::cpu());
        ShardSpec spec;
        spec.global_shape = {8, 3};
        spec.partition_dim = 0;
        spec.rank = ps.tp_rank();
        spec.size = 2;
        Parameter* col = buf.add("col.weight", spec, false, ParamInit::Normal);
        Parameter* norm = buf.add("norm.weight", {5}, true, ParamInit::Ones);
        norm->tp_duplicate = true;
        Parameter* copy = buf.add("output_layer.weight", {4, 3}, false, ParamInit::Normal);
        copy->shared_embedding_copy = true;
        buf.allocate(ddp_config(dist_opt, 8), ps.data_context().size());
        buf.init_weights(3, 1.0f, 1, false);
        DDPConfig cfg = ddp_config(dist_opt, 8);
        DistributedDataParallel ddp(ps, {&buf}, cfg);
        OptimizerConfig oc = adam_config(DType::Float32);
        oc.clip_grad = 1.0;
        oc.log_num_zeros_in_grad = true;
        AdamOptimizer opt(ddp.parameters(), oc, ddp);
        ddp.zero_grad(ctx);
        // Identical on the data-parallel replicas; the column shard differs per tp rank.
        std::vector<float> gc(12), gn = {1, 2, 0, 3, 4}, ge(12, 100.0f);
        for (int i = 0; i < 12; ++i) gc[size_t(i)] = float(ps.tp_rank() * 12 + i) * 0.1f;
        set_grad(*col, gc);
        set_grad(*norm, gn);
        set_grad(*copy, ge);
        finalize_model_grads(ctx, ddp);
        double want_sq = 1 + 4 + 9 + 16;  // the norm weight once, the shared copy never
        for (int i = 0; i < 24; ++i) want_sq += double(float(i) * 0.1f) * double(float(i) * 0.1f);
        const OptimizerStepResult r = opt.step(ctx);
        ASSERT_TRUE(r.update_successful);
        EXPECT_NEAR(*r.grad_norm, std::sqrt(want_sq), 1e-5 * std::sqrt(want_sq));
        EXPECT_EQ(*r.num_zeros_in_grad, 2);  // col's element 0 on tp rank 0, the norm's 0
        ddp.finish_param_sync(ctx);
        // params_norm counts the same way: the column shards, the norm weight once, not the copy.
        double want_params = 0;
        std::vector<float> mine = col->data.to_floats(), nv = norm->data.to_floats();
        for (float v : mine) want_params += double(v) * v;
        Tensor sum = Tensor::from_floats({float(want_params)}, {1});
        ps.tensor().all_reduce(ctx, sum)->wait();
        want_params = double(sum.item());
        for (float v : nv) want_params += double(v) * v;
        EXPECT_NEAR(opt.params_norm(ctx), std::sqrt(want_params), 1e-5 * std::sqrt(want_params));
      });
    }
  }
}

// Note [Buffers per reduction group]: dense parameters reduce over data × context parallel, expert
// parameters over expert-data parallel (both scaled by 1 / (dp × cp)), each in a buffer of its own made from the model's
// parameters (whose values move into it), sharded over its own group by the distributed optimizer.
TEST(DistributedDataParallel, ExpertParametersReduceOverTheExpertDataGroup) {
  ParallelConfig ep2;
  ep2.expert_model_parallel_size = 2;  // world 4: dense dp 4; expert groups {0,1},{2,3}, expert-data {0,2},{1,3}
  for (bool dist_opt : {false, true}) {
    SCOPED_TRACE(dist_opt ? "distributed optimizer" : "all-reduce");
    run_thread_ranks(4, ep2, [&](ParallelState& ps) {
      Context ctx;
      ParamAndGradBuffer model(DType::Float32, Device::cpu());  // the model's own layout: one bucket, no padding
      Parameter* dense = model.add("decoder.layers.0.mlp.router.weight", {6, 5}, false, ParamInit::Normal);
      Parameter* expert = model.add("decoder.layers.0.mlp.experts.weight", {7, 3}, false, ParamInit::Normal);
      expert->reduce_group = GradReduceGroup::ExpertData;
      model.allocate();
      model.init_weights(9, 1.0f, 1, false);
      const std::vector<float> dense_values = dense->data.to_floats(), expert_values = expert->data.to_floats();
      DistributedDataParallel ddp(ps, {&model}, ddp_config(dist_opt, 0));
      ASSERT_EQ(ddp.num_buffers(), 2);
      EXPECT_EQ(ddp.buffer_group(0), GradReduceGroup::DataContext);
      EXPECT_EQ(ddp.buffer_group(1), GradReduceGroup::ExpertData);
      EXPECT_EQ(ddp.buffer(0).dp_size(), 4);
      EXPECT_EQ(ddp.buffer(1).dp_size(), 2);
      EXPECT_EQ(&ddp.reduction_group_of(expert->name), &ps.expert_data());
      EXPECT_EQ(dense->data.to_floats(), dense_values) << "the values move into the DDP's buffers";
      EXPECT_EQ(expert->data.to_floats(), expert_values);
      EXPECT_EQ(dense->data.storage(), ddp.buffer(0).param_buffer().storage());
      EXPECT_EQ(expert->main_grad.storage(), ddp.buffer(1).grad_buffer().storage());
      ddp.zero_grad(ctx);
      auto value = [](int rank, int i) { return float(rank) * 4.0f + 0.5f * float(i); };
      std::vector<float> gd(30), ge(21);
      for (int i = 0; i < 30; ++i) gd[size_t(i)] = value(ps.rank(), i);
      for (int i = 0; i < 21; ++i) ge[size_t(i)] = value(ps.rank(), i);
      set_grad(*dense, gd);
      set_grad(*expert, ge);
      finalize_model_grads(ctx, ddp);
      std::vector<float> want_d(30), want_e(21);
      const std::vector<int>& edp = ps.expert_data().global_ranks();
      ASSERT_EQ(edp.size(), 2u);
      for (int i = 0; i < 30; ++i)
        want_d[size_t(i)] = (value(0, i) + value(1, i) + value(2, i) + value(3, i)) / 4;
      // Summed over expert-data, scaled by 1 / (dp × cp) = 1/4 like the dense ones (Megatron's
      // expert_gradient_scaling_factor): each expert's gradient already holds the tokens the
      // dispatcher brought from the other data-parallel ranks of its expert group.
      for (int i = 0; i < 21; ++i) want_e[size_t(i)] = (value(edp[0], i) + value(edp[1], i)) / 4;
      const ParamShard own_d = ddp.owned_shard(dense->name), own_e = ddp.owned_shard(expert->name);
      expect_near(slice(dense->main_grad.to_floats(), own_d), slice(want_d, own_d), 1e-6, dense->name);
      expect_near(slice(expert->main_grad.to_floats(), own_e), slice(want_e, own_e), 1e-6, expert->name);
      if (dist_opt) {  // the expert buffer's shards cover it once over the two expert-data ranks
        int64_t covered = 0;
        for (int r = 0; r < 2; ++r) covered += ddp.shard(expert->name, r).count;
        EXPECT_EQ(covered, expert->data.numel());
      }
    });
  }
}

}  // namespace
}  // namespace megatron
