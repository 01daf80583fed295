// The CUDA half of the runtime: a stream-ordered memory pool (cudaMallocAsync on the device's
// default pool, which keeps freed blocks for reuse so a steady-state iteration allocates nothing),
// pinned host memory, copies, and the per-Context stream. It installs itself into the hooks of
// runtime/allocator.h and runtime/context.h so the CPU build carries no CUDA symbols.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "megatron/runtime/allocator.h"
#include "megatron/runtime/check.h"
#include "megatron/runtime/context.h"
#include "megatron/runtime/cuda/cuda_check.h"

namespace megatron::detail {

namespace {
struct DeviceStats {
  std::mutex mu;
  std::unordered_map<int, MemoryStats> by_device;
};
DeviceStats& device_stats() {
  static DeviceStats s;
  return s;
}

void record(Device d, long long delta) {
  auto& s = device_stats();
  std::lock_guard<std::mutex> lock(s.mu);
  MemoryStats& m = s.by_device[d.type == DeviceType::CUDAHost ? -1 : d.index];
  m.allocated = size_t((long long)m.allocated + delta);
  if (delta > 0) {
    m.num_allocs += 1;
    m.peak_allocated = std::max(m.peak_allocated, m.allocated);
  }
}

// Note [Keeping the pool's memory]: the default pool's release threshold is 0, so every
// synchronisation (a stream or event sync, a D2H copy of a loss or norm) hands all its free memory
// back to the driver, and the next allocations map it again. After a backward pass that is tens of
// GB — measured at ~30 ms of a 1.3B GPT's 300 ms step on the H200. The pool keeps what it has
// instead (Megatron's PyTorch caching allocator behaves the same way).
void keep_pool_memory(int device) {
  static std::mutex mu;
  static std::unordered_map<int, bool> done;
  std::lock_guard<std::mutex> lock(mu);
  if (done[device]) return;
  cudaMemPool_t pool;
  CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device));
  uint64_t threshold = UINT64_MAX;
  CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
  done[device] = true;
}

// Note [Allocation under capture]: while a thread captures a CUDA graph (runtime/cuda_graph.h),
//   - a new block is a graph allocation: cudaMallocAsync on the capturing stream becomes an
//     allocation node, and its release (in the captured work) a free node; CUDA gives the graph
//     its own memory and lets blocks whose lifetimes do not overlap share it. A graph allocation
//     must be released within the capture (the graph is launched again and again); one that
//     outlives it fails the capture;
//   - a block allocated before the capture and released during it may still be read by the
//     captured work at every launch: it is kept until the graph is destroyed;
//   - memsets and device-to-device copies on the legacy stream (Tensor::zero_, copy_from) go to
//     the capturing stream instead; a copy to or from the host cannot be captured (it waits for
//     the device) and is an error.
//   - while a side stream's work is enqueued (Note [Side stream], context.h) its allocations and
//     frees are nodes on the side stream, which forked from the capturing stream and joins it
//     before the capture ends.
struct CaptureState {
  cudaStream_t stream = nullptr;  // null: not capturing
  uint64_t id = 0;                // which capture (a block's free belongs to the capture that made it)
  long long live = 0;             // graph allocations not yet released
  std::vector<std::pair<void*, size_t>> kept;
};
thread_local CaptureState t_capture;
thread_local uint64_t t_captures = 0;

// Note [Side stream] (context.h), rule 1: while this thread enqueues work on a side stream, its
// allocations and frees, and the memsets and copies given no stream, are ordered on that stream
// instead of the legacy default stream (or, under capture, the capturing stream).
thread_local cudaStream_t t_route = nullptr;

// The stream this thread's stream-less work goes to now.
cudaStream_t current_stream() { return t_route != nullptr ? t_route : t_capture.stream; }

// What a graph holds: the executable graph and the pre-capture blocks it may read.
struct GraphHandle {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  Device device;
  std::vector<std::pair<void*, size_t>> kept;
};

