// The routed experts in FP8 on the CPU reference ops (Note [FP8 experts]): each expert's output,
// input gradient, probability gradient and weight gradients equal a reference built from the dense
// FP8 linear layer (Fp8LinearState) applied to that expert's rows alone, with a scaling state of its
// own, for every recipe and format, in the sequential and the grouped form (so the two forms equal
// each other), with an expert without rows; the grouped form also with the step's weight copies kept
// (Note [FP8 weight cache]: the transposes from the forward to the backward, or both for the step). Over three steps the delayed recipe's amax histories
// and scales of every expert equal the reference's, and the expert without rows keeps its fresh
// state. With row counts that are multiples of 16 everything is bit for bit; with counts that the
// experts pad (37, 21 rows) the CPU sgemm of the padded block sums in another order than the
// unpadded reference's, which moves the last bit of some fp32 results (measured: at most 1.1e-6 of
// the tensor's largest value, also in the histories and scales it feeds): compared within 2e-6.
// Blockwise with a width that is not a multiple of 128 is refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "megatron/core/distributed/param_and_grad_buffer.h"
#include "megatron/core/tensor_parallel/fp8_linear.h"
#include "megatron/core/transformer/moe/experts.h"
#include "megatron/core/transformer/moe/moe_layer.h"
#include "megatron/kernels/ops.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

using testing::random_tensor;

// 128 wide (the blockwise recipe's block), 4 experts of 128 with SwiGLU; the row counts need
// padding to 16 (37, 21), one is aligned (64) and one expert gets no rows.
constexpr int64_t kHidden = 128, kFfn = 128;
const std::vector<int64_t> kAligned = {48, 0, 64, 32}, kPadded = {37, 0, 64, 21};

TransformerConfig expert_config() {
  TransformerConfig tc;
  tc.num_layers = 2;
  tc.hidden_size = int(kHidden);
  tc.num_attention_heads = 4;
  tc.vocab_size = 16;
  tc.activation = "swiglu";
  tc.add_bias_linear = false;
  tc.max_position_embeddings = 8;
  tc.finalize();
  return tc;
}

double g_worst = 0;  // the largest relative difference seen (printed per test)

// got == want bit for bit (tol 0), or within tol of want's largest magnitude.
void expect_same(const Tensor& got, const Tensor& want, const std::string& what, double tol) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  const std::vector<float> g = got.to_floats(), w = want.to_floats();
  double scale = 0, worst = 0;
  size_t differ = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    scale = std::max(scale, std::abs(double(w[i])));
    worst = std::max(worst, std::abs(double(g[i]) - double(w[i])));
    differ += g[i] != w[i];
  }
  const double rel = worst / std::max(scale, 1e-30);
  g_worst = std::max(g_worst, rel);
  if (tol == 0) {
    EXPECT_EQ(differ, 0u) << what << ": " << differ << " of " << g.size() << " values differ (" << rel << ")";
  } else {
    EXPECT_LE(rel, tol) << what << ": " << differ << " of " << g.size() << " values differ";
  }
}

// What the experts keep of their weights' FP8 copies within a step (Note [FP8 weight cache]):
// nothing, the transposed copy from the forward to the backward, or both for the step.
enum class Copies { PerUse, KeepTransposes, Cache };

struct Param {
  Fp8Recipe recipe;
  std::string format;
  bool grouped;
  Copies copies = Copies::PerUse;
};

class Fp8Experts : public ::testing::TestWithParam<Param> {};

