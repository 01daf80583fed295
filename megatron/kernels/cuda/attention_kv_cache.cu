// Causal attention over a KV cache (inference), CUDA: the contract of op_list.inc and the CPU
// reference kernels/cpu/attention_kv_cache.cpp. Two launches: the new keys/values are copied into
// their cache slots (kv_cache_append), then one block per (query position, batch row, head) scores
// its query against the cached positions it may see, takes the softmax in shared memory and writes
// P·V. Decode steps have one query per sequence, so this is what a step costs; a prompt's first
// forward goes through the training attention (cuDNN) instead (Note [Prefill attention]).
//
// Note [Decode attention reads]: a decode step is bound by reading the cache, [positions, ng·d] per
// slot. Each warp takes every 4th position and its 32 lanes read the key row together (contiguous,
// d/32 elements a lane), so the score is a warp reduction; for P·V each warp sums its positions'
// value rows into per-lane accumulators (lane e holds channels e, e+32, ...), and the four warps'
// partial sums meet in shared memory. Slots and starts are read on the device only: no host
// synchronisation per layer (the caller checked them once per forward).
#include <cuda_runtime.h>

#include <cfloat>

#include "megatron/kernels/cuda/cuda_common.cuh"
#include "megatron/kernels/cuda/cuda_ops.h"
#include "megatron/runtime/cuda/cuda_check.h"

