// Pointwise ops, CUDA fast path: GeLU (tanh), SwiGLU, rotary embedding, dropout, dropout-add and add
// (references: kernels/cpu/activations.cpp, rope.cpp, dropout.cpp).
//
// The flat ops (GeLU, dropout, dropout-add, add) share one grid-stride kernel over 16-byte packs of
// one or two inputs, with a functor for the arithmetic (fp32 compute) and a scalar tail; an output may
// alias an input (each thread reads its pack before writing it, so no __restrict__ there). Dropout
// draws element i from philox_uniform(seed, offset, i) (Note [Random stream layout] in
// runtime/philox.h): a pack of 4k elements starts at a multiple of 4, so each Philox block is computed
// once and the mask is bit-identical to the CPU reference's.
// SwiGLU and quick-GeGLU work on [gate | up] rows in packs; RoPE puts one thread on each rotated pair or
// pass-through channel of a head row, several rows per block.
#include <algorithm>

#include "megatron/kernels/cuda/activations.cuh"
#include "megatron/kernels/cuda/cuda_common.cuh"
#include "megatron/kernels/cuda/cuda_ops.h"
#include "megatron/runtime/philox.h"

namespace megatron::cuda {

namespace {

// u[k] = philox_uniform(seed, offset, i0 + k); for N % 4 == 0, i0 must be a multiple of 4.
template <int N>
__device__ __forceinline__ void uniforms(uint64_t seed, uint64_t offset, int64_t i0, float (&u)[N]) {
  if constexpr (N % 4 == 0) {
    const uint32_t key[2] = {uint32_t(seed), uint32_t(seed >> 32)};
#pragma unroll
    for (int g = 0; g < N / 4; ++g) {
      const uint64_t block = (uint64_t(i0) >> 2) + uint64_t(g);
      const uint32_t ctr[4] = {uint32_t(block), uint32_t(block >> 32), uint32_t(offset), uint32_t(offset >> 32)};
      uint32_t r[4];
      philox4x32_10(ctr, key, r);
#pragma unroll
      for (int j = 0; j < 4; ++j) u[g * 4 + j] = float(r[j] >> 8) * (1.0f / 16777216.0f);
    }
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) u[k] = philox_uniform(seed, offset, uint64_t(i0 + k));
  }
}

// ---- flat ops: x = op(i0, x, y) on packs of the inputs a (-> x) and b (-> y, may be absent) --------
struct GeluForwardOp {
  template <int N>
  __device__ void operator()(int64_t, float (&x)[N], const float (&)[N]) const {
#pragma unroll
    for (int k = 0; k < N; ++k) x[k] = gelu(x[k]);
  }
};

struct GeluBackwardOp {  // a = grad_out, b = x
  template <int N>
  __device__ void operator()(int64_t, float (&dy)[N], const float (&x)[N]) const {
#pragma unroll
    for (int k = 0; k < N; ++k) dy[k] = dy[k] * gelu_grad(x[k]);
  }
};

struct AddOp {
  template <int N>
  __device__ void operator()(int64_t, float (&a)[N], const float (&b)[N]) const {
#pragma unroll
    for (int k = 0; k < N; ++k) a[k] = __fadd_rn(a[k], b[k]);
  }
};

template <bool RESIDUAL>  // a = x, b = residual
struct DropoutOp {
  float p, scale;
  uint64_t seed, offset;
  const uint64_t* shift;  // Note [Random offsets under CUDA graphs]
  template <int N>
  __device__ void operator()(int64_t i0, float (&x)[N], const float (&res)[N]) const {
    float u[N];
    uniforms<N>(seed, offset + (shift ? *shift : 0), i0, u);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float dropped = u[k] >= p ? __fmul_rn(x[k], scale) : 0.0f;  // never fused: bit-equal to the CPU
      x[k] = RESIDUAL ? __fadd_rn(res[k], dropped) : dropped;
    }
  }
};

template <typename T, int VEC, bool HAS_B, typename Op>
__global__ void pointwise_kernel(const T* a, const T* b, T* out, int64_t n, Op op) {
  const int64_t packs = n / VEC, tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t p = tid; p < packs; p += stride) {
    float x[VEC], y[VEC];
    load_pack<VEC>(a + p * VEC, x);
    if constexpr (HAS_B) load_pack<VEC>(b + p * VEC, y);
    op(p * VEC, x, y);
    store_pack<VEC>(out + p * VEC, x);
  }
  const int64_t i = packs * VEC + tid;  // the tail, fewer than VEC elements
  if (i < n) {
    float x[1] = {load_float(a[i])}, y[1] = {HAS_B ? load_float(b[i]) : 0.0f};
    op(i, x, y);
    out[i] = store_float<T>(x[0]);
  }
}

