// One training (or evaluation) step's forward and backward passes over this rank's model chunks —
// Megatron's get_forward_backward_func() and the loss handling of its forward_step/loss_func:
//   - PP = 1: no pipelining: each microbatch's forward followed by its backward;
//   - PP > 1: 1F1B, or interleaved 1F1B with several model chunks per rank (pipeline_schedules.h).
// Gradients accumulate in the fp32 grad buffers; with a DistributedDataParallel the gradient
// reduction is enabled for each chunk's last microbatch only (Megatron's no_sync), so overlapped
// buckets start during that backward.
//
// The schedules see the model only through ModelChunk (transformer/module.h) and the training
// script's forward step, which returns the output and its loss function (Megatron's forward_step
// returning output_tensor and loss_func); pretrain_gpt supplies the GPT ones.
//
// Losses: on the last stage each microbatch contributes its loss over its token count (the loss
// function's Σ loss / Σ tokens), divided by the number of microbatches and multiplied by the loss
// scale (Megatron with calculate_per_token_loss off); the data-parallel mean is the DDP's 1/dp
// scaling. With calculate_per_token_loss: Note [Per-token loss].
//
// Note [Per-token loss] (Megatron's --calculate-per-token-loss): each microbatch's gradient is that
// of loss_scale · Σ loss (no division by its tokens, none by the number of microbatches, no CP
// factor), the DDP sums over data × context ranks instead of averaging, and finalize_model_grads
// divides every gradient by the global batch's unmasked tokens (LossSums::num_tokens of the last
// stage, broadcast over the pipeline). The gradient is then that of Σ loss / Σ tokens over the
// whole global batch, whatever the microbatches' masks. loss_scale_tensor is then [2] =
// {loss_scale, 1}: the loss function's gradient is mask · scale[0] / scale[1] through the same
// device op as the mean's, so nothing waits for the device either way.
//
// Random streams: microbatch j of data-parallel rank r is microbatch j·dp + r of the global batch
// (Megatron's sampler), and it draws the random offsets that microbatch draws in the single-process
// run, so dropout masks do not depend on the data-parallel or pipeline layout.
#pragma once

#include <functional>
#include <vector>

#include "megatron/core/parallel_state.h"
#include "megatron/core/transformer/module.h"

