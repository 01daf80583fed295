// The mixture-of-experts ops on CUDA against the CPU reference: routing forward/backward for every
// option (the same experts, probabilities and gradients to rounding), token dropping by probability
// and by position with and without padding (the same kept tokens, exactly), the global aux loss and
// its gradient, the input jitter, the expert-bias update, the permutation (the same rows, exactly)
// and its data movement, the row scaling and the grouped GEMM, fp32 and bf16.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "megatron/kernels/cpu/cpu_ops.h"
#include "megatron/kernels/cuda/cuda_ops.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/kernels/moe_test_util.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

using testing::expect_close;
using testing::random_tensor;

const Device kGpu = Device::cuda(0);

void check_routing(const testing::RoutingCase& k, uint64_t seed) {
  SCOPED_TRACE(k.name + " T=" + std::to_string(k.seq * k.mb));
  Context cpu_ctx, gpu_ctx(kGpu);
  const int64_t t = k.seq * k.mb, e = k.config.num_experts;
  const Tensor logits = random_tensor({t, e}, seed, 1.5f), w = random_tensor({t, e}, seed + 1, 1.0f);
  const Tensor bias = k.bias ? random_tensor({e}, seed + 2, 0.1f) : Tensor();
  const MoeRoutingParams p = moe::routing_params(k.config, k.seq, k.mb);
  const testing::RoutingRun want = testing::run_routing(cpu_ctx, p, logits, bias);
  const testing::RoutingRun got = testing::run_routing(gpu_ctx, p, logits, bias);
  EXPECT_EQ(got.topk_indices.to(Device::cpu()).to_ints(), want.topk_indices.to_ints());
  EXPECT_EQ(got.routing_map.to(Device::cpu()).to_ints(), want.routing_map.to_ints());
  EXPECT_EQ(got.tokens_per_expert.to(Device::cpu()).to_floats(), want.tokens_per_expert.to_floats());
  expect_close(got.probs.to(Device::cpu()), want.probs, 1e-6, "probs");
  if (p.aux_on()) {
    EXPECT_EQ(got.aux_map.to(Device::cpu()).to_ints(), want.aux_map.to_ints());
    expect_close(got.aux_scores.to(Device::cpu()), want.aux_scores, 1e-6, "aux_scores");
  }
  const std::vector<float> gl = got.losses.to(Device::cpu()).to_floats(), wl = want.losses.to_floats();
  for (size_t i = 0; i < 3; ++i) EXPECT_NEAR(gl[i], wl[i], 1e-6 * std::fabs(wl[i]) + 1e-12) << "loss " << i;
  for (float scale : {1.0f, 0.125f}) {
    const Tensor g_want = testing::run_routing_backward(cpu_ctx, p, want, logits, w, scale);
    const Tensor g_got = testing::run_routing_backward(gpu_ctx, p, got, logits, w, scale);
    expect_close(g_got.to(Device::cpu()), g_want, 1e-5, "grad_logits");
  }
}

TEST(MoeRoutingGpu, MatchesCpu) {
  uint64_t seed = 1;
  for (const testing::RoutingCase& k : testing::routing_cases()) check_routing(k, seed += 10);
  // Training-sized: Mixtral-like and DeepSeek-like routing over 4096 tokens.
  std::vector<testing::RoutingCase> big = testing::routing_cases();
  for (testing::RoutingCase& k : big) {
    k.seq = 1024;
    k.mb = 4;
    check_routing(k, seed += 10);
  }
}

// Note [Token dropping on the device]: every policy keeps the CPU's tokens, on small problems with
// ties (position policy: every routed token has the value 1) and at training size.
TEST(MoeRoutingGpu, TokenDroppingMatchesCpu) {
  uint64_t seed = 500;
  for (const char* policy : {"probs", "position"})
    for (bool pad : {false, true})
      for (float factor : {0.5f, 1.0f, 1.25f}) {
        for (const testing::RoutingCase& base : testing::routing_cases()) {
          testing::RoutingCase k = base;
          k.name += std::string(" ") + policy + (pad ? " pad" : "") + " cf " + std::to_string(factor);
          k.config.capacity_factor = factor;
          k.config.drop_policy = policy;
          k.config.pad_to_capacity = pad;
          check_routing(k, seed += 10);
          if (factor == 1.0f) {  // training-sized
            k.seq = 1024;
            k.mb = 4;
            check_routing(k, seed += 10);
          }
        }
      }
}

