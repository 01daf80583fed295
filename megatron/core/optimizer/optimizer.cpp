// The mixed-precision Adam optimizer (optimizer.h): masters, param groups, loss-scale skipping,
// clipping folded into the Adam kernel's grad_scale; the distributed optimizer's shards and the
// cross-rank grad statistics.
#include "megatron/core/optimizer/optimizer.h"

#include <algorithm>
#include <cmath>

#include "megatron/core/distributed/distributed_data_parallel.h"
#include "megatron/core/fp8_utils.h"
#include "megatron/core/optimizer/clip_grads.h"
#include "megatron/kernels/ops.h"

namespace megatron {

namespace {

void validate(const OptimizerConfig& c) {
  MG_CHECK(!(c.fp16 && c.bf16), "both fp16 and bf16 are set: pick one");
  MG_CHECK(c.lr >= 0.0, "lr is {}: it must be >= 0", c.lr);
  MG_CHECK(c.weight_decay >= 0.0, "weight_decay is {}: it must be >= 0", c.weight_decay);
  MG_CHECK(c.adam_beta1 >= 0.0 && c.adam_beta1 < 1.0, "adam_beta1 is {}: it must be in [0, 1)", c.adam_beta1);
  MG_CHECK(c.adam_beta2 >= 0.0 && c.adam_beta2 < 1.0, "adam_beta2 is {}: it must be in [0, 1)", c.adam_beta2);
  MG_CHECK(c.adam_eps >= 0.0, "adam_eps is {}: it must be >= 0", c.adam_eps);
  MG_CHECK(c.clip_grad >= 0.0, "clip_grad is {}: it must be >= 0 (0 disables clipping)", c.clip_grad);
  MG_CHECK(c.loss_scale >= 0.0, "loss_scale is {}: it must be > 0, or 0 for dynamic loss scaling", c.loss_scale);
}

// Megatron's get_megatron_optimizer: a scaler only for fp16/bf16 runs; constant when --loss-scale is
// given, dynamic for fp16 otherwise.
std::unique_ptr<GradScaler> make_grad_scaler(const OptimizerConfig& c) {
  if (!c.fp16 && !c.bf16) return nullptr;
  if (c.loss_scale > 0.0) return std::make_unique<ConstantGradScaler>(float(c.loss_scale));
  if (!c.fp16) return nullptr;
  DynamicGradScalerConfig d;
  d.initial_scale = float(c.initial_loss_scale);
  d.min_scale = float(c.min_loss_scale);
  d.growth_interval = c.loss_scale_window;
  d.hysteresis = c.hysteresis;
  return std::make_unique<DynamicGradScaler>(d);
}

}  // namespace

AdamOptimizer::AdamOptimizer(std::vector<Parameter> params, const OptimizerConfig& config)
    : config_(config), params_(std::move(params)), lr_(config.lr), weight_decay_(config.weight_decay) {
  for (const Parameter& p : params_) {
    shard_start_.push_back(0);
    shard_count_.push_back(p.data.defined() ? p.data.numel() : 0);
    counted_.push_back(true);
  }
  init_states();
}

AdamOptimizer::AdamOptimizer(std::vector<Parameter> params, const OptimizerConfig& config,
                             DistributedDataParallel& ddp)
    : config_(config), params_(std::move(params)), lr_(config.lr), weight_decay_(config.weight_decay), ddp_(&ddp) {
  distributed_ = ddp.config().use_distributed_optimizer;
  const ParallelState& ps = ddp.parallel_state();
  // Note [Counting gradients once]: which gradient elements this rank counts, as coalesced views of
  // the chunks' grad buffers (one grad_stats pass per contiguous run).
  struct Piece {
    int buffer;
    int64_t offset, count;
  };
  std::vector<Piece> pieces;
  for (const Parameter& p : params_) {
    const Parameter* model = ddp.find(p.name);
    MG_CHECK(model && p.data.defined() && model->data.raw_data() == p.data.raw_data(),
             "optimizer: parameter '{}' is not a parameter of the data-parallel model chunks", p.name);
    const ParamShard sh = ddp.owned_shard(p.name);
    shard_start_.push_back(distributed_ ? sh.start : 0);
    shard_count_.push_back(distributed_ ? sh.count : p.data.numel());
    // Each element once over the world: the shard's owner (distributed optimizer), else the first
    // replica of its reduction group (dense: data × context rank 0; experts: expert-data rank 0).
    const bool first_replica = p.reduce_group == GradReduceGroup::ExpertData ? ps.edp_rank() == 0
                                                                              : ps.dp_rank() == 0 && ps.cp_rank() == 0;
    counted_.push_back(!p.shared_embedding_copy && (!p.tp_duplicate || ps.tp_rank() == 0) &&
                       (distributed_ || first_replica));
    if (!counted_.back() || shard_count_.back() == 0) continue;
    const Tensor g = p.main_grad.flat_slice(shard_start_.back(), shard_count_.back());
    for (int c = 0; c < ddp.num_buffers(); ++c) {
      const Tensor& buf = ddp.buffer(c).grad_buffer();
      if (buf.storage() != g.storage()) continue;
      const auto bytes = static_cast<const char*>(g.raw_data()) - static_cast<const char*>(buf.raw_data());
      pieces.push_back(Piece{c, int64_t(bytes / int64_t(sizeof(float))), g.numel()});
    }
    MG_ASSERT(!pieces.empty() && pieces.back().count == g.numel(), "main_grad of {} is not in its grad buffer", p.name);
  }
  std::sort(pieces.begin(), pieces.end(),
            [](const Piece& a, const Piece& b) { return a.buffer != b.buffer ? a.buffer < b.buffer : a.offset < b.offset; });
  for (size_t i = 0; i < pieces.size();) {
    size_t j = i + 1;
    int64_t end = pieces[i].offset + pieces[i].count;
    while (j < pieces.size() && pieces[j].buffer == pieces[i].buffer && pieces[j].offset == end) end += pieces[j++].count;
    stat_grads_.push_back(ddp.buffer(pieces[i].buffer).grad_buffer().flat_slice(pieces[i].offset, end - pieces[i].offset));
    i = j;
  }
  init_states();
  ddp.release_fp8_init_values();  // the FP8 weights' masters have them now
}

void AdamOptimizer::init_states() {
  validate(config_);
  const DType half = config_.fp16 ? DType::Float16 : config_.bf16 ? DType::BFloat16 : DType::Float32;
  states_.reserve(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    const Parameter& p = params_[i];
    MG_CHECK(!p.name.empty(), "optimizer: parameter {} has no name", i);
    MG_CHECK(index_.emplace(p.name, i).second, "optimizer: parameter '{}' is given twice", p.name);
    MG_CHECK(p.data.defined(), "optimizer: parameter '{}' has no data", p.name);
    MG_CHECK(!p.fp8 || distributed_,
             "optimizer: FP8 parameter '{}' (--fp8-param-gather) needs the distributed optimizer", p.name);
    MG_CHECK(p.data.dtype() == DType::Float32 || p.data.dtype() == half || (p.fp8 && is_fp8(p.data.dtype())),
             "optimizer: parameter '{}' is {} but the run is {}: set fp16/bf16 to match the model's dtype", p.name,
             p.data.str(), to_string(half));
    MG_CHECK(p.main_grad.defined() && p.main_grad.dtype() == DType::Float32 && p.main_grad.numel() == p.data.numel(),
             "optimizer: parameter '{}' ({}) needs an fp32 main_grad of the same size, got {}", p.name, p.data.str(),
             p.main_grad.defined() ? p.main_grad.str() : "none");
    MG_CHECK(p.main_grad.device() == p.data.device(), "optimizer: parameter '{}' is on {} but its main_grad on {}",
             p.name, p.data.device().str(), p.main_grad.device().str());
    const Tensor model = model_shard(i);
    AdamParamState s;
    if (p.fp8) {  // Note [FP8 parameters]: the model's value before it became FP8
      s.master = ddp_->fp8_init_value(p.name).view({-1}).flat_slice(shard_start_[i], shard_count_[i]).to(DType::Float32);
    } else {
      s.master = p.data.dtype() == DType::Float32 ? model : model.to(DType::Float32);
    }
    s.exp_avg = Tensor::zeros(model.shape(), DType::Float32, p.data.device());
    s.exp_avg_sq = Tensor::zeros(model.shape(), DType::Float32, p.data.device());
    states_.push_back(std::move(s));
  }
  scaler_ = make_grad_scaler(config_);
}

Tensor AdamOptimizer::model_shard(size_t i) const {
  const Parameter& p = params_[i];
  return distributed_ ? p.data.flat_slice(shard_start_[i], shard_count_[i]) : p.data;
}

GradStats AdamOptimizer::reduce_stats(Context& ctx, const GradStats& local) const {
  if (!ddp_) return local;
  const ParallelState& ps = ddp_->parallel_state();
  return all_reduce_grad_stats(ctx, ps.world(), local);  // Note [Counting gradients once]
}

OptimizerStepResult AdamOptimizer::step(Context& ctx) {
  OptimizerStepResult result;
  std::vector<Tensor> grads;
  if (ddp_) {
    grads = stat_grads_;
  } else if (grad_buffer_.defined()) {
    grads.push_back(grad_buffer_);
  } else {
    grads.reserve(params_.size());
    for (const Parameter& p : params_) grads.push_back(p.main_grad);
  }
  const GradStats stats = reduce_stats(ctx, grad_stats_fp32(ctx, grads));

  // Unscale and check for inf/nan (Megatron reads inv_scale before updating the scaler).
  double inv_scale = 1.0;
  if (scaler_) {
    inv_scale = scaler_->inv_scale();
    scaler_->update(stats.found_inf_or_nan);
    if (stats.found_inf_or_nan) return result;
  }

  double clip_coeff = 1.0;
  result.grad_norm = 0.0;
  if (config_.clip_grad > 0.0) {
    const double norm = grad_norm_from_stats(stats, inv_scale);
    result.grad_norm = norm;
    const double c = clip_coefficient(config_.clip_grad, norm);
    if (c < 1.0) clip_coeff = c;
  }
  if (config_.log_num_zeros_in_grad) result.num_zeros_in_grad = stats.num_zeros;

  ++step_count_;
  AdamHyperParams hp;
  hp.lr = float(lr_);
  hp.beta1 = float(config_.adam_beta1);
  hp.beta2 = float(config_.adam_beta2);
  hp.eps = float(config_.adam_eps);
  hp.step = step_count_;
  hp.bias_correction = true;
  hp.grad_scale = float(inv_scale * clip_coeff);
  // Every parameter in few launches (Note [Multi-tensor AdamW]), one call per learning rate.
  std::vector<AdamTensors> update, decoupled;
  update.reserve(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    Parameter& p = params_[i];
    AdamParamState& s = states_[i];
    if (shard_count_[i] == 0) continue;
    const bool own_lr = decoupled_lr_ && p.is_embedding_or_output_parameter;
    AdamTensors t;
    t.main_param = s.master;
    t.grad = distributed_ ? p.main_grad.flat_slice(shard_start_[i], shard_count_[i]) : p.main_grad;
    t.exp_avg = s.exp_avg;
    t.exp_avg_sq = s.exp_avg_sq;
    if (p.data.dtype() != DType::Float32 && !p.fp8) t.model_param = model_shard(i);
    t.weight_decay = p.no_weight_decay ? 0.0f : float(weight_decay_);
    (own_lr ? decoupled : update).push_back(std::move(t));
  }
  ops::adamw_step_multi(ctx, update, hp);
  if (!decoupled.empty()) {
    AdamHyperParams dhp = hp;
    dhp.lr = float(*decoupled_lr_);
    ops::adamw_step_multi(ctx, decoupled, dhp);
  }
  quantize_fp8_params(ctx);
  if (distributed_) ddp_->start_param_sync(ctx);
  result.update_successful = true;
  return result;
}

size_t AdamOptimizer::index_of(const std::string& name) const {
  auto it = index_.find(name);
  MG_CHECK(it != index_.end(), "optimizer has no parameter '{}'", name);
  return it->second;
}

AdamParamState& AdamOptimizer::state(const std::string& name) { return states_[index_of(name)]; }
const AdamParamState& AdamOptimizer::state(const std::string& name) const { return states_[index_of(name)]; }

AdamParamState AdamOptimizer::gather_state(Context& ctx, const std::string& name) const {
  const size_t i = index_of(name);
  if (!distributed_) return states_[i];
  // Every rank sends its piece of the three tensors, padded to the longest piece, in one all-gather.
  Communicator& group = ddp_->reduction_group_of(name);
  const Parameter& p = params_[i];
  const Device device = p.data.device();
  std::vector<ParamShard> pieces;
  int64_t k = 0;
  for (int r = 0; r < group.size(); ++r) {
    pieces.push_back(ddp_->shard(name, r));
    k = std::max(k, pieces.back().count);
  }
  const AdamParamState& s = states_[i];
  Tensor mine = Tensor::zeros({3 * k}, DType::Float32, device);
  const int64_t n = shard_count_[i];
  if (n > 0) {
    mine.flat_slice(0, n).copy_from(s.master);
    mine.flat_slice(k, n).copy_from(s.exp_avg);
    mine.flat_slice(2 * k, n).copy_from(s.exp_avg_sq);
  }
  Tensor all = Tensor::empty({3 * k * group.size()}, DType::Float32, device);
  group.all_gather(ctx, mine, all)->wait();
  AdamParamState out;
  out.master = Tensor::empty(p.data.shape(), DType::Float32, device);
  out.exp_avg = Tensor::empty(p.data.shape(), DType::Float32, device);
  out.exp_avg_sq = Tensor::empty(p.data.shape(), DType::Float32, device);
  for (int r = 0; r < group.size(); ++r) {
    const ParamShard& pc = pieces[size_t(r)];
    if (pc.count == 0) continue;
    const int64_t base = 3 * k * r;
    out.master.flat_slice(pc.start, pc.count).copy_from(all.flat_slice(base, pc.count));
    out.exp_avg.flat_slice(pc.start, pc.count).copy_from(all.flat_slice(base + k, pc.count));
    out.exp_avg_sq.flat_slice(pc.start, pc.count).copy_from(all.flat_slice(base + 2 * k, pc.count));
  }
  return out;
}

void AdamOptimizer::scatter_state(Context& ctx, const std::string& name, const AdamParamState& in) {
  const size_t i = index_of(name);
  AdamParamState& s = states_[i];
  const int64_t numel = params_[i].data.numel();
  MG_CHECK(in.master.numel() == numel && in.exp_avg.numel() == numel && in.exp_avg_sq.numel() == numel,
           "optimizer state of '{}' has {}/{}/{} elements, the parameter {}", name, in.master.numel(),
           in.exp_avg.numel(), in.exp_avg_sq.numel(), numel);
  if (shard_count_[i] == 0) return;
  auto own = [&](const Tensor& t) { return distributed_ ? t.flat_slice(shard_start_[i], shard_count_[i]) : t; };
  s.master.copy_from(own(in.master));
  s.exp_avg.copy_from(own(in.exp_avg));
  s.exp_avg_sq.copy_from(own(in.exp_avg_sq));
}

void AdamOptimizer::reload_model_params() {
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].data.dtype() != DType::Float32 && !params_[i].fp8 && shard_count_[i] > 0)
      states_[i].master.copy_from(model_shard(i));
  }
}

