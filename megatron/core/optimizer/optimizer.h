// The mixed-precision Adam optimizer: Megatron-LM's Float16OptimizerWithFloat16Params (bf16/fp16
// parameters with fp32 master copies) and FP32Optimizer (fp32 parameters are their own masters)
// in one class, over AdamW (apex FusedAdam, adam_w_mode) via ops::adamw_step.
//
// step(ctx), as Megatron's MixedPrecisionOptimizer.step:
//   1. one ops::grad_stats pass over the fp32 main grads: Σg², inf/nan, zeros;
//   2. with a grad scaler: update it with the inf/nan flag; on inf/nan skip the step;
//   3. clip_grad > 0: grad norm of the unscaled grads, clip coefficient clip/(norm + 1e-6) if < 1;
//   4. adamw_step per parameter with grad_scale = (1/loss_scale) · clip coefficient, writing the
//      fp32 master and copying it into the model's parameter.
// The main grads are read, never modified (unscaling and clipping are folded into grad_scale);
// zeroing them is the caller's job. Param groups: parameters with no_weight_decay get weight decay
// 0 (Megatron's wd_mult 0), the others the scheduled weight decay; with a decoupled learning rate
// (--decoupled-lr: set_decoupled_lr) the is_embedding_or_output_parameter parameters take it, the
// others lr() (Megatron's param group with its own max_lr/min_lr).
//
// Parallel training (constructed over a DistributedDataParallel):
//   - Note [Counting gradients once] (Megatron's param_is_not_shared and
//     param_is_not_tensor_parallel_duplicate): the grad statistics — Σg², inf/nan, zeros — and the
//     parameter norm count every element of the full model exactly once: shared_embedding_copy
//     parameters never, tp_duplicate parameters on tensor-parallel rank 0 only, and with the
//     distributed optimizer only the elements of this rank's shard, without it only the first
//     replica's (data × context rank 0 for dense parameters, expert-data rank 0 for experts). They
//     are summed over the world (where Megatron adds the dense norm over tp × pp and the experts'
//     over etp × ep × pp), so every rank sees the same norm and the same found-inf and skips together.
//   - Distributed optimizer (Megatron's DistributedOptimizer): masters and moments exist only for
//     this rank's shard of every bucket, per parameter as a flat slice (state(name) is that 1-D
//     slice; for fp32 parameters the master is a view of the model parameter). step() updates the
//     shards and ends with ddp.start_param_sync(), the all-gather of the updated parameters.
//   - FP8 parameters (--fp8-param-gather, Note [FP8 parameters] in core/fp8_utils.h): their masters
//     start from the model's values DistributedDataParallel kept (fp8_init_value), and each step
//     quantises the updated shards into the FP8 buffer before the all-gather.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "megatron/core/optimizer/grad_scaler.h"
#include "megatron/core/parameter.h"
#include "megatron/kernels/ops.h"
#include "megatron/runtime/context.h"

namespace megatron {

/// Megatron's OptimizerConfig (the Adam part), with its names and defaults.
struct OptimizerConfig {
  double lr = 0.0;      // Megatron: None (required); the scheduler sets the lr each step
  double min_lr = 0.0;  // Megatron: None; used by the scheduler
  double weight_decay = 0.01;
  bool fp16 = false;
  bool bf16 = false;
  double loss_scale = 0.0;                   // > 0: a constant scale; 0: dynamic when fp16, none otherwise
  double initial_loss_scale = 4294967296.0;  // 2^32
  double min_loss_scale = 1.0;
  int64_t loss_scale_window = 1000;
  int64_t hysteresis = 2;
  double adam_beta1 = 0.9;
  double adam_beta2 = 0.999;
  double adam_eps = 1e-8;
  double clip_grad = 1.0;  // 0 disables clipping
  bool log_num_zeros_in_grad = false;
};

/// What Megatron's optimizer.step() returns: (update_successful, grad_norm, num_zeros_in_grad).
struct OptimizerStepResult {
  bool update_successful = false;
  std::optional<double> grad_norm;           // unset when skipped; 0 when clip_grad == 0
  std::optional<int64_t> num_zeros_in_grad;  // set when log_num_zeros_in_grad and not skipped
};

/// The optimizer state of one parameter, for checkpoints. All fp32, the parameter's numel and shape.
struct AdamParamState {
  Tensor master;  // the fp32 master (the parameter itself when it is fp32)
  Tensor exp_avg;
  Tensor exp_avg_sq;
};

class DistributedDataParallel;

class AdamOptimizer {
 public:
  /// Takes the parameters (their tensors are shared, not copied) and allocates the fp32 masters
  /// (initialised from the model's values) and zero Adam moments on each parameter's device.
  AdamOptimizer(std::vector<Parameter> params, const OptimizerConfig& config);
  /// Parallel training over ddp's model chunks: `params` are theirs (ddp.parameters()); see the
  /// notes above. `ddp` must outlive the optimizer.
  AdamOptimizer(std::vector<Parameter> params, const OptimizerConfig& config, DistributedDataParallel& ddp);

