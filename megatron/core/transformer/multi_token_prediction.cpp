#include "megatron/core/transformer/multi_token_prediction.h"

#include "megatron/core/tensor_parallel/mappings.h"
#include "megatron/kernels/ops.h"

namespace megatron {

namespace {

// [a; b] along the hidden dimension (torch.cat((a, b), -1)): out [N, 2h] viewed as [N, 2, h] is
// the transpose of the two stacked [2, N, h].
Tensor concat_hidden(Context& ctx, const Tensor& a, const Tensor& b) {
  const int64_t n = a.size(0), h = a.size(1);
  Tensor stacked = Tensor::empty({2 * n, h}, a.dtype(), ctx.device());
  ops::copy_rows(ctx, a, 0, stacked, 0, n);
  ops::copy_rows(ctx, b, 0, stacked, n, n);
  Tensor out = Tensor::empty({n, 2, h}, a.dtype(), ctx.device());
  ops::transpose_01(ctx, stacked.view({2, n, h}), out);
  return out.view({n, 2 * h});
}

// concat_hidden's backward: the gradient [N, 2h] split into those of a and b.
std::pair<Tensor, Tensor> split_hidden(Context& ctx, const Tensor& grad) {
  const int64_t n = grad.size(0), h = grad.size(1) / 2;
  Tensor stacked = Tensor::empty({2, n, h}, grad.dtype(), ctx.device());
  ops::transpose_01(ctx, grad.view({n, 2, h}), stacked);
  return {stacked.flat_slice(0, n * h).view({n, h}), stacked.flat_slice(n * h, n * h).view({n, h})};
}

// Megatron's gather_from_tensor_model_parallel_region: y [N, h/tp] of every rank -> [N, h], the
// ranks' column blocks side by side (the all-gather stacks them as [tp, N, h/tp]).
Tensor gather_hidden(Context& ctx, Communicator& tp, const Tensor& y) {
  const int64_t n = y.size(0), hl = y.size(1), t = tp.size();
  Tensor all = tensor_parallel::all_gather_sequence(ctx, tp, y);
  Tensor out = Tensor::empty({n, t, hl}, y.dtype(), ctx.device());
  ops::transpose_01(ctx, all.view({t, n, hl}), out);
  return out.view({n, t * hl});
}

// gather_hidden's backward: this rank's column block of the gradient [N, h].
Tensor split_hidden_columns(Context& ctx, Communicator& tp, const Tensor& grad) {
  const int64_t n = grad.size(0), t = tp.size(), hl = grad.size(1) / t;
  Tensor blocks = Tensor::empty({t, n, hl}, grad.dtype(), ctx.device());
  ops::transpose_01(ctx, grad.view({n, t, hl}), blocks);
  return blocks.flat_slice(int64_t(tp.rank()) * n * hl, n * hl).view({n, hl});
}

}  // namespace

MultiTokenPredictionLayer::MultiTokenPredictionLayer(const TransformerConfig& config, const TransformerLayerSpec& spec,
                                                     ParamAndGradBuffer& params, const std::string& prefix,
                                                     const ProcessGroupCollection& pg, int layer_number)
    : hidden_(config.hidden_size),
      tp_(multi_rank(pg.tp)),
      sequence_parallel_(tp_ && config.sequence_parallel),
      enorm_(config, spec.input_layernorm, params, prefix + ".enorm", pg),
      hnorm_(config, spec.input_layernorm, params, prefix + ".hnorm", pg),
      eh_proj_(params, prefix + ".eh_proj", 2 * config.hidden_size, config.hidden_size, /*bias=*/false,
               ParamInit::Normal, ParallelMode::Column, pg.tp, config.sequence_parallel),
      layer_(config, spec, params, prefix + ".transformer_layer", pg, layer_number),
      final_layernorm_(config, spec.input_layernorm, params, prefix + ".final_layernorm", pg) {}

Tensor MultiTokenPredictionLayer::forward(Context& ctx, const Tensor& embedding, const Tensor& hidden,
                                          const AttentionInputs& in, uint64_t rng_base, Saved& saved,
                                          AuxLossTracker* aux_losses) const {
  const int64_t s = hidden.size(0), b = hidden.size(1), h = hidden_;
  MG_ASSERT(embedding.shape() == hidden.shape(), "MTP embedding {} and hidden states {}", embedding.str(), hidden.str());
  // Megatron's _concat_embeddings: [enorm(embedding); hnorm(hidden)], then eh_proj.
  Tensor e = enorm_.forward(ctx, embedding.view({s * b, h}), saved.enorm);
  Tensor g = hnorm_.forward(ctx, hidden.view({s * b, h}), saved.hnorm);
  saved.proj_in = concat_hidden(ctx, e, g);
  Tensor x = eh_proj_.forward(ctx, saved.proj_in);  // [N, h/tp] (N: the whole sequence's rows under SP)
  if (tp_) {
    x = gather_hidden(ctx, *tp_, x);
    if (sequence_parallel_) x = tensor_parallel::split_sequence(*tp_, x);
  }
  // Note [MTP layer recomputation]
  Tensor y = layer_.forward(ctx, x.view({s, b, h}), in, rng_base, /*keep_core_attention=*/true, saved.layer,
                            aux_losses);
  return final_layernorm_.forward(ctx, y.view({s * b, h}), saved.final_norm).view({s, b, h});
}

std::pair<Tensor, Tensor> MultiTokenPredictionLayer::backward(Context& ctx, const Tensor& grad_out,
                                                              const AttentionInputs& in, Saved& saved) const {
  const int64_t s = grad_out.size(0), b = grad_out.size(1), h = hidden_;
  Tensor grad_y = final_layernorm_.backward(ctx, grad_out.view({s * b, h}), saved.final_norm);
  Tensor grad_x = layer_.backward(ctx, grad_y.view({s, b, h}), in, saved.layer).view({s * b, h});
  if (tp_) {
    // scatter_to_sequence_parallel_region's backward gathers the sequence, the hidden gather's
    // takes this rank's columns.
    if (sequence_parallel_) grad_x = tensor_parallel::all_gather_sequence(ctx, *tp_, grad_x);
    grad_x = split_hidden_columns(ctx, *tp_, grad_x);
  }
  Tensor grad_in = eh_proj_.backward(ctx, grad_x, saved.proj_in);
  auto [grad_e, grad_g] = split_hidden(ctx, grad_in);
  Tensor grad_embedding = enorm_.backward(ctx, grad_e, saved.enorm).view({s, b, h});
  Tensor grad_hidden = hnorm_.backward(ctx, grad_g, saved.hnorm).view({s, b, h});
  saved = Saved{};
  return {grad_embedding, grad_hidden};
}

Tensor roll_sequence_left(Context& ctx, const Tensor& x) {
  const int64_t s = x.size(0);
  Tensor out = Tensor::zeros(x.shape(), x.dtype(), ctx.device());
  if (s > 1) ops::copy_rows(ctx, x, 1, out, 0, s - 1);
  return out;
}

Tensor roll_tokens_left(Context& ctx, const Tensor& ids) {
  MG_ASSERT(ids.dim() == 2, "ids {}", ids.str());
  const int64_t b = ids.size(0), s = ids.size(1);
  Tensor sb = Tensor::empty({s, b}, ids.dtype(), ctx.device());
  ops::transpose_01(ctx, ids, sb);
  Tensor rolled = roll_sequence_left(ctx, sb);
  Tensor out = Tensor::empty({b, s}, ids.dtype(), ctx.device());
  ops::transpose_01(ctx, rolled, out);
  return out;
}

}  // namespace megatron
