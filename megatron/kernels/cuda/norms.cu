// LayerNorm and RMSNorm over the last dimension, CUDA fast path (reference: kernels/cpu/norms.cpp).
//
// Forward: one block per row of x [N, h]. Statistics are fp32 and two-pass (μ, then Σ(x - μ)²), the
// row being re-read from L1/L2 rather than held, so any h works; loads are 16-byte vectors when h and
// the pointers allow, scalar otherwise. γ (weight, + 1 under zero_centered_gamma) and β are first
// converted into an fp32 scratch, so the row kernel is templated on the activation dtype only.
//
// Backward: one fused kernel (Note [Fused norm backward]) when a row fits in the registers of one
// block (≤ 1024 packs: h ≤ 8192 in 16-bit, ≤ 4096 in fp32, ≤ 1024 unvectorised), else the unfused
// fallback (a block per row for dx, then a column-tile kernel re-reading x and dy for the parameter
// grads). Bandwidth, GPT 1.3B (x [16384, 2048] bf16): the kernel must read x and dy and write dx,
// 3 × 67 MB = 201 MB, plus 131 KB of mean/rstd: 0.042 ms at the H200's 4.8 TB/s, ~0.05 ms at the
// ~4 TB/s a streaming kernel reaches. The partials add 2 × 264 × 2048 × 4 B = 4.3 MB written and
// read back (from L2) by the final kernel, ~2-3 µs. The previous version took ~0.165 ms: it read x
// and dy twice (the column-sum kernel re-read all 134 MB with scalar 2-byte loads, 64 bytes per warp
// and only ~8 rows in flight per block, latency-bound), and it converted γ through a scratch with
// an extra launch. Expected now ~0.055 ms per call (≈ 2.7 ms per step instead of 8.1).
//
// Note [Deterministic norm parameter grads]: dweight = Σ_rows dy·x̂ and dbias = Σ_rows dy are column
// sums. The first stage (the fused kernel, or the fallback's column-tile kernel) gives each block
// its own partial row in an fp32 scratch [parts, h] and sums its rows in a fixed order; a second
// kernel sums the partial rows in a fixed order and adds the result into the fp32 gradient
// (accumulation, never overwrite). No float atomics: the same bits on every run on a given device
// (the number of partial rows depends on the SM count).
#include <algorithm>

#include "megatron/kernels/cuda/cuda_common.cuh"
#include "megatron/kernels/cuda/cuda_ops.h"