  OptimizerStepResult step(Context& ctx);
  /// The contiguous fp32 buffer all the main grads are views of (the model's ParamAndGradBuffer):
  /// the norm and inf/nan check then take one pass over it instead of one per parameter.
  void set_grad_buffer(Tensor grad_buffer) { grad_buffer_ = std::move(grad_buffer); }

  /// The learning rate and weight decay for the following steps (from OptimizerParamScheduler:
  /// set_lr(v.lr); set_weight_decay(v.wd)). Parameters with no_weight_decay always get 0.
  void set_lr(double lr) { lr_ = lr; }
  void set_weight_decay(double wd) { weight_decay_ = wd; }
  double lr() const { return lr_; }
  /// The learning rate of the is_embedding_or_output_parameter parameters (--decoupled-lr's
  /// schedule: OptimizerParamScheduler::get_lr(decoupled_lr, decoupled_min_lr)); until set they follow lr().
  void set_decoupled_lr(double lr) { decoupled_lr_ = lr; }
  /// The learning rate a parameter is updated with.
  double lr_of(const Parameter& p) const {
    return p.is_embedding_or_output_parameter && decoupled_lr_ ? *decoupled_lr_ : lr_;
  }
  double weight_decay() const { return weight_decay_; }

  /// The loss scale the training loop multiplies the loss by (1 without a grad scaler).
  float loss_scale() const { return scaler_ ? scaler_->scale() : 1.0f; }
  /// The grad scaler, or nullptr (fp32 and bf16 without --loss-scale).
  GradScaler* grad_scaler() const { return scaler_.get(); }
  /// Successful Adam steps so far (the bias-correction step of the next update is this + 1).
  int64_t step_count() const { return step_count_; }
  const OptimizerConfig& config() const { return config_; }

  const std::vector<Parameter>& parameters() const { return params_; }
  /// Whether the state is sharded over data-parallel ranks (the distributed optimizer).
  bool distributed() const { return distributed_; }
  /// The Adam state of the parameter of that name (a user error if there is none); with the
  /// distributed optimizer this rank's 1-D shard of it (possibly empty: see shard_of).
  AdamParamState& state(const std::string& name);
  const AdamParamState& state(const std::string& name) const;

  /// Checkpoint I/O of one parameter's whole state (master, exp_avg, exp_avg_sq shaped like the
  /// parameter). With the distributed optimizer this is collective over the data-parallel group
  /// (every rank calls it for the same names in the same order): gather assembles the shards,
  /// scatter keeps this rank's shard of `state`.
  AdamParamState gather_state(Context& ctx, const std::string& name) const;
  void scatter_state(Context& ctx, const std::string& name, const AdamParamState& state);

  /// Copies the model's parameters into the fp32 masters (after loading model weights without
  /// optimizer state). FP8 parameters have no model value to copy: give theirs to set_main_param.
  void reload_model_params();
  /// Sets the fp32 master of parameter `name` (this rank's shard of it) from its whole value (any
  /// float dtype, the parameter's numel); copy_main_params_to_model_params then sets the model's.
  void set_main_param(const std::string& name, const Tensor& value);
  /// Whether some parameters are FP8 (--fp8-param-gather, Note [FP8 parameters]): their values exist
  /// once copy_main_params_to_model_params(ctx) has quantised them, which must follow construction.
  bool has_fp8_params() const;
  /// Copies the fp32 masters into the model's parameters (after loading masters from a checkpoint);
  /// FP8 parameters are quantised from them (Note [FP8 parameters]).
  /// With the distributed optimizer this is collective (the shards are all-gathered) and needs the
  /// Context overload.
  void copy_main_params_to_model_params();
  void copy_main_params_to_model_params(Context& ctx);

  /// The L2 norm of the fp32 masters over the whole model (Megatron's calc_params_l2_norm; Note
  /// [Counting gradients once]). Collective in parallel training.
  double params_norm(Context& ctx) const;

  /// The non-tensor state: {"step", "lr", "weight_decay", "grad_scaler"}. Tensors go through state().
  nlohmann::json state_dict() const;
  void load_state_dict(const nlohmann::json& state);

 private:
  size_t index_of(const std::string& name) const;
  void init_states();
  /// The elements of parameter i this rank updates: all of it, or its shard as a flat slice.
  Tensor model_shard(size_t i) const;
  /// Note [FP8 parameters]: quantises this rank's shards of the FP8 parameters from their masters.
  void quantize_fp8_params(Context& ctx);
  /// Σ over the elements this rank counts, reduced over the grad-stats group.
  GradStats reduce_stats(Context& ctx, const GradStats& local) const;

  OptimizerConfig config_;
  std::vector<Parameter> params_;
  std::vector<AdamParamState> states_;
  std::unordered_map<std::string, size_t> index_;
  std::unique_ptr<GradScaler> scaler_;
  double lr_;
  std::optional<double> decoupled_lr_;
  double weight_decay_;
  int64_t step_count_ = 0;
  Tensor grad_buffer_;
  // Parallel training.
  DistributedDataParallel* ddp_ = nullptr;
  bool distributed_ = false;
  std::vector<int64_t> shard_start_, shard_count_;  // per parameter: its elements held here
  std::vector<bool> counted_;                        // per parameter: counted in norms here
  std::vector<Tensor> stat_grads_;                   // the counted gradient elements, coalesced
};

}  // namespace megatron
