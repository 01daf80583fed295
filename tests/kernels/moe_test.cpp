// The CPU reference of the mixture-of-experts ops against core/transformer/moe/moe_utils.cpp (the
// module code they will replace) on random problems and against Megatron's own routing outputs
// (tests/fixtures/moe/router_*.safetensors), with finite differences for the backwards; the global
// aux loss against a hand computation, and the input jitter.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "megatron/core/dist_checkpointing/safetensors.h"
#include "megatron/core/transformer/moe/moe_ops.h"
#include "megatron/kernels/cpu/cpu_ops.h"
#include "tests/kernels/gradcheck.h"
#include "tests/kernels/moe_test_util.h"
#include "tests/moe_fixture_util.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

using testing::random_tensor;

double rel_error(const std::vector<float>& got, const std::vector<float>& want) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < got.size() && i < want.size(); ++i) {
    diff = std::max(diff, std::fabs(double(got[i]) - double(want[i])));
    scale = std::max(scale, std::fabs(double(want[i])));
  }
  return got.size() == want.size() ? diff / std::max(scale, 1e-30) : INFINITY;
}

double rel(double got, double want) { return std::fabs(got - want) / std::max(std::fabs(want), 1e-30); }

// The op's routing and its backward against moe_utils.cpp's routing_forward/routing_backward.
void expect_matches_moe_utils(const moe::RouterConfig& c, const Tensor& logits, const Tensor& bias, int64_t seq,
                              int64_t mb, const Tensor& grad_probs, double tol, const std::string& what) {
  SCOPED_TRACE(what);
  Context ctx;
  const MoeRoutingParams p = moe::routing_params(c, seq, mb);
  moe::RoutingSaved saved;
  const moe::RoutingOutput want = moe::routing_forward(c, logits, bias, seq, mb, saved);
  const testing::RoutingRun got = testing::run_routing(ctx, p, logits, bias);
  EXPECT_LE(rel_error(got.probs.to_floats(), want.probs.to_floats()), tol);
  EXPECT_EQ(got.routing_map.to_ints(), want.routing_map.to_ints());
  EXPECT_EQ(got.tokens_per_expert.to_floats(), want.tokens_per_expert.to_floats());
  const std::vector<float> l = got.losses.to_floats();
  EXPECT_LE(rel(l[0], float(want.aux_loss)), tol) << l[0] << " vs " << want.aux_loss;
  EXPECT_LE(rel(l[1], float(want.seq_aux_loss)), tol) << l[1] << " vs " << want.seq_aux_loss;
  EXPECT_LE(rel(l[2], float(want.z_loss)), tol) << l[2] << " vs " << want.z_loss;
  for (float scale : {1.0f, 0.25f}) {
    const Tensor g_want = moe::routing_backward(c, grad_probs, saved, scale);
    const Tensor g_got = testing::run_routing_backward(ctx, p, got, logits, grad_probs, scale);
    EXPECT_LE(rel_error(g_got.to_floats(), g_want.to_floats()), tol) << "aux_loss_scale " << scale;
  }
}

TEST(MoeRouting, MatchesMoeUtilsOnRandomProblems) {
  for (const testing::RoutingCase& k : testing::routing_cases()) {
    const int64_t t = k.seq * k.mb, e = k.config.num_experts;
    const Tensor logits = random_tensor({t, e}, 100, 1.5f), w = random_tensor({t, e}, 101, 1.0f);
    const Tensor bias = k.bias ? random_tensor({e}, 102, 0.1f) : Tensor();
    expect_matches_moe_utils(k.config, logits, bias, k.seq, k.mb, w, 1e-6, k.name);
  }
}

TEST(MoeRouting, TokenDroppingMatchesMoeUtils) {
  moe::RouterConfig c;
  c.num_experts = 8;
  c.topk = 2;
  c.aux_loss_coeff = 0.01f;
  for (const char* policy : {"probs", "position"})
    for (bool pad : {false, true}) {
      c.capacity_factor = 0.75f;
      c.drop_policy = policy;
      c.pad_to_capacity = pad;
      const Tensor logits = random_tensor({24, 8}, 7, 1.0f), w = random_tensor({24, 8}, 8, 1.0f);
      expect_matches_moe_utils(c, logits, Tensor(), 12, 2, w, 1e-6, std::string(policy) + (pad ? " pad" : ""));
    }
}

