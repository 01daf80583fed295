// Packed sequences on the GPU (Note [Packed sequences]): a Llama-style model over rows packing
// several documents with their Documents mask (cuDNN's ragged layout in bf16) — the per-token losses
// and every gradient against the CPU in the same precision, and each document's loss and gradient
// on the GPU against running that document alone on the GPU, one line per case.
#include <gtest/gtest.h>

#include <cmath>

#include "megatron/core/models/gpt/gpt_model.h"
#include "megatron/runtime/allocator.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

TransformerConfig config(bool bf16) {
  TransformerConfig c;
  c.num_layers = 2;
  c.hidden_size = 256;
  c.num_attention_heads = 4;
  c.num_query_groups = 2;
  c.vocab_size = 512;
  c.make_vocab_size_divisible_by = 128;
  c.max_position_embeddings = 256;
  c.hidden_dropout = c.attention_dropout = 0.0f;
  c.normalization = "RMSNorm";
  c.activation = "swiglu";
  c.ffn_hidden_size = 512;
  c.add_bias_linear = false;
  c.position_embedding_type = "rope";
  c.share_embeddings_and_output_weights = false;
  c.bf16 = bf16;
  return c;
}

struct Result {
  std::vector<float> losses, grads;
};

Result run(const GPTModel& model, Device device, const Tensor& tokens, const Tensor& labels, const Tensor& cu,
           const std::vector<float>& weight) {
  Context ctx(device, 3);
  auto& params = const_cast<GPTModel&>(model).params();
  params.zero_grad();
  GPTModel::Stash stash;
  Tensor losses = model.forward(ctx, tokens.to(device), Tensor(), labels.to(device), stash, cu);
  model.backward(ctx, Tensor::from_floats(weight, losses.shape()).to(device), stash);
  ctx.synchronize();
  return {losses.to_floats(), params.grad_buffer().to_floats()};
}

double scaled_error(const std::vector<float>& x, const std::vector<float>& y) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
    if (!std::isfinite(x[i])) return INFINITY;
    diff = std::max(diff, std::fabs(double(x[i]) - double(y[i])));
    scale = std::max(scale, std::fabs(double(y[i])));
  }
  return diff / std::max(scale, 1e-30);
}

std::vector<int64_t> ids(int64_t n, uint64_t seed, int64_t vocab) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  for (size_t i = 0; i < v.size(); ++i) v[i] = int64_t(philox_element(seed, 0, i) % uint64_t(vocab));
  return v;
}

// Two rows of 256: documents {40, 100, 116} and {256}.
TEST(PackedModelGpu, DocumentsMatchCpuAndRunningAlone) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU";
  const int64_t s = 256, b = 2;
  const std::vector<std::vector<int64_t>> docs = {{40, 100, 116}, {256}};
  std::vector<int64_t> cu_flat = {0, 40, 140, 256, 0, 256, 256, 256};
  const Tensor cu = Tensor::from_ints(cu_flat, {b, 4}, DType::Int32);
  for (bool bf16 : {false, true}) {
    const TransformerConfig c = config(bf16);
    const std::vector<int64_t> tok = ids(b * s, 1, c.vocab_size), lab = ids(b * s, 2, c.vocab_size);
    const Tensor tokens = Tensor::from_ints(tok, {b, s}), labels = Tensor::from_ints(lab, {b, s});
    GPTModel cpu_model(c, Device::cpu()), gpu_model(c, Device::cuda(0));
    cpu_model.init_weights(5);
    gpu_model.init_weights(5);
    const std::vector<float> all(size_t(b * s), 1.0f / float(b * s));
    const Result on_cpu = run(cpu_model, Device::cpu(), tokens, labels, cu, all);
    const Result on_gpu = run(gpu_model, Device::cuda(0), tokens, labels, cu, all);
    const double e_loss = scaled_error(on_gpu.losses, on_cpu.losses), e_grad = scaled_error(on_gpu.grads, on_cpu.grads);
    std::printf("%s packed, GPU vs CPU: losses %.2e, gradients %.2e (of their scale)\n", bf16 ? "bf16" : "fp32", e_loss,
                e_grad);
    EXPECT_LT(e_loss, bf16 ? 2e-2 : 1e-4);
    EXPECT_LT(e_grad, bf16 ? 5e-2 : 1e-3);
    // Each document of row 0 on the GPU: packed against alone.
    int64_t start = 0;
    for (int64_t len : docs[0]) {
      std::vector<float> w(size_t(b * s), 0.0f);
      for (int64_t j = 0; j < len; ++j) w[size_t(start + j)] = 1.0f;
      const Result packed = run(gpu_model, Device::cuda(0), tokens, labels, cu, w);
      const std::vector<int64_t> dt(tok.begin() + start, tok.begin() + start + len),
          dl(lab.begin() + start, lab.begin() + start + len);
      const Result alone = run(gpu_model, Device::cuda(0), Tensor::from_ints(dt, {1, len}), Tensor::from_ints(dl, {1, len}),
                               Tensor(), std::vector<float>(size_t(len), 1.0f));
      const std::vector<float> pl(packed.losses.begin() + start, packed.losses.begin() + start + len);
      const double el = scaled_error(pl, alone.losses), eg = scaled_error(packed.grads, alone.grads);
      std::printf("%s document at %lld (%lld tokens), packed vs alone on the GPU: losses %.2e, gradients %.2e\n",
                  bf16 ? "bf16" : "fp32", (long long)start, (long long)len, el, eg);
      EXPECT_LT(el, bf16 ? 2e-2 : 1e-4);
      EXPECT_LT(eg, bf16 ? 5e-2 : 1e-3);
      start += len;
    }
  }
}

}  // namespace
}  // namespace megatron
