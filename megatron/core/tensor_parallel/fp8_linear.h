// One linear layer's GEMMs in FP8: y = x·Wᵀ + b and its two gradients, with the layer's FP8
// scaling state (TE's fp8 meta of one te.Linear). Linear (layers.h) calls these on its local
// tensors when FP8 is on for the layer; the tensor-parallel communication stays in Linear.
//
// Note [FP8 linear layer]: the three GEMMs of Note [FP8 GEMM layouts] with the recipe's operands:
//   forward      x (e4m3, the input's scale), W (e4m3, the weight's scale), bias added in fp32,
//                with fast accumulation under the per-tensor recipes (TE's fprop setting; Note
//                [FP8 GEMM accumulation]);
//   grad_in      dy (the backward dtype: e5m2 with hybrid) · the transposed weight copy W_t;
//   weight_grad  dy_t · x_t, accumulated into the fp32 main_grad (with --no-fp8-wgrad dyᵀ·x in the
//                activations' precision, the unquantised layer's GEMM); the bias gradient is the
//                column sum of dy in its own precision (not quantised), as TE's bgrad — summed in
//                the pass that quantises dy (fp8_quantize_dbias) when that pass makes both copies.
// Per-tensor recipes quantise with Fp8TensorScaling (forward: tensors 0 = input, 1 = weight;
// backward: 0 = output gradient); the transposed copies x_t and W_t are made in backward by
// quantising the kept bf16 tensors again with the same state, recording no amax (delayed: the
// step's scale, so the copies equal the forward's transposed; current scaling: W_t with the scale
// its forward set — the weight has not changed — and x_t from its own amax again, since another
// microbatch's forward may have rescaled tensor 0 in between). Nothing fp8 is kept between forward
// and backward. The blockwise recipe quantises x and dy per 1x128
// tile, W per 128x128 tile; the weight gradient's operands are 1x128 tiles along the token
// dimension of the transposed tensors (Note [FP8 block scaling]).
// update() is the delayed recipe's step, once per training step after its last backward (the
// model reduces the amax over its ranks first: Note [FP8 scaling under parallelism]). The weights
// stay in their bf16 (or fp32) parameters and are quantised at each use — once in forward, once
// transposed in backward — which costs a pass over them per microbatch and no memory between,
// unless the step caches them (Note [FP8 weight cache]); under --fp8-param-gather a weight given
// in FP8 (Note [FP8 parameters]) is used as it is with the weight's scale_inv, and its transposed
// copy is made once after each optimizer step.
//
// Note [FP8 weight cache] (TE's is_first_microbatch, which Megatron's TE layers pass unless
// disable_parameter_transpose_cache): a training step with several microbatches quantises each
// weight once — its first forward makes the FP8 copy and the transposed one in one pass over the
// weight, and every later use in the step reuses them; the model turns the cache on before the
// step's first microbatch (ModelChunk::begin_fp8_step) and off, dropping the copies, once the step's
// gradients are final (finish_fp8_step), before the optimizer changes the weights. The copies are
// the bytes every microbatch would make (the weight and its scale do not change within a step; the
// delayed recipe's amax of the weight is its max over the step's uses either way), so a step gives
// the same result with or without the cache. It costs the copies' memory (1 byte per weight element
// each) for the length of the step — no more at the step's peak than making the transposed copy at
// the first backward did, since every later microbatch's forward holds both — so a step of one
// microbatch does not use it; nor does a step captured whole in a CUDA graph (its replays would
// write into copies the step had dropped).
// Kept transposes (set_keep_transposed_weight; the MoE experts' grouped layers at one microbatch,
// Note [Grouped FP8 linear layers]): the forward's pass over the weight also makes the transposed
// copy, kept until the backward that uses it takes it — one pass over the weight per step instead
// of two, for 1 byte per weight element held from the forward to the backward (TE keeps both copies
// for the whole run). The single layer's forward does not (the dense layers keep bf16's peak memory).
#pragma once

#include "megatron/core/fp8_utils.h"