// ---- Megatron's fixtures ----------------------------------------------------------------------------

TEST(MoeRouting, ReproducesMegatronsFixtures) {
  const std::string dir = testing::moe_fixtures_dir();
  int checked = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("router_", 0) != 0) continue;
    SCOPED_TRACE(name);
    safetensors::File f(entry.path().string());
    const moe::RouterConfig c = testing::router_fixture_config(f);
    const int64_t seq = std::stoll(f.metadata().at("seq_length")), mb = std::stoll(f.metadata().at("micro_batch"));
    const Tensor logits = f.read("logits", DType::Float32);
    const Tensor bias = c.expert_bias ? f.read("expert_bias", DType::Float32) : Tensor();
    Context ctx;
    const MoeRoutingParams p = moe::routing_params(c, seq, mb);
    const testing::RoutingRun r = testing::run_routing(ctx, p, logits, bias);
    const double probs_err = rel_error(r.probs.to_floats(), f.read("probs").to_floats());
    EXPECT_LE(probs_err, 1e-6);
    if (!c.pad_to_capacity) {  // padding's zero-probability slots follow PyTorch's tie-break (moe_routing_test.cpp)
      EXPECT_EQ(r.routing_map.to_ints(), f.read("routing_map").to_ints());
    }
    EXPECT_EQ(r.tokens_per_expert.to_floats(), f.read("tokens_per_expert").to_floats());
    const std::vector<float> l = r.losses.to_floats();
    const char* names[3] = {"aux_loss", "seq_aux_loss", "z_loss"};
    for (int i = 0; i < 3; ++i) {
      const double want = f.read(names[i]).item(0);
      EXPECT_LE(std::fabs(l[size_t(i)] - want), 1e-6 * std::fabs(want) + 1e-12) << names[i];
    }
    const Tensor grad = testing::run_routing_backward(ctx, p, r, logits, f.read("W", DType::Float32), 1.0f);
    const double grad_err = rel_error(grad.to_floats(), f.read("grad_logits").to_floats());
    // moe_utils.cpp's own distance from Megatron's fp32 arithmetic on this fixture (fp64 sums vs PyTorch's fp32)
    moe::RoutingSaved saved;
    moe::routing_forward(c, logits, bias, seq, mb, saved);
    const double module_err = rel_error(moe::routing_backward(c, f.read("W", DType::Float32), saved, 1.0f).to_floats(),
                                        f.read("grad_logits").to_floats());
    EXPECT_LE(grad_err, std::max(1e-6, 1.01 * module_err)) << "moe_utils.cpp: " << module_err;
    if (c.expert_bias) {
      Tensor b = bias.clone();
      cpu::moe_expert_bias_update(ctx, r.tokens_per_expert, 1e-3f, b);
      EXPECT_EQ(b.to_floats(), f.read("expert_bias_after_update").to_floats());
    }
    std::printf("moe op routing %s: probs within %.1e, grad_logits within %.1e of Megatron's (moe_utils.cpp %.1e)\n",
                name.c_str(), probs_err, grad_err, module_err);
    ++checked;
  }
  EXPECT_GE(checked, 5) << "fixtures in " << dir;
}

