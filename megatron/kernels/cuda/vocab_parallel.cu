// The vocab-parallel embedding and cross entropy, CUDA fast path (reference: kernels/cpu/vocab_parallel.cpp,
// which says how the pieces and the caller's all-reduces fit together).
//
// embedding forward   one block per output row: the shard's row in 16-byte packs when the id is in
//                     [vocab_start, vocab_start + Vl), zeros otherwise. Ids outside [0, vocab_size) are
//                     the user's mistake: recorded with atomicMin, synced and thrown as the CPU does
//                     (Note [Device-side id checks] in embedding.cu).
// embedding backward  Note [Embedding backward by sorting] (embedding.cu): rows are radix-sorted by local
//                     id, ids of other shards keyed INT_MAX and skipped; one block per run of equal ids sums
//                     its rows in a fixed order (deterministic) and adds the sum into word_grad once.
// local max / sums    one block per row, 16-byte packs, fp32 per thread merged across the block.
//                     local_sums syncs only when asked to report a negative label (like cross_entropy_forward).
// from_sums           elementwise.
// backward            as cross_entropy_backward with the one-hot shifted by vocab_start; in place allowed
//                     (each thread reads its pack before writing it, so no __restrict__ there).
#include <algorithm>
#include <climits>
#include <cmath>
#include <cub/device/device_radix_sort.cuh>

#include "megatron/kernels/cuda/cuda_common.cuh"
#include "megatron/kernels/cuda/cuda_ops.h"
#include "megatron/kernels/ops.h"

namespace megatron::cuda {

namespace {

constexpr int kMaxRowThreads = 512;
constexpr int kMaxEmbeddingThreads = 256;
constexpr unsigned long long kNoBad = ~0ull;

// An int32/int64 index tensor on the device (token ids, labels).
struct Indices {
  const void* data = nullptr;
  bool is64 = false;
  __device__ __forceinline__ int64_t operator[](int64_t i) const {
    return is64 ? static_cast<const int64_t*>(data)[i] : int64_t(static_cast<const int32_t*>(data)[i]);
  }
};

// ---- block reductions (blockDim.x a multiple of 32); the result is valid in every thread ----------

struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
  static constexpr float kIdentity = -INFINITY;
};
struct SumOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
  static constexpr float kIdentity = 0.0f;
};

