// GPTModel (Megatron-Core's GPTModel): embedding -> TransformerBlock -> output layer -> per-token
// cross entropy. One class serves the GPT-2 style (learned positions, LayerNorm, GeLU, biases, tied
// embeddings) and the Llama style (RoPE, RMSNorm, SwiGLU, GQA, no biases, untied output layer):
// the TransformerConfig decides, and the decoder's layers are built from a block spec
// (get_gpt_decoder_block_spec(config) unless one is given), as Megatron's layer specs do.
//
// The model owns its parameters (a ParamAndGradBuffer in registration order, one bucket);
// DistributedDataParallel lays them out in its own buffers per reduction group once the model
// exists (Note [Buffers per reduction group]). The modules get the process groups they use
// (ProcessGroupCollection), not the ParallelState.
//
// forward() keeps what backward needs in a per-microbatch Stash, so pipeline schedules can hold
// several microbatches in flight; backward() accumulates every parameter gradient into the fp32
// grad buffer.
//
// Parallelism: built with a ParallelState, a GPTModel is this rank's model chunk — its
// tensor-parallel shard of the layers pipeline_layer_range(config, pp_rank, vp_stage), with the
// embedding on the first stage (pre_process) and the final norm, output layer and the
// vocab-parallel cross entropy on the last (post_process). forward_step/backward_step take and give
// the activations exchanged between stages ([s, b, h], or [s/tp, b, h] under sequence parallelism).
// With tied embeddings on more than one stage, the last stage holds its own copy of the word
// embeddings under the same name (shared_embedding_copy): same initial values, gradients
// all-reduced with the first stage's (the embedding group), saved once.
//
// Random streams: one microbatch draws 1 + 3·num_layers (+ 4·mtp_num_layers) consecutive offsets
// from ctx.rng().offset (the embedding dropout, then three per layer by global layer index, then
// per MTP depth its embedding dropout and its layer's three) and advances the offset by that much,
// on every stage, so each stage's masks are the single-process run's.
//
// Multi-token prediction (--mtp-num-layers D, core/transformer/multi_token_prediction.h): the MTP
// block sits on the last stage (Megatron's default placement) after the decoder; it needs the
// tokens, position ids and loss mask there, and the embedding: with more than one stage the last
// one holds its own copy of the word embeddings (tied or not; Megatron's mtp_process embedding),
// synchronised as the tied copy is. Note [MTP loss] in gpt_model.cpp says how its loss enters the
// gradient and the tracker.
#pragma once

#include <memory>
#include <optional>

#include "megatron/core/models/common/embeddings/language_model_embedding.h"
#include "megatron/core/models/common/embeddings/rotary_pos_embedding.h"
#include "megatron/core/tensor_parallel/layers.h"
#include "megatron/core/transformer/kv_cache.h"
#include "megatron/core/transformer/module.h"
#include "megatron/core/transformer/multi_token_prediction.h"
#include "megatron/core/transformer/transformer_block.h"

namespace megatron {

class GPTModel : public ModelChunk {
 public:
  /// Builds the modules, registers and allocates the parameters on `device` (not initialised:
  /// call init_weights or load a checkpoint). Calls config.finalize() first. `spec`: one layer spec
  /// per decoder layer (default: get_gpt_decoder_block_spec of the finalized config).
  GPTModel(TransformerConfig config, Device device = Device::cpu(), const ParallelState* ps = nullptr,
           int vp_stage = 0, std::optional<TransformerBlockSpec> spec = std::nullopt);

  struct Stash : ModelStash {
    uint64_t rng_base = 0;
    LanguageModelEmbedding::Saved embedding;
    TransformerBlock::Saved decoder;
    AttentionInputs attn;  // the rotary angles of this rank's positions (RoPE) and the documents
    Tensor hidden;  // final-normed hidden states [s, b, h]
    Tensor logits;  // [s, b, padded_vocab]; becomes its own gradient in backward
    Tensor labels;  // [s, b]
    Tensor lse;     // [s·b] fp32
    struct MtpDepth {  // one MTP depth's activations (the last stage)
      LanguageModelEmbedding::Saved embedding;
      MultiTokenPredictionLayer::Saved layer;
      Tensor hidden, logits, labels, lse;  // as the main head's, for this depth's shifted labels
      Tensor grad_losses;                  // [s·b] fp32: the gradient of its per-token losses (Note [MTP loss])
    };
    std::vector<MtpDepth> mtp;
  };