TEST(MoeRouting, GradientsMatchFiniteDifferences) {
  for (const testing::RoutingCase& k : testing::routing_cases()) {
    if (k.config.num_experts > 16) continue;  // the small ones: every logit is perturbed
    SCOPED_TRACE(k.name);
    const int64_t t = k.seq * k.mb, e = k.config.num_experts;
    Tensor logits = random_tensor({t, e}, 200, 1.0f);
    const MoeRoutingParams p = moe::routing_params(k.config, k.seq, k.mb);
    Context ctx;
    // L = Σ probs·R + aux + seq_aux + z; the losses' upstream gradient is 1 (aux_loss_scale).
    testing::GradCheck gc([&] {
      const testing::RoutingRun r = testing::run_routing(ctx, p, logits, Tensor());
      const std::vector<float> l = r.losses.to_floats();
      return std::vector<Tensor>{r.probs, Tensor::from_floats({l[0] + l[1] + l[2]}, {1})};
    });
    ASSERT_EQ(gc.upstream(1).numel(), 1);
    const float loss_up = gc.upstream(1).item(0);
    const testing::RoutingRun r = testing::run_routing(ctx, p, logits, Tensor());
    Tensor grad_probs = gc.upstream(0).clone();
    // the losses' gradients come with aux_loss_scale = their upstream value
    const Tensor grad = testing::run_routing_backward(ctx, p, r, logits, grad_probs, loss_up);
    // probs' part scales with R, the losses' with loss_up: the check covers both
    gc.check("logits", logits, grad, {1e-3, 2e-2, 3e-3});
  }
}

TEST(MoeRouting, ExpertBiasUpdateMatchesMoeUtils) {
  Context ctx;
  const Tensor n = Tensor::from_floats({3, 5, 4, 4, 0, 8}, {6}), b = random_tensor({6}, 3, 0.1f);
  Tensor got = b.clone();
  cpu::moe_expert_bias_update(ctx, n, 0.01f, got);
  EXPECT_EQ(got.to_floats(), moe::updated_expert_bias(n, b, 0.01f).to_floats());
}

// ---- permutation ------------------------------------------------------------------------------------

// A random routing map of t tokens over e experts, k distinct experts per token.
Tensor random_map(int64_t t, int64_t e, int k, uint64_t seed) {
  std::vector<int64_t> m(static_cast<size_t>(t * e), 0);
  const Tensor noise = random_tensor({t, e}, seed, 1.0f);
  const std::vector<float> v = noise.to_floats();
  for (int64_t i = 0; i < t; ++i) {
    std::vector<int64_t> idx(static_cast<size_t>(e));
    for (int64_t x = 0; x < e; ++x) idx[size_t(x)] = x;
    std::sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) { return v[size_t(i * e + a)] > v[size_t(i * e + b)]; });
    for (int j = 0; j < k; ++j) m[size_t(i * e + idx[size_t(j)])] = 1;
  }
  return Tensor::from_ints(m, {t, e}, DType::UInt8);
}

TEST(MoePermutation, MatchesMoeUtils) {
  Context ctx;
  struct Case {
    int64_t t, e;
    int k;
    int64_t capacity;
  };
  for (const Case& c : {Case{17, 4, 2, 0}, Case{64, 8, 2, 0}, Case{30, 6, 3, 7}, Case{12, 5, 1, 12}, Case{40, 8, 2, 3}}) {
    SCOPED_TRACE("t=" + std::to_string(c.t) + " e=" + std::to_string(c.e) + " cap=" + std::to_string(c.capacity));
    const Tensor map = random_map(c.t, c.e, c.k, uint64_t(c.t * 7 + c.e));
    const moe::Permutation want = moe::make_permutation(map, c.capacity);
    MoePermutation perm;
    cpu::moe_permutation(ctx, map, c.capacity, perm);
    EXPECT_EQ(perm.rows_per_expert, want.tokens_per_expert);
    EXPECT_EQ(perm.sorted_indices.to_ints(), want.sorted_indices);
    EXPECT_EQ(perm.row_expert.to_ints(), want.row_expert);
    const int64_t n = perm.rows(), h = 24;
    for (DType dt : {DType::Float32, DType::BFloat16}) {
      const Tensor x = random_tensor({c.t, h}, 5, 1.0f, dt), rows = random_tensor({n, h}, 6, 1.0f, dt);
      const Tensor probs = random_tensor({c.t, c.e}, 9, 1.0f), gp = random_tensor({n}, 10, 1.0f);
      Tensor permuted = Tensor::empty({n, h}, dt);
      cpu::moe_permute_forward(ctx, x, perm, permuted);
      EXPECT_EQ(permuted.to_floats(), moe::permute_forward(x, want).to_floats());
      Tensor back = Tensor::empty({c.t, h}, dt);
      cpu::moe_permute_backward(ctx, rows, perm, back);
      EXPECT_EQ(back.to_floats(), moe::permute_backward(rows, want).to_floats());
      Tensor pp = Tensor::empty({n}, DType::Float32);
      cpu::moe_permute_probs_forward(ctx, probs, perm, pp);
      EXPECT_EQ(pp.to_floats(), moe::permute_probs(probs, want).to_floats());
      Tensor gprobs = Tensor::empty({c.t, c.e}, DType::Float32);
      cpu::moe_permute_probs_backward(ctx, gp, perm, gprobs);
      EXPECT_EQ(gprobs.to_floats(), moe::permute_probs_backward(gp, want, c.e).to_floats());
      Tensor out = Tensor::empty({c.t, h}, dt);
      cpu::moe_unpermute_forward(ctx, rows, pp, perm, out);
      EXPECT_EQ(out.to_floats(), moe::unpermute_forward(rows, pp, want).to_floats());
      const Tensor g = random_tensor({c.t, h}, 11, 1.0f, dt);
      Tensor gx = Tensor::empty({n, h}, dt), gw = Tensor::empty({n}, DType::Float32), want_gx, want_gw;
      cpu::moe_unpermute_backward(ctx, g, rows, pp, perm, gx, gw);
      moe::unpermute_backward(g, rows, pp, want, want_gx, want_gw);
      EXPECT_EQ(gx.to_floats(), want_gx.to_floats());
      EXPECT_EQ(gw.to_floats(), want_gw.to_floats());
    }
  }
}

