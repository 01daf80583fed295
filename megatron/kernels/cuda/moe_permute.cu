// Mixture of experts on CUDA, the token permutation and the row scaling by the probabilities — the
// fast path of kernels/cpu/moe.cpp's (routing, token dropping and the losses: moe.cu).
//
// Note [Permutation on the device]: the permuted order (Note [Permuted order]) is a stable
// partition of each routing-map column. Block (x, c) counts column x's routed tokens in chunk c of
// kChunk tokens; one block scans the chunk counts per expert and the experts' row counts; block
// (x, c) then ranks its chunk's tokens with a block scan and writes each routed token at
// offset[x] + rank (with drop-and-pad, the first `capacity` routed tokens, then unrouted ones at
// offset[x] + routed[x] + their rank among the unrouted). Besides sorted_indices and row_expert it
// writes token_rows [T, E] (the row of each pair, -1 for none), so every backward is a gather:
// a token's rows are summed in row order, the CPU's order, without atomics. The dropless row
// counts come back to the host in one copy (the caller sizes its buffers from them).
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <vector>

#include "megatron/kernels/cuda/cuda_common.cuh"
#include "megatron/kernels/cuda/cuda_ops.h"

namespace megatron::cuda {

// ---- permutation (Note [Permutation on the device]) --------------------------------------------------

namespace {

constexpr int kScanThreads = 256, kScanItems = 4, kChunk = kScanThreads * kScanItems;

__global__ void chunk_counts_kernel(const uint8_t* __restrict__ map, int64_t t_count, int e, int chunks,
                                    int32_t* counts) {
  const int x = blockIdx.x, c = blockIdx.y;
  int n = 0;
  const int64_t t0 = int64_t(c) * kChunk;
  for (int i = threadIdx.x; i < kChunk; i += kScanThreads) {
    const int64_t t = t0 + i;
    if (t < t_count) n += map[t * e + x] != 0;
  }
  using Reduce = cub::BlockReduce<int, kScanThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  n = Reduce(tmp).Sum(n);
  if (threadIdx.x == 0) counts[int64_t(x) * chunks + c] = n;
}

// chunk counts -> each chunk's first rank within its expert (in place), routed[x], and the experts'
// first rows offset[x] and rows rows[x] (int64, for the host).
__global__ void chunk_offsets_kernel(int32_t* chunk, int e, int chunks, int64_t capacity, int32_t* routed,
                                     int32_t* offset, int64_t* rows) {
  for (int x = threadIdx.x; x < e; x += blockDim.x) {
    int32_t run = 0;
    for (int c = 0; c < chunks; ++c) {
      const int32_t n = chunk[int64_t(x) * chunks + c];
      chunk[int64_t(x) * chunks + c] = run;
      run += n;
    }
    routed[x] = run;
    rows[x] = capacity > 0 ? capacity : run;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t o = 0;
    for (int x = 0; x < e; ++x) offset[x] = int32_t(o), o += rows[x];
  }
}

__global__ void scatter_rows_kernel(const uint8_t* __restrict__ map, int64_t t_count, int e, int chunks,
                                    int64_t capacity, const int32_t* chunk_start, const int32_t* routed,
                                    const int32_t* offset, int32_t* sorted, int32_t* row_expert, int32_t* token_rows) {
  const int x = blockIdx.x, c = blockIdx.y;
  const int64_t t0 = int64_t(c) * kChunk + int64_t(threadIdx.x) * kScanItems;
  int flag[kScanItems], rank[kScanItems];
#pragma unroll
  for (int i = 0; i < kScanItems; ++i) flag[i] = (t0 + i < t_count && map[(t0 + i) * e + x] != 0) ? 1 : 0;
  using Scan = cub::BlockScan<int, kScanThreads>;
  __shared__ typename Scan::TempStorage tmp;
  Scan(tmp).ExclusiveSum(flag, rank);
  const int32_t base = chunk_start[int64_t(x) * chunks + c], n_routed = routed[x], first = offset[x];
#pragma unroll
  for (int i = 0; i < kScanItems; ++i) {
    const int64_t t = t0 + i;
    if (t >= t_count) continue;
    const int64_t r = base + rank[i];  // routed tokens of x before t
    int64_t row = -1;
    if (flag[i]) {
      if (capacity == 0 || r < capacity) row = first + r;
    } else if (capacity > 0) {
      const int64_t u = t - r;  // unrouted tokens of x before t
      if (n_routed + u < capacity) row = first + n_routed + u;
    }
    if (row < 0) continue;
    sorted[row] = int32_t(t);
    row_expert[row] = x;
    token_rows[t * e + x] = int32_t(row);
  }
}

}  // namespace

void moe_permutation(Context& ctx, const Tensor& routing_map, int64_t capacity, MoePermutation& perm) {
  MG_CHECK(routing_map.defined() && routing_map.dim() == 2 && routing_map.dtype() == DType::UInt8,
           "moe_permutation: the routing map must be uint8 [tokens, experts], got {}",
           routing_map.defined() ? routing_map.str() : "undefined");
  check_cuda(routing_map, "routing_map");
  const int64_t t_count = routing_map.size(0), e = routing_map.size(1);
  MG_CHECK(capacity >= 0 && capacity <= t_count, "moe_permutation: expert capacity {} for {} tokens", capacity,
           t_count);
  MG_CHECK(t_count * e < (int64_t(1) << 31), "moe_permutation: {} tokens x {} experts exceed int32 row indices",
           t_count, e);
  MG_CHECK(capacity > 0 || !ctx.capturing(),
           "moe_permutation on CUDA: the dropless row counts are read back on the host, which a CUDA graph "
           "capture cannot do (use drop-and-pad or run the MoE layer outside the graph)");
  const cudaStream_t stream = stream_of(ctx);
  const int chunks = int(std::max<int64_t>(1, (t_count + kChunk - 1) / kChunk));
  Tensor meta32 = Tensor::empty({e * chunks + 2 * e}, DType::Int32, ctx.device());
  Tensor rows_dev = Tensor::empty({e}, DType::Int64, ctx.device());
  int32_t* chunk = dev_ptr<int32_t>(meta32);
  int32_t* routed = chunk + e * chunks;
  int32_t* offset = routed + e;
  const dim3 grid{unsigned(e), unsigned(chunks)};
  if (e > 0) {
    chunk_counts_kernel<<<grid, kScanThreads, 0, stream>>>(dev_ptr<const uint8_t>(routing_map), t_count, int(e),
                                                          chunks, chunk);
    CUDA_CHECK_LAUNCH();
    chunk_offsets_kernel<<<1, kScanThreads, 0, stream>>>(chunk, int(e), chunks, capacity, routed, offset,
                                                         dev_ptr<int64_t>(rows_dev));
    CUDA_CHECK_LAUNCH();
  }
  perm.rows_per_expert.assign(size_t(e), capacity);
  if (capacity == 0 && e > 0) {  // the one copy back: the caller sizes the experts' buffers from it
    CUDA_CHECK(cudaMemcpyAsync(perm.rows_per_expert.data(), rows_dev.raw_data(), size_t(e) * sizeof(int64_t),
                               cudaMemcpyDeviceToHost, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  perm.num_tokens = t_count;
  perm.num_experts = e;
  const int64_t n = perm.rows();
  perm.sorted_indices = Tensor::empty({n}, DType::Int32, ctx.device());
  perm.row_expert = Tensor::empty({n}, DType::Int32, ctx.device());
  perm.token_rows = Tensor::empty({t_count, e}, DType::Int32, ctx.device());
  if (t_count * e == 0) return;
  CUDA_CHECK(cudaMemsetAsync(perm.token_rows.raw_data(), 0xFF, perm.token_rows.nbytes(), stream));  // -1
  scatter_rows_kernel<<<grid, kScanThreads, 0, stream>>>(dev_ptr<const uint8_t>(routing_map), t_count, int(e), chunks,
                                                         capacity, chunk, routed, offset,
                                                         dev_ptr<int32_t>(perm.sorted_indices),
                                                         dev_ptr<int32_t>(perm.row_expert),
                                                         dev_ptr<int32_t>(perm.token_rows));
  CUDA_CHECK_LAUNCH();
}

namespace {

constexpr int kRowBlock = 256;

// Elements per vector access: 16 bytes when every row start is 16-byte aligned, else one.
template <typename T>
int pack_of(int64_t h, std::initializer_list<const void*> ptrs) {
  const int n = int(16 / sizeof(T));
  if (h % n != 0) return 1;
  for (const void* p : ptrs)
    if (p && !aligned16(p)) return 1;
  return n;
}

// out[r] = src[index[r]] (index null: r), row by row; a plain copy of the storage type.
template <typename T, int N>
__global__ void gather_rows_kernel(const T* __restrict__ src, const int32_t* __restrict__ index, int64_t rows,
                                   int64_t h, T* __restrict__ out) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* s = src + int64_t(index[r]) * h;
    T* o = out + r * h;
    for (int64_t j = int64_t(threadIdx.x) * N; j < h; j += int64_t(blockDim.x) * N)
      *reinterpret_cast<Pack<T, N>*>(o + j) = *reinterpret_cast<const Pack<T, N>*>(s + j);
  }
}

// out[t] = Σ over t's rows r (token_rows[t, :], in row order) of w[r] · rows[r] (w null: 1), fp32,
// rounded once. The token's rows are gathered into shared memory first.
template <typename T, int N>
__global__ void gather_sum_rows_kernel(const T* __restrict__ rows, const float* __restrict__ w,
                                       const int32_t* __restrict__ token_rows, int64_t t_count, int e, int64_t h,
                                       T* __restrict__ out) {
  extern __shared__ int32_t list[];  // [e] rows, then [e] weights (as float bits)
  __shared__ int count;
  float* wl = reinterpret_cast<float*>(list + e);
  for (int64_t t = blockIdx.x; t < t_count; t += gridDim.x) {
    __syncthreads();
    if (threadIdx.x == 0) {
      int n = 0;
      for (int x = 0; x < e; ++x) {
        const int32_t r = token_rows[t * e + x];
        if (r >= 0) list[n] = r, wl[n] = w ? w[r] : 1.0f, ++n;
      }
      count = n;
    }
    __syncthreads();
    for (int64_t j = int64_t(threadIdx.x) * N; j < h; j += int64_t(blockDim.x) * N) {
      float acc[N];
#pragma unroll
      for (int q = 0; q < N; ++q) acc[q] = 0.0f;
      for (int i = 0; i < count; ++i) {
        float v[N];
        load_pack<N>(rows + int64_t(list[i]) * h + j, v);
#pragma unroll
        for (int q = 0; q < N; ++q) acc[q] += wl[i] * v[q];
      }
      store_pack<N>(out + t * h + j, acc);
    }
  }
}

__device__ float block_sum_float(float v) {
  using Reduce = cub::BlockReduce<float, kRowBlock>;
  __shared__ typename Reduce::TempStorage tmp;
  return Reduce(tmp).Sum(v);
}

// Row r: gx[r] = w[r] · g[index[r]] (when gx), gp[r] = Σ_j g[index[r], j] · x[r, j] (when gp), fp32;
// index null: r (the row scaling's backward), w null: 1.
template <typename T, int N>
__global__ void scaled_rows_and_dots_kernel(const T* __restrict__ g, const int32_t* __restrict__ index,
                                            const T* __restrict__ x, const float* __restrict__ w, int64_t rows,
                                            int64_t h, T* __restrict__ gx, float* __restrict__ gp) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* gr = g + (index ? int64_t(index[r]) : r) * h;
    const float wr = w ? w[r] : 1.0f;
    float dot = 0.0f;
    for (int64_t j = int64_t(threadIdx.x) * N; j < h; j += int64_t(blockDim.x) * N) {
      float gv[N];
      load_pack<N>(gr + j, gv);
      if (gx) {
        float o[N];
#pragma unroll
        for (int q = 0; q < N; ++q) o[q] = gv[q] * wr;
        store_pack<N>(gx + r * h + j, o);
      }
      if (gp) {
        float xv[N];
        load_pack<N>(x + r * h + j, xv);
#pragma unroll
        for (int q = 0; q < N; ++q) dot += gv[q] * xv[q];
      }
    }
    if (gp) {
      dot = block_sum_float(dot);
      if (threadIdx.x == 0) gp[r] = dot;
      __syncthreads();  // the reduction's storage is reused by the next row
    }
  }
}

// out[i] = x[i] · p[i / c] in fp32, rounded once.
template <typename T, int N>
__global__ void scale_rows_kernel(const T* __restrict__ x, const float* __restrict__ p, int64_t n, int64_t c,
                                  T* __restrict__ out) {
  const int64_t total = n * c;
  for (int64_t i = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) * N; i < total;
       i += int64_t(gridDim.x) * blockDim.x * N) {
    float v[N];
    load_pack<N>(x + i, v);
#pragma unroll
    for (int q = 0; q < N; ++q) v[q] *= p[(i + q) / c];
    store_pack<N>(out + i, v);
  }
}

