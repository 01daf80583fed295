// The optimizer ops on CUDA: the AdamW update, gradient statistics and in-place scaling — the fast
// path of kernels/cpu/optimizer.cpp.
//
// adamw_step_fp32_master does the CPU reference's arithmetic in the same order with explicitly
// rounded intrinsics (__fmul_rn, ...), so nvcc cannot contract it into FMAs and the result matches
// the CPU bit for bit. It reads 4 floats per access when every pointer is 16-byte aligned, and
// copies the new value into the bf16/fp16/fp32 model parameter in the same pass.
// grad_stats is a two-stage reduction (per-block partials, then one block in a fixed order, so it
// is deterministic) of Σg² in fp64, the inf/nan flag and the zero count; it synchronises the
// stream to return the values on the host.
#include <cmath>

#include "megatron/kernels/cuda/cuda_common.cuh"
#include "megatron/kernels/cuda/cuda_ops.h"

namespace megatron::cuda {

namespace {

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// ---- AdamW -------------------------------------------------------------------------------------

struct AdamConsts {
  float b1, b2, one_minus_b1, one_minus_b2, lr, lr_wd, eps, inv_bc1, inv_bc2, grad_scale;
};

// The CPU reference's expression order, each operation rounded on its own.
__device__ __forceinline__ void adam_update(float& p, float grad, float& m, float& v, const AdamConsts& c) {
  const float g = __fmul_rn(grad, c.grad_scale);
  m = __fadd_rn(__fmul_rn(c.b1, m), __fmul_rn(c.one_minus_b1, g));
  v = __fadd_rn(__fmul_rn(c.b2, v), __fmul_rn(__fmul_rn(c.one_minus_b2, g), g));
  const float update = __fdiv_rn(__fmul_rn(m, c.inv_bc1), __fadd_rn(__fsqrt_rn(__fmul_rn(v, c.inv_bc2)), c.eps));
  const float decayed = __fsub_rn(p, __fmul_rn(c.lr_wd, p));
  p = __fsub_rn(decayed, __fmul_rn(c.lr, update));
}

// Updates elements [begin, end) of one tensor as thread `first` of `stride` threads; model may be
// null (no copy-back). kVec: begin is a multiple of 4 and every pointer is aligned for 4-element
// accesses (float4 up to the last multiple of 4, then one element at a time).
template <typename M, bool kVec>
__device__ __forceinline__ void adam_range(float* __restrict__ param, const float* __restrict__ grad,
                                           float* __restrict__ exp_avg, float* __restrict__ exp_avg_sq, M* model,
                                           int64_t begin, int64_t end, int64_t first, int64_t stride,
                                           const AdamConsts& c) {
  int64_t done = begin;
  if constexpr (kVec) {
    const int64_t end4 = begin + (end - begin) / 4 * 4;
    for (int64_t i = begin / 4 + first; i < end4 / 4; i += stride) {
      float4 p = reinterpret_cast<float4*>(param)[i];
      const float4 g = reinterpret_cast<const float4*>(grad)[i];
      float4 m = reinterpret_cast<float4*>(exp_avg)[i];
      float4 v = reinterpret_cast<float4*>(exp_avg_sq)[i];
      adam_update(p.x, g.x, m.x, v.x, c);
      adam_update(p.y, g.y, m.y, v.y, c);
      adam_update(p.z, g.z, m.z, v.z, c);
      adam_update(p.w, g.w, m.w, v.w, c);
      reinterpret_cast<float4*>(param)[i] = p;
      reinterpret_cast<float4*>(exp_avg)[i] = m;
      reinterpret_cast<float4*>(exp_avg_sq)[i] = v;
      if (model != nullptr) {
        Vec<M, 4> out;
        out.v[0] = store_float<M>(p.x);
        out.v[1] = store_float<M>(p.y);
        out.v[2] = store_float<M>(p.z);
        out.v[3] = store_float<M>(p.w);
        reinterpret_cast<Vec<M, 4>*>(model)[i] = out;
      }
    }
    done = end4;
  }
  for (int64_t i = done + first; i < end; i += stride) {
    float p = param[i], m = exp_avg[i], v = exp_avg_sq[i];
    adam_update(p, grad[i], m, v, c);
    param[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if (model != nullptr) model[i] = store_float<M>(p);
  }
}

template <typename M, bool kVec>
__global__ void adamw_step_fp32_master_kernel(float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
                                              M* model, int64_t n, AdamConsts c) {
  adam_range<M, kVec>(param, grad, exp_avg, exp_avg_sq, model, 0, n, blockIdx.x * int64_t(blockDim.x) + threadIdx.x,
                      int64_t(gridDim.x) * blockDim.x, c);
}

// Note [Multi-tensor AdamW]: adamw_step_multi updates many parameters per launch, as Megatron's
// multi_tensor_apply does: block b updates chunk b (kMultiChunk elements) of one of the launch's
// tensors, named in the kernel's argument block (a __grid_constant__ struct, read in place). A
// model with a few hundred parameters takes tens of launches instead of one per parameter (the
// small ones — norms, biases — were launches of a few microseconds each), with the same
// arithmetic (adam_update), so the values are adamw_step's bit for bit.
constexpr int kMultiMaxTensors = 96;
constexpr int kMultiMaxChunks = 2048;
constexpr int64_t kMultiChunk = 65536;

template <typename M>
struct MultiAdamArgs {
  float* param[kMultiMaxTensors];
  const float* grad[kMultiMaxTensors];
  float* exp_avg[kMultiMaxTensors];
  float* exp_avg_sq[kMultiMaxTensors];
  M* model[kMultiMaxTensors];  // null: no copy-back
  int64_t n[kMultiMaxTensors];
  float lr_wd[kMultiMaxTensors];
  uint8_t tensor[kMultiMaxChunks];
  int32_t chunk[kMultiMaxChunks];
};
static_assert(sizeof(MultiAdamArgs<float>) < 32000, "kernel arguments are limited to 32 KB");

template <typename M, bool kVec>
__global__ void adamw_multi_kernel(const __grid_constant__ MultiAdamArgs<M> a, AdamConsts c) {
  const int t = a.tensor[blockIdx.x];
  const int64_t start = int64_t(a.chunk[blockIdx.x]) * kMultiChunk;  // a multiple of 4
  c.lr_wd = a.lr_wd[t];
  adam_range<M, kVec>(a.param[t], a.grad[t], a.exp_avg[t], a.exp_avg_sq[t], a.model[t], start,
                      min(start + kMultiChunk, a.n[t]), threadIdx.x, blockDim.x, c);
}

// ---- grad_stats --------------------------------------------------------------------------------

struct StatsPartial {
  double sum_sq;
  unsigned long long zeros;
  unsigned int bad;
};

constexpr int kStatsThreads = 256;
constexpr int kStatsMaxBlocks = 1024;

__device__ __forceinline__ void stats_add(StatsPartial& s, float x) {
  const double d = x;
  s.sum_sq += d * d;
  s.bad |= isfinite(x) ? 0u : 1u;
  s.zeros += x == 0.0f ? 1ull : 0ull;
}

// Reduces one StatsPartial per thread of a kStatsThreads block; thread 0 gets the total.
__device__ StatsPartial block_reduce_stats(StatsPartial s) {
  __shared__ StatsPartial warp_sums[kStatsThreads / 32];
  for (int off = 16; off > 0; off /= 2) {
    s.sum_sq += __shfl_down_sync(0xffffffffu, s.sum_sq, off);
    s.zeros += __shfl_down_sync(0xffffffffu, s.zeros, off);
    s.bad |= __shfl_down_sync(0xffffffffu, s.bad, off);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_sums[warp] = s;
  __syncthreads();
  if (warp == 0) {
    s = lane < kStatsThreads / 32 ? warp_sums[lane] : StatsPartial{0.0, 0ull, 0u};
    for (int off = 16; off > 0; off /= 2) {
      s.sum_sq += __shfl_down_sync(0xffffffffu, s.sum_sq, off);
      s.zeros += __shfl_down_sync(0xffffffffu, s.zeros, off);
      s.bad |= __shfl_down_sync(0xffffffffu, s.bad, off);
    }
  }
  return s;
}

template <bool kVec>
__global__ void __launch_bounds__(kStatsThreads) grad_stats_partial_kernel(const float* __restrict__ g, int64_t n,
                                                                            StatsPartial* partials) {
  StatsPartial s{0.0, 0ull, 0u};
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t tid = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  int64_t done = 0;
  if constexpr (kVec) {
    const int64_t n4 = n / 4;
    for (int64_t i = tid; i < n4; i += stride) {
      const float4 x = reinterpret_cast<const float4*>(g)[i];
      stats_add(s, x.x);
      stats_add(s, x.y);
      stats_add(s, x.z);
      stats_add(s, x.w);
    }
    done = n4 * 4;
  }
  for (int64_t i = done + tid; i < n; i += stride) stats_add(s, g[i]);
  s = block_reduce_stats(s);
  if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

__global__ void __launch_bounds__(kStatsThreads) grad_stats_finish_kernel(const StatsPartial* partials, int count,
                                                                           StatsPartial* result) {
  StatsPartial s{0.0, 0ull, 0u};
  for (int i = threadIdx.x; i < count; i += blockDim.x) {
    s.sum_sq += partials[i].sum_sq;
    s.zeros += partials[i].zeros;
    s.bad |= partials[i].bad;
  }
  s = block_reduce_stats(s);
  if (threadIdx.x == 0) *result = s;
}

// ---- scale_ ------------------------------------------------------------------------------------

template <typename T, bool kVec>
__global__ void scale_kernel(T* x, int64_t n, float s) {
  constexpr int kN = 16 / sizeof(T);
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t tid = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  int64_t done = 0;
  if constexpr (kVec) {
    const int64_t nv = n / kN;
    auto* xv = reinterpret_cast<Vec<T, kN>*>(x);
    for (int64_t i = tid; i < nv; i += stride) {
      Vec<T, kN> v = xv[i];
#pragma unroll
      for (int j = 0; j < kN; ++j) v.v[j] = store_float<T>(__fmul_rn(load_float(v.v[j]), s));
      xv[i] = v;
    }
    done = nv * kN;
  }
  for (int64_t i = done + tid; i < n; i += stride) x[i] = store_float<T>(__fmul_rn(load_float(x[i]), s));
}

// The same host arithmetic as the CPU reference, so the constants are identical.
AdamConsts adam_consts(const AdamHyperParams& hp) {
  const double bc1 = hp.bias_correction ? 1.0 - std::pow(double(hp.beta1), double(hp.step)) : 1.0;
  const double bc2 = hp.bias_correction ? 1.0 - std::pow(double(hp.beta2), double(hp.step)) : 1.0;
  AdamConsts c;
  c.b1 = hp.beta1;
  c.b2 = hp.beta2;
  c.one_minus_b1 = 1.0f - hp.beta1;
  c.one_minus_b2 = 1.0f - hp.beta2;
  c.lr = hp.lr;
  c.lr_wd = hp.lr * hp.weight_decay;
  c.eps = hp.eps;
  c.inv_bc1 = float(1.0 / bc1);
  c.inv_bc2 = float(1.0 / bc2);
  c.grad_scale = hp.grad_scale;
  return c;
}

}  // namespace

void adamw_step(Context& ctx, Tensor& main_param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                const AdamHyperParams& hp, Tensor& model_param) {
  check_cuda(main_param, "main_param");
  const int64_t n = main_param.numel();
  check_fp32(main_param, n, "main_param");
  check_fp32(grad, n, "grad");
  check_fp32(exp_avg, n, "exp_avg");
  check_fp32(exp_avg_sq, n, "exp_avg_sq");
  const bool copy_back = model_param.defined() && model_param.raw_data() != main_param.raw_data();
  if (model_param.defined()) {
    check_cuda(model_param, "model_param");
    MG_ASSERT(model_param.numel() == n, "model_param is {}, expected {} elements", model_param.str(), n);
  }
  MG_ASSERT(hp.step >= 1, "adamw_step: step is {}, it counts from 1", hp.step);
  if (n == 0) return;

  const AdamConsts c = adam_consts(hp);

  const DType model_dtype = copy_back ? model_param.dtype() : DType::Float32;
  dispatch_float(model_dtype, [&]<typename M>() {
    M* model = copy_back ? dev_ptr<M>(model_param) : nullptr;
    const bool vec = aligned(main_param.raw_data(), 16) && aligned(grad.raw_data(), 16) &&
                     aligned(exp_avg.raw_data(), 16) && aligned(exp_avg_sq.raw_data(), 16) &&
                     (model == nullptr || aligned(model, 4 * sizeof(M)));
    const unsigned grid = grid_for(vec ? (n + 3) / 4 : n);
    auto* p = dev_ptr<float>(main_param);
    auto* g = dev_ptr<const float>(grad);
    auto* m = dev_ptr<float>(exp_avg);
    auto* v = dev_ptr<float>(exp_avg_sq);
    if (vec) {
      adamw_step_fp32_master_kernel<M, true><<<grid, kBlockSize, 0, stream_of(ctx)>>>(p, g, m, v, model, n, c);
    } else {
      adamw_step_fp32_master_kernel<M, false><<<grid, kBlockSize, 0, stream_of(ctx)>>>(p, g, m, v, model, n, c);
    }
  });
  CUDA_CHECK_LAUNCH();
}

void adamw_step_multi(Context& ctx, std::vector<AdamTensors>& params, const AdamHyperParams& hp) {
  MG_ASSERT(hp.step >= 1, "adamw_step_multi: step is {}, it counts from 1", hp.step);
  // The copy-back dtype of the launches: the first model parameter's; an entry with another one
  // (none in a model: every parameter has the model's dtype) takes adamw_step on its own.
  DType model_dtype = DType::Float32;
  auto copies_back = [](const AdamTensors& t) {
    return t.model_param.defined() && t.model_param.raw_data() != t.main_param.raw_data();
  };
  for (const AdamTensors& t : params) {
    if (copies_back(t)) {
      model_dtype = t.model_param.dtype();
      break;
    }
  }
  std::vector<const AdamTensors*> groups[2];  // [0]: every pointer 16-byte aligned, [1]: not
  for (AdamTensors& t : params) {
    const int64_t n = t.main_param.numel();
    check_fp32(t.main_param, n, "main_param");
    check_fp32(t.grad, n, "grad");
    check_fp32(t.exp_avg, n, "exp_avg");
    check_fp32(t.exp_avg_sq, n, "exp_avg_sq");
    if (t.model_param.defined()) {
      check_cuda(t.model_param, "model_param");
      MG_ASSERT(t.model_param.numel() == n, "model_param is {}, expected {} elements", t.model_param.str(), n);
    }
    if (n == 0) continue;
    if (copies_back(t) && t.model_param.dtype() != model_dtype) {
      AdamHyperParams h = hp;
      h.weight_decay = t.weight_decay;
      adamw_step(ctx, t.main_param, t.grad, t.exp_avg, t.exp_avg_sq, h, t.model_param);
      continue;
    }
    const size_t model_align = 4 * size_of(model_dtype);
    const bool vec = aligned(t.main_param.raw_data(), 16) && aligned(t.grad.raw_data(), 16) &&
                     aligned(t.exp_avg.raw_data(), 16) && aligned(t.exp_avg_sq.raw_data(), 16) &&
                     (!copies_back(t) || aligned(t.model_param.raw_data(), model_align));
    groups[vec ? 0 : 1].push_back(&t);
  }
  const AdamConsts c = adam_consts(hp);
  dispatch_float(model_dtype, [&]<typename M>() {
    for (int g = 0; g < 2; ++g) {
      MultiAdamArgs<M> args{};
      int nt = 0, nc = 0;
      auto launch = [&] {
        if (nc > 0) {
          if (g == 0) {
            adamw_multi_kernel<M, true><<<unsigned(nc), kBlockSize, 0, stream_of(ctx)>>>(args, c);
          } else {
            adamw_multi_kernel<M, false><<<unsigned(nc), kBlockSize, 0, stream_of(ctx)>>>(args, c);
          }
          CUDA_CHECK_LAUNCH();
        }
        nt = nc = 0;
      };
      auto set_tensor = [&](int i, const AdamTensors& t) {
        args.param[i] = dev_ptr<float>(t.main_param);
        args.grad[i] = dev_ptr<const float>(t.grad);
        args.exp_avg[i] = dev_ptr<float>(t.exp_avg);
        args.exp_avg_sq[i] = dev_ptr<float>(t.exp_avg_sq);
        args.model[i] = copies_back(t) ? dev_ptr<M>(t.model_param) : nullptr;
        args.n[i] = t.main_param.numel();
        args.lr_wd[i] = hp.lr * t.weight_decay;
      };
      for (const AdamTensors* t : groups[g]) {
        if (nt == kMultiMaxTensors) launch();
        set_tensor(nt, *t);
        const int64_t chunks = (t->main_param.numel() + kMultiChunk - 1) / kMultiChunk;
        for (int64_t k = 0; k < chunks; ++k) {
          if (nc == kMultiMaxChunks) {  // a full launch; this tensor goes on at slot 0 of the next
            launch();
            set_tensor(0, *t);
          }
          args.tensor[nc] = uint8_t(nt);
          args.chunk[nc] = int32_t(k);
          ++nc;
        }
        ++nt;
      }
      launch();
    }
  });
}

GradStats grad_stats(Context& ctx, const Tensor& grad) {
  check_cuda(grad, "grad");
  MG_ASSERT(grad.dtype() == DType::Float32, "grad must be fp32, got {}", grad.str());
  GradStats out;
  const int64_t n = grad.numel();
  if (n == 0) return out;
  const bool vec = aligned(grad.raw_data(), 16);
  const int blocks = int(grid_for(vec ? (n + 3) / 4 : n, kStatsThreads, kStatsMaxBlocks));
  Tensor ws = ctx.workspace(size_t(blocks + 1) * sizeof(StatsPartial));
  auto* partials = static_cast<StatsPartial*>(ws.raw_data());
  const auto* g = dev_ptr<const float>(grad);
  if (vec) {
    grad_stats_partial_kernel<true><<<blocks, kStatsThreads, 0, stream_of(ctx)>>>(g, n, partials);
  } else {
    grad_stats_partial_kernel<false><<<blocks, kStatsThreads, 0, stream_of(ctx)>>>(g, n, partials);
  }
  CUDA_CHECK_LAUNCH();
  grad_stats_finish_kernel<<<1, kStatsThreads, 0, stream_of(ctx)>>>(partials, blocks, partials + blocks);
  CUDA_CHECK_LAUNCH();
  StatsPartial host{};
  CUDA_CHECK(cudaMemcpyAsync(&host, partials + blocks, sizeof(host), cudaMemcpyDeviceToHost, stream_of(ctx)));
  CUDA_CHECK(cudaStreamSynchronize(stream_of(ctx)));
  out.sum_sq = host.sum_sq;
  out.found_inf_or_nan = host.bad != 0;
  out.num_zeros = int64_t(host.zeros);
  return out;
}

void scale_(Context& ctx, Tensor& x, float s) {
  check_cuda(x, "x");
  const int64_t n = x.numel();
  if (n == 0) return;
  dispatch_float(x.dtype(), [&]<typename T>() {
    constexpr int kN = 16 / sizeof(T);
    const bool vec = aligned(x.raw_data(), 16);
    const unsigned grid = grid_for(vec ? (n + kN - 1) / kN : n);
    if (vec) {
      scale_kernel<T, true><<<grid, kBlockSize, 0, stream_of(ctx)>>>(dev_ptr<T>(x), n, s);
    } else {
      scale_kernel<T, false><<<grid, kBlockSize, 0, stream_of(ctx)>>>(dev_ptr<T>(x), n, s);
    }
  });
  CUDA_CHECK_LAUNCH();
}

}  // namespace megatron::cuda
