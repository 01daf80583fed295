// LanguageModelEmbedding: word embeddings (+ learned absolute position embeddings) and the
// embedding dropout; output sequence-first [s, b, h] as Megatron-Core's.
//
// With tensor parallelism the word embeddings are Megatron's VocabParallelEmbedding: this rank holds
// rows [tp_rank·V/tp, (tp_rank+1)·V/tp) of the padded table, looks up the tokens it owns (zeros for
// the others) and the partial results are all-reduced — or reduce-scattered along the sequence under
// sequence parallelism, giving this rank's [s/tp, b, h] shard. Position embeddings are whole on every
// rank and added after the reduction; the dropout then runs on what this rank holds.
#pragma once

#include "megatron/core/distributed/param_and_grad_buffer.h"
#include "megatron/core/process_groups_config.h"
#include "megatron/core/transformer/transformer_config.h"
#include "megatron/runtime/context.h"

namespace megatron {

class LanguageModelEmbedding {
 public:
  /// Tensor parallelism over pg.tp; sequence parallelism as the config says.
  LanguageModelEmbedding(const TransformerConfig& config, ParamAndGradBuffer& params, const std::string& prefix,
                         const ProcessGroupCollection& pg = {});

  struct Saved {
    Tensor tokens, position_ids;
    uint64_t dropout_offset = 0;
  };
  /// tokens [b, s], position_ids [b, s] (used with learned positions) -> [s, b, h] ([s/tp, b, h]
  /// under sequence parallelism). The dropout draws from stream `dropout_offset`.
  Tensor forward(Context& ctx, const Tensor& tokens, const Tensor& position_ids, uint64_t dropout_offset,
                 Saved& saved) const;
  void backward(Context& ctx, const Tensor& grad_out, const Saved& saved) const;

  Parameter* word_embeddings() const { return word_; }

 private:
  int64_t hidden_;
  int64_t vocab_size_;  // padded, all ranks
  float dropout_p_;
  DType dtype_;
  Communicator* tp_;  // null: one rank
  bool sequence_parallel_;
  Parameter* word_;
  Parameter* position_ = nullptr;
};

}  // namespace megatron
