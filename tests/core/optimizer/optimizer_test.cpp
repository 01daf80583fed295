// AdamOptimizer against a hand computation: two AdamW steps with and without weight decay, bf16
// parameters holding the rounded fp32 master, clipping folded into the update, inf/nan skipping
// with the dynamic loss scaler, zero counting, checkpoint state and bad configs.
#include "megatron/core/optimizer/optimizer.h"

#include <gtest/gtest.h>

#include <cmath>

#include "tests/test_util.h"

namespace megatron {
namespace {

// AdamW in double, as torch.optim.AdamW.
struct RefAdam {
  std::vector<double> p, m, v;
  explicit RefAdam(const std::vector<float>& init) : p(init.begin(), init.end()), m(init.size()), v(init.size()) {}
  void step(const std::vector<float>& grad, double scale, int t, double lr, double wd, double b1, double b2,
            double eps) {
    for (size_t i = 0; i < p.size(); ++i) {
      const double g = double(grad[i]) * scale;
      m[i] = b1 * m[i] + (1 - b1) * g;
      v[i] = b2 * v[i] + (1 - b2) * g * g;
      const double mhat = m[i] / (1 - std::pow(b1, t)), vhat = v[i] / (1 - std::pow(b2, t));
      p[i] = p[i] - lr * wd * p[i] - lr * mhat / (std::sqrt(vhat) + eps);
    }
  }
};

void expect_close(const std::vector<float>& got, const std::vector<double>& want, double tol, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_NEAR(got[i], want[i], tol * std::max(1.0, std::fabs(want[i]))) << what << "[" << i << "]";
}

OptimizerConfig adam_config() {
  OptimizerConfig c;
  c.lr = 1e-2;
  c.weight_decay = 0.1;
  c.adam_beta1 = 0.9;
  c.adam_beta2 = 0.95;
  c.clip_grad = 0.0;
  return c;
}

Parameter param(const std::string& name, const std::vector<float>& values, const Shape& shape, DType dtype) {
  return make_parameter(name, Tensor::from_floats(values, shape, dtype), Tensor::zeros(shape, DType::Float32));
}

void set_grad(Parameter& p, const std::vector<float>& g) {
  p.main_grad.copy_from(Tensor::from_floats(g, {int64_t(g.size())}));
}

TEST(AdamOptimizer, DefaultNoWeightDecayRule) {
  EXPECT_TRUE(param("layer.bias", {1, 2}, {1, 2}, DType::Float32).no_weight_decay);
  EXPECT_TRUE(param("norm.weight", {1, 2}, {2}, DType::Float32).no_weight_decay);
  EXPECT_FALSE(param("fc.weight", {1, 2}, {1, 2}, DType::Float32).no_weight_decay);
}

TEST(AdamOptimizer, TwoStepsMatchHandComputation) {
  for (DType dt : {DType::Float32, DType::BFloat16}) {
    SCOPED_TRACE(std::string(to_string(dt)));
    Context ctx;
    OptimizerConfig cfg = adam_config();
    cfg.bf16 = dt == DType::BFloat16;
    const std::vector<float> w0 = {0.5f, -1.25f, 2.0f, 0.75f}, b0 = {0.25f, -0.5f};
    AdamOptimizer opt({param("fc.weight", w0, {2, 2}, dt), param("fc.bias", b0, {2}, dt)}, cfg);
    EXPECT_EQ(opt.grad_scaler(), nullptr);
    RefAdam w(w0), b(b0);
    const std::vector<std::vector<float>> wg = {{0.1f, -0.2f, 0.3f, 0.0f}, {-0.05f, 0.4f, 0.1f, 0.2f}};
    const std::vector<std::vector<float>> bg = {{1.0f, 0.0f}, {0.5f, -2.0f}};
    for (int t = 1; t <= 2; ++t) {
      auto params = opt.parameters();
      set_grad(params[0], wg[t - 1]);
      set_grad(params[1], bg[t - 1]);
      const OptimizerStepResult r = opt.step(ctx);
      EXPECT_TRUE(r.update_successful);
      EXPECT_EQ(r.grad_norm, 0.0);  // clip_grad 0: Megatron reports 0
      EXPECT_FALSE(r.num_zeros_in_grad.has_value());
      w.step(wg[t - 1], 1.0, t, 1e-2, 0.1, 0.9, 0.95, 1e-8);
      b.step(bg[t - 1], 1.0, t, 1e-2, 0.0, 0.9, 0.95, 1e-8);  // bias: no weight decay
    }
    EXPECT_EQ(opt.step_count(), 2);
    const AdamParamState& ws = opt.state("fc.weight");
    const AdamParamState& bs = opt.state("fc.bias");
    expect_close(ws.master.to_floats(), w.p, 1e-6, "weight master");
    expect_close(bs.master.to_floats(), b.p, 1e-6, "bias master");
    expect_close(ws.exp_avg.to_floats(), w.m, 1e-6, "weight exp_avg");
    expect_close(ws.exp_avg_sq.to_floats(), w.v, 1e-6, "weight exp_avg_sq");
    EXPECT_EQ(ws.master.dtype(), DType::Float32);
    // The model's parameter holds the master rounded to its dtype.
    for (size_t k = 0; k < 2; ++k) {
      const Parameter& p = opt.parameters()[k];
      const std::vector<float> master = opt.state(p.name).master.to_floats(), model = p.data.to_floats();
      for (size_t i = 0; i < master.size(); ++i)
        EXPECT_EQ(model[i], dt == DType::BFloat16 ? to_float(to_bf16(master[i])) : master[i]) << p.name << i;
    }
  }
}

TEST(AdamOptimizer, WeightDecayFollowsParamGroupsAndSchedule) {
  Context ctx;
  OptimizerConfig cfg = adam_config();
  AdamOptimizer opt(
      {param("w", {2.0f, -4.0f}, {1, 2}, DType::Float32), param("ln.weight", {2.0f}, {1}, DType::Float32)}, cfg);
  opt.set_lr(0.5);
  opt.set_weight_decay(0.2);
  // Zero gradients: Adam's update is 0, only the decoupled decay moves the decayed group.
  EXPECT_TRUE(opt.step(ctx).update_successful);
  expect_close(opt.parameters()[0].data.to_floats(), {2.0 * 0.9, -4.0 * 0.9}, 1e-6, "decayed");
  EXPECT_EQ(opt.parameters()[1].data.to_floats(), (std::vector<float>{2.0f}));
}

// --decoupled-lr: the embedding and output parameters step with their own rate, the others with
// lr(); until a decoupled rate is set they all follow lr(). Each against the hand computation.
TEST(AdamOptimizer, DecoupledLearningRateForEmbeddingAndOutput) {
  Context ctx;
  OptimizerConfig cfg = adam_config();
  const std::vector<float> e0 = {0.5f, -1.0f}, o0 = {2.0f, 0.25f}, w0 = {1.5f, -0.75f};
  std::vector<Parameter> params = {param("embedding.word_embeddings.weight", e0, {1, 2}, DType::Float32),
                                   param("output_layer.weight", o0, {1, 2}, DType::Float32),
                                   param("decoder.fc.weight", w0, {1, 2}, DType::Float32)};
  params[0].is_embedding_or_output_parameter = params[1].is_embedding_or_output_parameter = true;
  AdamOptimizer opt(params, cfg);
  EXPECT_EQ(opt.lr_of(params[0]), opt.lr());  // not set: the default rate
  opt.set_lr(1e-2);
  opt.set_decoupled_lr(3e-1);
  EXPECT_EQ(opt.lr_of(params[0]), 3e-1);
  EXPECT_EQ(opt.lr_of(params[2]), 1e-2);
  const std::vector<float> g = {0.2f, -0.1f};
  for (Parameter p : opt.parameters()) set_grad(p, g);  // copies share the gradient tensors
  ASSERT_TRUE(opt.step(ctx).update_successful);
  RefAdam e(e0), o(o0), w(w0);
  e.step(g, 1.0, 1, 3e-1, 0.1, 0.9, 0.95, 1e-8);
  o.step(g, 1.0, 1, 3e-1, 0.1, 0.9, 0.95, 1e-8);
  w.step(g, 1.0, 1, 1e-2, 0.1, 0.9, 0.95, 1e-8);
  expect_close(opt.parameters()[0].data.to_floats(), e.p, 1e-6, "embedding");
  expect_close(opt.parameters()[1].data.to_floats(), o.p, 1e-6, "output layer");
  expect_close(opt.parameters()[2].data.to_floats(), w.p, 1e-6, "decoder");
  // The decoupled rate is part of the optimizer's state.
  AdamOptimizer other(params, cfg);
  other.load_state_dict(opt.state_dict());
  EXPECT_EQ(other.lr_of(params[1]), 3e-1);
}

TEST(AdamOptimizer, ClippingScalesTheUpdate) {
  Context ctx;
  OptimizerConfig cfg = adam_config();
  cfg.clip_grad = 1.0;
  cfg.log_num_zeros_in_grad = true;
  AdamOptimizer opt({param("w", {1.0f, 1.0f, 1.0f}, {1, 3}, DType::Float32)}, cfg);
  auto params = opt.parameters();
  set_grad(params[0], {3.0f, 0.0f, 4.0f});
  const OptimizerStepResult r = opt.step(ctx);
  ASSERT_TRUE(r.update_successful);
  EXPECT_DOUBLE_EQ(*r.grad_norm, 5.0);
  EXPECT_EQ(*r.num_zeros_in_grad, 1);
  const float coeff = float(1.0 / (5.0 + 1e-6));
  RefAdam ref({1.0f, 1.0f, 1.0f});
  ref.step({3.0f, 0.0f, 4.0f}, coeff, 1, 1e-2, 0.1, 0.9, 0.95, 1e-8);
  expect_close(opt.state("w").exp_avg.to_floats(), ref.m, 1e-6, "exp_avg");
  expect_close(opt.state("w").master.to_floats(), ref.p, 1e-6, "master");
  // The main grads are left as they were (the clip is folded into the kernel's grad_scale).
  EXPECT_EQ(params[0].main_grad.to_floats(), (std::vector<float>{3.0f, 0.0f, 4.0f}));
}

TEST(AdamOptimizer, Fp16DynamicLossScalingSkipsInfSteps) {
  Context ctx;
  OptimizerConfig cfg = adam_config();
  cfg.fp16 = true;
  cfg.initial_loss_scale = 1024.0;
  cfg.loss_scale_window = 2;
  cfg.hysteresis = 2;
  cfg.clip_grad = 100.0;
  AdamOptimizer opt({param("w", {1.0f, -1.0f}, {1, 2}, DType::Float16)}, cfg);
  ASSERT_NE(dynamic_cast<DynamicGradScaler*>(opt.grad_scaler()), nullptr);
  EXPECT_EQ(opt.loss_scale(), 1024.0f);
  auto params = opt.parameters();

  for (float bad : {INFINITY, NAN}) {
    set_grad(params[0], {bad, 1.0f});
    const OptimizerStepResult r = opt.step(ctx);
    EXPECT_FALSE(r.update_successful);
    EXPECT_FALSE(r.grad_norm.has_value());
    EXPECT_FALSE(r.num_zeros_in_grad.has_value());
  }
  EXPECT_EQ(opt.step_count(), 0);
  EXPECT_EQ(opt.loss_scale(), 512.0f);  // hysteresis 2: the second bad step backs off
  EXPECT_EQ(params[0].data.to_floats(), (std::vector<float>{1.0f, -1.0f}));
  EXPECT_EQ(opt.state("w").exp_avg.to_floats(), (std::vector<float>{0.0f, 0.0f}));

  // Clean grads scaled by 512 are unscaled before the norm and the update.
  set_grad(params[0], {3.0f * 512.0f, 4.0f * 512.0f});
  OptimizerStepResult r = opt.step(ctx);
  ASSERT_TRUE(r.update_successful);
  EXPECT_DOUBLE_EQ(*r.grad_norm, 5.0);
  expect_close(opt.state("w").exp_avg.to_floats(), {0.1 * 3.0, 0.1 * 4.0}, 1e-6, "exp_avg");
  EXPECT_EQ(opt.loss_scale(), 512.0f);
  set_grad(params[0], {512.0f, 512.0f});
  r = opt.step(ctx);
  EXPECT_TRUE(r.update_successful);
  EXPECT_EQ(opt.loss_scale(), 1024.0f);  // two clean steps: the window grew the scale
  EXPECT_EQ(opt.step_count(), 2);
  const std::vector<float> master = opt.state("w").master.to_floats(), model = params[0].data.to_floats();
  for (size_t i = 0; i < 2; ++i) EXPECT_EQ(model[i], to_float(to_fp16(master[i])));
}

TEST(AdamOptimizer, ScalerChoiceFollowsMegatron) {
  OptimizerConfig cfg = adam_config();
  EXPECT_EQ(AdamOptimizer({}, cfg).grad_scaler(), nullptr);  // fp32
  cfg.bf16 = true;
  EXPECT_EQ(AdamOptimizer({}, cfg).grad_scaler(), nullptr);
  cfg.loss_scale = 8.0;
  AdamOptimizer constant({}, cfg);
  ASSERT_NE(dynamic_cast<ConstantGradScaler*>(constant.grad_scaler()), nullptr);
  EXPECT_EQ(constant.loss_scale(), 8.0f);
}

TEST(AdamOptimizer, StateDictRoundTrip) {
  Context ctx;
  OptimizerConfig cfg = adam_config();
  cfg.fp16 = true;
  AdamOptimizer a({param("w", {1.0f}, {1, 1}, DType::Float16)}, cfg);
  auto params = a.parameters();
  set_grad(params[0], {INFINITY});
  a.step(ctx);
  set_grad(params[0], {1.0f});
  a.step(ctx);
  a.set_lr(3e-4);
  const nlohmann::json state = a.state_dict();
  AdamOptimizer b({param("w", {7.0f}, {1, 1}, DType::Float16)}, cfg);
  b.load_state_dict(state);
  b.state("w").master.copy_from(a.state("w").master);
  b.copy_main_params_to_model_params();
  EXPECT_EQ(b.step_count(), 1);
  EXPECT_EQ(b.lr(), 3e-4);
  EXPECT_EQ(b.grad_scaler()->state_dict(), a.grad_scaler()->state_dict());
  EXPECT_EQ(b.parameters()[0].data.to_floats(), a.parameters()[0].data.to_floats());
  Tensor model = b.parameters()[0].data;  // shares the model's storage
  model.fill_(2.0f);
  b.reload_model_params();
  EXPECT_EQ(b.state("w").master.item(0), 2.0f);
}

TEST(AdamOptimizer, BadConfigsThrow) {
  OptimizerConfig both = adam_config();
  both.fp16 = both.bf16 = true;
  EXPECT_THROW(AdamOptimizer({}, both), Error);
  OptimizerConfig cfg = adam_config();
  EXPECT_THROW(AdamOptimizer({param("w", {1.0f}, {1}, DType::BFloat16)}, cfg), Error);  // bf16 model, fp32 run
  Parameter short_grad = param("w", {1.0f, 2.0f}, {2}, DType::Float32);
  short_grad.main_grad = Tensor::zeros({1}, DType::Float32);
  EXPECT_THROW(AdamOptimizer({short_grad}, cfg), Error);
  Parameter bf16_grad = param("w", {1.0f}, {1}, DType::Float32);
  bf16_grad.main_grad = Tensor::zeros({1}, DType::BFloat16);
  EXPECT_THROW(AdamOptimizer({bf16_grad}, cfg), Error);
  EXPECT_THROW(AdamOptimizer({param("w", {1.0f}, {1}, DType::Float32), param("w", {1.0f}, {1}, DType::Float32)}, cfg),
               Error);
  OptimizerConfig bad_beta = adam_config();
  bad_beta.adam_beta2 = 1.0;
  EXPECT_THROW(AdamOptimizer({}, bad_beta), Error);
  OptimizerConfig bad_scale = adam_config();
  bad_scale.fp16 = true;
  bad_scale.min_loss_scale = 1e12;  // above the initial scale
  EXPECT_THROW(AdamOptimizer({}, bad_scale), Error);
  AdamOptimizer ok({param("w", {1.0f}, {1}, DType::Float32)}, cfg);
  EXPECT_THROW(ok.state("missing"), Error);
}

}  // namespace
}  // namespace megatron