__global__ void permute_probs_kernel(const float* probs, const int32_t* sorted, const int32_t* expert, int64_t n,
                                     int e, float* out) {
  for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < n; r += int64_t(gridDim.x) * blockDim.x)
    out[r] = probs[int64_t(sorted[r]) * e + expert[r]];
}

__global__ void permute_probs_backward_kernel(const float* g, const int32_t* token_rows, int64_t total, float* out) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = token_rows[i] < 0 ? 0.0f : g[token_rows[i]];
}

struct PermDims {
  int64_t n = 0, h = 0;
};

PermDims check_perm(const MoePermutation& perm, const Tensor& permuted, const Tensor& tokens) {
  const int64_t n = perm.rows();
  MG_ASSERT(perm.sorted_indices.defined() && perm.sorted_indices.numel() == n && perm.token_rows.defined() &&
                perm.token_rows.numel() == perm.num_tokens * perm.num_experts && perm.sorted_indices.device().is_cuda(),
            "MoE permutation of {} rows is incomplete or not on a CUDA device", n);
  check_float_cuda(permuted, "permuted");
  check_float_cuda(tokens, "tokens");
  MG_ASSERT(permuted.dim() == 2 && tokens.dim() == 2 && permuted.size(0) == n && tokens.size(0) == perm.num_tokens &&
                permuted.size(1) == tokens.size(1) && permuted.dtype() == tokens.dtype(),
            "permuted {} and tokens {} for a permutation of {} tokens into {} rows", permuted.str(), tokens.str(),
            perm.num_tokens, n);
  return {n, tokens.size(1)};
}

