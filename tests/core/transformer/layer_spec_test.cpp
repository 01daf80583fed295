// Layer specs: a decoder whose layers have different specs (here dense MLPs of different sizes)
// is built through the block spec alone — no change to the block, the model or the schedules — and
// its gradients agree with central finite differences of the loss; the default spec is the config's
// layout; a spec of the wrong length is refused with one clear line.
#include <gtest/gtest.h>

#include <cmath>

#include "megatron/core/models/gpt/gpt_layer_specs.h"
#include "megatron/core/models/gpt/gpt_model.h"
#include "megatron/core/tensor_parallel/fp8_linear.h"
#include "megatron/kernels/ops.h"
#include "tests/core/model_test_util.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

TransformerConfig tiny_config(bool llama) {
  TransformerConfig c;
  c.num_layers = 2;
  c.hidden_size = 16;
  c.num_attention_heads = 2;
  c.vocab_size = 40;
  c.make_vocab_size_divisible_by = 8;
  c.max_position_embeddings = 8;
  c.hidden_dropout = 0.0f;
  c.attention_dropout = 0.0f;
  c.init_method_std = 0.2f;  // large enough that every layer matters to the loss
  if (llama) {
    c.num_query_groups = 1;
    testing::use_llama_layers(c);
  }
  return c;
}

// Layer 0's MLP is 24 wide, layer 1's 40 (the config says 64).
TransformerBlockSpec two_sizes(const TransformerConfig& c) {
  TransformerBlockSpec spec = get_gpt_decoder_block_spec(c);
  spec.layers[0].mlp.ffn_hidden_size = 24;
  spec.layers[1].mlp.ffn_hidden_size = 40;
  return spec;
}

// The mean per-token loss; with `backward`, its gradient accumulates into the model's main grads.
double loss(const GPTModel& model, const Tensor& tokens, const Tensor& labels, bool backward) {
  Context ctx(Device::cpu(), 7);
  GPTModel::Stash stash;
  Tensor losses = model.forward(ctx, tokens, Tensor(), labels, stash);
  const std::vector<float> l = losses.to_floats();
  double mean = 0;
  for (float x : l) mean += x;
  mean /= double(l.size());
  if (backward) {
    Tensor grad = Tensor::from_floats(std::vector<float>(l.size(), 1.0f / float(l.size())), losses.shape());
    model.backward(ctx, grad, stash);
  }
  return mean;
}

class LayerSpecs : public ::testing::TestWithParam<bool> {};

TEST_P(LayerSpecs, LayersOfDifferentSpecsHaveTheirShapesAndExactGradients) {
  const TransformerConfig c = tiny_config(GetParam());
  TransformerConfig finalized = c;
  finalized.finalize();
  GPTModel model(c, Device::cpu(), nullptr, 0, two_sizes(finalized));
  model.init_weights(11);
  const int64_t glu = GetParam() ? 2 : 1;
  EXPECT_EQ(model.params().find("decoder.layers.0.mlp.linear_fc1.weight")->data.shape(), (Shape{glu * 24, 16}));
  EXPECT_EQ(model.params().find("decoder.layers.0.mlp.linear_fc2.weight")->data.shape(), (Shape{16, 24}));
  EXPECT_EQ(model.params().find("decoder.layers.1.mlp.linear_fc1.weight")->data.shape(), (Shape{glu * 40, 16}));
  EXPECT_EQ(model.params().find("decoder.layers.1.mlp.linear_fc2.weight")->data.shape(), (Shape{16, 40}));

  const Tensor tokens = testing::random_ids(2, 8, c.vocab_size, 1), labels = testing::random_ids(2, 8, c.vocab_size, 2);
  model.params().zero_grad();
  loss(model, tokens, labels, true);
  // Central differences on a spread of elements of every parameter of both layers.
  int checked = 0;
  double worst = 0;
  for (Parameter* p : model.params().parameters()) {
    if (p->name.rfind("decoder.layers.", 0) != 0) continue;
    const int64_t n = p->data.numel();
    const std::vector<float> analytic = p->main_grad.to_floats();
    for (int64_t k = 0; k < 3; ++k) {
      const int64_t i = (k * 7919 + 13) % n;
      float* v = p->data.data<float>() + i;
      const float saved = *v, eps = 1e-2f;
      *v = saved + eps;
      const double up = loss(model, tokens, labels, false);
      *v = saved - eps;
      const double down = loss(model, tokens, labels, false);
      *v = saved;
      const double numeric = (up - down) / (2.0 * double(eps));
      const double err = std::fabs(numeric - analytic[size_t(i)]);
      worst = std::max(worst, err);
      EXPECT_NEAR(analytic[size_t(i)], numeric, 2e-3 + 2e-2 * std::fabs(numeric)) << p->name << "[" << i << "]";
      ++checked;
    }
  }
  std::printf("%s: layer 0 MLP 24 wide, layer 1 MLP 40 wide: %d gradient elements checked, worst |error| %.2e\n",
              GetParam() ? "llama" : "gpt", checked, worst);
  EXPECT_GT(checked, 20);
}

