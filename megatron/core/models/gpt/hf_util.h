// Host helpers the HF converters share (hf_mapping.cpp, hf_deepseek.cpp): fp32 row-major tensors,
// row concatenation and padding, the shape-checked HF reader and Megatron's layer names.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "megatron/runtime/tensor.h"

namespace megatron::hf_detail {

/// t as a host fp32 tensor (no copy when it already is one).
Tensor as_fp32(const Tensor& t);
/// [r, c] -> [c, r].
Tensor transpose2d(const Tensor& t);
/// Concatenates along dim 0.
Tensor concat_rows(const std::vector<Tensor>& parts);
/// Pads the rows of a [V, ...] table to `rows` with zeros, or strips it back.
Tensor resize_rows(const Tensor& t, int64_t rows);

/// Fetches an HF tensor as fp32 and checks its shape against the config's (one line naming it).
struct HFReader {
  const std::function<Tensor(const std::string&)>& get;
  Tensor operator()(const std::string& name, const Shape& expected) const;
};

/// "decoder.layers.<i>.<rest>".
std::string layer(int i, const char* rest);

/// A float as the shortest decimal that reads back as it (1e-05, not 9.999999747378752e-06), for config.json.
double shortest(float x);

}  // namespace megatron::hf_detail
