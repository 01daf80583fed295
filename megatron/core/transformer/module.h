// ModelChunk (what Megatron's MegatronModule is to its schedules and training loop): the small
// interface the pipeline schedules, the CUDA-graph step, checkpointing and pretrain() work through,
// so they serve any model — GPTModel today, others through their own model provider:
//   - which stages the chunk holds (pre_process: the first, post_process: the last);
//   - the activations exchanged between stages and the random streams of one microbatch;
//   - a per-microbatch stash and the backward step (the forward step is the model's own, called by
//     the training script's forward_step, as in Megatron);
//   - its parameters, their initialisation, and the few facts the loop needs about them;
//   - the extra losses its modules report (AuxLossTracker).
#pragma once

#include <memory>
#include <typeinfo>
#include <utility>
#include <vector>

#include "megatron/core/distributed/param_and_grad_buffer.h"
#include "megatron/core/transformer/aux_loss_tracker.h"
#include "megatron/runtime/check.h"
#include "megatron/runtime/context.h"

namespace megatron {

/// What one microbatch's forward keeps for its backward (each model's own type; opaque to the
/// schedules).
struct ModelStash {
  virtual ~ModelStash() = default;
};

class ModelChunk {
 public:
  virtual ~ModelChunk() = default;

  /// Megatron's pre_process / post_process: the chunk holds the first / last pipeline stage.
  virtual bool pre_process() const = 0;
  virtual bool post_process() const = 0;
  /// The activations this chunk exchanges with its neighbouring stages for a [micro_batch,
  /// seq_length] microbatch, and their dtype.
  virtual Shape stage_activation_shape(int64_t micro_batch, int64_t seq_length) const = 0;
  virtual DType activation_dtype() const = 0;
  /// Random offsets one microbatch draws (the same on every stage).
  virtual uint64_t random_streams_per_microbatch() const = 0;

  /// A fresh stash for one microbatch.
  virtual std::unique_ptr<ModelStash> make_stash() const = 0;
  /// The backward pass of one microbatch: output_grad is the gradient of the loss function's input
  /// on the last stage, else the gradient of this chunk's output. Accumulates the parameter
  /// gradients, releases the stash, and returns the gradient of the chunk's input (undefined on
  /// the first stage).
  virtual Tensor backward_step(Context& ctx, const Tensor& output_grad, ModelStash& stash) const = 0;

  virtual ParamAndGradBuffer& params() = 0;
  virtual const ParamAndGradBuffer& params() const = 0;
  /// Initialises every parameter from `seed` (Megatron's init methods).
  virtual void init_weights(uint64_t seed) = 0;
  /// Parameters whose gradient one microbatch's backward accumulates more than once, and how many
  /// times (the data-parallel wrapper waits for all of them before reducing their bucket).
  virtual std::vector<std::pair<const Parameter*, int>> repeated_accumulations() const { return {}; }

  /// The id ranges the chunk's input tables accept, checked on the host before a step moves its
  /// microbatches to the device (0: not checked).
  struct InputRanges {
    int64_t token_rows = 0, position_rows = 0;
  };
  virtual InputRanges input_ranges() const { return {}; }

  /// Where the chunk's modules report their extra losses (mixture-of-experts auxiliary losses, ...):
  /// the training loop's tracker (null: not tracked). The model declares its losses in it.
  virtual void set_aux_loss_tracker(AuxLossTracker* tracker) { aux_losses_ = tracker; }
  AuxLossTracker* aux_loss_tracker() const { return aux_losses_; }
  /// After a step's gradients are final, before the optimizer: the MoE routers' aux-loss-free
  /// expert biases move by the step's token counts (Megatron's _update_router_expert_bias in
  /// finalize_model_grads; collective over the chunk's tp × cp and data-parallel groups), and the
  /// routers' per-step state restarts (reset_model_temporary_tensors: the global aux loss's counts).
  virtual void finish_router_step(Context&) {}
  /// After a step's gradients are final: the FP8 scaling state's step — the delayed recipe's amax
  /// histories reduced over the chunk's tensor × context and data-parallel groups, then rolled and
  /// the scales updated, on the device (Note [FP8 scaling under parallelism] in gpt_model.cpp).
  virtual void finish_fp8_step(Context&) {}
  /// Before a training step's first microbatch: whether the FP8 layers keep their weights' FP8
  /// copies for the step's later microbatches, and whether the MoE experts keep their weights'
  /// transposed copies from a forward to its backward (Note [FP8 weight cache]; finish_fp8_step
  /// drops them).
  virtual void begin_fp8_step(bool /*cache_weights*/, bool /*keep_expert_transposes*/) {}
  /// State that is not a parameter but belongs in checkpoints (the routers' expert biases, the FP8
  /// scaling state), by name.
  virtual std::vector<ModelBuffer> buffers() { return {}; }

 private:
  AuxLossTracker* aux_losses_ = nullptr;
};

/// The model type of a chunk (in a training script's own forward step), or a clear error.
template <class Model>
const Model& model_cast(const ModelChunk& chunk) {
  const auto* m = dynamic_cast<const Model*>(&chunk);
  MG_CHECK(m, "the forward step expects a {} model chunk", typeid(Model).name());
  return *m;
}
template <class Stash>
Stash& stash_cast(ModelStash& stash) {
  auto* s = dynamic_cast<Stash*>(&stash);
  MG_CHECK(s, "the forward step was given another model's stash");
  return *s;
}

}  // namespace megatron
