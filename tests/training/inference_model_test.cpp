// check_inference_layout: what the generation tools refuse, one line each, before loading anything.
#include "megatron/training/inference_model.h"

#include <gtest/gtest.h>

#include "megatron/runtime/check.h"

namespace megatron {
namespace {

std::string refusal(const Arguments& args, int world_size) {
  LaunchInfo launch;
  launch.world_size = world_size;
  try {
    check_inference_layout(args, launch);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(InferenceLayout, RefusesWhatTensorParallelInferenceDoesNotRun) {
  Arguments args;
  EXPECT_EQ(refusal(args, 1), "");
  args.tensor_model_parallel_size = 2;
  EXPECT_EQ(refusal(args, 2), "");
  EXPECT_NE(refusal(args, 4).find("--tensor-model-parallel-size 2 runs on 2 ranks and 4 were launched"),
            std::string::npos);
  Arguments moe = args;
  moe.num_experts = 8;
  EXPECT_NE(refusal(moe, 2).find("MoE layers under tensor parallelism need sequence parallelism"), std::string::npos);
  moe.tensor_model_parallel_size = 1;
  EXPECT_EQ(refusal(moe, 1), "");  // one rank serves it
  Arguments mla = args;
  mla.multi_latent_attention = true;
  EXPECT_NE(refusal(mla, 2).find("multi-latent attention's KV cache runs on one rank"), std::string::npos);
  for (auto [field, flag] : {std::pair{&Arguments::pipeline_model_parallel_size, "--pipeline-model-parallel-size 2"},
                             {&Arguments::context_parallel_size, "--context-parallel-size 2"},
                             {&Arguments::expert_model_parallel_size, "--expert-model-parallel-size 2"}}) {
    Arguments a;
    a.*field = 2;
    const std::string message = refusal(a, 2);
    EXPECT_EQ(message.rfind(flag, 0), 0u) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
}

}  // namespace
}  // namespace megatron