template <typename Op>
void pointwise(const Context& ctx, const Tensor& a, const Tensor& b, Tensor& out, const Op& op) {
  const int64_t n = a.numel();
  if (n == 0) return;
  cudaStream_t stream = stream_of(ctx);
  dispatch_float(a.dtype(), [&]<typename T>() {
    constexpr int kVec = 16 / sizeof(T);
    const T* bp = b.defined() ? dev_ptr<T>(b) : nullptr;
    const bool vec = aligned16(a.raw_data()) && aligned16(out.raw_data()) && (!bp || aligned16(bp));
    auto launch = [&]<int VEC, bool HAS_B>() {
      pointwise_kernel<T, VEC, HAS_B, Op>
          <<<grid_for(std::max<int64_t>(n / VEC, 1)), kBlockSize, 0, stream>>>(dev_ptr<T>(a), bp, dev_ptr<T>(out), n, op);
    };
    if (vec) {
      bp ? launch.template operator()<kVec, true>() : launch.template operator()<kVec, false>();
    } else {
      bp ? launch.template operator()<1, true>() : launch.template operator()<1, false>();
    }
  });
  CUDA_CHECK_LAUNCH();
}

// `t` has the numel and dtype of `like`.
void check_like(const Tensor& t, const Tensor& like, const char* name) {
  check_float_cuda(t, name);
  MG_ASSERT(t.numel() == like.numel() && t.dtype() == like.dtype(), "{} is {}, expected the size and dtype of {}",
            name, t.str(), like.str());
}

// out = residual + dropout(x); residual may be undefined.
void dropout_add(Context& ctx, const Tensor& x, const Tensor& residual, float p, uint64_t seed,
                 uint64_t offset, Tensor& out) {
  MG_ASSERT(p >= 0.0f && p <= 1.0f, "dropout probability {} must be in [0, 1]", p);
  check_float_cuda(x, "x");
  check_like(out, x, "out");
  if (residual.defined()) check_like(residual, x, "residual");
  if (p == 0.0f) {
    if (residual.defined()) return pointwise(ctx, x, residual, out, AddOp{});
    if (out.raw_data() != x.raw_data() && x.numel() > 0) {
      CUDA_CHECK(cudaMemcpyAsync(out.raw_data(), x.raw_data(), x.nbytes(), cudaMemcpyDeviceToDevice, stream_of(ctx)));
    }
    return;
  }
  const float scale = p < 1.0f ? 1.0f / (1.0f - p) : 0.0f;
  const uint64_t* shift = rng_shift_of(ctx);
  if (residual.defined()) return pointwise(ctx, x, residual, out, DropoutOp<true>{p, scale, seed, offset, shift});
  pointwise(ctx, x, Tensor(), out, DropoutOp<false>{p, scale, seed, offset, shift});
}

// ---- SwiGLU: x [N, 2f] = [gate | up] rows -----------------------------------------------------------
template <typename T, int VEC>
__global__ void swiglu_forward_kernel(const T* __restrict__ x, int64_t rows, int64_t f, T* __restrict__ out) {
  const int64_t per_row = f / VEC, packs = rows * per_row;
  for (int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; p < packs; p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = p / per_row, c = (p % per_row) * VEC;
    float g[VEC], u[VEC], y[VEC];
    load_pack<VEC>(x + r * 2 * f + c, g);
    load_pack<VEC>(x + r * 2 * f + f + c, u);
#pragma unroll
    for (int k = 0; k < VEC; ++k) y[k] = swiglu_value(g[k], u[k]);
    store_pack<VEC>(out + r * f + c, y);
  }
}

template <typename T, int VEC>
__global__ void swiglu_backward_kernel(const T* __restrict__ dy, const T* __restrict__ x, int64_t rows, int64_t f,
                                       T* __restrict__ dx) {
  const int64_t per_row = f / VEC, packs = rows * per_row;
  for (int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; p < packs; p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = p / per_row, c = (p % per_row) * VEC;
    float g[VEC], u[VEC], d[VEC], dg[VEC], du[VEC];
    load_pack<VEC>(x + r * 2 * f + c, g);
    load_pack<VEC>(x + r * 2 * f + f + c, u);
    load_pack<VEC>(dy + r * f + c, d);
#pragma unroll
    for (int k = 0; k < VEC; ++k) swiglu_grads(d[k], g[k], u[k], dg[k], du[k]);
    store_pack<VEC>(dx + r * 2 * f + c, dg);
    store_pack<VEC>(dx + r * 2 * f + f + c, du);
  }
}