unsigned row_grid(int64_t rows) { return unsigned(std::clamp<int64_t>(rows, 1, 65535 * 4)); }

void gather_sum_rows(Context& ctx, const Tensor& rows, const float* w, const MoePermutation& perm, Tensor& out) {
  const int64_t h = out.size(1), e = perm.num_experts;
  if (perm.num_tokens == 0 || h == 0) return;
  const size_t smem = size_t(e) * 8;
  dispatch_float(out.dtype(), [&]<typename T>() {
    auto launch = [&]<int N>() {
      gather_sum_rows_kernel<T, N><<<row_grid(perm.num_tokens), kRowBlock, smem, stream_of(ctx)>>>(
          dev_ptr<const T>(rows), w, dev_ptr<const int32_t>(perm.token_rows), perm.num_tokens, int(e), h,
          dev_ptr<T>(out));
    };
    if (pack_of<T>(h, {rows.raw_data(), out.raw_data()}) > 1) {
      launch.template operator()<int(16 / sizeof(T))>();
    } else {
      launch.template operator()<1>();
    }
  });
  CUDA_CHECK_LAUNCH();
}

// gx / gp of scaled_rows_and_dots_kernel; either may be undefined.
void scaled_rows_and_dots(Context& ctx, const Tensor& g, const int32_t* index, const Tensor& x, const float* w,
                          int64_t rows, int64_t h, Tensor& gx, Tensor& gp) {
  if (rows == 0 || (!gx.defined() && !gp.defined())) return;
  if (h == 0) {
    if (gp.defined()) CUDA_CHECK(cudaMemsetAsync(gp.raw_data(), 0, gp.nbytes(), stream_of(ctx)));
    return;
  }
  dispatch_float(g.dtype(), [&]<typename T>() {
    auto launch = [&]<int N>() {
      scaled_rows_and_dots_kernel<T, N><<<row_grid(rows), kRowBlock, 0, stream_of(ctx)>>>(
          dev_ptr<const T>(g), index, gp.defined() ? dev_ptr<const T>(x) : nullptr, w, rows, h,
          gx.defined() ? dev_ptr<T>(gx) : nullptr, gp.defined() ? dev_ptr<float>(gp) : nullptr);
    };
    const bool packed = pack_of<T>(h, {g.raw_data(), gp.defined() ? x.raw_data() : nullptr,
                                       gx.defined() ? gx.raw_data() : nullptr}) > 1;
    if (packed) {
      launch.template operator()<int(16 / sizeof(T))>();
    } else {
      launch.template operator()<1>();
    }
  });
  CUDA_CHECK_LAUNCH();
}

}  // namespace

