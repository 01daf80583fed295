// Causal attention over a KV cache (inference), CUDA: the contract of op_list.inc and the CPU
// reference kernels/cpu/attention_kv_cache.cpp. Two launches: the new keys/values are copied into
// their cache slots, then one block per (query position, batch row, head) scores its query against
// the cached positions it may see, takes the softmax in shared memory and writes P·V. Decode steps
// have one query per sequence, so this simple form is what a step costs; prefill of long prompts
// goes through the training attention (cuDNN) instead.
#include <cuda_runtime.h>

#include <cfloat>

#include "megatron/kernels/cuda/cuda_common.cuh"
#include "megatron/kernels/cuda/cuda_ops.h"
#include "megatron/runtime/cuda/cuda_check.h"

namespace megatron::cuda {

namespace {

constexpr int kThreads = 128;

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

// grid (s, b, nq); dynamic shared memory: max_len floats of scores.
template <typename T>
__global__ void kv_cache_attend(const T* q, const T* k_cache, const T* v_cache, const int64_t* slots,
                                const int64_t* starts, int64_t b, int64_t nq, int64_t ng, int64_t d, int64_t max_len,
                                float scale, T* out) {
  extern __shared__ float scores[];
  __shared__ float scratch[32];
  const int64_t j = blockIdx.x, i = blockIdx.y, h = blockIdx.z;
  const int64_t last = starts[i] + j, g = h / (nq / ng), row = ng * d;
  const T* qrow = q + ((j * b + i) * nq + h) * d;
  const T* kbase = k_cache + slots[i] * max_len * row + g * d;
  const T* vbase = v_cache + slots[i] * max_len * row + g * d;
  float m = -FLT_MAX;
  for (int64_t t = threadIdx.x; t <= last; t += blockDim.x) {
    float acc = 0.0f;
    for (int64_t e = 0; e < d; ++e) acc += load_float(qrow[e]) * load_float(kbase[t * row + e]);
    scores[t] = acc * scale;
    m = fmaxf(m, scores[t]);
  }
  m = block_reduce(m, scratch, true);
  float sum = 0.0f;
  for (int64_t t = threadIdx.x; t <= last; t += blockDim.x) {
    scores[t] = __expf(scores[t] - m);
    sum += scores[t];
  }
  sum = block_reduce(sum, scratch, false);
  const float inv = 1.0f / sum;
  __syncthreads();
  T* orow = out + ((j * b + i) * nq + h) * d;
  for (int64_t e = threadIdx.x; e < d; e += blockDim.x) {
    float acc = 0.0f;
    for (int64_t t = 0; t <= last; ++t) acc += scores[t] * load_float(vbase[t * row + e]);
    orow[e] = store_float<T>(acc * inv);
  }
}

}  // namespace

void attention_kv_cache_forward(Context& ctx, const Tensor& q, const Tensor& k_new, const Tensor& v_new,
                                const Tensor& slots, const Tensor& starts, float softmax_scale, Tensor& k_cache,
                                Tensor& v_cache, Tensor& out) {
  MG_ASSERT(q.dim() == 4 && k_new.dim() == 4 && k_new.shape() == v_new.shape() && k_cache.shape() == v_cache.shape(),
            "attention_kv_cache: q {} k_new {} caches {}", q.str(), k_new.str(), k_cache.str());
  MG_ASSERT(q.dtype() == k_new.dtype() && q.dtype() == v_new.dtype() && q.dtype() == k_cache.dtype() &&
                q.dtype() == v_cache.dtype() && q.dtype() == out.dtype(),
            "attention_kv_cache on CUDA takes one dtype for q, k/v and the caches");
  const int64_t s = q.size(0), b = q.size(1), nq = q.size(2), d = q.size(3), ng = k_new.size(2);
  const int64_t num_slots = k_cache.size(0), max_len = k_cache.size(1);
  MG_ASSERT(k_cache.size(2) == ng && k_cache.size(3) == d && nq % ng == 0, "caches {} for k_new {}", k_cache.str(),
            k_new.str());
  const std::vector<int64_t> slot = slots.to_ints(), start = starts.to_ints();
  MG_ASSERT(int64_t(slot.size()) == b && int64_t(start.size()) == b, "slots/starts need {} entries", b);
  for (int64_t i = 0; i < b; ++i) {
    MG_ASSERT(
        slot[size_t(i)] >= 0 && slot[size_t(i)] < num_slots && start[size_t(i)] >= 0 && start[size_t(i)] + s <= max_len,
        "batch row {}: slot {} positions {}..{} outside a cache of {} x {}", i, slot[size_t(i)], start[size_t(i)],
        start[size_t(i)] + s - 1, num_slots, max_len);
  }
  Tensor dslots = Tensor::from_ints(slot, {b}, DType::Int64, ctx.device());
  Tensor dstarts = Tensor::from_ints(start, {b}, DType::Int64, ctx.device());
  const size_t shared = size_t(max_len) * sizeof(float);
  MG_CHECK(shared <= 200 * 1024, "KV cache of {} positions is too long for the decode kernel", max_len);
  cudaStream_t stream = stream_of(ctx);
  dispatch_float(q.dtype(), [&]<typename T>() {
    kv_cache_write<T><<<grid_for(s * b * ng * d), kBlockSize, 0, stream>>>(
        dev_ptr<const T>(k_new), dev_ptr<const T>(v_new), dev_ptr<const int64_t>(dslots),
        dev_ptr<const int64_t>(dstarts), s, b, ng * d, max_len, dev_ptr<T>(k_cache), dev_ptr<T>(v_cache));
    CUDA_CHECK_LAUNCH();
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