std::shared_ptr<Storage> cuda_allocate(size_t nbytes, Device device) {
  void* p = nullptr;
  size_t n = std::max<size_t>(nbytes, 1);
  if (device.type == DeviceType::CUDAHost) {
    MG_CHECK(t_capture.stream == nullptr, "pinned host memory cannot be allocated while a CUDA graph is captured");
    CUDA_CHECK(cudaMallocHost(&p, n));
    record(device, (long long)n);
    return std::make_shared<Storage>(p, nbytes, device, [device, n](void* ptr, size_t) {
      cudaFreeHost(ptr);
      record(device, -(long long)n);
    });
  }
  if (t_capture.stream != nullptr) {
    CUDA_CHECK(cudaMallocAsync(&p, n, current_stream()));
    record(device, (long long)n);
    t_capture.live += 1;
    return std::make_shared<Storage>(p, nbytes, device, [device, n, id = t_capture.id](void* ptr, size_t) {
      if (t_capture.stream != nullptr && t_capture.id == id) {
        cudaFreeAsync(ptr, current_stream());
        t_capture.live -= 1;
      }  // else: it outlived the capture, which failed because of it; the graph owns the memory
      record(device, -(long long)n);
    });
  }
  CUDA_CHECK(cudaSetDevice(device.index));
  keep_pool_memory(device.index);
  // Allocations are ordered on the legacy default stream — or on the side stream while its work is
  // enqueued (Note [Side stream]); kernels on Context streams are ordered against it by the pool's
  // own cross-stream synchronisation at free time.
  CUDA_CHECK(cudaMallocAsync(&p, n, t_route));
  record(device, (long long)n);
  return std::make_shared<Storage>(p, nbytes, device, [device, n](void* ptr, size_t) {
    if (t_capture.stream != nullptr) {
      t_capture.kept.emplace_back(ptr, n);  // the graph may read it: freed with the graph
    } else {
      cudaFreeAsync(ptr, t_route);
    }
    record(device, -(long long)n);
  });
}

MemoryStats cuda_stats(Device d) {
  auto& s = device_stats();
  MemoryStats m;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    m = s.by_device[d.type == DeviceType::CUDAHost ? -1 : d.index];
  }
  m.reserved = m.allocated;  // pinned host memory is not pooled
  if (d.type == DeviceType::CUDA) {  // the stream-ordered pool's reservation (Megatron's reserved_bytes)
    cudaMemPool_t pool;
    uint64_t reserved = 0;
    if (cudaDeviceGetDefaultMemPool(&pool, d.index) == cudaSuccess &&
        cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &reserved) == cudaSuccess) {
      m.reserved = size_t(reserved);
    } else {
      cudaGetLastError();
    }
  }
  return m;
}

void cuda_reset_peak(Device d) {
  auto& s = device_stats();
  std::lock_guard<std::mutex> lock(s.mu);
  MemoryStats& m = s.by_device[d.type == DeviceType::CUDAHost ? -1 : d.index];
  m.peak_allocated = m.allocated;
}

void cuda_empty_cache(Device d) {
  MG_CHECK(t_capture.stream == nullptr, "the memory pool cannot be trimmed while a CUDA graph is captured");
  CUDA_CHECK(cudaSetDevice(d.index));
  CUDA_CHECK(cudaDeviceSynchronize());  // blocks freed by pending work are unused only once it ran
  cudaMemPool_t pool;
  CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, d.index));
  CUDA_CHECK(cudaMemPoolTrimTo(pool, 0));
}

void cuda_copy(void* dst, Device dst_dev, const void* src, Device src_dev, size_t n, void* stream) {
  if (t_capture.stream != nullptr) {
    MG_CHECK(dst_dev.type == DeviceType::CUDA && src_dev.type == DeviceType::CUDA,
             "a copy from {} to {} cannot be captured in a CUDA graph (it waits for the device): run it before "
             "the captured step", src_dev.str(), dst_dev.str());
    CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice,
                               stream != nullptr ? static_cast<cudaStream_t>(stream) : current_stream()));
    return;
  }
  auto s = stream != nullptr ? static_cast<cudaStream_t>(stream) : t_route;
  CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, s));
  CUDA_CHECK(cudaStreamSynchronize(s));
}