TEST(MoePermutation, UnpermuteGradientsMatchFiniteDifferences) {
  Context ctx;
  const int64_t t = 10, e = 4, h = 6;
  MoePermutation perm;
  cpu::moe_permutation(ctx, random_map(t, e, 2, 3), 0, perm);
  const int64_t n = perm.rows();
  Tensor rows = random_tensor({n, h}, 1, 1.0f), probs = random_tensor({n}, 2, 1.0f);
  testing::GradCheck gc([&] {
    Tensor out = Tensor::empty({t, h}, DType::Float32);
    cpu::moe_unpermute_forward(ctx, rows, probs, perm, out);
    return std::vector<Tensor>{out};
  });
  Tensor gx = Tensor::empty({n, h}, DType::Float32), gp = Tensor::empty({n}, DType::Float32);
  cpu::moe_unpermute_backward(ctx, gc.upstream(0), rows, probs, perm, gx, gp);
  gc.check("permuted", rows, gx);
  gc.check("probs", probs, gp);
  // permute's backward is the transpose of its forward: <P x, y> = <x, Pᵀ y>
  Tensor x = random_tensor({t, h}, 4, 1.0f), y = random_tensor({n, h}, 5, 1.0f);
  Tensor px = Tensor::empty({n, h}, DType::Float32), pty = Tensor::empty({t, h}, DType::Float32);
  cpu::moe_permute_forward(ctx, x, perm, px);
  cpu::moe_permute_backward(ctx, y, perm, pty);
  double a = 0, b = 0;
  const std::vector<float> pxv = px.to_floats(), yv = y.to_floats(), xv = x.to_floats(), ptyv = pty.to_floats();
  for (size_t i = 0; i < pxv.size(); ++i) a += double(pxv[i]) * yv[i];
  for (size_t i = 0; i < xv.size(); ++i) b += double(xv[i]) * ptyv[i];
  EXPECT_NEAR(a, b, 1e-4 * std::fabs(a) + 1e-5);
}

// ---- row scaling and the grouped GEMM ---------------------------------------------------------------

