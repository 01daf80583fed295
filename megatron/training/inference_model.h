// The model the generation tools run (tools/text_generation_server, tools/generate): built from
// arguments that carry the checkpoint's model arguments, then loaded whole in one process or, on
// ranks launched as for training with --tensor-model-parallel-size N, as this rank's shard of a
// checkpoint saved with any layout (Note [Tensor-parallel inference] in
// megatron/core/inference/inference_group.h).
#pragma once

#include <memory>

#include "megatron/core/comm/communicator.h"
#include "megatron/core/inference/inference_group.h"
#include "megatron/core/parallel_state.h"
#include "megatron/training/arguments.h"

namespace megatron {

struct InferenceModel {
  std::unique_ptr<ParallelState> ps;      // null: one process
  std::unique_ptr<Context> ctx;
  std::unique_ptr<GPTModel> model;        // dropout off, no recomputation, no sequence parallelism
  std::unique_ptr<InferenceGroup> group;  // the tensor-parallel ranks; null: one process

  /// A rank other than the group's leader: it runs InferenceGroup::follow and nothing else.
  bool follower() const { return group && !group->leader(); }
};

/// Refuses, one line each, what inference does not run: a launched rank count other than
/// --tensor-model-parallel-size (one process per shard, one job per model replica), pipeline,
/// context and expert parallel sizes above 1, and under tensor parallelism MoE models (MoE with
/// TP needs sequence parallelism) and multi-latent attention (its cache runs on one rank).
void check_inference_layout(const Arguments& args, const LaunchInfo& launch);

/// Checks the layout, builds the model for `vocab_size` tokenizer ids on args.device (this rank's
/// GPU under a launcher) and loads args.load. Collective over the launched ranks.
InferenceModel load_inference_model(Arguments args, const LaunchInfo& launch, int64_t vocab_size, uint64_t seed);

}  // namespace megatron