namespace megatron::cuda {

namespace {

constexpr int kMaxRowThreads = 512;
constexpr int kColTile = 32;          // columns per parameter-grad block (one warp wide)
constexpr int kColRowThreads = 8;     // rows in flight per parameter-grad block
constexpr int kBwdMaxThreads = 512;   // fused backward: threads per block at most
constexpr int kBwdPacksInFlight = 4;  // fused backward: 16-byte loads of x (and of dy) per thread per step
constexpr int kBwdMaxPacksPerThread = 2;
constexpr int kBwdThreadsPerSm = 1024;  // target residency; more only multiplies the partial rows
constexpr int kMaxParamParts = 512;     // partial rows at most (the final kernel reads ≤ 16 per thread)
constexpr int kFinalRows = 32;          // warps per final-sum block

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Σ v over the block (blockDim.x a multiple of 32), returned to every thread; shared holds 32 floats.
__device__ float block_sum(float v, float* shared) {
  v = warp_sum(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // a previous call may still be reading shared
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < int(blockDim.x >> 5) ? shared[lane] : 0.0f;
  return warp_sum(v);
}

// out[c] = w[c] + add (w undefined: out = add).
template <typename W>
__global__ void norm_param_to_fp32_kernel(const W* __restrict__ w, float add, int64_t h, float* __restrict__ out) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c < h) out[c] = (w ? load_float(w[c]) : 0.0f) + add;
}

// y = (x - μ)·rstd·γ + β per row (μ = 0 and var = mean(x²) when !CENTERED; beta may be null).
template <typename T, int VEC, bool CENTERED>
__global__ void norm_forward_kernel(const T* __restrict__ x, const float* __restrict__ gamma,
                                    const float* __restrict__ beta, int64_t h, float eps, T* __restrict__ out,
                                    float* __restrict__ mean, float* __restrict__ rstd) {
  __shared__ float shared[32];
  const int64_t row = blockIdx.x;
  const T* xr = x + row * h;
  T* yr = out + row * h;
  const int64_t start = int64_t(threadIdx.x) * VEC, stride = int64_t(blockDim.x) * VEC;
  float mu = 0.0f;
  if constexpr (CENTERED) {
    float s = 0.0f;
    for (int64_t c = start; c < h; c += stride) {
      float v[VEC];
      load_pack<VEC>(xr + c, v);
#pragma unroll
      for (int k = 0; k < VEC; ++k) s += v[k];
    }
    mu = block_sum(s, shared) / float(h);
  }
  float ss = 0.0f;
  for (int64_t c = start; c < h; c += stride) {
    float v[VEC];
    load_pack<VEC>(xr + c, v);
#pragma unroll
    for (int k = 0; k < VEC; ++k) ss += (v[k] - mu) * (v[k] - mu);
  }
  const float rs = 1.0f / sqrtf(block_sum(ss, shared) / float(h) + eps);
  for (int64_t c = start; c < h; c += stride) {
    float v[VEC], g[VEC], y[VEC];
    load_pack<VEC>(xr + c, v);
    load_pack<VEC>(gamma + c, g);
#pragma unroll
    for (int k = 0; k < VEC; ++k) y[k] = (v[k] - mu) * rs * g[k];
    if (beta) {
      float b[VEC];
      load_pack<VEC>(beta + c, b);
#pragma unroll
      for (int k = 0; k < VEC; ++k) y[k] += b[k];
    }
    store_pack<VEC>(yr + c, y);
  }
  if (threadIdx.x == 0) {
    if (mean) mean[row] = mu;
    if (rstd) rstd[row] = rs;
  }
}

// dx = rstd·(dx̂ - mean(dx̂) - x̂·mean(dx̂·x̂)), dx̂ = dy·γ (no mean(dx̂) term when !CENTERED).
template <typename T, int VEC, bool CENTERED>
__global__ void norm_backward_input_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                           const float* __restrict__ gamma, const float* __restrict__ mean,
                                           const float* __restrict__ rstd, int64_t h, T* __restrict__ dx) {
  __shared__ float shared[32];
  const int64_t row = blockIdx.x;
  const T* xr = x + row * h;
  const T* dyr = dy + row * h;
  T* dxr = dx + row * h;
  const float m = CENTERED ? mean[row] : 0.0f, rs = rstd[row];
  const int64_t start = int64_t(threadIdx.x) * VEC, stride = int64_t(blockDim.x) * VEC;
  float sum_dxhat = 0.0f, sum_dxhat_xhat = 0.0f;
  for (int64_t c = start; c < h; c += stride) {
    float v[VEC], d[VEC], g[VEC];
    load_pack<VEC>(xr + c, v);
    load_pack<VEC>(dyr + c, d);
    load_pack<VEC>(gamma + c, g);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const float dxhat = d[k] * g[k];
      sum_dxhat += dxhat;
      sum_dxhat_xhat += dxhat * ((v[k] - m) * rs);
    }
  }
  const float a = CENTERED ? block_sum(sum_dxhat, shared) / float(h) : 0.0f;
  const float b = block_sum(sum_dxhat_xhat, shared) / float(h);
  for (int64_t c = start; c < h; c += stride) {
    float v[VEC], d[VEC], g[VEC], out[VEC];
    load_pack<VEC>(xr + c, v);
    load_pack<VEC>(dyr + c, d);
    load_pack<VEC>(gamma + c, g);
#pragma unroll
    for (int k = 0; k < VEC; ++k) out[k] = rs * (d[k] * g[k] - a - (v[k] - m) * rs * b);
    store_pack<VEC>(dxr + c, out);
  }
}