TEST_P(LayerSpecs, TheDefaultSpecIsTheConfigsLayout) {
  TransformerConfig c = tiny_config(GetParam());
  c.finalize();
  const TransformerBlockSpec spec = get_gpt_decoder_block_spec(c);
  ASSERT_EQ(spec.layers.size(), 2u);
  const NormKind norm = GetParam() ? NormKind::RMSNorm : NormKind::LayerNorm;
  for (const TransformerLayerSpec& l : spec.layers) {
    EXPECT_EQ(l.mixer.kind, MixerKind::SelfAttention);
    EXPECT_EQ(l.mlp.kind, MlpKind::Dense);
    EXPECT_EQ(l.mlp.ffn_hidden_size, c.ffn_hidden_size);
    EXPECT_EQ(l.input_layernorm, norm);
    EXPECT_EQ(l.pre_mlp_layernorm, norm);
  }
  EXPECT_EQ(spec.final_layernorm, norm);
  // A model with the default spec equals one given it explicitly, parameter for parameter.
  GPTModel implicit(c), explicit_spec(c, Device::cpu(), nullptr, 0, spec);
  implicit.init_weights(3);
  explicit_spec.init_weights(3);
  EXPECT_EQ(implicit.params().param_buffer().to_floats(), explicit_spec.params().param_buffer().to_floats());
}

INSTANTIATE_TEST_SUITE_P(Styles, LayerSpecs, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "llama" : "gpt"; });

TEST(LayerSpecs, ASpecOfTheWrongLengthIsAClearError) {
  TransformerConfig c = tiny_config(false);
  c.finalize();
  TransformerBlockSpec spec = get_gpt_decoder_block_spec(c);
  spec.layers.pop_back();
  try {
    GPTModel model(c, Device::cpu(), nullptr, 0, spec);
    FAIL() << "a block spec of 1 layer for 2 layers was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("the block spec has 1 layer specs for 2 layers"), std::string::npos)
        << e.what();
  }
}

