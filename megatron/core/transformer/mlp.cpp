#include "megatron/core/transformer/mlp.h"

#include <limits>
#include <optional>

#include "megatron/kernels/ops.h"

namespace megatron {

MlpActivation MlpActivation::from_config(const TransformerConfig& config) {
  MlpActivation a;
  if (config.quick_geglu()) {
    a.kind = Kind::QuickGeglu;
    a.limit = config.activation_func_clamp_value > 0.0f ? config.activation_func_clamp_value
                                                         : std::numeric_limits<float>::infinity();
    a.linear_offset = config.glu_linear_offset;
  } else if (config.gated_linear_unit) {
    a.kind = Kind::Swiglu;
  }
  return a;
}

void MlpActivation::forward(Context& ctx, const Tensor& fc1, Tensor& out) const {
  switch (kind) {
    case Kind::Gelu: ops::gelu_forward(ctx, fc1, out); return;
    case Kind::Swiglu: ops::swiglu_forward(ctx, fc1, out); return;
    case Kind::QuickGeglu: ops::quick_geglu_forward(ctx, fc1, alpha, limit, linear_offset, out); return;
  }
}

void MlpActivation::backward(Context& ctx, const Tensor& grad_out, const Tensor& fc1, Tensor& grad_fc1) const {
  switch (kind) {
    case Kind::Gelu: ops::gelu_backward(ctx, grad_out, fc1, grad_fc1); return;
    case Kind::Swiglu: ops::swiglu_backward(ctx, grad_out, fc1, grad_fc1); return;
    case Kind::QuickGeglu:
      ops::quick_geglu_backward(ctx, grad_out, fc1, alpha, limit, linear_offset, grad_fc1);
      return;
  }
}

namespace {
int64_t ffn_size(const TransformerConfig& config, const MlpSpec& spec, const ProcessGroupCollection& pg) {
  const int64_t ffn = spec.ffn_hidden_size > 0 ? spec.ffn_hidden_size : config.ffn_hidden_size;
  MG_CHECK(ffn % group_size(pg.tp) == 0,
           "the MLP's intermediate size {} must be divisible by --tensor-model-parallel-size ({})", ffn,
           group_size(pg.tp));
  return ffn;
}
}  // namespace

MLP::MLP(const TransformerConfig& config, const MlpSpec& spec, ParamAndGradBuffer& params, const std::string& prefix,
         const ProcessGroupCollection& pg)
    : act_(MlpActivation::from_config(config)),
      swiglu_(config.gated_linear_unit),
      ffn_(ffn_size(config, spec, pg) / group_size(pg.tp)),
      linear_fc1_(params, prefix + ".linear_fc1", config.hidden_size,
                  (config.gated_linear_unit ? 2 : 1) * ffn_size(config, spec, pg), config.add_bias_linear,
                  ParamInit::Normal, ParallelMode::Column, pg.tp, config.sequence_parallel,
                  config.gated_linear_unit ? 2 : 1),
      linear_fc2_(params, prefix + ".linear_fc2", ffn_size(config, spec, pg), config.hidden_size,
                  config.add_bias_linear, ParamInit::ScaledNormal, ParallelMode::Row, pg.tp,
                  config.sequence_parallel) {}

void MLP::enable_fp8(const Fp8Config& config, Device device, std::vector<Linear*>& fp8_linears) {
  for (Linear* l : {&linear_fc1_, &linear_fc2_}) {
    l->enable_fp8(config, device);
    fp8_linears.push_back(l);
  }
}

Tensor MLP::activation(Context& ctx, const Tensor& fc1) const {
  Tensor act = Tensor::empty({fc1.size(0), ffn_}, fc1.dtype(), ctx.device());
  act_.forward(ctx, fc1, act);
  return act;
}

// Note [Produced tensors]: SwiGLU's and GeLU's outputs and input gradients go to the linear layers
// as the passes that make them; QuickGeGLU's are computed here.
std::optional<Fp8Activation> MLP::produced_activation() const {
  if (act_.kind == MlpActivation::Kind::Swiglu) return Fp8Activation::Swiglu;
  if (act_.kind == MlpActivation::Kind::Gelu) return Fp8Activation::Gelu;
  return std::nullopt;
}

ProducedTensor MLP::fc2_input(Context& ctx, const Tensor& fc1) const {
  if (const auto a = produced_activation()) return ProducedTensor::activation(*a, fc1);
  return activation(ctx, fc1);
}

Tensor MLP::forward(Context& ctx, const Tensor& x, Saved& saved) const {
  saved.x = x;
  // GeLU in bf16 rides fc1's GEMM epilogue (Note [GeLU in the GEMM epilogue]); in FP8 it is a
  // produced tensor like SwiGLU's.
  if (!swiglu_ && !linear_fc1_.fp8()) return linear_fc2_.forward(ctx, linear_fc1_.forward_gelu(ctx, x, saved.fc1));
  saved.fc1 = linear_fc1_.forward(ctx, x);
  return linear_fc2_.forward(ctx, fc2_input(ctx, saved.fc1));
}

Tensor MLP::backward(Context& ctx, const Tensor& grad_out, const Saved& saved) const {
  // Note [Activation recomputed in backward]: the activation's output is not kept: fc2's weight
  // gradient needs it, and one elementwise pass recomputes it from fc1's output, saving an
  // [N, ffn] tensor per layer. With SwiGLU, and with GeLU in FP8, the activation and its gradient
  // are produced tensors (Note [Produced tensors]): fc2's FP8 layer makes its transposed input copy
  // straight from fc1's output, fc1's makes both copies of its output gradient inside the
  // activation's backward pass. GeLU in bf16: its gradient is applied inside fc2's input-gradient
  // GEMM (Note [GeLU in the GEMM epilogue]).
  if (!swiglu_ && !linear_fc1_.fp8()) {
    Tensor grad_fc1 = linear_fc2_.backward_through_gelu(ctx, grad_out, activation(ctx, saved.fc1), saved.fc1);
    return linear_fc1_.backward(ctx, grad_fc1, saved.x);
  }
  Tensor grad_act = linear_fc2_.backward(ctx, grad_out, fc2_input(ctx, saved.fc1));
  if (const auto a = produced_activation()) {
    return linear_fc1_.backward(ctx, ProducedTensor::activation_grad(*a, grad_act, saved.fc1), saved.x);
  }
  Tensor grad_fc1 = Tensor::empty(saved.fc1.shape(), saved.fc1.dtype(), ctx.device());
  act_.backward(ctx, grad_act, saved.fc1, grad_fc1);
  return linear_fc1_.backward(ctx, grad_fc1, saved.x);
}

}  // namespace megatron
