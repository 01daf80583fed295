#include "megatron/runtime/allocator.h"

#include <sys/mman.h>

#include <cstdlib>
#include <cstring>
#include <mutex>

#include "megatron/runtime/check.h"
#include "megatron/runtime/context.h"

namespace megatron {

namespace {
struct CpuStats {
  std::mutex mu;
  MemoryStats stats;
};
CpuStats& cpu_stats() {
  static CpuStats s;
  return s;
}
constexpr size_t kCpuAlignment = 64;
}  // namespace

namespace detail {
#ifdef MEGATRON_WITH_CUDA
void install_cuda_runtime(CudaAllocatorHooks& alloc, CudaContextHooks& ctx);  // runtime/cuda/cuda_runtime.cu
#endif

CudaAllocatorHooks& cuda_hooks() {
  static CudaAllocatorHooks hooks = [] {
    CudaAllocatorHooks h;
#ifdef MEGATRON_WITH_CUDA
    install_cuda_runtime(h, cuda_context_hooks());
#endif
    return h;
  }();
  return hooks;
}
}  // namespace detail

bool cuda_available() { return detail::cuda_hooks().allocate != nullptr; }

int cuda_device_count() {
  auto& hooks = detail::cuda_hooks();
  return hooks.device_count ? hooks.device_count() : 0;
}

int cuda_compute_capability(int device) {
  auto& hooks = detail::cuda_hooks();
  return hooks.compute_capability ? hooks.compute_capability(device) : 0;
}

std::shared_ptr<Storage> allocate(size_t nbytes, Device device) {
  if (device.type == DeviceType::CPU) {
    size_t rounded = (std::max<size_t>(nbytes, 1) + kCpuAlignment - 1) / kCpuAlignment * kCpuAlignment;
    void* p = std::aligned_alloc(kCpuAlignment, rounded);
    MG_CHECK(p != nullptr, "out of host memory allocating {} bytes", nbytes);
    {
      auto& s = cpu_stats();
      std::lock_guard<std::mutex> lock(s.mu);
      s.stats.allocated += rounded;
      s.stats.num_allocs += 1;
      s.stats.peak_allocated = std::max(s.stats.peak_allocated, s.stats.allocated);
    }
    return std::make_shared<Storage>(p, nbytes, device, [rounded](void* ptr, size_t) {
      std::free(ptr);
      auto& s = cpu_stats();
      std::lock_guard<std::mutex> lock(s.mu);
      s.stats.allocated -= rounded;
    });
  }
  auto& hooks = detail::cuda_hooks();
  MG_CHECK(hooks.allocate != nullptr,
           "a {} tensor was requested but this build has no CUDA support: rebuild with -DMEGATRON_CUDA=ON",
           device.str());
  return hooks.allocate(nbytes, device);
}

std::shared_ptr<Storage> allocate_zeroed_host(size_t nbytes) {
  constexpr size_t kMmapThreshold = size_t(1) << 20;
  if (nbytes < kMmapThreshold) {
    auto s = allocate(nbytes, Device::cpu());
    std::memset(s->data(), 0, nbytes);
    return s;
  }
  void* p = ::mmap(nullptr, nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  MG_CHECK(p != MAP_FAILED, "out of host memory allocating {} bytes", nbytes);
  {
    auto& st = cpu_stats();
    std::lock_guard<std::mutex> lock(st.mu);
    st.stats.allocated += nbytes;
    st.stats.num_allocs += 1;
    st.stats.peak_allocated = std::max(st.stats.peak_allocated, st.stats.allocated);
  }
  return std::make_shared<Storage>(p, nbytes, Device::cpu(), [](void* ptr, size_t n) {
    ::munmap(ptr, n);
    auto& st = cpu_stats();
    std::lock_guard<std::mutex> lock(st.mu);
    st.stats.allocated -= n;
  });
}

MemoryStats memory_stats(Device device) {
  if (device.type == DeviceType::CPU) {
    auto& s = cpu_stats();
    std::lock_guard<std::mutex> lock(s.mu);
    MemoryStats m = s.stats;
    m.reserved = m.allocated;  // malloc'd blocks go back at once: nothing is cached
    return m;
  }
  auto& hooks = detail::cuda_hooks();
  return hooks.stats ? hooks.stats(device) : MemoryStats{};
}

void reset_peak_memory_stats(Device device) {
  if (device.type == DeviceType::CPU) {
    auto& s = cpu_stats();
    std::lock_guard<std::mutex> lock(s.mu);
    s.stats.peak_allocated = s.stats.allocated;
    return;
  }
  auto& hooks = detail::cuda_hooks();
  if (hooks.reset_peak) hooks.reset_peak(device);
}

void empty_cache(Device device) {
  if (device.type != DeviceType::CUDA) return;
  auto& hooks = detail::cuda_hooks();
  if (hooks.empty_cache) hooks.empty_cache(device);
}

void fill_bytes(void* dst, Device dev, int value, size_t n, void* stream) {
  if (n == 0) return;
  if (dev.is_host()) {
    std::memset(dst, value, n);
    return;
  }
  auto& hooks = detail::cuda_hooks();
  MG_CHECK(hooks.memset != nullptr, "memset on {} needs a CUDA build", dev.str());
  hooks.memset(dst, value, n, stream);
}

void copy_bytes(void* dst, Device dst_dev, const void* src, Device src_dev, size_t n, void* stream) {
  if (n == 0) return;
  if (dst_dev.is_host() && src_dev.is_host()) {
    std::memmove(dst, src, n);
    return;
  }
  auto& hooks = detail::cuda_hooks();
  MG_CHECK(hooks.copy != nullptr, "copy between {} and {} needs a CUDA build", src_dev.str(), dst_dev.str());
  hooks.copy(dst, dst_dev, src, src_dev, n, stream);
}

}  // namespace megatron