// Conversions between the float types on the device (Tensor::copy_from/to of a CUDA tensor to
// another dtype), rounding to nearest even as the host's convert_elements does.
template <typename S, typename D>
__global__ void convert_kernel(const S* src, D* dst, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    if constexpr (std::is_same_v<D, float>) {
      dst[i] = float(src[i]);
    } else if constexpr (std::is_same_v<D, __nv_bfloat16>) {
      dst[i] = __float2bfloat16_rn(float(src[i]));
    } else {
      dst[i] = __float2half_rn(float(src[i]));
    }
  }
}

template <typename S>
bool convert_from(const S* src, void* dst, DType dst_type, size_t n, unsigned grid, cudaStream_t s) {
  switch (dst_type) {
    case DType::Float32: convert_kernel<<<grid, 256, 0, s>>>(src, static_cast<float*>(dst), n); return true;
    case DType::BFloat16: convert_kernel<<<grid, 256, 0, s>>>(src, static_cast<__nv_bfloat16*>(dst), n); return true;
    case DType::Float16: convert_kernel<<<grid, 256, 0, s>>>(src, static_cast<__half*>(dst), n); return true;
    default: return false;
  }
}

bool cuda_convert(const void* src, DType src_type, void* dst, DType dst_type, size_t n) {
  if (n == 0) return true;
  // Under a capture the conversion joins the captured stream as a device-to-device copy does
  // (cuda_copy): recorded, not waited for. Otherwise it is done when it returns, as copy_bytes.
  const bool captured = t_capture.stream != nullptr;
  const cudaStream_t s = captured ? current_stream() : t_route;
  const unsigned grid = unsigned(std::min<size_t>((n + 255) / 256, 65535));
  bool ok = false;
  switch (src_type) {
    case DType::Float32: ok = convert_from(static_cast<const float*>(src), dst, dst_type, n, grid, s); break;
    case DType::BFloat16: ok = convert_from(static_cast<const __nv_bfloat16*>(src), dst, dst_type, n, grid, s); break;
    case DType::Float16: ok = convert_from(static_cast<const __half*>(src), dst, dst_type, n, grid, s); break;
    default: return false;
  }
  if (!ok) return false;
  CUDA_CHECK(cudaGetLastError());
  if (!captured) CUDA_CHECK(cudaStreamSynchronize(s));
  return true;
}

void cuda_memset(void* dst, int value, size_t n, void* stream) {
  if (stream == nullptr) stream = current_stream();
  CUDA_CHECK(cudaMemsetAsync(dst, value, n, static_cast<cudaStream_t>(stream)));
}

// Note [Streams and the memory pool]: a Context's stream is a blocking stream, so it is ordered
// with the legacy default stream on which the pool allocates and frees: a block freed after a
// kernel that used it is reused only once that kernel finished. A side stream is not (it must not
// stop at every allocation of the main thread): Note [Side stream] in context.h is its rule.
void context_create(Device device, void** stream, void** cublaslt, void** cudnn) {
  CUDA_CHECK(cudaSetDevice(device.index));
  cudaStream_t s;
  CUDA_CHECK(cudaStreamCreate(&s));
  *stream = s;
  cublasLtHandle_t lt = nullptr;
  cublasStatus_t st = cublasLtCreate(&lt);
  if (st != CUBLAS_STATUS_SUCCESS) {
    mg_library_failure("cuBLASLt", "cublasLtCreate", __FILE__, __LINE__, cublasLtGetStatusString(st), device.index);
  }
  *cublaslt = lt;
  cudnnHandle_t dnn = nullptr;
  cudnnStatus_t ds = cudnnCreate(&dnn);
  if (ds != CUDNN_STATUS_SUCCESS) {
    mg_library_failure("cuDNN", "cudnnCreate", __FILE__, __LINE__, cudnnGetErrorString(ds), device.index);
  }
  cudnnSetStream(dnn, s);
  *cudnn = dnn;
}