void moe_permute_forward(Context& ctx, const Tensor& tokens, const MoePermutation& perm, Tensor& permuted) {
  const PermDims d = check_perm(perm, permuted, tokens);
  if (d.n == 0 || d.h == 0) return;
  dispatch_float(tokens.dtype(), [&]<typename T>() {
    auto launch = [&]<int N>() {
      gather_rows_kernel<T, N><<<row_grid(d.n), kRowBlock, 0, stream_of(ctx)>>>(
          dev_ptr<const T>(tokens), dev_ptr<const int32_t>(perm.sorted_indices), d.n, d.h, dev_ptr<T>(permuted));
    };
    if (pack_of<T>(d.h, {tokens.raw_data(), permuted.raw_data()}) > 1) {
      launch.template operator()<int(16 / sizeof(T))>();
    } else {
      launch.template operator()<1>();
    }
  });
  CUDA_CHECK_LAUNCH();
}

void moe_permute_backward(Context& ctx, const Tensor& grad_permuted, const MoePermutation& perm,
                          Tensor& grad_tokens) {
  check_perm(perm, grad_permuted, grad_tokens);
  gather_sum_rows(ctx, grad_permuted, nullptr, perm, grad_tokens);
}

void moe_unpermute_forward(Context& ctx, const Tensor& permuted, const Tensor& probs_permuted,
                           const MoePermutation& perm, Tensor& out) {
  const PermDims d = check_perm(perm, permuted, out);
  if (probs_permuted.defined()) check_fp32(probs_permuted, d.n, "probs_permuted");
  gather_sum_rows(ctx, permuted, probs_permuted.defined() ? dev_ptr<const float>(probs_permuted) : nullptr, perm,
                  out);
}

