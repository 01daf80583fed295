#include "megatron/core/models/common/embeddings/language_model_embedding.h"

#include "megatron/kernels/ops.h"

namespace megatron {

LanguageModelEmbedding::LanguageModelEmbedding(const TransformerConfig& config, ParamAndGradBuffer& params,
                                               const std::string& prefix)
    : hidden_(config.hidden_size), dropout_p_(config.hidden_dropout), dtype_(config.params_dtype) {
  word_ = params.add(prefix + ".word_embeddings.weight", {config.padded_vocab_size, config.hidden_size},
                     /*no_weight_decay=*/false, ParamInit::Normal);
  if (config.use_learned_positions()) {
    position_ = params.add(prefix + ".position_embeddings.weight", {config.max_position_embeddings, config.hidden_size},
                           /*no_weight_decay=*/false, ParamInit::Normal);
  }
}

Tensor LanguageModelEmbedding::forward(Context& ctx, const Tensor& tokens, const Tensor& position_ids,
                                       Saved& saved) const {
  const int64_t b = tokens.size(0), s = tokens.size(1);
  saved.tokens = tokens;
  saved.position_ids = position_ ? position_ids : Tensor();
  saved.dropout_offset = ctx.rng().next_offset();
  Tensor out = Tensor::empty({s, b, hidden_}, dtype_, ctx.device());
  ops::embedding_forward(ctx, tokens, saved.position_ids, word_->data, position_ ? position_->data : Tensor(), out);
  ops::dropout_forward(ctx, out, dropout_p_, ctx.rng().seed, saved.dropout_offset, out);
  return out;
}

void LanguageModelEmbedding::backward(Context& ctx, const Tensor& grad_out, const Saved& saved) const {
  Tensor grad = Tensor::empty(grad_out.shape(), grad_out.dtype(), ctx.device());
  ops::dropout_backward(ctx, grad_out, dropout_p_, ctx.rng().seed, saved.dropout_offset, grad);
  Tensor no_grad;
  ops::embedding_backward(ctx, saved.tokens, saved.position_ids, grad, word_->main_grad,
                          position_ ? position_->main_grad : no_grad);
}

}  // namespace megatron
