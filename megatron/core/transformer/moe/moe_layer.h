// MoELayer (Megatron-Core's moe/moe_layer.py with SequentialMLP experts, one process): the router
// chooses each token's experts, the tokens are permuted into expert order (Note [Permuted order]),
// each local expert — a dense MLP of --moe-ffn-hidden-size, "<prefix>.experts.local_experts.<e>" —
// runs on its rows, and the outputs are unpermuted with the routing probabilities as weights:
//   y[t] = Σ_{e routed for t} probs[t, e] · expert_e(x[t])
// Backward: the gradient reaches the input through the experts and the permutation, and through
// the probabilities into the router (with the router's own losses).
//
// Half there: the token dispatchers' communication (allgather / alltoall over the expert-parallel
// group), grouped GEMMs, the shared expert, and the layer's place in the layer specs are not built;
// the training arguments refuse --num-experts.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "megatron/core/transformer/mlp.h"
#include "megatron/core/transformer/moe/router.h"

namespace megatron::moe {

class MoELayer {
 public:
  MoELayer(const TransformerConfig& config, const RouterConfig& router_config, int64_t moe_ffn_hidden_size,
           ParamAndGradBuffer& params, const std::string& prefix, int layer_number);

  struct Saved {
    TopKRouter::Saved router;
    Permutation permutation;
    Tensor probs;       // [N] the permuted rows' probabilities
    Tensor expert_out;  // [N, h] the experts' outputs in permuted order
    std::vector<MLP::Saved> experts;
    DType dtype = DType::Float32;
  };
  /// x [T, h] (T = seq_length · micro_batch, sequence-major) -> [T, h].
  Tensor forward(Context& ctx, const Tensor& x, int64_t seq_length, int64_t micro_batch, AuxLossTracker* tracker,
                 Saved& saved);
  Tensor backward(Context& ctx, const Tensor& grad_out, Saved& saved);

  TopKRouter& router() { return router_; }
  int num_experts() const { return int(experts_.size()); }

 private:
  TopKRouter router_;
  std::vector<std::unique_ptr<MLP>> experts_;
};

}  // namespace megatron::moe
