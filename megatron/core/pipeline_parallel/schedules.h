// Pipeline schedules as plain functions over callbacks (Megatron's get_forward_backward_func).
// Without pipeline parallelism: forward_backward_no_pipelining runs the microbatches of one global
// batch one after another, each forward immediately followed by its backward, gradients
// accumulating in the fp32 grad buffer. The parallel issue adds 1F1B and interleaved 1F1B beside it.
#pragma once

#include <functional>

#include "megatron/core/models/gpt/gpt_model.h"

namespace megatron {

/// One microbatch as the data loader gives it (host tensors, [micro batch, seq]).
struct MicroBatch {
  Tensor tokens;        // int64
  Tensor labels;        // int64
  Tensor loss_mask;     // fp32
  Tensor position_ids;  // int64
};

/// What forward_step returns (Megatron: output tensor and the loss function's mask).
struct ForwardOutput {
  Tensor losses;     // per-token losses [b, s] fp32
  Tensor loss_mask;  // [b, s] fp32 (undefined: every token counts)
};

/// A data iterator: each call returns the next microbatch.
using BatchIterator = std::function<MicroBatch()>;

/// Megatron's forward_step_func: takes the next microbatch from the iterator and runs the forward.
using ForwardStepFunc = std::function<ForwardOutput(Context&, BatchIterator&, const GPTModel&, GPTModel::Stash&)>;

/// Σ loss·mask and Σ mask over the microbatches of one step (the reported lm loss is their ratio).
struct LossSums {
  double loss_sum = 0.0;
  double num_tokens = 0.0;
};

/// Runs `num_microbatches` microbatches. Unless forward_only, backpropagates each microbatch's mean
/// loss (over its unmasked tokens) divided by num_microbatches and multiplied by `loss_scale`.
LossSums forward_backward_no_pipelining(Context& ctx, const GPTModel& model, const ForwardStepFunc& forward_step,
                                        BatchIterator& data, int num_microbatches, float loss_scale, bool forward_only);

}  // namespace megatron
