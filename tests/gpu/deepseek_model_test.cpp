// DeepSeek-V3 (multi-latent attention, YaRN, sigmoid group-limited MoE with the expert bias and a
// shared expert; tests/fixtures/arch/deepseek_v3) on CUDA against the CPU reference: one forward and
// backward of the mean loss, the loss and every gradient in the same precision — fp32 (the row-wise
// attention kernels with value heads narrower than the query/key heads, copy_columns) and bf16
// (cuDNN with both head widths) — and in fp32 the fixture's HF loss. One line per case.
#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "megatron/core/dist_checkpointing/safetensors.h"
#include "megatron/core/models/gpt/hf_mapping.h"
#include "megatron/kernels/ops.h"
#include "megatron/runtime/allocator.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

struct Result {
  double loss = 0;
  TensorMap grads;  // Megatron names, on the host
};

double scaled_error(const std::vector<float>& x, const std::vector<float>& y) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
    if (std::isnan(x[i])) return INFINITY;
    diff = std::max(diff, std::fabs(double(x[i]) - double(y[i])));
    scale = std::max(scale, std::fabs(double(y[i])));
  }
  return diff / std::max(scale, 1e-30);
}

Result run(Device device, bool bf16) {
  const std::string dir = testing::arch_fixtures_dir();
  HFFolder folder(dir + "/deepseek_v3");
  safetensors::File io(dir + "/deepseek_v3_io.safetensors");
  HFModelInfo info = config_from_hf(folder.config(), 1);
  TransformerConfig c = info.config;
  c.hidden_dropout = c.attention_dropout = 0.0f;
  c.bf16 = bf16;
  Context ctx(device);
  GPTModel model(c, device);
  load_model_state_dict(model, hf_to_megatron(info, [&](const std::string& n) { return folder.get(n); }),
                        folder.dir());
  model.params().zero_grad();
  const Tensor tokens = io.read("tokens").to(device), labels = io.read("labels").to(device);
  GPTModel::Stash stash;
  Tensor losses = model.forward(ctx, tokens, Tensor(), labels, stash);
  Tensor sums = Tensor::empty({2}, DType::Float32, device);
  ops::masked_loss_sums(ctx, losses.view({-1}), Tensor(), sums);
  const std::vector<float> h = sums.to_floats();
  Tensor grad = Tensor::empty({losses.numel()}, DType::Float32, device);
  ops::masked_loss_backward(ctx, Tensor(), float(1.0 / h[1]), grad);
  model.backward(ctx, grad.view(losses.shape()), stash);
  ctx.synchronize();
  Result r;
  r.loss = h[0] / h[1];
  for (const auto& [n, g] : model_grad_dict(model)) r.grads[n] = g.to(Device::cpu());
  return r;
}

class DeepSeekModelGpu : public ::testing::TestWithParam<bool> {};

TEST_P(DeepSeekModelGpu, LossAndGradientsMatchCpu) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU";
  const bool bf16 = GetParam();
  const Result want = run(Device::cpu(), bf16);
  const Result got = run(Device::cuda(0), bf16);
  const double loss_tol = bf16 ? 1e-2 : 1e-5, grad_tol = bf16 ? 1e-1 : 1e-4;
  EXPECT_NEAR(got.loss, want.loss, loss_tol * std::fabs(want.loss));
  if (!bf16) {
    safetensors::File io(testing::arch_fixtures_dir() + "/deepseek_v3_io.safetensors");
    const double hf = io.read("loss").item(0);
    EXPECT_NEAR(got.loss, hf, 1e-5 * std::fabs(hf)) << "the fixture's HF loss";
  }
  ASSERT_EQ(got.grads.size(), want.grads.size());
  double worst = 0;
  std::string worst_name;
  for (const auto& [n, g] : want.grads) {
    ASSERT_TRUE(got.grads.count(n)) << n;
    const double e = scaled_error(got.grads.at(n).to_floats(), g.to_floats());
    if (e > worst) worst = e, worst_name = n;
    EXPECT_LE(e, grad_tol) << n;
  }
  std::printf("deepseek_v3 on cuda %s: loss %.7f (cpu, same precision: %.7f), %zu gradients, worst %.2e (%s)\n",
              bf16 ? "bf16" : "fp32", got.loss, want.loss, want.grads.size(), worst, worst_name.c_str());
}

INSTANTIATE_TEST_SUITE_P(Precisions, DeepSeekModelGpu, ::testing::Values(false, true),
                         [](const auto& info) { return std::string(info.param ? "bf16" : "fp32"); });

}  // namespace
}  // namespace megatron
