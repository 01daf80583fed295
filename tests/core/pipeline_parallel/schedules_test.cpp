// The pipeline schedules on a toy model, one thread per pipeline rank over a local group: virtual
// stage l = chunk·pp + stage multiplies its input by its own weight vector (y = w_l ⊙ x), the last
// one adds the loss Σ y²/2 of each microbatch, scaled by 1/M. Gradients and losses must equal a
// sequential computation exactly (the same float operations in the same order), and the order of
// forward and backward calls on every rank must be Megatron's.
#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "megatron/core/parallel_state.h"
#include "megatron/core/pipeline_parallel/p2p_communication.h"
#include "megatron/core/pipeline_parallel/pipeline_schedules.h"

namespace megatron {
namespace {

const Shape kShape = {2, 1, 3};  // [seq, micro batch, hidden]
constexpr int kNumel = 6;

std::vector<float> weight_of(int layer) {
  std::vector<float> w(kNumel);
  for (int i = 0; i < kNumel; ++i) w[i] = 0.9f + 0.03f * float(layer) - 0.02f * float(i);
  return w;
}

std::vector<float> data_of(int microbatch) {
  std::vector<float> x(kNumel);
  for (int i = 0; i < kNumel; ++i) x[i] = 0.5f + 0.1f * float(microbatch) + 0.01f * float(i);
  return x;
}

std::vector<float> mul(const std::vector<float>& a, const std::vector<float>& b) {
  std::vector<float> y(a.size());
  for (size_t i = 0; i < a.size(); ++i) y[i] = a[i] * b[i];
  return y;
}

float loss_of(const std::vector<float>& y) {
  float l = 0.0f;
  for (float v : y) l += 0.5f * v * v;
  return l;
}

std::vector<float> loss_grad(const std::vector<float>& y, int num_microbatches) {
  const float inv = 1.0f / float(num_microbatches);
  std::vector<float> g(y.size());
  for (size_t i = 0; i < y.size(); ++i) g[i] = y[i] * inv;
  return g;
}

void accumulate(std::vector<float>& acc, const std::vector<float>& g, const std::vector<float>& x) {
  for (size_t i = 0; i < acc.size(); ++i) acc[i] += g[i] * x[i];
}

struct Reference {
  std::vector<std::vector<float>> grads;  // per virtual stage
  std::vector<float> losses;              // per microbatch
};

Reference sequential(int num_layers, int num_microbatches) {
  Reference ref{std::vector<std::vector<float>>(num_layers, std::vector<float>(kNumel, 0.0f)), {}};
  for (int mb = 0; mb < num_microbatches; ++mb) {
    std::vector<std::vector<float>> xs{data_of(mb)};
    for (int l = 0; l < num_layers; ++l) xs.push_back(mul(weight_of(l), xs.back()));
    ref.losses.push_back(loss_of(xs.back()));
    std::vector<float> g = loss_grad(xs.back(), num_microbatches);
    for (int l = num_layers - 1; l >= 0; --l) {
      accumulate(ref.grads[l], g, xs[l]);
      g = mul(g, weight_of(l));
    }
  }
  return ref;
}

// What one rank saw.
struct RankResult {
  std::vector<std::string> calls;               // "F c m" / "B c m"
  std::map<int, std::vector<float>> grads;      // per virtual stage held here
  std::map<int, float> losses;                  // per microbatch (last stage)
  std::map<int, int> last_for_chunk;            // chunk -> times set
  int max_in_flight = 0;
  std::vector<std::string> problems;            // contract violations seen by the callbacks
  std::string error;                            // what the schedule threw
};

struct RunOptions {
  int pp = 2, vpp = 1, num_microbatches = 2;
  bool interleaved = false, forward_only = false;
  int bad_forward_rank = -1;  // this rank's forwards return a wrongly shaped tensor
  bool undefined_forward = false;  // ... or nothing
  std::chrono::milliseconds timeout{3000};  // a schedule bug fails the test rather than hanging it
};

// The toy model's callbacks on one rank.
struct ToyStage {
  ParallelState& ps;
  const RunOptions& opt;
  RankResult& res;
  std::map<std::pair<int, int>, Tensor> inputs, outputs;  // (chunk, microbatch)
  std::vector<std::weak_ptr<Storage>> released;           // inputs whose backward has returned
  int in_flight = 0;

