// HuggingFace <-> Megatron-Core names and layouts for the GPT-2 and Llama families (Llama, Mistral,
// Qwen2, Qwen3: the same tensor names; Qwen2 adds q/k/v biases, Qwen3 the per-head RMSNorms of
// queries and keys, self_attn.q_norm/k_norm <-> self_attention.q_layernorm/k_layernorm) and their
// mixture-of-experts relatives (Mixtral, Qwen2-MoE, Qwen3-MoE; Note [HF mixture of experts]).
//
//   GPT-2: Conv1D weights are [in, out] (transposed here); c_attn packs q, k, v along `out`.
//   Llama: q_proj/k_proj/v_proj are separate; gate_proj and up_proj become linear_fc1 = [gate; up].
//   Both:  the fused QKV is regrouped per query group (Note in ops.h on the QKV layout); the word
//          embeddings (and an untied lm_head) are padded with zero rows to the padded vocabulary
//          and stripped on the way back.
// Everything goes through name -> Tensor maps, so checkpoints, converters and tests share it. The
// config.json each mapping follows is hf_config.h's (included here).
//
// Note [HF mixture of experts]
// One HF tensor per expert, Megatron's SequentialMLP names with the global expert index:
//   mixtral:   model.layers.L.block_sparse_moe.gate.weight         -> decoder.layers.L.mlp.router.weight
//              ...block_sparse_moe.experts.E.{w1 (gate), w3 (up)}  -> ...mlp.experts.local_experts.E.linear_fc1.weight
//              ...block_sparse_moe.experts.E.w2 (down)             -> ...mlp.experts.local_experts.E.linear_fc2.weight
//   qwen2_moe, qwen3_moe: mlp.gate.weight, mlp.experts.E.{gate,up,down}_proj likewise; qwen2_moe's
//              mlp.shared_expert.{gate,up,down}_proj -> mlp.shared_experts.linear_fc1/linear_fc2 and
//              mlp.shared_expert_gate.weight [1, h] -> mlp.shared_experts.gate_weight.
// Routing: Mixtral's softmax over all experts, top-k, renormalised, equals Megatron's default (top-k
// of the logits, softmax over the chosen); Qwen's norm_topk_prob true is the same, false is
// --moe-router-pre-softmax (softmax over all, top-k, no renormalisation). Dense layers among MoE
// ones (Qwen's mlp_only_layers, and layer i is MoE only when (i + 1) % decoder_sparse_step == 0)
// become the --moe-layer-freq pattern, with the dense MLP of intermediate_size. The HF aux loss
// (router_aux_loss_coef) counts only with output_router_logits: then it is --moe-aux-loss-coeff.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "megatron/core/models/gpt/gpt_model.h"
#include "megatron/core/models/gpt/hf_config.h"

namespace megatron {

using TensorMap = std::map<std::string, Tensor>;

/// One tensor a mapping hands on: `parts` concatenated along dim 0, then `zero_rows` rows of zeros.
/// Fused and padded tensors (QKV, [gate; up], the padded vocabulary) travel as their pieces, so a
/// streaming writer never assembles them (Note [Streaming conversion] in tools/convert_checkpoint.cpp).
/// Pieces keep their source's dtype (bf16 stays bf16); the writer converts to the file's dtype.
/// A tensor that is computed (a transpose) travels as row blocks made one at a time instead:
/// `blocks` rows of shape `shape`, rows [b, e) made by make(b, e), block_rows at a time.
struct RowParts {
  struct Blocks {
    Shape shape;
    DType dtype = DType::Float32;
    int64_t block_rows = 1;
    std::function<Tensor(int64_t, int64_t)> make;
  };
  std::vector<Tensor> parts;
  int64_t zero_rows = 0;
  std::shared_ptr<const Blocks> blocks;  // set: the tensor is made block by block (parts empty)
  RowParts(Tensor t) : parts{std::move(t)} {}  // NOLINT: a whole tensor is one part
  RowParts(std::vector<Tensor> p, int64_t zeros = 0) : parts(std::move(p)), zero_rows(zeros) {}
  explicit RowParts(Blocks b) : blocks(std::make_shared<const Blocks>(std::move(b))) {}
  Shape shape() const;
  /// The widest dtype of the pieces (what the tensor holds without rounding).
  DType dtype() const;
  /// The pieces a writer takes one at a time: count() of them, piece(k) made on demand.
  size_t count() const;
  Tensor piece(size_t k) const;
  /// The tensor itself (fp32, one copy unless it is a single fp32 part).
  Tensor materialize() const;
};

/// Where a mapping puts its tensors, one at a time: out[name] = tensor calls put(name, tensor) at once.
class TensorSink {
 public:
  using Put = std::function<void(const std::string&, RowParts)>;
  explicit TensorSink(Put put) : put_(std::move(put)) {}
  struct Slot {
    const Put& put;
    std::string name;
    void operator=(RowParts t) const { put(name, std::move(t)); }
  };
  Slot operator[](std::string name) { return {put_, std::move(name)}; }

