// GPTModel: activation recomputation (identical gradients, lower peak memory), Megatron's
// initialisation, vocabulary padding, bf16 storage, the inference-only model's memory, and the
// bad-input errors of config and weights.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include "megatron/core/dist_checkpointing/safetensors.h"
#include "megatron/core/models/gpt/hf_mapping.h"
#include "megatron/kernels/ops.h"
#include "tests/core/model_test_util.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

TransformerConfig tiny_config(bool llama) {
  TransformerConfig c;
  c.num_layers = 4;
  c.hidden_size = 64;
  c.num_attention_heads = 4;
  c.vocab_size = 100;
  c.make_vocab_size_divisible_by = 16;
  c.max_position_embeddings = 64;
  c.hidden_dropout = 0.1f;
  c.attention_dropout = 0.1f;
  if (llama) {
    c.num_query_groups = 2;
    testing::use_llama_layers(c);
    c.ffn_hidden_size = 96;
  }
  return c;
}

struct RunResult {
  float loss = 0;
  std::vector<float> grads;
  size_t peak_activation_bytes = 0;
};

// One forward/backward of the mean loss; returns loss, the whole grad buffer and the peak host
// bytes allocated above what was in use before the forward (activations and temporaries).
RunResult run(TransformerConfig c, const std::string& granularity, const std::string& method, int num_layers,
              DType dtype = DType::Float32) {
  c.recompute_granularity = granularity;
  c.recompute_method = method;
  c.recompute_num_layers = num_layers;
  c.bf16 = dtype == DType::BFloat16;
  GPTModel model(c);
  model.init_weights(1234);
  model.params().zero_grad();
  Context ctx(Device::cpu(), /*seed=*/42);
  const int64_t b = 4, s = 64;
  Tensor tokens = testing::random_ids(b, s, c.vocab_size, 1), labels = testing::random_ids(b, s, c.vocab_size, 2);
  const size_t before = memory_stats(Device::cpu()).allocated;
  reset_peak_memory_stats(Device::cpu());
  GPTModel::Stash stash;
  Tensor losses = model.forward(ctx, tokens, Tensor(), labels, stash);
  Tensor sums = Tensor::empty({2}, DType::Float32);
  ops::masked_loss_sums(ctx, losses.view({-1}), Tensor(), sums);
  Tensor grad = Tensor::empty({losses.numel()}, DType::Float32);
  ops::masked_loss_backward(ctx, Tensor(), 1.0f / sums.item(1), grad);
  model.backward(ctx, grad.view(losses.shape()), stash);
  RunResult r;
  r.peak_activation_bytes = memory_stats(Device::cpu()).peak_allocated - before;
  r.loss = sums.item(0) / sums.item(1);
  r.grads = model.params().grad_buffer().to_floats();
  return r;
}

class Recompute : public ::testing::TestWithParam<bool> {};

TEST_P(Recompute, IdenticalGradientsWithLowerPeakMemory) {
  const TransformerConfig c = tiny_config(GetParam());
  RunResult none = run(c, "", "", 0);
  RunResult selective = run(c, "selective", "", 0);
  RunResult uniform = run(c, "full", "uniform", 2);
  RunResult block = run(c, "full", "block", 2);
  for (const RunResult* r : {&selective, &uniform, &block}) {
    EXPECT_EQ(r->loss, none.loss);
    ASSERT_EQ(r->grads.size(), none.grads.size());
    EXPECT_EQ(r->grads, none.grads) << "recomputation must replay forward (dropout included) exactly";
  }
  EXPECT_LT(selective.peak_activation_bytes, none.peak_activation_bytes);
  EXPECT_LT(block.peak_activation_bytes, none.peak_activation_bytes);
  EXPECT_LT(uniform.peak_activation_bytes, block.peak_activation_bytes);
  std::printf("%s peak activation bytes: none %zu, selective %zu, full/block(2) %zu, full/uniform(2) %zu\n",
              GetParam() ? "llama" : "gpt", none.peak_activation_bytes, selective.peak_activation_bytes,
              block.peak_activation_bytes, uniform.peak_activation_bytes);
}

INSTANTIATE_TEST_SUITE_P(Styles, Recompute, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "llama" : "gpt"; });

TEST(GPTModel, Bf16StorageTracksFp32) {
  for (bool llama : {false, true}) {
    TransformerConfig c = tiny_config(llama);
    c.hidden_dropout = c.attention_dropout = 0.0f;
    RunResult f32 = run(c, "", "", 0);
    RunResult b16 = run(c, "", "", 0, DType::BFloat16);
    EXPECT_NEAR(b16.loss, f32.loss, 0.02 * f32.loss) << (llama ? "llama" : "gpt");
  }
}