TEST(MoeScaleRows, ForwardAndFiniteDifferences) {
  Context ctx;
  const int64_t n = 7, c = 9;
  Tensor x = random_tensor({n, c}, 1, 1.0f), p = random_tensor({n}, 2, 1.0f);
  Tensor out = Tensor::empty({n, c}, DType::Float32);
  cpu::moe_scale_rows_forward(ctx, x, p, out);
  const std::vector<float> xv = x.to_floats(), pv = p.to_floats(), ov = out.to_floats();
  for (int64_t i = 0; i < n * c; ++i) EXPECT_EQ(ov[size_t(i)], xv[size_t(i)] * pv[size_t(i / c)]);
  testing::GradCheck gc([&] {
    Tensor o = Tensor::empty({n, c}, DType::Float32);
    cpu::moe_scale_rows_forward(ctx, x, p, o);
    return std::vector<Tensor>{o};
  });
  Tensor gx = Tensor::empty({n, c}, DType::Float32), gp = Tensor::empty({n}, DType::Float32);
  cpu::moe_scale_rows_backward(ctx, gc.upstream(0), x, p, gx, gp);
  gc.check("x", x, gx);
  gc.check("probs", p, gp);
}

// The grouped experts' biases: y[r] += s[r] · b_e by hand (s = 1 or the probabilities), the
// gradients of the biases and probabilities by finite differences, and the backward accumulating.
TEST(MoeGroupedBias, ForwardByHandAndFiniteDifferences) {
  Context ctx;
  const int64_t c = 5, n = 8;
  const std::vector<int64_t> rows = {3, 0, 4, 1};
  std::vector<Tensor> b;
  for (int e = 0; e < 4; ++e) b.push_back(random_tensor({c}, 10 + e, 1.0f));
  const Tensor y0 = random_tensor({n, c}, 1, 1.0f);
  Tensor p = random_tensor({n}, 2, 1.0f);
  for (bool weighted : {false, true}) {
    SCOPED_TRACE(weighted ? "weighted by the probabilities" : "plain");
    const Tensor probs = weighted ? p : Tensor();
    Tensor y = y0.clone();
    cpu::moe_grouped_bias_forward(ctx, y, b, rows, probs);
    const std::vector<float> yv = y.to_floats(), y0v = y0.to_floats(), pv = p.to_floats();
    int64_t r = 0;
    for (int e = 0; e < 4; ++e) {
      const std::vector<float> bv = b[size_t(e)].to_floats();
      for (int64_t k = 0; k < rows[size_t(e)]; ++k, ++r)
        for (int64_t j = 0; j < c; ++j)
          EXPECT_FLOAT_EQ(yv[size_t(r * c + j)], y0v[size_t(r * c + j)] + (weighted ? pv[size_t(r)] : 1.0f) * bv[size_t(j)]);
    }
    testing::GradCheck gc([&] {
      Tensor o = y0.clone();
      cpu::moe_grouped_bias_forward(ctx, o, b, rows, probs);
      return std::vector<Tensor>{o};
    });
    std::vector<Tensor> db;
    for (int e = 0; e < 4; ++e) db.push_back(Tensor::zeros({c}, DType::Float32));
    Tensor gp = weighted ? Tensor::zeros({n}, DType::Float32) : Tensor();
    cpu::moe_grouped_bias_backward(ctx, gc.upstream(0), b, rows, probs, db, gp);
    for (int e = 0; e < 4; ++e) gc.check("bias " + std::to_string(e), b[size_t(e)], db[size_t(e)]);
    if (weighted) gc.check("probs", p, gp);
    const std::vector<float> once = db[0].to_floats();
    cpu::moe_grouped_bias_backward(ctx, gc.upstream(0), b, rows, probs, db, gp);  // accumulates
    const std::vector<float> twice = db[0].to_floats();
    for (int64_t j = 0; j < c; ++j) EXPECT_FLOAT_EQ(twice[size_t(j)], 2 * once[size_t(j)]);
  }
}