namespace megatron {

class DistributedDataParallel;

/// One microbatch as the data loader gives it (host tensors, [micro batch, seq]).
struct MicroBatch {
  Tensor tokens;        // int64
  Tensor labels;        // int64
  Tensor loss_mask;     // fp32
  Tensor position_ids;  // int64
  /// The documents of each row with --reset-attention-mask: host int32 [b, n + 1] in positions of
  /// the whole sequence (Note [Packed sequences]); undefined: causal over each row.
  Tensor cu_seqlens;
};

/// Megatron's loss_func, run on the last stage: from the forward step's `output`, writes the
/// microbatch's {Σ loss, token count} into `sums` [2] (fp32, on ctx's device) and, when `grad` is
/// not null, the gradient of loss_scale · Σ loss / token count with respect to `output` into *grad
/// (loss_scale [1] fp32 on the device). Nothing in it may wait for the device (the CUDA-graph step
/// captures it).
using LossFunc =
    std::function<void(Context& ctx, const Tensor& output, Tensor& sums, const Tensor& loss_scale, Tensor* grad)>;

/// The language-model loss over per-token losses [b, s] (fp32): the sum over the tokens where
/// loss_mask [b, s] is 1 (undefined: every token), over their number — Megatron's GPT loss_func.
///
/// Note [Loss under context parallelism]: with a context-parallel group `cp` each rank holds part
/// of every sequence; its {Σ loss, tokens} are summed over the group before the gradient is
/// taken, and the gradient is multiplied by the group's size (Megatron's `output_tensor *=
/// cp_group_size`), which the mean over data × context ranks of the gradient reduction undoes.
/// Megatron divides each rank's sum by its own token count; the sum over the group makes every
/// layout equal the single process also when the loss mask is uneven (--eod-mask-loss), and is
/// the same when it is not. Every CP rank reports the microbatch's whole sums.
/// `per_token`: the gradient of loss_scale · Σ loss over this rank's tokens, loss_scale being
/// loss_scale_tensor's [2] (Note [Per-token loss]); the sums are reported as above.
LossFunc masked_token_loss(Tensor loss_mask, Communicator* cp = nullptr, bool per_token = false);

/// What forward_step returns (Megatron: the output tensor and the loss function).
struct ForwardOutput {
  Tensor output;      // the loss function's input on the last stage, else the activations to send
  Tensor loss_mask;   // [b, s] fp32 for the default loss function (undefined: every token counts)
  LossFunc loss_func; // the last stage's loss; unset: masked_token_loss(loss_mask)
};

/// A data iterator: each call returns the next microbatch.
using BatchIterator = std::function<MicroBatch()>;

/// Megatron's forward_step_func for one model chunk: `input` is the previous stage's output
/// (undefined on the first stage); `stash` is the chunk's make_stash(), for its backward_step.
using ForwardStepFunc =
    std::function<ForwardOutput(Context&, const MicroBatch&, const ModelChunk&, const Tensor& input, ModelStash& stash)>;

/// A ForwardStepFunc from one written for a concrete model type, f(ctx, batch, const Model&, input,
/// Model::Stash&) (model_cast / stash_cast).
template <class Model, class F>
ForwardStepFunc typed_forward_step(F f) {
  return [f](Context& ctx, const MicroBatch& b, const ModelChunk& m, const Tensor& input, ModelStash& stash) {
    return f(ctx, b, model_cast<Model>(m), input, stash_cast<typename Model::Stash>(stash));
  };
}

/// Σ loss·mask and Σ mask over the microbatches of one step (the reported lm loss is their ratio);
/// meaningful on the last pipeline stage only, summed over the data-parallel ranks.
struct LossSums {
  double loss_sum = 0.0;
  double num_tokens = 0.0;
};

struct ForwardBackwardArgs {
  int num_microbatches = 1;  // this data-parallel rank's
  int64_t micro_batch_size = 1;
  int64_t seq_length = 0;
  float loss_scale = 1.0f;
  bool forward_only = false;
  bool calculate_per_token_loss = false;  // Note [Per-token loss]
};

/// Checks a microbatch's ids on the host as the embedding and cross-entropy kernels do on the
/// device (same messages): token ids and labels in [0, vocab_rows), position ids in
/// [0, position_rows) when position_rows > 0.
void check_batch_ids(const MicroBatch& batch, int64_t vocab_rows, int64_t position_rows);

/// Note [One wait per step]: the eager step copies its microbatches to the device and checks their
/// ids on the host before the first forward (HostCheckedIds), and reads the loss sums back once at
/// the end: nothing in between waits for the device (with PP = 1; the pipeline's exchanges wait for
/// their peers).

/// The same over microbatches already pulled (one per microbatch).
LossSums forward_backward(Context& ctx, ParallelState* ps, const std::vector<const ModelChunk*>& chunks,
                          const ForwardStepFunc& forward_step, std::vector<MicroBatch> batches,
                          const ForwardBackwardArgs& args, DistributedDataParallel* ddp = nullptr);

/// check_batch_ids with the model's table sizes (ModelChunk::input_ranges), then the batch's tensors on `device`.
MicroBatch checked_on_device(const MicroBatch& b, const ModelChunk& model, Device device);

/// Enqueues one step's work over `batches` (one per microbatch) without reading anything back:
/// the last stage writes microbatch j's {Σ loss·mask, Σ mask} into sums [M, 2] (fp32, on the
/// context's device) and scales its loss gradient by loss_scale [1] (fp32, on the device: the loss
/// scale over the number of microbatches) divided by that token count. With PP = 1 nothing in it
/// waits for the device, so it can be captured into a CUDA graph (core/full_cuda_graph.h).
void schedule_forward_backward(Context& ctx, ParallelState* ps, const std::vector<const ModelChunk*>& chunks,
                               const ForwardStepFunc& forward_step, const std::vector<MicroBatch>& batches,
                               const ForwardBackwardArgs& args, const Tensor& loss_scale, Tensor& sums,
                               DistributedDataParallel* ddp = nullptr);
/// The scalar schedule_forward_backward scales the loss gradient by, loss_scale / M, on `device`;
/// with calculate_per_token_loss {loss_scale, 1} (Note [Per-token loss]).
Tensor loss_scale_tensor(const ForwardBackwardArgs& args, Device device);
/// Reads sums [M, 2] back (the one wait of a step) and sums it over microbatches, then over the
/// data-parallel ranks; zeros on a rank without the last stage.
LossSums collect_loss_sums(Context& ctx, ParallelState* ps, const std::vector<const ModelChunk*>& chunks,
                           const Tensor& sums);

/// Runs one step's microbatches through this rank's model chunks (`chunks`, in virtual-stage order)
/// with the schedule the layout calls for. Every rank pulls num_microbatches batches from `data`.
/// `ps` null: one process. `ddp` may be null (no gradient reduction).
LossSums forward_backward(Context& ctx, ParallelState* ps, const std::vector<const ModelChunk*>& chunks,
                          const ForwardStepFunc& forward_step, BatchIterator& data, const ForwardBackwardArgs& args,
                          DistributedDataParallel* ddp = nullptr);

}  // namespace megatron
