// FP8 configuration checks and the per-tensor scaling state (fp8_utils.h).
#include "megatron/core/fp8_utils.h"

#include <algorithm>

#include <fmt/format.h>

#include "megatron/core/comm/communicator.h"
#include "megatron/runtime/check.h"
#include "megatron/runtime/dtype.h"

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

void Fp8TensorScaling::quantize(Context& ctx, int64_t i, const ProducedTensor& x, Tensor& q, Tensor& q_t, bool again,
                                Tensor dbias) {
  MG_ASSERT(i >= 0 && i < size(), "FP8 tensor {} of {}", i, size());
  Tensor s = scale(i), si = scale_inv(i), a = amax(i), none;
  // one pass over v writing q, q_t, dbias and what is given of the amax and scale_inv
  auto pass = [&](const ProducedTensor& v, Tensor& amax_out, Tensor& scale_inv_out) {
    if (!v.is_tensor()) {  // Note [Quantising inside the activation]
      ops::fp8_quantize_activation(ctx, v.act(), v.pre(), v.grad(), s, q, q_t, amax_out, scale_inv_out, dbias);
    } else if (dbias.defined()) {
      ops::fp8_quantize_dbias(ctx, v.tensor(), s, q, q_t, amax_out, scale_inv_out, dbias);
    } else {
      ops::fp8_quantize(ctx, v.tensor(), s, q, q_t, amax_out, scale_inv_out);
    }
  };
  if (again) {
    pass(x, none, none);
    return;
  }
  if (recipe_ == Fp8Recipe::Tensorwise) {
    // Current scaling reads x twice (its amax, then the codes): a produced x is written once and
    // read twice rather than computed twice — the activation twice measured slower (GPT 1.3B
    // tensorwise 1.18x of bf16 against 1.21x; Note [Quantising inside the activation]).
    const Tensor values = x.materialize(ctx);
    ops::fp8_amax(ctx, values, a);
    ops::fp8_scale_from_amax(ctx, a, params_.fp8_max, /*power_of_two_scales=*/false, s, si);
    pass(values, none, none);
    return;
  }
  pass(x, a, si);
}

void Fp8TensorScaling::update(Context& ctx) {
  if (recipe_ != Fp8Recipe::Delayed || size() == 0) return;
  ops::fp8_delayed_scale_update(ctx, amax_history_, scale_, params_);
}

void update_fp8_scaling(Context& ctx, const std::vector<Fp8TensorScaling*>& states) {
  std::vector<const Fp8TensorScaling*> firsts;  // one per distinct Fp8DelayedParams
  std::vector<std::vector<Tensor>> histories, scales;
  for (Fp8TensorScaling* s : states) {
    if (s->recipe() != Fp8Recipe::Delayed || s->size() == 0) continue;
    const Fp8DelayedParams& p = s->delayed_params();
    size_t g = 0;
    while (g < firsts.size() && !(firsts[g]->delayed_params().fp8_max == p.fp8_max &&
                                  firsts[g]->delayed_params().margin == p.margin &&
                                  firsts[g]->delayed_params().use_max == p.use_max))
      ++g;
    if (g == firsts.size()) {
      firsts.push_back(s);
      histories.emplace_back();
      scales.emplace_back();
    }
    histories[g].push_back(s->mutable_amax_history());
    scales[g].push_back(s->mutable_scales());
  }
  for (size_t g = 0; g < firsts.size(); ++g)
    ops::fp8_delayed_scale_update_grouped(ctx, histories[g], scales[g], firsts[g]->delayed_params());
}

namespace {
// Fp8Param::block_scale_inv's shape for a weight of `shape`: the forward GEMM's 128x128 scale
// layout with as many rows as the transposed copy's layout has columns, so that both fit in it
// (Note [FP8 parameters]).
Shape block_grid_shape(const Shape& shape) {
  Shape grid = fp8_block_scale_shape(shape[0], shape[1], /*tile_2d=*/true);
  grid[0] = fp8_block_scale_shape(shape[1], shape[0], /*tile_2d=*/true)[1];
  return grid;
}
}  // namespace