  /// tokens, position_ids, labels: [b, s] int. Returns the per-token losses [b, s] fp32
  /// (Megatron's GPTModel.forward with labels). position_ids may be undefined (0..s-1).
  /// cu_seqlens: the documents packed in each row (host int32 [b, n + 1], Note [Packed
  /// sequences]; Megatron's packed_seq_params), undefined: causal over each row.
  /// Under context parallelism tokens/position_ids/labels are this rank's rows (Note
  /// [Load-balanced chunks]) and cu_seqlens the whole sequence's.
  /// loss_mask [b, s] fp32 (undefined: every token) weighs the MTP losses (Note [MTP loss]); the
  /// returned main losses are unmasked, as without MTP.
  Tensor forward(Context& ctx, const Tensor& tokens, const Tensor& position_ids, const Tensor& labels, Stash& stash,
                 const Tensor& cu_seqlens = Tensor(), const Tensor& loss_mask = Tensor()) const;
  /// Inference: logits [s, b, padded_vocab] (model dtype) for tokens [b, s]; no loss, nothing kept.
  Tensor forward_logits(Context& ctx, const Tensor& tokens, const Tensor& position_ids) const;
  /// grad_losses [b, s] fp32 (d loss / d per-token loss). Accumulates into the parameters' main_grad.
  void backward(Context& ctx, const Tensor& grad_losses, Stash& stash) const;

  /// One pipeline stage: the first stage reads tokens/position_ids, the others `input` (the previous
  /// stage's output). Returns the per-token losses [b, s] on the last stage (labels needed there,
  /// and with MTP also tokens, position_ids and loss_mask: has_mtp()), else the activations to send on.
  Tensor forward_step(Context& ctx, const Tensor& tokens, const Tensor& position_ids, const Tensor& labels,
                      const Tensor& input, Stash& stash, const Tensor& cu_seqlens = Tensor(),
                      const Tensor& loss_mask = Tensor()) const;
  /// This chunk holds the MTP block (the last stage of a model with --mtp-num-layers).
  bool has_mtp() const { return !mtp_layers_.empty(); }
  const std::vector<std::unique_ptr<MultiTokenPredictionLayer>>& mtp_layers() const { return mtp_layers_; }
  /// output_grad: grad_losses [b, s] on the last stage, else the gradient of this stage's output.
  /// Returns the gradient of `input` (undefined on the first stage).
  Tensor backward_step(Context& ctx, const Tensor& output_grad, Stash& stash) const;

  // ---- ModelChunk ----
  bool pre_process() const override { return pre_process_; }
  bool post_process() const override { return post_process_; }
  /// The shape of the activations this chunk exchanges for a [b, s] microbatch.
  Shape stage_activation_shape(int64_t micro_batch, int64_t seq_length) const override;
  DType activation_dtype() const override { return config_.params_dtype; }
  /// Random offsets one microbatch uses (the same on every stage).
  uint64_t random_streams_per_microbatch() const override;
  std::unique_ptr<ModelStash> make_stash() const override { return std::make_unique<Stash>(); }
  Tensor backward_step(Context& ctx, const Tensor& output_grad, ModelStash& stash) const override {
    return backward_step(ctx, output_grad, stash_cast<Stash>(stash));
  }
  /// The word embeddings when the output layer shares them on this chunk (twice per microbatch), and
  /// with MTP the embeddings and output head once more per depth.
  std::vector<std::pair<const Parameter*, int>> repeated_accumulations() const override;
  /// Token ids below the padded vocabulary; position ids below --max-position-embeddings (learned positions).
  InputRanges input_ranges() const override;

  // ---- inference with a KV cache (megatron/core/inference) ----
  /// tokens [b, s] (int) are the next s tokens of b sequences: sequence i lives in cache slot
  /// slots[i] and its new tokens sit at positions starts[i] .. starts[i]+s-1 (right padding: a
  /// shorter sequence's extra tokens are written past its end and overwritten later). Appends
  /// their keys/values to the cache and returns the logits [s, b, padded_vocab] of the new tokens,
  /// equal to forward_logits on each full sequence. The model must be built with dropout off.
  /// output_rows, when non-empty, picks the rows (j·b + i: sequence i's token j) that need logits:
  /// the output layer runs on those rows only and the result is [output_rows.size(), padded_vocab]
  /// (a prefill needs one row per sequence, not s·b rows of the whole vocabulary). Under tensor
  /// parallelism (sequence parallelism off) every rank of the group calls it with the same
  /// arguments and its own cache shard, and every rank gets the whole vocabulary's logits (Note
  /// [Tensor-parallel inference] in core/inference/inference_group.h).
  Tensor forward_inference(Context& ctx, const Tensor& tokens, const std::vector<int64_t>& slots,
                           const std::vector<int64_t>& starts, KVCache& cache,
                           const std::vector<int64_t>& output_rows = {}) const;
  /// The two halves of forward_inference. inference_inputs: the host half — checks the slots,
  /// starts and positions and puts a forward's inputs on the device. The second: the device half,
  /// which reads nothing back from the device, so a decode step can be recorded into a CUDA graph
  /// when inference_capturable() (InferenceEngine's Note [Decode graphs]).
  InferenceInputs inference_inputs(Context& ctx, const Tensor& tokens, const std::vector<int64_t>& slots,
                                   const std::vector<int64_t>& starts, const KVCache& cache) const;
  Tensor forward_inference(Context& ctx, const InferenceInputs& in, KVCache& cache,
                           const std::vector<int64_t>& output_rows = {}) const;
  /// Whether the device half synchronises with nothing: not with MoE layers (their token counts),
  /// multi-latent attention, sinks or windows (per-sequence host loops) or FP8.
  bool inference_capturable() const;