// Note [Deterministic norm parameter grads], first stage of the fallback (rows too wide for the fused
// kernel): part_w[chunk, c] = Σ dy·x̂ and part_b[chunk, c] = Σ dy over the chunk's rows (either may be null).
template <typename T, bool CENTERED>
__global__ void norm_param_grad_partial_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                               const float* __restrict__ mean, const float* __restrict__ rstd,
                                               int64_t n, int64_t h, int64_t rows_per_chunk, float* __restrict__ part_w,
                                               float* __restrict__ part_b) {
  __shared__ float sw[kColRowThreads][kColTile + 1], sb[kColRowThreads][kColTile + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t c = int64_t(blockIdx.x) * kColTile + tx;
  const int64_t chunk = blockIdx.y;
  const int64_t r0 = chunk * rows_per_chunk, r1 = std::min(n, r0 + rows_per_chunk);
  float aw = 0.0f, ab = 0.0f;
  if (c < h) {
    for (int64_t r = r0 + ty; r < r1; r += kColRowThreads) {
      const float g = load_float(dy[r * h + c]);
      const float xhat = (load_float(x[r * h + c]) - (CENTERED ? mean[r] : 0.0f)) * rstd[r];
      aw += g * xhat;
      ab += g;
    }
  }
  sw[ty][tx] = aw;
  sb[ty][tx] = ab;
  __syncthreads();
  if (ty != 0 || c >= h) return;
  float tw = 0.0f, tb = 0.0f;
#pragma unroll
  for (int k = 0; k < kColRowThreads; ++k) {
    tw += sw[k][tx];
    tb += sb[k][tx];
  }
  if (part_w) part_w[chunk * h + c] = tw;
  if (part_b) part_b[chunk * h + c] = tb;
}

// A parameter vector of any float dtype read as fp32 (γ + 1 under zero_centered_gamma), so the fused
// kernels need no fp32 copy of γ and stay templated on the activation dtype only.
struct ParamView {
  const void* data;
  DType dtype;
  float add;
  __device__ float operator[](int64_t c) const {
    switch (dtype) {
      case DType::BFloat16:
        return __bfloat162float(static_cast<const __nv_bfloat16*>(data)[c]) + add;
      case DType::Float16:
        return __half2float(static_cast<const __half*>(data)[c]) + add;
      default:
        return static_cast<const float*>(data)[c] + add;
    }
  }
};

template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> load_pack_or_zero(const T* p, bool ok) {
  Pack<T, VEC> pk;
  if (ok) {
    pk = *reinterpret_cast<const Pack<T, VEC>*>(p);
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) pk.v[j] = store_float<T>(0.0f);
  }
  return pk;
}

// Note [Fused norm backward]: one kernel computes dx and the per-block parameter-grad partials.
// Each block owns a contiguous chunk of rows; thread t owns the K packs of VEC columns
// (t + k·blockDim)·VEC of every row, so γ and the dγ/dβ accumulators live in its registers and x
// and dy are read from DRAM exactly once. R = kBwdPacksInFlight / K rows are loaded per step (R·K
// 16-byte loads of each of x and dy in flight per thread), their two row sums Σdx̂ and Σdx̂·x̂ are
// reduced together (one __syncthreads per step, double-buffered shared memory), then dx is written
// from the registers. Each thread adds its rows in order and the block writes its partial row to
// part_w/part_b[blockIdx.x]; the final kernel sums those in a fixed order: deterministic.
template <typename T, int VEC, int K, bool CENTERED>
__global__ void __launch_bounds__(kBwdMaxThreads)
    norm_backward_fused_kernel(const T* __restrict__ dy, const T* __restrict__ x, ParamView weight,
                               const float* __restrict__ mean, const float* __restrict__ rstd, int64_t n, int64_t h,
                               int64_t rows_per_block, T* __restrict__ dx, float* __restrict__ part_w,
                               float* __restrict__ part_b) {
  constexpr int R = kBwdPacksInFlight / K;
  constexpr int S = CENTERED ? 2 : 1;  // row sums per row: Σdx̂·x̂ and, when centered, Σdx̂
  __shared__ float red[2][R * S][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int64_t r0 = int64_t(blockIdx.x) * rows_per_block, r1 = std::min(n, r0 + rows_per_block);

  int64_t col[K];
  bool ok[K];
  float g[K][VEC], aw[K][VEC], ab[K][VEC];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    col[k] = (int64_t(threadIdx.x) + int64_t(k) * blockDim.x) * VEC;
    ok[k] = col[k] < h;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      g[k][j] = ok[k] && weight.data ? weight[col[k] + j] : 0.0f;
      aw[k][j] = 0.0f;
      ab[k][j] = 0.0f;
    }
  }

  int buf = 0;
  for (int64_t r = r0; r < r1; r += R) {
    Pack<T, VEC> xp[R][K], dp[R][K];
    float m[R], rs[R];
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int64_t row = r + i;
      const bool valid = row < r1;
      m[i] = CENTERED && valid ? mean[row] : 0.0f;
      rs[i] = valid ? rstd[row] : 0.0f;
#pragma unroll
      for (int k = 0; k < K; ++k) {
        xp[i][k] = load_pack_or_zero<T, VEC>(x + row * h + col[k], valid && ok[k]);
        dp[i][k] = load_pack_or_zero<T, VEC>(dy + row * h + col[k], valid && ok[k]);
      }
    }
    float sums[R * S];