void Fp8Param::dequantize(Context& ctx, const Tensor& data, Tensor& out) const {
  if (!blockwise()) {
    ops::fp8_dequantize(ctx, data, scaling->scale_inv(index), out);
    return;
  }
  MG_CHECK(block_scale_inv.defined(), "an FP8 weight read before the optimizer quantised it");
  // Tile by tile on the host (checkpoints without the optimizer: not a hot path).
  const Tensor q = data.to(Device::cpu()), si = block_scale_inv.to(Device::cpu());
  const int64_t rows = q.size(0), cols = q.size(1), ld = si.size(1);
  const auto* b = static_cast<const uint8_t*>(q.raw_data());
  std::vector<float> v(size_t(q.numel()));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      v[size_t(r * cols + c)] = to_float(fp8_e4m3{b[r * cols + c]}) *
                                si.data<float>()[(r / kFp8BlockLen) * ld + c / kFp8BlockLen];
  out.copy_from(Tensor::from_floats(v, q.shape()).to(out.dtype()));
}

// Note [FP8 parameters].
void quantize_fp8_param_shards(Context& ctx, const std::vector<Fp8ParamShard>& shards, Communicator* amax_group) {
  Tensor none;
  // Tensorwise and blockwise: the shards' amaxes (one per weight, or its tile grid), side by side
  // in one buffer for one all-reduce.
  std::vector<const Fp8ParamShard*> reduced;
  std::vector<int64_t> offsets;
  int64_t total = 0;
  for (const Fp8ParamShard& sh : shards) {
    MG_ASSERT(sh.param, "an FP8 parameter shard without its parameter");
    MG_ASSERT(sh.main.numel() == sh.data.numel(), "FP8 parameter shard of {} main and {} fp8 elements",
              sh.main.numel(), sh.data.numel());
    Fp8Param& p = *sh.param;
    p.transpose = Tensor();  // Fp8Param::transpose: made again by the next backward
    p.transpose_scale_inv = Tensor();
    p.quantized = true;
    if (p.blockwise()) {
      MG_ASSERT(sh.shape.size() == 2, "a blockwise FP8 weight of shape {}", shape_str(sh.shape));
      const Shape grid = block_grid_shape(sh.shape);
      if (!p.block_scale_inv.defined()) p.block_scale_inv = Tensor::empty(grid, DType::Float32, ctx.device());
    } else if (p.scaling->recipe() == Fp8Recipe::Delayed) {
      Fp8TensorScaling& s = *p.scaling;
      Tensor q = sh.data, amax = s.amax(p.index), scale_inv = s.scale_inv(p.index);
      ops::fp8_quantize(ctx, sh.main, s.scale(p.index), q, none, amax, scale_inv);
      continue;
    }
    reduced.push_back(&sh);
    offsets.push_back(total);
    total += p.blockwise() ? p.block_scale_inv.numel() : 1;
  }
  if (reduced.empty()) return;
  Tensor amaxes = Tensor::zeros({total}, DType::Float32, ctx.device());
  auto slot = [&](Tensor& t, size_t j) {
    const Fp8Param& p = *reduced[j]->param;
    return p.blockwise() ? t.flat_slice(offsets[j], p.block_scale_inv.numel()).view(p.block_scale_inv.shape())
                         : t.flat_slice(offsets[j], 1);
  };
  for (size_t j = 0; j < reduced.size(); ++j) {
    const Fp8ParamShard& sh = *reduced[j];
    if (sh.main.numel() == 0) continue;
    Tensor a = slot(amaxes, j);
    if (sh.param->blockwise()) {
      ops::fp8_block_partial_amax(ctx, sh.main, sh.start, sh.shape[1], a);
    } else {
      ops::fp8_amax(ctx, sh.main, a);
    }
  }
  if (amax_group && amax_group->size() > 1) amax_group->all_reduce(ctx, amaxes, ReduceOp::Max)->wait();
  for (size_t j = 0; j < reduced.size(); ++j) {
    const Fp8ParamShard& sh = *reduced[j];
    Fp8Param& p = *sh.param;
    Tensor a = slot(amaxes, j), q = sh.data;
    if (p.blockwise()) {  // power-of-two tile scales (Note [Block scaling recipe])
      Tensor scale = Tensor::empty(p.block_scale_inv.shape(), DType::Float32, ctx.device());
      ops::fp8_scale_from_amax(ctx, a, fp8_max_of(DType::Float8E4M3), /*power_of_two_scales=*/true, scale,
                               p.block_scale_inv);
      if (sh.main.numel() > 0) ops::fp8_block_partial_quantize(ctx, sh.main, sh.start, sh.shape[1], scale, q);
      continue;
    }
    Fp8TensorScaling& s = *p.scaling;
    Tensor scale = s.scale(p.index), scale_inv = s.scale_inv(p.index);
    ops::fp8_scale_from_amax(ctx, a, fp8_max_of(s.dtype()), /*power_of_two_scales=*/false, scale, scale_inv);
    ops::fp8_quantize(ctx, sh.main, scale, q, none, none, none);
  }
}

}  // namespace megatron