  int layer(int chunk) const { return chunk * ps.pp_size() + ps.pp_rank(); }
  bool first(int chunk) const { return chunk == 0 && ps.pp_rank() == 0; }
  bool last(int chunk) const { return chunk == ps.vpp_size() - 1 && ps.pp_rank() == ps.pp_size() - 1; }
  void problem(const std::string& what) { res.problems.push_back(what); }

  void check_released() {
    for (auto& w : released) {
      if (!w.expired()) problem("an input was still held after its backward");
    }
    released.clear();
  }

  Tensor forward(int chunk, int mb, const Tensor& input) {
    check_released();
    res.calls.push_back("F " + std::to_string(chunk) + " " + std::to_string(mb));
    res.max_in_flight = std::max(res.max_in_flight, ++in_flight);
    if (ps.virtual_pipeline_rank() != chunk) problem("virtual pipeline rank not set for forward");
    if (input.defined() == first(chunk)) problem("forward input defined on the first stage only");
    if (opt.forward_only) --in_flight;
    Tensor x = first(chunk) ? Tensor::from_floats(data_of(mb), kShape) : input;
    Tensor y = Tensor::from_floats(mul(weight_of(layer(chunk)), x.to_floats()), kShape);
    if (last(chunk)) res.losses[mb] = loss_of(y.to_floats());
    if (!opt.forward_only) {
      inputs[{chunk, mb}] = x;
      outputs[{chunk, mb}] = y;
    }
    if (ps.pp_rank() == opt.bad_forward_rank) return opt.undefined_forward ? Tensor() : Tensor::zeros({7}, DType::Float32);
    return y;
  }