#pragma unroll
    for (int i = 0; i < R; ++i) {
      float s_xhat = 0.0f, s_dxhat = 0.0f;
#pragma unroll
      for (int k = 0; k < K; ++k) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float d = load_float(dp[i][k].v[j]);
          const float xhat = (load_float(xp[i][k].v[j]) - m[i]) * rs[i];
          const float dxhat = d * g[k][j];
          s_dxhat += dxhat;
          s_xhat += dxhat * xhat;
          aw[k][j] += d * xhat;  // invalid rows and columns hold zeros: they add 0
          ab[k][j] += d;
        }
      }
      sums[i * S] = s_xhat;
      if constexpr (CENTERED) sums[i * S + 1] = s_dxhat;
    }
    if (!dx) continue;  // block-uniform
#pragma unroll
    for (int q = 0; q < R * S; ++q) {
      const float v = warp_sum(sums[q]);
      if (lane == 0) red[buf][q][warp] = v;
    }
    __syncthreads();  // double buffering: a step's writes never race the previous step's reads
#pragma unroll
    for (int q = 0; q < R * S; ++q) sums[q] = warp_sum(lane < warps ? red[buf][q][lane] : 0.0f);
    buf ^= 1;
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int64_t row = r + i;
      if (row >= r1) break;
      const float b = sums[i * S] / float(h);
      const float a = CENTERED ? sums[i * S + S - 1] / float(h) : 0.0f;
#pragma unroll
      for (int k = 0; k < K; ++k) {
        if (!ok[k]) continue;
        float out[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float d = load_float(dp[i][k].v[j]);
          const float v = load_float(xp[i][k].v[j]);
          out[j] = rs[i] * (d * g[k][j] - a - (v - m[i]) * rs[i] * b);
        }
        store_pack<VEC>(dx + row * h + col[k], out);
      }
    }
  }

#pragma unroll
  for (int k = 0; k < K; ++k) {
    if (!ok[k]) continue;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      if (part_w) part_w[int64_t(blockIdx.x) * h + col[k] + j] = aw[k][j];
      if (part_b) part_b[int64_t(blockIdx.x) * h + col[k] + j] = ab[k][j];
    }
  }
}

// Second stage: grad[c] += Σ_p part[p, c] over the partial rows p in a fixed order (either output may
// be null). A block covers 32 columns (coalesced 128-byte rows); warp w sums rows w, w + 32, ... in
// order, then one warp adds the 32 warp sums in order. The partials were just written, so they come
// from L2.
__global__ void __launch_bounds__(kFinalRows * 32)
    norm_param_grad_final_kernel(const float* __restrict__ part_w, const float* __restrict__ part_b, int64_t parts,
                                 int64_t h, float* __restrict__ grad_w, float* __restrict__ grad_b) {
  __shared__ float sw[kFinalRows][33], sb[kFinalRows][33];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t c = int64_t(blockIdx.x) * 32 + tx;
  float aw = 0.0f, ab = 0.0f;
  if (c < h) {
#pragma unroll 4
    for (int64_t p = ty; p < parts; p += kFinalRows) {
      if (part_w) aw += part_w[p * h + c];
      if (part_b) ab += part_b[p * h + c];
    }
  }
  sw[ty][tx] = aw;
  sb[ty][tx] = ab;
  __syncthreads();
  if (ty != 0 || c >= h) return;
  float tw = 0.0f, tb = 0.0f;
#pragma unroll
  for (int k = 0; k < kFinalRows; ++k) {
    tw += sw[k][tx];
    tb += sb[k][tx];
  }
  if (grad_w) grad_w[c] += tw;
  if (grad_b) grad_b[c] += tb;
}

// Rows of x viewed as [N, h]; checks `other` (same shape and dtype as x) when defined.
void check_like(const Tensor& x, const Tensor& other, const char* name) {
  check_float_cuda(other, name);
  MG_ASSERT(other.numel() == x.numel() && other.dtype() == x.dtype(), "{} is {}, expected the shape and dtype of {}",
            name, other.str(), x.str());
}