// Quick-GeGLU with clamps on [gate | up] rows (reference and derivative: kernels/cpu/activations.cpp).
template <typename T, int VEC>
__global__ void quick_geglu_forward_kernel(const T* __restrict__ x, int64_t rows, int64_t f, float alpha, float limit,
                                           float linear_offset, T* __restrict__ out) {
  const int64_t per_row = f / VEC, packs = rows * per_row;
  for (int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; p < packs; p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = p / per_row, c = (p % per_row) * VEC;
    float g[VEC], u[VEC], y[VEC];
    load_pack<VEC>(x + r * 2 * f + c, g);
    load_pack<VEC>(x + r * 2 * f + f + c, u);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const float gc = fminf(g[k], limit), uc = fminf(fmaxf(u[k], -limit), limit);
      y[k] = gc * sigmoid(alpha * gc) * (uc + linear_offset);
    }
    store_pack<VEC>(out + r * f + c, y);
  }
}

template <typename T, int VEC>
__global__ void quick_geglu_backward_kernel(const T* __restrict__ dy, const T* __restrict__ x, int64_t rows, int64_t f,
                                            float alpha, float limit, float linear_offset, T* __restrict__ dx) {
  const int64_t per_row = f / VEC, packs = rows * per_row;
  for (int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; p < packs; p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = p / per_row, c = (p % per_row) * VEC;
    float g[VEC], u[VEC], d[VEC], dg[VEC], du[VEC];
    load_pack<VEC>(x + r * 2 * f + c, g);
    load_pack<VEC>(x + r * 2 * f + f + c, u);
    load_pack<VEC>(dy + r * f + c, d);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const float gc = fminf(g[k], limit), uc = fminf(fmaxf(u[k], -limit), limit);
      const float s = sigmoid(alpha * gc);
      dg[k] = g[k] <= limit ? d[k] * (uc + linear_offset) * s * (1.0f + alpha * gc * (1.0f - s)) : 0.0f;
      du[k] = (u[k] >= -limit && u[k] <= limit) ? d[k] * gc * s : 0.0f;
    }
    store_pack<VEC>(dx + r * 2 * f + c, dg);
    store_pack<VEC>(dx + r * 2 * f + f + c, du);
  }
}

// Rows and f of a SwiGLU input x [N, 2f] and its half-width partner [N, f] (out or grad_out).
int64_t swiglu_rows(const Tensor& x, const Tensor& half, int64_t& f) {
  check_float_cuda(x, "x");
  MG_ASSERT(x.dim() >= 1 && x.size(-1) % 2 == 0, "swiglu input {} must have an even last dimension", x.str());
  f = x.size(-1) / 2;
  const int64_t n = f == 0 ? 0 : x.numel() / (2 * f);
  check_float_cuda(half, "swiglu output / grad_out");
  MG_ASSERT(half.numel() == n * f && half.size(-1) == f && half.dtype() == x.dtype(),
            "{} does not match swiglu input {}", half.str(), x.str());
  return n;
}

// ---- RoPE: x [s, b, n, d], freqs [s, half] ------------------------------------------------------------
// out = scale · rotate(x, sign·θ) (scale: YaRN's attention factor, 1 for plain RoPE; cos and sin
// are scaled as in the CPU reference); threadIdx.x walks a head row's items (half pairs, then
// d - 2·half pass-through channels), threadIdx.y picks the row.
template <typename T>
__global__ void rope_kernel(const T* x, const float* __restrict__ freqs, int64_t rows, int64_t heads_per_pos, int64_t d,
                            int64_t half, bool interleaved, float sign, float scale, T* out) {
  const int64_t items = d - half;  // half pairs + (d - 2·half) pass-through channels
  for (int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y; row < rows;
       row += int64_t(gridDim.x) * blockDim.y) {
    const T* xr = x + row * d;
    T* yr = out + row * d;
    const float* theta = freqs + (row / heads_per_pos) * half;
    for (int64_t j = threadIdx.x; j < items; j += blockDim.x) {
      if (j < half) {
        const int64_t lo = interleaved ? 2 * j : j, hi = interleaved ? lo + 1 : lo + half;
        float sn, cs;
        sincosf(theta[j], &sn, &cs);
        cs *= scale;
        sn = sign * (sn * scale);
        const float a = load_float(xr[lo]), b = load_float(xr[hi]);
        yr[lo] = store_float<T>(a * cs - b * sn);
        yr[hi] = store_float<T>(b * cs + a * sn);
      } else if (x != out) {
        const int64_t c = half + j;  // 2·half + (j - half)
        yr[c] = xr[c];
      }
    }
  }
}

