#include "megatron/core/transformer/moe/router.h"

#include "megatron/core/transformer/moe/moe_ops.h"
#include "megatron/kernels/ops.h"

namespace megatron::moe {

TopKRouter::TopKRouter(const RouterConfig& config, int64_t hidden_size, ParamAndGradBuffer& params,
                       const std::string& prefix, int layer_number, int num_layers, const ProcessGroupCollection& pg)
    : config_(config),
      layer_number_(layer_number),
      num_layers_(num_layers),
      tp_cp_(multi_rank(pg.tp_cp)),
      tp_(multi_rank(pg.tp)),
      dp_(multi_rank(pg.dp)) {
  config_.validate();
  MG_CHECK(config_.input_jitter_eps == 0 || group_size(pg.cp) == 1,
           "--moe-input-jitter-eps with context parallelism is not built yet (the jitter is drawn by sequence "
           "position, and context-parallel chunks are not mapped): leave one of them out");
  MG_CHECK(!config_.fp64 || params.device().is_host(),
           "--moe-router-dtype fp64 runs on the CPU only (there is no fp64 GPU router here): use "
           "--moe-router-dtype fp32 on a GPU");
  weight_ = params.add(prefix + ".weight", {config_.num_experts, hidden_size}, /*no_weight_decay=*/false,
                       ParamInit::Normal);
  // The same weight on every tensor-parallel rank, each routing its own sequence shard.
  weight_->tp_duplicate = tp_ != nullptr;
  weight_->sequence_parallel = tp_ != nullptr;
  if (config_.linear_bias) {
    bias_ = params.add(prefix + ".bias", {config_.num_experts}, /*no_weight_decay=*/true, ParamInit::Normal);
    bias_->tp_duplicate = tp_ != nullptr;
    bias_->sequence_parallel = tp_ != nullptr;
  }
  if (config_.expert_bias) expert_bias_ = Tensor::zeros({config_.num_experts}, DType::Float32, params.device());
  tokens_per_expert_ = Tensor::zeros({config_.num_experts}, DType::Float32, params.device());
  if (config_.global_aux_loss_coeff > 0) {
    global_tokens_ = Tensor::zeros({config_.num_experts}, DType::Float32, params.device());
  }
}

void TopKRouter::declare_router_losses(AuxLossTracker& tracker, const RouterConfig& config, int num_layers,
                                       Communicator* tp_cp) {
  using OverDp = AuxLossTracker::OverDp;
  if (config.aux_loss_coeff > 0) tracker.declare("load_balancing_loss", num_layers, tp_cp);
  if (config.seq_aux_loss_coeff > 0) tracker.declare("seq_load_balancing_loss", num_layers, tp_cp);
  if (config.global_aux_loss_coeff > 0) {  // Note [Global aux loss]: a partial sum over tp × dp × cp
    tracker.declare("global_load_balancing_loss", num_layers, tp_cp, OverDp::Sum);
  }
  if (config.z_loss_coeff > 0) tracker.declare("z_loss", num_layers, nullptr, OverDp::None);
}

// Note [Load-balancing counts over tp x cp]: Megatron's aux and seq-aux losses multiply this rank's
// score sums by the token counts of the whole tp x cp group (get_tokens_per_expert_and_token_count),
// so every rank's loss and gradient depend on the other ranks' counts. ops::moe_routing_* count one
// rank's tokens; until they take the group's counts, a router with a load-balancing loss over more
// than one tp x cp rank routes with moe_utils.h's routing_forward/backward (the CPU reference),
// summing the counts over the group on the context's device. (The global aux loss takes its counts
// from outside the routing op, ops::moe_global_aux_loss_*, so it needs no host routing.)
bool TopKRouter::host_routing() const {
  // Sinkhorn's balancing is a whole-batch iteration, on the host (Note [Sinkhorn routing]); fp64 has
  // no device type (Note [fp64 router]).
  return config_.sinkhorn || config_.fp64 ||
         (tp_cp_ && (config_.aux_loss_coeff > 0 || config_.seq_aux_loss_coeff > 0));
}

Tensor TopKRouter::global_tokens(Context& ctx, const Tensor& counts, bool tracked, uint64_t rng_base) {
  if (!tracked) {  // recomputation: the first pass's counts
    auto it = global_by_stream_.find(rng_base);
    MG_ASSERT(it != global_by_stream_.end(), "a recomputed router forward whose first pass is not recorded");
    return it->second;
  }
  MG_CHECK(!ctx.capturing(),
           "--moe-router-load-balancing-type global_aux_loss keeps per-step host state and runs outside CUDA graph "
           "capture: leave out the CUDA graph of the training step, or the global aux loss");
  Tensor n = counts;
  for (Communicator* g : {tp_cp_, dp_}) {
    if (g) g->all_reduce(ctx, n)->wait();
  }
  ops::add(ctx, global_tokens_, n, global_tokens_);
  ++global_steps_;
  Tensor avg = global_tokens_.clone();
  ops::scale_(ctx, avg, 1.0f / float(global_steps_));
  global_by_stream_[rng_base] = avg;
  return avg;
}

void TopKRouter::reset_global_aux_loss_tracker(Context& ctx) {
  if (!global_tokens_.defined()) return;
  ops::scale_(ctx, global_tokens_, 0.0f);
  global_steps_ = 0;
  global_by_stream_.clear();
}

std::vector<double> TopKRouter::logits_fp64(const Tensor& x) const {
  const int64_t t_count = x.size(0), h = x.size(1), e = config_.num_experts;
  const std::vector<float> xv = x.to(Device::cpu()).to_floats();
  const std::vector<float> wv = weight_->data.to(Device::cpu()).to(DType::Float32).to_floats();
  const std::vector<float> bv = bias_ ? bias_->data.to(Device::cpu()).to(DType::Float32).to_floats()
                                      : std::vector<float>(size_t(e), 0.0f);
  std::vector<double> out(static_cast<size_t>(t_count * e));
  for (int64_t t = 0; t < t_count; ++t)
    for (int64_t x_ = 0; x_ < e; ++x_) {
      double acc = bv[size_t(x_)];
      for (int64_t j = 0; j < h; ++j) acc += double(xv[size_t(t * h + j)]) * double(wv[size_t(x_ * h + j)]);
      out[size_t(t * e + x_)] = acc;
    }
  return out;
}

TopKRouter::Output TopKRouter::forward(Context& ctx, const Tensor& x, int64_t seq_length, int64_t micro_batch,
                                       AuxLossTracker* tracker, Saved& saved, bool training, uint64_t rng_base) {
  MG_CHECK(x.dim() == 2 && x.size(1) == weight_->data.size(1), "router input {} for a weight {}", shape_str(x.shape()),
           shape_str(weight_->data.shape()));
  const Device dev = ctx.device();
  const int64_t t_count = x.size(0), e = config_.num_experts;
  saved.x = x.dtype() == DType::Float32 ? x : x.to(DType::Float32);
  saved.seq_length = seq_length;
  saved.micro_batch = micro_batch;
  saved.jitter = training && config_.input_jitter_eps > 0;
  if (saved.jitter) {  // Note [Router input jitter]
    saved.jitter_seed = ctx.rng().seed;
    saved.jitter_offset = kJitterStream + rng_base;
    Tensor jittered = Tensor::empty(saved.x.shape(), DType::Float32, dev);
    ops::moe_input_jitter(ctx, saved.x, config_.input_jitter_eps, saved.jitter_seed, saved.jitter_offset, micro_batch,
                          int64_t(group_rank(tp_)) * seq_length, jittered);
    saved.x = jittered;
  }
  MG_CHECK(tokens_per_expert_.device() == dev, "the router's state is on {}, its forward runs on {}",
           tokens_per_expert_.device().str(), dev.str());
  // The global aux loss in training: a tracked forward counts, a recomputed one replays its counts.
  saved.global_on = config_.global_aux_loss_coeff > 0 && training &&
                    (tracker != nullptr || global_by_stream_.count(rng_base) > 0);
  const RouterConfig rc = routing_config(saved.global_on);

  Output out;
  Tensor tokens, losses, global_loss;  // [E], [3] = {aux, seq_aux, z} with their coefficients, [1]; on dev
  if (host_routing()) {
    CountReduction counts;  // over tp × cp (one rank: none), and the global aux loss's
    if (tp_cp_) {
      counts.group_size = tp_cp_->size();
      counts.sum = [&](std::vector<float> v) {
        Tensor t = Tensor::from_floats(v, {int64_t(v.size())}).to(dev);
        tp_cp_->all_reduce(ctx, t)->wait();
        return t.to_floats();
      };
    }
    counts.global_group_size = int(global_aux_group());
    counts.global_average = [&](std::vector<float> v) {
      saved.global_tokens = global_tokens(ctx, Tensor::from_floats(v, {int64_t(v.size())}).to(dev), tracker != nullptr,
                                          rng_base);
      return saved.global_tokens.to_floats();
    };
    RoutingOutput r;
    if (config_.fp64) {
      r = routing_forward_fp64(rc, logits_fp64(saved.x), expert_bias_, seq_length, micro_batch, saved.host, &counts,
                               training);
    } else {
      Tensor logits = Tensor::empty({t_count, e}, DType::Float32, dev);
      ops::linear_forward(ctx, saved.x, weight_fp32(), bias_fp32(), logits);  // Megatron's router_gating_linear in fp32
      r = routing_forward(rc, logits, expert_bias_, seq_length, micro_batch, saved.host, &counts, training);
    }
    out.probs = r.probs.to(dev);
    out.routing_map = r.routing_map.to(dev);
    tokens = r.tokens_per_expert.to(dev);
    losses = Tensor::from_floats({float(r.aux_loss), float(r.seq_aux_loss), float(r.z_loss)}, {3}).to(dev);
    if (saved.global_on) global_loss = Tensor::from_floats({float(r.global_aux_loss)}, {1}).to(dev);
  } else {
    Tensor logits = Tensor::empty({t_count, e}, DType::Float32, dev);
    ops::linear_forward(ctx, saved.x, weight_fp32(), bias_fp32(), logits);  // Megatron's router_gating_linear in fp32
    const MoeRoutingParams p = routing_params(rc, seq_length, micro_batch, global_aux_group());
    out.probs = Tensor::empty({t_count, e}, DType::Float32, dev);
    out.routing_map = Tensor::empty({t_count, e}, DType::UInt8, dev);
    saved.topk_indices = Tensor::empty({t_count, int64_t(p.topk)}, DType::Int32, dev);
    if (p.aux_on()) {
      saved.aux_scores = Tensor::empty({t_count, e}, DType::Float32, dev);
      saved.aux_map = Tensor::empty({t_count, e}, DType::UInt8, dev);
    }
    tokens = Tensor::empty({e}, DType::Float32, dev);
    losses = Tensor::empty({3}, DType::Float32, dev);
    ops::moe_routing_forward(ctx, logits, expert_bias_, p, out.probs, out.routing_map, saved.topk_indices,
                             saved.aux_scores, saved.aux_map, tokens, losses);
    if (saved.global_on) {  // Note [Global aux loss]
      Tensor counts = Tensor::empty({e}, DType::Float32, dev);
      ops::moe_expert_counts(ctx, saved.aux_map, counts);
      saved.global_tokens = global_tokens(ctx, counts, tracker != nullptr, rng_base);
      global_loss = Tensor::empty({1}, DType::Float32, dev);
      ops::moe_global_aux_loss_forward(ctx, saved.aux_scores, saved.global_tokens, p, global_loss);
    }
    saved.logits = logits;
    saved.routing_map = out.routing_map;
  }
  // The expert bias counts the tokens of training forward passes only: `tracker` is null when the
  // layer is recomputed and in evaluation (Megatron counts under torch.is_grad_enabled() only).
  if (tracker) {
    ops::add(ctx, tokens_per_expert_, tokens, tokens_per_expert_);
    tracker->add_tokens_per_expert(ctx, layer_number_, tokens);  // --moe-per-layer-logging
  }
  if (tracker) {  // Megatron's save_to_aux_losses_tracker: each loss over its coefficient, a device scalar
    auto report = [&](const char* name, Tensor v, float coeff) {
      if (coeff <= 0 || !v.defined()) return;
      ops::scale_(ctx, v, 1.0f / coeff);
      tracker->add(ctx, name, layer_number_, v);
    };
    report("load_balancing_loss", losses.slice(0, 1), config_.aux_loss_coeff);
    report("seq_load_balancing_loss", losses.slice(1, 2), config_.seq_aux_loss_coeff);
    report("global_load_balancing_loss", global_loss, config_.global_aux_loss_coeff);
    report("z_loss", losses.slice(2, 3), rc.z_loss_coeff);
  }
  return out;
}

Tensor TopKRouter::backward(Context& ctx, const Tensor& grad_probs, const Saved& saved, float aux_loss_scale) const {
  const Device dev = ctx.device();
  const RouterConfig rc = routing_config(saved.global_on);
  const int64_t t_count = saved.x.size(0), h = saved.x.size(1), e = config_.num_experts;
  Tensor grad_x;
  if (config_.fp64) {  // Note [fp64 router]: grad_x = g · W and grad_W += gᵀ · x in fp64, on the host
    const std::vector<double> g = routing_backward_fp64(rc, grad_probs, saved.host, aux_loss_scale);
    const std::vector<float> xv = saved.x.to(Device::cpu()).to_floats();
    const std::vector<float> wv = weight_->data.to(Device::cpu()).to(DType::Float32).to_floats();
    std::vector<float> gx(static_cast<size_t>(t_count * h)), gw(static_cast<size_t>(e * h));
    for (int64_t t = 0; t < t_count; ++t)
      for (int64_t j = 0; j < h; ++j) {
        double acc = 0;
        for (int64_t x = 0; x < e; ++x) acc += g[size_t(t * e + x)] * double(wv[size_t(x * h + j)]);
        gx[size_t(t * h + j)] = float(acc);
      }
    for (int64_t x = 0; x < e; ++x)
      for (int64_t j = 0; j < h; ++j) {
        double acc = 0;
        for (int64_t t = 0; t < t_count; ++t) acc += g[size_t(t * e + x)] * double(xv[size_t(t * h + j)]);
        gw[size_t(x * h + j)] = float(acc);
      }
    grad_x = Tensor::from_floats(gx, {t_count, h}).to(dev);
    Tensor& main_grad = weight_->main_grad;
    ops::add(ctx, main_grad, Tensor::from_floats(gw, {e, h}).to(main_grad.device()), main_grad);
    if (bias_) {
      std::vector<float> gb(static_cast<size_t>(e));
      for (int64_t x = 0; x < e; ++x) {
        double acc = 0;
        for (int64_t t = 0; t < t_count; ++t) acc += g[size_t(t * e + x)];
        gb[size_t(x)] = float(acc);
      }
      ops::add(ctx, bias_->main_grad, Tensor::from_floats(gb, {e}).to(bias_->main_grad.device()), bias_->main_grad);
    }
  } else {
    Tensor grad_logits;
    if (host_routing()) {
      grad_logits = routing_backward(rc, grad_probs, saved.host, aux_loss_scale).to(dev);
    } else {
      const MoeRoutingParams p = routing_params(rc, saved.seq_length, saved.micro_batch, global_aux_group());
      grad_logits = Tensor::empty(saved.logits.shape(), DType::Float32, dev);
      ops::moe_routing_backward(ctx, grad_probs, saved.logits, saved.topk_indices, saved.routing_map, saved.aux_scores,
                                saved.aux_map, p, aux_loss_scale, grad_logits);
      if (saved.global_on) {
        ops::moe_global_aux_loss_backward(ctx, saved.logits, saved.aux_scores, saved.global_tokens, p, aux_loss_scale,
                                          grad_logits);
      }
    }
    grad_x = Tensor::empty(saved.x.shape(), DType::Float32, dev);
    Tensor no_bias, &bias_grad = bias_ ? bias_->main_grad : no_bias;
    ops::linear_backward(ctx, grad_logits, saved.x, weight_fp32(), grad_x, weight_->main_grad, bias_grad);
  }
  notify_grad_accumulated(ctx, weight_);
  notify_grad_accumulated(ctx, bias_);
  if (saved.jitter) {  // d(x·u)/dx = u (Note [Router input jitter])
    ops::moe_input_jitter(ctx, grad_x, config_.input_jitter_eps, saved.jitter_seed, saved.jitter_offset,
                          saved.micro_batch, int64_t(group_rank(tp_)) * saved.seq_length, grad_x);
  }
  return grad_x;
}

Tensor TopKRouter::bias_fp32() const {
  if (!bias_) return Tensor();
  return bias_->data.dtype() == DType::Float32 ? bias_->data : bias_->data.to(DType::Float32);
}

Tensor TopKRouter::weight_fp32() const {
  return weight_->data.dtype() == DType::Float32 ? weight_->data : weight_->data.to(DType::Float32);
}

RouterConfig TopKRouter::routing_config(bool global) const {
  RouterConfig c = config_;
  if (tp_cp_) c.z_loss_coeff /= float(tp_cp_->size());  // Megatron's apply_z_loss: a share per rank of the group
  if (!global) c.global_aux_loss_coeff = 0.0f;
  return c;
}

void TopKRouter::update_expert_bias(Context& ctx, float update_rate, const std::vector<Communicator*>& groups) {
  if (!expert_bias_.defined()) return;
  for (Communicator* g : groups) {
    if (g && g->size() > 1) g->all_reduce(ctx, tokens_per_expert_)->wait();
  }
  ops::moe_expert_bias_update(ctx, tokens_per_expert_, update_rate, expert_bias_);
  ops::scale_(ctx, tokens_per_expert_, 0.0f);
}

}  // namespace megatron::moe
