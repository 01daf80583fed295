// DistributedDataParallel: Megatron-Core's DDP wrapper over the model chunks — its own gradient
// buffers, one per reduction group and chunk, made after the model exists; gradient reduction per
// bucket, optionally overlapped with backward, and (distributed optimizer) the all-gather of
// updated parameters — plus finalize_model_grads, the reductions over the tensor-parallel and
// embedding groups that follow it.
//
// Note [Buffers per reduction group] (Megatron's buffers and expert_parallel_buffers): each
// parameter names the group its gradient reduces over (Parameter::reduce_group): data × context
// parallel for dense parameters, expert-data parallel for the experts of a mixture of experts. For
// every chunk, the parameters of each group get a ParamAndGradBuffer of their own, laid out for
// that group's size (Note [Buckets and padding]) — dense, FP8 dense, expert, FP8 expert (the FP8
// ones under --fp8-param-gather: Note [FP8 parameters]), in registration order within each — and
// the distributed optimizer shards each buffer over its own group. The model's
// values are copied in and its own storage released, so the parameters live in exactly one place.
// A chunk whose parameters are all dense and whose buffer the caller already laid out for this
// config and group size is used as it is.
//
// Note [Gradient reduction] (Megatron's _ParamAndGradBucketGroup):
//   - A buffer's reduction group is data × context parallel for dense parameters (Megatron's
//     data-parallel group "with context parallel"; the plain data-parallel group when CP = 1), or
//     expert-data parallel. Its size is called dp below.
//   - A bucket's gradients are multiplied by 1/dp (Megatron's gradient_scaling_factor) and summed:
//     all-reduce (every rank holds the mean), or with the distributed optimizer reduce-scatter in
//     place (rank r's shard [start + r·n/dp, start + (r+1)·n/dp) of every bucket holds the mean; the
//     rest of the grad buffer holds stale local values and must not be read).
//   - With overlap_grad_reduce, a bucket is launched (async) during the chunk's last microbatch once
//     every one of its parameters has reported all its expected accumulations through GradHook
//     (notify_grad_accumulated). Buckets of a buffer are launched in bucket order — a complete
//     bucket waits for the earlier ones — so every rank issues the collectives in the same order.
//     finish_grad_sync() launches whatever was not launched, so correctness never depends on hooks.
//   - The hooks count only while grad sync is enabled for the chunk (Megatron's is_last_microbatch;
//     disable it for every microbatch but the last, as Megatron's no_sync()). Enabled by default.
//   - Everything runs on the rank's one thread; the hooks are not thread-safe.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "megatron/core/comm/communicator.h"
#include "megatron/core/distributed/param_and_grad_buffer.h"
#include "megatron/core/parallel_state.h"

namespace megatron {

/// A parameter's piece of one data-parallel rank's shard: flat elements [start, start + count) of
/// the parameter (count 0: none).
struct ParamShard {
  int64_t start = 0;
  int64_t count = 0;
};

class DistributedDataParallel : public GradHook {
 public:
  /// `chunks`: the model chunks' parameters (their buffers allocated, in any layout). Builds the
  /// buffers of Note [Buffers per reduction group] and installs itself as every parameter's grad_hook.
  DistributedDataParallel(ParallelState& ps, std::vector<ParamAndGradBuffer*> chunks, const DDPConfig& config);
  ~DistributedDataParallel() override;
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  const DDPConfig& config() const { return config_; }
  ParallelState& parallel_state() const { return ps_; }
  /// The gradient-reduction (and optimizer-sharding) group of dense parameters: data × context parallel.
  Communicator& data_parallel_group() const { return ps_.data_context(); }
  /// The group `group`'s parameters reduce over.
  Communicator& reduction_group(GradReduceGroup group) const;
  /// The reduction group of the parameter of that name.
  Communicator& reduction_group_of(const std::string& name) const;
  int num_chunks() const { return int(chunks_.size()); }
  /// A model chunk's parameters (the registry the model built).
  ParamAndGradBuffer& chunk(int i) const { return *chunks_.at(size_t(i)); }
  /// The gradient buffers (Note [Buffers per reduction group]), chunk by chunk.
  int num_buffers() const { return int(buffers_.size()); }
  const ParamAndGradBuffer& buffer(int i) const { return *buffers_.at(size_t(i)).buffer; }
  int buffer_chunk(int i) const { return buffers_.at(size_t(i)).chunk; }
  GradReduceGroup buffer_group(int i) const { return buffers_.at(size_t(i)).group; }
  /// Copies of every chunk's parameters (chunk order, registration order), for the optimizer.
  std::vector<Parameter> parameters() const;

  /// Zeros the grad buffers and resets the reduction state (Megatron's zero_grad_buffer); waits for
  /// reductions still in flight first.
  void zero_grad(Context& ctx);

