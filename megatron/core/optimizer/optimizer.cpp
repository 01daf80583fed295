// The mixed-precision Adam optimizer (optimizer.h): masters, param groups, loss-scale skipping,
// clipping folded into the Adam kernel's grad_scale.
#include "megatron/core/optimizer/optimizer.h"

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
  validate(config_);
  const DType half = config_.fp16 ? DType::Float16 : config_.bf16 ? DType::BFloat16 : DType::Float32;
  states_.reserve(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    const Parameter& p = params_[i];
    MG_CHECK(!p.name.empty(), "optimizer: parameter {} has no name", i);
    MG_CHECK(index_.emplace(p.name, i).second, "optimizer: parameter '{}' is given twice", p.name);
    MG_CHECK(p.data.defined(), "optimizer: parameter '{}' has no data", p.name);
    MG_CHECK(p.data.dtype() == DType::Float32 || p.data.dtype() == half,
             "optimizer: parameter '{}' is {} but the run is {}: set fp16/bf16 to match the model's dtype", p.name,
             p.data.str(), to_string(half));
    MG_CHECK(p.main_grad.defined() && p.main_grad.dtype() == DType::Float32 && p.main_grad.numel() == p.data.numel(),
             "optimizer: parameter '{}' ({}) needs an fp32 main_grad of the same size, got {}", p.name, p.data.str(),
             p.main_grad.defined() ? p.main_grad.str() : "none");
    MG_CHECK(p.main_grad.device() == p.data.device(), "optimizer: parameter '{}' is on {} but its main_grad on {}",
             p.name, p.data.device().str(), p.main_grad.device().str());
    AdamParamState s;
    s.master = p.data.dtype() == DType::Float32 ? p.data : p.data.to(DType::Float32);
    s.exp_avg = Tensor::zeros(p.data.shape(), DType::Float32, p.data.device());
    s.exp_avg_sq = Tensor::zeros(p.data.shape(), DType::Float32, p.data.device());
    states_.push_back(std::move(s));
  }
  scaler_ = make_grad_scaler(config_);
}

OptimizerStepResult AdamOptimizer::step(Context& ctx) {
  OptimizerStepResult result;
  std::vector<Tensor> grads;
  if (grad_buffer_.defined()) {
    grads.push_back(grad_buffer_);
  } else {
    grads.reserve(params_.size());
    for (const Parameter& p : params_) grads.push_back(p.main_grad);
  }
  const GradStats stats = grad_stats_fp32(ctx, grads);

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
  for (size_t i = 0; i < params_.size(); ++i) {
    Parameter& p = params_[i];
    AdamParamState& s = states_[i];
    hp.weight_decay = p.no_weight_decay ? 0.0f : float(weight_decay_);
    Tensor model_param = p.data.dtype() == DType::Float32 ? Tensor() : p.data;
    ops::adamw_step(ctx, s.master, p.main_grad, s.exp_avg, s.exp_avg_sq, hp, model_param);
  }
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

AdamParamState AdamOptimizer::gather_state(Context& ctx, const std::string& name) const { return state(name); }

void AdamOptimizer::scatter_state(Context& ctx, const std::string& name, const AdamParamState& in) {
  AdamParamState& s = state(name);
  s.master.copy_from(in.master);
  s.exp_avg.copy_from(in.exp_avg);
  s.exp_avg_sq.copy_from(in.exp_avg_sq);
}

void AdamOptimizer::reload_model_params() {
  for (size_t i = 0; i < params_.size(); ++i)
    if (params_[i].data.dtype() != DType::Float32) states_[i].master.copy_from(params_[i].data);
}

void AdamOptimizer::copy_main_params_to_model_params() {
  for (size_t i = 0; i < params_.size(); ++i)
    if (params_[i].data.dtype() != DType::Float32) params_[i].data.copy_from(states_[i].master);
}

nlohmann::json AdamOptimizer::state_dict() const {
  return {{"step", step_count_},
          {"lr", lr_},
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
  if (state.contains("weight_decay")) weight_decay_ = state.at("weight_decay").get<double>();
  step_count_ = step;
}

}  // namespace megatron
