// Host helpers the HF converters share (hf_config.cpp, hf_mapping.cpp, hf_deepseek.cpp,
// hf_gpt_oss.cpp): fp32 row-major tensors, row concatenation and padding, the grouped QKV layout, the
// shape-checked HF reader and Megatron's layer names (hf_util.cpp); the config fields more than one
// HF type writes (hf_config.cpp). Not a public API.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "megatron/core/models/gpt/hf_mapping.h"
#include "megatron/runtime/tensor.h"

namespace megatron::hf_detail {

/// t as a host fp32 tensor (no copy when it already is one).
Tensor as_fp32(const Tensor& t);
/// t on the host in its own dtype (no copy when it is there).
Tensor host(const Tensor& t);
/// [r, c] -> [c, r] (fp32).
Tensor transpose2d(const Tensor& t);
/// Concatenates along dim 0 (fp32).
Tensor concat_rows(const std::vector<Tensor>& parts);
/// The rows of t in `order`, as views of it (a run of consecutive rows is one piece).
RowParts rows_of(const Tensor& t, const std::vector<int64_t>& order);
/// The transpose of t's rows `rows` and columns `cols` (empty: all, in order): out[a][b] =
/// t[rows[b]][cols[a]], in t's dtype, made in row blocks of about 4 MiB as the writer takes them
/// (Note [Streaming conversion]); t is held until the last block is made.
RowParts transposed(const Tensor& t, std::vector<int64_t> rows = {}, std::vector<int64_t> cols = {});
/// q [nq·d, ...], k/v [ng·d, ...] -> grouped [ng·(nq/ng+2)·d, ...] (per group: its q heads, k, v).
Tensor merge_qkv(const Tensor& q, const Tensor& k, const Tensor& v, int64_t nq, int64_t ng, int64_t d);
/// merge_qkv as its row pieces (views of q, k, v), for a streaming writer.
RowParts merge_qkv_rows(const Tensor& q, const Tensor& k, const Tensor& v, int64_t nq, int64_t ng, int64_t d);
/// merge_qkv's row order: row r of the grouped QKV is row order[r] of [q; k; v].
std::vector<int64_t> merged_qkv_order(int64_t nq, int64_t ng, int64_t d);
/// Its inverse, split: the grouped QKV's rows that make q, k and v.
void split_qkv_order(int64_t nq, int64_t ng, int64_t d, std::vector<int64_t>& q, std::vector<int64_t>& k,
                     std::vector<int64_t>& v);
/// The inverse of merge_qkv (fp32 copies).
void split_qkv(const Tensor& qkv, int64_t nq, int64_t ng, int64_t d, Tensor& q, Tensor& k, Tensor& v);
/// resize_rows without a copy: the table (in its dtype) and zero rows, or a view of its first `rows` rows.
RowParts pad_rows(const Tensor& t, int64_t rows);
/// Pads the rows of a [V, ...] table to `rows` with zeros, or strips it back (fp32).
Tensor resize_rows(const Tensor& t, int64_t rows);

/// Fetches an HF tensor (on the host, in its dtype) and checks its shape against the config's (one line naming it).
struct HFReader {
  const std::function<Tensor(const std::string&)>& get;
  Tensor operator()(const std::string& name, const Shape& expected) const;
};

/// "decoder.layers.<i>.<rest>".
std::string layer(int i, const char* rest);

/// A float as the shortest decimal that reads back as it (1e-05, not 9.999999747378752e-06), for config.json.
double shortest(float x);

/// Whether an HF model_type is one of the Llama family's mixture-of-experts types (mixtral, qwen2_moe,
/// qwen3_moe; Note [HF mixture of experts]).
bool is_hf_moe(const std::string& model_type);

/// --moe-aux-loss-coeff as config.json's router_aux_loss_coef (0: none), for the HF types whose aux
/// loss is Megatron's aux_loss (Mixtral, the Qwen MoE types, GPT-OSS); one line for another balancing type.
float router_aux_loss_coef_to_hf(const TransformerConfig& config);

/// The config.json fields every Llama-family type we export writes alike (Llama, Qwen2/3, Mixtral,
/// the Qwen MoE types, DeepSeek-V3, GPT-OSS): the type and its architecture, the sizes (with the
/// type's intermediate size, key/value heads and head dim), RMSNorm's epsilon, SiLU, attention_bias
/// and tied embeddings. Each writer adds its own fields.
nlohmann::json llama_family_config(const TransformerConfig& c, const std::string& model_type,
                                   const std::string& architecture, int64_t intermediate_size, int64_t kv_heads,
                                   int64_t head_dim, bool attention_bias);

}  // namespace megatron::hf_detail