// A model built for inference only (TransformerConfig::inference_only, as the server and generate
// load theirs) holds its bf16 weights and nothing else: the bytes allocated for it are the
// parameter buffer's (the training model adds the fp32 gradient buffer: three times as much), no
// parameter has a main_grad, its forward equals the training model's, and backward or zero_grad
// is one line.
TEST(GPTModel, InferenceOnlyModelHoldsTheWeightsAlone) {
  TransformerConfig c = tiny_config(true);
  c.bf16 = true;
  c.hidden_dropout = c.attention_dropout = 0.0f;
  auto bytes_of_model = [&](bool inference_only, std::unique_ptr<GPTModel>& out) {
    TransformerConfig k = c;
    k.inference_only = inference_only;
    const size_t before = memory_stats(Device::cpu()).allocated;
    reset_peak_memory_stats(Device::cpu());
    out = std::make_unique<GPTModel>(k);
    return memory_stats(Device::cpu()).peak_allocated - before;
  };
  std::unique_ptr<GPTModel> inference, training;
  const size_t inference_bytes = bytes_of_model(true, inference);
  const size_t training_bytes = bytes_of_model(false, training);
  const size_t weights = inference->params().param_buffer().nbytes();
  EXPECT_EQ(weights, size_t(inference->params().param_buffer().numel()) * 2);
  EXPECT_GE(inference_bytes, weights);
  EXPECT_LT(inference_bytes, weights + weights / 4) << "more than the weights: " << inference_bytes;
  EXPECT_GE(training_bytes, 3 * weights) << "the training model's fp32 gradients";
  EXPECT_FALSE(inference->params().has_grads());
  for (const Parameter* p : inference->params().parameters()) EXPECT_FALSE(p->main_grad.defined()) << p->name;
  inference->init_weights(1234);
  training->init_weights(1234);
  Context ctx(Device::cpu(), 42);
  const Tensor tokens = testing::random_ids(2, 16, c.vocab_size, 1), labels = testing::random_ids(2, 16, c.vocab_size, 2);
  GPTModel::Stash a, b;
  const Tensor la = inference->forward(ctx, tokens, Tensor(), labels, a);
  const Tensor lb = training->forward(ctx, tokens, Tensor(), labels, b);
  EXPECT_EQ(la.to_floats(), lb.to_floats());
  EXPECT_EQ(testing::error_of([&] { inference->backward(ctx, Tensor::zeros(la.shape(), DType::Float32), a); }),
            "backward through a model built for inference only (no gradients)");
  EXPECT_NE(testing::error_of([&] { inference->params().zero_grad(); }).find("built for inference only"),
            std::string::npos);
}

TEST(GPTModel, MegatronInitialisation) {
  TransformerConfig c = tiny_config(false);
  c.num_layers = 2;
  c.hidden_size = 128;
  c.init_method_std = 0.02f;
  GPTModel model(c);
  model.init_weights(7);
  auto stddev = [&](const std::string& name) {
    std::vector<float> v = model.params().find(name)->data.to_floats();
    double s = 0;
    for (float x : v) s += double(x) * x;
    return std::sqrt(s / double(v.size()));
  };
  EXPECT_NEAR(stddev("decoder.layers.0.mlp.linear_fc1.weight"), 0.02, 0.001);
  EXPECT_NEAR(stddev("embedding.word_embeddings.weight"), 0.02, 0.001);
  EXPECT_NEAR(stddev("decoder.layers.1.mlp.linear_fc2.weight"), 0.02 / std::sqrt(4.0), 0.001);  // 1/sqrt(2L)
  EXPECT_NEAR(stddev("decoder.layers.1.self_attention.linear_proj.weight"), 0.01, 0.001);
  EXPECT_EQ(stddev("decoder.layers.0.mlp.linear_fc1.bias"), 0.0);
  for (float x : model.params().find("decoder.final_layernorm.weight")->data.to_floats()) EXPECT_EQ(x, 1.0f);
  // Same seed, same values; another seed, others.
  GPTModel again(c);
  again.init_weights(7);
  EXPECT_EQ(again.params().param_buffer().to_floats(), model.params().param_buffer().to_floats());
  again.init_weights(8);
  EXPECT_NE(again.params().param_buffer().to_floats(), model.params().param_buffer().to_floats());
}

TEST(GPTModel, ParameterNamesFollowMegatronCore) {
  GPTModel model(tiny_config(true));
  for (const char* name :
       {"embedding.word_embeddings.weight", "decoder.layers.0.input_layernorm.weight",
        "decoder.layers.0.self_attention.linear_qkv.weight", "decoder.layers.0.self_attention.linear_proj.weight",
        "decoder.layers.0.pre_mlp_layernorm.weight", "decoder.layers.0.mlp.linear_fc1.weight",
        "decoder.layers.0.mlp.linear_fc2.weight", "decoder.final_layernorm.weight", "output_layer.weight"}) {
    EXPECT_NE(model.params().find(name), nullptr) << name;
  }
  // GQA: 4 query heads, 2 groups, head dim 16 -> (4 + 2·2)·16 rows.
  EXPECT_EQ(model.params().find("decoder.layers.0.self_attention.linear_qkv.weight")->data.shape(), (Shape{128, 64}));
  EXPECT_EQ(model.params().find("decoder.layers.0.mlp.linear_fc1.weight")->data.shape(), (Shape{192, 64}));
  EXPECT_EQ(model.params().find("embedding.word_embeddings.weight")->data.shape(), (Shape{112, 64}));  // 100 -> 112
  EXPECT_TRUE(model.params().find("decoder.layers.0.input_layernorm.weight")->no_weight_decay);
  EXPECT_FALSE(model.params().find("output_layer.weight")->no_weight_decay);
}

