// Megatron's FullCudaGraphWrapper (--cuda-graph-impl local --cuda-graph-scope full_iteration): the
// forward and backward passes of every microbatch of a training step recorded once as one CUDA
// graph (runtime/cuda_graph.h) and launched as one, so the host launches nothing per kernel.
//
// A step in graph mode:
//   1. the step's microbatches are pulled and their ids checked on the host (Note [Host checks
//      under capture]), then copied into the graph's input tensors, and the loss scale over the
//      number of microbatches into its device scalar;
//   2. the first steps (--cuda-graph-warmup-steps) run eagerly: they build the cuBLASLt and cuDNN
//      plans and grow the workspaces, which the captured work must find in place; the step after
//      them is captured (recording runs nothing) and launched;
//   3. each later step launches the graph; the loss sums [M, 2] are read back once.
// A change of shape (another number of microbatches under batch-size ramp-up) starts over at 2.
// Gradients accumulate into the main-grad buffers as in the eager step; zeroing them, the gradient
// reduction and the optimizer stay outside the graph (the optimizer's inf check and gradient norm
// are read by the host). Evaluation runs eagerly.
//
// Dropout draws the offsets an eager step would: the graph holds the captured step's, and the
// context's device offset shift moves them on (Note [Random offsets under CUDA graphs], context.h).
//
// What the graph cannot follow is refused when the arguments are validated (training/arguments.cpp):
// pipeline and tensor parallelism (their communication inside the step) and overlapped gradient
// reduction.
#pragma once

#include <vector>

#include "megatron/core/pipeline_parallel/schedules.h"
#include "megatron/runtime/cuda_graph.h"

namespace megatron {

class FullCudaGraph {
 public:
  explicit FullCudaGraph(int warmup_steps) : warmup_steps_(warmup_steps) {}

  /// forward_backward (schedules.h) through the graph; the same results as the eager call.
  LossSums forward_backward(Context& ctx, ParallelState* ps, const std::vector<const ModelChunk*>& chunks,
                            const ForwardStepFunc& forward_step, BatchIterator& data, const ForwardBackwardArgs& args,
                            DistributedDataParallel* ddp = nullptr);

  /// How many times a step was captured (1 unless the shapes changed) and launched.
  int64_t captures() const { return captures_; }
  int64_t launches() const { return launches_; }

 private:
  struct Key {
    int num_microbatches = 0;
    Shape tokens;
    bool has_positions = false, has_mask = false;
    bool operator==(const Key&) const = default;
  };
  int warmup_steps_;
  int eager_left_ = 0;
  Key key_;
  CudaGraph graph_;
  std::vector<MicroBatch> inputs_;  // on the device, read by the graph
  Tensor loss_scale_, sums_;
  uint64_t captured_rng_base_ = 0;  // ctx.rng().offset when the step was captured
  int64_t captures_ = 0, launches_ = 0;
};

}  // namespace megatron
