#include "megatron/runtime/cuda_graph.h"

#include "megatron/runtime/check.h"

namespace megatron {

namespace {
detail::CudaContextHooks& hooks_for(const Context& ctx) {
  MG_CHECK(ctx.is_cuda(), "CUDA graphs need a CUDA device (this context is on {})", ctx.device().str());
  auto& h = detail::cuda_context_hooks();
  MG_CHECK(h.capture_begin != nullptr, "CUDA graphs need a CUDA build");
  return h;
}
}  // namespace

void CudaGraph::capture(Context& ctx, const std::function<void()>& body) {
  auto& h = hooks_for(ctx);
  reset();
  h.capture_begin(ctx.device(), ctx.stream());
  ctx.capturing_ = true;
  try {
    body();
  } catch (...) {
    ctx.capturing_ = false;
    h.capture_abort(ctx.stream());
    throw;
  }
  ctx.capturing_ = false;
  graph_ = h.capture_end(ctx.stream());
}

void CudaGraph::replay(Context& ctx) const {
  MG_ASSERT(graph_ != nullptr, "replay of a CUDA graph that was not captured");
  hooks_for(ctx).graph_launch(graph_, ctx.stream());
}

void CudaGraph::reset() {
  if (graph_ == nullptr) return;
  detail::cuda_context_hooks().graph_destroy(graph_);
  graph_ = nullptr;
}

size_t CudaGraph::memory_bytes(Device device) {
  auto& h = detail::cuda_context_hooks();
  if (!device.is_cuda() || h.graph_memory == nullptr) return 0;
  return h.graph_memory(device);
}

}  // namespace megatron
