#include "megatron/core/transformer/transformer_layer.h"

#include "megatron/core/tensor_parallel/random.h"
#include "megatron/kernels/ops.h"

namespace megatron {

namespace {
// The modules a spec names (the one place that maps spec kinds to module types).
TransformerLayer::Mixer make_mixer(const TransformerConfig& config, const MixerSpec& spec, ParamAndGradBuffer& params,
                                   const std::string& prefix, const ProcessGroupCollection& pg) {
  switch (spec.kind) {
    case MixerKind::SelfAttention:
      return TransformerLayer::Mixer(std::in_place_type<SelfAttention>, config, spec, params,
                                     prefix + ".self_attention", pg);
    case MixerKind::MLA:
      return TransformerLayer::Mixer(std::in_place_type<MLASelfAttention>, config, spec, params,
                                     prefix + ".self_attention", pg);
  }
  MG_CHECK(false, "unknown mixer kind {}", int(spec.kind));
  __builtin_unreachable();
}

TransformerLayer::Mlp make_mlp(const TransformerConfig& config, const MlpSpec& spec, ParamAndGradBuffer& params,
                               const std::string& prefix, const ProcessGroupCollection& pg, int layer_number) {
  switch (spec.kind) {
    case MlpKind::Dense:
      return TransformerLayer::Mlp(std::in_place_type<MLP>, config, spec, params, prefix + ".mlp", pg);
    case MlpKind::MoE: {
      moe::MoEConfig m = moe::moe_config(config);
      if (spec.ffn_hidden_size > 0) m.ffn_hidden_size = spec.ffn_hidden_size;
      return TransformerLayer::Mlp(std::in_place_type<moe::MoELayer>, config, m, params, prefix + ".mlp",
                                   layer_number, pg);
    }
  }
  MG_CHECK(false, "unknown MLP kind {}", int(spec.kind));
  __builtin_unreachable();
}

// The alternative of `saved` that matches the module `m` (emplaced fresh in forward, read in backward).
template <class Module, class SavedVariant>
typename Module::Saved& fresh_saved(SavedVariant& saved) {
  return saved.template emplace<typename Module::Saved>();
}
template <class Module, class SavedVariant>
typename Module::Saved& saved_of(SavedVariant& saved) {
  auto* s = std::get_if<typename Module::Saved>(&saved);
  MG_ASSERT(s, "backward of a layer whose saved activations are of another module kind");
  return *s;
}
}  // namespace

TransformerLayer::TransformerLayer(const TransformerConfig& config, const TransformerLayerSpec& spec,
                                   ParamAndGradBuffer& params, const std::string& prefix,
                                   const ProcessGroupCollection& pg, int layer_number)
    : hidden_dropout_(config.hidden_dropout),
      sequence_parallel_(group_size(pg.tp) > 1 && config.sequence_parallel),
      per_token_loss_(config.calculate_per_token_loss),
      tp_(multi_rank(pg.tp)),
      input_layernorm_(config, spec.input_layernorm, params, prefix + ".input_layernorm", pg),
      mixer_(make_mixer(config, spec.mixer, params, prefix, pg)),
      pre_mlp_layernorm_(config, spec.pre_mlp_layernorm, params, prefix + ".pre_mlp_layernorm", pg),
      mlp_(make_mlp(config, spec.mlp, params, prefix, pg, layer_number)) {
  if (!spec.fp8) return;
  // Note [FP8 layers]: the attention's and the MLP's linear layers — a dense MLP's, or an MoE
  // layer's experts and shared experts (the router stays out).
  std::visit([&](auto& m) { m.enable_fp8(config.fp8, params.device(), fp8_linears_); }, mixer_);
  if (MLP* mlp = std::get_if<MLP>(&mlp_)) mlp->enable_fp8(config.fp8, params.device(), fp8_linears_);
  if (moe::MoELayer* m = moe()) m->enable_fp8(config.fp8, params.device(), fp8_linears_, fp8_expert_linears_);
}

Tensor TransformerLayer::mixer_forward(Context& ctx, const Tensor& x, const AttentionInputs& in, uint64_t offset,
                                       bool keep_core, MixerSaved& saved) const {
  return std::visit(
      [&](const auto& m) {
        return m.forward(ctx, x, in, offset, keep_core, fresh_saved<std::decay_t<decltype(m)>>(saved));
      },
      mixer_);
}

Tensor TransformerLayer::mixer_backward(Context& ctx, const Tensor& grad, const AttentionInputs& in,
                                        MixerSaved& saved) const {
  return std::visit(
      [&](const auto& m) { return m.backward(ctx, grad, in, saved_of<std::decay_t<decltype(m)>>(saved)); }, mixer_);
}

// x [s·b, h]; an MoE layer routes the s·b tokens (sequence-major) and reports its losses.
Tensor TransformerLayer::mlp_forward(Context& ctx, const Tensor& x, int64_t s, int64_t b, AuxLossTracker* aux_losses,
                                     bool report, bool training, uint64_t rng_base, MlpSaved& saved) const {
  return std::visit(
      [&](const auto& m) {
        using M = std::decay_t<decltype(m)>;
        auto& ms = fresh_saved<M>(saved);
        if constexpr (std::is_same_v<M, moe::MoELayer>) {
          ms.aux_loss_scale = aux_losses ? aux_losses->backward_scale() : 1.0f;
          // Megatron's router with calculate_per_token_loss: the load-balancing and z losses enter
          // the gradient times the router's tokens (this rank's), which finalize_model_grads' division
          // by the global batch's tokens turns back into about 1 / (microbatches · dp).
          if (per_token_loss_) ms.aux_loss_scale *= float(x.size(0));
          const bool reports = report && aux_losses && !aux_losses->evaluating();
          return m.forward(ctx, x, s, b, reports ? aux_losses : nullptr, ms, training, rng_base);
        } else {
          return m.forward(ctx, x, ms);
        }
      },
      mlp_);
}

Tensor TransformerLayer::mlp_backward(Context& ctx, const Tensor& grad, MlpSaved& saved) const {
  return std::visit(
      [&](const auto& m) {
        using M = std::decay_t<decltype(m)>;
        auto& ms = saved_of<M>(saved);
        if constexpr (std::is_same_v<M, moe::MoELayer>) {
          return m.backward(ctx, grad, ms, ms.aux_loss_scale);
        } else {
          return m.backward(ctx, grad, ms);
        }
      },
      mlp_);
}

Tensor TransformerLayer::forward(Context& ctx, const Tensor& x, const AttentionInputs& in, uint64_t rng_base,
                                 bool keep_core_attention, Saved& saved, AuxLossTracker* aux_losses,
                                 bool report_aux_losses) const {
  const int64_t s = x.size(0), b = x.size(1), h = x.size(2);
  saved.rng_base = rng_base;
  Tensor h1 = input_layernorm_.forward(ctx, x.view({s * b, h}), saved.input_norm).view({s, b, h});
  Tensor attn = mixer_forward(ctx, h1, in, rng_base, keep_core_attention, saved.mixer);
  Tensor x2 = Tensor::empty(x.shape(), x.dtype(), ctx.device());
  ops::dropout_add_forward(ctx, attn, x, hidden_dropout_, tensor_parallel::region_seed(ctx, tp_, sequence_parallel_), rng_base + 1, x2);
  Tensor h2 = pre_mlp_layernorm_.forward(ctx, x2.view({s * b, h}), saved.pre_mlp_norm);
  const bool training = !(aux_losses && aux_losses->evaluating());
  Tensor mlp_out = mlp_forward(ctx, h2, s, b, aux_losses, report_aux_losses, training, rng_base, saved.mlp);
  Tensor out = Tensor::empty(x.shape(), x.dtype(), ctx.device());
  ops::dropout_add_forward(ctx, mlp_out.view({s, b, h}), x2, hidden_dropout_, tensor_parallel::region_seed(ctx, tp_, sequence_parallel_), rng_base + 2, out);
  return out;
}

Tensor TransformerLayer::backward(Context& ctx, const Tensor& grad_out, const AttentionInputs& in, Saved& saved) const {
  const int64_t s = grad_out.size(0), b = grad_out.size(1), h = grad_out.size(2);
  const DType dt = grad_out.dtype();
  // out = x2 + dropout(mlp(norm2(x2)))
  Tensor grad_mlp = Tensor::empty({s * b, h}, dt, ctx.device());
  ops::dropout_backward(ctx, grad_out.view({s * b, h}), hidden_dropout_, tensor_parallel::region_seed(ctx, tp_, sequence_parallel_), saved.rng_base + 2, grad_mlp);
  Tensor grad_h2 = mlp_backward(ctx, grad_mlp, saved.mlp);
  Tensor grad_x2 = pre_mlp_layernorm_.backward(ctx, grad_h2, saved.pre_mlp_norm).view({s, b, h});
  ops::add(ctx, grad_x2, grad_out, grad_x2);
  // x2 = x + dropout(attention(norm1(x)))
  Tensor grad_attn = Tensor::empty({s, b, h}, dt, ctx.device());
  ops::dropout_backward(ctx, grad_x2, hidden_dropout_, tensor_parallel::region_seed(ctx, tp_, sequence_parallel_), saved.rng_base + 1, grad_attn);
  Tensor grad_h1 = mixer_backward(ctx, grad_attn, in, saved.mixer);
  Tensor grad_x = input_layernorm_.backward(ctx, grad_h1.view({s * b, h}), saved.input_norm).view({s, b, h});
  ops::add(ctx, grad_x, grad_x2, grad_x);
  return grad_x;
}

// ---- inference ---------------------------------------------------------------------------------

Tensor TransformerLayer::forward_inference(Context& ctx, const Tensor& x, const Tensor& freqs, const CacheRows& rows,
                                           Tensor& k_cache, Tensor& v_cache) const {
  const int64_t s = x.size(0), b = x.size(1), h = x.size(2);
  Norm::Saved norm_saved;
  MlpSaved mlp_saved;
  Tensor h1 = input_layernorm_.forward(ctx, x.view({s * b, h}), norm_saved).view({s, b, h});
  Tensor attn = std::visit(
      [&](const auto& m) { return m.forward_inference(ctx, h1, freqs, rows, k_cache, v_cache); }, mixer_);
  Tensor x2 = Tensor::empty(x.shape(), x.dtype(), ctx.device());
  ops::add(ctx, attn, x, x2);
  Tensor h2 = pre_mlp_layernorm_.forward(ctx, x2.view({s * b, h}), norm_saved);
  Tensor mlp_out = mlp_forward(ctx, h2, s, b, nullptr, false, /*training=*/false, 0, mlp_saved);
  Tensor out = Tensor::empty(x.shape(), x.dtype(), ctx.device());
  ops::add(ctx, mlp_out.view({s, b, h}), x2, out);
  return out;
}

}  // namespace megatron
