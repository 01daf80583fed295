// Context: everything an op needs besides its tensors — the device, the stream, library handles,
// a workspace and the RNG. Passed explicitly; there are no globals (DESIGN.md principle 5).
#pragma once

#include <memory>

#include "megatron/runtime/device.h"
#include "megatron/runtime/philox.h"
#include "megatron/runtime/tensor.h"

namespace megatron {

class Context {
 public:
  explicit Context(Device device = Device::cpu(), uint64_t seed = 1234);
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  Device device() const { return device_; }
  bool is_cuda() const { return device_.is_cuda(); }
  /// The CUDA stream (cudaStream_t) ops on this context run on; null on CPU.
  void* stream() const { return stream_; }
  /// Library handles (cublasLtHandle_t, cudnnHandle_t) owned by the CUDA half; null on CPU.
  void* cublaslt_handle() const { return cublaslt_; }
  void* cudnn_handle() const { return cudnn_; }
  /// A scratch buffer of at least `bytes`, reused across calls (grown, never shrunk).
  Tensor workspace(size_t bytes);
  /// Waits until all work queued on this context's stream has finished (no-op on CPU).
  void synchronize();

  RngState& rng() { return rng_; }
  /// Note [Random offsets under CUDA graphs]: on a GPU, every random op adds this device int64 [1]
  /// to the offset it is given (undefined on the CPU). It is zero except while a CUDA graph replays
  /// a step that was captured at other offsets (core/full_cuda_graph.cpp sets it to the difference).
  Tensor& rng_offset_shift() { return rng_shift_; }

  /// Whether the work enqueued on this context is being captured into a CUDA graph
  /// (runtime/cuda_graph.h): ops must then not wait for the device or read its results on the
  /// host (Note [Host checks under capture]).
  bool capturing() const { return capturing_; }
  /// Whether the ids the ops are given were checked on the host already (Note [Host checks under
  /// capture]): the forward ops then skip reading their own device-side checks back — a wait for
  /// the device each. Set for a scope with HostCheckedIds.
  bool ids_checked_on_host() const { return capturing_ || ids_checked_on_host_; }

  /// Megatron's --deterministic-mode: ops that would otherwise accumulate in a varying order (cuDNN's
  /// attention backward) choose an algorithm that gives the same bits at every run, at some cost.
  bool deterministic() const { return deterministic_; }
  void set_deterministic(bool on) { deterministic_ = on; }

  /// Per-op timing (runtime/profiler.h); null (the default) means off. Not owned.
  class OpProfiler* profiler() const { return profiler_; }
  void set_profiler(class OpProfiler* p) { profiler_ = p; }

 private:
  Device device_;
  void* stream_ = nullptr;
  void* cublaslt_ = nullptr;
  void* cudnn_ = nullptr;
  Tensor workspace_;
  RngState rng_;
  Tensor rng_shift_;
  class OpProfiler* profiler_ = nullptr;
  bool capturing_ = false;
  bool ids_checked_on_host_ = false;
  bool deterministic_ = false;
  friend class CudaGraph;
  friend class HostCheckedIds;
};

/// Marks, for its lifetime, the ids given to ctx's ops as checked on the host.
class HostCheckedIds {
 public:
  explicit HostCheckedIds(Context& ctx) : ctx_(ctx), before_(ctx.ids_checked_on_host_) {
    ctx.ids_checked_on_host_ = true;
  }
  ~HostCheckedIds() { ctx_.ids_checked_on_host_ = before_; }
  HostCheckedIds(const HostCheckedIds&) = delete;
  HostCheckedIds& operator=(const HostCheckedIds&) = delete;

 private:
  Context& ctx_;
  bool before_;
};

namespace detail {
struct CudaContextHooks {
  void (*create)(Device, void** stream, void** cublaslt, void** cudnn) = nullptr;
  void (*destroy)(Device, void* stream, void* cublaslt, void* cudnn) = nullptr;
  void (*synchronize)(void* stream) = nullptr;
  // CUDA graphs (runtime/cuda_graph.h): capture what a stream is given, instantiate, launch.
  void (*capture_begin)(Device, void* stream) = nullptr;
  void* (*capture_end)(void* stream) = nullptr;  // the instantiated graph
  void (*capture_abort)(void* stream) = nullptr;
  void (*graph_launch)(void* graph, void* stream) = nullptr;
  void (*graph_destroy)(void* graph) = nullptr;
  size_t (*graph_memory)(Device) = nullptr;  // bytes the device's graph allocations hold now
};
CudaContextHooks& cuda_context_hooks();
}  // namespace detail

}  // namespace megatron
