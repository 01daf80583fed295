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
//
// Note [FP8 parameters] (--fp8-param-gather: Megatron's fp8_param_gather over TE's fp8_model_init
// and the distributed optimizer's quantize_param_shard): the weights of the FP8 linear layers are
// held as FP8 data (e4m3, 1 byte per element) and their scale inverses (the layer's weight tensor's,
// or the weight's 128x128 tiles') — no bf16 copy. DistributedDataParallel gives them a parameter
// buffer of their own (fp8 bytes; the fp32 grad buffer as for any parameter) and the optimizer's
// fp32 main params are the weights' only high-precision values (initialised from the model's
// bf16/fp32 initial values, as Megatron's get_high_precision_init_val). After each Adam step every
// data-parallel rank quantises its own shard of the fp32 main params straight into its shard of the
// FP8 buffer, then the all-gather moves FP8 bytes (half of bf16's traffic):
//   delayed     with the scale the step's update just set from the amax history; the shard's amax
//               goes into the history's row 0, and the next step's reduction over tensor × context
//               × data parallelism (Note [FP8 scaling under parallelism]) makes it the whole weight's;
//   tensorwise  amax of the whole weight = max over the data-parallel group of the shards' amaxes
//               (one all-reduce for every FP8 weight), then scale = fp8_max / amax;
//   blockwise   each 128x128 tile's amax over the whole weight = max over the group of the shards'
//               partial tile amaxes (fp8_block_partial_amax: a shard is cut anywhere, so a tile may
//               lie across ranks; one all-reduce for every tile of every FP8 weight, as TE's
//               _cast_master_weights_to_fp8_blockwise_scaling), then the tiles' power-of-two scales
//               and fp8_block_partial_quantize of the shard with its tiles' scales;
// and the scale inverses on every rank, whether or not it holds a piece of the weight. The scales
// are then the ones the forward would have computed from the bf16 weight without the flag, so the
// only difference in the math is the rounding: fp32 -> fp8 once instead of fp32 -> bf16 -> fp8.
// The forward uses the FP8 weight as it is; the backward's transposed copy (Hopper's GEMMs are TN
// only: Note [FP8 GEMM layouts]) is a byte transpose made by the first backward after the values
// change and kept until the next optimizer step (Fp8Param::transpose; blockwise with the tile
// grid's transpose: a 128x128 tile of Wᵀ is a tile of W transposed, with the same scale). The MoE
// experts' FP8 weights are FP8 parameters the same way, in an FP8 buffer of the expert-data-parallel
// group: their shards and amaxes span that group, the ranks that hold the same expert weight.
#pragma once

#include <string>
#include <vector>

#include "megatron/core/tensor_parallel/produced_tensor.h"
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
  /// The weight-gradient GEMM in FP8 (Megatron's fp8_wgrad; --no-fp8-wgrad: in the activations'
  /// precision, TE's override_linear_precision). Megatron honours it with the delayed recipe only;
  /// we honour it with every recipe (Note [FP8 linear layer]).
  bool wgrad = true;

  bool enabled() const { return !format.empty(); }
  /// The dtype of activations and weights (e4m3 for both formats).
  DType forward_dtype() const { return DType::Float8E4M3; }
  /// The dtype of gradients: e5m2 with hybrid, else e4m3.
  DType backward_dtype() const { return format == "hybrid" ? DType::Float8E5M2 : DType::Float8E4M3; }

  /// Megatron's checks of the options (TransformerConfig.__post_init__, validate_args), one line
  /// each: formats and recipes by name (mxfp8: Blackwell only), the history length, delayed scaling
  /// with bf16 first/last layers, the bf16 layer counts against the layers of a pipeline stage,
  /// --fp8-param-gather without FP8 or without the distributed optimizer (Note [FP8 parameters]),
  /// and blockwise with a hidden or MLP size that is not a multiple of the 128 block.
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
  /// of the input under the delayed recipe): quantise with that scale and record nothing. dbias
  /// (fp32 [K]; undefined: none) += x's column sums in the same pass (fp8_quantize_dbias). A
  /// produced x is made inside the passes (Note [Produced tensors]).
  void quantize(Context& ctx, int64_t i, const ProducedTensor& x, Tensor& q, Tensor& q_t, bool again = false,
                Tensor dbias = Tensor());
  /// The delayed recipe's step after the forward or backward pass that used these tensors (a no-op
  /// for current scaling): roll the histories and update the scales, on the device.
  void update(Context& ctx);

  Tensor scale(int64_t i) const { return scale_.flat_slice(i, 1); }
  Tensor scale_inv(int64_t i) const { return scale_inv_.flat_slice(i * kScaleInvStride, 1); }
  const Fp8DelayedParams& delayed_params() const { return params_; }
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

/// update() of every state in `states`, in one launch per kind of state (per fp8 format: the
/// grouped update, fp8_delayed_scale_update_grouped) rather than one per state.
void update_fp8_scaling(Context& ctx, const std::vector<Fp8TensorScaling*>& states);

/// A weight held in FP8 under --fp8-param-gather (Note [FP8 parameters]): Parameter::fp8 points at
/// this, owned by the weight's layer (Fp8LinearState).
struct Fp8Param {
  /// Per-tensor recipes: the layer's forward state; the weight is its tensor `index`. Null under
  /// the blockwise recipe, whose scales are the weight's own tiles' (block_scale_inv).
  Fp8TensorScaling* scaling = nullptr;
  int64_t index = 1;
  /// The weight's dtype without FP8 parameters (the run's bf16 or fp32): its checkpoints store it so.
  DType model_dtype = DType::BFloat16;
  /// The optimizer has written the FP8 values (AdamOptimizer::copy_main_params_to_model_params).
  bool quantized = false;
  /// The transposed FP8 copy for the input-gradient GEMM; undefined when the values changed since.
  Tensor transpose;
  /// Blockwise: the 128x128 tiles' scale inverses, fp32 [roundup(ceil(out/128), 4), roundup(ceil(in/128), 4)]
  /// — the forward GEMM reads its first ceil(out/128) rows (fp8_block_scale_shape), and its
  /// transpose's first ceil(in/128) rows are the transposed copy's (transpose_scale_inv).
  Tensor block_scale_inv, transpose_scale_inv;
  bool blockwise() const { return scaling == nullptr; }
  /// The weight's FP8 data `data` dequantised to `out` (its shape, fp32/bf16): with the weight's
  /// scale_inv, or tile by tile.
  void dequantize(Context& ctx, const Tensor& data, Tensor& out) const;
};

/// The FP8 parameters' quantisation from their fp32 main values (Note [FP8 parameters]): for each
/// weight, `main` is this rank's shard of its fp32 main params — elements [start, start + n) of the
/// flattened weight of `shape` — and `data` the same elements of its FP8 data (both may be empty).
/// Tensorwise and blockwise: `amax_group` (the group the weight's shards span — data-parallel for a
/// dense weight, expert-data-parallel for an expert's — or null with one rank) takes one all-reduce
/// (max) of every shard's amax, or of every shard's tile amaxes.
struct Fp8ParamShard {
  Fp8Param* param = nullptr;
  Tensor main, data;
  int64_t start = 0;
  Shape shape;
};
class Communicator;
void quantize_fp8_param_shards(Context& ctx, const std::vector<Fp8ParamShard>& shards, Communicator* amax_group);

}  // namespace megatron
