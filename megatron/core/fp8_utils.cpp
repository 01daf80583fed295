// FP8 configuration checks and the per-tensor scaling state (fp8_utils.h).
#include "megatron/core/fp8_utils.h"

#include <algorithm>

#include <fmt/format.h>

#include "megatron/core/comm/communicator.h"
#include "megatron/runtime/check.h"

namespace megatron {

Fp8Recipe fp8_recipe_from_string(const std::string& s) {
  if (s == "delayed") return Fp8Recipe::Delayed;
  if (s == "tensorwise") return Fp8Recipe::Tensorwise;
  if (s == "blockwise") return Fp8Recipe::Blockwise;
  MG_CHECK(s != "mxfp8", "--fp8-recipe mxfp8 needs a Blackwell GPU (MXFP8 block scaling has no Hopper kernels): use "
           "delayed, tensorwise or blockwise");
  MG_CHECK(s != "custom", "--fp8-recipe custom takes a Python quantizer factory, which megatron.cpp has no use for: "
           "use delayed, tensorwise or blockwise");
  MG_CHECK(false, "--fp8-recipe '{}' is not a recipe: use delayed, tensorwise or blockwise", s);
  return Fp8Recipe::Delayed;
}

std::string to_string(Fp8Recipe r) {
  switch (r) {
    case Fp8Recipe::Delayed: return "delayed";
    case Fp8Recipe::Tensorwise: return "tensorwise";
    case Fp8Recipe::Blockwise: return "blockwise";
  }
  return "?";
}

void Fp8Config::validate(int num_layers, int pipeline_model_parallel_size, bool use_distributed_optimizer,
                         int hidden_size, int ffn_hidden_size) const {
  MG_CHECK(format.empty() || format == "e4m3" || format == "hybrid",
           "--fp8-format '{}' is not a format: use e4m3 or hybrid", format);
  MG_CHECK(!param_gather || enabled(), "--fp8-param-gather needs --fp8-format (e4m3 or hybrid)");
  MG_CHECK(!param_gather || use_distributed_optimizer,
           "--fp8-param-gather only works with the distributed optimizer: add --use-distributed-optimizer");
  if (!enabled()) return;
  MG_CHECK(!(param_gather && recipe == Fp8Recipe::Blockwise),
           "--fp8-param-gather with --fp8-recipe blockwise is not supported: its 128x128 weight scales would need the "
           "distributed optimizer's shards cut at block boundaries; use delayed or tensorwise, or drop the flag");
  MG_CHECK(amax_history_len >= 1, "--fp8-amax-history-len must be at least 1 (got {})", amax_history_len);
  MG_CHECK(interval >= 1, "--fp8-interval must be at least 1 (got {})", interval);
  MG_CHECK(!(first_last_layers_bf16 && recipe == Fp8Recipe::Delayed),
           "--first-last-layers-bf16 does not work with --fp8-recipe delayed (Megatron's rule): use tensorwise or "
           "blockwise");
  if (first_last_layers_bf16) {
    const int per_stage = num_layers / std::max(1, pipeline_model_parallel_size);
    MG_CHECK(num_layers_at_start_in_bf16 >= 0 && num_layers_at_start_in_bf16 <= per_stage,
             "--num-layers-at-start-in-bf16 ({}) must be between 0 and the layers of a pipeline stage ({})",
             num_layers_at_start_in_bf16, per_stage);
    MG_CHECK(num_layers_at_end_in_bf16 >= 0 && num_layers_at_end_in_bf16 <= per_stage,
             "--num-layers-at-end-in-bf16 ({}) must be between 0 and the layers of a pipeline stage ({})",
             num_layers_at_end_in_bf16, per_stage);
  }
  if (recipe == Fp8Recipe::Blockwise) {
    MG_CHECK(hidden_size % kFp8BlockLen == 0 && ffn_hidden_size % kFp8BlockLen == 0,
             "--fp8-recipe blockwise needs --hidden-size ({}) and --ffn-hidden-size ({}) to be multiples of the {} "
             "block",
             hidden_size, ffn_hidden_size, kFp8BlockLen);
  }
}

bool is_first_last_bf16_layer(const Fp8Config& c, int num_layers, int layer_no) {
  if (!c.first_last_layers_bf16 || layer_no < 0) return false;
  return layer_no < c.num_layers_at_start_in_bf16 || layer_no >= num_layers - c.num_layers_at_end_in_bf16;
}

Fp8TensorScaling::Fp8TensorScaling(const Fp8Config& config, int64_t num_tensors, DType fp8_dtype, Device device)
    : recipe_(config.recipe), dtype_(fp8_dtype) {
  MG_CHECK(is_fp8(fp8_dtype), "FP8 scaling state of {} tensors: {} is not an fp8 dtype", num_tensors,
           megatron::to_string(fp8_dtype));
  MG_CHECK(config.recipe != Fp8Recipe::Blockwise,
           "the blockwise recipe keeps no per-tensor scaling state: its scales come with each quantised tensor");
  params_.fp8_max = fp8_max_of(fp8_dtype);
  params_.margin = config.margin;
  params_.use_max = config.amax_compute_max;
  scale_ = Tensor::from_floats(std::vector<float>(size_t(num_tensors), 1.0f), {num_tensors}, DType::Float32, device);
  // Note [Aligned scale inverses]: each scale_inv gets a 16-byte slot of its own: cuBLASLt reads
  // them through device pointers whose alignment its kernels depend on (a [n] array would put
  // tensor 1's at 4 bytes).
  scale_inv_ = Tensor::from_floats(std::vector<float>(size_t(num_tensors * kScaleInvStride), 1.0f),
                                   {num_tensors, kScaleInvStride}, DType::Float32, device);
  if (recipe_ == Fp8Recipe::Delayed) {
    amax_history_ = Tensor::zeros({int64_t(config.amax_history_len), num_tensors}, DType::Float32, device);
  } else {
    amax_ = Tensor::zeros({num_tensors}, DType::Float32, device);
  }
}

Tensor Fp8TensorScaling::amax(int64_t i) const {
  return recipe_ == Fp8Recipe::Delayed ? amax_history_.flat_slice(i, 1) : amax_.flat_slice(i, 1);
}

void Fp8TensorScaling::quantize(Context& ctx, int64_t i, const Tensor& x, Tensor& q, Tensor& q_t, bool again) {
  MG_ASSERT(i >= 0 && i < size(), "FP8 tensor {} of {}", i, size());
  Tensor s = scale(i), si = scale_inv(i), a = amax(i);
  if (again) {
    Tensor none;
    ops::fp8_quantize(ctx, x, s, q, q_t, none, none);
    return;
  }
  if (recipe_ == Fp8Recipe::Tensorwise) {
    ops::fp8_amax(ctx, x, a);
    ops::fp8_scale_from_amax(ctx, a, params_.fp8_max, /*power_of_two_scales=*/false, s, si);
    Tensor none;
    ops::fp8_quantize(ctx, x, s, q, q_t, none, none);
    return;
  }
  ops::fp8_quantize(ctx, x, s, q, q_t, a, si);
}

void Fp8TensorScaling::update(Context& ctx) {
  if (recipe_ != Fp8Recipe::Delayed || size() == 0) return;
  ops::fp8_delayed_scale_update(ctx, amax_history_, scale_, params_);
}

// Note [FP8 parameters].
void quantize_fp8_param_shards(Context& ctx, const std::vector<Fp8ParamShard>& shards, Communicator* amax_group) {
  Tensor none;
  std::vector<const Fp8ParamShard*> current;
  for (const Fp8ParamShard& sh : shards) {
    MG_ASSERT(sh.param && sh.param->scaling, "an FP8 parameter without its scaling state");
    MG_ASSERT(sh.main.numel() == sh.data.numel(), "FP8 parameter shard of {} main and {} fp8 elements",
              sh.main.numel(), sh.data.numel());
    Fp8TensorScaling& s = *sh.param->scaling;
    const int64_t i = sh.param->index;
    sh.param->transpose = Tensor();  // Fp8Param::transpose: made again by the next backward
    sh.param->quantized = true;
    if (s.recipe() == Fp8Recipe::Tensorwise) {
      current.push_back(&sh);
      continue;
    }
    MG_ASSERT(s.recipe() == Fp8Recipe::Delayed, "FP8 parameters with the {} recipe", to_string(s.recipe()));
    Tensor q = sh.data, amax = s.amax(i), scale_inv = s.scale_inv(i);
    ops::fp8_quantize(ctx, sh.main, s.scale(i), q, none, amax, scale_inv);
  }
  if (current.empty()) return;
  // Current scaling: the whole weight's amax from its shards', for every weight in one all-reduce.
  Tensor amaxes = Tensor::zeros({int64_t(current.size())}, DType::Float32, ctx.device());
  for (size_t j = 0; j < current.size(); ++j) {
    Tensor a = amaxes.flat_slice(int64_t(j), 1);
    if (current[j]->main.numel() > 0) ops::fp8_amax(ctx, current[j]->main, a);
  }
  if (amax_group && amax_group->size() > 1) amax_group->all_reduce(ctx, amaxes, ReduceOp::Max)->wait();
  for (size_t j = 0; j < current.size(); ++j) {
    Fp8TensorScaling& s = *current[j]->param->scaling;
    const int64_t i = current[j]->param->index;
    Tensor a = amaxes.flat_slice(int64_t(j), 1), scale = s.scale(i), scale_inv = s.scale_inv(i), q = current[j]->data;
    ops::fp8_scale_from_amax(ctx, a, fp8_max_of(s.dtype()), /*power_of_two_scales=*/false, scale, scale_inv);
    ops::fp8_quantize(ctx, current[j]->main, scale, q, none, none, none);
  }
}

}  // namespace megatron
