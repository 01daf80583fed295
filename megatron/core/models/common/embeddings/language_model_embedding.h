// LanguageModelEmbedding: word embeddings (+ learned absolute position embeddings) and the
// embedding dropout; output sequence-first [s, b, h] as Megatron-Core's.
#pragma once

#include "megatron/core/distributed/param_and_grad_buffer.h"
#include "megatron/core/transformer/transformer_config.h"
#include "megatron/runtime/context.h"

namespace megatron {

class LanguageModelEmbedding {
 public:
  LanguageModelEmbedding(const TransformerConfig& config, ParamAndGradBuffer& params, const std::string& prefix);

  struct Saved {
    Tensor tokens, position_ids;
    uint64_t dropout_offset = 0;
  };
  /// tokens [b, s], position_ids [b, s] (used with learned positions) -> [s, b, h].
  Tensor forward(Context& ctx, const Tensor& tokens, const Tensor& position_ids, Saved& saved) const;
  void backward(Context& ctx, const Tensor& grad_out, const Saved& saved) const;

  Parameter* word_embeddings() const { return word_; }

 private:
  int64_t hidden_;
  float dropout_p_;
  DType dtype_;
  Parameter* word_;
  Parameter* position_ = nullptr;
};

}  // namespace megatron
