// Multi-token prediction (Megatron-Core's multi_token_prediction.py, DeepSeek-V3's MTP): after the
// decoder, D sequential modules each predict one more token ahead. Depth k (1-based) takes the
// previous depth's output h_{k-1} (the decoder's final-normed hidden states for k = 1) and the
// embeddings of the input tokens shifted left by k (roll_tensor: the shifted-out end filled with
// token 0), and computes
//   x   = eh_proj([enorm(embedding(tokens << k)); hnorm(h_{k-1})])    concatenated on the hidden dim
//   h_k = final_layernorm(transformer_layer(x))
// The model's output layer turns h_k into logits, scored against the labels shifted left by k
// under the loss mask shifted the same way (GPTModel does that part, as Megatron's process_mtp_loss).
//
// Parameters (Megatron's names): mtp.layers.{k-1}.enorm, .hnorm, .eh_proj (column parallel, 2h -> h,
// no bias), .transformer_layer.* (a decoder layer built from the decoder's last layer spec, dense or
// MoE: get_gpt_mtp_block_spec), .final_layernorm. The embedding and output layer are the model's.
//
// Tensor parallelism follows Megatron: eh_proj is column parallel and its output is all-gathered
// along the hidden dimension (gather_from_tensor_model_parallel_region) — and, under sequence
// parallelism, cut back to this rank's sequence shard (scatter_to_sequence_parallel_region) before
// the transformer layer. The norms work on what the rank holds ([s/tp, b, h] under SP).
//
// Note [MTP layer recomputation]: the MTP layers keep their activations under every
// --recompute-granularity (Megatron recomputes them with full/uniform): the same numbers, more memory.
#pragma once

#include <string>
#include <utility>

#include "megatron/core/tensor_parallel/layers.h"
#include "megatron/core/transformer/norm.h"
#include "megatron/core/transformer/transformer_layer.h"

namespace megatron {

class MultiTokenPredictionLayer {
 public:
  /// Random offsets one depth draws per microbatch: its embedding dropout, then its layer's.
  static constexpr uint64_t kRandomStreams = 1 + TransformerLayer::kRandomStreams;

  /// prefix "mtp.layers.{k-1}"; layer_number: the global layer index the MoE router reports under
  /// (num_layers + k - 1, after the decoder's, as Megatron's router does for MTP layers).
  MultiTokenPredictionLayer(const TransformerConfig& config, const TransformerLayerSpec& spec,
                            ParamAndGradBuffer& params, const std::string& prefix, const ProcessGroupCollection& pg,
                            int layer_number);

  struct Saved {
    Norm::Saved enorm, hnorm;
    Tensor proj_in;  // [N, 2h]: [enorm(e); hnorm(h)] (N: this rank's rows)
    TransformerLayer::Saved layer;
    Norm::Saved final_norm;
  };
  /// embedding: the shifted tokens' embeddings, hidden: h_{k-1}; both [s, b, h] ([s/tp, b, h] under
  /// SP). Returns h_k, the same shape. The layer draws its streams from rng_base.
  Tensor forward(Context& ctx, const Tensor& embedding, const Tensor& hidden, const AttentionInputs& in,
                 uint64_t rng_base, Saved& saved, AuxLossTracker* aux_losses) const;
  /// Returns the gradients of {embedding, hidden}; accumulates the parameter gradients.
  std::pair<Tensor, Tensor> backward(Context& ctx, const Tensor& grad_out, const AttentionInputs& in,
                                     Saved& saved) const;

  TransformerLayer& transformer_layer() { return layer_; }
  const TransformerLayer& transformer_layer() const { return layer_; }

 private:
  int64_t hidden_;
  Communicator* tp_;  // null: one rank
  bool sequence_parallel_;
  Norm enorm_, hnorm_;
  Linear eh_proj_;
  TransformerLayer layer_;
  Norm final_layernorm_;
};

/// Megatron's roll_tensor(x, shifts=-1) along the sequence: out[j] = x[j + 1], the last position 0.
/// x is sequence-first [s, ...] (labels and masks in the model's [s, b] layout).
Tensor roll_sequence_left(Context& ctx, const Tensor& x);
/// The same for batch-first ids [b, s] (tokens, position ids).
Tensor roll_tokens_left(Context& ctx, const Tensor& ids);

}  // namespace megatron