template <typename Op>
__device__ float block_reduce(float v, Op op) {
  __shared__ float shared[32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < int(blockDim.x >> 5) ? shared[lane] : Op::kIdentity;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// ---- embedding ------------------------------------------------------------------------------------

// out[si, bi, :] = word_shard[tokens[bi, si] - vocab_start, :] when in the shard, else 0.
template <typename T, int VEC>
__global__ void vocab_parallel_embedding_forward_kernel(Indices tokens, const T* __restrict__ word, int64_t vocab_start,
                                                        int64_t vl, int64_t vocab_size, int64_t b, int64_t s, int64_t h,
                                                        T* __restrict__ out, unsigned long long* bad) {
  const int64_t row = blockIdx.x, si = row / b, bi = row % b, flat = bi * s + si;
  const int64_t id = tokens[flat];
  if (id < 0 || id >= vocab_size) {
    if (threadIdx.x == 0) atomicMin(bad, static_cast<unsigned long long>(flat));
    return;
  }
  const int64_t local = id - vocab_start;
  T* orow = out + row * h;
  if (local >= 0 && local < vl) {
    const T* wr = word + local * h;
    for (int64_t c = int64_t(threadIdx.x) * VEC; c < h; c += int64_t(blockDim.x) * VEC)
      *reinterpret_cast<Pack<T, VEC>*>(orow + c) = *reinterpret_cast<const Pack<T, VEC>*>(wr + c);
  } else {
    Pack<T, VEC> zero;
#pragma unroll
    for (int k = 0; k < VEC; ++k) zero.v[k] = store_float<T>(0.0f);
    for (int64_t c = int64_t(threadIdx.x) * VEC; c < h; c += int64_t(blockDim.x) * VEC)
      *reinterpret_cast<Pack<T, VEC>*>(orow + c) = zero;
  }
}

// keys[r] = local id of grad_out row r (r = si·b + bi), INT_MAX when another shard holds it.
__global__ void vocab_parallel_sort_keys(Indices tokens, int64_t vocab_start, int64_t vl, int64_t b, int64_t s,
                                         int32_t* keys, int32_t* rows) {
  const int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (r >= b * s) return;
  const int64_t si = r / b, bi = r % b;
  const int64_t local = tokens[bi * s + si] - vocab_start;
  keys[r] = local >= 0 && local < vl ? int32_t(local) : INT_MAX;
  rows[r] = int32_t(r);
}

// ---- cross entropy --------------------------------------------------------------------------------

template <typename T, int VEC>
__global__ void cross_entropy_local_max_kernel(const T* __restrict__ logits, int64_t V, float* __restrict__ max) {
  const int64_t row = blockIdx.x;
  const T* xr = logits + row * V;
  float m = -INFINITY;
  for (int64_t c = int64_t(threadIdx.x) * VEC; c < V; c += int64_t(blockDim.x) * VEC) {
    float v[VEC];
    load_pack<VEC>(xr + c, v);
#pragma unroll
    for (int k = 0; k < VEC; ++k) m = fmaxf(m, v[k]);
  }
  m = block_reduce(m, MaxOp{});
  if (threadIdx.x == 0) max[row] = m;
}

// sums[row] = Σ exp(x - max[row]); sums[N + row] = x[label - vocab_start] or 0.
template <typename T, int VEC>
__global__ void cross_entropy_local_sums_kernel(const T* __restrict__ logits, Indices labels, int64_t vocab_start,
                                                int64_t V, int64_t N, const float* __restrict__ max,
                                                float* __restrict__ sums, unsigned long long* bad_row) {
  const int64_t row = blockIdx.x;
  const T* xr = logits + row * V;
  const float m = max[row];
  float acc = 0.0f;
  for (int64_t c = int64_t(threadIdx.x) * VEC; c < V; c += int64_t(blockDim.x) * VEC) {
    float v[VEC];
    load_pack<VEC>(xr + c, v);
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc += expf(v[k] - m);
  }
  acc = block_reduce(acc, SumOp{});
  if (threadIdx.x != 0) return;
  sums[row] = acc;
  const int64_t label = labels[row];
  if (label < 0) atomicMin(bad_row, static_cast<unsigned long long>(row));
  const int64_t local = label - vocab_start;
  sums[N + row] = local >= 0 && local < V ? load_float(xr[local]) : 0.0f;
}

__global__ void cross_entropy_from_sums_kernel(const float* __restrict__ max, const float* __restrict__ sums, int64_t n,
                                               float* __restrict__ losses, float* __restrict__ lse) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float l = max[i] + logf(sums[i]);
    losses[i] = l - sums[n + i];
    if (lse) lse[i] = l;
  }
}

template <typename T, int VEC>
__global__ void vocab_parallel_cross_entropy_backward_kernel(const float* __restrict__ grad_losses, const T* logits,
                                                             Indices labels, int64_t vocab_start,
                                                             const float* __restrict__ lse, int64_t V, T* grad) {
  const int64_t row = blockIdx.x, local = labels[row] - vocab_start;
  const float g = grad_losses[row], l = lse[row];
  const T* xr = logits + row * V;
  T* gr = grad + row * V;
  for (int64_t c = int64_t(threadIdx.x) * VEC; c < V; c += int64_t(blockDim.x) * VEC) {
    float v[VEC];
    load_pack<VEC>(xr + c, v);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      v[k] = expf(v[k] - l) * g;
      if (c + k == local) v[k] -= g;
    }
    store_pack<VEC>(gr + c, v);
  }
}

// ---- host helpers ---------------------------------------------------------------------------------

Indices make_indices(const Tensor& t, const char* name) {
  check_cuda(t, name);
  MG_ASSERT(t.dtype() == DType::Int32 || t.dtype() == DType::Int64, "{} must be int32/int64, got {}", name, t.str());
  return Indices{t.raw_data(), t.dtype() == DType::Int64};
}

// tokens [b, s] on the device.
Indices make_tokens(const Tensor& tokens) {
  MG_ASSERT(tokens.defined() && tokens.dim() == 2, "tokens must be [b, s], got {}",
            tokens.defined() ? tokens.str() : "undefined");
  return make_indices(tokens, "tokens");
}

