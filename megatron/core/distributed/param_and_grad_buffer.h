// ParamAndGradBuffer: all parameters of a model chunk in one contiguous buffer of the model dtype,
// and their gradients in one contiguous fp32 buffer (Megatron's main_grad). Parameters are laid out
// in reverse registration order — the order backward produces their gradients — so the later
// data-parallel bucketing reduces contiguous ranges as soon as they are ready.
//
// Modules register their parameters while they are built (add()), and keep the returned pointers;
// allocate() then creates the buffers and points every Parameter at its views.
#pragma once

#include <deque>
#include <string>
#include <unordered_map>
#include <vector>

#include "megatron/core/optimizer/parameter.h"
#include "megatron/runtime/tensor.h"

namespace megatron {

/// How a parameter is initialised (Megatron's init_method / output_layer_init_method, zeros, ones).
enum class ParamInit { Normal, ScaledNormal, Zeros, Ones };

class ParamAndGradBuffer {
 public:
  ParamAndGradBuffer(DType param_dtype, Device device) : param_dtype_(param_dtype), device_(device) {}
  ParamAndGradBuffer(const ParamAndGradBuffer&) = delete;
  ParamAndGradBuffer& operator=(const ParamAndGradBuffer&) = delete;

  /// Registers a parameter (before allocate()); the pointer stays valid for the buffer's lifetime.
  Parameter* add(const std::string& name, const Shape& shape, bool no_weight_decay, ParamInit init);
  /// Registers a tensor-parallel shard: the local shape is local_shape(spec), and initialisation
  /// gives it the values of its piece of the full tensor.
  Parameter* add(const std::string& name, const ShardSpec& spec, bool no_weight_decay, ParamInit init);
  void allocate();
  bool allocated() const { return param_buffer_.defined(); }

  /// Initialises every parameter as Megatron does: normal(0, std) weights, normal(0, std/sqrt(2L))
  /// output projections, zero biases, unit norm weights (zero with zero-centered gamma). The values
  /// are a pure function of (seed, parameter name, element index in the full tensor), independent of
  /// layout and order: a tensor-parallel shard gets exactly its piece of the single-process values.
  void init_weights(uint64_t seed, float std, int num_layers, bool zero_centered_gamma);
  void zero_grad();

  const std::vector<Parameter*>& parameters() const { return params_; }
  /// The parameter of that name, or nullptr.
  Parameter* find(const std::string& name) const;
  const Tensor& param_buffer() const { return param_buffer_; }
  const Tensor& grad_buffer() const { return grad_buffer_; }
  int64_t numel() const { return numel_; }

 private:
  struct Entry {
    Parameter param;
    Shape shape;
    ParamInit init;
  };
  DType param_dtype_;
  Device device_;
  std::deque<Entry> entries_;  // stable addresses
  std::vector<Parameter*> params_;
  std::unordered_map<std::string, Parameter*> by_name_;
  Tensor param_buffer_;
  Tensor grad_buffer_;
  int64_t numel_ = 0;
};

}  // namespace megatron
