// FP8 training's configuration and scaling state: Megatron's fp8 options (TransformerConfig's
// fp8, fp8_recipe, fp8_margin, ... and megatron/core/fp8_utils.py) and, per group of quantised
// tensors, the scales, scale inverses and amax histories that TransformerEngine's recipes keep
// (its "FP8 meta"), all on the device and advanced by the FP8 ops (kernels/fp8_ops.h).
//
// Note [Delayed scaling]: TE's DelayedScaling. Each tensor has an amax history of
// --fp8-amax-history-len steps ([L, n] for n tensors: row 0 the current step). Quantising with the
// current scale records max |x| into row 0 (fp8_quantize's amax); after the step
// fp8_delayed_scale_update takes amax = row 0 (--fp8-amax-compute-algo most_recent) or the max of
// the history (max), rolls the history one row (the oldest row receives this step's amax, row 0
// is cleared), and sets scale = (fp8_max / amax) / 2^--fp8-margin — keeping the previous scale
// when amax is 0, inf or NaN (a tensor that was all zeros or overflowed says nothing new) and
// using FLT_MAX when the division overflows. A step whose amax is 0 (all zeros, or the tensor not
// used) neither rolls the history nor moves the scale, as TE's bulk update (the kernel behind its
// PyTorch recipes: amax_and_scale_update_after_reduction) does. One pass over each tensor per use; the scale lags
// one step behind the data, so a sudden jump in range saturates for a step. --fp8-interval is
// accepted and ignored, as in Megatron (deprecated since TE 1.8: the scale updates every step).
//
// Note [Current scaling]: TE's Float8CurrentScaling (--fp8-recipe tensorwise): scale =
// fp8_max / amax of the tensor being quantised, computed just before quantising it (fp8_amax,
// fp8_scale_from_amax, fp8_quantize: two passes, no history; no margin). Robust to range jumps.
//
// Note [Block scaling recipe]: TE's Float8BlockScaling (--fp8-recipe blockwise): activations and
// gradients with a scale per 1x128 tile, weights per 128x128 tile (fp8_block_quantize), scales
// rounded down to powers of two (TE's default; exact scale inverses); e4m3 by default, as TE.
// Needs the hidden sizes to be multiples of 128.
#pragma once

#include <string>
#include <vector>

#include "megatron/kernels/fp8_ops.h"
#include "megatron/runtime/context.h"
#include "megatron/runtime/tensor.h"

namespace megatron {

enum class Fp8Recipe { Delayed, Tensorwise, Blockwise };

/// Megatron's FP8 options (flags in training/arguments.cpp; names and defaults as Megatron's).
struct Fp8Config {
  std::string format;               // --fp8-format: "" (off), "e4m3" or "hybrid"
  Fp8Recipe recipe = Fp8Recipe::Delayed;  // --fp8-recipe (default delayed)
  int margin = 0;                   // --fp8-margin
  int interval = 1;                 // --fp8-interval (ignored: Note [Delayed scaling])
  int amax_history_len = 1;         // --fp8-amax-history-len
  bool amax_compute_max = false;    // --fp8-amax-compute-algo max (default most_recent)
  bool first_last_layers_bf16 = false;   // --first-last-layers-bf16
  int num_layers_at_start_in_bf16 = 1;   // --num-layers-at-start-in-bf16
  int num_layers_at_end_in_bf16 = 1;     // --num-layers-at-end-in-bf16
  bool param_gather = false;        // --fp8-param-gather

  bool enabled() const { return !format.empty(); }
  /// The dtype of activations and weights (e4m3 for both formats).
  DType forward_dtype() const { return DType::Float8E4M3; }
  /// The dtype of gradients: e5m2 with hybrid, else e4m3.
  DType backward_dtype() const { return format == "hybrid" ? DType::Float8E5M2 : DType::Float8E4M3; }

  /// Megatron's checks of the options (TransformerConfig.__post_init__, validate_args), one line
  /// each: formats and recipes by name (mxfp8: Blackwell only), the history length, delayed scaling
  /// with bf16 first/last layers, the bf16 layer counts against the layers of a pipeline stage,
  /// --fp8-param-gather without FP8 or without the distributed optimizer, and blockwise with a
  /// hidden or MLP size that is not a multiple of the 128 block.
  void validate(int num_layers, int pipeline_model_parallel_size, bool use_distributed_optimizer, int hidden_size,
                int ffn_hidden_size) const;
};

/// Parses --fp8-recipe (delayed, tensorwise, blockwise; mxfp8 and custom are refused with the reason).
Fp8Recipe fp8_recipe_from_string(const std::string& s);
std::string to_string(Fp8Recipe r);

/// Megatron's is_first_last_bf16_layer: whether global layer layer_no (0-based) of num_layers stays
/// in bf16 under --first-last-layers-bf16.
bool is_first_last_bf16_layer(const Fp8Config& c, int num_layers, int layer_no);

/// The per-tensor scaling state of n tensors quantised to one fp8 dtype (a layer's forward
/// operands, or its gradients), on one device: scale, scale_inv [n] and, for the delayed recipe,
/// the amax history [L, n]; for current scaling an amax [n]. Tensor i is quantised with
/// quantize(i, ...) and the GEMM reads scale_inv(i).
class Fp8TensorScaling {
 public:
  Fp8TensorScaling() = default;
  /// Scales start at 1 and the history at 0, as TE's.
  Fp8TensorScaling(const Fp8Config& config, int64_t num_tensors, DType fp8_dtype, Device device);

  int64_t size() const { return scale_.defined() ? scale_.numel() : 0; }
  DType dtype() const { return dtype_; }
  Fp8Recipe recipe() const { return recipe_; }

  /// q = fp8(x · scale_i) and/or q_t, its transpose (either may be undefined), recording the amax
  /// (delayed: into the history's row 0; current scaling: scale_i from this x first) and writing
  /// scale_inv_i — Note [Delayed scaling], Note [Current scaling]. `again`: x was quantised with
  /// tensor i's current scale already (the backward pass's transposed copies of the weight, and
  /// of the input under the delayed recipe): quantise with that scale and record nothing.
  void quantize(Context& ctx, int64_t i, const Tensor& x, Tensor& q, Tensor& q_t, bool again = false);
  /// The delayed recipe's step after the forward or backward pass that used these tensors (a no-op
  /// for current scaling): roll the histories and update the scales, on the device.
  void update(Context& ctx);

  Tensor scale(int64_t i) const { return scale_.flat_slice(i, 1); }
  Tensor scale_inv(int64_t i) const { return scale_inv_.flat_slice(i * kScaleInvStride, 1); }
  /// The amax that quantize records into: the history's row 0 (delayed) or the current amax.
  Tensor amax(int64_t i) const;
  const Tensor& scales() const { return scale_; }
  const Tensor& amax_history() const { return amax_history_; }  // [L, n], delayed only
  Tensor& mutable_scales() { return scale_; }
  Tensor& mutable_amax_history() { return amax_history_; }

  /// Floats between consecutive scale inverses (Note [Aligned scale inverses]).
  static constexpr int64_t kScaleInvStride = 4;

 private:
  Fp8Recipe recipe_ = Fp8Recipe::Delayed;
  DType dtype_ = DType::Float8E4M3;
  Fp8DelayedParams params_;
  Tensor scale_, scale_inv_, amax_history_, amax_;
};

}  // namespace megatron
