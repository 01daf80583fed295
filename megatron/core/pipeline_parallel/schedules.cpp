#include "megatron/core/pipeline_parallel/schedules.h"

#include "megatron/kernels/ops.h"

namespace megatron {

LossSums forward_backward_no_pipelining(Context& ctx, const GPTModel& model, const ForwardStepFunc& forward_step,
                                        BatchIterator& data, int num_microbatches, float loss_scale,
                                        bool forward_only) {
  LossSums total;
  Tensor sums = Tensor::empty({2}, DType::Float32, ctx.device());
  for (int mb = 0; mb < num_microbatches; ++mb) {
    GPTModel::Stash stash;
    ForwardOutput out = forward_step(ctx, data, model, stash);
    Tensor losses = out.losses.view({-1});
    Tensor mask = out.loss_mask.defined() ? out.loss_mask.view({-1}) : Tensor();
    ops::masked_loss_sums(ctx, losses, mask, sums);
    std::vector<float> host = sums.to_floats();
    total.loss_sum += host[0];
    total.num_tokens += host[1];
    if (forward_only) continue;
    // Megatron (calculate_per_token_loss off): each microbatch contributes its mean over its own
    // unmasked tokens, divided by the number of microbatches; the loss scale multiplies it (fp16).
    const float scale = host[1] > 0 ? loss_scale / (host[1] * float(num_microbatches)) : 0.0f;
    Tensor grad = Tensor::empty({losses.numel()}, DType::Float32, ctx.device());
    ops::masked_loss_backward(ctx, mask, scale, grad);
    model.backward(ctx, grad.view(out.losses.shape()), stash);
  }
  return total;
}

}  // namespace megatron
