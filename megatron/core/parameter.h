// A trainable parameter (what torch.nn.Parameter and its Megatron attributes are to Megatron): the
// model's tensor, its fp32 gradient (Megatron's param.main_grad), whether weight decay applies, how
// the local tensor sits in the full (unsharded) parameter under tensor parallelism, and which group
// its gradient is reduced over. Modules create them (through a ParamAndGradBuffer, registration
// order); the data-parallel wrapper (distributed/) lays them out in its buffers; the optimizer
// (optimizer/) and checkpoints (dist_checkpointing/) read them — so it sits below all three.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "megatron/runtime/context.h"
#include "megatron/runtime/tensor.h"

namespace megatron {

class Context;
struct Parameter;
struct Fp8Param;

/// Told each time a backward pass has accumulated into a parameter's main_grad (the data-parallel
/// wrapper uses it to start reducing a bucket as soon as its gradients are complete).
class GradHook {
 public:
  virtual ~GradHook() = default;
  virtual void grad_accumulated(Context& ctx, Parameter& param) = 0;
};

/// How a parameter's local tensor is a piece of the full tensor (Megatron's tensor_model_parallel,
/// partition_dim and partition_stride attributes). Unsharded (partition_dim < 0) parameters are
/// whole on every tensor-parallel rank.
struct ShardSpec {
  Shape global_shape;      // the full tensor's shape (== the local shape when unsharded)
  int partition_dim = -1;  // the split dimension, or -1
  int rank = 0;            // tensor-parallel rank and size along partition_dim
  int size = 1;
  /// partition_dim holds `chunks` equal blocks, each split over the ranks: the local tensor is
  /// [block 0's piece; block 1's piece; ...] (SwiGLU's fc1 [gate; up], Megatron's stride).
  int chunks = 1;
};

/// One rectangle: local[local_offset + i] = global[global_offset + i] for every i < shape.
struct ShardBox {
  std::vector<int64_t> global_offset, local_offset, shape;
};

/// A contiguous run: local flat [local_start, +count) = global flat [global_start, +count).
struct FlatRun {
  int64_t global_start, local_start, count;
};

/// The rectangles that make up a local tensor of `spec` (one, or `chunks` of them).
std::vector<ShardBox> shard_boxes(const ShardSpec& spec);
/// The local shape of a parameter of `spec`.
Shape local_shape(const ShardSpec& spec);
/// A box as maximal contiguous runs of flat (row-major) elements of the global and local tensors.
std::vector<FlatRun> flat_runs(const ShardBox& box, const Shape& global_shape, const Shape& local_shape);
/// An unsharded spec for a tensor of `shape`.
ShardSpec unsharded(const Shape& shape);

/// The group a parameter's gradient is reduced (and its optimizer state sharded) over — Megatron's
/// dense buffers (data × context parallel) and expert_parallel_buffers (expert-data parallel; the
/// experts of a mixture-of-experts layer, param.allreduce = False in Megatron).
enum class GradReduceGroup { DataContext, ExpertData };
const char* grad_reduce_group_name(GradReduceGroup g);

struct Parameter {
  std::string name;  // unique, e.g. "decoder.layers.0.self_attention.linear_qkv.weight"
  Tensor data;       // model dtype: fp32, bf16 or fp16; fp8 when `fp8` is set
  Tensor main_grad;  // fp32, same numel; owned by the model, zeroed by the caller
  bool no_weight_decay = false;
  ShardSpec shard;   // empty global_shape: unsharded, the local shape
  /// The same values live on every tensor-parallel rank (norm weights, row-parallel biases): counted
  /// once (tp rank 0) in gradient norms and checkpoints.
  bool tp_duplicate = false;
  /// Computed on sequence shards under --sequence-parallel (norm weights and biases, row-parallel
  /// biases): its gradient is all-reduced over the tensor-parallel group.
  bool sequence_parallel = false;
  /// Its gradient on each tensor-parallel rank is a partial sum over that rank's share of the work
  /// although the values are whole on every rank (the q/k layernorms over this rank's heads,
  /// Megatron's q_layernorm/k_layernorm): all-reduced over the tensor-parallel group by
  /// finalize_model_grads, with or without --sequence-parallel.
  bool tp_partial_grad = false;
  /// The last pipeline stage's copy of the tied word embeddings (Megatron's output_layer.weight with
  /// share_embeddings_and_output_weights): same name and values as the first stage's, gradients
  /// all-reduced over the embedding group, not counted in norms and not saved.
  bool shared_embedding_copy = false;
  /// The word embeddings of the first stage when the output layer shares them on another stage:
  /// gradients all-reduced over the embedding group.
  bool in_embedding_group = false;
  /// Megatron's is_embedding_or_output_parameter: the word embeddings (every stage's copy) and the
  /// output layer's weight, which --decoupled-lr gives their own learning rate.
  bool is_embedding_or_output_parameter = false;
  /// The group DistributedDataParallel reduces the gradient over (one buffer per group).
  GradReduceGroup reduce_group = GradReduceGroup::DataContext;
  /// --fp8-param-gather: the weight of an FP8 layer, held in FP8 once DistributedDataParallel has
  /// laid it out (Note [FP8 parameters], core/fp8_utils.h); owned by the layer. Null otherwise.
  Fp8Param* fp8 = nullptr;
  /// Set by the data-parallel wrapper; modules call notify_grad_accumulated after accumulating.
  GradHook* grad_hook = nullptr;
};

/// Model state that is not a parameter but belongs in checkpoints (Megatron's persistent buffers —
/// the MoE routers' expert biases — and TransformerEngine's extra state — the FP8 scaling state), by
/// name, the same on every rank that holds it.
struct ModelBuffer {
  std::string name;
  Tensor* tensor = nullptr;
  /// Loaded when the checkpoint has it, else left as it is (the FP8 scaling state: a bf16 run's
  /// checkpoint has none, and a bf16 run ignores an FP8 run's). A required one must be there.
  bool optional = false;
  /// The same on the ranks that hold one routed expert (expert tensor × expert data parallel), and
  /// written by those that write the expert weights; else by those that write the dense weights.
  bool expert = false;
};

// Note [Gradient hooks on the side stream]: a gradient accumulated by work on a side context
// (Note [Side stream], runtime/context.h) is reported at the SideStream's join, on the main
// context. A hook launches its bucket's reduction ordered after the stream it is given; the bucket
// may also hold gradients the main stream computes at the same time, and the side's gradient is
// complete only once the side stream has run — after the join, the main stream has both.
inline void notify_grad_accumulated(Context& ctx, Parameter* p) {
  if (!p || !p->grad_hook) return;
  if (ctx.is_side()) {
    ctx.after_join([p](Context& main) { p->grad_hook->grad_accumulated(main, *p); });
    return;
  }
  p->grad_hook->grad_accumulated(ctx, *p);
}

/// Megatron's default rule (_get_param_groups): no weight decay for biases and 1-D parameters
/// (norm weights).
inline bool default_no_weight_decay(std::string_view name, const Tensor& data) {
  return data.dim() == 1 || (name.size() >= 5 && name.substr(name.size() - 5) == ".bias");
}

/// A Parameter with no_weight_decay set by Megatron's default rule.
inline Parameter make_parameter(std::string name, Tensor data, Tensor main_grad) {
  const bool no_wd = default_no_weight_decay(name, data);
  Parameter p;
  p.name = std::move(name);
  p.data = std::move(data);
  p.main_grad = std::move(main_grad);
  p.no_weight_decay = no_wd;
  p.shard = unsharded(p.data.shape());
  return p;
}

}  // namespace megatron