  Tensor backward(int chunk, int mb, const Tensor& output_grad, bool last_for_chunk) {
    check_released();
    res.calls.push_back("B " + std::to_string(chunk) + " " + std::to_string(mb));
    --in_flight;
    if (ps.virtual_pipeline_rank() != chunk) problem("virtual pipeline rank not set for backward");
    if (output_grad.defined() == last(chunk)) problem("output grad defined except on the last stage");
    if (last_for_chunk) res.last_for_chunk[chunk]++;
    if (last_for_chunk != (mb == opt.num_microbatches - 1)) problem("last_for_chunk on microbatch " + std::to_string(mb));
    auto in = inputs.find({chunk, mb});
    if (in == inputs.end()) {
      problem("backward before forward");
      return {};
    }
    std::vector<float> g = last(chunk) ? loss_grad(outputs.at({chunk, mb}).to_floats(), opt.num_microbatches)
                                       : output_grad.to_floats();
    std::vector<float> x = in->second.to_floats();
    auto& acc = res.grads[layer(chunk)];
    if (acc.empty()) acc.assign(kNumel, 0.0f);
    accumulate(acc, g, x);
    if (!first(chunk)) released.push_back(in->second.storage());
    inputs.erase(in);
    outputs.erase({chunk, mb});
    return Tensor::from_floats(mul(g, weight_of(layer(chunk))), kShape);
  }
};

std::vector<RankResult> run_pipeline(const RunOptions& opt) {
  auto comms = make_local_group(opt.pp);
  std::vector<RankResult> results(opt.pp);
  std::vector<std::thread> threads;
  for (int r = 0; r < opt.pp; ++r) {
    threads.emplace_back([&, r, comm = std::move(comms[r])]() mutable {
      RankResult& res = results[r];
      try {
        comm->set_timeout(opt.timeout);
        ParallelConfig config;
        config.pipeline_model_parallel_size = opt.pp;
        config.virtual_pipeline_model_parallel_size = opt.vpp;
        ParallelState ps(std::move(comm), config);
        Context ctx;
        ToyStage stage{ps, opt, res, {}, {}, {}, 0};
        PipelineStepFuncs f;
        f.forward = [&](Context&, int c, int mb, const Tensor& in) { return stage.forward(c, mb, in); };
        f.backward = [&](Context&, int c, int mb, const Tensor& g, bool l) { return stage.backward(c, mb, g, l); };
        if (opt.interleaved) {
          forward_backward_pipelining_with_interleaving(ctx, ps, f, opt.num_microbatches, kShape, DType::Float32,
                                                        opt.forward_only);
        } else {
          forward_backward_pipelining_without_interleaving(ctx, ps, f, opt.num_microbatches, kShape,
                                                           DType::Float32, opt.forward_only);
        }
        stage.check_released();
        if (!stage.inputs.empty()) stage.problem("the model kept inputs after the step");
      } catch (const std::exception& e) {
        res.error = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return results;
}

std::string label(const RunOptions& o) {
  return "pp " + std::to_string(o.pp) + " vpp " + std::to_string(o.vpp) + " M " + std::to_string(o.num_microbatches) +
         (o.interleaved ? " interleaved" : "") + (o.forward_only ? " forward-only" : "");
}

// Gradients and losses equal the sequential computation; every callback contract held.
void expect_matches_sequential(const RunOptions& opt) {
  SCOPED_TRACE(label(opt));
  std::vector<RankResult> results = run_pipeline(opt);
  Reference ref = sequential(opt.pp * opt.vpp, opt.num_microbatches);
  for (int r = 0; r < opt.pp; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const RankResult& res = results[r];
    ASSERT_EQ(res.error, "");
    EXPECT_EQ(res.problems, std::vector<std::string>{});
    EXPECT_EQ(int(res.calls.size()), opt.num_microbatches * opt.vpp * (opt.forward_only ? 1 : 2));
    for (int c = 0; c < opt.vpp; ++c) {
      const int l = c * opt.pp + r;
      if (opt.forward_only) {
        EXPECT_EQ(res.grads.count(l), 0u);
        continue;
      }
      EXPECT_EQ(res.grads.at(l), ref.grads[l]) << "virtual stage " << l;
      EXPECT_EQ(res.last_for_chunk.count(c) ? res.last_for_chunk.at(c) : 0, 1) << "chunk " << c;
    }
    if (r == opt.pp - 1) {
      ASSERT_EQ(int(res.losses.size()), opt.num_microbatches);
      for (int mb = 0; mb < opt.num_microbatches; ++mb) EXPECT_EQ(res.losses.at(mb), ref.losses[mb]);
    } else {
      EXPECT_TRUE(res.losses.empty());
    }
  }
}

TEST(PipelineSchedules, OneFOneBMatchesSequential) {
  for (int pp : {2, 4}) {
    for (int m : {1, pp - 1, pp, pp + 1, 2 * pp, 2 * pp + 3, 3 * pp}) {
      if (m < 1) continue;
      expect_matches_sequential({pp, 1, m, false, false});
    }
  }
}

TEST(PipelineSchedules, InterleavedMatchesSequential) {
  for (int pp : {2, 4}) {
    for (int vpp : {1, 2, 3}) {
      for (int m : {pp, 2 * pp, 3 * pp}) expect_matches_sequential({pp, vpp, m, true, false});
    }
  }
}

TEST(PipelineSchedules, ForwardOnly) {
  for (int pp : {2, 4}) {
    expect_matches_sequential({pp, 1, 2 * pp + 1, false, true});
    expect_matches_sequential({pp, 1, 1, false, true});
    for (int vpp : {1, 2}) expect_matches_sequential({pp, vpp, 2 * pp, true, true});
  }
}

std::vector<std::string> calls_of(const std::string& spec) {  // "F0,0 B1,2" -> {"F 0 0", "B 1 2"}
  std::vector<std::string> out;
  size_t i = 0;
  while (i < spec.size()) {
    if (spec[i] == ' ') {
      ++i;
      continue;
    }
    size_t end = spec.find(' ', i);
    if (end == std::string::npos) end = spec.size();
    std::string tok = spec.substr(i, end - i);
    const size_t comma = tok.find(',');
    out.push_back(tok.substr(0, 1) + " " + tok.substr(1, comma - 1) + " " + tok.substr(comma + 1));
    i = end;
  }
  return out;
}

// Orders derived by hand from Megatron's algorithm (chunk of virtual microbatch k: (k mod pp·V)/pp,
// reversed in backward; microbatch: (k / pp·V)·pp + k mod pp; warmup (pp - rank - 1)·2 + (V - 1)·pp).
TEST(PipelineSchedules, InterleavedOrderIsMegatrons) {
  std::vector<RankResult> r = run_pipeline({2, 2, 4, true, false});
  ASSERT_EQ(r[0].error, "");
  ASSERT_EQ(r[1].error, "");
  // rank 0: 4 warmup forwards; rank 1: 2.
  EXPECT_EQ(r[0].calls, calls_of("F0,0 F0,1 F1,0 F1,1  F0,2 B1,0 F0,3 B1,1 F1,2 B0,0 F1,3 B0,1  "
                                 "B1,2 B1,3 B0,2 B0,3"));
  EXPECT_EQ(r[1].calls, calls_of("F0,0 F0,1  F1,0 B1,0 F1,1 B1,1 F0,2 B0,0 F0,3 B0,1 F1,2 B1,2 F1,3 B1,3  "
                                 "B0,2 B0,3"));
  // num_microbatches == pp: every forward is warmup.
  r = run_pipeline({2, 2, 2, true, false});
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_EQ(r[rank].error, "");
    EXPECT_EQ(r[rank].calls, calls_of("F0,0 F0,1 F1,0 F1,1 B1,0 B1,1 B0,0 B0,1"));
  }
  // pp 4, V 2, M 8, rank 0: 3·2 + 4 = 10 warmup forwards of 16.
  r = run_pipeline({4, 2, 8, true, false});
  ASSERT_EQ(r[0].error, "");
  EXPECT_EQ(r[0].calls, calls_of("F0,0 F0,1 F0,2 F0,3 F1,0 F1,1 F1,2 F1,3 F0,4 F0,5  "
                                 "F0,6 B1,0 F0,7 B1,1 F1,4 B1,2 F1,5 B1,3 F1,6 B0,0 F1,7 B0,1  "
                                 "B0,2 B0,3 B1,4 B1,5 B1,6 B1,7 B0,4 B0,5 B0,6 B0,7"));
}

TEST(PipelineSchedules, OneFOneBOrderIsMegatrons) {
  std::vector<RankResult> r = run_pipeline({4, 1, 6, false, false});
  const char* expected[] = {
      "F0,0 F0,1 F0,2  F0,3 B0,0 F0,4 B0,1 F0,5 B0,2  B0,3 B0,4 B0,5",
      "F0,0 F0,1  F0,2 B0,0 F0,3 B0,1 F0,4 B0,2 F0,5 B0,3  B0,4 B0,5",
      "F0,0  F0,1 B0,0 F0,2 B0,1 F0,3 B0,2 F0,4 B0,3 F0,5 B0,4  B0,5",
      "F0,0 B0,0 F0,1 B0,1 F0,2 B0,2 F0,3 B0,3 F0,4 B0,4 F0,5 B0,5",
  };
  for (int rank = 0; rank < 4; ++rank) {
    ASSERT_EQ(r[rank].error, "");
    EXPECT_EQ(r[rank].calls, calls_of(expected[rank])) << "rank " << rank;
  }
}

// 1F1B's memory bound: rank r holds at most pp - r microbatches between forward and backward.
TEST(PipelineSchedules, OneFOneBInFlightBound) {
  for (int pp : {2, 4}) {
    for (int m : {1, pp, 3 * pp + 1}) {
      std::vector<RankResult> r = run_pipeline({pp, 1, m, false, false});
      for (int rank = 0; rank < pp; ++rank) {
        ASSERT_EQ(r[rank].error, "");
        EXPECT_EQ(r[rank].max_in_flight, std::min(pp - rank, m)) << "pp " << pp << " M " << m << " rank " << rank;
      }
    }
  }
}

void expect_all_ranks_fail(const RunOptions& opt, const std::string& needle) {
  SCOPED_TRACE(label(opt));
  std::vector<RankResult> r = run_pipeline(opt);
  for (int rank = 0; rank < opt.pp; ++rank) {
    EXPECT_NE(r[rank].error.find(needle), std::string::npos) << "rank " << rank << ": " << r[rank].error;
    EXPECT_TRUE(r[rank].calls.empty());
  }
}

TEST(PipelineSchedules, Errors) {
  expect_all_ranks_fail({2, 2, 3, true, false}, "--pipeline-model-parallel-size (2)");
  expect_all_ranks_fail({4, 2, 6, true, false}, "--num-layers-per-virtual-pipeline-stage");
  expect_all_ranks_fail({2, 2, 4, false, false}, "use the interleaved schedule");
  expect_all_ranks_fail({2, 1, 0, false, false}, "0 microbatches");
  expect_all_ranks_fail({2, 1, 0, true, false}, "0 microbatches");

  // A stage whose forward returns the wrong tensor fails there with a message naming the shapes; its
  // peer then times out waiting instead of hanging.
  RunOptions bad{2, 1, 4, false, false};
  bad.bad_forward_rank = 0;
  bad.timeout = std::chrono::milliseconds(300);
  std::vector<RankResult> r = run_pipeline(bad);
  EXPECT_NE(r[0].error.find("fp32[7]"), std::string::npos) << r[0].error;
  EXPECT_NE(r[0].error.find("[2, 1, 3]"), std::string::npos) << r[0].error;
  EXPECT_NE(r[1].error.find("recv from group rank 0"), std::string::npos) << r[1].error;
  bad.undefined_forward = true;
  r = run_pipeline(bad);
  EXPECT_NE(r[0].error.find("returned no activation"), std::string::npos) << r[0].error;
}

TEST(PipelineSchedules, MissingCallbacksAndEmptyShape) {
  auto comms = make_local_group(1);
  ParallelState ps(std::move(comms[0]), ParallelConfig{});
  Context ctx;
  PipelineStepFuncs f;
  f.forward = [](Context&, int, int, const Tensor&) { return Tensor(); };
  EXPECT_THROW(forward_backward_pipelining_without_interleaving(ctx, ps, f, 2, kShape, DType::Float32, false), Error);
  EXPECT_THROW(P2PCommunicator(ctx, ps, {}, DType::Float32), Error);
  // One stage: forward then backward per microbatch, nothing sent.
  int forwards = 0, backwards = 0;
  f.forward = [&](Context&, int, int, const Tensor& in) {
    EXPECT_FALSE(in.defined());
    ++forwards;
    return Tensor();
  };
  f.backward = [&](Context&, int, int mb, const Tensor& g, bool last) {
    EXPECT_FALSE(g.defined());
    EXPECT_EQ(last, mb == 2);
    EXPECT_EQ(forwards, mb + 1);
    ++backwards;
    return Tensor();
  };
  forward_backward_pipelining_without_interleaving(ctx, ps, f, 3, kShape, DType::Float32, false);
  EXPECT_EQ(backwards, 3);
}

// Activations and gradients to the same peer in one batch (two stages) arrive in order:
// Note [P2P message order].
TEST(P2PCommunication, TwoStagesBothStreamsInOneBatch) {
  auto comms = make_local_group(2);
  std::vector<std::string> errors(2);
  std::vector<std::vector<float>> got_prev(2), got_next(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r, comm = std::move(comms[r])]() mutable {
      try {
        comm->set_timeout(std::chrono::seconds(3));
        ParallelConfig config;
        config.pipeline_model_parallel_size = 2;
        ParallelState ps(std::move(comm), config);
        Context ctx;
        P2PCommunicator p2p(ctx, ps, {2}, DType::Float32);
        Tensor act = Tensor::from_floats({float(r), 1.0f}, {2});
        Tensor grad = Tensor::from_floats({float(r), -1.0f}, {2});
        auto [from_prev, from_next] = p2p.send_forward_backward_recv_forward_backward(act, grad, true, true);
        got_prev[r] = from_prev.to_floats();
        got_next[r] = from_next.to_floats();
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(errors[r], "");
    EXPECT_EQ(got_prev[r], (std::vector<float>{float(1 - r), 1.0f})) << "activation from the previous stage";
    EXPECT_EQ(got_next[r], (std::vector<float>{float(1 - r), -1.0f})) << "gradient from the next stage";
  }
}

}  // namespace
}  // namespace megatron