void check_rows_tensor(const Tensor& t, int64_t s, int64_t b, int64_t h, const char* name) {
  MG_ASSERT(t.dim() == 3 && t.size(0) == s && t.size(1) == b && t.size(2) == h, "{} is {}, expected [{}, {}, {}]", name,
            t.str(), s, b, h);
}

// logits [N, Vl] on the device: rows and width.
struct Shard {
  int64_t n = 0, v = 0;
};

Shard check_logits(const Tensor& logits) {
  check_cuda(logits, "logits");
  MG_ASSERT(logits.dim() >= 1 && is_floating(logits.dtype()), "logits must be float [N, Vl], got {}", logits.str());
  Shard sh;
  sh.v = logits.size(-1);
  sh.n = sh.v == 0 ? 0 : logits.numel() / sh.v;
  return sh;
}

// A one-element device buffer holding the smallest bad index, kNoBad when none.
Tensor make_bad_buffer(const Context& ctx) {
  Tensor bad = Tensor::empty({1}, DType::Int64, ctx.device());
  CUDA_CHECK(cudaMemsetAsync(bad.raw_data(), 0xff, sizeof(unsigned long long), stream_of(ctx)));
  return bad;
}

// Syncs the stream and returns the bad index (kNoBad when none; and always when the caller checked
// the ids on the host, Note [Host checks under capture]).
unsigned long long read_bad(const Context& ctx, const Tensor& bad) {
  if (ctx.ids_checked_on_host()) return kNoBad;
  cudaStream_t stream = stream_of(ctx);
  unsigned long long found = kNoBad;
  CUDA_CHECK(cudaMemcpyAsync(&found, bad.raw_data(), sizeof(found), cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  return found;
}

int64_t index_at(const Tensor& ids, int64_t flat) { return ids.flat_slice(flat, 1).to_ints()[0]; }

}  // namespace

void vocab_parallel_embedding_forward(Context& ctx, const Tensor& tokens, const Tensor& word_shard, int64_t vocab_start,
                                      int64_t vocab_size, Tensor& out) {
  check_cuda(word_shard, "word_shard");
  MG_ASSERT(word_shard.dim() == 2, "word_shard must be [Vl, h], got {}", word_shard.str());
  const int64_t vl = word_shard.size(0), h = word_shard.size(1);
  MG_ASSERT(vocab_start >= 0 && vocab_start + vl <= vocab_size, "shard [{}, {}) is outside the vocabulary [0, {})",
            vocab_start, vocab_start + vl, vocab_size);
  const Indices ids = make_tokens(tokens);
  const int64_t b = tokens.size(0), s = tokens.size(1);
  check_cuda(out, "out");
  check_rows_tensor(out, s, b, h, "out");
  MG_ASSERT(out.dtype() == word_shard.dtype(), "the CUDA embedding needs out {} in the dtype of word_shard {}",
            out.str(), word_shard.str());
  if (b * s == 0 || h == 0) return;
  Tensor bad = make_bad_buffer(ctx);
  auto* bad_ptr = static_cast<unsigned long long*>(bad.raw_data());
  cudaStream_t stream = stream_of(ctx);
  dispatch_float(out.dtype(), [&]<typename T>() {
    constexpr int kVec = 16 / sizeof(T);
    if (h % kVec == 0 && aligned16(word_shard.raw_data()) && aligned16(out.raw_data())) {
      vocab_parallel_embedding_forward_kernel<T, kVec>
          <<<unsigned(b * s), row_threads(h / kVec, kMaxEmbeddingThreads), 0, stream>>>(
              ids, dev_ptr<T>(word_shard), vocab_start, vl, vocab_size, b, s, h, dev_ptr<T>(out), bad_ptr);
    } else {
      vocab_parallel_embedding_forward_kernel<T, 1>
          <<<unsigned(b * s), row_threads(h, kMaxEmbeddingThreads), 0, stream>>>(
              ids, dev_ptr<T>(word_shard), vocab_start, vl, vocab_size, b, s, h, dev_ptr<T>(out), bad_ptr);
    }
  });
  CUDA_CHECK_LAUNCH();
  const unsigned long long found = read_bad(ctx, bad);
  if (found == kNoBad) return;
  const int64_t flat = int64_t(found);
  ops::throw_bad_table_id("token id", index_at(tokens, flat), flat, s, vocab_size);
}

void vocab_parallel_embedding_backward(Context& ctx, const Tensor& tokens, const Tensor& grad_out, int64_t vocab_start,
                                       Tensor& word_grad) {
  if (!word_grad.defined()) return;
  check_cuda(grad_out, "grad_out");
  MG_ASSERT(grad_out.dim() == 3, "grad_out must be [s, b, h], got {}", grad_out.str());
  const int64_t h = grad_out.size(2);
  const Indices ids = make_tokens(tokens);
  const int64_t b = tokens.size(0), s = tokens.size(1), n = b * s;
  check_rows_tensor(grad_out, s, b, h, "grad_out");
  check_cuda(word_grad, "word_grad");
  MG_ASSERT(word_grad.dtype() == DType::Float32 && word_grad.dim() == 2 && word_grad.size(1) == h,
            "word_grad is {}, expected fp32 [Vl, {}]", word_grad.str(), h);
  const int64_t vl = word_grad.size(0);
  MG_ASSERT(n < INT_MAX && vl < INT_MAX,
            "vocab-parallel embedding backward: {} rows into a [{}, {}] shard exceed int32", n, vl, h);
  if (n == 0 || h == 0 || vl == 0) return;
  cudaStream_t stream = stream_of(ctx);
  Tensor keys = Tensor::empty({2 * n}, DType::Int32, ctx.device());
  Tensor rows = Tensor::empty({2 * n}, DType::Int32, ctx.device());
  int32_t* keys_in = dev_ptr<int32_t>(keys);
  int32_t* rows_in = dev_ptr<int32_t>(rows);
  vocab_parallel_sort_keys<<<grid_for(n, kBlockSize, INT_MAX), kBlockSize, 0, stream>>>(ids, vocab_start, vl, b, s,
                                                                                        keys_in, rows_in);
  CUDA_CHECK_LAUNCH();
  const int bits = 32;  // INT_MAX marks other shards' rows: sort on every bit so they go last
  size_t temp_bytes = 0;
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys_in, keys_in + n, rows_in, rows_in + n, int(n), 0,
                                             bits, stream));
  Tensor temp = Tensor::empty({int64_t(std::max<size_t>(temp_bytes, 1))}, DType::UInt8, ctx.device());
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.raw_data(), temp_bytes, keys_in, keys_in + n, rows_in, rows_in + n,
                                             int(n), 0, bits, stream));
  const int threads = int(std::min<int64_t>(256, std::max<int64_t>(32, (h + 31) / 32 * 32)));
  dispatch_float(grad_out.dtype(), [&]<typename T>() {
    sorted_segment_sum<T><<<unsigned(n), threads, 0, stream>>>(
        keys_in + n, rows_in + n, n, dev_ptr<T>(grad_out), h, dev_ptr<float>(word_grad));
  });
  CUDA_CHECK_LAUNCH();
}

