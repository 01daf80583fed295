// Host helpers on fp32 row-major tensors shared by the HF mappings (hf_mapping.cpp, hf_gpt_oss.cpp):
// not a public API.
#pragma once

#include <string>
#include <vector>

#include "megatron/runtime/tensor.h"

namespace megatron::hf_detail {

/// A host fp32 copy (or t itself when it already is one).
Tensor as_fp32(const Tensor& t);
/// [r, c] -> [c, r].
Tensor transpose2d(const Tensor& t);
/// Concatenates along dim 0.
Tensor concat_rows(const std::vector<Tensor>& parts);
/// q [nq·d, ...], k/v [ng·d, ...] -> grouped [ng·(nq/ng+2)·d, ...] (per group: its q heads, k, v).
Tensor merge_qkv(const Tensor& q, const Tensor& k, const Tensor& v, int64_t nq, int64_t ng, int64_t d);
/// The inverse of merge_qkv.
void split_qkv(const Tensor& qkv, int64_t nq, int64_t ng, int64_t d, Tensor& q, Tensor& k, Tensor& v);
/// Pads the rows of a [V, h] table to `rows` with zeros, or strips it back.
Tensor resize_rows(const Tensor& t, int64_t rows);
/// "decoder.layers.<i>.<rest>".
std::string layer(int i, const char* rest);

}  // namespace megatron::hf_detail