// The global aux loss's ops (Note [Global aux loss]): the aux map's counts exactly, the loss and its
// gradient to rounding, for softmax and sigmoid scores.
TEST(MoeRoutingGpu, GlobalAuxLossMatchesCpu) {
  for (const char* score : {"softmax", "sigmoid"})
    for (int64_t t : {int64_t(26), int64_t(4096)}) {
      SCOPED_TRACE(std::string(score) + " T=" + std::to_string(t));
      Context cpu_ctx, gpu_ctx(kGpu);
      moe::RouterConfig c;
      c.num_experts = 16;
      c.topk = 4;
      c.score_function = score;
      c.global_aux_loss_coeff = 0.05f;
      const MoeRoutingParams p = moe::routing_params(c, t / 2, 2, /*global_aux_group=*/4);
      const Tensor logits = random_tensor({t, 16}, 31, 1.5f);
      const testing::RoutingRun r = testing::run_routing(cpu_ctx, p, logits, Tensor());
      Tensor want_n = Tensor::empty({16}, DType::Float32), got_n = Tensor::empty({16}, DType::Float32, kGpu);
      cpu::moe_expert_counts(cpu_ctx, r.aux_map, want_n);
      cuda::moe_expert_counts(gpu_ctx, r.aux_map.to(kGpu), got_n);
      EXPECT_EQ(got_n.to(Device::cpu()).to_floats(), want_n.to_floats());
      const Tensor tokens = random_tensor({16}, 32, 10.0f);  // any per-expert counts (averaged: not integers)
      Tensor want_l = Tensor::empty({1}, DType::Float32), got_l = Tensor::empty({1}, DType::Float32, kGpu);
      cpu::moe_global_aux_loss_forward(cpu_ctx, r.aux_scores, tokens, p, want_l);
      cuda::moe_global_aux_loss_forward(gpu_ctx, r.aux_scores.to(kGpu), tokens.to(kGpu), p, got_l);
      EXPECT_NEAR(got_l.to(Device::cpu()).item(0), want_l.item(0), 1e-6 * std::fabs(want_l.item(0)));
      const Tensor g0 = random_tensor({t, 16}, 33, 1.0f);
      Tensor want_g = g0.clone(), got_g = g0.to(kGpu);
      cpu::moe_global_aux_loss_backward(cpu_ctx, logits, r.aux_scores, tokens, p, 0.5f, want_g);
      cuda::moe_global_aux_loss_backward(gpu_ctx, logits.to(kGpu), r.aux_scores.to(kGpu), tokens.to(kGpu), p, 0.5f,
                                         got_g);
      expect_close(got_g.to(Device::cpu()), want_g, 1e-6, "grad_logits");
    }
}

// The input jitter (Note [Router input jitter]) draws the same factors on both, for any sequence offset.
TEST(MoeRoutingGpu, InputJitterMatchesCpu) {
  Context cpu_ctx, gpu_ctx(kGpu);
  const Tensor x = random_tensor({24, 40}, 41, 1.0f);
  for (int64_t seq_offset : {int64_t(0), int64_t(12)}) {
    Tensor want = Tensor::empty({24, 40}, DType::Float32), got = Tensor::empty({24, 40}, DType::Float32, kGpu);
    cpu::moe_input_jitter(cpu_ctx, x, 0.1f, 1234, 77, 3, seq_offset, want);
    cuda::moe_input_jitter(gpu_ctx, x.to(kGpu), 0.1f, 1234, 77, 3, seq_offset, got);
    EXPECT_EQ(got.to(Device::cpu()).to_floats(), want.to_floats());
  }
}

TEST(MoeRoutingGpu, ExpertBiasUpdate) {
  Context cpu_ctx, gpu_ctx(kGpu);
  const Tensor n = Tensor::from_floats({3, 5, 4, 4, 0, 8, 4, 4}, {8}), b = random_tensor({8}, 3, 0.1f);
  Tensor want = b.clone(), got = b.to(kGpu);
  cpu::moe_expert_bias_update(cpu_ctx, n, 0.01f, want);
  cuda::moe_expert_bias_update(gpu_ctx, n.to(kGpu), 0.01f, got);
  EXPECT_EQ(got.to(Device::cpu()).to_floats(), want.to_floats());
}