TEST(MoeGroupedLinear, MatchesOneLinearPerExpertAndFiniteDifferences) {
  Context ctx;
  const int64_t in = 5, out = 3;
  const std::vector<int64_t> rows = {4, 0, 7, 1};
  const int64_t n = 12;
  std::vector<Tensor> w, wg, wg_want;
  for (int e = 0; e < 4; ++e) {
    w.push_back(random_tensor({out, in}, 10 + e, 0.5f));
    wg.push_back(random_tensor({out, in}, 20 + e, 1.0f));
    wg_want.push_back(wg.back().clone());
  }
  Tensor x = random_tensor({n, in}, 1, 1.0f), dy = random_tensor({n, out}, 2, 1.0f);
  Tensor y = Tensor::empty({n, out}, DType::Float32);
  cpu::moe_grouped_linear_forward(ctx, x, w, rows, y);
  Tensor dx = Tensor::empty({n, in}, DType::Float32);
  cpu::moe_grouped_linear_backward(ctx, dy, x, w, rows, dx, wg);
  // by hand: y[r] = x[r] · W_eᵀ for r in expert e's block; dW_e = Σ dy[r]ᵀ x[r]
  const std::vector<float> xv = x.to_floats(), yv = y.to_floats(), dyv = dy.to_floats(), dxv = dx.to_floats();
  int64_t r0 = 0;
  for (int e = 0; e < 4; ++e) {
    const std::vector<float> wv = w[size_t(e)].to_floats();
    std::vector<float> dw = wg_want[size_t(e)].to_floats();
    for (int64_t r = r0; r < r0 + rows[size_t(e)]; ++r) {
      for (int64_t o = 0; o < out; ++o) {
        double s = 0;
        for (int64_t i = 0; i < in; ++i) s += double(xv[size_t(r * in + i)]) * wv[size_t(o * in + i)];
        EXPECT_NEAR(yv[size_t(r * out + o)], s, 1e-5);
        for (int64_t i = 0; i < in; ++i) dw[size_t(o * in + i)] += dyv[size_t(r * out + o)] * xv[size_t(r * in + i)];
      }
      for (int64_t i = 0; i < in; ++i) {
        double s = 0;
        for (int64_t o = 0; o < out; ++o) s += double(dyv[size_t(r * out + o)]) * wv[size_t(o * in + i)];
        EXPECT_NEAR(dxv[size_t(r * in + i)], s, 1e-5);
      }
    }
    EXPECT_LE(rel_error(wg[size_t(e)].to_floats(), dw), 1e-6) << "expert " << e;
    r0 += rows[size_t(e)];
  }
}

// ---- the global aux loss (Note [Global aux loss] in core/transformer/moe/router.h) -------------------

