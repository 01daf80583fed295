#include "megatron/core/models/gpt/gpt_model.h"

#include <algorithm>

#include "megatron/core/models/gpt/gpt_layer_specs.h"
#include "megatron/core/parallel_state.h"
#include "megatron/core/tensor_parallel/fp8_linear.h"
#include "megatron/core/transformer/context_parallel.h"
#include "megatron/kernels/ops.h"

namespace megatron {

namespace {
TransformerConfig finalized(TransformerConfig c) {
  c.finalize();
  return c;
}
}  // namespace

GPTModel::GPTModel(TransformerConfig config, Device device, const ParallelState* ps, int vp_stage,
                   std::optional<TransformerBlockSpec> spec)
    : config_(finalized(std::move(config))),
      ps_(ps),
      pg_(ProcessGroupCollection::from(ps)),
      params_(std::make_unique<ParamAndGradBuffer>(config_.params_dtype, device)) {
  if (ps_) {
    MG_ASSERT(config_.tensor_model_parallel_size == ps_->tp_size() &&
                  config_.pipeline_model_parallel_size == ps_->pp_size() &&
                  config_.virtual_pipeline_model_parallel_size == ps_->vpp_size(),
              "the model config's layout (tp {}, pp {}, vpp {}) differs from the parallel state's ({})",
              config_.tensor_model_parallel_size, config_.pipeline_model_parallel_size,
              config_.virtual_pipeline_model_parallel_size, ps_->describe());
    MG_ASSERT(config_.expert_model_parallel_size == ps_->ep_size() &&
                  config_.expert_tensor_parallel_size == ps_->etp_size(),
              "the model config's expert layout (ep {}, etp {}) differs from the parallel state's ({})",
              config_.expert_model_parallel_size, config_.expert_tensor_parallel_size, ps_->describe());
    MG_ASSERT(vp_stage >= 0 && vp_stage < ps_->vpp_size(), "model chunk {} of {}", vp_stage, ps_->vpp_size());
    MG_ASSERT(ps_->tp_size() == 1 || config_.sequence_parallel == ps_->sequence_parallel(),
              "the model config's sequence parallelism ({}) differs from the parallel state's ({})",
              config_.sequence_parallel, ps_->sequence_parallel());
    pre_process_ = ps_->pp_rank() == 0 && vp_stage == 0;
    post_process_ = ps_->pp_rank() == ps_->pp_size() - 1 && vp_stage == ps_->vpp_size() - 1;
  }
  const LayerRange layers =
      ps_ ? pipeline_layer_range(config_, ps_->pp_rank(), vp_stage) : LayerRange{0, config_.num_layers};
  // Megatron's mtp_process: the MTP block goes with the last stage (mtp_on_this_rank).
  const bool mtp = post_process_ && config_.mtp_num_layers > 0;
  if (pre_process_ || mtp) embedding_ = std::make_unique<LanguageModelEmbedding>(config_, *params_, "embedding", pg_);
  if (mtp && !pre_process_) {
    // The MTP stage's copy of the word embeddings, tied or not (Megatron's setup_embeddings_and_output_layer):
    // kept equal to the first stage's like the tied output layer's copy.
    embedding_->word_embeddings()->shared_embedding_copy = true;
  }
  if (config_.use_rope()) rotary_.emplace(config_);
  const TransformerBlockSpec block_spec = spec ? *spec : get_gpt_decoder_block_spec(config_);
  decoder_ = std::make_unique<TransformerBlock>(config_, block_spec, *params_, "decoder", pg_, layers, post_process_);
  if (mtp) {
    // Megatron's get_gpt_mtp_block_spec: every depth's layer is the decoder's last layer spec.
    MG_ASSERT(!block_spec.layers.empty(), "an empty decoder block spec");
    TransformerLayerSpec layer_spec = block_spec.layers.back();
    layer_spec.fp8 = false;  // refused with MTP (TransformerConfig::finalize_mtp)
    for (int k = 0; k < config_.mtp_num_layers; ++k) {
      mtp_layers_.push_back(std::make_unique<MultiTokenPredictionLayer>(
          config_, layer_spec, *params_, fmt::format("mtp.layers.{}", k), pg_, config_.num_layers + k));
    }
    one_ = Tensor::from_floats({1.0f}, {1}, DType::Float32, device);
  }
  if (post_process_) {
    if (!config_.share_embeddings_and_output_weights) {
      output_layer_ = std::make_unique<Linear>(*params_, "output_layer", config_.hidden_size,
                                               config_.padded_vocab_size, /*bias=*/false, ParamInit::Normal,
                                               ParallelMode::Column, pg_.tp, config_.sequence_parallel);
    } else if (embedding_) {  // the first stage's embeddings, or the MTP stage's copy
      output_layer_ = std::make_unique<Linear>(embedding_->word_embeddings(), ParallelMode::Column, pg_.tp,
                                               config_.sequence_parallel);
    } else {
      Parameter* copy = params_->add("embedding.word_embeddings.weight",
                                     tp_shard({config_.padded_vocab_size, config_.hidden_size}, 0, pg_.tp),
                                     /*no_weight_decay=*/false, ParamInit::Normal);
      copy->shared_embedding_copy = true;
      output_layer_ = std::make_unique<Linear>(copy, ParallelMode::Column, pg_.tp, config_.sequence_parallel);
    }
  }
  if (pre_process_ && !post_process_ && (config_.share_embeddings_and_output_weights || config_.mtp_num_layers > 0)) {
    embedding_->word_embeddings()->in_embedding_group = true;
  }
  // Megatron's is_embedding_or_output_parameter (--decoupled-lr): the first stage's word embeddings
  // and the last stage's output weight. Every copy of the word embeddings is marked (the MTP stage's
  // too, which Megatron leaves out), so that copies kept equal by their all-reduced gradients also
  // take the same steps.
  for (const char* name : {"embedding.word_embeddings.weight", "output_layer.weight"}) {
    if (Parameter* p = params_->find(name)) p->is_embedding_or_output_parameter = true;
  }
  params_->allocate({}, 1, /*with_grads=*/!config_.inference_only);
}

void GPTModel::set_aux_loss_tracker(AuxLossTracker* tracker) {
  ModelChunk::set_aux_loss_tracker(tracker);
  decoder_->set_aux_loss_tracker(tracker);
  if (tracker && config_.is_moe()) {
    // The MTP layers' routers report after the decoder's (Megatron's num_layers + mtp_num_layers).
    moe::TopKRouter::declare_router_losses(*tracker, moe::moe_config(config_).router,
                                           config_.num_layers + config_.mtp_num_layers, pg_.tp_cp);
  }
  // Megatron's MTPLossLoggingHelper: "mtp_k loss" per depth, declared on every rank (the
  // reduction is collective), reported by the last stage, averaged over the data-parallel ranks.
  if (tracker) {
    for (int k = 1; k <= config_.mtp_num_layers; ++k) tracker->declare(fmt::format("mtp_{} loss", k), 1);
  }
}

void GPTModel::finish_router_step(Context& ctx) {
  if (!config_.is_moe()) return;
  std::vector<TransformerLayer*> layers;
  for (const auto& layer : decoder_->layers()) layers.push_back(layer.get());
  for (const auto& m : mtp_layers_) layers.push_back(&m->transformer_layer());
  for (TransformerLayer* layer : layers) {
    if (moe::MoELayer* m = layer->moe()) {
      m->router().update_expert_bias(ctx, config_.moe_router_bias_update_rate, {pg_.tp_cp, pg_.dp});
      m->router().reset_global_aux_loss_tracker(ctx);
    }
  }
}

// Note [FP8 scaling under parallelism]: the delayed recipe's amax of a tensor is its maximum over
// the step's microbatches on this rank (row 0 of the history) and then, as Megatron's amax
// reduction group does (tensor × context × data parallel), over the ranks that hold the same layer:
// one all-reduce (max) of every FP8 layer's row 0 over tp × cp, then over dp, before the histories
// roll. A tensor-parallel shard's amax so becomes its whole tensor's and every data-parallel replica
// scales alike — a layout quantises as one process does. (Megatron/TE reduce after each forward
// and backward pass; once per step after the last backward here, so the step's scales are those
// of the previous steps, as TE's per-microbatch updates would also give with one microbatch.)
// The routed experts' states reduce over the ranks that hold the same expert instead — expert
// tensor parallel, then expert data parallel (Note [FP8 experts]) — so that every expert-parallel
// layout scales each expert by its own tokens' amax, as one process does. (Megatron hands TE one
// amax group, tp × cp × dp, for every module; TE reduces a rank's amaxes position by position
// there, which under expert parallelism puts different experts of different ranks together.)
// The current-scaling recipes (tensorwise, blockwise) keep no state across steps: each rank
// scales its local tensors by their own amax, as TE does for tensor-parallel shards.
namespace {
// Row 0 of every state's amax history (this step's amax), all-reduced (max) over each group in turn.
void reduce_amax(Context& ctx, const std::vector<Fp8TensorScaling*>& states, std::initializer_list<Communicator*> groups) {
  bool any = false;
  for (Communicator* g : groups) any = any || g;
  if (states.empty() || !any) return;
  int64_t total = 0;
  for (const Fp8TensorScaling* s : states) total += s->size();
  Tensor rows = Tensor::empty({total}, DType::Float32, ctx.device());
  auto each_row0 = [&](auto&& copy) {
    int64_t offset = 0;
    for (Fp8TensorScaling* s : states) {
      Tensor row0 = s->mutable_amax_history().flat_slice(0, s->size());
      Tensor slot = rows.flat_slice(offset, s->size());
      copy(row0, slot);
      offset += s->size();
    }
  };
  each_row0([&](Tensor& row0, Tensor& slot) {
    copy_bytes(slot.raw_data(), ctx.device(), row0.raw_data(), ctx.device(), size_t(row0.nbytes()), ctx.stream());
  });
  for (Communicator* g : groups) {
    if (g) g->all_reduce(ctx, rows, ReduceOp::Max)->wait();
  }
  each_row0([&](Tensor& row0, Tensor& slot) {
    copy_bytes(row0.raw_data(), ctx.device(), slot.raw_data(), ctx.device(), size_t(row0.nbytes()), ctx.stream());
  });
}

std::vector<Fp8TensorScaling*> scaling_states(const std::vector<Linear*>& linears) {
  std::vector<Fp8TensorScaling*> states;
  for (Linear* l : linears) {
    states.push_back(&l->fp8()->forward_scaling());
    states.push_back(&l->fp8()->backward_scaling());
  }
  return states;
}
}  // namespace

void GPTModel::begin_fp8_step(bool cache_weights, bool keep_expert_transposes) {
  for (const auto& layer : decoder_->layers()) {
    for (Linear* l : layer->fp8_linears()) l->fp8()->set_weight_cache(cache_weights);
    for (Linear* l : layer->fp8_expert_linears()) {
      l->fp8()->set_weight_cache(cache_weights);
      l->fp8()->set_keep_transposed_weight(keep_expert_transposes);
    }
  }
}

void GPTModel::finish_fp8_step(Context& ctx) {
  if (!config_.fp8.enabled()) return;
  begin_fp8_step(false, false);  // Note [FP8 weight cache]: the optimizer changes the weights next
  if (config_.fp8.recipe != Fp8Recipe::Delayed) return;
  std::vector<Linear*> dense, experts;
  for (const auto& layer : decoder_->layers()) {
    dense.insert(dense.end(), layer->fp8_linears().begin(), layer->fp8_linears().end());
    experts.insert(experts.end(), layer->fp8_expert_linears().begin(), layer->fp8_expert_linears().end());
  }
  // Every rank of a group holds the same layers (the same local experts, for the expert groups),
  // in the same order, so the concatenated rows line up.
  reduce_amax(ctx, scaling_states(dense), {multi_rank(pg_.tp_cp), multi_rank(pg_.dp)});
  reduce_amax(ctx, scaling_states(experts), {multi_rank(pg_.expt_tp), multi_rank(pg_.expt_dp)});
  std::vector<Fp8TensorScaling*> states = scaling_states(dense);
  const std::vector<Fp8TensorScaling*> expert_states = scaling_states(experts);
  states.insert(states.end(), expert_states.begin(), expert_states.end());
  update_fp8_scaling(ctx, states);
}

// Note [FP8 state in checkpoints]: the delayed recipe's scales and amax histories of each FP8
// linear layer ("<layer>.fp8_forward_scale" [2], "<layer>.fp8_forward_amax_history" [L, 2] — input,
// weight — and "<layer>.fp8_backward_scale" [1], "<layer>.fp8_backward_amax_history" [L, 1] — the
// output gradient; TE's fp8 meta in Megatron's _extra_state), the same on every rank of the layer
// once reduced, so written once like the expert biases. A routed expert's are under its weights'
// name (the global expert index: "...mlp.experts.local_experts.<g>.linear_fc1.fp8_forward_scale"),
// written by the ranks that write the expert weights (ModelBuffer::expert), so they load into any
// expert-parallel layout. They are optional: a bf16 checkpoint loads
// into an FP8 run with fresh state (scales 1, empty histories, as a new TE module) and an FP8
// checkpoint into a bf16 run ignores them. The scale inverses are not saved: each quantisation
// writes them from the scale.
std::vector<ModelBuffer> GPTModel::buffers() {
  std::vector<ModelBuffer> out;
  for (size_t i = 0; i < decoder_->layers().size(); ++i) {
    moe::MoELayer* m = decoder_->layers()[i]->moe();
    if (m && m->router().expert_bias().defined()) {
      out.push_back({fmt::format("decoder.layers.{}.mlp.router.expert_bias", decoder_->first_layer() + int(i)),
                     &m->router().expert_bias()});
    }
  }
  for (size_t k = 0; k < mtp_layers_.size(); ++k) {
    moe::MoELayer* m = mtp_layers_[k]->transformer_layer().moe();
    if (m && m->router().expert_bias().defined()) {
      out.push_back({fmt::format("mtp.layers.{}.transformer_layer.mlp.router.expert_bias", k),
                     &m->router().expert_bias()});
    }
  }
  if (config_.fp8.enabled() && config_.fp8.recipe == Fp8Recipe::Delayed) {
    for (const auto& layer : decoder_->layers()) {
      for (bool expert : {false, true}) {
        for (Linear* l : expert ? layer->fp8_expert_linears() : layer->fp8_linears()) {
          for (auto [pass, s] : {std::pair<const char*, Fp8TensorScaling*>{"forward", &l->fp8()->forward_scaling()},
                                 {"backward", &l->fp8()->backward_scaling()}}) {
            out.push_back({fmt::format("{}.fp8_{}_scale", l->name(), pass), &s->mutable_scales(), true, expert});
            out.push_back(
                {fmt::format("{}.fp8_{}_amax_history", l->name(), pass), &s->mutable_amax_history(), true, expert});
          }
        }
      }
    }
  }
  return out;
}

void GPTModel::init_weights(uint64_t seed) {
  params_->init_weights(seed, config_.init_method_std, config_.num_layers, config_.layernorm_zero_centered_gamma);
}

std::vector<std::pair<const Parameter*, int>> GPTModel::repeated_accumulations() const {
  // Tied word embeddings on one stage accumulate twice per microbatch (output layer, embedding);
  // with MTP the embedding and the output layer also run once per depth.
  const int depths = int(mtp_layers_.size());
  const bool tied = config_.share_embeddings_and_output_weights;
  std::vector<std::pair<const Parameter*, int>> out;
  auto add = [&](const Parameter* p, int times) {
    if (p && times > 1) out.emplace_back(p, times);
  };
  if (embedding_) {
    add(embedding_->word_embeddings(), (pre_process_ ? 1 : 0) + depths + (post_process_ && tied ? 1 + depths : 0));
    if (pre_process_ && config_.use_learned_positions()) add(params_->find("embedding.position_embeddings.weight"), 1 + depths);
  }
  if (post_process_ && !tied) add(output_layer_->weight(), 1 + depths);
  return out;
}

ModelChunk::InputRanges GPTModel::input_ranges() const {
  return {config_.padded_vocab_size, config_.use_learned_positions() ? config_.max_position_embeddings : 0};
}

uint64_t GPTModel::random_streams_per_microbatch() const {
  return 1 + uint64_t(config_.num_layers) * TransformerLayer::kRandomStreams +
         uint64_t(config_.mtp_num_layers) * MultiTokenPredictionLayer::kRandomStreams;
}

Shape GPTModel::stage_activation_shape(int64_t micro_batch, int64_t seq_length) const {
  const int64_t tp = tp_group() && config_.sequence_parallel ? tp_group()->size() : 1;
  return {seq_length / group_size(pg_.cp) / tp, micro_batch, config_.hidden_size};
}

void GPTModel::forward_to_logits(Context& ctx, const Tensor& tokens, const Tensor& position_ids, const Tensor& input,
                                 const Tensor& cu_seqlens, Stash& stash) const {
  const int64_t h = config_.hidden_size;
  const int cp = group_size(pg_.cp), cp_rank = group_rank(pg_.cp);
  Tensor x;
  int64_t s = 0, b = 0;
  if (pre_process_) {
    MG_ASSERT(tokens.dim() == 2, "tokens {}", shape_str(tokens.shape()));
    b = tokens.size(0), s = tokens.size(1);
    if (config_.use_learned_positions()) {
      MG_CHECK(s <= config_.max_position_embeddings, "sequence length {} exceeds --max-position-embeddings {}", s,
               config_.max_position_embeddings);
    }
    Tensor positions = position_ids;
    if (!positions.defined()) {
      positions = cp > 1 ? cp_split_rows(default_position_ids(b, s * cp), cp_rank, cp) : default_position_ids(b, s);
    }
    if (positions.device() != tokens.device()) positions = positions.to(tokens.device());
    x = embedding_->forward(ctx, tokens, positions, stash.rng_base, stash.embedding);
  } else {
    MG_ASSERT(input.defined() && input.dim() == 3, "a pipeline stage after the first needs its input activations");
    x = input;
    b = input.size(1);
    s = input.size(0) * (tp_group() && config_.sequence_parallel ? tp_group()->size() : 1);
  }
  // Under context parallelism s is this rank's rows: the angles and documents are the whole
  // sequence's, cut to its rows (Note [Load-balanced chunks]).
  if (rotary_) {
    stash.attn.freqs = cp > 1 ? gather_rows(ctx, rotary_->freqs(ctx, s * cp), cp_positions(cp_rank, cp, s * cp))
                              : rotary_->freqs(ctx, s);
  }
  if (cu_seqlens.defined()) {
    auto packed = std::make_shared<PackedSeqParams>(make_packed_seq_params(cu_seqlens, ctx.device()));
    MG_CHECK(packed->batch == b && packed->seq_length == s * cp,
             "the documents (cu_seqlens {}) are not those of {} sequences of {} positions", cu_seqlens.str(), b, s * cp);
    if (cp > 1) add_context_parallel_chunks(*packed, cp, ctx.device());
    stash.attn.packed = std::move(packed);
  }
  stash.hidden = decoder_->forward(ctx, x, stash.attn, stash.rng_base + 1, stash.decoder);
  if (post_process_) {
    stash.logits = output_layer_->forward(ctx, stash.hidden.view({-1, h})).view({s, b, output_layer_->out_features()});
  }
}

Tensor GPTModel::forward_logits(Context& ctx, const Tensor& tokens, const Tensor& position_ids) const {
  MG_CHECK(pre_process_ && post_process_ && !tp_group() && !pg_.cp,
           "full-sequence logits need the whole model on one rank");
  Stash stash;
  stash.rng_base = ctx.rng().offset;
  forward_to_logits(ctx, tokens, position_ids, Tensor(), Tensor(), stash);
  return stash.logits;
}

Tensor GPTModel::forward(Context& ctx, const Tensor& tokens, const Tensor& position_ids, const Tensor& labels,
                         Stash& stash, const Tensor& cu_seqlens, const Tensor& loss_mask) const {
  MG_ASSERT(pre_process_ && post_process_, "forward() runs a whole model; a pipeline stage uses forward_step()");
  return forward_step(ctx, tokens, position_ids, labels, Tensor(), stash, cu_seqlens, loss_mask);
}

void GPTModel::cross_entropy(Context& ctx, const Tensor& logits, const Tensor& labels, Tensor& losses,
                             Tensor& lse) const {
  const int64_t n = logits.size(0);
  if (Communicator* tp = tp_group()) {
    // Megatron's _VocabParallelCrossEntropy: the row max, then Σexp and the target logit, each
    // reduced over the vocabulary shards.
    Tensor max = Tensor::empty({n}, DType::Float32, ctx.device());
    ops::cross_entropy_local_max(ctx, logits, max);
    tp->all_reduce(ctx, max, ReduceOp::Max)->wait();
    Tensor sums = Tensor::empty({2, n}, DType::Float32, ctx.device());
    ops::cross_entropy_local_sums(ctx, logits, labels, logits.size(1) * tp->rank(), max, sums);
    tp->all_reduce(ctx, sums, ReduceOp::Sum)->wait();
    ops::cross_entropy_from_sums(ctx, max, sums, losses, lse);
  } else {
    ops::cross_entropy_forward(ctx, logits, labels, losses, lse);
  }
}

void GPTModel::cross_entropy_backward(Context& ctx, const Tensor& grad_losses, Tensor& logits, const Tensor& labels,
                                      const Tensor& lse) const {
  // The fused cross-entropy backward turns the logits into their own gradient in place.
  if (Communicator* tp = tp_group()) {
    ops::vocab_parallel_cross_entropy_backward(ctx, grad_losses, logits, labels, logits.size(1) * tp->rank(), lse,
                                               logits);
  } else {
    ops::cross_entropy_backward(ctx, grad_losses, logits, labels, lse, logits);
  }
}

// Note [MTP loss]: Megatron's process_mtp_loss with calculate_per_token_loss off. Depth k's loss is
// its mean over the tokens its shifted loss mask keeps, L_k = Σ mask_k·ce_k / max(Σ mask_k, 1), and
// the training objective adds (mtp_loss_scaling_factor / D)·Σ_k L_k to the main loss. Megatron's
// MTPLossAutoScaler gives that term the gradient scale of the main loss — the loss scale over the
// number of microbatches, without the main loss's context-parallel factor (refused with MTP) — so
// ce_k's gradient is mask_k · scale · factor / (D · Σ mask_k), known at forward time (the MoE aux
// losses do the same) and kept in the stash for backward. The scale is the aux-loss tracker's
// backward scale (1 without a tracker: the gradient of the plain objective). The tracker gets L_k
// under "mtp_k loss" in training steps (not in evaluation, as Megatron logs it only in training):
// summed over the step's microbatches, divided by their number and averaged over the data-parallel
// ranks by AuxLossTracker::report (Megatron's track_mtp_metrics). The main loss is unchanged.
void GPTModel::mtp_forward(Context& ctx, const Tensor& tokens, const Tensor& position_ids, const Tensor& loss_mask,
                           Stash& stash) const {
  const int64_t s = stash.labels.size(0), b = stash.labels.size(1), h = config_.hidden_size;
  const int64_t vl = output_layer_->out_features();
  auto on_device = [&](const Tensor& t) { return t.device() == ctx.device() ? t : t.to(ctx.device()); };
  MG_CHECK(tokens.defined() && tokens.dim() == 2 && tokens.size(0) == b && tokens.size(1) == s,
           "the MTP block on the last stage needs the microbatch's tokens [{}, {}] (got {})", b, s,
           tokens.defined() ? tokens.str() : "none");
  Tensor ids = on_device(tokens);
  Tensor positions = on_device(position_ids.defined() ? position_ids : default_position_ids(b, s));
  Tensor mask = Tensor::empty({s, b}, DType::Float32, ctx.device());
  if (loss_mask.defined()) {
    ops::transpose_01(ctx, on_device(loss_mask.to(DType::Float32)), mask);
  } else {
    mask = Tensor::from_floats(std::vector<float>(size_t(s * b), 1.0f), {s, b}, DType::Float32, ctx.device());
  }
  Tensor labels = stash.labels;
  Tensor hidden = stash.hidden;
  AuxLossTracker* tracker = aux_loss_tracker();
  const bool training = !(tracker && tracker->evaluating());
  const int depths = int(mtp_layers_.size());
  const float scale = (tracker ? tracker->backward_scale() : 1.0f) * config_.mtp_loss_scaling_factor / float(depths);
  // Megatron's MTP with calculate_per_token_loss: each depth's summed loss is normalised by its own
  // (rolled) tokens and multiplied by the microbatch's tokens before rolling, which
  // finalize_model_grads then divides by the global batch's (Note [Per-token loss]).
  Tensor original;  // [2]; [1] = Σ mask before rolling (Megatron's original_num_tokens)
  if (config_.calculate_per_token_loss) {
    original = Tensor::empty({2}, DType::Float32, ctx.device());
    ops::masked_loss_sums(ctx, mask.view({s * b}), mask.view({s * b}), original);
  }
  stash.mtp.assign(size_t(depths), Stash::MtpDepth{});
  for (int k = 0; k < depths; ++k) {
    Stash::MtpDepth& d = stash.mtp[size_t(k)];
    const uint64_t rng = stash.rng_base + 1 + uint64_t(config_.num_layers) * TransformerLayer::kRandomStreams +
                         uint64_t(k) * MultiTokenPredictionLayer::kRandomStreams;
    // Megatron's _get_embeddings: the input ids and position ids shifted once more per depth.
    ids = roll_tokens_left(ctx, ids);
    positions = roll_tokens_left(ctx, positions);
    Tensor emb = embedding_->forward(ctx, ids, positions, rng, d.embedding);
    hidden = mtp_layers_[size_t(k)]->forward(ctx, emb, hidden, stash.attn, rng + 1, d.layer, tracker);
    d.hidden = hidden;
    d.logits = output_layer_->forward(ctx, hidden.view({-1, h})).view({s * b, vl});
    labels = roll_sequence_left(ctx, labels);
    mask = roll_sequence_left(ctx, mask);
    d.labels = labels;
    Tensor losses = Tensor::empty({s * b}, DType::Float32, ctx.device());
    d.lse = Tensor::empty({s * b}, DType::Float32, ctx.device());
    cross_entropy(ctx, d.logits, labels.view({s * b}), losses, d.lse);
    Tensor sums = Tensor::empty({2}, DType::Float32, ctx.device());
    ops::masked_loss_sums(ctx, losses, mask.view({s * b}), sums);
    d.grad_losses = Tensor::empty({s * b}, DType::Float32, ctx.device());
    ops::masked_loss_backward_normalized(ctx, mask.view({s * b}), sums,
                                         original.defined() ? original.flat_slice(1, 1) : one_, d.grad_losses);
    ops::scale_(ctx, d.grad_losses, scale);
    if (tracker && training) {
      Tensor mean = Tensor::empty({1}, DType::Float32, ctx.device());  // sums[0] / sums[1] (0 without tokens)
      ops::masked_loss_backward_normalized(ctx, Tensor(), sums, sums.flat_slice(0, 1), mean);
      tracker->add(ctx, fmt::format("mtp_{} loss", k + 1), 0, mean);
    }
  }
}

Tensor GPTModel::mtp_backward(Context& ctx, Stash& stash) const {
  const int64_t h = config_.hidden_size;
  Tensor grad_next;  // the gradient of depth k's output from depth k + 1's hnorm
  for (int k = int(mtp_layers_.size()) - 1; k >= 0; --k) {
    Stash::MtpDepth& d = stash.mtp[size_t(k)];
    const int64_t n = d.logits.size(0);
    cross_entropy_backward(ctx, d.grad_losses, d.logits, d.labels.view({n}), d.lse);
    Tensor grad = output_layer_->backward(ctx, d.logits, d.hidden.view({-1, h})).view(d.hidden.shape());
    if (grad_next.defined()) ops::add(ctx, grad, grad_next, grad);
    d.logits = d.hidden = d.lse = Tensor();
    auto [grad_embedding, grad_hidden] = mtp_layers_[size_t(k)]->backward(ctx, grad, stash.attn, d.layer);
    embedding_->backward(ctx, grad_embedding, d.embedding);
    grad_next = grad_hidden;
  }
  return grad_next;
}

Tensor GPTModel::forward_step(Context& ctx, const Tensor& tokens, const Tensor& position_ids, const Tensor& labels,
                              const Tensor& input, Stash& stash, const Tensor& cu_seqlens,
                              const Tensor& loss_mask) const {
  MG_CHECK(!has_mtp() || !cu_seqlens.defined(),
           "--mtp-num-layers with packed documents (--reset-attention-mask) is not supported");
  stash.rng_base = ctx.rng().offset;
  ctx.rng().offset += random_streams_per_microbatch();
  forward_to_logits(ctx, tokens, position_ids, input, cu_seqlens, stash);
  if (!post_process_) {
    Tensor out = stash.hidden;
    stash.hidden = Tensor();
    return out;
  }
  MG_ASSERT(labels.dim() == 2, "labels {}", shape_str(labels.shape()));
  const int64_t b = labels.size(0), s = labels.size(1), vl = output_layer_->out_features();
  stash.labels = Tensor::empty({s, b}, labels.dtype(), ctx.device());
  ops::transpose_01(ctx, labels.device() == ctx.device() ? labels : labels.to(ctx.device()), stash.labels);
  Tensor losses_sb = Tensor::empty({s * b}, DType::Float32, ctx.device());
  stash.lse = Tensor::empty({s * b}, DType::Float32, ctx.device());
  cross_entropy(ctx, stash.logits.view({s * b, vl}), stash.labels.view({s * b}), losses_sb, stash.lse);
  if (has_mtp()) mtp_forward(ctx, tokens, position_ids, loss_mask, stash);
  Tensor losses = Tensor::empty({b, s}, DType::Float32, ctx.device());
  ops::transpose_01(ctx, losses_sb.view({s, b}), losses);
  return losses;
}

void GPTModel::backward(Context& ctx, const Tensor& grad_losses, Stash& stash) const {
  backward_step(ctx, grad_losses, stash);
}

Tensor GPTModel::backward_step(Context& ctx, const Tensor& output_grad, Stash& stash) const {
  MG_CHECK(!config_.inference_only, "backward through a model built for inference only (no gradients)");
  const int64_t h = config_.hidden_size;
  Tensor grad_hidden;
  if (post_process_) {
    const int64_t b = output_grad.size(0), s = output_grad.size(1), vl = output_layer_->out_features();
    Tensor grad_losses_sb = Tensor::empty({s, b}, DType::Float32, ctx.device());
    ops::transpose_01(ctx, output_grad, grad_losses_sb);
    Tensor grad_logits = stash.logits.view({s * b, vl});
    cross_entropy_backward(ctx, grad_losses_sb.view({s * b}), grad_logits, stash.labels.view({s * b}), stash.lse);
    grad_hidden = output_layer_->backward(ctx, grad_logits, stash.hidden.view({-1, h}))
                      .view({-1, b, h});
    stash.logits = stash.hidden = stash.lse = Tensor();
    // The decoder's output also feeds the first MTP depth's hnorm.
    if (has_mtp()) ops::add(ctx, grad_hidden, mtp_backward(ctx, stash), grad_hidden);
  } else {
    grad_hidden = output_grad;
  }
  Tensor grad_x = decoder_->backward(ctx, grad_hidden, stash.attn, stash.decoder);
  if (pre_process_) {
    embedding_->backward(ctx, grad_x, stash.embedding);
    grad_x = Tensor();
  }
  stash = Stash{};
  return grad_x;
}

// ---- inference -----------------------------------------------------------------------------------

InferenceInputs GPTModel::inference_inputs(Context& ctx, const Tensor& tokens, const std::vector<int64_t>& slots,
                                           const std::vector<int64_t>& starts, const KVCache& cache) const {
  MG_ASSERT(tokens.dim() == 2, "tokens {}", shape_str(tokens.shape()));
  const int64_t b = tokens.size(0), s = tokens.size(1);
  MG_CHECK(int64_t(slots.size()) == b && int64_t(starts.size()) == b, "{} sequences but {} slots and {} starts", b,
           slots.size(), starts.size());
  MG_CHECK(config_.hidden_dropout == 0.0f && config_.attention_dropout == 0.0f,
           "inference needs a model built with hidden and attention dropout 0");
  MG_CHECK(pre_process_ && post_process_ && !pg_.cp,
           "inference needs every layer on each rank (no pipeline or context parallelism)");
  MG_CHECK(!tp_group() || !config_.sequence_parallel, "inference runs without sequence parallelism: build the model "
           "with sequence_parallel off (Note [Tensor-parallel inference])");
  std::vector<int64_t> positions(size_t(b * s));
  int64_t max_position = 0;
  for (int64_t i = 0; i < b; ++i) {
    for (int64_t j = 0; j < s; ++j) positions[size_t(i * s + j)] = starts[size_t(i)] + j;
    max_position = std::max(max_position, starts[size_t(i)] + s - 1);
  }
  MG_CHECK(max_position < cache.max_length(), "position {} is past the KV cache's {} positions", max_position,
           cache.max_length());
  for (int64_t i = 0; i < b; ++i) {
    MG_CHECK(slots[size_t(i)] >= 0 && slots[size_t(i)] < cache.num_slots() && starts[size_t(i)] >= 0,
             "sequence {}: cache slot {} at position {} does not fit a cache of {} slots", i, slots[size_t(i)],
             starts[size_t(i)], cache.num_slots());
  }
  if (config_.use_learned_positions()) {
    MG_CHECK(max_position < config_.max_position_embeddings, "position {} exceeds --max-position-embeddings {}",
             max_position, config_.max_position_embeddings);
  }
  InferenceInputs in;
  in.tokens = tokens.device() == ctx.device() ? tokens : tokens.to(ctx.device());
  in.position_ids = Tensor::from_ints(positions, {b, s}, DType::Int64, ctx.device());
  if (rotary_) {  // row j·b + i: the angles of sequence i's position starts[i] + j
    // The angle table is computed once (on the host: it is read per row) and grown when a longer
    // position comes; a decode step then reads no device memory back.
    if (int64_t(inference_freqs_.size()) < (max_position + 1) * (rotary_->rotary_dim() / 2))
      inference_freqs_ = rotary_->freqs(ctx, std::max(max_position + 1, cache.max_length())).to_floats();
    const std::vector<float>& table = inference_freqs_;
    const int64_t half = rotary_->rotary_dim() / 2;
    std::vector<float> rows(size_t(s * b * half));
    for (int64_t j = 0; j < s; ++j)
      for (int64_t i = 0; i < b; ++i)
        std::copy_n(table.begin() + (starts[size_t(i)] + j) * half, half, rows.begin() + (j * b + i) * half);
    in.freqs = Tensor::from_floats(rows, {s * b, half}, DType::Float32, ctx.device());
  }
  in.rows = CacheRows{slots, starts, Tensor::from_ints(slots, {b}, DType::Int64, ctx.device()),
                      Tensor::from_ints(starts, {b}, DType::Int64, ctx.device())};
  return in;
}

bool GPTModel::inference_capturable() const {
  return !config_.multi_latent_attention && config_.num_moe_experts == 0 && !config_.has_attention_sinks() &&
         config_.window_size_left < 0 && !config_.fp8.enabled();
}

Tensor GPTModel::forward_inference(Context& ctx, const Tensor& tokens, const std::vector<int64_t>& slots,
                                   const std::vector<int64_t>& starts, KVCache& cache,
                                   const std::vector<int64_t>& output_rows) const {
  return forward_inference(ctx, inference_inputs(ctx, tokens, slots, starts, cache), cache, output_rows);
}

Tensor GPTModel::forward_inference(Context& ctx, const InferenceInputs& in, KVCache& cache,
                                   const std::vector<int64_t>& output_rows) const {
  const int64_t b = in.tokens.size(0), s = in.tokens.size(1), h = config_.hidden_size, v = config_.padded_vocab_size;
  LanguageModelEmbedding::Saved embedding_saved;
  Tensor x = embedding_->forward(ctx, in.tokens, in.position_ids, 0, embedding_saved);
  Tensor hidden = decoder_->forward_inference(ctx, x, in.freqs, in.rows, cache.keys, cache.values);
  Tensor rows = hidden.view({s * b, h});
  if (output_rows.empty()) return gather_vocab_shards(ctx, output_layer_->forward(ctx, rows)).view({s, b, v});
  const int64_t n = int64_t(output_rows.size());
  Tensor picked = Tensor::empty({n, h}, rows.dtype(), rows.device());
  for (int64_t r = 0; r < n;) {  // one copy per run of consecutive rows
    const int64_t first = output_rows[size_t(r)];
    MG_CHECK(first >= 0 && first < s * b, "output row {} is outside the {} rows of the forward", first, s * b);
    int64_t run = 1;
    while (r + run < n && output_rows[size_t(r + run)] == first + run && first + run < s * b) ++run;
    ops::copy_rows(ctx, rows, first, picked, r, run);
    r += run;
  }
  return gather_vocab_shards(ctx, output_layer_->forward(ctx, picked));
}

// Megatron's gather_from_tensor_model_parallel_region on the output layer's logits (its
// parallel_output=False for generation): every rank gets the whole padded vocabulary. The
// all-gather stacks the shards rank-major, [tp, n, v/tp]; one transpose puts each row's shards side
// by side, [n, tp, v/tp] = [n, v]. Inference only: no backward.
Tensor GPTModel::gather_vocab_shards(Context& ctx, const Tensor& local) const {
  Communicator* tp = tp_group();
  if (!tp) return local;
  const int64_t n = local.size(0), shard = local.size(1);
  Tensor stacked = Tensor::empty({tp->size(), n, shard}, local.dtype(), ctx.device());
  tp->all_gather(ctx, local, stacked)->wait();
  Tensor out = Tensor::empty({n, tp->size(), shard}, local.dtype(), ctx.device());
  ops::transpose_01(ctx, stacked, out);
  return out.view({n, tp->size() * shard});
}

Tensor default_position_ids(int64_t batch, int64_t seq_len) {
  std::vector<int64_t> ids(size_t(batch * seq_len));
  for (int64_t i = 0; i < batch; ++i)
    for (int64_t j = 0; j < seq_len; ++j) ids[size_t(i * seq_len + j)] = j;
  return Tensor::from_ints(ids, {batch, seq_len});
}

}  // namespace megatron
