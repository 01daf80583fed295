#include "megatron/core/transformer/transformer_layer.h"

#include "megatron/core/tensor_parallel/random.h"
#include "megatron/kernels/ops.h"

namespace megatron {

TransformerLayer::TransformerLayer(const TransformerConfig& config, ParamAndGradBuffer& params,
                                   const std::string& prefix, const ParallelState* ps)
    : hidden_dropout_(config.hidden_dropout),
      sequence_parallel_(ps && ps->tp_size() > 1 && ps->sequence_parallel()),
      ps_(ps),
      input_layernorm_(config, params, prefix + ".input_layernorm", ps),
      self_attention_(config, params, prefix + ".self_attention", ps),
      pre_mlp_layernorm_(config, params, prefix + ".pre_mlp_layernorm", ps),
      mlp_(config, params, prefix + ".mlp", ps) {}

Tensor TransformerLayer::forward(Context& ctx, const Tensor& x, const Tensor& freqs, uint64_t rng_base,
                                 bool keep_core_attention, Saved& saved) const {
  const int64_t s = x.size(0), b = x.size(1), h = x.size(2);
  saved.rng_base = rng_base;
  Tensor h1 = input_layernorm_.forward(ctx, x.view({s * b, h}), saved.input_norm).view({s, b, h});
  Tensor attn = self_attention_.forward(ctx, h1, freqs, rng_base, keep_core_attention, saved.attention);
  Tensor x2 = Tensor::empty(x.shape(), x.dtype(), ctx.device());
  ops::dropout_add_forward(ctx, attn, x, hidden_dropout_, tensor_parallel::region_seed(ctx, ps_, sequence_parallel_), rng_base + 1, x2);
  Tensor h2 = pre_mlp_layernorm_.forward(ctx, x2.view({s * b, h}), saved.pre_mlp_norm);
  Tensor mlp_out = mlp_.forward(ctx, h2, saved.mlp);
  Tensor out = Tensor::empty(x.shape(), x.dtype(), ctx.device());
  ops::dropout_add_forward(ctx, mlp_out.view({s, b, h}), x2, hidden_dropout_, tensor_parallel::region_seed(ctx, ps_, sequence_parallel_), rng_base + 2, out);
  return out;
}

Tensor TransformerLayer::backward(Context& ctx, const Tensor& grad_out, const Tensor& freqs, Saved& saved) const {
  const int64_t s = grad_out.size(0), b = grad_out.size(1), h = grad_out.size(2);
  const DType dt = grad_out.dtype();
  // out = x2 + dropout(mlp(norm2(x2)))
  Tensor grad_mlp = Tensor::empty({s * b, h}, dt, ctx.device());
  ops::dropout_backward(ctx, grad_out.view({s * b, h}), hidden_dropout_, tensor_parallel::region_seed(ctx, ps_, sequence_parallel_), saved.rng_base + 2, grad_mlp);
  Tensor grad_h2 = mlp_.backward(ctx, grad_mlp, saved.mlp);
  Tensor grad_x2 = pre_mlp_layernorm_.backward(ctx, grad_h2, saved.pre_mlp_norm).view({s, b, h});
  ops::add(ctx, grad_x2, grad_out, grad_x2);
  // x2 = x + dropout(attention(norm1(x)))
  Tensor grad_attn = Tensor::empty({s, b, h}, dt, ctx.device());
  ops::dropout_backward(ctx, grad_x2, hidden_dropout_, tensor_parallel::region_seed(ctx, ps_, sequence_parallel_), saved.rng_base + 1, grad_attn);
  Tensor grad_h1 = self_attention_.backward(ctx, grad_attn, freqs, saved.attention);
  Tensor grad_x = input_layernorm_.backward(ctx, grad_h1.view({s * b, h}), saved.input_norm).view({s, b, h});
  ops::add(ctx, grad_x, grad_x2, grad_x);
  return grad_x;
}

// ---- inference ---------------------------------------------------------------------------------

Tensor TransformerLayer::forward_inference(Context& ctx, const Tensor& x, const Tensor& freqs, const Tensor& slots,
                                           const Tensor& starts, Tensor& k_cache, Tensor& v_cache) const {
  const int64_t s = x.size(0), b = x.size(1), h = x.size(2);
  Norm::Saved norm_saved;
  MLP::Saved mlp_saved;
  Tensor h1 = input_layernorm_.forward(ctx, x.view({s * b, h}), norm_saved).view({s, b, h});
  Tensor attn = self_attention_.forward_inference(ctx, h1, freqs, slots, starts, k_cache, v_cache);
  Tensor x2 = Tensor::empty(x.shape(), x.dtype(), ctx.device());
  ops::add(ctx, attn, x, x2);
  Tensor h2 = pre_mlp_layernorm_.forward(ctx, x2.view({s * b, h}), norm_saved);
  Tensor mlp_out = mlp_.forward(ctx, h2, mlp_saved);
  Tensor out = Tensor::empty(x.shape(), x.dtype(), ctx.device());
  ops::add(ctx, mlp_out.view({s, b, h}), x2, out);
  return out;
}

}  // namespace megatron