TEST(LayerSpecs, AnMlpSizeThatDoesNotSplitOverTensorParallelRanksIsAClearError) {
  TransformerConfig c = tiny_config(false);
  c.finalize();
  TransformerBlockSpec spec = get_gpt_decoder_block_spec(c);
  spec.layers[1].mlp.ffn_hidden_size = 25;
  TransformerConfig tp2 = c;
  tp2.tensor_model_parallel_size = 2;
  auto groups = make_local_group(2, "tensor-parallel");
  ProcessGroupCollection pg;
  pg.tp = groups[0].get();
  ParamAndGradBuffer params(DType::Float32, Device::cpu());
  try {
    MLP mlp(tp2, spec.layers[1].mlp, params, "decoder.layers.1.mlp", pg);
    FAIL() << "an MLP of 25 over 2 ranks was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("intermediate size 25 must be divisible by --tensor-model-parallel-size (2)"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace megatron

namespace megatron {
namespace {

// Note [FP8 layers]: the spec marks the layers that run in FP8 (all but the first and last with
// --first-last-layers-bf16), and an FP8 layer's attention and MLP linear layers get FP8 state.
TEST(LayerSpecs, Fp8LayersFollowTheSpec) {
  TransformerConfig c = tiny_config(true);
  c.num_layers = 4;
  c.fp8.format = "hybrid";
  c.fp8.recipe = Fp8Recipe::Tensorwise;
  c.fp8.first_last_layers_bf16 = true;
  c.finalize();
  const TransformerBlockSpec spec = get_gpt_decoder_block_spec(c);
  ASSERT_EQ(spec.layers.size(), 4u);
  EXPECT_FALSE(spec.layers[0].fp8);
  EXPECT_TRUE(spec.layers[1].fp8);
  EXPECT_TRUE(spec.layers[2].fp8);
  EXPECT_FALSE(spec.layers[3].fp8);
  GPTModel model(c, Device::cpu());
  const std::vector<size_t> want = {0, 4, 4, 0};
  std::vector<std::string> names;
  for (size_t i = 0; i < 4; ++i) {
    const auto& linears = model.decoder().layers()[i]->fp8_linears();
    EXPECT_EQ(linears.size(), want[i]) << "layer " << i;
    for (const Linear* l : linears) {
      EXPECT_NE(l->fp8(), nullptr);
      names.push_back(l->name());
    }
  }
  EXPECT_EQ(names.front(), "decoder.layers.1.self_attention.linear_qkv");
  EXPECT_EQ(names.back(), "decoder.layers.2.mlp.linear_fc2");
}

// The delayed recipe's step: after a forward and backward, finish_fp8_step rolls each FP8 layer's
// amax history (this step's amax lands in its last row) and sets scale = fp8_max / amax; the
// state is in the model's checkpoint buffers, optional.
TEST(LayerSpecs, Fp8DelayedStateStepsAndIsCheckpointed) {
  TransformerConfig c = tiny_config(false);
  c.fp8.format = "hybrid";
  c.fp8.recipe = Fp8Recipe::Delayed;
  c.fp8.amax_history_len = 3;
  c.finalize();
  GPTModel model(c, Device::cpu());
  model.init_weights(3);
  loss(model, testing::random_ids(2, 8, 40, 1), testing::random_ids(2, 8, 40, 2), /*backward=*/true);
  Context ctx;
  model.finish_fp8_step(ctx);
  const Linear* qkv = model.decoder().layers()[0]->fp8_linears()[0];
  for (auto* s : {&qkv->fp8()->forward_scaling(), &qkv->fp8()->backward_scaling()}) {
    const std::vector<float> h = s->amax_history().to_floats(), scale = s->scales().to_floats();
    const int64_t n = s->size();
    for (int64_t j = 0; j < n; ++j) {
      EXPECT_EQ(h[size_t(j)], 0.0f) << "row 0 is cleared for the next step";
      const float amax = h[size_t(2 * n + j)];
      EXPECT_GT(amax, 0.0f);
      EXPECT_EQ(scale[size_t(j)], fp8_max_of(s->dtype()) / amax);
    }
  }
  int fp8_buffers = 0;
  for (const ModelBuffer& b : model.buffers()) {
    if (b.name.find(".fp8_") == std::string::npos) continue;
    ++fp8_buffers;
    EXPECT_TRUE(b.optional) << b.name;
  }
  EXPECT_EQ(fp8_buffers, 2 * 4 * 4);  // 2 layers x 4 linear layers x (scale, history) x (forward, backward)
}

}  // namespace
}  // namespace megatron