 private:
  Put put_;
};

/// A source of named tensors: get(name) returns it as host fp32 or throws one line naming it;
/// has(name) says whether it exists (for optional tensors).
struct TensorSource {
  std::function<Tensor(const std::string&)> get;
  std::function<bool(const std::string&)> has;
};

/// A HuggingFace model folder as users download it: config.json and model.safetensors, or the
/// shards listed in model.safetensors.index.json.
class HFFolder {
 public:
  explicit HFFolder(const std::string& dir);
  const std::string& dir() const { return dir_; }
  const nlohmann::json& config() const { return config_; }
  std::vector<std::string> tensor_names() const;
  bool has(const std::string& name) const;
  /// The tensor as fp32, or one line naming it when the folder has none.
  Tensor get(const std::string& name) const;
  /// The tensor in its stored dtype (same error).
  Tensor read(const std::string& name) const;
  /// Its shape and dtype as stored (same error).
  Shape shape(const std::string& name) const;
  DType dtype(const std::string& name) const;
  /// Whether tensors a and b hold the same bytes (dtype and shape included), compared a chunk at a
  /// time from the mapped files (Note [Bounded reads] in safetensors.h).
  bool same_bytes(const std::string& a, const std::string& b) const;

 private:
  struct Shard;
  std::string dir_;
  nlohmann::json config_;
  std::map<std::string, std::shared_ptr<const Shard>> by_tensor_;
};

/// config_from_hf of the folder's config.json, where the folder also settles what the config alone
/// cannot: a deepseek_v3 folder without the tensors of its num_nextn_predict_layers MTP layers (as
/// transformers writes them) imports without MTP; one with some but not all of them is one line
/// (Note [HF DeepSeek-V3 MTP] in hf_deepseek.h).
HFModelInfo config_from_hf(const HFFolder& folder, int make_vocab_size_divisible_by = 128);

/// HF tensors -> Megatron-Core tensors (fp32 host). get_hf(name) returns the HF tensor or throws.
/// Shapes are checked against the config; a mismatch names the tensor and both shapes.
TensorMap hf_to_megatron(const HFModelInfo& info, const std::function<Tensor(const std::string&)>& get_hf);
/// The same, each Megatron-Core tensor handed to `out` as soon as it is made (from its HF sources only),
/// as views or row blocks of the sources in their dtype (Note [Streaming conversion]).
void hf_to_megatron(const HFModelInfo& info, const std::function<Tensor(const std::string&)>& get_hf, TensorSink& out);
/// Megatron-Core tensors -> HF tensors (fp32 host), the exact inverse of hf_to_megatron. For a model
/// trained here (info.config its own config) it also folds what HF expresses otherwise into the
/// weights: zero-centered norms (--apply-layernorm-1p) get their 1 back, interleaved RoPE's q/k rows
/// go to HF's half-split order, GPT-2's missing biases and positions are zeros.
TensorMap megatron_to_hf(const HFModelInfo& info, const TensorMap& megatron);
/// The same, reading each Megatron-Core tensor from `megatron` when needed and handing each HF
/// tensor to `out` as soon as it is made, as views or row blocks of the sources in their dtype (fp32
/// where computed: zero-centered norms, GPT-OSS's experts).
void megatron_to_hf(const HFModelInfo& info, const TensorSource& megatron, TensorSink& out);

/// The model's parameters (or their fp32 gradients) by Megatron-Core name, as host fp32 copies.
TensorMap model_state_dict(const GPTModel& model);
TensorMap model_grad_dict(const GPTModel& model);
/// The model's buffers (GPTModel::buffers: the MoE routers' expert biases, ...) by name, as host
/// fp32 copies: with model_state_dict, everything an HF export needs.
TensorMap model_buffer_dict(GPTModel& model);
/// Copies tensors into the model's parameters (converted to the model dtype), and into its buffers
/// (the expert biases) when the state names them. Every parameter must be present with its exact
/// shape; an extra tensor is an error too. Errors name the tensor.
void load_model_state_dict(GPTModel& model, const TensorMap& state, const std::string& source);

}  // namespace megatron