// γ (+ 1 under zero_centered_gamma) into out[0, h) and, when out_beta is non-null, β (zeros if bias is
// undefined) into out_beta[0, h).
void params_to_fp32(const Context& ctx, const Tensor& weight, const Tensor& bias, int64_t h, bool zero_centered_gamma,
                    float* gamma, float* beta) {
  cudaStream_t stream = stream_of(ctx);
  const unsigned grid = grid_for(h);
  check_float_cuda(weight, "weight");
  MG_ASSERT(weight.numel() == h, "weight is {}, expected {} elements", weight.str(), h);
  dispatch_float(weight.dtype(), [&]<typename W>() {
    norm_param_to_fp32_kernel<W>
        <<<grid, kBlockSize, 0, stream>>>(dev_ptr<W>(weight), zero_centered_gamma ? 1.0f : 0.0f, h, gamma);
  });
  CUDA_CHECK_LAUNCH();
  if (!beta) return;
  if (!bias.defined()) {
    norm_param_to_fp32_kernel<float><<<grid, kBlockSize, 0, stream>>>(nullptr, 0.0f, h, beta);
  } else {
    check_float_cuda(bias, "bias");
    MG_ASSERT(bias.numel() == h, "bias is {}, expected {} elements", bias.str(), h);
    dispatch_float(bias.dtype(), [&]<typename W>() {
      norm_param_to_fp32_kernel<W><<<grid, kBlockSize, 0, stream>>>(dev_ptr<W>(bias), 0.0f, h, beta);
    });
  }
  CUDA_CHECK_LAUNCH();
}

// centered: LayerNorm (bias and mean may be undefined), else RMSNorm.
void norm_forward(Context& ctx, const Tensor& x, const Tensor& weight, const Tensor& bias, float eps,
                  bool zero_centered_gamma, bool centered, Tensor& out, Tensor* mean, Tensor& rstd) {
  check_float_cuda(x, "x");
  MG_ASSERT(x.dim() >= 1, "norm input must be [..., h], got {}", x.str());
  const int64_t h = x.size(-1), n = h == 0 ? 0 : x.numel() / h;
  check_like(x, out, "out");
  float* mean_out = nullptr;
  if (mean && mean->defined()) {
    check_fp32(*mean, n, "mean");
    mean_out = dev_ptr<float>(*mean);
  }
  float* rstd_out = nullptr;
  if (rstd.defined()) {
    check_fp32(rstd, n, "rstd");
    rstd_out = dev_ptr<float>(rstd);
  }
  if (n == 0) return;
  const bool has_beta = centered && bias.defined();
  Tensor params = Tensor::empty({(has_beta ? 2 : 1) * h}, DType::Float32, x.device());
  float* gamma = dev_ptr<float>(params);
  float* beta = has_beta ? gamma + h : nullptr;
  params_to_fp32(ctx, weight, bias, h, zero_centered_gamma, gamma, beta);

  cudaStream_t stream = stream_of(ctx);
  dispatch_float(x.dtype(), [&]<typename T>() {
    constexpr int kVec = 16 / sizeof(T);
    const bool vec = h % kVec == 0 && aligned16(x.raw_data()) && aligned16(out.raw_data());
    const int threads = row_threads(vec ? h / kVec : h, kMaxRowThreads);
    auto launch = [&]<int VEC, bool C>() {
      norm_forward_kernel<T, VEC, C><<<unsigned(n), threads, 0, stream>>>(dev_ptr<T>(x), gamma, beta, h, eps,
                                                                          dev_ptr<T>(out), mean_out, rstd_out);
    };
    if (vec) {
      centered ? launch.template operator()<kVec, true>() : launch.template operator()<kVec, false>();
    } else {
      centered ? launch.template operator()<1, true>() : launch.template operator()<1, false>();
    }
  });
  CUDA_CHECK_LAUNCH();
}