// Three tokens, four experts, top-2 softmax scores, worked by hand: the aux scores are each token's
// softmax over the four logits, the aux map its top 2; with tokens per expert n (the step's average
// over tp × dp × cp) and N = T · group the loss is coeff · E / (k · N²) · Σ_x (Σ_t score[t, x]) · n[x].
TEST(MoeGlobalAuxLoss, MatchesAHandComputation) {
  moe::RouterConfig c;
  c.num_experts = 4;
  c.topk = 2;
  c.global_aux_loss_coeff = 0.5f;
  const std::vector<float> l = {0.0f, 1.0f, 2.0f, 3.0f, 1.0f, 1.0f, 0.0f, -1.0f, 2.0f, 0.0f, 0.0f, 2.0f};
  const Tensor logits = Tensor::from_floats(l, {3, 4});
  const int64_t group = 2;
  std::vector<double> score_sums(4, 0.0);
  for (int t = 0; t < 3; ++t) {
    double z = 0;
    for (int x = 0; x < 4; ++x) z += std::exp(double(l[size_t(t * 4 + x)]));
    for (int x = 0; x < 4; ++x) score_sums[size_t(x)] += std::exp(double(l[size_t(t * 4 + x)])) / z;
  }
  // The aux map's counts: token 0 -> {3, 2}, token 1 -> {0, 1} (ties to the lower index), token 2 -> {0, 3}.
  const std::vector<float> counts = {2, 1, 1, 2};
  const std::vector<float> tokens = {3.5f, 1.0f, 2.0f, 4.5f};  // e.g. (this + another microbatch) / 2
  const double n_total = 3.0 * group;
  double want = 0;
  for (int x = 0; x < 4; ++x) want += score_sums[size_t(x)] * tokens[size_t(x)];
  want *= 0.5 * 4 / (2 * n_total * n_total);

  Context ctx;
  const MoeRoutingParams p = moe::routing_params(c, 3, 1, group);
  const testing::RoutingRun r = testing::run_routing(ctx, p, logits, Tensor());
  Tensor n = Tensor::empty({4}, DType::Float32), loss = Tensor::empty({1}, DType::Float32);
  cpu::moe_expert_counts(ctx, r.aux_map, n);
  EXPECT_EQ(n.to_floats(), counts);
  cpu::moe_global_aux_loss_forward(ctx, r.aux_scores, Tensor::from_floats(tokens, {4}), p, loss);
  EXPECT_NEAR(loss.item(0), want, 1e-6 * want);
  const std::vector<float> l3 = r.losses.to_floats();
  EXPECT_EQ(l3, std::vector<float>(3, 0.0f)) << "the global loss is not one of the routing op's own";

  // moe_utils.cpp: routing_forward with the counts' reduction given (the loss sees `tokens` for the
  // counts it is handed), and the same loss function on its own.
  moe::CountReduction red;
  red.global_group_size = int(group);
  std::vector<float> seen;
  red.global_average = [&](std::vector<float> v) {
    seen = v;
    return tokens;
  };
  moe::RoutingSaved saved;
  const moe::RoutingOutput out = moe::routing_forward(c, logits, Tensor(), 3, 1, saved, &red);
  EXPECT_EQ(seen, counts);
  EXPECT_NEAR(out.global_aux_loss, want, 1e-6 * want);
  EXPECT_EQ(out.aux_loss, 0.0);
  EXPECT_EQ(moe::global_aux_loss(saved.aux_scores, tokens, n_total, 2, 0.5f), out.global_aux_loss);
  // Without a reduction (one rank, one microbatch) the counts are this microbatch's own.
  moe::RoutingSaved one;
  const moe::RoutingOutput single = moe::routing_forward(c, logits, Tensor(), 3, 1, one);
  EXPECT_NEAR(single.global_aux_loss, moe::global_aux_loss(one.aux_scores, counts, 3.0, 2, 0.5f), 1e-15);
}

// The op's gradient (and moe_utils.cpp's) against finite differences of L = Σ probs·R + a·loss, for
// softmax and sigmoid scores, composed with the other losses.
TEST(MoeGlobalAuxLoss, GradientsMatchFiniteDifferencesAndMoeUtils) {
  for (const char* score : {"softmax", "sigmoid"}) {
    SCOPED_TRACE(score);
    moe::RouterConfig c;
    c.num_experts = 8;
    c.topk = 2;
    c.score_function = score;
    c.global_aux_loss_coeff = 0.4f;
    c.aux_loss_coeff = 0.1f;
    c.z_loss_coeff = 0.05f;
    const int64_t seq = 5, mb = 2, t = seq * mb, group = 3;
    const MoeRoutingParams p = moe::routing_params(c, seq, mb, group);
    const Tensor tokens = Tensor::from_floats({7, 1, 2.5f, 3, 0, 4, 1.5f, 5}, {8});
    Tensor logits = random_tensor({t, 8}, 300, 1.0f);
    Context ctx;
    auto forward = [&] {
      const testing::RoutingRun r = testing::run_routing(ctx, p, logits, Tensor());
      Tensor loss = Tensor::empty({1}, DType::Float32);
      cpu::moe_global_aux_loss_forward(ctx, r.aux_scores, tokens, p, loss);
      const std::vector<float> l = r.losses.to_floats();
      return std::vector<Tensor>{r.probs, Tensor::from_floats({l[0] + l[1] + l[2] + loss.item(0)}, {1})};
    };
    testing::GradCheck gc(forward);
    const float up = gc.upstream(1).item(0);
    const testing::RoutingRun r = testing::run_routing(ctx, p, logits, Tensor());
    Tensor grad = testing::run_routing_backward(ctx, p, r, logits, gc.upstream(0), up);
    cpu::moe_global_aux_loss_backward(ctx, logits, r.aux_scores, tokens, p, up, grad);
    gc.check("logits", logits, grad, {1e-3, 2e-2, 3e-3});
    // moe_utils.cpp's routing_backward with the same counts gives the same gradient.
    moe::CountReduction red;
    red.global_group_size = int(group);
    red.global_average = [&](std::vector<float>) { return tokens.to_floats(); };
    moe::RoutingSaved saved;
    moe::routing_forward(c, logits, Tensor(), seq, mb, saved, &red);
    const Tensor g_ref = moe::routing_backward(c, gc.upstream(0), saved, up);
    EXPECT_LE(rel_error(grad.to_floats(), g_ref.to_floats()), 1e-6);
  }
}

