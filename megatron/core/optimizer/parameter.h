// A trainable parameter as the optimizer sees it: the model's tensor, its fp32 gradient in the
// model's grad buffer (Megatron's param.main_grad) and whether weight decay applies.
#pragma once

#include <string>
#include <string_view>

#include "megatron/runtime/tensor.h"

namespace megatron {

struct Parameter {
  std::string name;  // unique, e.g. "decoder.layers.0.self_attention.linear_qkv.weight"
  Tensor data;       // model dtype: fp32, bf16 or fp16
  Tensor main_grad;  // fp32, same numel; owned by the model, zeroed by the caller
  bool no_weight_decay = false;
};

/// Megatron's default rule (_get_param_groups): no weight decay for biases and 1-D parameters
/// (norm weights).
inline bool default_no_weight_decay(std::string_view name, const Tensor& data) {
  return data.dim() == 1 || (name.size() >= 5 && name.substr(name.size() - 5) == ".bias");
}

/// A Parameter with no_weight_decay set by Megatron's default rule.
inline Parameter make_parameter(std::string name, Tensor data, Tensor main_grad) {
  const bool no_wd = default_no_weight_decay(name, data);
  return Parameter{std::move(name), std::move(data), std::move(main_grad), no_wd};
}

}  // namespace megatron