void context_destroy(Device, void* stream, void* cublaslt, void* cudnn) {
  if (cudnn) cudnnDestroy(static_cast<cudnnHandle_t>(cudnn));
  if (cublaslt) cublasLtDestroy(static_cast<cublasLtHandle_t>(cublaslt));
  if (stream) cudaStreamDestroy(static_cast<cudaStream_t>(stream));
}

void* event_record(void* stream) {
  cudaEvent_t e;
  CUDA_CHECK(cudaEventCreate(&e));
  CUDA_CHECK(cudaEventRecord(e, static_cast<cudaStream_t>(stream)));
  return e;
}

float event_elapsed_ms(void* start, void* end) {
  float ms = 0;
  CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start), static_cast<cudaEvent_t>(end)));
  return ms;
}

void event_destroy(void* e) { cudaEventDestroy(static_cast<cudaEvent_t>(e)); }

// Note [Side stream] (context.h): the side stream is non-blocking — the legacy stream's allocations
// and frees, which the main thread keeps making, do not stop it — and shares the main context's
// cuBLASLt handle; its cuDNN handle is its own (a cuDNN handle is bound to one stream).
void side_create(Device device, void** stream, void** cudnn, void** fork_event, void** join_event) {
  CUDA_CHECK(cudaSetDevice(device.index));
  cudaStream_t s;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  *stream = s;
  cudnnHandle_t dnn = nullptr;
  cudnnStatus_t ds = cudnnCreate(&dnn);
  if (ds != CUDNN_STATUS_SUCCESS) {
    mg_library_failure("cuDNN", "cudnnCreate", __FILE__, __LINE__, cudnnGetErrorString(ds), device.index);
  }
  cudnnSetStream(dnn, s);
  *cudnn = dnn;
  for (void** e : {fork_event, join_event}) {
    cudaEvent_t ev;
    CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    *e = ev;
  }
}

void side_destroy(void* stream, void* cudnn, void* fork_event, void* join_event) {
  if (cudnn) cudnnDestroy(static_cast<cudnnHandle_t>(cudnn));
  for (void* e : {fork_event, join_event})
    if (e) cudaEventDestroy(static_cast<cudaEvent_t>(e));
  if (stream) cudaStreamDestroy(static_cast<cudaStream_t>(stream));
}

// `waiter` waits for what `signaller` was given so far; under capture this is how a forked stream
// enters the capture and how it joins back.
void stream_wait(void* waiter, void* signaller, void* event) {
  auto e = static_cast<cudaEvent_t>(event);
  CUDA_CHECK(cudaEventRecord(e, static_cast<cudaStream_t>(signaller)));
  CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(waiter), e, 0));
}

void* route(void* stream) {
  void* previous = t_route;
  t_route = static_cast<cudaStream_t>(stream);
  return previous;
}

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: not an error for a CPU run
    return 0;
  }
  return n;
}

void context_synchronize(void* stream) {
  MG_CHECK(t_capture.stream == nullptr, "the host waited for the device while a CUDA graph was captured: the "
           "captured step must not synchronise");
  CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
}

void capture_begin(Device device, void* stream) {
  MG_CHECK(t_capture.stream == nullptr, "a CUDA graph is already being captured on this thread");
  CUDA_CHECK(cudaSetDevice(device.index));
  // What the eager steps before the capture left in the pool goes back to the driver: the graph's
  // allocations come from memory of their own, and should not sit beside a cached copy of them.
  CUDA_CHECK(cudaDeviceSynchronize());
  cudaMemPool_t pool;
  CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device.index));
  CUDA_CHECK(cudaMemPoolTrimTo(pool, 0));
  CUDA_CHECK(cudaStreamBeginCapture(static_cast<cudaStream_t>(stream), cudaStreamCaptureModeThreadLocal));
  t_capture = CaptureState{};
  t_capture.stream = static_cast<cudaStream_t>(stream);
  t_capture.id = ++t_captures;
}