// ---- the input jitter (Note [Router input jitter]) ----------------------------------------------------

TEST(MoeInputJitter, BoundedReplayableAndIndexedByThePlaceInTheSequence) {
  Context ctx;
  const int64_t seq = 8, mb = 3, h = 16, t = seq * mb;
  const Tensor x = random_tensor({t, h}, 51, 1.0f);
  auto jitter = [&](const Tensor& in, float eps, uint64_t offset, int64_t seq_offset) {
    Tensor out = Tensor::empty(in.shape(), DType::Float32);
    cpu::moe_input_jitter(ctx, in, eps, 1234, offset, mb, seq_offset, out);
    return out;
  };
  EXPECT_EQ(jitter(x, 0.0f, 9, 0).to_floats(), x.to_floats()) << "eps 0 is the identity";
  const Tensor a = jitter(x, 0.1f, 9, 0);
  EXPECT_EQ(jitter(x, 0.1f, 9, 0).to_floats(), a.to_floats()) << "the same stream replays";
  EXPECT_NE(jitter(x, 0.1f, 10, 0).to_floats(), a.to_floats()) << "another stream draws other noise";
  const Tensor ones = Tensor::from_floats(std::vector<float>(size_t(t * h), 1.0f), {t, h});
  const std::vector<float> u = jitter(ones, 0.1f, 9, 0).to_floats();
  double mean = 0;
  for (float v : u) {
    EXPECT_GE(v, 0.9f);
    EXPECT_LT(v, 1.1f);
    mean += v;
  }
  mean /= double(u.size());
  EXPECT_NEAR(mean, 1.0, 0.01);
  const std::vector<float> xv = x.to_floats(), av = a.to_floats();
  for (size_t i = 0; i < xv.size(); ++i) EXPECT_EQ(av[i], xv[i] * u[i]);
  // Two sequence shards (sequence parallelism: positions [0, 4) and [4, 8)) draw the whole sequence's noise.
  const int64_t half = seq / 2 * mb;
  const std::vector<float> lo = jitter(x.slice(0, half).clone(), 0.1f, 9, 0).to_floats();
  const std::vector<float> hi = jitter(x.slice(half, t).clone(), 0.1f, 9, seq / 2).to_floats();
  std::vector<float> both = lo;
  both.insert(both.end(), hi.begin(), hi.end());
  EXPECT_EQ(both, av);
  // moe_utils.cpp's host version is the same function.
  EXPECT_EQ(moe::input_jitter(x, 0.1f, 1234, 9, mb, 0).to_floats(), av);
  // In place, as the router applies it to its input's gradient.
  Tensor g = x.clone();
  cpu::moe_input_jitter(ctx, g, 0.1f, 1234, 9, mb, 0, g);
  EXPECT_EQ(g.to_floats(), av);
}

TEST(MoeOps, BadInputsAreClearErrors) {
  Context ctx;
  moe::RouterConfig c;
  c.num_experts = 8;
  c.topk = 2;
  MoeRoutingParams p = moe::routing_params(c, 3, 2);
  const Tensor logits = random_tensor({5, 8}, 1, 1.0f);  // 5 tokens for 3 x 2
  EXPECT_THROW(testing::run_routing(ctx, p, logits, Tensor()), Error);
  std::vector<Tensor> w = {random_tensor({2, 3}, 1, 1.0f)};
  Tensor y = Tensor::empty({4, 2}, DType::Float32);
  EXPECT_THROW(cpu::moe_grouped_linear_forward(ctx, random_tensor({4, 3}, 2, 1.0f), w, {3}, y), Error);
}

}  // namespace
}  // namespace megatron