void AdamOptimizer::set_main_param(const std::string& name, const Tensor& value) {
  const size_t i = index_of(name);
  MG_CHECK(value.numel() == params_[i].data.numel(), "set_main_param: '{}' has {} elements, the value {}", name,
           params_[i].data.numel(), value.numel());
  if (shard_count_[i] == 0) return;
  const Tensor own = value.view({-1}).flat_slice(shard_start_[i], shard_count_[i]);
  states_[i].master.copy_from(own.dtype() == DType::Float32 ? own : own.to(DType::Float32));
}

bool AdamOptimizer::has_fp8_params() const {
  return std::any_of(params_.begin(), params_.end(), [](const Parameter& p) { return p.fp8 != nullptr; });
}

// Note [FP8 parameters]: every rank's shard of each FP8 weight from its masters, before the
// all-gather; the dense weights' amaxes reduce over the data-parallel group, the experts' over the
// expert-data-parallel one.
void AdamOptimizer::quantize_fp8_params(Context& ctx) {
  for (GradReduceGroup g : {GradReduceGroup::DataContext, GradReduceGroup::ExpertData}) {
    std::vector<Fp8ParamShard> shards;
    for (size_t i = 0; i < params_.size(); ++i) {
      const Parameter& p = params_[i];
      if (!p.fp8 || p.reduce_group != g) continue;
      shards.push_back({p.fp8, states_[i].master, model_shard(i), shard_start_[i], p.data.shape()});
    }
    if (!shards.empty()) quantize_fp8_param_shards(ctx, shards, &ddp_->reduction_group(g));
  }
}

