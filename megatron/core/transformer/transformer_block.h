// TransformerBlock: the stack of layers and the final norm ("decoder" in Megatron-Core's names),
// with activation recomputation:
//   none       every layer keeps its Saved activations;
//   selective  layers drop their core-attention tensors (Note [Selective recomputation]);
//   full       uniform: the layers are cut into chunks of --recompute-num-layers and only each
//              chunk's input is kept; backward re-runs the chunk's forward, then its backward.
//              block: the first --recompute-num-layers layers are recomputed one by one, the rest
//              keep their activations.
#pragma once

#include <memory>
#include <vector>

#include "megatron/core/inference/kv_cache.h"
#include "megatron/core/transformer/transformer_layer.h"

namespace megatron {

class TransformerBlock {
 public:
  /// The layers `range` of the decoder (all of them by default; a pipeline stage's chunk otherwise),
  /// named by their global index, and the final norm when `final_norm` (the last stage).
  TransformerBlock(const TransformerConfig& config, ParamAndGradBuffer& params, const std::string& prefix,
                   const ParallelState* ps = nullptr, LayerRange range = {}, bool final_norm = true);

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
  Tensor forward(Context& ctx, const Tensor& x, const Tensor& freqs, uint64_t rng_base, Saved& saved) const;
  Tensor backward(Context& ctx, const Tensor& grad_out, const Tensor& freqs, Saved& saved) const;
  const std::vector<Segment>& segments() const { return segments_; }

  /// Inference: x [s, b, h] -> final-normed [s, b, h], each layer appending to its cache entry
  /// (TransformerLayer::forward_inference). slots, starts [b]: cache slot and first new position.
  Tensor forward_inference(Context& ctx, const Tensor& x, const Tensor& freqs, const Tensor& slots,
                           const Tensor& starts, KVCache& cache) const;

 private:
  Tensor run_segment(Context& ctx, const Segment& seg, const Tensor& x, const Tensor& freqs, Saved& saved,
                     bool keep) const;

  bool selective_;
  std::vector<Segment> segments_;
  int first_layer_;  // global index of layers_[0]
  std::vector<std::unique_ptr<TransformerLayer>> layers_;
  std::unique_ptr<Norm> final_layernorm_;
};

}  // namespace megatron