void check_experts(const Param& P, const std::vector<int64_t>& kRows, double tol) {
  g_worst = 0;
  Fp8Config c;
  c.format = P.format;
  c.recipe = P.recipe;
  c.amax_history_len = 3;
  const TransformerConfig tc = expert_config();
  const int E = int(kRows.size());
  ParamAndGradBuffer params(DType::Float32, Device::cpu());
  moe::SequentialMLP experts(tc, E, /*first_expert=*/4, kFfn, params, "decoder.layers.1.mlp.experts", {}, P.grouped);
  std::vector<Linear*> linears;
  experts.enable_fp8(c, Device::cpu(), linears);
  ASSERT_EQ(linears.size(), size_t(2 * E));
  EXPECT_EQ(linears[0]->name(), "decoder.layers.1.mlp.experts.local_experts.4.linear_fc1");
  EXPECT_EQ(linears[3]->name(), "decoder.layers.1.mlp.experts.local_experts.5.linear_fc2");
  params.allocate();
  params.init_weights(7, 0.05f, 2, false);
  params.zero_grad();
  auto weight = [&](int e, int fc) {
    return params.find(fmt::format("decoder.layers.1.mlp.experts.local_experts.{}.linear_fc{}.weight", 4 + e, fc));
  };

  // The reference: per expert a dense FP8 linear state for fc1 and one for fc2, fresh like the module's.
  std::vector<std::unique_ptr<Fp8LinearState>> ref1, ref2;
  std::vector<Tensor> ref_wg1, ref_wg2;
  for (int e = 0; e < E; ++e) {
    ref1.push_back(std::make_unique<Fp8LinearState>(c, Device::cpu()));
    ref2.push_back(std::make_unique<Fp8LinearState>(c, Device::cpu()));
    ref_wg1.push_back(Tensor::zeros(weight(e, 1)->data.shape(), DType::Float32));
    ref_wg2.push_back(Tensor::zeros(weight(e, 2)->data.shape(), DType::Float32));
  }

  Context ctx;
  int64_t total = 0;
  for (int64_t n : kRows) total += n;
  const int steps = P.recipe == Fp8Recipe::Delayed ? 3 : 1;
  for (int step = 0; step < steps; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const Tensor x = random_tensor({total, kHidden}, 100 + step, 1.0f + step);
    const Tensor dy = random_tensor({total, kHidden}, 200 + step, 1e-2f);
    std::vector<float> pv = random_tensor({total}, 300 + step, 0.3f).to_floats();
    for (float& p : pv) p = 0.5f + p;
    const Tensor probs = Tensor::from_floats(pv, {total});

    // the step's copies (as GPTModel::begin_fp8_step for the experts)
    for (int e = 0; e < E; ++e) {
      for (int fc : {1, 2}) {
        experts.fp8_state(e, fc)->set_weight_cache(P.copies == Copies::Cache);
        experts.fp8_state(e, fc)->set_keep_transposed_weight(P.copies == Copies::KeepTransposes);
      }
    }
    moe::SequentialMLP::Saved saved;
    const Tensor y = experts.forward(ctx, x, probs, kRows, saved);
    if (P.copies != Copies::PerUse) {  // the forward's pass made the transposed copies of the experts with rows
      for (int e = 0; e < E; ++e) {
        EXPECT_EQ(experts.fp8_state(e, 1)->has_cached_weight(), kRows[size_t(e)] > 0) << "expert " << e;
        EXPECT_EQ(experts.fp8_state(e, 1)->wants_transposed_in_forward(), kRows[size_t(e)] == 0) << "expert " << e;
      }
    }
    Tensor grad_probs;
    const Tensor gx = experts.backward(ctx, dy, saved, grad_probs);
    for (int e = 0; e < E; ++e) {  // the backward took the kept transposes; the cache holds both until dropped
      EXPECT_EQ(experts.fp8_state(e, 2)->has_cached_weight(), P.copies == Copies::Cache && kRows[size_t(e)] > 0);
      for (int fc : {1, 2}) {
        experts.fp8_state(e, fc)->set_weight_cache(false);
        experts.fp8_state(e, fc)->set_keep_transposed_weight(false);
        EXPECT_FALSE(experts.fp8_state(e, fc)->has_cached_weight());
      }
    }

    int64_t row = 0;
    for (int e = 0; e < E; ++e) {
      const int64_t n = kRows[size_t(e)];
      if (n == 0) continue;
      SCOPED_TRACE("expert " + std::to_string(e));
      const Tensor xe = x.slice(row, row + n), pe = probs.slice(row, row + n), dye = dy.slice(row, row + n);
      const Tensor& w1 = weight(e, 1)->data;
      const Tensor& w2 = weight(e, 2)->data;
      Tensor fc1 = Tensor::empty({n, 2 * kFfn}, DType::Float32), act = Tensor::empty({n, kFfn}, DType::Float32);
      Tensor scaled = Tensor::empty({n, kFfn}, DType::Float32), ye = Tensor::empty({n, kHidden}, DType::Float32);
      ref1[size_t(e)]->forward(ctx, xe, w1, Tensor(), fc1);
      ops::swiglu_forward(ctx, fc1, act);
      ops::moe_scale_rows_forward(ctx, act, pe, scaled);
      ref2[size_t(e)]->forward(ctx, scaled, w2, Tensor(), ye);
      expect_same(y.slice(row, row + n), ye, "output", tol);

      Tensor g_scaled = Tensor::empty({n, kFfn}, DType::Float32), none;
      ref2[size_t(e)]->backward(ctx, dye, scaled, w2, g_scaled, ref_wg2[size_t(e)], none);
      Tensor g_act = Tensor::empty({n, kFfn}, DType::Float32), g_p = Tensor::empty({n}, DType::Float32);
      ops::moe_scale_rows_backward(ctx, g_scaled, act, pe, g_act, g_p);
      Tensor g_fc1 = Tensor::empty({n, 2 * kFfn}, DType::Float32), g_x = Tensor::empty({n, kHidden}, DType::Float32);
      ops::swiglu_backward(ctx, g_act, fc1, g_fc1);
      ref1[size_t(e)]->backward(ctx, g_fc1, xe, w1, g_x, ref_wg1[size_t(e)], none);
      expect_same(gx.slice(row, row + n), g_x, "input gradient", tol);
      expect_same(grad_probs.slice(row, row + n), g_p, "probability gradient", tol);
      expect_same(weight(e, 1)->main_grad, ref_wg1[size_t(e)], "fc1 weight gradient", tol);
      expect_same(weight(e, 2)->main_grad, ref_wg2[size_t(e)], "fc2 weight gradient", tol);
      row += n;
    }

    // Note [Delayed scaling]: the step's update, then each expert's state is its reference's.
    for (int e = 0; e < E; ++e) {
      experts.fp8_state(e, 1)->update(ctx);
      experts.fp8_state(e, 2)->update(ctx);
      ref1[size_t(e)]->update(ctx);
      ref2[size_t(e)]->update(ctx);
    }
    if (P.recipe != Fp8Recipe::Delayed) continue;
    for (int e = 0; e < E; ++e) {
      SCOPED_TRACE("expert " + std::to_string(e));
      for (int fc : {1, 2}) {
        Fp8LinearState& got = *experts.fp8_state(e, fc);
        Fp8LinearState& want = fc == 1 ? *ref1[size_t(e)] : *ref2[size_t(e)];
        expect_same(got.forward_scaling().amax_history(), want.forward_scaling().amax_history(), "forward history", tol);
        expect_same(got.forward_scaling().scales(), want.forward_scaling().scales(), "forward scales", tol);
        expect_same(got.backward_scaling().amax_history(), want.backward_scaling().amax_history(),
                    "backward history", tol);
        expect_same(got.backward_scaling().scales(), want.backward_scaling().scales(), "backward scales", tol);
      }
    }
    // the histories are live: the data of a busy expert is in them, scales have moved
    const std::vector<float> h = experts.fp8_state(0, 1)->forward_scaling().amax_history().to_floats();
    EXPECT_GT(h[4], 0.0f) << "the newest row (the last) of expert 0's input history";
    EXPECT_NE(experts.fp8_state(2, 2)->backward_scaling().scales().item(), 1.0f);
    // the expert without rows was skipped: its history is empty and its scales are TE's fresh 1
    for (int fc : {1, 2}) {
      for (float v : experts.fp8_state(1, fc)->forward_scaling().amax_history().to_floats()) EXPECT_EQ(v, 0.0f);
      for (float v : experts.fp8_state(1, fc)->forward_scaling().scales().to_floats()) EXPECT_EQ(v, 1.0f);
    }
  }
  // FP8 is in use: the output differs from the unquantised experts' on the same parameters.
  {
    ParamAndGradBuffer plain_params(DType::Float32, Device::cpu());
    moe::SequentialMLP plain(tc, E, 4, kFfn, plain_params, "decoder.layers.1.mlp.experts", {}, P.grouped);
    plain_params.allocate();
    for (Parameter* q : plain_params.parameters()) q->data.copy_from(params.find(q->name)->data);
    const Tensor x = random_tensor({total, kHidden}, 999), probs = Tensor::from_floats(std::vector<float>(size_t(total), 0.7f), {total});
    moe::SequentialMLP::Saved s1, s2;
    const std::vector<float> a = experts.forward(ctx, x, probs, kRows, s1).to_floats();
    const std::vector<float> b = plain.forward(ctx, x, probs, kRows, s2).to_floats();
    double diff = 0, scale = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      diff = std::max(diff, std::abs(double(a[i]) - b[i]));
      scale = std::max(scale, std::abs(double(b[i])));
    }
    EXPECT_GT(diff, 0.0);
    EXPECT_LT(diff, 0.25 * scale);
  }
  std::printf("%s rows %s: largest difference from the reference %.3g of the largest value\n",
              (to_string(P.recipe) + " " + P.format + (P.grouped ? " grouped" : " sequential") +
               (P.copies == Copies::KeepTransposes ? " (kept transposes)" : P.copies == Copies::Cache ? " (cached)" : ""))
                  .c_str(),
              kRows == kAligned ? "aligned" : "padded", g_worst);
}

