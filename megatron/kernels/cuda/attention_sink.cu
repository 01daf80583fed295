// Attention sinks, CUDA fast path (Note [Attention sinks] in kernels/op_list.inc; reference:
// kernels/cpu/attention_sink.cpp).
//  * forward: one warp per (position, batch, head) row: lane 0 reads lse0 (before anyone writes lse,
//    which may alias it), the warp scales the row of out by exp(lse0 - lse), lane 0 writes lse.
//  * backward: one block per head sums -exp(s_h - lse_i)·(dO_i·out_i) over its b·s rows (a warp per
//    row, fixed order of the block reduction: deterministic, no atomics) and adds it to sinks_grad.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "megatron/kernels/cuda/cuda_common.cuh"
#include "megatron/kernels/cuda/cuda_ops.h"

namespace megatron::cuda {

namespace {

constexpr int kSinkThreads = 256;
constexpr int kSinkWarps = kSinkThreads / 32;

template <typename T, typename S>
__global__ void attention_sink_forward_kernel(const T* out0, const float* lse0, const S* __restrict__ sinks, int64_t s,
                                              int64_t b, int64_t nq, int64_t d, T* out, float* lse) {
  const int lane = threadIdx.x % 32;
  const int64_t rows = s * b * nq;
  for (int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; row < rows;
       row += int64_t(gridDim.x) * blockDim.x / 32) {
    const int64_t h = row % nq, bi = (row / nq) % b, i = row / (nq * b);
    const int64_t st = (bi * nq + h) * s + i;
    float w = 0.0f, total = 0.0f;
    if (lane == 0) {
      const float x = lse0[st], sk = load_float(sinks[h]);
      const float m = fmaxf(x, sk);
      total = m + logf(expf(x - m) + expf(sk - m));
      w = expf(x - total);
    }
    w = __shfl_sync(0xffffffffu, w, 0);
    total = __shfl_sync(0xffffffffu, total, 0);
    for (int64_t c = lane; c < d; c += 32) out[row * d + c] = store_float<T>(load_float(out0[row * d + c]) * w);
    if (lane == 0) lse[st] = total;
  }
}

template <typename T, typename S>
__global__ void attention_sink_backward_kernel(const T* __restrict__ grad_out, const T* __restrict__ out,
                                               const float* __restrict__ lse, const S* __restrict__ sinks, int64_t s,
                                               int64_t b, int64_t nq, int64_t d, float* __restrict__ sinks_grad) {
  __shared__ float partial[kSinkWarps];
  const int64_t h = blockIdx.x;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const float sk = load_float(sinks[h]);
  float acc = 0.0f;  // lane 0 of each warp: its rows' sum
  for (int64_t r = warp; r < s * b; r += kSinkWarps) {
    const int64_t i = r / b, bi = r % b;
    const int64_t row = (i * b + bi) * nq + h;
    float dot = 0.0f;
    for (int64_t c = lane; c < d; c += 32) dot += load_float(grad_out[row * d + c]) * load_float(out[row * d + c]);
    for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    if (lane == 0) acc += expf(sk - lse[(bi * nq + h) * s + i]) * dot;
  }
  if (lane == 0) partial[warp] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.0f;
    for (int w = 0; w < kSinkWarps; ++w) total += partial[w];
    sinks_grad[h] -= total;
  }
}

struct SinkDims {
  int64_t s = 0, b = 0, nq = 0, d = 0;
};

SinkDims check_sink(const Tensor& out, const Tensor& lse, const Tensor& sinks) {
  check_float_cuda(out, "out");
  check_cuda(lse, "lse");
  check_float_cuda(sinks, "sinks");
  MG_ASSERT(out.dim() == 4, "attention sinks: out {} is not [s, b, nq, d]", out.str());
  const SinkDims a{out.size(0), out.size(1), out.size(2), out.size(3)};
  MG_ASSERT(lse.dtype() == DType::Float32 && lse.shape() == Shape({a.b, a.nq, a.s}),
            "attention sinks: lse {} for out {}", lse.str(), out.str());
  MG_ASSERT(sinks.dim() == 1 && sinks.size(0) == a.nq, "attention sinks: sinks {} for {} heads", sinks.str(), a.nq);
  return a;
}

}  // namespace

void attention_sink_forward(Context& ctx, const Tensor& out0, const Tensor& lse0, const Tensor& sinks, Tensor& out,
                            Tensor& lse) {
  const SinkDims a = check_sink(out0, lse0, sinks);
  check_sink(out, lse, sinks);
  MG_ASSERT(out.shape() == out0.shape() && out.dtype() == out0.dtype(), "attention_sink_forward: out {} for out0 {}",
            out.str(), out0.str());
  const int64_t rows = a.s * a.b * a.nq;
  if (rows == 0) return;
  const int64_t blocks = std::min<int64_t>((rows * 32 + kSinkThreads - 1) / kSinkThreads, 65535);
  dispatch_float(out.dtype(), [&]<typename T>() {
    dispatch_float(sinks.dtype(), [&]<typename S>() {
      attention_sink_forward_kernel<T, S><<<unsigned(blocks), kSinkThreads, 0, stream_of(ctx)>>>(
          dev_ptr<const T>(out0), dev_ptr<const float>(lse0), dev_ptr<const S>(sinks), a.s, a.b, a.nq, a.d,
          dev_ptr<T>(out), dev_ptr<float>(lse));
    });
  });
  CUDA_CHECK_LAUNCH();
}

void attention_sink_backward(Context& ctx, const Tensor& grad_out, const Tensor& out, const Tensor& lse,
                             const Tensor& sinks, Tensor& sinks_grad) {
  const SinkDims a = check_sink(out, lse, sinks);
  check_float_cuda(grad_out, "grad_out");
  MG_ASSERT(grad_out.shape() == out.shape() && grad_out.dtype() == out.dtype(),
            "attention_sink_backward: grad_out {} for out {}", grad_out.str(), out.str());
  if (!sinks_grad.defined() || a.nq == 0) return;
  check_cuda(sinks_grad, "sinks_grad");
  MG_ASSERT(sinks_grad.dtype() == DType::Float32 && sinks_grad.numel() == a.nq,
            "attention_sink_backward: sinks_grad {} is not fp32 [{}]", sinks_grad.str(), a.nq);
  dispatch_float(out.dtype(), [&]<typename T>() {
    dispatch_float(sinks.dtype(), [&]<typename S>() {
      attention_sink_backward_kernel<T, S><<<unsigned(a.nq), kSinkThreads, 0, stream_of(ctx)>>>(
          dev_ptr<const T>(grad_out), dev_ptr<const T>(out), dev_ptr<const float>(lse), dev_ptr<const S>(sinks), a.s,
          a.b, a.nq, a.d, dev_ptr<float>(sinks_grad));
    });
  });
  CUDA_CHECK_LAUNCH();
}

}  // namespace megatron::cuda
