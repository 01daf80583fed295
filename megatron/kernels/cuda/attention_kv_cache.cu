// Causal attention over a KV cache (inference), CUDA: the contract of op_list.inc and the CPU
// reference kernels/cpu/attention_kv_cache.cpp. Two launches: the new keys/values are copied into
// their cache slots (kv_cache_append), then one block per (query position, batch row, head) scores
// its query against the cached positions it may see, takes the softmax in shared memory and writes
// P·V. Decode steps have one query per sequence, so this is what a step costs; a prompt's first
// forward goes through the training attention (cuDNN) instead (Note [Prefill attention]).
//
// Note [Decode attention reads]: a decode step has one query per (sequence, head) and is bound by
// reading that sequence's cache, [positions, ng·d]. One block per query leaves a batch-1 step with
// as many blocks as heads, each walking hundreds of positions one dependent load after another
// (190 µs a layer on an H200, whatever the batch). So the positions are split (flash decoding):
// a block takes one chunk of one query's positions — scores with a thread per position (its key
// row in unrolled 16-byte loads), the chunk's max and sum, and the unnormalised P·V with a thread
// per 16-byte pack of channels and position group (enough loads in flight to keep HBM busy) — and
// a second launch merges the chunks' partial results by their maxima. The chunk
// count is fixed by the cache length (not the positions in use), so a step's grid is the same
// every step (capturable); chunks past a query's position only record that they are empty.
// Slots and starts are read on the device only: no host synchronisation per layer (the caller
// checked them once per forward).

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include <cfloat>

#include "megatron/kernels/cuda/cuda_common.cuh"
#include "megatron/kernels/cuda/cuda_ops.h"
#include "megatron/runtime/cuda/cuda_check.h"

namespace megatron::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kMaxHeadDim = kThreads;  // kv_channels up to this (MLA caches go another way)

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

// grid (chunks, s·b, nq), kThreads threads; dynamic shared memory: chunk floats of scores.
// Writes the chunk's max m, sum l = Σ exp(score - m) and acc = Σ exp(score - m)·v (Note [Decode
// attention reads]); an empty chunk writes m = -inf, l = 0, acc = 0.
template <typename T>
__global__ void kv_cache_attend_chunk(const T* q, const T* k_cache, const T* v_cache, const int64_t* slots,
                                      const int64_t* starts, int64_t b, int64_t nq, int64_t ng, int64_t d,
                                      int64_t max_len, int64_t chunk, float scale, bool vec, float* part_m,
                                      float* part_l, float* part_acc) {
  extern __shared__ float scores[];
  __shared__ float scratch[32];
  __shared__ float qs[kMaxHeadDim];
  __shared__ float partial[kThreads * 8];  // the groups' partial P·V sums (up to kPack channels a thread)
  const int64_t c = blockIdx.x, row_id = blockIdx.y, h = blockIdx.z;  // row_id = j·b + i
  const int64_t j = row_id / b, i = row_id % b;
  const int64_t last = starts[i] + j, g = h / (nq / ng), row = ng * d;
  const int64_t lo = c * chunk, hi = min(lo + chunk, last + 1);
  const int64_t out_id = (c * gridDim.y + row_id) * nq + h;
  float* acc_out = part_acc + out_id * d;
  if (lo >= hi) {
    if (threadIdx.x == 0) part_m[out_id] = -INFINITY, part_l[out_id] = 0.0f;
    for (int64_t e = threadIdx.x; e < d; e += blockDim.x) acc_out[e] = 0.0f;
    return;
  }
  const T* qrow = q + (row_id * nq + h) * d;
  for (int64_t e = threadIdx.x; e < d; e += blockDim.x) qs[e] = load_float(qrow[e]);
  __syncthreads();
  const T* kbase = k_cache + slots[i] * max_len * row + g * d;
  const T* vbase = v_cache + slots[i] * max_len * row + g * d;
  constexpr int kPack = 16 / sizeof(T);
  float m = -FLT_MAX;
  for (int64_t t = lo + threadIdx.x; t < hi; t += blockDim.x) {
    const T* krow = kbase + t * row;
    float acc = 0.0f;
    if (vec) {
#pragma unroll 8
      for (int64_t e = 0; e < d; e += kPack) {  // unrolled: several 16-byte loads in flight
        float kv[kPack];
        load_pack<kPack>(krow + e, kv);
#pragma unroll
        for (int u = 0; u < kPack; ++u) acc += qs[e + u] * kv[u];
      }
    } else {
      for (int64_t e = 0; e < d; ++e) acc += qs[e] * load_float(krow[e]);
    }
    acc *= scale;
    scores[t - lo] = acc;
    m = fmaxf(m, acc);
  }
  m = block_reduce(m, scratch, true);
  float sum = 0.0f;
  for (int64_t t = lo + threadIdx.x; t < hi; t += blockDim.x) {
    const float p = __expf(scores[t - lo] - m);
    scores[t - lo] = p;
    sum += p;
  }
  sum = block_reduce(sum, scratch, false);  // its barriers also publish the exponentials
  if (vec && (d / kPack) <= kThreads && kThreads % (d / kPack) == 0) {
    // P·V in 16-byte packs: thread (grp, pk) sums channels pk·kPack.. over positions lo + grp,
    // lo + grp + groups, ...; the groups' sums meet in shared memory.
    const int64_t lanes = d / kPack, groups = kThreads / lanes, grp = threadIdx.x / lanes, pk = threadIdx.x % lanes;
    float acc[kPack] = {};
#pragma unroll 4
    for (int64_t t = lo + grp; t < hi; t += groups) {
      float vv[kPack];
      load_pack<kPack>(vbase + t * row + pk * kPack, vv);
      const float p = scores[t - lo];
#pragma unroll
      for (int u = 0; u < kPack; ++u) acc[u] += p * vv[u];
    }
#pragma unroll
    for (int u = 0; u < kPack; ++u) partial[grp * d + pk * kPack + u] = acc[u];
    __syncthreads();
    for (int64_t e = threadIdx.x; e < d; e += blockDim.x) {
      float total = 0.0f;
      for (int64_t k = 0; k < groups; ++k) total += partial[k * d + e];
      acc_out[e] = total;
    }
  } else {
    // P·V a channel a thread: thread (grp, e) sums channel e over positions lo + grp, lo + grp + groups, ...
    const int64_t groups = kThreads / d, grp = threadIdx.x / d, e = threadIdx.x % d;
    float acc = 0.0f;
    if (grp < groups) {
#pragma unroll 8
      for (int64_t t = lo + grp; t < hi; t += groups) acc += scores[t - lo] * load_float(vbase[t * row + e]);
    }
    partial[threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.x < d) {
      float total = 0.0f;
      for (int64_t k = 0; k < groups; ++k) total += partial[k * d + threadIdx.x];
      acc_out[threadIdx.x] = total;
    }
  }
  if (threadIdx.x == 0) part_m[out_id] = m, part_l[out_id] = sum;
}