void rope_rotate(const Context& ctx, const Tensor& x, const Tensor& freqs, bool interleaved, float sign, float scale,
                 Tensor& out) {
  check_float_cuda(x, "x");
  MG_ASSERT(x.dim() == 4, "rope input must be [s, b, n, d], got {}", x.str());
  check_like(out, x, "out");
  MG_ASSERT(freqs.defined() && freqs.device().is_cuda() && freqs.dtype() == DType::Float32,
            "freqs must be an fp32 CUDA tensor, got {}", freqs.defined() ? freqs.str() : "undefined");
  const int64_t s = x.size(0), heads = x.size(1) * x.size(2), d = x.size(3);
  MG_ASSERT(freqs.dim() == 2 && freqs.size(0) == s, "freqs is {}, expected [{}, r/2]", freqs.str(), s);
  const int64_t half = freqs.size(1);
  MG_ASSERT(2 * half <= d, "rotary dimension {} exceeds head dimension {}", 2 * half, d);
  const int64_t rows = s * heads;
  if (rows == 0 || d == 0) return;
  const int64_t items = d - half;
  const int tx = int(std::clamp<int64_t>((items + 31) / 32 * 32, 32, kBlockSize));
  const dim3 block{unsigned(tx), unsigned(kBlockSize / tx)};
  const unsigned grid = unsigned(std::min<int64_t>((rows + block.y - 1) / block.y, 65535LL * 16));
  cudaStream_t stream = stream_of(ctx);
  dispatch_float(x.dtype(), [&]<typename T>() {
    rope_kernel<T><<<grid, block, 0, stream>>>(dev_ptr<T>(x), dev_ptr<float>(freqs), rows, heads, d, half, interleaved,
                                               sign, scale, dev_ptr<T>(out));
  });
  CUDA_CHECK_LAUNCH();
}

}  // namespace

void gelu_forward(Context& ctx, const Tensor& x, Tensor& out) {
  check_float_cuda(x, "x");
  check_like(out, x, "out");
  pointwise(ctx, x, Tensor(), out, GeluForwardOp{});
}

void gelu_backward(Context& ctx, const Tensor& grad_out, const Tensor& x, Tensor& grad_in) {
  check_float_cuda(x, "x");
  check_like(grad_out, x, "grad_out");
  check_like(grad_in, x, "grad_in");
  pointwise(ctx, grad_out, x, grad_in, GeluBackwardOp{});
}

void swiglu_forward(Context& ctx, const Tensor& x, Tensor& out) {
  int64_t f = 0;
  const int64_t n = swiglu_rows(x, out, f);
  if (n * f == 0) return;
  cudaStream_t stream = stream_of(ctx);
  dispatch_float(x.dtype(), [&]<typename T>() {
    constexpr int kVec = 16 / sizeof(T);
    if (f % kVec == 0 && aligned16(x.raw_data()) && aligned16(out.raw_data())) {
      swiglu_forward_kernel<T, kVec>
          <<<grid_for(n * f / kVec), kBlockSize, 0, stream>>>(dev_ptr<T>(x), n, f, dev_ptr<T>(out));
    } else {
      swiglu_forward_kernel<T, 1><<<grid_for(n * f), kBlockSize, 0, stream>>>(dev_ptr<T>(x), n, f, dev_ptr<T>(out));
    }
  });
  CUDA_CHECK_LAUNCH();
}

void swiglu_backward(Context& ctx, const Tensor& grad_out, const Tensor& x, Tensor& grad_in) {
  int64_t f = 0;
  const int64_t n = swiglu_rows(x, grad_out, f);
  check_like(grad_in, x, "grad_in");
  if (n * f == 0) return;
  cudaStream_t stream = stream_of(ctx);
  dispatch_float(x.dtype(), [&]<typename T>() {
    constexpr int kVec = 16 / sizeof(T);
    if (f % kVec == 0 && aligned16(x.raw_data()) && aligned16(grad_out.raw_data()) && aligned16(grad_in.raw_data())) {
      swiglu_backward_kernel<T, kVec><<<grid_for(n * f / kVec), kBlockSize, 0, stream>>>(
          dev_ptr<T>(grad_out), dev_ptr<T>(x), n, f, dev_ptr<T>(grad_in));
    } else {
      swiglu_backward_kernel<T, 1><<<grid_for(n * f), kBlockSize, 0, stream>>>(dev_ptr<T>(grad_out), dev_ptr<T>(x), n,
                                                                               f, dev_ptr<T>(grad_in));
    }
  });
  CUDA_CHECK_LAUNCH();
}

