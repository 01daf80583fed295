// The HuggingFace golden fixtures on the GPU: every fixture of the golden folders
// (testing::golden_fixture_models: $MEGATRON_FIXTURES, then tests/fixtures), converted and run on
// CUDA in fp32 (the fixture's tolerances) and in bf16 (bf16 tolerances): logits, loss and every
// gradient, one line per fixture and precision.
#include <gtest/gtest.h>

#include <cmath>

#include "megatron/core/dist_checkpointing/safetensors.h"
#include "megatron/core/models/gpt/hf_mapping.h"
#include "megatron/kernels/ops.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

double scaled_error(const std::vector<float>& x, const std::vector<float>& y) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
    diff = std::max(diff, std::fabs(double(x[i]) - double(y[i])));
    scale = std::max(scale, std::fabs(double(y[i])));
    if (std::isnan(x[i])) return INFINITY;
  }
  return diff / std::max(scale, 1e-30);
}

struct Case {
  std::string model;
  bool bf16;
};

class GoldenGpu : public ::testing::TestWithParam<Case> {};

TEST_P(GoldenGpu, LogitsLossAndGradients) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU";
  const Case c = GetParam();
  const std::string dir = testing::golden_fixture_dir_of(c.model);
  safetensors::File model_file(dir + "/" + c.model + "_model.safetensors");
  safetensors::File io(dir + "/" + c.model + "_io.safetensors");
  HFModelInfo info = config_from_hf(nlohmann::json::parse(model_file.metadata().at("config")), 1);
  TransformerConfig config = info.config;
  config.hidden_dropout = config.attention_dropout = 0.0f;
  config.bf16 = c.bf16;
  Context ctx(Device::cuda(0));
  GPTModel model(config, ctx.device());
  load_model_state_dict(model, hf_to_megatron(info, [&](const std::string& n) { return model_file.read(n); }),
                        model_file.path());
  model.params().zero_grad();
  Tensor tokens = io.read("tokens").to(ctx.device()), labels = io.read("labels").to(ctx.device());
  GPTModel::Stash stash;
  Tensor losses = model.forward(ctx, tokens, Tensor(), labels, stash);
  const int64_t b = tokens.size(0), s = tokens.size(1), v = stash.logits.size(2);
  Tensor logits_bsv = Tensor::empty({b, s, v}, stash.logits.dtype(), ctx.device());
  ops::transpose_01(ctx, stash.logits, logits_bsv);
  const std::vector<float> logits = logits_bsv.to_floats();
  Tensor sums = Tensor::empty({2}, DType::Float32, ctx.device());
  ops::masked_loss_sums(ctx, losses.view({-1}), Tensor(), sums);
  const std::vector<float> h = sums.to_floats();
  const double loss = h[0] / h[1];
  Tensor grad = Tensor::empty({b * s}, DType::Float32, ctx.device());
  ops::masked_loss_backward(ctx, Tensor(), float(1.0 / h[1]), grad);
  model.backward(ctx, grad.view({b, s}), stash);
  ctx.synchronize();

  const double logit_tol = c.bf16 ? 3e-2 : 1e-5, grad_tol = c.bf16 ? 8e-2 : 1e-4;
  const double ref_loss = io.read("loss").item(0);
  EXPECT_LE(scaled_error(logits, io.read("logits").to_floats()), logit_tol);
  EXPECT_NEAR(loss, ref_loss, (c.bf16 ? 1e-2 : 1e-5) * ref_loss);
  TensorMap grads = megatron_to_hf(info, model_grad_dict(model));
  double worst = 0;
  for (const auto& [name, g] : grads) {
    const double e = scaled_error(g.to_floats(), io.read("grad." + name).to_floats());
    worst = std::max(worst, e);
    EXPECT_LE(e, grad_tol) << name;
  }
  std::printf("%s %s: loss %.7f (HF %.7f), worst gradient error %.2e of its tensor's scale\n", c.model.c_str(),
              c.bf16 ? "bf16" : "fp32", loss, ref_loss, worst);
}

std::vector<Case> cases() {
  std::vector<Case> v;
  for (bool bf16 : {false, true})
    for (const std::string& name : testing::golden_fixture_models()) v.push_back(Case{name, bf16});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Fixtures, GoldenGpu, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return info.param.model + (info.param.bf16 ? "_bf16" : "_fp32"); });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(GoldenGpu);

}  // namespace
}  // namespace megatron