namespace megatron::cuda {

namespace {

constexpr int kThreads = 128;
constexpr int kMaxHeadDim = 256;  // kv_channels up to this (MLA caches go another way)

template <typename T>
__global__ void kv_cache_write(const T* k_new, const T* v_new, const int64_t* slots, const int64_t* starts, int64_t s,
                               int64_t b, int64_t row, int64_t max_len, T* k_cache, T* v_cache) {
  const int64_t total = s * b * row;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t e = idx % row, t = idx / row, i = t % b, j = t / b;
    const int64_t dst = (slots[i] * max_len + starts[i] + j) * row + e;
    k_cache[dst] = k_new[idx];
    v_cache[dst] = v_new[idx];
  }
}

__device__ float block_reduce(float v, float* scratch, bool is_max) {
  for (int o = 16; o > 0; o >>= 1) {
    float other = __shfl_xor_sync(0xffffffffu, v, o);
    v = is_max ? fmaxf(v, other) : v + other;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float r = is_max ? -FLT_MAX : 0.0f;
  for (int w = 0; w < int(blockDim.x >> 5); ++w) r = is_max ? fmaxf(r, scratch[w]) : r + scratch[w];
  return r;
}

// grid (s, b, nq), kThreads threads (4 warps); dynamic shared memory: max_len floats of scores.
// Note [Decode attention reads].
template <typename T>
__global__ void kv_cache_attend(const T* q, const T* k_cache, const T* v_cache, const int64_t* slots,
                                const int64_t* starts, int64_t b, int64_t nq, int64_t ng, int64_t d, int64_t max_len,
                                float scale, T* out) {
  extern __shared__ float scores[];
  __shared__ float scratch[32];
  __shared__ float partial[kThreads / 32][kMaxHeadDim];
  const int64_t j = blockIdx.x, i = blockIdx.y, h = blockIdx.z;
  const int64_t last = starts[i] + j, g = h / (nq / ng), row = ng * d;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = kThreads / 32;
  const T* qrow = q + ((j * b + i) * nq + h) * d;
  const T* kbase = k_cache + slots[i] * max_len * row + g * d;
  const T* vbase = v_cache + slots[i] * max_len * row + g * d;
  constexpr int kPerLane = kMaxHeadDim / 32;
  float qv[kPerLane];
#pragma unroll
  for (int u = 0; u < kPerLane; ++u) {
    const int64_t e = lane + 32 * u;
    qv[u] = e < d ? load_float(qrow[e]) : 0.0f;
  }
  float m = -FLT_MAX;
  for (int64_t t = warp; t <= last; t += warps) {
    const T* krow = kbase + t * row;
    float acc = 0.0f;
#pragma unroll
    for (int u = 0; u < kPerLane; ++u) {
      const int64_t e = lane + 32 * u;
      if (e < d) acc += qv[u] * load_float(krow[e]);
    }
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    acc *= scale;
    if (lane == 0) scores[t] = acc;
    m = fmaxf(m, acc);
  }
  m = block_reduce(m, scratch, true);
  float sum = 0.0f;
  for (int64_t t = threadIdx.x; t <= last; t += blockDim.x) {
    scores[t] = __expf(scores[t] - m);
    sum += scores[t];
  }
  sum = block_reduce(sum, scratch, false);  // its barriers also publish the exponentials
  const float inv = 1.0f / sum;
  float acc[kPerLane] = {};
  for (int64_t t = warp; t <= last; t += warps) {
    const float p = scores[t];
    const T* vrow = vbase + t * row;
#pragma unroll
    for (int u = 0; u < kPerLane; ++u) {
      const int64_t e = lane + 32 * u;
      if (e < d) acc[u] += p * load_float(vrow[e]);
    }
  }
#pragma unroll
  for (int u = 0; u < kPerLane; ++u) partial[warp][lane + 32 * u] = acc[u];
  __syncthreads();
  T* orow = out + ((j * b + i) * nq + h) * d;
  for (int64_t e = threadIdx.x; e < d; e += blockDim.x) {
    float o = 0.0f;
    for (int w = 0; w < warps; ++w) o += partial[w][e];
    orow[e] = store_float<T>(o * inv);
  }
}

}  // namespace

namespace {
// slots/starts as int64 on the device: used as they are, or uploaded when the caller passed host tensors.
Tensor device_indices(Context& ctx, const Tensor& t, int64_t b, const char* name) {
  MG_ASSERT(t.numel() == b, "{} {} needs {} entries", name, t.str(), b);
  if (t.device().is_cuda() && t.dtype() == DType::Int64) return t;
  return Tensor::from_ints(t.to(Device::cpu()).to_ints(), {b}, DType::Int64, ctx.device());
}
}  // namespace

void kv_cache_append(Context& ctx, const Tensor& k_new, const Tensor& v_new, const Tensor& slots, const Tensor& starts,
                     Tensor& k_cache, Tensor& v_cache) {
  MG_ASSERT(k_new.dim() == 4 && k_new.shape() == v_new.shape() && k_cache.dim() == 4 &&
                k_cache.shape() == v_cache.shape() && k_cache.size(2) == k_new.size(2) &&
                k_cache.size(3) == k_new.size(3),
            "kv_cache_append: k_new {} v_new {} caches {}", k_new.str(), v_new.str(), k_cache.str());
  MG_ASSERT(k_new.dtype() == k_cache.dtype() && v_new.dtype() == k_cache.dtype() && v_cache.dtype() == k_cache.dtype(),
            "kv_cache_append on CUDA takes one dtype for k/v and the caches");
  const int64_t s = k_new.size(0), b = k_new.size(1), ng = k_new.size(2), d = k_new.size(3);
  const Tensor dslots = device_indices(ctx, slots, b, "slots"), dstarts = device_indices(ctx, starts, b, "starts");
  if (s * b == 0) return;
  dispatch_float(k_new.dtype(), [&]<typename T>() {
    kv_cache_write<T><<<grid_for(s * b * ng * d), kBlockSize, 0, stream_of(ctx)>>>(
        dev_ptr<const T>(k_new), dev_ptr<const T>(v_new), dev_ptr<const int64_t>(dslots),
        dev_ptr<const int64_t>(dstarts), s, b, ng * d, k_cache.size(1), dev_ptr<T>(k_cache), dev_ptr<T>(v_cache));
    CUDA_CHECK_LAUNCH();
  });
}

void attention_kv_cache_forward(Context& ctx, const Tensor& q, const Tensor& k_new, const Tensor& v_new,
                                const Tensor& slots, const Tensor& starts, float softmax_scale, Tensor& k_cache,
                                Tensor& v_cache, Tensor& out) {
  MG_ASSERT(q.dim() == 4 && k_new.dim() == 4 && k_new.shape() == v_new.shape() && k_cache.shape() == v_cache.shape(),
            "attention_kv_cache: q {} k_new {} caches {}", q.str(), k_new.str(), k_cache.str());
  MG_ASSERT(q.dtype() == k_new.dtype() && q.dtype() == out.dtype(),
            "attention_kv_cache on CUDA takes one dtype for q, k/v and the caches");
  const int64_t s = q.size(0), b = q.size(1), nq = q.size(2), d = q.size(3), ng = k_new.size(2);
  const int64_t max_len = k_cache.size(1);
  MG_ASSERT(k_cache.size(2) == ng && k_cache.size(3) == d && nq % ng == 0, "caches {} for k_new {}", k_cache.str(),
            k_new.str());
  MG_CHECK(d <= kMaxHeadDim, "KV-cache attention on CUDA takes heads of up to {} channels (got {})", kMaxHeadDim, d);
  const Tensor dslots = device_indices(ctx, slots, b, "slots"), dstarts = device_indices(ctx, starts, b, "starts");
  kv_cache_append(ctx, k_new, v_new, dslots, dstarts, k_cache, v_cache);
  const size_t shared = size_t(max_len) * sizeof(float);
  MG_CHECK(shared <= 200 * 1024, "KV cache of {} positions is too long for the decode kernel", max_len);
  cudaStream_t stream = stream_of(ctx);
  dispatch_float(q.dtype(), [&]<typename T>() {
    if (shared > 48 * 1024) {
      CUDA_CHECK(cudaFuncSetAttribute(kv_cache_attend<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared)));
    }
    kv_cache_attend<T><<<dim3(unsigned(s), unsigned(b), unsigned(nq)), kThreads, shared, stream>>>(
        dev_ptr<const T>(q), dev_ptr<const T>(k_cache), dev_ptr<const T>(v_cache), dev_ptr<const int64_t>(dslots),
        dev_ptr<const int64_t>(dstarts), b, nq, ng, d, max_len, softmax_scale, dev_ptr<T>(out));
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace megatron::cuda