TEST_P(Fp8Experts, EachExpertIsTheDenseFp8LinearOnItsRows) {
  {
    SCOPED_TRACE("rows aligned to 16");
    check_experts(GetParam(), kAligned, 0);
  }
  {
    SCOPED_TRACE("rows padded to 16");
    check_experts(GetParam(), kPadded, 2e-6);
  }
}

std::string param_name(const ::testing::TestParamInfo<Param>& i) {
  const std::string copies = i.param.copies == Copies::KeepTransposes ? "_kept_transposes"
                             : i.param.copies == Copies::Cache        ? "_cached"
                                                                      : "";
  return to_string(i.param.recipe) + "_" + i.param.format + (i.param.grouped ? "_grouped" : "_sequential") + copies;
}

INSTANTIATE_TEST_SUITE_P(
    Recipes, Fp8Experts,
    ::testing::Values(Param{Fp8Recipe::Delayed, "hybrid", false}, Param{Fp8Recipe::Delayed, "hybrid", true},
                      Param{Fp8Recipe::Delayed, "e4m3", false}, Param{Fp8Recipe::Delayed, "e4m3", true},
                      Param{Fp8Recipe::Tensorwise, "hybrid", false}, Param{Fp8Recipe::Tensorwise, "hybrid", true},
                      Param{Fp8Recipe::Tensorwise, "e4m3", true}, Param{Fp8Recipe::Blockwise, "hybrid", false},
                      Param{Fp8Recipe::Blockwise, "hybrid", true}, Param{Fp8Recipe::Blockwise, "e4m3", true},
                      Param{Fp8Recipe::Delayed, "hybrid", true, Copies::KeepTransposes},
                      Param{Fp8Recipe::Tensorwise, "hybrid", true, Copies::KeepTransposes},
                      Param{Fp8Recipe::Delayed, "hybrid", true, Copies::Cache},
                      Param{Fp8Recipe::Tensorwise, "hybrid", true, Copies::Cache}),
    param_name);