// A routing map with k experts per token from random logits (the op's own routing).
Tensor routed_map(int64_t t, int e, int k, uint64_t seed) {
  Context ctx;
  moe::RouterConfig c;
  c.num_experts = e;
  c.topk = k;
  return testing::run_routing(ctx, moe::routing_params(c, t, 1), random_tensor({t, e}, seed, 1.0f), Tensor())
      .routing_map;
}

TEST(MoePermutationGpu, MatchesCpu) {
  struct Case {
    int64_t t;
    int e, k;
    int64_t capacity;
    int64_t h;
  };
  for (const Case& c : {Case{17, 4, 2, 0, 24}, Case{3000, 8, 2, 0, 2048}, Case{2500, 64, 6, 0, 136},
                        Case{1500, 8, 2, 300, 64}, Case{100, 6, 3, 90, 7}}) {
    SCOPED_TRACE("t=" + std::to_string(c.t) + " e=" + std::to_string(c.e) + " cap=" + std::to_string(c.capacity));
    Context cpu_ctx, gpu_ctx(kGpu);
    const Tensor map = routed_map(c.t, c.e, c.k, uint64_t(c.t + c.e));
    MoePermutation want, got;
    cpu::moe_permutation(cpu_ctx, map, c.capacity, want);
    cuda::moe_permutation(gpu_ctx, map.to(kGpu), c.capacity, got);
    ASSERT_EQ(got.rows_per_expert, want.rows_per_expert);
    EXPECT_EQ(got.sorted_indices.to(Device::cpu()).to_ints(), want.sorted_indices.to_ints());
    EXPECT_EQ(got.row_expert.to(Device::cpu()).to_ints(), want.row_expert.to_ints());
    EXPECT_EQ(got.token_rows.to(Device::cpu()).to_ints(), want.token_rows.to_ints());
    const int64_t n = want.rows(), h = c.h;
    for (DType dt : {DType::Float32, DType::BFloat16}) {
      SCOPED_TRACE(to_string(dt));
      const double tol = dt == DType::Float32 ? 1e-6 : 1e-2;
      const Tensor x = random_tensor({c.t, h}, 5, 1.0f, dt), rows = random_tensor({n, h}, 6, 1.0f, dt);
      const Tensor probs = random_tensor({c.t, c.e}, 9, 1.0f), gp = random_tensor({n}, 10, 1.0f);
      const Tensor g = random_tensor({c.t, h}, 11, 1.0f, dt);
      auto both = [&](auto&& f, const Shape& shape, DType out_dtype) {
        Tensor a = Tensor::empty(shape, out_dtype), b = Tensor::empty(shape, out_dtype, kGpu);
        f(cpu_ctx, want, a, Device::cpu());
        f(gpu_ctx, got, b, kGpu);
        return std::pair{a, b.to(Device::cpu())};
      };
      auto [pf, pf_gpu] = both([&](Context& ctx, MoePermutation& pm, Tensor& o, Device d) {
        ops::moe_permute_forward(ctx, x.to(d), pm, o);
      }, {n, h}, dt);
      EXPECT_EQ(pf_gpu.to_floats(), pf.to_floats());
      auto [pb, pb_gpu] = both([&](Context& ctx, MoePermutation& pm, Tensor& o, Device d) {
        ops::moe_permute_backward(ctx, rows.to(d), pm, o);
      }, {c.t, h}, dt);
      expect_close(pb_gpu, pb, tol, "permute_backward");
      auto [pp, pp_gpu] = both([&](Context& ctx, MoePermutation& pm, Tensor& o, Device d) {
        ops::moe_permute_probs_forward(ctx, probs.to(d), pm, o);
      }, {n}, DType::Float32);
      EXPECT_EQ(pp_gpu.to_floats(), pp.to_floats());
      auto [ppb, ppb_gpu] = both([&](Context& ctx, MoePermutation& pm, Tensor& o, Device d) {
        ops::moe_permute_probs_backward(ctx, gp.to(d), pm, o);
      }, {c.t, c.e}, DType::Float32);
      EXPECT_EQ(ppb_gpu.to_floats(), ppb.to_floats());
      auto [un, un_gpu] = both([&](Context& ctx, MoePermutation& pm, Tensor& o, Device d) {
        ops::moe_unpermute_forward(ctx, rows.to(d), pp.to(d), pm, o);
      }, {c.t, h}, dt);
      expect_close(un_gpu, un, tol, "unpermute_forward");
      Tensor gx = Tensor::empty({n, h}, dt), gw = Tensor::empty({n}, DType::Float32);
      Tensor gx_gpu = Tensor::empty({n, h}, dt, kGpu), gw_gpu = Tensor::empty({n}, DType::Float32, kGpu);
      cpu::moe_unpermute_backward(cpu_ctx, g, rows, pp, want, gx, gw);
      cuda::moe_unpermute_backward(gpu_ctx, g.to(kGpu), rows.to(kGpu), pp.to(kGpu), got, gx_gpu, gw_gpu);
      EXPECT_EQ(gx_gpu.to(Device::cpu()).to_floats(), gx.to_floats());
      expect_close(gw_gpu.to(Device::cpu()), gw, dt == DType::Float32 ? 1e-5 : 1e-3, "grad_probs_permuted");
    }
  }
}