void cross_entropy_local_max(Context& ctx, const Tensor& logits, Tensor& max) {
  const Shard sh = check_logits(logits);
  check_fp32(max, sh.n, "max");
  if (sh.n == 0) return;
  cudaStream_t stream = stream_of(ctx);
  dispatch_float(logits.dtype(), [&]<typename T>() {
    constexpr int kVec = 16 / sizeof(T);
    if (sh.v % kVec == 0 && aligned16(logits.raw_data())) {
      cross_entropy_local_max_kernel<T, kVec><<<unsigned(sh.n), row_threads(sh.v / kVec, kMaxRowThreads), 0, stream>>>(
          dev_ptr<T>(logits), sh.v, dev_ptr<float>(max));
    } else {
      cross_entropy_local_max_kernel<T, 1><<<unsigned(sh.n), row_threads(sh.v, kMaxRowThreads), 0, stream>>>(
          dev_ptr<T>(logits), sh.v, dev_ptr<float>(max));
    }
  });
  CUDA_CHECK_LAUNCH();
}

void cross_entropy_local_sums(Context& ctx, const Tensor& logits, const Tensor& labels, int64_t vocab_start,
                              const Tensor& max, Tensor& sums) {
  const Shard sh = check_logits(logits);
  const Indices y = make_indices(labels, "labels");
  MG_ASSERT(labels.numel() == sh.n, "labels {} do not match logits {}", labels.str(), logits.str());
  check_fp32(max, sh.n, "max");
  check_fp32(sums, 2 * sh.n, "sums");
  if (sh.n == 0) return;
  cudaStream_t stream = stream_of(ctx);
  Tensor bad = make_bad_buffer(ctx);
  auto* bad_row = static_cast<unsigned long long*>(bad.raw_data());
  dispatch_float(logits.dtype(), [&]<typename T>() {
    constexpr int kVec = 16 / sizeof(T);
    if (sh.v % kVec == 0 && aligned16(logits.raw_data())) {
      cross_entropy_local_sums_kernel<T, kVec><<<unsigned(sh.n), row_threads(sh.v / kVec, kMaxRowThreads), 0, stream>>>(
          dev_ptr<T>(logits), y, vocab_start, sh.v, sh.n, dev_ptr<float>(max), dev_ptr<float>(sums), bad_row);
    } else {
      cross_entropy_local_sums_kernel<T, 1><<<unsigned(sh.n), row_threads(sh.v, kMaxRowThreads), 0, stream>>>(
          dev_ptr<T>(logits), y, vocab_start, sh.v, sh.n, dev_ptr<float>(max), dev_ptr<float>(sums), bad_row);
    }
  });
  CUDA_CHECK_LAUNCH();
  const unsigned long long found = read_bad(ctx, bad);
  if (found == kNoBad) return;
  const int64_t row = int64_t(found);
  MG_CHECK(false,
           "label {} at position {} is outside the vocabulary: mask ignored tokens with the loss mask instead of a "
           "negative label",
           index_at(labels, row), row);
}