TEST(TransformerConfig, VocabularyPadding) {
  EXPECT_EQ(padded_vocab_size(50257, 128, 1), 50304);
  EXPECT_EQ(padded_vocab_size(50257, 128, 2), 50432);
  EXPECT_EQ(padded_vocab_size(512, 128, 1), 512);
  EXPECT_EQ(padded_vocab_size(32000, 64, 8), 32256);
}

TEST(TransformerConfig, ShapesThatDoNotDivideAreClearErrors) {
  TransformerConfig c = tiny_config(true);
  c.num_query_groups = 3;
  testing::expect_one_line_error([&] { c.finalize(); }, "--num-attention-heads (4) must be divisible by --num-query-groups (3)");
  c = tiny_config(false);
  c.hidden_size = 66;
  testing::expect_one_line_error([&] { c.finalize(); }, "--hidden-size (66) must be divisible by --num-attention-heads (4)");
  c = tiny_config(false);
  c.recompute_granularity = "full";
  testing::expect_one_line_error([&] { c.finalize(); }, "--recompute-method");
  c = tiny_config(true);
  c.rotary_percent = 0.05f;
  testing::expect_one_line_error([&] { c.finalize(); }, "--rotary-percent");
  c = tiny_config(false);
  c.bf16 = c.fp16 = true;
  testing::expect_one_line_error([&] { c.finalize(); }, "--bf16 and --fp16");
}

// Rewrites the fixture GPT-2 weights with one change and loads them as the golden test does.
class BadWeights : public ::testing::Test {
 protected:
  void SetUp() override {
    src_ = std::make_unique<safetensors::File>(testing::fixtures_dir() + "/gpt2_model.safetensors");
    dir_ = std::filesystem::temp_directory_path() / ("mg_bad_weights_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  void load(const std::function<void(std::vector<std::pair<std::string, Tensor>>&)>& edit) {
    std::vector<std::pair<std::string, Tensor>> tensors;
    for (const std::string& n : src_->names()) tensors.emplace_back(n, src_->read(n));
    edit(tensors);
    const std::string path = (dir_ / "model.safetensors").string();
    safetensors::write(path, tensors, src_->metadata());
    safetensors::File file(path);
    HFModelInfo info = config_from_hf(nlohmann::json::parse(file.metadata().at("config")), 1);
    GPTModel model(info.config);
    load_model_state_dict(model, hf_to_megatron(info, [&](const std::string& n) { return file.read(n); }), path);
  }

  std::unique_ptr<safetensors::File> src_;
  std::filesystem::path dir_;
};

TEST_F(BadWeights, MissingTensorIsNamed) {
  testing::expect_one_line_error(
      [&] {
        load([](auto& t) {
          std::erase_if(t, [](const auto& p) { return p.first == "transformer.h.1.mlp.c_fc.weight"; });
        });
      },
      "transformer.h.1.mlp.c_fc.weight");
}

TEST_F(BadWeights, WrongShapeIsNamed) {
  testing::expect_one_line_error(
      [&] {
        load([](auto& t) {
          for (auto& [n, x] : t)
            if (n == "transformer.h.0.attn.c_proj.weight") x = Tensor::zeros({64, 32}, DType::Float32);
        });
      },
      "HF tensor 'transformer.h.0.attn.c_proj.weight' has shape [64, 32], but the config needs [64, 64]");
}

TEST_F(BadWeights, WrongDtypeIsNamed) {
  testing::expect_one_line_error(
      [&] {
        load([](auto& t) {
          for (auto& [n, x] : t)
            if (n == "transformer.ln_f.weight") x = Tensor::zeros({64}, DType::Int32);
        });
      },
      "HF tensor 'transformer.ln_f.weight' has dtype int32");
}

TEST(HFConfig, UnsupportedModelsAreRefused) {
  testing::expect_one_line_error([] { config_from_hf(nlohmann::json{{"model_type", "bert"}}); }, "model_type 'bert' is not supported");
  testing::expect_one_line_error([] { config_from_hf(nlohmann::json::object()); }, "no \"model_type\"");
}

TEST(HFMapping, RoundTripIsExact) {
  for (const char* name : {"gpt2", "llama"}) {
    safetensors::File file(testing::fixtures_dir() + "/" + name + "_model.safetensors");
    HFModelInfo info = config_from_hf(nlohmann::json::parse(file.metadata().at("config")), 128);
    TensorMap ours = hf_to_megatron(info, [&](const std::string& n) { return file.read(n); });
    TensorMap back = megatron_to_hf(info, ours);
    EXPECT_EQ(back.size(), file.size()) << name;
    for (const std::string& n : file.names()) {
      ASSERT_TRUE(back.count(n)) << n;
      EXPECT_EQ(back[n].to_floats(), file.read(n).to_floats()) << n;
    }
  }
}

}  // namespace
}  // namespace megatron
