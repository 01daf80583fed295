// Megatron's CUDA RNG tracker, as seeds: dropout inside the tensor-parallel region (attention
// probabilities of this rank's heads; hidden states on sequence-parallel shards) draws from the
// model-parallel seed `seed + 2718 + tp_rank`, so every rank's shard gets its own mask; dropout on
// tensors that every tensor-parallel rank holds whole uses the default seed, so the masks agree.
// At tensor-parallel size 1 both are the default seed (the single-device run is unchanged).
#pragma once

#include "megatron/core/process_groups_config.h"
#include "megatron/runtime/context.h"

namespace megatron::tensor_parallel {

/// `tp`: the tensor-parallel group (null: one rank).
inline uint64_t region_seed(Context& ctx, const Communicator* tp, bool tensor_parallel_region) {
  if (!tensor_parallel_region || group_size(tp) == 1) return ctx.rng().seed;
  return ctx.rng().seed + 2718 + uint64_t(tp->rank());
}

}  // namespace megatron::tensor_parallel