void quick_geglu_forward(Context& ctx, const Tensor& x, float alpha, float limit, float linear_offset, Tensor& out) {
  int64_t f = 0;
  const int64_t n = swiglu_rows(x, out, f);
  if (n * f == 0) return;
  cudaStream_t stream = stream_of(ctx);
  dispatch_float(x.dtype(), [&]<typename T>() {
    constexpr int kVec = 16 / sizeof(T);
    if (f % kVec == 0 && aligned16(x.raw_data()) && aligned16(out.raw_data())) {
      quick_geglu_forward_kernel<T, kVec><<<grid_for(n * f / kVec), kBlockSize, 0, stream>>>(
          dev_ptr<T>(x), n, f, alpha, limit, linear_offset, dev_ptr<T>(out));
    } else {
      quick_geglu_forward_kernel<T, 1><<<grid_for(n * f), kBlockSize, 0, stream>>>(dev_ptr<T>(x), n, f, alpha, limit,
                                                                                    linear_offset, dev_ptr<T>(out));
    }
  });
  CUDA_CHECK_LAUNCH();
}

void quick_geglu_backward(Context& ctx, const Tensor& grad_out, const Tensor& x, float alpha, float limit,
                          float linear_offset, Tensor& grad_in) {
  int64_t f = 0;
  const int64_t n = swiglu_rows(x, grad_out, f);
  check_like(grad_in, x, "grad_in");
  if (n * f == 0) return;
  cudaStream_t stream = stream_of(ctx);
  dispatch_float(x.dtype(), [&]<typename T>() {
    constexpr int kVec = 16 / sizeof(T);
    if (f % kVec == 0 && aligned16(x.raw_data()) && aligned16(grad_out.raw_data()) && aligned16(grad_in.raw_data())) {
      quick_geglu_backward_kernel<T, kVec><<<grid_for(n * f / kVec), kBlockSize, 0, stream>>>(
          dev_ptr<T>(grad_out), dev_ptr<T>(x), n, f, alpha, limit, linear_offset, dev_ptr<T>(grad_in));
    } else {
      quick_geglu_backward_kernel<T, 1><<<grid_for(n * f), kBlockSize, 0, stream>>>(
          dev_ptr<T>(grad_out), dev_ptr<T>(x), n, f, alpha, limit, linear_offset, dev_ptr<T>(grad_in));
    }
  });
  CUDA_CHECK_LAUNCH();
}

void rope_forward(Context& ctx, const Tensor& x, const Tensor& freqs, bool interleaved, float scale, Tensor& out) {
  rope_rotate(ctx, x, freqs, interleaved, 1.0f, scale, out);
}

void rope_backward(Context& ctx, const Tensor& grad_out, const Tensor& freqs, bool interleaved, float scale,
                   Tensor& grad_in) {
  rope_rotate(ctx, grad_out, freqs, interleaved, -1.0f, scale, grad_in);
}

void dropout_forward(Context& ctx, const Tensor& x, float p, uint64_t seed, uint64_t offset, Tensor& out) {
  dropout_add(ctx, x, Tensor(), p, seed, offset, out);
}

void dropout_backward(Context& ctx, const Tensor& grad_out, float p, uint64_t seed, uint64_t offset, Tensor& grad_in) {
  dropout_add(ctx, grad_out, Tensor(), p, seed, offset, grad_in);
}

void dropout_add_forward(Context& ctx, const Tensor& x, const Tensor& residual, float p, uint64_t seed, uint64_t offset,
                         Tensor& out) {
  MG_ASSERT(residual.defined(), "dropout_add_forward needs a residual");
  dropout_add(ctx, x, residual, p, seed, offset, out);
}

void add(Context& ctx, const Tensor& a, const Tensor& b, Tensor& out) {
  MG_ASSERT(b.defined(), "add needs two tensors");
  check_float_cuda(a, "a");
  check_like(b, a, "b");
  check_like(out, a, "out");
  pointwise(ctx, a, b, out, AddOp{});
}

}  // namespace megatron::cuda
