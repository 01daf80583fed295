// TransformerBlock: the stack of layers and the final norm ("decoder" in Megatron-Core's names),
// each layer built from its spec in the block spec (Megatron's TransformerBlockSubmodules), with
// activation recomputation:
//   none       every layer keeps its Saved activations;
//   selective  layers drop their core-attention tensors (Note [Selective recomputation]);
//   full       uniform: the layers are cut into chunks of --recompute-num-layers and only each
//              chunk's input is kept; backward re-runs the chunk's forward, then its backward.
//              block: the first --recompute-num-layers layers are recomputed one by one, the rest
//              keep their activations.
#pragma once

#include <memory>
#include <vector>

#include "megatron/core/transformer/transformer_layer.h"
#include "megatron/core/transformer/transformer_layer_spec.h"

namespace megatron {

class TransformerBlock {
 public:
  /// The layers `range` of the decoder (all of them by default; a pipeline stage's chunk otherwise),
  /// named by their global index and built from spec.layers[global index], and the final norm when
  /// `final_norm` (the last stage).
  TransformerBlock(const TransformerConfig& config, const TransformerBlockSpec& spec, ParamAndGradBuffer& params,
                   const std::string& prefix, const ProcessGroupCollection& pg = {}, LayerRange range = {},
                   bool final_norm = true);

  struct Segment {
    int begin = 0, end = 0;  // layers [begin, end)
    bool recompute = false;  // keep only the input; re-run forward in backward
  };
  struct Saved {
    std::vector<Tensor> segment_inputs;           // per segment
    std::vector<TransformerLayer::Saved> layers;  // per layer (empty while recomputed)
    uint64_t rng_base = 0;
    Norm::Saved final_norm;
  };

  /// x [s, b, h] -> final-normed hidden states [s, b, h] (not normed without the final norm).
  /// Global layer i draws its random streams at rng_base + i·TransformerLayer::kRandomStreams.
  Tensor forward(Context& ctx, const Tensor& x, const AttentionInputs& in, uint64_t rng_base, Saved& saved) const;
  Tensor backward(Context& ctx, const Tensor& grad_out, const AttentionInputs& in, Saved& saved) const;
  const std::vector<Segment>& segments() const { return segments_; }
  /// Where the MoE layers report their losses (and find their backward scale); null: nowhere.
  void set_aux_loss_tracker(AuxLossTracker* tracker) { aux_losses_ = tracker; }
  /// This block's layers (global index first_layer() + i).
  const std::vector<std::unique_ptr<TransformerLayer>>& layers() const { return layers_; }
  int first_layer() const { return first_layer_; }

  /// Inference: x [s, b, h] -> final-normed [s, b, h], layer i appending to keys[i]/values[i]
  /// (TransformerLayer::forward_inference; KVCache holds them). rows: each sequence's cache slot
  /// and first new position.
  Tensor forward_inference(Context& ctx, const Tensor& x, const Tensor& freqs, const CacheRows& rows,
                           std::vector<Tensor>& keys, std::vector<Tensor>& values) const;

 private:
  Tensor run_segment(Context& ctx, const Segment& seg, const Tensor& x, const AttentionInputs& in, Saved& saved,
                     bool keep, bool report_aux_losses) const;

  bool selective_;
  std::vector<Segment> segments_;
  int first_layer_;  // global index of layers_[0]
  std::vector<std::unique_ptr<TransformerLayer>> layers_;
  std::unique_ptr<Norm> final_layernorm_;
  AuxLossTracker* aux_losses_ = nullptr;
};

}  // namespace megatron
