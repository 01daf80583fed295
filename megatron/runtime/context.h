// Context: everything an op needs besides its tensors — the device, the stream, library handles,
// a workspace and the RNG. Passed explicitly; there are no globals (DESIGN.md principle 5).
#pragma once

#include <functional>
#include <memory>
#include <utility>
#include <vector>

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

  RngState& rng() { return main_ ? main_->rng() : rng_; }
  /// Note [Random offsets under CUDA graphs]: on a GPU, every random op adds this device int64 [1]
  /// to the offset it is given (undefined on the CPU). It is zero except while a CUDA graph replays
  /// a step that was captured at other offsets (core/full_cuda_graph.cpp sets it to the difference).
  Tensor& rng_offset_shift() { return main_ ? main_->rng_offset_shift() : rng_shift_; }

  /// Whether the work enqueued on this context is being captured into a CUDA graph
  /// (runtime/cuda_graph.h): ops must then not wait for the device or read its results on the
  /// host (Note [Host checks under capture]).
  bool capturing() const { return main_ ? main_->capturing() : capturing_; }
  /// Whether the ids the ops are given were checked on the host already (Note [Host checks under
  /// capture]): the forward ops then skip reading their own device-side checks back — a wait for
  /// the device each. Set for a scope with HostCheckedIds.
  bool ids_checked_on_host() const { return main_ ? main_->ids_checked_on_host() : capturing_ || ids_checked_on_host_; }

  /// Megatron's --deterministic-mode: ops that would otherwise accumulate in a varying order (cuDNN's
  /// attention backward) choose an algorithm that gives the same bits at every run, at some cost.
  bool deterministic() const { return main_ ? main_->deterministic() : deterministic_; }
  void set_deterministic(bool on) { deterministic_ = on; }

  /// Per-op timing (runtime/profiler.h); null (the default) means off. Not owned. A side context's
  /// ops are not timed (their events would interleave with the main stream's).
  class OpProfiler* profiler() const { return profiler_; }
  void set_profiler(class OpProfiler* p) { profiler_ = p; }

  /// Note [Side stream]: the context of this device's second stream, made at the first call (use
  /// it through SideStream, which orders the two streams). Its ops share this context's RNG,
  /// offset shift, capture state, determinism and cuBLASLt handle; it has its own stream, cuDNN
  /// handle and workspace (two GEMMs in flight at once cannot share one). On the CPU it is a
  /// second CPU context: its work runs inline, in the order it is given.
  Context& side();
  /// Whether this is a side context; main() is the context it belongs to (itself otherwise).
  bool is_side() const { return main_ != nullptr; }
  Context& main() { return main_ ? *main_ : *this; }
  /// On a side context: runs `f` on the main context at the next SideStream::join, once the main
  /// stream waits for the side stream's work (Note [Gradient hooks on the side stream]).
  void after_join(std::function<void(Context& main)> f);

 private:
  Context(Context& main, int side_tag);  // a side context (side())
  friend class SideStream;

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
  // Side-stream state (Note [Side stream]): main_ is set on a side context, side_ on a main one.
  Context* main_ = nullptr;
  std::unique_ptr<Context> side_;
  void* fork_event_ = nullptr;  // recorded on the main stream, waited on by the side stream
  void* join_event_ = nullptr;  // recorded on the side stream, waited on by the main stream
  bool forked_ = false;
  std::vector<std::function<void(Context&)>> after_join_;
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

// Note [Side stream]: SideStream runs work on the side context's stream beside the main stream's
// (Megatron's torch.cuda.Stream of the shared experts) and orders the two with events only — the
// host never waits:
//   SideStream side(ctx);
//   Tensor a = side.run([&](Context& s) { ... });  // fork (the side stream waits for ctx's work so
//                                                  // far), then f's work on the side stream
//   ... more work on ctx ...                       // the main stream, at the same time
//   side.join();                                   // the main stream waits for the side's work so far
// Under CUDA-graph capture the fork event pulls the side stream into the capture and the join
// brings it back (CUDA's fork/join pattern: a capture ends only when every forked stream has
// joined), so the graph holds the two branches. A SideStream that is destroyed without join() (an
// exception) still joins the streams. On the CPU run() calls f inline and fork/join do nothing.
//
// Memory (the rule that replaces PyTorch's record_stream): the side stream is a non-blocking
// stream, so the stream-ordered pool's legacy-stream allocations and frees do not order it — which
// is what lets it run while the main thread allocates and frees. Instead:
//   1. While the host is inside run(), this thread's allocations and frees, and the memsets and
//      copies given no stream (Tensor::zero_, copy_from, to), go to the side stream (under capture:
//      allocation and free nodes in the side branch). A block released there is reused by the pool
//      only once the side stream has passed the free (stream-ordered free), whatever stream asks
//      for it next — the pool may make that stream wait for the side stream (its internal
//      dependencies): correct, at worst less overlap. A host read inside run() waits for the side
//      stream (which includes the main stream's work before the fork).
//   2. A tensor the side stream touched and that is still referenced when run() returns (its
//      inputs, outputs and saved activations) must stay referenced until join(): released later,
//      its free is ordered on the legacy stream after the main stream, which waits for the side.
//   3. Each run() starts after everything enqueued on the main stream before it (a fork per
//      run). Work given to the main stream after a run() and before join() is unordered with that
//      run's work: it must not write what the run reads, nor touch what it writes.
// MoELayer keeps rule 2 by holding x / grad_out, the side's output and the saved activations
// across the join (Note [Shared experts on a side stream], moe/shared_experts.h).
class SideStream {
 public:
  explicit SideStream(Context& main);
  ~SideStream();
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;

  /// Enqueues f(side context) on the side stream after the main stream's work so far (rules 1 and
  /// 3 above).
  template <typename F>
  decltype(auto) run(F&& f) {
    fork();
    Route route(side_);
    return std::forward<F>(f)(side_);
  }
  /// The main stream waits for the side stream's work so far; then the side's after_join work runs.
  void join();
  Context& side() { return side_; }

 private:
  class Route {  // routes this thread's allocations, frees and unstreamed copies to the side stream
   public:
    explicit Route(Context& side);
    ~Route();
    Route(const Route&) = delete;
    Route& operator=(const Route&) = delete;

   private:
    void* previous_ = nullptr;
    bool cuda_;
  };
  void fork();
  void join_streams();
  Context& main_;
  Context& side_;
  bool joined_ = false;
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
  // Side streams (Note [Side stream]): a non-blocking stream with its cuDNN handle and two events;
  // `wait` records `event` on `signaller` and makes `waiter` wait for it (no host wait); `route`
  // sends this thread's allocations, frees and unstreamed copies to `stream` (null: back to the
  // default) and returns the previous route.
  void (*side_create)(Device, void** stream, void** cudnn, void** fork_event, void** join_event) = nullptr;
  void (*side_destroy)(void* stream, void* cudnn, void* fork_event, void* join_event) = nullptr;
  void (*wait)(void* waiter, void* signaller, void* event) = nullptr;
  void* (*route)(void* stream) = nullptr;
};
CudaContextHooks& cuda_context_hooks();
}  // namespace detail

}  // namespace megatron