void moe_unpermute_backward(Context& ctx, const Tensor& grad_out, const Tensor& permuted, const Tensor& probs_permuted,
                            const MoePermutation& perm, Tensor& grad_permuted, Tensor& grad_probs_permuted) {
  const PermDims d = check_perm(perm, permuted, grad_out);
  const bool weighted = probs_permuted.defined();
  if (weighted) check_fp32(probs_permuted, d.n, "probs_permuted");
  if (grad_permuted.defined()) {
    check_float_cuda(grad_permuted, "grad_permuted");
    MG_ASSERT(grad_permuted.numel() == d.n * d.h && grad_permuted.dtype() == grad_out.dtype(),
              "grad_permuted is {}, expected {} [{}, {}]", grad_permuted.str(), to_string(grad_out.dtype()), d.n, d.h);
  }
  Tensor gp = weighted ? grad_probs_permuted : Tensor();
  if (gp.defined()) check_fp32(gp, d.n, "grad_probs_permuted");
  scaled_rows_and_dots(ctx, grad_out, dev_ptr<const int32_t>(perm.sorted_indices), permuted,
                       weighted ? dev_ptr<const float>(probs_permuted) : nullptr, d.n, d.h, grad_permuted, gp);
}

void moe_permute_probs_forward(Context& ctx, const Tensor& probs, const MoePermutation& perm, Tensor& probs_permuted) {
  const int64_t n = perm.rows(), e = perm.num_experts;
  check_fp32(probs, perm.num_tokens * e, "probs");
  check_fp32(probs_permuted, n, "probs_permuted");
  if (n == 0) return;
  permute_probs_kernel<<<grid_for(n), kBlockSize, 0, stream_of(ctx)>>>(
      dev_ptr<const float>(probs), dev_ptr<const int32_t>(perm.sorted_indices),
      dev_ptr<const int32_t>(perm.row_expert), n, int(e), dev_ptr<float>(probs_permuted));
  CUDA_CHECK_LAUNCH();
}

