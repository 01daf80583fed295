// The schedules are model-agnostic: a model that is not a GPT (a lookup table w[token] trained to
// regress the labels, with its own squared-error loss function) runs through forward_backward via
// the ModelChunk interface and the forward step's loss function, and its gradients are the
// analytic ones; the extra losses its forward reports reach the AuxLossTracker's per-step report.
#include <gtest/gtest.h>

#include <cmath>
#include <thread>

#include "megatron/core/pipeline_parallel/schedules.h"
#include "megatron/core/transformer/aux_loss_tracker.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

class LookupRegression : public ModelChunk {
 public:
  struct Stash : ModelStash {
    Tensor tokens;
  };
  explicit LookupRegression(int64_t vocab) : params_(DType::Float32, Device::cpu()) {
    w_ = params_.add("w", {vocab}, false, ParamInit::Normal);
    params_.allocate();
  }
  bool pre_process() const override { return true; }
  bool post_process() const override { return true; }
  Shape stage_activation_shape(int64_t b, int64_t s) const override { return {s, b}; }
  DType activation_dtype() const override { return DType::Float32; }
  uint64_t random_streams_per_microbatch() const override { return 1; }
  std::unique_ptr<ModelStash> make_stash() const override { return std::make_unique<Stash>(); }
  ParamAndGradBuffer& params() override { return params_; }
  const ParamAndGradBuffer& params() const override { return params_; }
  void init_weights(uint64_t seed) override { params_.init_weights(seed, 1.0f, 1, false); }

  // out [b, s] = w[tokens]; reports Σ w² as "toy_aux" for layer 0 once per microbatch.
  Tensor forward(Context& ctx, const Tensor& tokens, Stash& stash) const {
    stash.tokens = tokens;
    const std::vector<int64_t> t = tokens.to_ints();
    const std::vector<float> w = w_->data.to_floats();
    std::vector<float> out(t.size());
    double sq = 0;
    for (size_t i = 0; i < t.size(); ++i) out[i] = w[size_t(t[i])];
    for (float x : w) sq += double(x) * x;
    if (AuxLossTracker* aux = aux_loss_tracker()) aux->add(ctx, "toy_aux", 0, Tensor::from_floats({float(sq)}, {1}));
    return Tensor::from_floats(out, tokens.shape());
  }
  Tensor backward_step(Context& ctx, const Tensor& grad, ModelStash& s) const override {
    const std::vector<int64_t> t = stash_cast<Stash>(s).tokens.to_ints();
    const std::vector<float> g = grad.to_floats();
    float* mg = w_->main_grad.data<float>();
    for (size_t i = 0; i < t.size(); ++i) mg[t[i]] += g[i];
    return Tensor();
  }

 private:
  ParamAndGradBuffer params_;
  Parameter* w_;
};

// Σ (out - label)² over the tokens, over their number.
LossFunc squared_error(Tensor labels) {
  return [labels](Context&, const Tensor& out, Tensor& sums, const Tensor& loss_scale, Tensor* grad) {
    const std::vector<float> o = out.to_floats(), y = labels.to_floats();
    double sq = 0;
    for (size_t i = 0; i < o.size(); ++i) sq += double(o[i] - y[i]) * (o[i] - y[i]);
    sums.copy_from(Tensor::from_floats({float(sq), float(o.size())}, {2}));
    if (!grad) return;
    const float scale = loss_scale.item(0) / float(o.size());
    std::vector<float> g(o.size());
    for (size_t i = 0; i < o.size(); ++i) g[i] = scale * 2.0f * (o[i] - y[i]);
    *grad = Tensor::from_floats(g, out.shape());
  };
}

MicroBatch batch(std::vector<int64_t> tokens, std::vector<int64_t> labels) {
  MicroBatch b;
  b.tokens = Tensor::from_ints(tokens, {1, int64_t(tokens.size())});
  b.labels = Tensor::from_ints(labels, {1, int64_t(labels.size())});
  return b;
}

