// tools/convert_checkpoint both ways on the DeepSeek-V3 fixture (multi-latent attention, YaRN, dense
// first layer, sigmoid group-limited MoE with the expert bias and a shared expert): HF -> megatron.cpp
// checkpoint -> HF gives back every tensor exactly (fp32), e_score_correction_bias included (a model
// buffer in the checkpoint), and a config.json that imports to the same model; a model trained with
// --mtp-num-layers 1 exported (its MTP layer as model.layers.{L}: Note [HF DeepSeek-V3 MTP]), imported
// and exported again, bit-exact both ways.
#include <gtest/gtest.h>

#include <cstring>

#include "megatron/core/dist_checkpointing/safetensors.h"
#include "megatron/core/dist_checkpointing/sharded.h"
#include "megatron/core/models/gpt/hf_mapping.h"
#include "tests/functional/run_util.h"
#include "tests/test_util.h"

namespace megatron::testing {
namespace {

TEST(ConvertDeepSeekV3, HFToMegatronToHFIsExact) {
  ScratchDir dir("convert_deepseek_v3");
  const std::string src = fs::absolute(arch_fixtures_dir() + "/deepseek_v3").string();
  RunResult in = run({bin("convert_checkpoint"), "--from", "hf", "--load", src, "--save", "ckpt"}, dir.path);
  ASSERT_EQ(in.exit_code, 0) << in.output;
  RunResult out = run({bin("convert_checkpoint"), "--from", "megatron", "--load", "ckpt", "--save", "hf"}, dir.path);
  ASSERT_EQ(out.exit_code, 0) << out.output;
  HFFolder original(src), back((dir.path / "hf").string());
  ASSERT_EQ(back.tensor_names(), original.tensor_names());
  size_t exact = 0;
  for (const std::string& n : original.tensor_names()) {
    const bool same = back.get(n).to_floats() == original.get(n).to_floats();
    EXPECT_TRUE(same) << n;
    exact += same;
  }
  const HFModelInfo a = config_from_hf(original.config(), 1), b = config_from_hf(back.config(), 1);
  EXPECT_EQ(back.config().at("model_type"), "deepseek_v3");
  EXPECT_EQ(a.config.moe_layer_pattern, b.config.moe_layer_pattern);
  EXPECT_EQ(a.config.q_lora_rank, b.config.q_lora_rank);
  EXPECT_EQ(a.rope_interleave, b.rope_interleave);
  std::printf("convert_checkpoint deepseek_v3: hf -> megatron.cpp -> hf, %zu of %zu tensors exact\n", exact,
              original.tensor_names().size());
}

// A small DeepSeek-V3 (dense first layer, then MoE with the expert bias and a shared expert) with one
// MTP depth, trained 2 steps so every weight and expert bias moves.
const std::vector<std::string> kDeepSeekMtp = {
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "96", "--swiglu",
    "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights", "--multi-latent-attention", "--q-lora-rank", "24", "--kv-lora-rank", "16",
    "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12", "--qk-layernorm", "--rope-type", "yarn",
    "--rotary-scaling-factor", "4", "--yarn-original-max-position-embeddings", "8", "--mscale", "1",
    "--mscale-all-dim", "1", "--num-experts", "4", "--moe-layer-freq", "([0]+[1])", "--moe-ffn-hidden-size", "32",
    "--moe-shared-expert-intermediate-size", "32", "--moe-router-topk", "2", "--moe-router-score-function", "sigmoid",
    "--moe-router-enable-expert-bias", "--moe-router-num-groups", "2", "--moe-router-group-topk", "1",
    "--moe-router-group-score-topk", "2", "--mtp-num-layers", "1", "--seq-length", "16",
    "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2",
    "--lr", "2e-2", "--vocab-size", "100", "--mock-data", "--eval-iters", "0", "--device", "cpu", "--save", "ckpt",
    "--save-interval", "2"};

bool bit_equal(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() && std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0;
}

// Every model tensor (parameters and buffers) of two checkpoint directories, bit for bit; of the
// embedding and output layer the rows of the vocabulary (the padding rows are the run's in a, zeros
// after an HF import in b).
void expect_same_checkpoints(const fs::path& a, const fs::path& b, int64_t vocab) {
  dist_checkpointing::ShardIndex ia(a.string(), "model"), ib(b.string(), "model");
  ASSERT_EQ(ia.names(), ib.names());
  int mtp = 0;
  for (const std::string& name : ia.names()) {
    const Shape shape = ia.tensor(name).shape;
    Tensor ta = Tensor::empty(shape, DType::Float32), tb = Tensor::empty(shape, DType::Float32);
    ia.load_into(name, ShardSpec{}, ta);
    ib.load_into(name, ShardSpec{}, tb);
    if (name == "embedding.word_embeddings.weight" || name == "output_layer.weight") {
      ta = ta.slice(0, vocab), tb = tb.slice(0, vocab);
    }
    EXPECT_TRUE(bit_equal(ta, tb)) << name;
    mtp += name.rfind("mtp.", 0) == 0;
  }
  EXPECT_GT(mtp, 5) << "the MTP layer's tensors are in both";
}

TEST(ConvertDeepSeekV3, MtpModelRoundTripIsBitExact) {
  ScratchDir dir("convert_deepseek_v3_mtp");
  RunResult train = run(concat({bin("pretrain_gpt")}, kDeepSeekMtp), dir.path);
  ASSERT_EQ(train.exit_code, 0) << train.output;
  RunResult out = run({bin("convert_checkpoint"), "--from", "megatron", "--load", "ckpt", "--save", "hf"}, dir.path);
  ASSERT_EQ(out.exit_code, 0) << out.output;
  HFFolder hf((dir.path / "hf").string());
  EXPECT_EQ(hf.config().at("num_nextn_predict_layers"), 1);
  for (const char* n : {"model.layers.2.eh_proj.weight", "model.layers.2.enorm.weight", "model.layers.2.hnorm.weight",
                        "model.layers.2.shared_head.norm.weight", "model.layers.2.self_attn.q_b_proj.weight",
                        "model.layers.2.mlp.gate.e_score_correction_bias"})
    EXPECT_TRUE(hf.has(n)) << n;
  EXPECT_TRUE(bit_equal(hf.get("model.layers.2.embed_tokens.weight"), hf.get("model.embed_tokens.weight")));
  EXPECT_TRUE(bit_equal(hf.get("model.layers.2.shared_head.head.weight"), hf.get("lm_head.weight")));
  RunResult in = run({bin("convert_checkpoint"), "--from", "hf", "--load", "hf", "--save", "ckpt2"}, dir.path);
  ASSERT_EQ(in.exit_code, 0) << in.output;
  expect_same_checkpoints(dir.path / "ckpt/iter_0000002", dir.path / "ckpt2/release", 100);
  RunResult again = run({bin("convert_checkpoint"), "--from", "megatron", "--load", "ckpt2", "--save", "hf2"}, dir.path);
  ASSERT_EQ(again.exit_code, 0) << again.output;
  HFFolder hf2((dir.path / "hf2").string());
  ASSERT_EQ(hf2.tensor_names(), hf.tensor_names());
  for (const std::string& n : hf.tensor_names()) EXPECT_TRUE(bit_equal(hf2.get(n), hf.get(n))) << n;
  EXPECT_EQ(hf2.config().at("num_nextn_predict_layers"), 1);
  std::printf("convert_checkpoint deepseek_v3 with MTP: megatron.cpp -> hf -> megatron.cpp -> hf, %zu HF tensors\n",
              hf.tensor_names().size());
}

}  // namespace
}  // namespace megatron::testing
