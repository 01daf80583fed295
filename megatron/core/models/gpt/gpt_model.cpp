#include "megatron/core/models/gpt/gpt_model.h"

#include <algorithm>

#include "megatron/kernels/ops.h"

namespace megatron {

namespace {
TransformerConfig finalized(TransformerConfig c) {
  c.finalize();
  return c;
}
}  // namespace

GPTModel::GPTModel(TransformerConfig config, Device device)
    : config_(finalized(std::move(config))),
      params_(std::make_unique<ParamAndGradBuffer>(config_.params_dtype, device)) {
  embedding_ = std::make_unique<LanguageModelEmbedding>(config_, *params_, "embedding");
  if (config_.use_rope()) rotary_.emplace(config_);
  decoder_ = std::make_unique<TransformerBlock>(config_, *params_, "decoder");
  if (config_.share_embeddings_and_output_weights) {
    output_layer_ = std::make_unique<Linear>(embedding_->word_embeddings());
  } else {
    output_layer_ = std::make_unique<Linear>(*params_, "output_layer", config_.hidden_size, config_.padded_vocab_size,
                                             /*bias=*/false, ParamInit::Normal);
  }
  params_->allocate();
}

void GPTModel::init_weights(uint64_t seed) {
  params_->init_weights(seed, config_.init_method_std, config_.num_layers, config_.layernorm_zero_centered_gamma);
}

void GPTModel::forward_to_logits(Context& ctx, const Tensor& tokens, const Tensor& position_ids, Stash& stash) const {
  MG_ASSERT(tokens.dim() == 2, "tokens {}", shape_str(tokens.shape()));
  const int64_t b = tokens.size(0), s = tokens.size(1), h = config_.hidden_size, v = config_.padded_vocab_size;
  if (config_.use_learned_positions()) {
    MG_CHECK(s <= config_.max_position_embeddings, "sequence length {} exceeds --max-position-embeddings {}", s,
             config_.max_position_embeddings);
  }
  Tensor positions = position_ids.defined() ? position_ids : default_position_ids(b, s);
  if (positions.device() != tokens.device()) positions = positions.to(tokens.device());
  Tensor x = embedding_->forward(ctx, tokens, positions, stash.embedding);
  if (rotary_) stash.freqs = rotary_->freqs(ctx, s);
  stash.hidden = decoder_->forward(ctx, x, stash.freqs, stash.decoder);
  stash.logits = output_layer_->forward(ctx, stash.hidden.view({s * b, h})).view({s, b, v});
}

Tensor GPTModel::forward_logits(Context& ctx, const Tensor& tokens, const Tensor& position_ids) const {
  Stash stash;
  forward_to_logits(ctx, tokens, position_ids, stash);
  return stash.logits;
}

Tensor GPTModel::forward(Context& ctx, const Tensor& tokens, const Tensor& position_ids, const Tensor& labels,
                         Stash& stash) const {
  MG_ASSERT(labels.shape() == tokens.shape(), "tokens {} labels {}", shape_str(tokens.shape()),
            shape_str(labels.shape()));
  const int64_t b = tokens.size(0), s = tokens.size(1), v = config_.padded_vocab_size;
  forward_to_logits(ctx, tokens, position_ids, stash);
  stash.labels = Tensor::empty({s, b}, labels.dtype(), ctx.device());
  ops::transpose_01(ctx, labels, stash.labels);
  Tensor losses_sb = Tensor::empty({s * b}, DType::Float32, ctx.device());
  stash.lse = Tensor::empty({s * b}, DType::Float32, ctx.device());
  ops::cross_entropy_forward(ctx, stash.logits.view({s * b, v}), stash.labels.view({s * b}), losses_sb, stash.lse);
  Tensor losses = Tensor::empty({b, s}, DType::Float32, ctx.device());
  ops::transpose_01(ctx, losses_sb.view({s, b}), losses);
  return losses;
}

void GPTModel::backward(Context& ctx, const Tensor& grad_losses, Stash& stash) const {
  const int64_t b = grad_losses.size(0), s = grad_losses.size(1), h = config_.hidden_size,
                v = config_.padded_vocab_size;
  Tensor grad_losses_sb = Tensor::empty({s, b}, DType::Float32, ctx.device());
  ops::transpose_01(ctx, grad_losses, grad_losses_sb);
  // The fused cross-entropy backward turns the logits into their own gradient in place.
  Tensor grad_logits = stash.logits.view({s * b, v});
  ops::cross_entropy_backward(ctx, grad_losses_sb.view({s * b}), grad_logits, stash.labels.view({s * b}), stash.lse,
                              grad_logits);
  Tensor grad_hidden = output_layer_->backward(ctx, grad_logits, stash.hidden.view({s * b, h})).view({s, b, h});
  stash.logits = stash.hidden = stash.lse = Tensor();
  Tensor grad_x = decoder_->backward(ctx, grad_hidden, stash.freqs, stash.decoder);
  embedding_->backward(ctx, grad_x, stash.embedding);
  stash = Stash{};
}

// ---- inference -----------------------------------------------------------------------------------

Tensor GPTModel::forward_inference(Context& ctx, const Tensor& tokens, const std::vector<int64_t>& slots,
                                   const std::vector<int64_t>& starts, KVCache& cache) const {
  MG_ASSERT(tokens.dim() == 2, "tokens {}", shape_str(tokens.shape()));
  const int64_t b = tokens.size(0), s = tokens.size(1), h = config_.hidden_size, v = config_.padded_vocab_size;
  MG_CHECK(int64_t(slots.size()) == b && int64_t(starts.size()) == b, "{} sequences but {} slots and {} starts", b,
           slots.size(), starts.size());
  MG_CHECK(config_.hidden_dropout == 0.0f && config_.attention_dropout == 0.0f,
           "inference needs a model built with hidden and attention dropout 0");
  std::vector<int64_t> positions(size_t(b * s));
  int64_t max_position = 0;
  for (int64_t i = 0; i < b; ++i) {
    for (int64_t j = 0; j < s; ++j) positions[size_t(i * s + j)] = starts[size_t(i)] + j;
    max_position = std::max(max_position, starts[size_t(i)] + s - 1);
  }
  MG_CHECK(max_position < cache.max_length(), "position {} is past the KV cache's {} positions", max_position,
           cache.max_length());
  if (config_.use_learned_positions()) {
    MG_CHECK(max_position < config_.max_position_embeddings, "position {} exceeds --max-position-embeddings {}",
             max_position, config_.max_position_embeddings);
  }
  Tensor position_ids = Tensor::from_ints(positions, {b, s}, DType::Int64, tokens.device());
  LanguageModelEmbedding::Saved embedding_saved;
  Tensor x = embedding_->forward(ctx, tokens, position_ids, embedding_saved);
  Tensor freqs;
  if (rotary_) {  // row j·b + i: the angles of sequence i's position starts[i] + j
    std::vector<float> table = rotary_->freqs(ctx, max_position + 1).to_floats();
    const int64_t half = rotary_->rotary_dim() / 2;
    std::vector<float> rows(size_t(s * b * half));
    for (int64_t j = 0; j < s; ++j)
      for (int64_t i = 0; i < b; ++i)
        std::copy_n(table.begin() + (starts[size_t(i)] + j) * half, half, rows.begin() + (j * b + i) * half);
    freqs = Tensor::from_floats(rows, {s * b, half}, DType::Float32, ctx.device());
  }
  Tensor slot_t = Tensor::from_ints(slots, {b}, DType::Int64, ctx.device());
  Tensor start_t = Tensor::from_ints(starts, {b}, DType::Int64, ctx.device());
  Tensor hidden = decoder_->forward_inference(ctx, x, freqs, slot_t, start_t, cache);
  return output_layer_->forward(ctx, hidden.view({s * b, h})).view({s, b, v});
}

Tensor default_position_ids(int64_t batch, int64_t seq_len) {
  std::vector<int64_t> ids(size_t(batch * seq_len));
  for (int64_t i = 0; i < batch; ++i)
    for (int64_t j = 0; j < seq_len; ++j) ids[size_t(i * seq_len + j)] = j;
  return Tensor::from_ints(ids, {batch, seq_len});
}

}  // namespace megatron
