// Cross-entropy loss and the masked token mean, CUDA fast path (reference: kernels/cpu/cross_entropy.cpp).
//
// logits [N, V] (V up to ~256k), one block per row:
//   forward   one pass of an online log-sum-exp: each thread keeps (max, Σ exp(x - max)) in fp32 over
//             16-byte packs, rescaling once per pack; the pairs are merged across the block.
//   backward  grad = (exp(x - lse) - [v == label])·grad_losses[n] in one pass; grad_logits may alias
//             logits (each thread reads its pack before writing it, so no __restrict__ there).
// A label outside [0, V) is the user's mistake: the forward records the first bad row with atomicMin,
// syncs and throws megatron::Error naming it, as the CPU does (Note [Device-side id checks] in
// embedding.cu). The backward trusts the labels its forward checked; a bad one there is skipped, never
// read or written out of bounds.
// masked_loss_sums reduces in one block in fp64, in a fixed order (deterministic).
#include <algorithm>
#include <cmath>

#include "megatron/kernels/cuda/cuda_common.cuh"
#include "megatron/kernels/cuda/cuda_ops.h"
#include "megatron/kernels/ops.h"

namespace megatron::cuda {

namespace {

constexpr int kMaxRowThreads = 512;
constexpr int kSumThreads = 1024;


struct Labels {
  const void* data = nullptr;
  bool is64 = false;
  __device__ __forceinline__ int64_t operator[](int64_t i) const {
    return is64 ? static_cast<const int64_t*>(data)[i] : int64_t(static_cast<const int32_t*>(data)[i]);
  }
};

// A running log-sum-exp: max m and Σ exp(x - m).
struct MaxSum {
  float m, s;
};

__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.0f};
  return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
}

// Merges every thread's pair (blockDim.x a multiple of 32); the result is valid in every thread.
__device__ MaxSum block_merge(MaxSum v) {
  __shared__ MaxSum shared[32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = merge(v, {__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o)});
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < int(blockDim.x >> 5) ? shared[lane] : MaxSum{-INFINITY, 0.0f};
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = merge(v, {__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o)});
  return v;
}

template <typename T, int VEC>
__global__ void cross_entropy_forward_kernel(const T* __restrict__ logits, Labels labels, int64_t V,
                                             float* __restrict__ losses, float* __restrict__ lse,
                                             unsigned long long* bad_row) {
  const int64_t row = blockIdx.x;
  const T* xr = logits + row * V;
  MaxSum acc{-INFINITY, 0.0f};
  for (int64_t c = int64_t(threadIdx.x) * VEC; c < V; c += int64_t(blockDim.x) * VEC) {
    float v[VEC];
    load_pack<VEC>(xr + c, v);
    float pm = v[0];
#pragma unroll
    for (int k = 1; k < VEC; ++k) pm = fmaxf(pm, v[k]);
    if (pm == -INFINITY) continue;  // exp(-inf) adds nothing
    if (pm > acc.m) {
      acc.s *= expf(acc.m - pm);
      acc.m = pm;
    }
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc.s += expf(v[k] - acc.m);
  }
  acc = block_merge(acc);
  if (threadIdx.x != 0) return;
  const int64_t label = labels[row];
  if (label < 0 || label >= V) {
    atomicMin(bad_row, static_cast<unsigned long long>(row));
    return;
  }
  const float l = acc.m + logf(acc.s);
  losses[row] = l - load_float(xr[label]);
  if (lse) lse[row] = l;
}

// sums = {Σ loss·mask, Σ mask} (mask null: all ones), in one block, fp64, fixed order.
template <typename L, typename M>
__global__ void masked_loss_sums_kernel(const L* __restrict__ losses, const M* __restrict__ mask, int64_t n,
                                        float* __restrict__ sums) {
  __shared__ double sw[32], sc[32];
  double w = 0.0, cnt = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const double m = mask ? double(load_float(mask[i])) : 1.0;
    w += double(load_float(losses[i])) * m;
    cnt += m;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    w += __shfl_xor_sync(0xffffffffu, w, o);
    cnt += __shfl_xor_sync(0xffffffffu, cnt, o);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    sw[warp] = w;
    sc[warp] = cnt;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  double tw = 0.0, tc = 0.0;
  for (int k = 0; k < int(blockDim.x >> 5); ++k) {
    tw += sw[k];
    tc += sc[k];
  }
  sums[0] = float(tw);
  sums[1] = float(tc);
}

template <typename M>
__global__ void masked_loss_backward_kernel(const M* __restrict__ mask, float scale, int64_t n,
                                            float* __restrict__ grad) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    grad[i] = mask ? load_float(mask[i]) * scale : scale;
}

// The same with factor = scale[0] / sums[1] (0 when sums[1] is 0) read on the device.
template <typename M>
__global__ void masked_loss_backward_normalized_kernel(const M* __restrict__ mask, const float* __restrict__ sums,
                                                       const float* __restrict__ scale, int64_t n,
                                                       float* __restrict__ grad) {
  const float count = sums[1];
  const float factor = count > 0.0f ? scale[0] / count : 0.0f;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    grad[i] = mask ? load_float(mask[i]) * factor : factor;
}