// grid (s·b, nq), d threads: out = Σ_c e^(m_c - M)·acc_c / Σ_c e^(m_c - M)·l_c with M = max_c m_c.
template <typename T>
__global__ void kv_cache_attend_merge(const float* part_m, const float* part_l, const float* part_acc, int64_t chunks,
                                      int64_t rows, int64_t nq, int64_t d, T* out) {
  const int64_t row_id = blockIdx.x, h = blockIdx.y;
  float big = -INFINITY;
  for (int64_t c = 0; c < chunks; ++c) big = fmaxf(big, part_m[(c * rows + row_id) * nq + h]);
  float denom = 0.0f;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t id = (c * rows + row_id) * nq + h;
    if (part_l[id] > 0.0f) denom += __expf(part_m[id] - big) * part_l[id];
  }
  for (int64_t e = threadIdx.x; e < d; e += blockDim.x) {
    float num = 0.0f;
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t id = (c * rows + row_id) * nq + h;
      if (part_l[id] > 0.0f) num += __expf(part_m[id] - big) * part_acc[id * d + e];
    }
    out[(row_id * nq + h) * d + e] = store_float<T>(num / denom);
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
  // Note [Decode attention reads]: chunks of at least 128 positions, at most 32 of them.
  const int64_t chunk = std::max<int64_t>(128, (max_len + 31) / 32 + 127) / 128 * 128;
  const int64_t chunks = (max_len + chunk - 1) / chunk, rows = s * b;
  const size_t shared = size_t(chunk) * sizeof(float);
  MG_CHECK(shared <= 200 * 1024, "KV cache of {} positions is too long for the decode kernel", max_len);
  Tensor part_m = Tensor::empty({chunks, rows, nq}, DType::Float32, ctx.device());
  Tensor part_l = Tensor::empty({chunks, rows, nq}, DType::Float32, ctx.device());
  Tensor part_acc = Tensor::empty({chunks, rows, nq, d}, DType::Float32, ctx.device());
  cudaStream_t stream = stream_of(ctx);
  dispatch_float(q.dtype(), [&]<typename T>() {
    const size_t bytes = sizeof(T);
    const bool vec = (d * bytes) % 16 == 0 && (ng * d * bytes) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(k_cache.raw_data()) % 16 == 0 && reinterpret_cast<uintptr_t>(v_cache.raw_data()) % 16 == 0;
    if (shared > 48 * 1024) {  // once per type, at the largest size (not again under graph capture)
      static const cudaError_t raised = cudaFuncSetAttribute(
          kv_cache_attend_chunk<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(200 * 1024));
      CUDA_CHECK(raised);
    }
    kv_cache_attend_chunk<T><<<dim3(unsigned(chunks), unsigned(rows), unsigned(nq)), kThreads, shared, stream>>>(
        dev_ptr<const T>(q), dev_ptr<const T>(k_cache), dev_ptr<const T>(v_cache), dev_ptr<const int64_t>(dslots),
        dev_ptr<const int64_t>(dstarts), b, nq, ng, d, max_len, chunk, softmax_scale, vec, dev_ptr<float>(part_m),
        dev_ptr<float>(part_l), dev_ptr<float>(part_acc));
    CUDA_CHECK_LAUNCH();
    kv_cache_attend_merge<T><<<dim3(unsigned(rows), unsigned(nq)), unsigned(std::min<int64_t>(d, kThreads)), 0, stream>>>(
        dev_ptr<const float>(part_m), dev_ptr<const float>(part_l), dev_ptr<const float>(part_acc), chunks, rows, nq,
        d, dev_ptr<T>(out));
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace megatron::cuda