void moe_permute_probs_backward(Context& ctx, const Tensor& grad_probs_permuted, const MoePermutation& perm,
                                Tensor& grad_probs) {
  const int64_t n = perm.rows(), total = perm.num_tokens * perm.num_experts;
  check_fp32(grad_probs_permuted, n, "grad_probs_permuted");
  check_fp32(grad_probs, total, "grad_probs");
  if (total == 0) return;
  permute_probs_backward_kernel<<<grid_for(total), kBlockSize, 0, stream_of(ctx)>>>(
      dev_ptr<const float>(grad_probs_permuted), dev_ptr<const int32_t>(perm.token_rows), total,
      dev_ptr<float>(grad_probs));
  CUDA_CHECK_LAUNCH();
}

// ---- row scaling ------------------------------------------------------------------------------------

void moe_scale_rows_forward(Context& ctx, const Tensor& x, const Tensor& probs, Tensor& out) {
  check_float_cuda(x, "x");
  check_float_cuda(out, "out");
  const int64_t n = probs.numel(), c = n == 0 ? 0 : x.numel() / n;
  check_fp32(probs, n, "probs");
  MG_ASSERT(x.numel() == n * c && out.numel() == n * c && out.dtype() == x.dtype(),
            "moe_scale_rows: x {} and out {} for {} probabilities", x.str(), out.str(), n);
  if (n * c == 0) return;
  dispatch_float(x.dtype(), [&]<typename T>() {
    auto launch = [&]<int N>() {
      scale_rows_kernel<T, N><<<grid_for(n * c / N), kBlockSize, 0, stream_of(ctx)>>>(
          dev_ptr<const T>(x), dev_ptr<const float>(probs), n, c, dev_ptr<T>(out));
    };
    if (pack_of<T>(c, {x.raw_data(), out.raw_data()}) > 1) {
      launch.template operator()<int(16 / sizeof(T))>();
    } else {
      launch.template operator()<1>();
    }
  });
  CUDA_CHECK_LAUNCH();
}