void AdamOptimizer::copy_main_params_to_model_params() {
  MG_CHECK(!distributed_,
           "copy_main_params_to_model_params with the distributed optimizer all-gathers the parameters: pass the "
           "Context");
  for (size_t i = 0; i < params_.size(); ++i)
    if (params_[i].data.dtype() != DType::Float32) params_[i].data.copy_from(states_[i].master);
}

void AdamOptimizer::copy_main_params_to_model_params(Context& ctx) {
  quantize_fp8_params(ctx);
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].data.dtype() == DType::Float32 || params_[i].fp8 || shard_count_[i] == 0) continue;
    Tensor model = model_shard(i);
    model.copy_from(states_[i].master);
  }
  if (distributed_) {
    ddp_->start_param_sync(ctx);
    ddp_->finish_param_sync(ctx);
  }
}

double AdamOptimizer::params_norm(Context& ctx) const {
  GradStats local;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!counted_[i] || shard_count_[i] == 0) continue;
    local.sum_sq += ops::grad_stats(ctx, states_[i].master).sum_sq;
  }
  return std::sqrt(reduce_stats(ctx, local).sum_sq);
}

nlohmann::json AdamOptimizer::state_dict() const {
  return {{"step", step_count_},
          {"lr", lr_},
          {"decoupled_lr", decoupled_lr_ ? nlohmann::json(*decoupled_lr_) : nlohmann::json()},
          {"weight_decay", weight_decay_},
          {"grad_scaler", scaler_ ? scaler_->state_dict() : nlohmann::json()}};
}

void AdamOptimizer::load_state_dict(const nlohmann::json& state) {
  MG_CHECK(state.contains("step"), "optimizer state has no 'step' entry");
  const int64_t step = state.at("step").get<int64_t>();
  MG_CHECK(step >= 0, "optimizer state has step {}", step);
  if (scaler_ && state.contains("grad_scaler") && !state.at("grad_scaler").is_null())
    scaler_->load_state_dict(state.at("grad_scaler"));
  if (state.contains("lr")) lr_ = state.at("lr").get<double>();
  if (state.contains("decoupled_lr") && !state.at("decoupled_lr").is_null())
    decoupled_lr_ = state.at("decoupled_lr").get<double>();
  if (state.contains("weight_decay")) weight_decay_ = state.at("weight_decay").get<double>();
  step_count_ = step;
}

}  // namespace megatron
