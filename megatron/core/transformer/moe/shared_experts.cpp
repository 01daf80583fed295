#include "megatron/core/transformer/moe/shared_experts.h"

#include <cmath>

#include "megatron/kernels/ops.h"

namespace megatron::moe {

namespace {
MlpSpec shared_spec(const TransformerConfig& config, int64_t intermediate_size) {
  MG_CHECK(intermediate_size > 0, "--moe-shared-expert-intermediate-size must be positive, got {}",
           intermediate_size);
  MG_CHECK(!config.add_bias_linear,
           "the shared experts have no biases (as in Megatron): use --disable-bias-linear with "
           "--moe-shared-expert-intermediate-size");
  MlpSpec spec;
  spec.ffn_hidden_size = int(intermediate_size);
  return spec;
}

// out[n, :] = s[n] · x[n, :] in fp32, rounded to x's dtype (s: fp32 [N] on x's device).
Tensor scale_rows(Context& ctx, const Tensor& x, const Tensor& s) {
  Tensor out = Tensor::empty(x.shape(), x.dtype(), ctx.device());
  ops::moe_scale_rows_forward(ctx, x, s, out);
  return out;
}
}  // namespace

SharedExpertMLP::SharedExpertMLP(const TransformerConfig& config, int64_t intermediate_size, bool gate,
                                 ParamAndGradBuffer& params, const std::string& prefix,
                                 const ProcessGroupCollection& pg)
    : mlp_(config, shared_spec(config, intermediate_size), params, prefix, pg) {
  if (!gate) return;
  gate_weight_ = params.add(prefix + ".gate_weight", {1, config.hidden_size}, /*no_weight_decay=*/false,
                            ParamInit::Normal);  // Megatron's config.init_method
  const bool tp = group_size(pg.tp) > 1;
  gate_weight_->tp_duplicate = tp;
  gate_weight_->sequence_parallel = tp && config.sequence_parallel;
}

Tensor SharedExpertMLP::forward(Context& ctx, const Tensor& x, Saved& saved) const {
  if (!gate_weight_) return mlp_.forward(ctx, x, saved.mlp);
  // The gate's sigmoid is host code: its logits are read back before the MLP is enqueued, so the
  // host waits for one [N, h] x [h, 1] GEMM, not for the MLP (Note [Shared experts on a side stream]).
  Tensor logits = Tensor::empty({x.size(0), 1}, x.dtype(), ctx.device());
  ops::linear_forward(ctx, x, gate_weight_->data, Tensor(), logits);
  std::vector<float> s = logits.to_floats();
  for (float& v : s) v = 1.0f / (1.0f + std::exp(-v));
  saved.score = Tensor::from_floats(s, {x.size(0)}).to(ctx.device());
  Tensor out = mlp_.forward(ctx, x, saved.mlp);
  saved.x = x;
  saved.mlp_out = out;
  return scale_rows(ctx, out, saved.score);
}

Tensor SharedExpertMLP::backward(Context& ctx, const Tensor& grad_out, Saved& saved) const {
  if (!gate_weight_) {
    Tensor grad_x = mlp_.backward(ctx, grad_out, saved.mlp);
    saved = Saved{};
    return grad_x;
  }
  const int64_t n = grad_out.size(0), h = grad_out.size(1);
  const std::vector<float> s = saved.score.to_floats(), g = grad_out.to_floats(), m = saved.mlp_out.to_floats();
  std::vector<float> dlogit(static_cast<size_t>(n));
  for (int64_t r = 0; r < n; ++r) {
    double dot = 0;
    for (int64_t c = 0; c < h; ++c) dot += double(g[size_t(r * h + c)]) * m[size_t(r * h + c)];
    const float sr = s[size_t(r)];
    dlogit[size_t(r)] = float(dot) * sr * (1.0f - sr);
  }
  // Copied to the device before the MLP's backward is enqueued: the copy waits for its stream.
  const Tensor grad_logits = Tensor::from_floats(dlogit, {n, 1}, grad_out.dtype()).to(ctx.device());
  Tensor grad_x = mlp_.backward(ctx, scale_rows(ctx, grad_out, saved.score), saved.mlp);
  Tensor grad_x_gate = Tensor::empty(saved.x.shape(), saved.x.dtype(), ctx.device()), no_bias;
  ops::linear_backward(ctx, grad_logits, saved.x, gate_weight_->data, grad_x_gate, gate_weight_->main_grad, no_bias);
  notify_grad_accumulated(ctx, gate_weight_);
  ops::add(ctx, grad_x, grad_x_gate, grad_x);
  saved = Saved{};
  return grad_x;
}

}  // namespace megatron::moe