struct Rows {
  int64_t n = 0, v = 0;
  Labels labels;
};

Rows check_logits(const Tensor& logits, const Tensor& labels) {
  check_cuda(logits, "logits");
  MG_ASSERT(logits.dim() >= 1 && is_floating(logits.dtype()), "logits must be float [N, V], got {}", logits.str());
  Rows r;
  r.v = logits.size(-1);
  r.n = r.v == 0 ? 0 : logits.numel() / r.v;
  check_cuda(labels, "labels");
  MG_ASSERT((labels.dtype() == DType::Int32 || labels.dtype() == DType::Int64) && labels.numel() == r.n,
            "labels {} do not match logits {} (expected int32/int64 [N])", labels.str(), logits.str());
  r.labels = Labels{labels.raw_data(), labels.dtype() == DType::Int64};
  return r;
}

// Calls f.template operator()<M>() with M the mask's CUDA type (float when the mask is undefined).
template <typename F>
void dispatch_mask(const Tensor& mask, F&& f) {
  if (!mask.defined()) return f.template operator()<float>();
  dispatch_float(mask.dtype(), std::forward<F>(f));
}

}  // namespace

void cross_entropy_forward(Context& ctx, const Tensor& logits, const Tensor& labels, Tensor& losses, Tensor& lse) {
  const Rows r = check_logits(logits, labels);
  check_fp32(losses, r.n, "losses");
  float* lse_out = nullptr;
  if (lse.defined()) {
    check_fp32(lse, r.n, "lse");
    lse_out = dev_ptr<float>(lse);
  }
  if (r.n == 0) return;
  MG_CHECK(r.v > 0, "cross entropy over an empty vocabulary: logits are {}", logits.str());
  cudaStream_t stream = stream_of(ctx);
  Tensor bad = Tensor::empty({1}, DType::Int64, ctx.device());
  auto* bad_row = static_cast<unsigned long long*>(bad.raw_data());
  CUDA_CHECK(cudaMemsetAsync(bad_row, 0xff, sizeof(unsigned long long), stream));
  dispatch_float(logits.dtype(), [&]<typename T>() {
    constexpr int kVec = 16 / sizeof(T);
    if (r.v % kVec == 0 && aligned16(logits.raw_data())) {
      cross_entropy_forward_kernel<T, kVec><<<unsigned(r.n), row_threads(r.v / kVec, kMaxRowThreads), 0, stream>>>(
          dev_ptr<T>(logits), r.labels, r.v, dev_ptr<float>(losses), lse_out, bad_row);
    } else {
      cross_entropy_forward_kernel<T, 1><<<unsigned(r.n), row_threads(r.v, kMaxRowThreads), 0, stream>>>(
          dev_ptr<T>(logits), r.labels, r.v, dev_ptr<float>(losses), lse_out, bad_row);
    }
  });
  CUDA_CHECK_LAUNCH();
  if (ctx.ids_checked_on_host()) return;  // Note [Host checks under capture] (embedding.cu)
  unsigned long long found = 0;
  CUDA_CHECK(cudaMemcpyAsync(&found, bad_row, sizeof(found), cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  if (found == ~0ull) return;
  const int64_t row = int64_t(found);
  ops::throw_bad_label(labels.flat_slice(row, 1).to_ints()[0], row, r.v);
}

void cross_entropy_backward(Context& ctx, const Tensor& grad_losses, const Tensor& logits, const Tensor& labels,
                            const Tensor& lse, Tensor& grad_logits) {
  check_logits(logits, labels);
  // The whole vocabulary is the one shard that starts at 0.
  vocab_parallel_cross_entropy_backward(ctx, grad_losses, logits, labels, 0, lse, grad_logits);
}

void masked_loss_sums(Context& ctx, const Tensor& losses, const Tensor& loss_mask, Tensor& sums) {
  check_cuda(losses, "losses");
  check_fp32(sums, 2, "sums");
  const int64_t n = losses.numel();
  if (loss_mask.defined()) {
    check_cuda(loss_mask, "loss_mask");
    MG_ASSERT(loss_mask.numel() == n, "loss_mask is {}, expected {} elements", loss_mask.str(), n);
  }
  cudaStream_t stream = stream_of(ctx);
  dispatch_float(losses.dtype(), [&]<typename L>() {
    dispatch_mask(loss_mask, [&]<typename M>() {
      const M* mask = loss_mask.defined() ? dev_ptr<M>(loss_mask) : nullptr;
      masked_loss_sums_kernel<L, M><<<1, kSumThreads, 0, stream>>>(dev_ptr<L>(losses), mask, n, dev_ptr<float>(sums));
    });
  });
  CUDA_CHECK_LAUNCH();
}

// Checks a loss gradient [N] fp32 and its mask; returns N.
static int64_t check_loss_gradient(const Tensor& loss_mask, const Tensor& grad_losses) {
  check_cuda(grad_losses, "grad_losses");
  MG_ASSERT(grad_losses.dtype() == DType::Float32, "grad_losses is {}, expected fp32", grad_losses.str());
  const int64_t n = grad_losses.numel();
  if (loss_mask.defined()) {
    check_cuda(loss_mask, "loss_mask");
    MG_ASSERT(loss_mask.numel() == n, "loss_mask is {}, expected {} elements", loss_mask.str(), n);
  }
  return n;
}

void masked_loss_backward(Context& ctx, const Tensor& loss_mask, float scale, Tensor& grad_losses) {
  const int64_t n = check_loss_gradient(loss_mask, grad_losses);
  if (n == 0) return;
  cudaStream_t stream = stream_of(ctx);
  dispatch_mask(loss_mask, [&]<typename M>() {
    const M* mask = loss_mask.defined() ? dev_ptr<M>(loss_mask) : nullptr;
    masked_loss_backward_kernel<M><<<grid_for(n), kBlockSize, 0, stream>>>(mask, scale, n, dev_ptr<float>(grad_losses));
  });
  CUDA_CHECK_LAUNCH();
}

void masked_loss_backward_normalized(Context& ctx, const Tensor& loss_mask, const Tensor& sums, const Tensor& scale,
                                     Tensor& grad_losses) {
  const int64_t n = check_loss_gradient(loss_mask, grad_losses);
  check_fp32(sums, 2, "sums");
  check_fp32(scale, 1, "scale");
  if (n == 0) return;
  cudaStream_t stream = stream_of(ctx);
  dispatch_mask(loss_mask, [&]<typename M>() {
    const M* mask = loss_mask.defined() ? dev_ptr<M>(loss_mask) : nullptr;
    masked_loss_backward_normalized_kernel<M><<<grid_for(n), kBlockSize, 0, stream>>>(
        mask, dev_ptr<float>(sums), dev_ptr<float>(scale), n, dev_ptr<float>(grad_losses));
  });
  CUDA_CHECK_LAUNCH();
}


namespace {

// One block per row: the first maximal column (ties to the lower index, as std::max_element), then
// Σ exp(double(x) - max) in fp64 — its order differs from the CPU's left-to-right sum only in the
// last bits of an fp64 value.
template <typename T>
__global__ void logits_summary_kernel(const T* logits, int64_t cols, int64_t vocab, int64_t* argmax, float* max_logit,
                                      int64_t* log_norm) {
  __shared__ float best_v[32];
  __shared__ int64_t best_i[32];
  __shared__ double partial[32];
  const T* row = logits + int64_t(blockIdx.x) * cols;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  float v = -INFINITY;
  int64_t idx = vocab;
  for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) {
    const float x = load_float(row[c]);
    if (x > v || (x == v && c < idx) || idx == vocab) v = x, idx = c;  // first index of the max (NaN: first seen)
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int64_t oi = __shfl_xor_sync(0xffffffffu, idx, o);
    if (ov > v || (ov == v && oi < idx)) v = ov, idx = oi;
  }
  if (lane == 0) best_v[warp] = v, best_i[warp] = idx;
  __syncthreads();
  float m = best_v[0];
  int64_t mi = best_i[0];
  for (int w = 1; w < warps; ++w)
    if (best_v[w] > m || (best_v[w] == m && best_i[w] < mi)) m = best_v[w], mi = best_i[w];
  double sum = 0;
  for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) sum += exp(double(load_float(row[c])) - double(m));
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if (lane == 0) partial[warp] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0;
    for (int w = 0; w < warps; ++w) total += partial[w];
    argmax[blockIdx.x] = mi;
    max_logit[blockIdx.x] = m;
    log_norm[blockIdx.x] = __double_as_longlong(log(total));
  }
}

}  // namespace

void logits_summary(Context& ctx, const Tensor& logits, int64_t vocab, Tensor& argmax, Tensor& max_logit,
                    Tensor& log_norm) {
  MG_ASSERT(logits.dim() == 2 && vocab > 0 && vocab <= logits.size(1), "logits_summary: logits {} for vocab {}",
            logits.str(), vocab);
  const int64_t n = logits.size(0);
  MG_ASSERT(argmax.dtype() == DType::Int64 && log_norm.dtype() == DType::Int64 && max_logit.dtype() == DType::Float32 &&
                argmax.numel() == n && max_logit.numel() == n && log_norm.numel() == n,
            "logits_summary: argmax {} (int64), max_logit {} (fp32), log_norm {} (int64) need {} entries", argmax.str(),
            max_logit.str(), log_norm.str(), n);
  if (n == 0) return;
  dispatch_float(logits.dtype(), [&]<typename T>() {
    logits_summary_kernel<T><<<unsigned(n), 512, 0, stream_of(ctx)>>>(dev_ptr<const T>(logits), logits.size(1), vocab,
                                                                     dev_ptr<int64_t>(argmax), dev_ptr<float>(max_logit),
                                                                     dev_ptr<int64_t>(log_norm));
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace megatron::cuda