void moe_scale_rows_backward(Context& ctx, const Tensor& grad_out, const Tensor& x, const Tensor& probs,
                             Tensor& grad_x, Tensor& grad_probs) {
  check_float_cuda(grad_out, "grad_out");
  const int64_t n = probs.numel(), c = n == 0 ? 0 : grad_out.numel() / n;
  check_fp32(probs, n, "probs");
  if (grad_x.defined()) {
    check_float_cuda(grad_x, "grad_x");
    MG_ASSERT(grad_x.numel() == n * c && grad_x.dtype() == grad_out.dtype(), "grad_x is {}, expected {} like {}",
              grad_x.str(), n * c, grad_out.str());
  }
  if (grad_probs.defined()) {
    check_fp32(grad_probs, n, "grad_probs");
    check_float_cuda(x, "x");
    MG_ASSERT(x.numel() == n * c && x.dtype() == grad_out.dtype(), "x is {}, expected {} like {}", x.str(), n * c,
              grad_out.str());
  }
  scaled_rows_and_dots(ctx, grad_out, nullptr, x, dev_ptr<const float>(probs), n, c, grad_x, grad_probs);
}

// ---- the grouped experts' biases ----------------------------------------------------------------------
// Up to kBiasExperts experts per launch, their bias pointers and first rows passed by value (no
// host-to-device copy: a CUDA graph captures the launch). Forward: blockIdx.y is the expert, the
// blocks of x stride over its rows' elements. Backward: one thread per (expert, column) sums the
// expert's rows in row order (the CPU's order, no atomics); one warp per row gives grad_probs.

namespace {

constexpr int kBiasExperts = 64;

struct GroupedBias {
  const void* bias[kBiasExperts];
  float* grad[kBiasExperts];
  int64_t first[kBiasExperts + 1];
};

template <typename T>
__global__ void grouped_bias_forward_kernel(T* __restrict__ y, GroupedBias g, const float* __restrict__ probs,
                                            int64_t c) {
  const int e = blockIdx.y;
  const T* b = static_cast<const T*>(g.bias[e]);
  const int64_t begin = g.first[e] * c, end = g.first[e + 1] * c;
  for (int64_t i = begin + int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < end;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float s = probs ? probs[i / c] : 1.0f;
    y[i] = store_float<T>(load_float(y[i]) + __fmul_rn(s, load_float(b[i % c])));  // no FMA: the CPU's rounding
  }
}

template <typename T>
__global__ void grouped_bias_grad_kernel(const T* __restrict__ g_out, GroupedBias g, const float* __restrict__ probs,
                                         int64_t c) {
  const int e = blockIdx.y;
  const int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= c) return;
  float sum = 0.0f;
  for (int64_t r = g.first[e]; r < g.first[e + 1]; ++r) sum += (probs ? probs[r] : 1.0f) * load_float(g_out[r * c + j]);
  g.grad[e][j] += sum;
}

template <typename T>
__global__ void grouped_bias_dots_kernel(const T* __restrict__ g_out, GroupedBias g, int experts, int64_t c,
                                         float* __restrict__ grad_probs) {
  const int64_t row = g.first[0] + (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= g.first[experts]) return;  // whole warps leave together (a warp is one row)
  int e = 0;
  while (g.first[e + 1] <= row) ++e;
  const T* b = static_cast<const T*>(g.bias[e]);
  float dot = 0.0f;
  for (int64_t j = lane; j < c; j += 32) dot += load_float(g_out[row * c + j]) * load_float(b[j]);
  for (int o = 16; o > 0; o /= 2) dot += __shfl_down_sync(0xffffffffu, dot, o);
  if (lane == 0) grad_probs[row] += dot;
}