void cross_entropy_from_sums(Context& ctx, const Tensor& max, const Tensor& sums, Tensor& losses, Tensor& lse) {
  check_cuda(max, "max");
  const int64_t n = max.numel();
  check_fp32(max, n, "max");
  check_fp32(sums, 2 * n, "sums");
  check_fp32(losses, n, "losses");
  float* lse_out = nullptr;
  if (lse.defined()) {
    check_fp32(lse, n, "lse");
    lse_out = dev_ptr<float>(lse);
  }
  if (n == 0) return;
  cross_entropy_from_sums_kernel<<<grid_for(n), kBlockSize, 0, stream_of(ctx)>>>(
      dev_ptr<float>(max), dev_ptr<float>(sums), n, dev_ptr<float>(losses), lse_out);
  CUDA_CHECK_LAUNCH();
}

void vocab_parallel_cross_entropy_backward(Context& ctx, const Tensor& grad_losses, const Tensor& logits,
                                           const Tensor& labels, int64_t vocab_start, const Tensor& lse,
                                           Tensor& grad_logits) {
  const Shard sh = check_logits(logits);
  const Indices y = make_indices(labels, "labels");
  MG_ASSERT(labels.numel() == sh.n, "labels {} do not match logits {}", labels.str(), logits.str());
  check_fp32(grad_losses, sh.n, "grad_losses");
  check_fp32(lse, sh.n, "lse");
  check_cuda(grad_logits, "grad_logits");
  MG_ASSERT(grad_logits.numel() == logits.numel() && grad_logits.dtype() == logits.dtype(),
            "grad_logits is {}, expected the size and dtype of logits {}", grad_logits.str(), logits.str());
  if (sh.n == 0) return;
  cudaStream_t stream = stream_of(ctx);
  dispatch_float(logits.dtype(), [&]<typename T>() {
    constexpr int kVec = 16 / sizeof(T);
    if (sh.v % kVec == 0 && aligned16(logits.raw_data()) && aligned16(grad_logits.raw_data())) {
      vocab_parallel_cross_entropy_backward_kernel<T, kVec>
          <<<unsigned(sh.n), row_threads(sh.v / kVec, kMaxRowThreads), 0, stream>>>(
              dev_ptr<float>(grad_losses), dev_ptr<T>(logits), y, vocab_start, dev_ptr<float>(lse), sh.v,
              dev_ptr<T>(grad_logits));
    } else {
      vocab_parallel_cross_entropy_backward_kernel<T, 1>
          <<<unsigned(sh.n), row_threads(sh.v, kMaxRowThreads), 0, stream>>>(
              dev_ptr<float>(grad_losses), dev_ptr<T>(logits), y, vocab_start, dev_ptr<float>(lse), sh.v,
              dev_ptr<T>(grad_logits));
    }
  });
  CUDA_CHECK_LAUNCH();
}

}  // namespace megatron::cuda
