// The bridge from the MoE modules' options to the op library's MoE ops (kernels/op_list.inc, "mixture
// of experts"): the routing options as the ops take them.
#pragma once

#include "megatron/core/transformer/moe/moe_utils.h"
#include "megatron/kernels/ops.h"

namespace megatron::moe {

/// config (validated) with the token layout, for ops::moe_routing_forward/backward; global_aux_group:
/// the ranks whose tokens the global aux loss counts (Note [Global aux loss], router.h).
inline MoeRoutingParams routing_params(const RouterConfig& config, int64_t seq_length, int64_t micro_batch,
                                       int64_t global_aux_group = 1) {
  config.validate();
  MoeRoutingParams p;
  p.num_experts = config.num_experts;
  p.topk = config.topk;
  p.sigmoid = config.score_function == "sigmoid";
  p.pre_softmax = config.pre_softmax;
  p.num_groups = config.num_groups;
  p.group_topk = config.group_topk;
  p.group_score_topk = config.group_score_topk;
  p.topk_scaling_factor = config.topk_scaling_factor;
  p.aux_loss_coeff = config.aux_loss_coeff;
  p.seq_aux_loss_coeff = config.seq_aux_loss_coeff;
  p.z_loss_coeff = config.z_loss_coeff;
  p.global_aux_loss_coeff = config.global_aux_loss_coeff;
  p.global_aux_group = global_aux_group;
  p.capacity_factor = config.capacity_factor.value_or(0.0f);
  p.drop_by_position = config.drop_policy == "position";
  p.pad_to_capacity = config.pad_to_capacity;
  p.seq_length = seq_length;
  p.micro_batch = micro_batch;
  return p;
}

}  // namespace megatron::moe
