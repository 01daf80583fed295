// Linear layers: y = x·Wᵀ + b with W [out, in] (Megatron's ColumnParallelLinear / RowParallelLinear).
// At tensor-parallel size 1 the two are the same computation; the parallel issue adds the column
// (output-split) and row (input-split) partitioning and their communication here.
// The weight gradient accumulates into the fp32 main_grad (gradient-accumulation fusion).
#pragma once

#include <string>

#include "megatron/core/distributed/param_and_grad_buffer.h"
#include "megatron/runtime/context.h"

namespace megatron {

class Linear {
 public:
  /// Registers "<prefix>.weight" [out, in] (and "<prefix>.bias" [out] when `bias`).
  Linear(ParamAndGradBuffer& params, const std::string& prefix, int64_t in_features, int64_t out_features, bool bias,
         ParamInit weight_init);
  /// Uses an existing weight (tied output layer); no bias.
  explicit Linear(Parameter* shared_weight);

  /// x [N, in] -> [N, out]. The caller keeps x for backward.
  Tensor forward(Context& ctx, const Tensor& x) const;
  /// Returns grad_in [N, in] (undefined when !need_grad_in); accumulates the parameter gradients.
  Tensor backward(Context& ctx, const Tensor& grad_out, const Tensor& x, bool need_grad_in = true) const;

  const Parameter* weight() const { return weight_; }
  int64_t out_features() const { return weight_->data.size(0); }

 private:
  Parameter* weight_;
  Parameter* bias_ = nullptr;
};

}  // namespace megatron