TEST(MoeScaleRowsGpu, MatchesCpu) {
  for (DType dt : {DType::Float32, DType::BFloat16})
    for (int64_t c : {int64_t(1408), int64_t(13)}) {
      SCOPED_TRACE(std::string(to_string(dt)) + " c=" + std::to_string(c));
      Context cpu_ctx, gpu_ctx(kGpu);
      const int64_t n = 777;
      const Tensor x = random_tensor({n, c}, 1, 1.0f, dt), p = random_tensor({n}, 2, 1.0f),
                   g = random_tensor({n, c}, 3, 1.0f, dt);
      Tensor out = Tensor::empty({n, c}, dt), out_gpu = Tensor::empty({n, c}, dt, kGpu);
      cpu::moe_scale_rows_forward(cpu_ctx, x, p, out);
      cuda::moe_scale_rows_forward(gpu_ctx, x.to(kGpu), p.to(kGpu), out_gpu);
      EXPECT_EQ(out_gpu.to(Device::cpu()).to_floats(), out.to_floats());
      Tensor gx = Tensor::empty({n, c}, dt), gp = Tensor::empty({n}, DType::Float32);
      Tensor gx_gpu = Tensor::empty({n, c}, dt, kGpu), gp_gpu = Tensor::empty({n}, DType::Float32, kGpu);
      cpu::moe_scale_rows_backward(cpu_ctx, g, x, p, gx, gp);
      cuda::moe_scale_rows_backward(gpu_ctx, g.to(kGpu), x.to(kGpu), p.to(kGpu), gx_gpu, gp_gpu);
      EXPECT_EQ(gx_gpu.to(Device::cpu()).to_floats(), gx.to_floats());
      expect_close(gp_gpu.to(Device::cpu()), gp, dt == DType::Float32 ? 1e-5 : 1e-3, "grad_probs");
    }
}

