// Owning storage that knows its device, and the allocators behind it. Every allocator keeps
// statistics (bytes in use, peak) so tests and logs can state memory figures: the CPU figures are
// what the activation-recomputation test measures; the CUDA pool's feed Megatron's memory report.
#pragma once

#include <atomic>
#include <cstddef>
#include <functional>
#include <memory>

#include "megatron/runtime/device.h"
#include "megatron/runtime/dtype.h"

namespace megatron {

struct MemoryStats {
  size_t allocated = 0;       // bytes in use now
  size_t peak_allocated = 0;  // high-water mark since the last reset
  size_t num_allocs = 0;
  size_t reserved = 0;        // bytes the device's pool holds (in use or cached; the CPU: = allocated)
};

/// A block of memory. Freed through its allocator when the last Tensor referencing it goes away.
class Storage {
 public:
  using Deleter = std::function<void(void*, size_t)>;
  Storage(void* ptr, size_t nbytes, Device device, Deleter deleter)
      : ptr_(ptr), nbytes_(nbytes), device_(device), deleter_(std::move(deleter)) {}
  ~Storage() {
    if (deleter_) deleter_(ptr_, nbytes_);
  }
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return ptr_; }
  size_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }

 private:
  void* ptr_;
  size_t nbytes_;
  Device device_;
  Deleter deleter_;
};

/// Allocates `nbytes` on `device` (CPU: 64-byte aligned; CUDA: the stream-ordered pool, ordered on
/// the legacy default stream — or on a side stream while work is enqueued there, and then a tensor
/// the side stream used follows Note [Side stream] in context.h, which stands in for PyTorch's
/// record_stream).
std::shared_ptr<Storage> allocate(size_t nbytes, Device device);
/// Zero-filled host memory. Large blocks come straight from the kernel's zero pages (mmap), so
/// they cost nothing until first written — a model's gradient buffer and Adam moments do not pay
/// a pass over memory at startup.
std::shared_ptr<Storage> allocate_zeroed_host(size_t nbytes);

/// Statistics for a device's allocator. CPU statistics count every Tensor allocation on the host.
MemoryStats memory_stats(Device device);
void reset_peak_memory_stats(Device device);
/// Gives the device pool's cached, unused memory back to the driver after the device finished its
/// work (torch.cuda.empty_cache; Megatron's --empty-unused-memory-level). The CPU caches nothing.
void empty_cache(Device device);

namespace detail {
// The CUDA half of the allocator lives in runtime/cuda (compiled only with CUDA); these hooks are
// set by it at static-initialisation time, so a CPU build has no CUDA symbols at all.
struct CudaAllocatorHooks {
  std::shared_ptr<Storage> (*allocate)(size_t, Device) = nullptr;
  MemoryStats (*stats)(Device) = nullptr;
  void (*reset_peak)(Device) = nullptr;
  void (*empty_cache)(Device) = nullptr;
  void (*copy)(void* dst, Device dst_dev, const void* src, Device src_dev, size_t n, void* stream) = nullptr;
  int (*device_count)() = nullptr;
  int (*compute_capability)(int device) = nullptr;
  void (*memset)(void* dst, int value, size_t n, void* stream) = nullptr;
  // Element conversion between fp32, bf16 and fp16 on one device (false: a pair it does not do).
  bool (*convert)(const void* src, DType src_type, void* dst, DType dst_type, size_t n) = nullptr;
  // Events for OpProfiler: record on a stream, elapsed milliseconds between two, destroy.
  void* (*event_record)(void* stream) = nullptr;
  float (*event_elapsed_ms)(void* start, void* end) = nullptr;
  void (*event_destroy)(void* event) = nullptr;
  // cudaProfilerStart / cudaProfilerStop (an external profiler's capture range).
  void (*profiler_range)(bool start) = nullptr;
};
CudaAllocatorHooks& cuda_hooks();
}  // namespace detail

/// Copies bytes between any two devices (host<->host is memcpy).
void copy_bytes(void* dst, Device dst_dev, const void* src, Device src_dev, size_t n, void* stream = nullptr);
/// Whether this build has the CUDA runtime half (not whether a GPU is present).
/// Sets n bytes to `value` (host: memset; device: an asynchronous memset on `stream`).
void fill_bytes(void* dst, Device dev, int value, size_t n, void* stream = nullptr);
bool cuda_available();
/// The number of CUDA devices this process sees (0 in a CPU build or on a machine without a GPU).
int cuda_device_count();
/// A CUDA device's compute capability as major * 10 + minor (90: Hopper); 0 without CUDA.
int cuda_compute_capability(int device);

}  // namespace megatron