TEST(ModelChunk, SchedulesTrainAModelThatIsNotAGpt) {
  LookupRegression model(5);
  model.init_weights(3);
  model.params().zero_grad();
  AuxLossTracker aux;
  aux.declare("toy_aux", 1);
  model.set_aux_loss_tracker(&aux);
  ForwardStepFunc step = typed_forward_step<LookupRegression>(
      [](Context& ctx, const MicroBatch& b, const LookupRegression& m, const Tensor&, LookupRegression::Stash& st) {
        return ForwardOutput{m.forward(ctx, b.tokens, st), Tensor(), squared_error(b.labels.to(DType::Float32))};
      });
  std::vector<MicroBatch> batches{batch({0, 3, 3}, {1, 2, -1}), batch({4, 1, 0, 2}, {0, 0, 2, 5})};
  ForwardBackwardArgs args;
  args.num_microbatches = 2;
  args.micro_batch_size = 1;
  args.loss_scale = 4.0f;
  Context ctx;
  const std::vector<float> w = model.params().find("w")->data.to_floats();
  const LossSums sums = forward_backward(ctx, nullptr, {&model}, step, batches, args);

  // Analytic: Σ over microbatches of (loss_scale / M) · 2 (w[t] - y) / N_mb at each token t.
  std::vector<double> want(5, 0.0);
  double loss_sum = 0, tokens = 0;
  for (const MicroBatch& b : batches) {
    const std::vector<int64_t> t = b.tokens.to_ints(), y = b.labels.to_ints();
    for (size_t i = 0; i < t.size(); ++i) {
      const double d = double(w[size_t(t[i])]) - double(y[i]);
      want[size_t(t[i])] += 4.0 / 2.0 * 2.0 * d / double(t.size());
      loss_sum += d * d;
    }
    tokens += double(t.size());
  }
  EXPECT_NEAR(sums.loss_sum, loss_sum, 1e-4 * loss_sum);
  EXPECT_EQ(sums.num_tokens, tokens);
  const std::vector<float> got = model.params().find("w")->main_grad.to_floats();
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-5 * (1 + std::fabs(want[i]))) << i;

  // The aux loss: reported once per microbatch, per-microbatch mean Σ w².
  double sq = 0;
  for (float x : w) sq += double(x) * x;
  const auto report = aux.report(ctx, nullptr, nullptr, args.num_microbatches);
  ASSERT_EQ(report.size(), 1u);
  EXPECT_EQ(report[0].first, "toy_aux");
  EXPECT_NEAR(report[0].second, sq, 1e-5 * sq);
  EXPECT_EQ(aux.report(ctx, nullptr, nullptr, 1)[0].second, 0.0) << "report clears the step's values";
}

TEST(AuxLossTracker, AveragesOverTheLayersThatReportedAndRefusesUndeclaredNames) {
  AuxLossTracker aux;
  aux.declare("load_balancing_loss", 4);
  Context ctx;
  for (int mb = 0; mb < 2; ++mb) {
    aux.add(ctx, "load_balancing_loss", 1, Tensor::from_floats({1.0f + float(mb)}, {1}));
    aux.add(ctx, "load_balancing_loss", 3, Tensor::from_floats({5.0f}, {1}));
  }
  const auto r = aux.report(ctx, nullptr, nullptr, 2);
  ASSERT_EQ(r.size(), 1u);
  EXPECT_DOUBLE_EQ(r[0].second, ((1.0 + 2.0) / 2 + (5.0 + 5.0) / 2) / 2);  // layers 1 and 3 of 4
  const std::string e = testing::error_of([&] { aux.add(ctx, "z_loss", 0, Tensor::from_floats({1.0f}, {1})); });
  EXPECT_NE(e.find("aux loss 'z_loss' was not declared"), std::string::npos) << e;
  EXPECT_NE(testing::error_of([&] { aux.add(ctx, "load_balancing_loss", 4, Tensor::from_floats({1.0f}, {1})); })
                .find("reported for layer 4 of 4"),
            std::string::npos);
}

TEST(AuxLossTracker, SumsOverPipelineRanksAndAveragesOverDataParallelRanks) {
  auto pp = make_local_group(2, "pipeline-parallel");
  std::vector<std::thread> threads;
  std::vector<double> got(2);
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      AuxLossTracker aux;
      aux.declare("load_balancing_loss", 2);
      Context ctx;
      aux.add(ctx, "load_balancing_loss", r, Tensor::from_floats({float(10 * (r + 1))}, {1}));  // stage r: layer r
      got[size_t(r)] = aux.report(ctx, pp[size_t(r)].get(), nullptr, 1)[0].second;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_DOUBLE_EQ(got[0], 15.0);  // (10 + 20) / 2 layers, the same on both stages
  EXPECT_DOUBLE_EQ(got[1], 15.0);
}

}  // namespace
}  // namespace megatron