// More experts than one launch takes (64), some without rows; bf16 and fp32.
TEST(MoeGroupedBiasGpu, MatchesCpu) {
  for (DType dt : {DType::Float32, DType::BFloat16}) {
    SCOPED_TRACE(to_string(dt));
    Context cpu_ctx, gpu_ctx(kGpu);
    const int64_t c = 300;
    std::vector<int64_t> rows;
    int64_t n = 0;
    for (int e = 0; e < 70; ++e) rows.push_back(e % 7 == 3 ? 0 : 1 + (e * 37) % 50), n += rows.back();
    std::vector<Tensor> b, b_gpu, db, db_gpu;
    for (size_t e = 0; e < rows.size(); ++e) {
      b.push_back(random_tensor({c}, 10 + e, 1.0f, dt));
      b_gpu.push_back(b.back().to(kGpu));
      db.push_back(random_tensor({c}, 200 + e, 1.0f));
      db_gpu.push_back(db.back().to(kGpu));
    }
    const Tensor y0 = random_tensor({n, c}, 1, 1.0f, dt), p = random_tensor({n}, 2, 1.0f),
                 g = random_tensor({n, c}, 3, 1.0f, dt);
    for (bool weighted : {false, true}) {
      const Tensor probs = weighted ? p : Tensor(), probs_gpu = weighted ? p.to(kGpu) : Tensor();
      Tensor y = y0.clone(), y_gpu = y0.to(kGpu);
      cpu::moe_grouped_bias_forward(cpu_ctx, y, b, rows, probs);
      cuda::moe_grouped_bias_forward(gpu_ctx, y_gpu, b_gpu, rows, probs_gpu);
      EXPECT_EQ(y_gpu.to(Device::cpu()).to_floats(), y.to_floats());
      Tensor gp = weighted ? random_tensor({n}, 5, 1.0f) : Tensor(), gp_gpu = weighted ? gp.to(kGpu) : Tensor();
      cpu::moe_grouped_bias_backward(cpu_ctx, g, b, rows, probs, db, gp);
      cuda::moe_grouped_bias_backward(gpu_ctx, g.to(kGpu), b_gpu, rows, probs_gpu, db_gpu, gp_gpu);
      for (size_t e = 0; e < rows.size(); ++e) expect_close(db_gpu[e].to(Device::cpu()), db[e], 1e-5, "bias grad");
      if (weighted) expect_close(gp_gpu.to(Device::cpu()), gp, 1e-5, "grad_probs");
    }
  }
}

TEST(MoeGroupedLinearGpu, MatchesCpu) {
  for (DType dt : {DType::Float32, DType::BFloat16}) {
    SCOPED_TRACE(to_string(dt));
    Context cpu_ctx, gpu_ctx(kGpu);
    const int64_t in = 256, out = 384;
    const std::vector<int64_t> rows = {100, 0, 257, 1, 64, 0, 300, 31};
    int64_t n = 0;
    for (int64_t r : rows) n += r;
    std::vector<Tensor> w, w_gpu, wg, wg_gpu;
    for (size_t e = 0; e < rows.size(); ++e) {
      w.push_back(random_tensor({out, in}, 10 + e, 0.1f, dt));
      // separate allocations, the second at an offset (not one contiguous block)
      Tensor big = Tensor::empty({out * in + 8}, dt, kGpu);
      w_gpu.push_back(big.flat_slice(8, out * in).view({out, in}));
      w_gpu.back().copy_from(w.back());
      wg.push_back(random_tensor({out, in}, 30 + e, 1.0f));
      wg_gpu.push_back(wg.back().to(kGpu));
    }
    const Tensor x = random_tensor({n, in}, 1, 1.0f, dt), dy = random_tensor({n, out}, 2, 1.0f, dt);
    Tensor y = Tensor::empty({n, out}, dt), y_gpu = Tensor::empty({n, out}, dt, kGpu);
    cpu::moe_grouped_linear_forward(cpu_ctx, x, w, rows, y);
    cuda::moe_grouped_linear_forward(gpu_ctx, x.to(kGpu), w_gpu, rows, y_gpu);
    const double tol = dt == DType::Float32 ? 1e-5 : 1e-2;
    expect_close(y_gpu.to(Device::cpu()), y, tol, "y");
    Tensor dx = Tensor::empty({n, in}, dt), dx_gpu = Tensor::empty({n, in}, dt, kGpu);
    cpu::moe_grouped_linear_backward(cpu_ctx, dy, x, w, rows, dx, wg);
    cuda::moe_grouped_linear_backward(gpu_ctx, dy.to(kGpu), x.to(kGpu), w_gpu, rows, dx_gpu, wg_gpu);
    expect_close(dx_gpu.to(Device::cpu()), dx, tol, "grad_in");
    for (size_t e = 0; e < rows.size(); ++e)
      expect_close(wg_gpu[e].to(Device::cpu()), wg[e], dt == DType::Float32 ? 1e-5 : 1e-3,
                   "weight_grad " + std::to_string(e));
  }
}

}  // namespace
}  // namespace megatron
