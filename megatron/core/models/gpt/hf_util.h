// Host helpers the HF converters share (hf_mapping.cpp, hf_deepseek.cpp, hf_gpt_oss.cpp): fp32
// row-major tensors, row concatenation and padding, the grouped QKV layout, the shape-checked HF
// reader and Megatron's layer names. Not a public API.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "megatron/core/models/gpt/hf_mapping.h"
#include "megatron/runtime/tensor.h"

namespace megatron::hf_detail {

/// t as a host fp32 tensor (no copy when it already is one).
Tensor as_fp32(const Tensor& t);
/// [r, c] -> [c, r].
Tensor transpose2d(const Tensor& t);
/// Concatenates along dim 0.
Tensor concat_rows(const std::vector<Tensor>& parts);
/// q [nq·d, ...], k/v [ng·d, ...] -> grouped [ng·(nq/ng+2)·d, ...] (per group: its q heads, k, v).
Tensor merge_qkv(const Tensor& q, const Tensor& k, const Tensor& v, int64_t nq, int64_t ng, int64_t d);
/// merge_qkv as its row pieces (views of q, k, v), for a streaming writer.
RowParts merge_qkv_rows(const Tensor& q, const Tensor& k, const Tensor& v, int64_t nq, int64_t ng, int64_t d);
/// The inverse of merge_qkv.
void split_qkv(const Tensor& qkv, int64_t nq, int64_t ng, int64_t d, Tensor& q, Tensor& k, Tensor& v);
/// resize_rows without a copy: the table and zero rows, or a view of its first `rows` rows.
RowParts pad_rows(const Tensor& t, int64_t rows);
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
