// Linear layers: y = x·Wᵀ + b with W [out, in] — Megatron's ColumnParallelLinear and
// RowParallelLinear. The weight gradient accumulates into the fp32 main_grad (gradient-accumulation
// fusion); after each accumulation the parameter's grad hook is told (data-parallel overlap).
//
//   Column (W split along out): x [N, in] -> y [N, out/tp]; no output gather (Megatron's
//     gather_output=False). Without sequence parallelism x is the same on every rank and its
//     gradient is all-reduced (copy_to_tensor_model_parallel_region); with it, x is this rank's
//     [N/tp, in] sequence shard, all-gathered for the GEMM (and again in backward, as Megatron does,
//     instead of keeping the gathered copy), and the input gradient is reduce-scattered.
//   Row (W split along in): x [N, in/tp] -> y [N, out] all-reduced (or [N/tp, out] reduce-scattered
//     with sequence parallelism); the bias is added once, by tensor-parallel rank 0, before the
//     reduction, so every rank computes its whole gradient (tp_duplicate).
//   ExpertColumn, ExpertRow: an expert's layers (Megatron's is_expert with explicit_expert_comm):
//     the weight is split as Column / Row over the expert-tensor-parallel group, and the layer
//     itself communicates nothing — the token dispatcher all-gathers the tokens over that group and
//     reduce-scatters the outputs.
//   None: the single-device layer.
// N is the flattened [s, b] sequence-first dimension, so sequence shards are contiguous row blocks.
#pragma once

#include <memory>
#include <string>

#include "megatron/core/distributed/param_and_grad_buffer.h"
#include "megatron/core/process_groups_config.h"
#include "megatron/core/tensor_parallel/produced_tensor.h"
#include "megatron/runtime/context.h"

namespace megatron {

enum class ParallelMode { None, Column, Row, ExpertColumn, ExpertRow };

struct Fp8Config;
class Fp8LinearState;

class Linear {
 public:
  /// Registers "<prefix>.weight" (and "<prefix>.bias" when `bias`), sharded by `mode` over the
  /// tensor-parallel group `tp` (null or one rank: unsharded); `sequence_parallel`: the config's
  /// --sequence-parallel (it applies when tp has more than one rank). `chunks`: the output dimension
  /// holds that many blocks each split over the ranks (SwiGLU's [gate; up]).
  Linear(ParamAndGradBuffer& params, const std::string& prefix, int64_t in_features, int64_t out_features, bool bias,
         ParamInit weight_init, ParallelMode mode = ParallelMode::None, Communicator* tp = nullptr,
         bool sequence_parallel = false, int chunks = 1);
  /// A column-parallel layer on an existing weight (the tied output layer); no bias.
  Linear(Parameter* shared_weight, ParallelMode mode = ParallelMode::None, Communicator* tp = nullptr,
         bool sequence_parallel = false);

  /// Forward as described above. The caller keeps x (as given) for backward. x may be a produced
  /// tensor (Note [Produced tensors]: SwiGLU's output into fc2), made in the FP8 quantisation pass
  /// or else materialised.
  Tensor forward(Context& ctx, const ProducedTensor& x) const;
  /// Forward followed by GeLU, in one GEMM where the kernels allow (ops::linear_gelu_forward):
  /// returns gelu(y) and sets `pre` to y, which backward_through_gelu needs. Not for a row-parallel
  /// layer (its y is a partial sum before the reduction), nor an FP8 one.
  Tensor forward_gelu(Context& ctx, const Tensor& x, Tensor& pre) const;
  /// Returns grad_in shaped like x (undefined when !need_grad_in); accumulates the parameter gradients.
  /// grad_out and x may be produced tensors (Note [Produced tensors]).
  Tensor backward(Context& ctx, const ProducedTensor& grad_out, const ProducedTensor& x,
                  bool need_grad_in = true) const;
  /// Backward of a layer whose input x is gelu(pre) (the MLP's fc2): returns the gradient of pre,
  /// gelu'(pre) ⊙ grad_x, in one GEMM where the kernels allow (ops::linear_dgelu_backward). Not for a
  /// column-parallel layer (its input gradient is reduced across ranks first), nor an FP8 one.
  Tensor backward_through_gelu(Context& ctx, const Tensor& grad_out, const Tensor& x, const Tensor& pre) const;

  /// Runs this layer's GEMMs in FP8 with the recipe of `config` (Note [FP8 linear layer],
  /// fp8_linear.h): Megatron's choice for the linear layers of attention and MLP. The GeLU epilogue
  /// fusions are bf16 only: in FP8 the MLP hands GeLU to the layers as produced tensors.
  /// `device`: where the layer's parameters live (they may not be allocated yet). With
  /// config.param_gather the weight becomes an FP8 parameter (Note [FP8 parameters]).
  void enable_fp8(const Fp8Config& config, Device device);
  /// The layer's FP8 state (null when FP8 is off): its update() is the delayed recipe's step.
  Fp8LinearState* fp8() const { return fp8_.get(); }

  const Parameter* weight() const { return weight_; }
  /// The layer's name: its weight's without ".weight" ("decoder.layers.0.self_attention.linear_qkv").
  std::string name() const;
  /// Local output features (out/tp for a column-parallel layer).
  int64_t out_features() const { return weight_->data.size(0); }

 private:
  Communicator* tp_group() const { return tp_; }
  // The layer's GEMMs on local tensors: ops::linear_* or, with FP8, fp8_'s.
  void gemm_forward(Context& ctx, const ProducedTensor& x, const Tensor& bias, Tensor& y) const;
  void gemm_backward(Context& ctx, const ProducedTensor& grad_out, const ProducedTensor& x, Tensor& grad_in,
                     Tensor& bias_grad) const;
  bool sequence_parallel() const { return sequence_parallel_; }

  Parameter* weight_;
  Parameter* bias_ = nullptr;
  ParallelMode mode_ = ParallelMode::None;
  Communicator* tp_ = nullptr;  // null: one rank
  bool sequence_parallel_ = false;
  std::shared_ptr<Fp8LinearState> fp8_;
};

/// The ShardSpec of a tensor-parallel parameter of global shape `shape` split along `dim` (-1:
/// unsharded) over the tensor-parallel group `tp` (null: one rank).
ShardSpec tp_shard(const Shape& shape, int dim, const Communicator* tp, int chunks = 1);

}  // namespace megatron
