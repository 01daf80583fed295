// CudaGraph: records the work a function enqueues on a Context's stream once, and launches the
// recording again and again — one launch instead of thousands, no host between kernels (Megatron's
// --cuda-graph-impl local). What the recording reads and writes are fixed addresses: inputs go
// into tensors that outlive the graph before each launch; outputs are read from such tensors after.
//
// The captured work must not synchronise with the host (Note [Host checks under capture]); blocks
// it allocates it must release (Note [Allocation under capture], runtime/cuda). Random ops draw the
// offsets they were captured with, moved by the context's device offset shift (Note [Random offsets
// under CUDA graphs], context.h), which the caller sets before a launch.
#pragma once

#include <functional>

#include "megatron/runtime/context.h"

namespace megatron {

class CudaGraph {
 public:
  CudaGraph() = default;
  ~CudaGraph() { reset(); }
  CudaGraph(const CudaGraph&) = delete;
  CudaGraph& operator=(const CudaGraph&) = delete;

  /// Records what `body` enqueues on ctx's stream (nothing runs yet); replaces an earlier recording.
  /// A failure (an op that synchronises, a block that outlives the capture) throws megatron::Error.
  void capture(Context& ctx, const std::function<void()>& body);
  /// Enqueues the recorded work on ctx's stream.
  void replay(Context& ctx) const;
  bool captured() const { return graph_ != nullptr; }
  /// Drops the recording (and the blocks it kept alive).
  void reset();

  /// Bytes the device's graph allocations hold (their own memory, outside the stream-ordered pool).
  static size_t memory_bytes(Device device);

 private:
  void* graph_ = nullptr;
};

}  // namespace megatron