// mean is null for RMSNorm; bias_grad may be undefined.
void norm_backward(Context& ctx, const Tensor& grad_out, const Tensor& x, const Tensor& weight, const Tensor* mean,
                   const Tensor& rstd, bool zero_centered_gamma, Tensor& grad_in, Tensor& weight_grad,
                   Tensor& bias_grad) {
  check_float_cuda(x, "x");
  MG_ASSERT(x.dim() >= 1, "norm input must be [..., h], got {}", x.str());
  const int64_t h = x.size(-1), n = h == 0 ? 0 : x.numel() / h;
  const bool centered = mean != nullptr;
  check_like(x, grad_out, "grad_out");
  check_fp32(rstd, n, "rstd");
  const float* mean_in = nullptr;
  if (centered) {
    check_fp32(*mean, n, "mean");
    mean_in = dev_ptr<float>(*mean);
  }
  if (grad_in.defined()) check_like(x, grad_in, "grad_in");
  if (weight_grad.defined()) check_fp32(weight_grad, h, "weight_grad");
  if (bias_grad.defined()) check_fp32(bias_grad, h, "bias_grad");
  if (n == 0 || (!grad_in.defined() && !weight_grad.defined() && !bias_grad.defined())) return;
  cudaStream_t stream = stream_of(ctx);
  int sms = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, x.device().index));

  // Partial rows of the parameter grads, [parts, h] each (Note [Deterministic norm parameter grads]).
  const int outputs = int(weight_grad.defined()) + int(bias_grad.defined());
  Tensor scratch;
  float *part_w = nullptr, *part_b = nullptr;
  int64_t parts = 0;
  auto make_partials = [&](int64_t p) {
    parts = p;
    if (outputs == 0) return;
    scratch = Tensor::empty({outputs * parts * h}, DType::Float32, x.device());
    part_w = weight_grad.defined() ? dev_ptr<float>(scratch) : nullptr;
    part_b = bias_grad.defined() ? dev_ptr<float>(scratch) + (outputs - 1) * parts * h : nullptr;
  };
  bool fused = false;
  dispatch_float(x.dtype(), [&]<typename T>() {
    constexpr int kVec = 16 / sizeof(T);
    const bool vec = h % kVec == 0 && aligned16(x.raw_data()) && aligned16(grad_out.raw_data()) &&
                     (!grad_in.defined() || aligned16(grad_in.raw_data()));
    const int64_t packs = vec ? h / kVec : h;
    const int k = packs <= kBwdMaxThreads ? 1 : packs <= kBwdMaxPacksPerThread * kBwdMaxThreads ? 2 : 0;
    if (k == 0) return;  // the row does not fit in the registers of one block: the unfused path below
    fused = true;
    const int threads = int((packs + k - 1) / k + 31) / 32 * 32;
    T* dx = nullptr;
    ParamView gamma{nullptr, DType::Float32, 0.0f};  // γ is only needed for dx
    if (grad_in.defined()) {
      check_float_cuda(weight, "weight");
      MG_ASSERT(weight.numel() == h, "weight is {}, expected {} elements", weight.str(), h);
      dx = dev_ptr<T>(grad_in);
      gamma = ParamView{weight.raw_data(), weight.dtype(), zero_centered_gamma ? 1.0f : 0.0f};
    }
    auto launch = [&]<int VEC, int K, bool C>() {
      const auto kernel = norm_backward_fused_kernel<T, VEC, K, C>;
      int occupancy = 0;
      CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occupancy, kernel, threads, 0));
      const int64_t per_sm = std::clamp<int64_t>(kBwdThreadsPerSm / threads, 1, std::max(occupancy, 1));
      constexpr int64_t kRows = kBwdPacksInFlight / K;
      int64_t blocks = std::min<int64_t>(int64_t(sms) * per_sm, (n + kRows - 1) / kRows);
      if (outputs > 0) blocks = std::min<int64_t>(blocks, kMaxParamParts);
      const int64_t rows_per_block = (n + blocks - 1) / blocks;
      make_partials((n + rows_per_block - 1) / rows_per_block);
      kernel<<<unsigned(parts), threads, 0, stream>>>(dev_ptr<T>(grad_out), dev_ptr<T>(x), gamma, mean_in,
                                                      dev_ptr<float>(rstd), n, h, rows_per_block, dx, part_w, part_b);
    };
    auto by_width = [&]<int VEC>() {
      if (k == 1) {
        centered ? launch.template operator()<VEC, 1, true>() : launch.template operator()<VEC, 1, false>();
      } else {
        centered ? launch.template operator()<VEC, 2, true>() : launch.template operator()<VEC, 2, false>();
      }
    };
    vec ? by_width.template operator()<kVec>() : by_width.template operator()<1>();
    CUDA_CHECK_LAUNCH();
  });

  if (!fused) {
    if (grad_in.defined()) {
      Tensor params = Tensor::empty({h}, DType::Float32, x.device());
      float* gamma = dev_ptr<float>(params);
      params_to_fp32(ctx, weight, Tensor(), h, zero_centered_gamma, gamma, nullptr);
      dispatch_float(x.dtype(), [&]<typename T>() {
        constexpr int kVec = 16 / sizeof(T);
        const bool vec =
            h % kVec == 0 && aligned16(x.raw_data()) && aligned16(grad_out.raw_data()) && aligned16(grad_in.raw_data());
        const int threads = row_threads(vec ? h / kVec : h, kMaxRowThreads);
        auto launch = [&]<int VEC, bool C>() {
          norm_backward_input_kernel<T, VEC, C><<<unsigned(n), threads, 0, stream>>>(
              dev_ptr<T>(grad_out), dev_ptr<T>(x), gamma, mean_in, dev_ptr<float>(rstd), h, dev_ptr<T>(grad_in));
        };
        if (vec) {
          centered ? launch.template operator()<kVec, true>() : launch.template operator()<kVec, false>();
        } else {
          centered ? launch.template operator()<1, true>() : launch.template operator()<1, false>();
        }
      });
      CUDA_CHECK_LAUNCH();
    }
    if (outputs == 0) return;
    const int64_t tiles = (h + kColTile - 1) / kColTile;
    int64_t chunks = std::max<int64_t>(1, (4 * int64_t(sms) + tiles - 1) / tiles);
    chunks = std::min(chunks, std::max<int64_t>(1, n / 32));  // at least ~32 rows per chunk
    const int64_t rows_per_chunk = (n + chunks - 1) / chunks;
    make_partials((n + rows_per_chunk - 1) / rows_per_chunk);
    const dim3 grid{unsigned(tiles), unsigned(parts)}, block{unsigned(kColTile), unsigned(kColRowThreads)};
    dispatch_float(x.dtype(), [&]<typename T>() {
      if (centered) {
        norm_param_grad_partial_kernel<T, true><<<grid, block, 0, stream>>>(
            dev_ptr<T>(grad_out), dev_ptr<T>(x), mean_in, dev_ptr<float>(rstd), n, h, rows_per_chunk, part_w, part_b);
      } else {
        norm_param_grad_partial_kernel<T, false><<<grid, block, 0, stream>>>(
            dev_ptr<T>(grad_out), dev_ptr<T>(x), nullptr, dev_ptr<float>(rstd), n, h, rows_per_chunk, part_w, part_b);
      }
    });
    CUDA_CHECK_LAUNCH();
  }

  if (outputs == 0) return;
  const dim3 grid{unsigned((h + 31) / 32)}, block{32u, unsigned(kFinalRows)};
  norm_param_grad_final_kernel<<<grid, block, 0, stream>>>(part_w, part_b, parts, h,
                                                           part_w ? dev_ptr<float>(weight_grad) : nullptr,
                                                           part_b ? dev_ptr<float>(bias_grad) : nullptr);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

