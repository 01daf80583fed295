// MoE options from the flags to the layer: TransformerConfig's MoE checks and moe::moe_config (what
// the router receives), and Megatron's routing-map padding for FP8.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "megatron/core/transformer/moe/moe_utils.h"
#include "megatron/core/transformer/moe/moe_layer.h"
#include "megatron/core/transformer/transformer_config.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

// Two tiny layers with 4 experts: the options under test go on top.
TransformerConfig tiny_moe_config() {
  TransformerConfig tc;
  tc.num_layers = 2;
  tc.hidden_size = 8;
  tc.num_attention_heads = 2;
  tc.vocab_size = 16;
  tc.max_position_embeddings = 8;
  tc.num_moe_experts = 4;
  return tc;
}

// Note [Routing padding for FP8]: Megatron's pad_routing_map written out for one map — each expert
// column gets its first unrouted tokens marked until its count is a multiple; an expert with too
// few unrouted tokens takes all of them. The flag's rules, one line each.
TEST(PadRoutingMap, IsMegatrons) {
  // tokens 0..4, experts 0..2: counts 2, 2, 1
  const Tensor map = Tensor::from_ints({1, 0, 0, 0, 1, 0, 1, 0, 0, 0, 0, 0, 0, 1, 1}, {5, 3}, DType::UInt8);
  EXPECT_EQ(moe::pad_routing_map(map, 3).to_ints(),
            (std::vector<int64_t>{1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1}));
  EXPECT_EQ(moe::pad_routing_map(map, 1).to_ints(), map.to_ints());
  EXPECT_EQ(moe::pad_routing_map(map, 8).to_ints(), std::vector<int64_t>(15, 1));
  EXPECT_EQ(map.to_ints(), (std::vector<int64_t>{1, 0, 0, 0, 1, 0, 1, 0, 0, 0, 0, 0, 0, 1, 1})) << "the input is kept";

  auto error = [](const std::string& dispatcher, bool fp8, bool pad_capacity) {
    TransformerConfig tc = tiny_moe_config();
    tc.moe_token_dispatcher_type = dispatcher;
    tc.moe_router_padding_for_quantization = true;
    tc.moe_pad_expert_input_to_capacity = pad_capacity;
    if (fp8) tc.fp8.format = "hybrid";
    return testing::error_of([&] { tc.finalize(); });
  };
  EXPECT_EQ(error("alltoall", true, false), "");
  EXPECT_EQ(error("flex", true, false), "");
  EXPECT_NE(error("alltoall", false, false).find("--moe-router-padding-for-quantization (--moe-router-padding-for-fp8) "
                                                 "needs --fp8-format"),
            std::string::npos);
  EXPECT_NE(error("allgather", true, false).find("the allgather dispatcher does not support"), std::string::npos);
  EXPECT_NE(error("alltoall", true, true).find("with --moe-pad-expert-input-to-capacity is not supported"),
            std::string::npos);
}

// The MoE flags reach the router: global_aux_loss composes with the other types, the jitter and the
// fp64 router are passed on, an unknown type is one line naming the known ones.
TEST(MoEConfig, RouterOptionsFromTheFlags) {
  TransformerConfig tc = tiny_moe_config();
  tc.moe_router_topk = 2;
  tc.moe_router_load_balancing_type = {"aux_loss", "global_aux_loss"};
  tc.moe_aux_loss_coeff = {0.01f, 0.02f};
  tc.moe_input_jitter_eps = 0.1f;
  tc.moe_router_dtype = "fp64";
  tc.finalize();
  const moe::MoEConfig m = moe::moe_config(tc);
  EXPECT_EQ(m.router.aux_loss_coeff, 0.01f);
  EXPECT_EQ(m.router.global_aux_loss_coeff, 0.02f);
  EXPECT_EQ(m.router.input_jitter_eps, 0.1f);
  EXPECT_TRUE(m.router.fp64);
  tc.moe_router_load_balancing_type = {"aux_loss", "switch"};
  try {
    moe::moe_config(tc);
    ADD_FAILURE() << "no error";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("global_aux_loss"), std::string::npos) << err.what();
  }
}

}  // namespace
}  // namespace megatron