  void init_weights(uint64_t seed) override;
  /// Also declares, on every rank, the losses the MoE layers of this config report (every stage
  /// declares the same names, MoE layers or not: the tracker's reduction is collective).
  void set_aux_loss_tracker(AuxLossTracker* tracker) override;
  void finish_router_step(Context& ctx) override;
  void finish_fp8_step(Context& ctx) override;
  void begin_fp8_step(bool cache_weights, bool keep_expert_transposes) override;
  /// "decoder.layers.L.mlp.router.expert_bias" of each MoE layer with --moe-router-enable-expert-bias;
  /// with the delayed FP8 recipe each FP8 linear layer's scaling state (optional: Note [FP8 state in
  /// checkpoints]).
  std::vector<ModelBuffer> buffers() override;
  const TransformerConfig& config() const { return config_; }
  const TransformerBlock& decoder() const { return *decoder_; }
  ParamAndGradBuffer& params() override { return *params_; }
  const ParamAndGradBuffer& params() const override { return *params_; }

 private:
  TransformerConfig config_;
  const ParallelState* ps_ = nullptr;  // null: single device
  ProcessGroupCollection pg_;          // the groups of ps_ the modules use
  bool pre_process_ = true, post_process_ = true;
  std::unique_ptr<ParamAndGradBuffer> params_;
  std::unique_ptr<LanguageModelEmbedding> embedding_;
  std::optional<RotaryEmbedding> rotary_;
  mutable std::vector<float> inference_freqs_;  // forward_inference's rotary angle table, grown as needed
  std::unique_ptr<TransformerBlock> decoder_;
  std::unique_ptr<Linear> output_layer_;
  std::vector<std::unique_ptr<MultiTokenPredictionLayer>> mtp_layers_;  // "mtp.layers.k" (the last stage)
  Tensor one_;  // [1] fp32 1 on the model's device (the MTP gradient's normalisation)

  // Embedding (or input) -> decoder -> output layer; fills the stash's activations and logits.
  void forward_to_logits(Context& ctx, const Tensor& tokens, const Tensor& position_ids, const Tensor& input,
                         const Tensor& cu_seqlens, Stash& stash) const;
  Communicator* tp_group() const { return pg_.tp; }
  // The output layer's vocabulary-parallel logits [n, v/tp] gathered into [n, v] on every rank.
  Tensor gather_vocab_shards(Context& ctx, const Tensor& local) const;
  // The per-token cross entropy of logits [N, vl] (vocab-parallel under TP) against labels [N]:
  // losses and lse [N] fp32; its backward turns the logits into their own gradient.
  void cross_entropy(Context& ctx, const Tensor& logits, const Tensor& labels, Tensor& losses, Tensor& lse) const;
  void cross_entropy_backward(Context& ctx, const Tensor& grad_losses, Tensor& logits, const Tensor& labels,
                              const Tensor& lse) const;
  // The MTP block's forward and backward (Note [MTP loss]); mtp_backward returns the gradient of
  // the decoder's final-normed output.
  void mtp_forward(Context& ctx, const Tensor& tokens, const Tensor& position_ids, const Tensor& loss_mask,
                   Stash& stash) const;
  Tensor mtp_backward(Context& ctx, Stash& stash) const;

 public:
  /// The context-parallel group (null: one rank): the loss's token count sums over it.
  Communicator* cp_group() const { return pg_.cp; }
};

/// position_ids [b, s] = 0..s-1 for every sequence (int64, host).
Tensor default_position_ids(int64_t batch, int64_t seq_len);

}  // namespace megatron
