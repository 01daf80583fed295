// The FP8 recipes' scaling state on the CPU: the delayed recipe's amax history and scales step by
// step against an independent computation (the last L amaxes of each tensor), current scaling,
// and Megatron's bf16 first/last layers and option checks.
#include "megatron/core/fp8_utils.h"

#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "tests/test_util.h"

namespace megatron {
namespace {

using testing::error_of;

// x whose max |x| is a — for a NaN, 0.5 with a NaN among the values (the quantiser's amax skips it).
Tensor with_amax(float a, int64_t n = 6) {
  const float top = std::isnan(a) ? 0.5f : a;
  std::vector<float> v(static_cast<size_t>(n), 0.0f);
  for (int64_t i = 0; i + 1 < n; ++i) v[size_t(i)] = (i % 2 ? -1.0f : 1.0f) * top * float(i + 1) / float(n);
  v[size_t(n - 1)] = top;
  if (std::isnan(a)) v[1] = a;
  return Tensor::from_floats(v, {2, n / 2});
}

// The delayed recipe as defined (Note [Delayed scaling]), computed from the sequence of amaxes.
struct DelayedModel {
  int len;
  bool use_max;
  float scaled_max;
  std::vector<float> seen;  // every step's amax
  float scale = 1.0f;
  void step(float amax_now) {
    if (amax_now == 0.0f) return;  // a step with amax 0 changes nothing
    seen.push_back(std::isnan(amax_now) ? 0.5f : amax_now);  // with_amax's NaN case
    float amax = seen.back();
    if (use_max) {
      amax = 0.0f;
      for (size_t i = seen.size() > size_t(len) ? seen.size() - size_t(len) : 0; i < seen.size(); ++i)
        amax = std::max(amax, seen[i]);
    }
    if (std::isfinite(amax) && amax > 0.0f) {
      scale = scaled_max / amax;
      if (std::isinf(scale)) scale = FLT_MAX;
    }
  }
  // The history after the update: row 0 cleared, rows 1..L-1 the last L-1 amaxes, oldest first.
  std::vector<float> history() const {
    std::vector<float> h(size_t(len), 0.0f);
    for (int r = 1; r < len; ++r) {
      const int64_t idx = int64_t(seen.size()) - int64_t(len) + r;
      if (idx >= 0) h[size_t(r)] = seen[size_t(idx)];
    }
    return h;
  }
};

void run_delayed(int len, bool use_max, int margin, DType dtype) {
  SCOPED_TRACE("L=" + std::to_string(len) + (use_max ? " max" : " most_recent") + " margin=" + std::to_string(margin) +
               " " + std::string(to_string(dtype)));
  Context ctx;
  Fp8Config c;
  c.format = "hybrid";
  c.recipe = Fp8Recipe::Delayed;
  c.amax_history_len = len;
  c.amax_compute_max = use_max;
  c.margin = margin;
  Fp8TensorScaling state(c, 2, dtype, Device::cpu());
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  // tensor 0 grows, jumps, vanishes, overflows and sees a NaN; tensor 1 shrinks smoothly
  const std::vector<float> seq0 = {1.0f, 2.0f, 0.5f, 300.0f, 0.0f, 7.0f, inf, 3.0f, nan, 1e-3f,
                                   4.0f, 4.0f, 1e-40f, 9.0f, 0.25f, 0.0f, 0.0f, 2.0f, 5.0f, 1.5f};
  const float fp8_max = fp8_max_of(dtype);
  DelayedModel m0{len, use_max, fp8_max * std::pow(2.0f, float(-margin))}, m1 = m0;
  for (int step = 0; step < 20; ++step) {
    const float a0 = seq0[size_t(step)], a1 = 100.0f / float(step + 1);
    const std::vector<float> s_before = state.scales().to_floats();
    EXPECT_EQ(s_before[0], m0.scale) << "step " << step;
    EXPECT_EQ(s_before[1], m1.scale) << "step " << step;
    // quantise with the scale of the previous update, recording the amax into row 0
    Tensor x0 = with_amax(a0), x1 = with_amax(a1), none;
    Tensor q0 = Tensor::empty(x0.shape(), dtype), q1 = Tensor::empty(x1.shape(), dtype);
    state.quantize(ctx, 0, x0, q0, none);
    state.quantize(ctx, 1, x1, q1, none);
    EXPECT_EQ(state.scale_inv(0).item(), 1.0f / m0.scale);
    const std::vector<float> xv = x0.to_floats();
    for (size_t i = 0; i < xv.size(); ++i) {
      const uint8_t want = dtype == DType::Float8E4M3 ? to_fp8_e4m3(xv[i] * m0.scale).bits
                                                      : to_fp8_e5m2(xv[i] * m0.scale).bits;
      EXPECT_EQ(static_cast<const uint8_t*>(q0.raw_data())[i], want) << "step " << step << " element " << i;
    }
    const std::vector<float> row0 = state.amax_history().to_floats();
    EXPECT_EQ(row0[0], std::isnan(a0) ? 0.5f : a0) << "step " << step;
    const std::vector<float> before = row0;
    state.update(ctx);
    m0.step(a0);
    m1.step(a1);
    const std::vector<float> h = state.amax_history().to_floats();
    const std::vector<float> w0 = m0.history(), w1 = m1.history();
    if (a0 == 0.0f) {  // tensor 0's column did not move
      for (int r = 0; r < len; ++r) EXPECT_EQ(h[size_t(r * 2)], before[size_t(r * 2)]) << "step " << step;
    }
    for (int r = 0; r < len; ++r) {
      EXPECT_EQ(h[size_t(r * 2)], w0[size_t(r)]) << "step " << step << " row " << r;
      EXPECT_EQ(h[size_t(r * 2 + 1)], w1[size_t(r)]) << "step " << step << " row " << r;
    }
  }
}

TEST(Fp8DelayedScaling, HistoryAndScalesFollowTheRecipeStepByStep) {
  for (int len : {1, 4, 16}) {
    for (bool use_max : {false, true}) run_delayed(len, use_max, 0, DType::Float8E4M3);
  }
  run_delayed(4, true, 2, DType::Float8E5M2);
  run_delayed(3, false, 1, DType::Float8E4M3);
}

// update_fp8_scaling (the step's update of every FP8 layer, grouped per format) equals each
// state's own update(): forward states (e4m3) and gradient states (e5m2) with their own maxima,
// over steps where some tensors are not seen; current-scaling states are left alone.
TEST(Fp8DelayedScaling, UpdatingManyStatesAtOnceIsEachStatesUpdate) {
  Context ctx;
  Fp8Config c;
  c.format = "hybrid";
  c.amax_history_len = 3;
  c.margin = 1;
  Fp8Config cw = c;
  cw.recipe = Fp8Recipe::Tensorwise;
  std::vector<Fp8TensorScaling> grouped, single;
  for (int i = 0; i < 5; ++i) {
    const DType t = i < 3 ? DType::Float8E4M3 : DType::Float8E5M2;
    grouped.emplace_back(c, i < 3 ? 2 : 1, t, Device::cpu());
    single.emplace_back(c, i < 3 ? 2 : 1, t, Device::cpu());
  }
  Fp8TensorScaling current(cw, 1, DType::Float8E4M3, Device::cpu());
  for (int step = 0; step < 4; ++step) {
    for (size_t i = 0; i < grouped.size(); ++i) {
      for (int64_t j = 0; j < grouped[i].size(); ++j) {
        if ((step + int(i) + int(j)) % 3 == 2) continue;  // not seen this step
        Tensor x = with_amax(float(1 + i) * std::ldexp(1.0f, step - int(j))), none;
        Tensor q = Tensor::empty(x.shape(), grouped[i].dtype()), q2 = Tensor::empty(x.shape(), grouped[i].dtype());
        grouped[i].quantize(ctx, j, x, q, none);
        single[i].quantize(ctx, j, x, q2, none);
      }
    }
    Tensor x = with_amax(3.0f), q = Tensor::empty(x.shape(), DType::Float8E4M3), none;
    current.quantize(ctx, 0, x, q, none);
    std::vector<Fp8TensorScaling*> all{&current};
    for (auto& s : grouped) all.push_back(&s);
    update_fp8_scaling(ctx, all);
    for (auto& s : single) s.update(ctx);
    for (size_t i = 0; i < grouped.size(); ++i) {
      EXPECT_EQ(grouped[i].scales().to_floats(), single[i].scales().to_floats()) << "step " << step << " state " << i;
      EXPECT_EQ(grouped[i].amax_history().to_floats(), single[i].amax_history().to_floats())
          << "step " << step << " state " << i;
    }
    EXPECT_EQ(current.scale(0).item(), 448.0f / 3.0f);
  }
}

TEST(Fp8CurrentScaling, ScalesFromTheTensorItself) {
  Context ctx;
  Fp8Config c;
  c.format = "e4m3";
  c.recipe = Fp8Recipe::Tensorwise;
  Fp8TensorScaling state(c, 1, DType::Float8E4M3, Device::cpu());
  for (float a : {3.0f, 500.0f, 0.0f}) {
    Tensor x = with_amax(a), none;
    Tensor q = Tensor::empty(x.shape(), DType::Float8E4M3);
    state.quantize(ctx, 0, x, q, none);
    const float s = a == 0.0f ? 1.0f : 448.0f / a;
    EXPECT_EQ(state.scale(0).item(), s);
    EXPECT_EQ(state.scale_inv(0).item(), 1.0f / s);
    EXPECT_EQ(state.amax(0).item(), a);
    const std::vector<float> xv = x.to_floats();
    for (size_t i = 0; i < xv.size(); ++i)
      EXPECT_EQ(static_cast<const uint8_t*>(q.raw_data())[i], to_fp8_e4m3(xv[i] * s).bits);
    state.update(ctx);  // nothing to roll
    EXPECT_EQ(state.scale(0).item(), s);
  }
}

TEST(Fp8Config, HybridUsesE5m2ForGradients) {
  Fp8Config c;
  EXPECT_FALSE(c.enabled());
  c.format = "e4m3";
  EXPECT_EQ(c.backward_dtype(), DType::Float8E4M3);
  c.format = "hybrid";
  EXPECT_EQ(c.forward_dtype(), DType::Float8E4M3);
  EXPECT_EQ(c.backward_dtype(), DType::Float8E5M2);
}

TEST(Fp8Config, FirstAndLastLayersInBf16AsMegatron) {
  Fp8Config c;
  c.format = "e4m3";
  EXPECT_FALSE(is_first_last_bf16_layer(c, 8, 0));
  c.first_last_layers_bf16 = true;
  c.num_layers_at_start_in_bf16 = 2;
  c.num_layers_at_end_in_bf16 = 1;
  std::vector<bool> bf16;
  for (int l = 0; l < 8; ++l) bf16.push_back(is_first_last_bf16_layer(c, 8, l));
  EXPECT_EQ(bf16, std::vector<bool>({true, true, false, false, false, false, false, true}));
  EXPECT_FALSE(is_first_last_bf16_layer(c, 8, -1));  // "all layers" (Megatron's layer_no < 0)
}

TEST(Fp8Config, RefusesWhatMegatronRefuses) {
  auto check = [](Fp8Config c, int hidden, bool dist_opt, const std::string& needle) {
    const std::string e = error_of([&] { c.validate(4, 2, dist_opt, hidden, 4 * hidden); });
    EXPECT_NE(e.find(needle), std::string::npos) << "got: " << e;
  };
  Fp8Config c;
  c.format = "e4m3";
  Fp8Config d = c;
  d.first_last_layers_bf16 = true;
  check(d, 128, false, "does not work with --fp8-recipe delayed");
  d.recipe = Fp8Recipe::Tensorwise;
  d.num_layers_at_start_in_bf16 = 3;  // 4 layers over 2 stages: at most 2
  check(d, 128, false, "--num-layers-at-start-in-bf16 (3) must be between 0 and the layers of a pipeline stage (2)");
  Fp8Config b = c;
  b.recipe = Fp8Recipe::Blockwise;
  check(b, 96, false, "multiples of the 128 block");
  Fp8Config p;
  p.param_gather = true;
  check(p, 128, true, "--fp8-param-gather needs --fp8-format");
  p.format = "hybrid";
  check(p, 128, false, "only works with the distributed optimizer");
  p.recipe = Fp8Recipe::Blockwise;  // Note [FP8 parameters]: the shards' partial tile amaxes
  EXPECT_EQ(error_of([&] { p.validate(4, 1, true, 128, 512); }), "");
  Fp8Config h = c;
  h.amax_history_len = 0;
  check(h, 128, false, "--fp8-amax-history-len must be at least 1");
  EXPECT_EQ(error_of([&] { b.validate(4, 2, false, 256, 1024); }), "");
  EXPECT_NE(error_of([] { fp8_recipe_from_string("mxfp8"); }).find("Blackwell"), std::string::npos);
  EXPECT_NE(error_of([] { fp8_recipe_from_string("fancy"); }).find("not a recipe"), std::string::npos);
  EXPECT_EQ(fp8_recipe_from_string("tensorwise"), Fp8Recipe::Tensorwise);
  EXPECT_NE(error_of([] { Fp8TensorScaling(Fp8Config{}, 1, DType::BFloat16, Device::cpu()); }).find("not an fp8"),
            std::string::npos);
}

}  // namespace
}  // namespace megatron
