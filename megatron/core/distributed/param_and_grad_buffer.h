// ParamAndGradBuffer: parameters in one contiguous buffer of the model dtype, and their gradients
// in one contiguous fp32 buffer (Megatron's main_grad). Parameters are laid out in reverse
// registration order — the order backward produces their gradients — so the data-parallel buckets
// reduce contiguous ranges as soon as they are ready. A buffer serves in two roles:
//   - a model chunk's parameters: modules register them while they are built (add()) and keep the
//     returned pointers; allocate() then creates the storage (one bucket, no padding, unless a
//     DDP layout is given) and points every Parameter at its views;
//   - DistributedDataParallel's buffers (Megatron's _ParamAndGradBuffer, one per reduction group
//     and model chunk, made after the model exists): the adopting constructor lays out parameters
//     that live elsewhere, copies their values in and points them at the new storage; the chunk's
//     own storage is then released (release_storage()).
//
// Note [Buckets and padding] (Megatron's _ParamAndGradBuffer): allocate(config, dp) cuts the layout
// into buckets at parameter boundaries — a bucket closes once it holds >= bucket_size elements, so
// it may exceed the size by its last parameter. With the distributed optimizer:
//   - each parameter starts at a multiple of 64 elements (aligned views for the kernels);
//   - each bucket is padded to a multiple of lcm(dp, 128) elements, so every data-parallel rank owns
//     an equal contiguous shard of every bucket, 128-element aligned when dp divides 128;
//   - a parameter of the tied embeddings (shared_embedding_copy / in_embedding_group) gets a bucket
//     of its own: the first and last pipeline stages then shard it identically, so the
//     embedding-group all-reduce after the data-parallel reduce-scatter is right on the owned shard.
// Padding is zero in both buffers and belongs to no parameter.
#pragma once

#include <optional>

#include <deque>
#include <string>
#include <unordered_map>
#include <vector>

#include "megatron/core/parameter.h"
#include "megatron/runtime/tensor.h"

namespace megatron {

/// How a parameter is initialised (Megatron's init_method / output_layer_init_method, zeros, ones).
enum class ParamInit { Normal, ScaledNormal, Zeros, Ones };

/// Megatron's DistributedDataParallelConfig (the part this build has).
struct DDPConfig {
  /// Start a bucket's reduction during the last microbatch's backward, as soon as its gradients are
  /// complete (GradHook), instead of all at once in finish_grad_sync().
  bool overlap_grad_reduce = false;
  /// Distributed optimizer: the all-gather of updated parameters runs asynchronously after the step
  /// and is waited for before the next forward (DistributedDataParallel::finish_param_sync).
  bool overlap_param_gather = false;
  /// Shard the optimizer state over data-parallel ranks: reduce-scatter instead of all-reduce.
  bool use_distributed_optimizer = false;
  /// Bucket size in elements. Unset: Megatron's default — max(40M, 1M·dp) with overlap_grad_reduce,
  /// else one bucket. Megatron ignores --ddp-bucket-size without --overlap-grad-reduce; map the flag
  /// only when it is set. A value is always honoured here (tests cut small buckets).
  std::optional<int64_t> bucket_size;
  /// Reduce gradients in fp32 (default); false (--grad-reduce-in-bf16): in the parameters' dtype
  /// (Note [Gradient reduction dtype]).
  bool grad_reduce_in_fp32 = true;
  /// Megatron's calculate_per_token_loss: the reduction sums over the data-parallel ranks instead
  /// of averaging (Note [Per-token loss] in pipeline_parallel/schedules.h).
  bool calculate_per_token_loss = false;
};

/// The bucket size allocate() uses: config.bucket_size, else Megatron's default (0: one bucket).
int64_t effective_bucket_size(const DDPConfig& config, int dp_size);

// Note [Gradient reduction dtype] (Megatron's grad_reduce_in_fp32 = not --grad-reduce-in-bf16):
// with grad_reduce_in_fp32 false and parameters that are not fp32, each buffer also holds a reduce
// buffer of the parameters' dtype (bf16). Gradients still accumulate over the microbatches in the
// fp32 grad buffer — every kernel here accumulates parameter gradients in fp32 — and a bucket's
// reduction rounds its fp32 gradients (already multiplied by the scaling factor) into its range of
// the reduce buffer, reduces that in bf16 (all-reduce, or reduce-scatter in place) and widens the
// result back into the fp32 grad buffer (the owned shard with the distributed optimizer), which the
// optimizer then reads as before. Megatron keeps main_grad itself in bf16 (accumulation included)
// and saves the fp32 buffer's memory; here the collective's traffic is halved and the reduce buffer
// costs 2 bytes per parameter more.

/// A contiguous range of both buffers whose gradients are reduced by one collective.
struct Bucket {
  int64_t start = 0, end = 0;      // [start, end) in the buffers, padding included
  std::vector<Parameter*> params;  // in layout order (reverse registration order)
  Tensor param_data;               // views of the range, 1-D
  Tensor grad_data;
  Tensor reduce_data;  // the range of the reduce buffer (Note [Gradient reduction dtype]); grad_data when fp32
  int64_t numel() const { return end - start; }
};

class ParamAndGradBuffer {
 public:
  ParamAndGradBuffer(DType param_dtype, Device device) : param_dtype_(param_dtype), device_(device) {}
  /// Adopts `params` (registration order; owned elsewhere, all of `param_dtype` on `device`): lays
  /// them out with `config` and `dp_size` (Note [Buckets and padding]), copies their values into the
  /// new buffer and points their data and main_grad at it (the gradients start at zero). An fp8
  /// `param_dtype` takes FP8 weights (Parameter::fp8) of any dtype and leaves their values to the
  /// optimizer (Note [FP8 parameters]).
  ParamAndGradBuffer(DType param_dtype, Device device, const std::vector<Parameter*>& params, const DDPConfig& config,
                     int dp_size);
  ParamAndGradBuffer(const ParamAndGradBuffer&) = delete;
  ParamAndGradBuffer& operator=(const ParamAndGradBuffer&) = delete;