  /// How many times backward accumulates into `p` per microbatch (default 1): 2 for word embeddings
  /// tied to the output layer on the same stage. The parameter is complete after that many calls.
  void set_expected_accumulations(const Parameter* p, int n);
  /// Megatron's no_sync(): while disabled, the hooks do not count (microbatches before the last).
  void enable_grad_sync();
  void disable_grad_sync();
  void set_grad_sync(int chunk, bool enabled);
  bool grad_sync_enabled(int chunk) const { return sync_enabled_.at(size_t(chunk)); }

  /// GradHook: counts an accumulation; launches the buckets that are complete (in order).
  void grad_accumulated(Context& ctx, Parameter& param) override;
  /// Launches every bucket not launched yet, then waits for all (Megatron's finish_grad_sync).
  void finish_grad_sync(Context& ctx);
  /// Multiplies every gradient buffer by `factor` (Megatron's scale_gradients).
  void scale_gradients(Context& ctx, float factor);

  /// Distributed optimizer: all-gathers every bucket's parameters from their owners' shards (after
  /// the optimizer updated the shards). Waited for at once unless overlap_param_gather, in which case
  /// finish_param_sync must be called before the parameters are read again (the next forward, eval,
  /// a checkpoint save). A no-op without the distributed optimizer or with dp = 1.
  void start_param_sync(Context& ctx);
  void finish_param_sync(Context& ctx);
  /// Waits for one chunk's all-gathers only (before that chunk's first forward).
  void finish_param_sync(Context& ctx, int chunk);

  /// Note [FP8 parameters]: the model's value of FP8 parameter `name` when DistributedDataParallel
  /// adopted it (bf16/fp32; its buffer holds fp8 bytes), for the optimizer's main params — Megatron's
  /// get_high_precision_init_val. The optimizer releases them (release_fp8_init_values) once built.
  Tensor fp8_init_value(const std::string& name) const;
  void release_fp8_init_values() { fp8_init_values_.clear(); }
  /// Whether any parameter is held in FP8.
  bool has_fp8_params() const { return has_fp8_params_; }

  /// Broadcasts every chunk's parameters from data-parallel rank 0 (Megatron's broadcast_params).
  void broadcast_params(Context& ctx);

  /// The piece of `p` (a parameter of one of the chunks, found by name) in rank `dp_rank`'s shard
  /// of its reduction group under the distributed optimizer; without it, all of `p` for every rank.
  ParamShard shard(const std::string& name, int dp_rank) const;
  ParamShard owned_shard(const std::string& name) const { return shard(name, reduction_group_of(name).rank()); }
  /// The model's parameter of that name (over every chunk), or nullptr.
  Parameter* find(const std::string& name) const;

 private:
  struct ParamState {
    int buffer = 0;
    int bucket = 0;
    int expected = 1;
    int count = 0;
  };
  struct GradBuffer {
    int chunk = 0;
    GradReduceGroup group = GradReduceGroup::DataContext;
    ParamAndGradBuffer* buffer = nullptr;      // owned below, or the chunk's own
    std::unique_ptr<ParamAndGradBuffer> owned;
  };
  struct BucketState {
    int pending = 0;  // parameters not yet complete in this iteration
    bool launched = false;
    std::unique_ptr<CommWork> grad_work;
    std::unique_ptr<CommWork> param_work;
  };
  void build_buffers();
  void launch_ready_buckets(Context& ctx, int buffer);
  void launch_bucket(Context& ctx, int buffer, int bucket);
  void widen_reduced_grads(int buffer, int bucket);
  void reset_grad_state();

  ParallelState& ps_;
  std::vector<ParamAndGradBuffer*> chunks_;
  DDPConfig config_;
  std::vector<GradBuffer> buffers_;
  std::vector<std::vector<BucketState>> buckets_;  // [buffer][bucket]
  std::vector<int> next_launch_;                   // per buffer: the first bucket not launched
  std::vector<bool> sync_enabled_;
  std::unordered_map<const Parameter*, ParamState> params_;
  std::unordered_map<std::string, Parameter*> by_name_;
  std::unordered_map<std::string, Tensor> fp8_init_values_;
  bool has_fp8_params_ = false;
};

/// Megatron's finalize_model_grads: finish_grad_sync, then all-reduce over the tensor-parallel group
/// the main grads of sequence_parallel parameters (with --sequence-parallel and TP > 1) and of
/// tp_partial_grad parameters (TP > 1), and over the
/// embedding group those of shared_embedding_copy / in_embedding_group parameters (PP > 1, on the
/// first and last stage). Every rank of those groups must hold the same such parameters in the same
/// order. With the distributed optimizer the results are right on each rank's owned shard (the
/// groups' ranks share the data-parallel rank, hence the bucket layout and shards).
/// `num_tokens` (Megatron's calculate_per_token_loss, Note [Per-token loss]): the global batch's
/// unmasked tokens as the last pipeline stage counted them (LossSums::num_tokens, summed over the
/// data and context ranks; other stages' values are ignored): broadcast over the pipeline, then
/// every gradient is divided by it (when it is > 0).
void finalize_model_grads(Context& ctx, DistributedDataParallel& ddp, std::optional<double> num_tokens = std::nullopt);

}  // namespace megatron
