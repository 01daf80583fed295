#include "megatron/core/models/common/embeddings/language_model_embedding.h"

#include "megatron/core/tensor_parallel/layers.h"
#include "megatron/core/tensor_parallel/mappings.h"
#include "megatron/core/tensor_parallel/random.h"
#include "megatron/kernels/ops.h"

namespace megatron {

LanguageModelEmbedding::LanguageModelEmbedding(const TransformerConfig& config, ParamAndGradBuffer& params,
                                               const std::string& prefix, const ProcessGroupCollection& pg)
    : hidden_(config.hidden_size),
      vocab_size_(config.padded_vocab_size),
      dropout_p_(config.hidden_dropout),
      dtype_(config.params_dtype),
      tp_(multi_rank(pg.tp)),
      sequence_parallel_(tp_ && config.sequence_parallel) {
  word_ = params.add(prefix + ".word_embeddings.weight",
                     tp_shard({config.padded_vocab_size, config.hidden_size}, 0, tp_), /*no_weight_decay=*/false,
                     ParamInit::Normal);
  if (config.use_learned_positions()) {
    position_ = params.add(prefix + ".position_embeddings.weight", {config.max_position_embeddings, config.hidden_size},
                           /*no_weight_decay=*/false, ParamInit::Normal);
    position_->tp_duplicate = tp_ != nullptr;
    position_->sequence_parallel = sequence_parallel_;
  }
}

Tensor LanguageModelEmbedding::forward(Context& ctx, const Tensor& tokens, const Tensor& position_ids,
                                       uint64_t dropout_offset, Saved& saved) const {
  const int64_t b = tokens.size(0), s = tokens.size(1);
  saved.tokens = tokens;
  saved.position_ids = position_ ? position_ids : Tensor();
  saved.dropout_offset = dropout_offset;
  Tensor out = Tensor::empty({s, b, hidden_}, dtype_, ctx.device());
  if (!tp_) {
    ops::embedding_forward(ctx, tokens, saved.position_ids, word_->data, position_ ? position_->data : Tensor(), out);
    ops::dropout_forward(ctx, out, dropout_p_, ctx.rng().seed, saved.dropout_offset, out);
    return out;
  }
  Communicator& tp = *tp_;
  const bool sp = sequence_parallel_;
  ops::vocab_parallel_embedding_forward(ctx, tokens, word_->data, word_->data.size(0) * tp.rank(), vocab_size_, out);
  if (sp) {
    out = tensor_parallel::reduce_scatter_sequence(ctx, tp, out);
  } else {
    tensor_parallel::all_reduce_(ctx, tp, out);
  }
  if (position_) {  // the whole sequence's positions, then this rank's rows of them
    Tensor pos = Tensor::empty({s, b, hidden_}, dtype_, ctx.device());
    ops::embedding_forward(ctx, saved.position_ids, Tensor(), position_->data, Tensor(), pos);
    Tensor mine = sp ? tensor_parallel::split_sequence(tp, pos) : pos;
    ops::add(ctx, out, mine, out);
  }
  ops::dropout_forward(ctx, out, dropout_p_, tensor_parallel::region_seed(ctx, tp_, sp), saved.dropout_offset, out);
  return out;
}

void LanguageModelEmbedding::backward(Context& ctx, const Tensor& grad_out, const Saved& saved) const {
  Tensor grad = Tensor::empty(grad_out.shape(), grad_out.dtype(), ctx.device());
  Tensor no_grad;
  if (!tp_) {
    ops::dropout_backward(ctx, grad_out, dropout_p_, ctx.rng().seed, saved.dropout_offset, grad);
    ops::embedding_backward(ctx, saved.tokens, saved.position_ids, grad, word_->main_grad,
                            position_ ? position_->main_grad : no_grad);
  } else {
    Communicator& tp = *tp_;
    const bool sp = sequence_parallel_;
    ops::dropout_backward(ctx, grad_out, dropout_p_, tensor_parallel::region_seed(ctx, tp_, sp), saved.dropout_offset,
                          grad);
    if (position_) {
      // Under sequence parallelism this rank's rows of the position gradient (zeros elsewhere); the
      // partial sums are all-reduced over the group with the other sequence-parallel gradients.
      Tensor g = grad;
      if (sp) {
        g = Tensor::zeros({grad.size(0) * tp.size(), grad.size(1), grad.size(2)}, grad.dtype(), ctx.device());
        Tensor mine = tensor_parallel::split_sequence(tp, g);
        mine.copy_from(grad);
      }
      ops::embedding_backward(ctx, saved.position_ids, Tensor(), g, position_->main_grad, no_grad);
    }
    const Tensor g_full = sp ? tensor_parallel::all_gather_sequence(ctx, tp, grad) : grad;
    ops::vocab_parallel_embedding_backward(ctx, saved.tokens, g_full, word_->data.size(0) * tp.rank(),
                                           word_->main_grad);
  }
  notify_grad_accumulated(ctx, word_);
  notify_grad_accumulated(ctx, position_);
}

}  // namespace megatron
