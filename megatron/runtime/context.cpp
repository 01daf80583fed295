#include "megatron/runtime/context.h"

namespace megatron {

namespace detail {
CudaContextHooks& cuda_context_hooks() {
  static CudaContextHooks hooks;
  return hooks;
}
}  // namespace detail

Context::Context(Device device, uint64_t seed) : device_(device) {
  rng_.seed = seed;
  if (device_.is_cuda()) {
    (void)cuda_available();  // installs the CUDA hooks of a CUDA build
    auto& hooks = detail::cuda_context_hooks();
    MG_CHECK(hooks.create != nullptr, "device {} requested but this build has no CUDA support: rebuild with "
             "-DMEGATRON_CUDA=ON", device_.str());
    hooks.create(device_, &stream_, &cublaslt_, &cudnn_);
    rng_shift_ = Tensor::zeros({1}, DType::Int64, device_);
  }
}

Context::Context(Context& main, int) : device_(main.device_), main_(&main) {
  if (!device_.is_cuda()) return;
  auto& hooks = detail::cuda_context_hooks();
  MG_CHECK(hooks.side_create != nullptr, "this build's CUDA runtime has no side streams");
  hooks.side_create(device_, &stream_, &cudnn_, &fork_event_, &join_event_);
  cublaslt_ = main.cublaslt_;  // shared: the same GEMM plans (linear.cu caches them per handle)
}

Context::~Context() {
  side_.reset();  // before this context's stream and handles
  workspace_ = Tensor();
  if (!device_.is_cuda()) return;
  auto& hooks = detail::cuda_context_hooks();
  if (main_) {
    if (hooks.side_destroy) hooks.side_destroy(stream_, cudnn_, fork_event_, join_event_);
  } else if (hooks.destroy) {
    hooks.destroy(device_, stream_, cublaslt_, cudnn_);
  }
}

Context& Context::side() {
  MG_ASSERT(main_ == nullptr, "a side context has no side context of its own");
  if (!side_) side_.reset(new Context(*this, 0));
  return *side_;
}

void Context::after_join(std::function<void(Context&)> f) {
  MG_ASSERT(main_ != nullptr, "after_join is for work given to a side context");
  after_join_.push_back(std::move(f));
}

// ---- SideStream (Note [Side stream]) ------------------------------------------------------------

SideStream::SideStream(Context& main) : main_(main), side_(main.side()) {
  MG_CHECK(!side_.forked_, "a second SideStream on {} while one is open: join the first", main.device().str());
  MG_ASSERT(side_.after_join_.empty(), "a side context kept work from an earlier SideStream");
  side_.forked_ = true;
}

SideStream::~SideStream() {
  if (joined_) return;
  try {
    join_streams();  // an exception left the scope: the streams still join, the host work is dropped
  } catch (...) {
  }
  side_.after_join_.clear();
}

void SideStream::fork() {
  MG_ASSERT(!joined_, "SideStream::run after join");
  if (main_.is_cuda()) detail::cuda_context_hooks().wait(side_.stream_, main_.stream_, side_.fork_event_);
}

void SideStream::join_streams() {
  side_.forked_ = false;
  if (main_.is_cuda()) detail::cuda_context_hooks().wait(main_.stream_, side_.stream_, side_.join_event_);
}

void SideStream::join() {
  MG_ASSERT(!joined_, "SideStream joined twice");
  join_streams();
  joined_ = true;
  std::vector<std::function<void(Context&)>> work = std::move(side_.after_join_);
  side_.after_join_.clear();
  for (auto& f : work) f(main_);
}

SideStream::Route::Route(Context& side) : cuda_(side.is_cuda()) {
  if (cuda_) previous_ = detail::cuda_context_hooks().route(side.stream());
}

SideStream::Route::~Route() {
  if (cuda_) detail::cuda_context_hooks().route(previous_);
}

Tensor Context::workspace(size_t bytes) {
  if (!workspace_.defined() || workspace_.nbytes() < bytes) {
    workspace_ = Tensor::empty({int64_t(bytes)}, DType::UInt8, device_);
  }
  return workspace_;
}

void Context::synchronize() {
  if (device_.is_cuda()) detail::cuda_context_hooks().synchronize(stream_);
}

}  // namespace megatron