// Checks the arguments of moe_grouped_bias_* and calls f(chunk, experts in it) per chunk of experts.
template <typename F>
void for_bias_chunks(const Tensor& y, const std::vector<Tensor>& biases, const std::vector<int64_t>& rows,
                     const std::vector<Tensor>* grads, const Tensor& probs, F&& f) {
  check_float_cuda(y, "y");
  MG_ASSERT(y.dim() == 2 && biases.size() == rows.size() && (!grads || grads->size() == rows.size()),
            "moe_grouped_bias: y {} with {} biases for {} experts", y.str(), biases.size(), rows.size());
  const int64_t c = y.size(1);
  int64_t row = 0;
  for (size_t e0 = 0; e0 < rows.size(); e0 += kBiasExperts) {
    GroupedBias g{};
    const int n = int(std::min<size_t>(kBiasExperts, rows.size() - e0));
    for (int k = 0; k < n; ++k) {
      const Tensor& b = biases[e0 + k];
      MG_ASSERT(b.defined() && b.numel() == c && b.dtype() == y.dtype() && b.device() == y.device(),
                "moe_grouped_bias: expert {}'s bias {} for rows of {}", e0 + k, b.defined() ? b.str() : "-", y.str());
      g.bias[k] = b.raw_data();
      if (grads) {
        check_fp32((*grads)[e0 + k], c, "bias_grads");
        g.grad[k] = dev_ptr<float>((*grads)[e0 + k]);
      }
      g.first[k] = row;
      row += rows[e0 + k];
    }
    g.first[n] = row;
    f(g, n);
  }
  MG_ASSERT(row == y.size(0), "moe_grouped_bias: {} rows over the experts for {}", row, y.str());
  if (probs.defined()) check_fp32(probs, row, "probs");
}

}  // namespace

void moe_grouped_bias_forward(Context& ctx, Tensor& y, const std::vector<Tensor>& biases,
                              const std::vector<int64_t>& rows_per_expert, const Tensor& probs) {
  const int64_t c = y.dim() == 2 ? y.size(1) : 0;
  const float* p = probs.defined() ? dev_ptr<const float>(probs) : nullptr;
  for_bias_chunks(y, biases, rows_per_expert, nullptr, probs, [&](const GroupedBias& g, int n) {
    int64_t most = 0;
    for (int k = 0; k < n; ++k) most = std::max(most, (g.first[k + 1] - g.first[k]) * c);
    if (most == 0) return;
    const dim3 grid(unsigned(std::min<int64_t>((most + kBlockSize - 1) / kBlockSize, 1024)), unsigned(n));
    dispatch_float(y.dtype(), [&]<typename T>() {
      grouped_bias_forward_kernel<T><<<grid, kBlockSize, 0, stream_of(ctx)>>>(dev_ptr<T>(y), g, p, c);
    });
    CUDA_CHECK_LAUNCH();
  });
}

void moe_grouped_bias_backward(Context& ctx, const Tensor& grad_out, const std::vector<Tensor>& biases,
                               const std::vector<int64_t>& rows_per_expert, const Tensor& probs,
                               const std::vector<Tensor>& bias_grads, Tensor& grad_probs) {
  const int64_t c = grad_out.dim() == 2 ? grad_out.size(1) : 0;
  MG_ASSERT(!grad_probs.defined() || probs.defined(), "moe_grouped_bias_backward: grad_probs without probs");
  const float* p = probs.defined() ? dev_ptr<const float>(probs) : nullptr;
  if (grad_probs.defined()) check_fp32(grad_probs, grad_out.dim() == 2 ? grad_out.size(0) : 0, "grad_probs");
  for_bias_chunks(grad_out, biases, rows_per_expert, &bias_grads, probs, [&](const GroupedBias& g, int n) {
    if (c == 0) return;
    const int64_t rows = g.first[n] - g.first[0];
    dispatch_float(grad_out.dtype(), [&]<typename T>() {
      const dim3 grid(unsigned((c + kBlockSize - 1) / kBlockSize), unsigned(n));
      grouped_bias_grad_kernel<T><<<grid, kBlockSize, 0, stream_of(ctx)>>>(dev_ptr<const T>(grad_out), g, p, c);
      CUDA_CHECK_LAUNCH();
      if (grad_probs.defined() && rows > 0) {
        // one warp per row of this chunk of experts, [first[0], first[n])
        const int64_t warps = rows;
        grouped_bias_dots_kernel<T><<<grid_for(warps * 32), kBlockSize, 0, stream_of(ctx)>>>(
            dev_ptr<const T>(grad_out), g, n, c, dev_ptr<float>(grad_probs));
        CUDA_CHECK_LAUNCH();
      }
    });
  });
}

}  // namespace megatron::cuda