  /// Registers a parameter (before allocate()); the pointer stays valid for the buffer's lifetime.
  Parameter* add(const std::string& name, const Shape& shape, bool no_weight_decay, ParamInit init);
  /// Registers a tensor-parallel shard: the local shape is local_shape(spec), and initialisation
  /// gives it the values of its piece of the full tensor.
  Parameter* add(const std::string& name, const ShardSpec& spec, bool no_weight_decay, ParamInit init);
  /// Creates the buffers and buckets (Note [Buckets and padding]); `dp_size` is the number of ranks
  /// that reduce gradients together (data × context parallel). `with_grads` false: the parameters
  /// only, no gradient buffer and no main_grad (a model for inference).
  void allocate(const DDPConfig& config = {}, int dp_size = 1, bool with_grads = true);
  /// Whether the parameters have gradients (main_grad): allocate's with_grads.
  bool has_grads() const { return with_grads_; }
  bool allocated() const { return param_buffer_.defined() || released_; }
  /// After another buffer adopted every parameter: drops this buffer's storage (the parameters
  /// keep their new views; zero_grad() then zeros each one's main_grad).
  void release_storage();
  /// Whether this buffer's parameters were laid out with `config` over `dp_size` ranks, as
  /// DistributedDataParallel would lay them out (then it can use the buffer as it is).
  bool has_layout(const DDPConfig& config, int dp_size) const;

  /// Initialises every parameter as Megatron does: normal(0, std) weights, normal(0, std/sqrt(2L))
  /// output projections, zero biases, unit norm weights (zero with zero-centered gamma). The values
  /// are a pure function of (seed, parameter name, element index in the full tensor), independent of
  /// layout and order: a tensor-parallel shard gets exactly its piece of the single-process values.
  void init_weights(uint64_t seed, float std, int num_layers, bool zero_centered_gamma);
  void zero_grad();

  const std::vector<Parameter*>& parameters() const { return params_; }
  /// The device the parameters live on.
  Device device() const { return device_; }
  /// The parameter of that name, or nullptr.
  Parameter* find(const std::string& name) const;
  const Tensor& param_buffer() const { return param_buffer_; }
  const Tensor& grad_buffer() const { return grad_buffer_; }
  /// The buffer gradients are reduced in (Note [Gradient reduction dtype]): grad_buffer() when fp32.
  const Tensor& grad_reduce_buffer() const { return reduce_buffer_.defined() ? reduce_buffer_ : grad_buffer_; }
  /// Elements of all parameters (the buffers may be longer by the padding).
  int64_t numel() const { return numel_; }

  const std::vector<Bucket>& buckets() const { return buckets_; }
  /// Where a parameter of this buffer lies: its first element's offset in the buffers and its bucket.
  struct Location {
    int64_t offset = 0;
    int bucket = 0;
  };
  Location location(const Parameter* p) const;
  const DDPConfig& ddp_config() const { return config_; }
  int dp_size() const { return dp_size_; }

 private:
  struct Entry {
    Parameter* param;  // in owned_ (registered) or elsewhere (adopted)
    Shape shape;
    ParamInit init;
    Location location;
  };
  void lay_out(const DDPConfig& config, int dp_size);

  DType param_dtype_;
  Device device_;
  std::deque<Parameter> owned_;  // registered parameters (stable addresses)
  std::deque<Entry> entries_;    // stable addresses
  std::vector<Parameter*> params_;
  std::unordered_map<std::string, Parameter*> by_name_;
  std::unordered_map<const Parameter*, Entry*> entry_of_;
  std::vector<Bucket> buckets_;
  DDPConfig config_;
  int dp_size_ = 1;
  Tensor param_buffer_;
  Tensor grad_buffer_;
  Tensor reduce_buffer_;  // undefined when gradients are reduced in fp32
  int64_t numel_ = 0;
  bool released_ = false;
  bool with_grads_ = true;
};

}  // namespace megatron
