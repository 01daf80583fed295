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

Context::~Context() {
  if (device_.is_cuda()) {
    auto& hooks = detail::cuda_context_hooks();
    if (hooks.destroy) hooks.destroy(device_, stream_, cublaslt_, cudnn_);
  }
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
