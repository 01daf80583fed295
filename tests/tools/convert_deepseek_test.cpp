// tools/convert_checkpoint both ways on the DeepSeek-V3 fixture (multi-latent attention, YaRN, dense
// first layer, sigmoid group-limited MoE with the expert bias and a shared expert): HF -> megatron.cpp
// checkpoint -> HF gives back every tensor exactly (fp32), e_score_correction_bias included (a model
// buffer in the checkpoint), and a config.json that imports to the same model.
#include <gtest/gtest.h>

#include "megatron/core/dist_checkpointing/safetensors.h"
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

}  // namespace
}  // namespace megatron::testing
