// Pipeline-parallel schedules (Megatron-Core's schedules.py): 1F1B and interleaved 1F1B as plain
// functions over two callbacks, forward and backward of one microbatch on one model chunk. They
// know nothing of the model: the callbacks own the activations each microbatch needs for its
// backward and, on the last stage, the loss. The p2p exchanges live in p2p_communication.h.
//
// The order of forward and backward steps on every rank is Megatron's, step for step:
//   1F1B:        pp_size - pp_rank - 1 warmup forwards, then one forward + one backward per step,
//                then the remaining backwards.
//   interleaved: V model chunks per rank, virtual microbatch k runs chunk (k mod pp·V) / pp on
//                microbatch (k / (pp·V))·pp + k mod pp (backwards walk the chunks in reverse);
//                (pp_size - pp_rank - 1)·2 + (V - 1)·pp_size warmup forwards (all of them when
//                num_microbatches == pp_size), then 1F1B over virtual microbatches, then the cooldown.
// A microbatch's received input is released as soon as its backward returns; outputs are released
// once sent (Megatron's deallocate_output_tensor).
#pragma once

#include <functional>

#include "megatron/core/parallel_state.h"

namespace megatron {

struct PipelineStepFuncs {
  /// Runs `microbatch` through model chunk `chunk` (the schedule has called
  /// ps.set_virtual_pipeline_rank(chunk)). `input` is the received activation (undefined on the
  /// first stage of the first chunk). Returns the activation to send to the next stage (ignored on
  /// the last stage of the last chunk).
  std::function<Tensor(Context&, int chunk, int microbatch, const Tensor& input)> forward;
  /// Backward of that microbatch on that chunk. output_grad is undefined on the last stage of the
  /// last chunk (the loss starts it). Returns d loss / d input (ignored on the first stage of the
  /// first chunk). last_for_chunk: the chunk's final backward of this step (the data-parallel
  /// wrapper starts reducing that chunk's gradients then).
  std::function<Tensor(Context&, int chunk, int microbatch, const Tensor& output_grad, bool last_for_chunk)>
      backward;
};

/// 1F1B (PipeDream-Flush): at most pp_size - pp_rank microbatches in flight on a rank. Needs
/// ps.vpp_size() == 1. forward_only: forwards only (evaluation).
void forward_backward_pipelining_without_interleaving(Context& ctx, ParallelState& ps, const PipelineStepFuncs& f,
                                                      int num_microbatches, const Shape& tensor_shape, DType dtype,
                                                      bool forward_only);

/// Interleaved 1F1B over ps.vpp_size() model chunks per rank. Needs num_microbatches to be a
/// multiple of pp_size (Megatron's rule).
void forward_backward_pipelining_with_interleaving(Context& ctx, ParallelState& ps, const PipelineStepFuncs& f,
                                                   int num_microbatches, const Shape& tensor_shape, DType dtype,
                                                   bool forward_only);

}  // namespace megatron