namespace megatron {

class Fp8LinearState {
 public:
  Fp8LinearState(const Fp8Config& config, Device device);
  Fp8LinearState(const Fp8LinearState&) = delete;  // param_ points into fwd_
  Fp8LinearState& operator=(const Fp8LinearState&) = delete;

  /// y [N, out] (x's dtype) = x [N, in] · weight [out, in]ᵀ + bias (undefined: none). The weight
  /// is bf16/fp32, or fp8 with param() (Note [FP8 parameters]).
  /// x may be produced in its quantisation pass (Note [Produced tensors]).
  void forward(Context& ctx, const ProducedTensor& x, const Tensor& weight, const Tensor& bias, Tensor& y);
  /// grad_in [N, in] = grad_out · weight (undefined: skipped); weight_grad [out, in] fp32 +=
  /// grad_outᵀ · x (undefined: skipped); bias_grad [out] fp32 += Σ_rows grad_out (undefined: skipped).
  /// grad_out and x may be produced in their quantisation passes (the blockwise recipe and
  /// --no-fp8-wgrad materialise them).
  void backward(Context& ctx, const ProducedTensor& grad_out, const ProducedTensor& x, const Tensor& weight,
                Tensor& grad_in, Tensor& weight_grad, Tensor& bias_grad);
  /// The delayed recipe's history roll and scale update for this layer (a no-op for the others).
  void update(Context& ctx);
  /// Note [FP8 weight cache]: on, the weight's FP8 copies (forward, and the transposed one) are made
  /// at their first use and reused until the cache is turned off; off drops them.
  void set_weight_cache(bool on);
  bool has_cached_weight() const { return cached_w_.data.defined() || cached_w_t_.data.defined(); }
  /// Note [FP8 weight cache], kept transposes: on, a grouped forward's weight pass also makes the
  /// transposed copy, which the next backward takes; off drops a kept one.
  void set_keep_transposed_weight(bool on);
  /// Whether a forward's pass over the weight also makes the transposed copy (cache or kept
  /// transposes on, and none made yet).
  bool wants_transposed_in_forward() const { return (cache_weights_ || keep_t_) && !cached_w_t_.data.defined(); }

  /// For a grouped pass over several layers' weights (fp8_grouped_linear.h): the weight's operand
  /// when it takes no quantisation pass — an FP8 weight, or the cache's copy — else undefined data;
  /// and the operand a grouped pass made, kept when the cache is on (the transposed one also with
  /// kept transposes, until a backward takes it).
  Fp8Operand ready_weight_operand(Context& ctx, const Tensor& weight, bool transposed);
  void offer_weight_operand(const Fp8Operand& o, bool transposed);

  const Fp8Config& config() const { return config_; }
  /// Per-tensor recipes: the forward (input, weight) and backward (output gradient) state.
  Fp8TensorScaling& forward_scaling() { return fwd_; }
  Fp8TensorScaling& backward_scaling() { return bwd_; }
  /// The weight's FP8 parameter state (Note [FP8 parameters]), for Parameter::fp8.
  Fp8Param* param() { return &param_; }

 private:
  /// again: x was quantised with tensor `index`'s scale earlier in this step (Fp8TensorScaling::quantize).
  Fp8Operand quantize(Context& ctx, bool backward, int64_t index, const ProducedTensor& x, bool transposed,
                      bool tile_2d, bool again = false);
  /// The FP8 weight (Note [FP8 parameters]) as a GEMM operand, or its transposed copy.
  Fp8Operand fp8_weight(Context& ctx, const Tensor& weight, bool transposed);

  /// The weight's operand (transposed: the input gradient's), from the cache or quantised now.
  Fp8Operand weight_operand(Context& ctx, const Tensor& weight, bool transposed);

  Fp8Config config_;
  Fp8TensorScaling fwd_, bwd_;
  Fp8Param param_;
  bool cache_weights_ = false;      // Note [FP8 weight cache]
  bool keep_t_ = false;             // kept transposes
  Fp8Operand cached_w_, cached_w_t_;
};

}  // namespace megatron
