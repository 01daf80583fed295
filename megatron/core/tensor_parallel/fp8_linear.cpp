// One linear layer's GEMMs in FP8 (fp8_linear.h, Note [FP8 linear layer]).
#include "megatron/core/tensor_parallel/fp8_linear.h"

#include "megatron/kernels/ops.h"

namespace megatron {

Fp8LinearState::Fp8LinearState(const Fp8Config& config, Device device) : config_(config) {
  MG_CHECK(config.enabled(), "an FP8 linear layer needs --fp8-format (e4m3 or hybrid)");
  if (config.recipe != Fp8Recipe::Blockwise) {
    fwd_ = Fp8TensorScaling(config, 2, config.forward_dtype(), device);
    bwd_ = Fp8TensorScaling(config, 1, config.backward_dtype(), device);
    param_.scaling = &fwd_;
    param_.index = 1;
  }
}

// x [rows, cols] quantised for a GEMM operand [rows, cols] (transposed: [cols, rows], the copy of
// xᵀ); per-tensor recipes through the state's tensor `index`, blockwise per tile.
Fp8Operand Fp8LinearState::quantize(Context& ctx, bool backward, int64_t index, const ProducedTensor& x,
                                    bool transposed, bool tile_2d, bool again) {
  const DType t = backward ? config_.backward_dtype() : config_.forward_dtype();
  const Shape shape = x.shape();
  const int64_t rows = shape[0], cols = shape[1];
  Fp8Operand o;
  if (config_.recipe != Fp8Recipe::Blockwise) {
    Fp8TensorScaling& s = backward ? bwd_ : fwd_;
    Tensor none;
    if (transposed) {
      o.data = Tensor::empty({cols, rows}, t, ctx.device());
      s.quantize(ctx, index, x, none, o.data, again);
    } else {
      o.data = Tensor::empty({rows, cols}, t, ctx.device());
      s.quantize(ctx, index, x, o.data, none, again);
    }
    o.scale_inv = s.scale_inv(index);
    return o;
  }
  Tensor src = x.materialize(ctx);
  if (transposed && !tile_2d) {  // the 1x128 copies along the tokens, without the bf16 transpose
    o.mode = Fp8ScaleMode::Block1x128;
    o.data = Tensor::empty({cols, rows}, t, ctx.device());
    o.scale_inv = Tensor::empty(fp8_block_scale_shape(cols, rows, false), DType::Float32, ctx.device());
    ops::fp8_block_quantize_transposed(ctx, src, /*power_of_two_scales=*/true, o.data, o.scale_inv);
    return o;
  }
  if (transposed) {
    Tensor values = src;
    src = Tensor::empty({cols, rows}, x.dtype(), ctx.device());
    ops::transpose_01(ctx, values, src);
  }
  o.mode = tile_2d ? Fp8ScaleMode::Block128x128 : Fp8ScaleMode::Block1x128;
  o.data = Tensor::empty(src.shape(), t, ctx.device());
  o.scale_inv = Tensor::empty(fp8_block_scale_shape(src.size(0), src.size(1), tile_2d), DType::Float32, ctx.device());
  ops::fp8_block_quantize(ctx, src, tile_2d, /*power_of_two_scales=*/true, o.data, o.scale_inv);
  return o;
}

// Note [FP8 parameters]: the weight as the optimizer quantised it, or its transposed copy (made
// once after each optimizer step, a byte transpose: the same scales — per tensor, or the tile grid
// transposed).
Fp8Operand Fp8LinearState::fp8_weight(Context& ctx, const Tensor& weight, bool transposed) {
  MG_ASSERT(weight.dtype() == config_.forward_dtype(), "an FP8 weight of {}", to_string(weight.dtype()));
  MG_CHECK(param_.quantized,
           "an FP8 weight was used before the optimizer quantised it from its main params: call "
           "AdamOptimizer::copy_main_params_to_model_params(ctx) once the optimizer is built");
  const int64_t out = weight.size(0), in = weight.size(1);
  const bool blockwise = config_.recipe == Fp8Recipe::Blockwise;
  // The first rows of a padded tile grid, in the GEMM's layout of a [rows, cols] operand.
  auto grid_rows = [](const Tensor& grid, int64_t rows, int64_t cols) {
    const Shape shape = fp8_block_scale_shape(rows, cols, /*tile_2d=*/true);
    MG_ASSERT(shape[1] == grid.size(1), "a tile grid {} for an operand [{}, {}]", shape_str(grid.shape()), rows, cols);
    return grid.flat_slice(0, shape[0] * shape[1]).view(shape);
  };
  if (!transposed) {
    if (!blockwise) return {weight, fwd_.scale_inv(1)};
    return {weight, grid_rows(param_.block_scale_inv, out, in), Fp8ScaleMode::Block128x128};
  }
  if (!param_.transpose.defined()) {
    param_.transpose = Tensor::empty({in, out}, weight.dtype(), weight.device());
    ops::transpose_01(ctx, weight, param_.transpose);
    if (blockwise) {
      const Tensor& grid = param_.block_scale_inv;
      param_.transpose_scale_inv = Tensor::empty({grid.size(1), grid.size(0)}, DType::Float32, grid.device());
      ops::transpose_01(ctx, grid, param_.transpose_scale_inv);
    }
  }
  if (!blockwise) return {param_.transpose, fwd_.scale_inv(1)};
  return {param_.transpose, grid_rows(param_.transpose_scale_inv, in, out), Fp8ScaleMode::Block128x128};
}

// The weight's transposed copy is quantised again with the scale its forward set (`again`: the
// weight has not changed since); with the cache on, the forward makes both copies in one pass.
Fp8Operand Fp8LinearState::weight_operand(Context& ctx, const Tensor& weight, bool transposed) {
  if (is_fp8(weight.dtype())) return fp8_weight(ctx, weight, transposed);
  Fp8Operand& cached = transposed ? cached_w_t_ : cached_w_;  // Note [FP8 weight cache]
  if (cached.data.defined()) return cached;
  if (cache_weights_ && !transposed && !cached_w_t_.data.defined() && config_.recipe != Fp8Recipe::Blockwise) {
    const int64_t out = weight.size(0), in = weight.size(1);
    cached_w_ = {Tensor::empty({out, in}, config_.forward_dtype(), ctx.device()), fwd_.scale_inv(1)};
    cached_w_t_ = {Tensor::empty({in, out}, config_.forward_dtype(), ctx.device()), fwd_.scale_inv(1)};
    fwd_.quantize(ctx, 1, weight, cached_w_.data, cached_w_t_.data);
    return cached_w_;
  }
  Fp8Operand o = quantize(ctx, false, 1, weight, transposed, true, /*again=*/transposed);
  if (cache_weights_) cached = o;
  return o;
}

Fp8Operand Fp8LinearState::ready_weight_operand(Context& ctx, const Tensor& weight, bool transposed) {
  if (is_fp8(weight.dtype())) return fp8_weight(ctx, weight, transposed);
  if (!transposed) return cached_w_;
  Fp8Operand o = cached_w_t_;
  if (!cache_weights_) cached_w_t_ = Fp8Operand();  // a kept transpose: this backward takes it
  return o;
}

void Fp8LinearState::offer_weight_operand(const Fp8Operand& o, bool transposed) {
  if (cache_weights_ || (transposed && keep_t_)) (transposed ? cached_w_t_ : cached_w_) = o;
}

void Fp8LinearState::set_weight_cache(bool on) {
  cache_weights_ = on;
  if (!on) cached_w_ = cached_w_t_ = Fp8Operand();
}

void Fp8LinearState::set_keep_transposed_weight(bool on) {
  keep_t_ = on;
  if (!on && !cache_weights_) cached_w_t_ = Fp8Operand();
}

void Fp8LinearState::forward(Context& ctx, const ProducedTensor& x, const Tensor& weight, const Tensor& bias,
                             Tensor& y) {
  const ProducedTensor x2 = x.flat_rows();
  Tensor y2 = y.view({-1, weight.size(0)});
  const Fp8Operand qx = quantize(ctx, false, 0, x2, false, false);
  const Fp8Operand qw = weight_operand(ctx, weight, false);
  ops::fp8_gemm(ctx, qx, qw, bias, y2, false, /*fast_accumulation=*/true);  // Note [FP8 GEMM accumulation]
}

void Fp8LinearState::backward(Context& ctx, const ProducedTensor& grad_out, const ProducedTensor& x,
                              const Tensor& weight, Tensor& grad_in, Tensor& weight_grad, Tensor& bias_grad) {
  const int64_t in = weight.size(1), out = weight.size(0);
  ProducedTensor x2 = x.flat_rows(), g2 = grad_out.flat_rows();
  const bool per_tensor = config_.recipe != Fp8Recipe::Blockwise;
  if (!per_tensor || !config_.wgrad) {  // tensors in memory: the block quantisation, the bf16 weight gradient
    x2 = x2.materialize(ctx);
    g2 = g2.materialize(ctx);
  }
  const int64_t rows = g2.shape()[0];
  Tensor none;
  Fp8Operand qg, qg_t;
  bool bias_done = false;
  if (per_tensor && grad_in.defined() && weight_grad.defined() && config_.wgrad) {
    // one pass over dy for both copies, and the bias gradient's column sums in it
    qg = {Tensor::empty({rows, out}, config_.backward_dtype(), ctx.device()), bwd_.scale_inv(0)};
    qg_t = {Tensor::empty({out, rows}, config_.backward_dtype(), ctx.device()), bwd_.scale_inv(0)};
    bwd_.quantize(ctx, 0, g2, qg.data, qg_t.data, /*again=*/false, bias_grad);
    bias_done = bias_grad.defined();
  }
  if (grad_in.defined()) {
    Tensor gi2 = grad_in.view({-1, in});
    if (!qg.data.defined()) qg = quantize(ctx, true, 0, g2, false, false);
    const Fp8Operand qw_t = weight_operand(ctx, weight, true);
    ops::fp8_gemm(ctx, qg, qw_t, none, gi2, false, false);
  }
  if (weight_grad.defined() && !config_.wgrad) {  // --no-fp8-wgrad: dyᵀ·x as the bf16 layer's
    ops::linear_backward(ctx, g2.tensor(), x2.tensor(), weight, none, weight_grad, none);
  } else if (weight_grad.defined()) {
    if (!qg_t.data.defined()) qg_t = quantize(ctx, true, 0, g2, true, false);
    const Fp8Operand qx_t =
        quantize(ctx, false, 0, x2, true, false, /*again=*/config_.recipe == Fp8Recipe::Delayed);
    Tensor wg = weight_grad;
    ops::fp8_gemm(ctx, qg_t, qx_t, none, wg, true, false);
  }
  if (bias_grad.defined() && !bias_done) {
    ops::linear_backward(ctx, g2.materialize(ctx), x2.materialize(ctx), weight, none, none, bias_grad);
  }
}

void Fp8LinearState::update(Context& ctx) {
  if (config_.recipe == Fp8Recipe::Blockwise) return;
  fwd_.update(ctx);
  bwd_.update(ctx);
}

}  // namespace megatron