void layernorm_forward(Context& ctx, const Tensor& x, const Tensor& weight, const Tensor& bias, float eps,
                       bool zero_centered_gamma, Tensor& out, Tensor& mean, Tensor& rstd) {
  norm_forward(ctx, x, weight, bias, eps, zero_centered_gamma, /*centered=*/true, out, &mean, rstd);
}

void layernorm_backward(Context& ctx, const Tensor& grad_out, const Tensor& x, const Tensor& weight, const Tensor& mean,
                        const Tensor& rstd, bool zero_centered_gamma, Tensor& grad_in, Tensor& weight_grad,
                        Tensor& bias_grad) {
  norm_backward(ctx, grad_out, x, weight, &mean, rstd, zero_centered_gamma, grad_in, weight_grad, bias_grad);
}

void rmsnorm_forward(Context& ctx, const Tensor& x, const Tensor& weight, float eps, bool zero_centered_gamma,
                     Tensor& out, Tensor& rstd) {
  norm_forward(ctx, x, weight, Tensor(), eps, zero_centered_gamma, /*centered=*/false, out, nullptr, rstd);
}

void rmsnorm_backward(Context& ctx, const Tensor& grad_out, const Tensor& x, const Tensor& weight, const Tensor& rstd,
                      bool zero_centered_gamma, Tensor& grad_in, Tensor& weight_grad) {
  Tensor no_bias_grad;
  norm_backward(ctx, grad_out, x, weight, nullptr, rstd, zero_centered_gamma, grad_in, weight_grad, no_bias_grad);
}

}  // namespace megatron::cuda