TEST(Fp8ExpertsRefused, BlockwiseNeedsWidthsOfTheBlock) {
  const TransformerConfig tc = expert_config();
  ParamAndGradBuffer params(DType::Float32, Device::cpu());
  moe::SequentialMLP experts(tc, 2, 0, 96, params, "e", {}, true);
  Fp8Config c;
  c.format = "hybrid";
  c.recipe = Fp8Recipe::Blockwise;
  std::vector<Linear*> linears;
  const std::string e = testing::error_of([&] { experts.enable_fp8(c, Device::cpu(), linears); });
  EXPECT_NE(e.find("--fp8-recipe blockwise needs --hidden-size (128) and the experts' width"), std::string::npos) << e;
}

// Note [Routing padding for FP8] in an MoE layer (alltoall dispatcher, one rank): the experts
// receive multiples of 16 rows; the added rows carry probability 0, so without FP8 the layer's
// output, input gradient and every parameter gradient are the unpadded layer's (to the last bits
// that the CPU sgemm's row-count-dependent summation order moves: measured 2.4e-7 on values up to
// 1); with FP8 the padded rows enter the amaxes (as in Megatron) and the layer stays close.
TEST(Fp8Experts, RouterPaddingGivesAlignedRowsThatAddNothing) {
  TransformerConfig tc = expert_config();
  tc.hidden_size = 32;
  tc.finalize();
  const int64_t seq = 20, mb = 2, t_count = seq * mb, h = 32;
  auto run = [&](bool padding, bool fp8, std::vector<int64_t>& rows, std::vector<float>& grads) {
    moe::MoEConfig mc;
    mc.router.num_experts = 4;
    mc.router.topk = 2;
    mc.router.aux_loss_coeff = 0.01f;
    mc.ffn_hidden_size = 32;
    mc.dispatcher = "alltoall";
    mc.router_padding = padding;
    ParamAndGradBuffer params(DType::Float32, Device::cpu());
    moe::MoELayer layer(tc, mc, params, "decoder.layers.1.mlp", 1);
    if (fp8) {
      Fp8Config c;
      c.format = "hybrid";
      c.recipe = Fp8Recipe::Tensorwise;
      std::vector<Linear*> dense, expert;
      layer.enable_fp8(c, Device::cpu(), dense, expert);
      EXPECT_EQ(expert.size(), 8u);
    }
    params.allocate();
    params.init_weights(5, 0.2f, 2, false);
    params.zero_grad();
    Context ctx;
    const Tensor x = random_tensor({t_count, h}, 61), dy = random_tensor({t_count, h}, 62, 1e-2f);
    moe::MoELayer::Saved saved;
    const Tensor y = layer.forward(ctx, x, seq, mb, nullptr, saved);
    rows = saved.experts.tokens_per_expert;
    const Tensor gx = layer.backward(ctx, dy, saved);
    grads = y.to_floats();
    for (float v : gx.to_floats()) grads.push_back(v);
    for (Parameter* q : params.parameters())
      for (float v : q->main_grad.to_floats()) grads.push_back(v);
  };
  std::vector<int64_t> rows_plain, rows_padded, rows_fp8;
  std::vector<float> plain, padded, fp8_plain, fp8_padded;
  run(false, false, rows_plain, plain);
  run(true, false, rows_padded, padded);
  int64_t routed = 0, total = 0;
  for (size_t e = 0; e < rows_padded.size(); ++e) {
    EXPECT_EQ(rows_padded[e] % 16, 0) << "expert " << e;
    EXPECT_GE(rows_padded[e], rows_plain[e]);
    EXPECT_LT(rows_padded[e] - rows_plain[e], 16);
    routed += rows_plain[e];
    total += rows_padded[e];
  }
  EXPECT_GT(total, routed) << "the map needed padding";
  {  // equal but for the CPU sgemm's summation order, which depends on the row count
    ASSERT_EQ(padded.size(), plain.size());
    double worst = 0, scale = 0;
    for (size_t i = 0; i < padded.size(); ++i) {
      worst = std::max(worst, std::abs(double(padded[i]) - plain[i]));
      scale = std::max(scale, std::abs(double(plain[i])));
    }
    std::printf("router padding without FP8: largest difference %.3g of values up to %.3g\n", worst, scale);
    EXPECT_LE(worst, 2e-6 * scale) << "the padded rows changed the layer";
  }
  run(false, true, rows_fp8, fp8_plain);
  run(true, true, rows_fp8, fp8_padded);
  for (int64_t n : rows_fp8) EXPECT_EQ(n % 16, 0);
  double diff = 0, scale = 0;
  for (size_t i = 0; i < fp8_plain.size(); ++i) {
    diff = std::max(diff, std::abs(double(fp8_padded[i]) - fp8_plain[i]));
    scale = std::max(scale, std::abs(double(fp8_plain[i])));
  }
  EXPECT_LT(diff, 0.1 * scale);
}

}  // namespace
}  // namespace megatron