void free_kept(std::vector<std::pair<void*, size_t>>& kept) {
  for (auto& [ptr, n] : kept) cudaFreeAsync(ptr, nullptr);
  kept.clear();
}

void capture_abort(void* stream) {
  if (t_capture.stream != static_cast<cudaStream_t>(stream)) return;
  cudaGraph_t graph = nullptr;
  cudaStreamEndCapture(t_capture.stream, &graph);
  if (graph) cudaGraphDestroy(graph);
  cudaGetLastError();
  CaptureState done = std::move(t_capture);
  t_capture = CaptureState{};
  free_kept(done.kept);
}

void* capture_end(void* stream) {
  MG_CHECK(t_capture.stream == static_cast<cudaStream_t>(stream), "capture_end without a capture on this stream");
  auto handle = std::make_unique<GraphHandle>();
  cudaError_t e = cudaStreamEndCapture(t_capture.stream, &handle->graph);
  CaptureState done = std::move(t_capture);
  t_capture = CaptureState{};
  handle->kept = std::move(done.kept);
  auto fail = [&](const std::string& why) {
    if (handle->graph) cudaGraphDestroy(handle->graph);
    free_kept(handle->kept);
    MG_CHECK(false, "CUDA graph capture failed: {}", why);
  };
  if (e != cudaSuccess) fail(cudaGetErrorString(e));
  if (done.live != 0) {
    fail(std::to_string(done.live) +
         " block(s) allocated in the captured work outlive it (a graph is launched again and again: what it "
         "allocates it must release)");
  }
  e = cudaGraphInstantiate(&handle->exec, handle->graph, 0);
  if (e != cudaSuccess) fail(std::string("instantiation: ") + cudaGetErrorString(e));
  return handle.release();
}

void graph_launch(void* graph, void* stream) {
  CUDA_CHECK(cudaGraphLaunch(static_cast<GraphHandle*>(graph)->exec, static_cast<cudaStream_t>(stream)));
}

void graph_destroy(void* graph) {
  std::unique_ptr<GraphHandle> h(static_cast<GraphHandle*>(graph));
  if (h->exec) cudaGraphExecDestroy(h->exec);
  if (h->graph) cudaGraphDestroy(h->graph);
  free_kept(h->kept);
}

size_t graph_memory(Device device) {
  uint64_t bytes = 0;
  CUDA_CHECK(cudaSetDevice(device.index));
  CUDA_CHECK(cudaDeviceGetGraphMemAttribute(device.index, cudaGraphMemAttrReservedMemCurrent, &bytes));
  return size_t(bytes);
}
}  // namespace

// major * 10 + minor (90 for Hopper), 0 when the device cannot be queried.
int compute_capability(int device) {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return major * 10 + minor;
}

void profiler_range(bool start) { CUDA_CHECK(start ? cudaProfilerStart() : cudaProfilerStop()); }

void install_cuda_runtime(CudaAllocatorHooks& alloc, CudaContextHooks& ctx) {
  alloc.allocate = cuda_allocate;
  alloc.stats = cuda_stats;
  alloc.reset_peak = cuda_reset_peak;
  alloc.empty_cache = cuda_empty_cache;
  alloc.copy = cuda_copy;
  alloc.device_count = device_count;
  alloc.compute_capability = compute_capability;
  alloc.memset = cuda_memset;
  alloc.convert = cuda_convert;
  alloc.event_record = event_record;
  alloc.event_elapsed_ms = event_elapsed_ms;
  alloc.event_destroy = event_destroy;
  alloc.profiler_range = profiler_range;
  ctx.create = context_create;
  ctx.destroy = context_destroy;
  ctx.synchronize = context_synchronize;
  ctx.capture_begin = capture_begin;
  ctx.capture_end = capture_end;
  ctx.capture_abort = capture_abort;
  ctx.graph_launch = graph_launch;
  ctx.graph_destroy = graph_destroy;
  ctx.graph_memory = graph_memory;
  ctx.side_create = side_create;
  ctx.side_destroy = side_destroy;
  ctx.wait = stream_wait;
  ctx.route = route;
}

}  // namespace megatron::detail
