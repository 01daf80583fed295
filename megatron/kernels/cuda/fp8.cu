// The FP8 ops on the GPU (fp8_ops.h; the formats, layouts and recipes are its Notes), the CUDA
// twin of kernels/cpu/fp8.cpp: the same fp32 arithmetic in the same order, so both produce the
// same bits (the GEMM aside, whose fp32 sums run in cuBLASLt's order).
//   quantise      one pass: q, the transposed copy q_t (32x32 tiles through shared memory), the
//                 amax (a block reduction, then one atomic max per block) and scale_inv;
//   recipes       the delayed update (one thread per tensor over its history) and current
//                 scaling's scale from amax, both reading and writing device memory only;
// Block scaling is fp8_block.cu, the grouped ops fp8_grouped.cu, the GEMM fp8_gemm.cu; the shared
// device functions fp8_common.cuh and fp8_tile.cuh (the vector and tile quantisation).
#include <cuda_fp8.h>

#include <cfloat>
#include <type_traits>

#include "megatron/kernels/cuda/activations.cuh"
#include "megatron/kernels/cuda/cuda_common.cuh"
#include "megatron/kernels/cuda/cuda_ops.h"
#include "megatron/kernels/cuda/fp8_common.cuh"
#include "megatron/kernels/cuda/fp8_tile.cuh"
#include "megatron/kernels/fp8_ops.h"

namespace megatron::cuda {

namespace {

// ---- per-tensor quantise -------------------------------------------------------------------------

template <typename T>
__device__ __forceinline__ uint4 pack_vector(const float (&v)[16 / sizeof(T)]) {
  union {
    Pack<T, int(16 / sizeof(T))> p;
    uint4 raw;
  } out;
#pragma unroll
  for (int e = 0; e < int(16 / sizeof(T)); ++e) out.p.v[e] = store_float<T>(v[e]);
  return out.raw;
}

template <typename T>
struct SwigluRows {  // x = swiglu(fc1) [m, f], fc1 [m, 2f] = [gate | up] rows
  static constexpr int V = int(16 / sizeof(T));
  const T* fc1;
  int64_t f;
  __device__ uint4 load(int64_t r, int64_t c) const {
    float g[V], u[V], y[V];
    load_pack<V>(fc1 + r * 2 * f + c, g);
    load_pack<V>(fc1 + r * 2 * f + f + c, u);
#pragma unroll
    for (int e = 0; e < V; ++e) y[e] = swiglu_value(g[e], u[e]);
    return pack_vector<T>(y);
  }
};

template <typename T>
struct SwigluGradRows {  // x = swiglu's input gradient [m, 2f] for the output gradient grad [m, f]
  static constexpr int V = int(16 / sizeof(T));
  const T* grad;
  const T* fc1;
  int64_t f;
  __device__ uint4 load(int64_t r, int64_t c) const {
    const bool up = c >= f;  // a vector lies wholly in one half (f % V == 0)
    const int64_t j = up ? c - f : c;
    float g[V], u[V], d[V], x[V];
    load_pack<V>(fc1 + r * 2 * f + j, g);
    load_pack<V>(fc1 + r * 2 * f + f + j, u);
    load_pack<V>(grad + r * f + j, d);
#pragma unroll
    for (int e = 0; e < V; ++e) {
      float dg, du;
      swiglu_grads(d[e], g[e], u[e], dg, du);
      x[e] = up ? du : dg;
    }
    return pack_vector<T>(x);
  }
};

template <typename T>
struct GeluRows {  // x = gelu(pre) [m, k] (grad null), or its input gradient grad · gelu'(pre)
  static constexpr int V = int(16 / sizeof(T));
  const T* grad;
  const T* pre;
  int64_t k;
  __device__ uint4 load(int64_t r, int64_t c) const {
    const int64_t i = r * k + c;
    float p[V], x[V];
    load_pack<V>(pre + i, p);
    if (grad != nullptr) {
      float d[V];
      load_pack<V>(grad + i, d);
#pragma unroll
      for (int e = 0; e < V; ++e) x[e] = d[e] * gelu_grad(p[e]);
    } else {
#pragma unroll
      for (int e = 0; e < V; ++e) x[e] = gelu(p[e]);
    }
    return pack_vector<T>(x);
  }
};

// Flat pass, scalar: q (optional) and the amax (optional); also the tail of the vector pass.
template <typename T>
__global__ void quantize_flat_kernel(const T* __restrict__ x, int64_t n, const float* __restrict__ scale,
                                     uint8_t* __restrict__ q, bool e4m3, float* __restrict__ amax) {
  const float s = scale != nullptr ? *scale : 1.0f;
  float local = 0.0f;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float v = load_float(x[i]);
    local = fmaxf(local, fabsf(v));
    if (q != nullptr) q[i] = encode_fp8(v * s, e4m3);
  }
  if (amax != nullptr) {
    local = block_max(local);
    if (threadIdx.x == 0) atomic_max_nonneg(amax, local);
  }
}

// Flat pass, vectorised: element vectors of 16 bytes (V = 16 / sizeof(T) elements), V codes stored at once.
template <typename T, typename Src>
__global__ void quantize_flat_vec_kernel(Src x, int64_t nvec, const float* __restrict__ scale,
                                         uint8_t* __restrict__ q, bool e4m3, float* __restrict__ amax) {
  constexpr int V = int(16 / sizeof(T));
  static_assert(V == 4 || V == 8, "16-byte vectors of 2- or 4-byte elements");
  using Codes = std::conditional_t<V == 8, uint2, uint32_t>;
  const float s = scale != nullptr ? *scale : 1.0f;
  float local = 0.0f;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < nvec; i += int64_t(gridDim.x) * blockDim.x) {
    const Codes codes = quantize_vector<T, Codes>(x.load_vec(i), s, e4m3, local);
    if (q != nullptr) reinterpret_cast<Codes*>(q)[i] = codes;
  }
  if (amax != nullptr) {
    local = block_max(local);
    if (threadIdx.x == 0) atomic_max_nonneg(amax, local);
  }
}

// Flat pass over a computed source (Note [Quantisation sources]): block (bx, by) takes rows by, by +
// gridDim.y, ... and in each the vectors bx·blockDim.x + tid, ... — no division per vector (a 64-bit
// one per vector made the flat walk of a [rows, k] source compute-bound).
template <typename T, typename Src>
__global__ void quantize_rows_vec_kernel(Src x, int64_t m, int64_t per_row, const float* __restrict__ scale,
                                         uint8_t* __restrict__ q, bool e4m3, float* __restrict__ amax) {
  constexpr int V = int(16 / sizeof(T));
  using Codes = std::conditional_t<V == 8, uint2, uint32_t>;
  const float s = scale != nullptr ? *scale : 1.0f;
  float local = 0.0f;
  for (int64_t r = blockIdx.y; r < m; r += gridDim.y) {
    for (int64_t v = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; v < per_row; v += int64_t(gridDim.x) * blockDim.x) {
      const Codes codes = quantize_vector<T, Codes>(x.load(r, v * V), s, e4m3, local);
      if (q != nullptr) reinterpret_cast<Codes*>(q)[r * per_row + v] = codes;
    }
  }
  if (amax != nullptr) {
    local = block_max(local);
    if (threadIdx.x == 0) atomic_max_nonneg(amax, local);
  }
}

// Tiled pass with the transposed copy: block (bx, by) takes x[by·128 .. +128, bx·32 .. +32]; threads
// (32, 8). Loads and q stores walk the tile's rows (32 consecutive columns per warp); the codes go
// through shared memory (rows of 33 bytes: conflict-free reads of 4 rows at a time) and each
// thread writes 4 consecutive bytes of a q_t row.
constexpr int kTileRowsQ = 128, kTileCols = 32, kThreadsY = 8;
template <typename T>
__global__ void quantize_transpose_kernel(const T* __restrict__ x, int64_t m, int64_t k,
                                          const float* __restrict__ scale, uint8_t* __restrict__ q,
                                          uint8_t* __restrict__ q_t, bool e4m3, float* __restrict__ amax,
                                          bool vector_store) {
  __shared__ uint8_t tile[kTileRowsQ][kTileCols + 1];
  const float s = *scale;
  const int64_t r0 = int64_t(blockIdx.y) * kTileRowsQ, c0 = int64_t(blockIdx.x) * kTileCols;
  float local = 0.0f;
  const int64_t c = c0 + threadIdx.x;
#pragma unroll 4
  for (int i = threadIdx.y; i < kTileRowsQ; i += kThreadsY) {
    const int64_t r = r0 + i;
    if (r < m && c < k) {
      const float v = load_float(x[r * k + c]);
      local = fmaxf(local, fabsf(v));
      const uint8_t code = encode_fp8(v * s, e4m3);
      if (q != nullptr) q[r * k + c] = code;
      tile[i][threadIdx.x] = code;
    }
  }
  __syncthreads();
  // q_t[c, r0 + 4·tx .. +4] for the tile's columns c = c0 + ty + 8·j
  const int64_t r = r0 + 4 * int64_t(threadIdx.x);
  for (int j = threadIdx.y; j < kTileCols; j += kThreadsY) {
    const int64_t cc = c0 + j;
    if (cc >= k || r >= m) continue;
    uint8_t* dst = q_t + cc * m + r;
    if (vector_store && r + 4 <= m) {
      const uint32_t packed = uint32_t(tile[4 * threadIdx.x][j]) | (uint32_t(tile[4 * threadIdx.x + 1][j]) << 8) |
                              (uint32_t(tile[4 * threadIdx.x + 2][j]) << 16) |
                              (uint32_t(tile[4 * threadIdx.x + 3][j]) << 24);
      *reinterpret_cast<uint32_t*>(dst) = packed;
    } else {
      for (int e = 0; e < 4 && r + e < m; ++e) dst[e] = tile[4 * threadIdx.x + e][j];
    }
  }
  if (amax != nullptr) {
    local = block_max(local);
    if (threadIdx.x == 0 && threadIdx.y == 0) atomic_max_nonneg(amax, local);
  }
}

template <typename T, typename Src>
__global__ void __launch_bounds__(kVecThreads)
    quantize_transpose_vec_kernel(Src x, int64_t m, int64_t k, const float* __restrict__ scale,
                                  uint8_t* __restrict__ q, uint8_t* __restrict__ q_t, bool e4m3,
                                  float* __restrict__ amax, bool wide_store, float* __restrict__ col_partial) {
  float local = quantize_tile<T>(x, m, k, m, int64_t(blockIdx.y) * kVecTile, int64_t(blockIdx.x) * kVecTile, *scale,
                                 q, q_t, e4m3, wide_store, col_partial, blockIdx.y);
  if (amax != nullptr) {
    local = block_max(local);
    if (threadIdx.x == 0) atomic_max_nonneg(amax, local);
  }
}

__global__ void column_partials_finish_kernel(const float* __restrict__ partial, int64_t tiles, int64_t k,
                                              float* __restrict__ dbias) {
  const int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (c >= k) return;
  float total = 0.0f;
  for (int64_t t = 0; t < tiles; ++t) total += partial[t * k + c];
  dbias[c] += total;
}

// dbias[c] += Σ_r x[r·k + c] (the scalar fallback of fp8_quantize_dbias: shapes the vector pass
// does not take).
template <typename T>
__global__ void column_sums_plain_kernel(const T* __restrict__ x, int64_t m, int64_t k, float* __restrict__ dbias) {
  const int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (c >= k) return;
  float total = 0.0f;
  for (int64_t r = 0; r < m; ++r) total += load_float(x[r * k + c]);
  dbias[c] += total;
}

__global__ void reciprocal_kernel(const float* __restrict__ scale, float* __restrict__ scale_inv, int64_t n) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i < n) scale_inv[i] = __frcp_rn(scale[i]);
}

template <typename T>
__global__ void dequantize_kernel(const uint8_t* __restrict__ q, int64_t n, bool e4m3,
                                  const float* __restrict__ scale_inv, T* __restrict__ out) {
  const float si = *scale_inv;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    out[i] = store_float<T>(decode_fp8(q[i], e4m3) * si);
  }
}

// ---- recipes -------------------------------------------------------------------------------------

__global__ void scale_from_amax_kernel(const float* __restrict__ amax, int64_t n, float fp8_max, bool pow2,
                                       float* __restrict__ scale, float* __restrict__ scale_inv) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const float s = scale_from_amax(amax[i], fp8_max, pow2, FLT_MAX);
  scale[i] = s;
  if (scale_inv != nullptr) scale_inv[i] = __frcp_rn(s);
}

// One thread per tensor: threads of a warp read neighbouring columns.
__global__ void delayed_scale_update_kernel(float* __restrict__ h, int64_t len, int64_t n, float* __restrict__ scale,
                                            float scaled_max, bool use_max) {
  const int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (j < n) delayed_update_column(h, len, n, j, scale, scaled_max, use_max);
}

// The flat pass: the vector kernel over the 16-byte-aligned whole vectors, the scalar one over the
// rest (Note [Quantisation kernels]).
template <typename T>
void launch_quantize_flat(cudaStream_t st, const T* x, int64_t n, const float* scale, uint8_t* q, bool e4m3,
                          float* amax) {
  constexpr int64_t V = int64_t(16 / sizeof(T));
  int64_t nvec = 0;
  if constexpr (sizeof(T) == 2 || sizeof(T) == 4) {
    const bool aligned = reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                         (q == nullptr || reinterpret_cast<uintptr_t>(q) % size_t(V) == 0);
    if (aligned) nvec = n / V;
  }
  if (nvec > 0) {
    if constexpr (sizeof(T) == 2 || sizeof(T) == 4) {
      quantize_flat_vec_kernel<T><<<grid_for(nvec, kBlockSize, 2048), kBlockSize, 0, st>>>(
          TensorRows<T>{x, 0}, nvec, scale, q, e4m3, amax);
    }
  }
  const int64_t done = nvec * V;
  if (done < n) {
    quantize_flat_kernel<T><<<grid_for(n - done, kBlockSize, 2048), kBlockSize, 0, st>>>(
        x + done, n - done, scale, q != nullptr ? q + done : nullptr, e4m3, amax);
  }
}

// The vector pass of Note [Vectorised transposed quantise] when the shape and pointers allow it
// (false: the caller takes the scalar tiled pass). src_aligned: x's source is 16-byte aligned
// (Note [Quantisation sources]); col_partial: the dbias partials, [tiles, k].
template <typename T, typename Src>
bool launch_quantize_transpose_vec(cudaStream_t st, const Src& src, bool src_aligned, int64_t m, int64_t k,
                                   const Tensor& scale, const Tensor& q, const Tensor& q_t, bool e4m3,
                                   const Tensor& amax, float* col_partial) {
  if constexpr (sizeof(T) != 2 && sizeof(T) != 4) {
    return false;
  } else {
    constexpr int64_t V = int64_t(16 / sizeof(T));
    const auto addr = [](const Tensor& t) { return reinterpret_cast<uintptr_t>(t.raw_data()); };
    const int64_t tiles_r = (m + kVecTile - 1) / kVecTile;
    if (k % V != 0 || !src_aligned || (q.defined() && addr(q) % uintptr_t(V) != 0) || tiles_r > 65535) {
      return false;
    }
    const bool wide_store = m % 16 == 0 && addr(q_t) % 16 == 0;
    const dim3 grid(unsigned((k + kVecTile - 1) / kVecTile), unsigned(tiles_r));
    quantize_transpose_vec_kernel<T><<<grid, kVecThreads, 0, st>>>(src, m, k, f32_ptr(scale), fp8_ptr(q), fp8_ptr(q_t),
                                                                   e4m3, f32_ptr(amax), wide_store, col_partial);
    return true;
  }
}

template <typename T>
bool launch_quantize_transpose_vec(cudaStream_t st, const Tensor& x, int64_t m, int64_t k, const Tensor& scale,
                                   const Tensor& q, const Tensor& q_t, bool e4m3, const Tensor& amax,
                                   float* col_partial) {
  const bool aligned = reinterpret_cast<uintptr_t>(x.raw_data()) % 16 == 0;
  return launch_quantize_transpose_vec<T>(st, TensorRows<T>{dev_ptr<const T>(x), k}, aligned, m, k, scale, q, q_t,
                                          e4m3, amax, col_partial);
}

}  // namespace

void fp8_quantize(Context& ctx, const Tensor& x, const Tensor& scale, Tensor& q, Tensor& q_t, Tensor& amax,
                  Tensor& scale_inv) {
  const auto [m, k] = ops::check_fp8_quantize(x, scale, q, q_t, amax, scale_inv);
  check_on_gpu({&x, &scale, &q, &q_t, &amax, &scale_inv}, "fp8_quantize");
  const bool e4m3 = (q.defined() ? q.dtype() : (q_t.defined() ? q_t.dtype() : DType::Float8E4M3)) ==
                    DType::Float8E4M3;
  cudaStream_t st = stream_of(ctx);
  const int64_t n = m * k;
  if (n > 0) {
    dispatch_float(x.dtype(), [&]<typename T>() {
      if (q_t.defined() && launch_quantize_transpose_vec<T>(st, x, m, k, scale, q, q_t, e4m3, amax, nullptr)) {
        // the vector pass took it
      } else if (q_t.defined()) {
        const dim3 grid(unsigned((k + kTileCols - 1) / kTileCols), unsigned((m + kTileRowsQ - 1) / kTileRowsQ));
        MG_CHECK(grid.y <= 65535u, "fp8_quantize: {} rows are too many for one transposed pass", m);
        const bool vector_store = m % 4 == 0 && reinterpret_cast<uintptr_t>(q_t.raw_data()) % 4 == 0;
        quantize_transpose_kernel<T><<<grid, dim3(kTileCols, kThreadsY), 0, st>>>(
            dev_ptr<const T>(x), m, k, f32_ptr(scale), fp8_ptr(q), fp8_ptr(q_t), e4m3, f32_ptr(amax), vector_store);
      } else if (q.defined() || amax.defined()) {
        launch_quantize_flat<T>(st, dev_ptr<const T>(x), n, f32_ptr(scale), fp8_ptr(q), e4m3, f32_ptr(amax));
      }
      CUDA_CHECK(cudaGetLastError());
    });
  }
  if (scale_inv.defined()) {
    reciprocal_kernel<<<1, 32, 0, st>>>(f32_ptr(scale), f32_ptr(scale_inv), 1);
    CUDA_CHECK(cudaGetLastError());
  }
}

void fp8_quantize_dbias(Context& ctx, const Tensor& x, const Tensor& scale, Tensor& q, Tensor& q_t, Tensor& amax,
                        Tensor& scale_inv, Tensor& dbias) {
  const auto [m, k] = ops::check_fp8_quantize_dbias(x, scale, q, q_t, amax, scale_inv, dbias);
  check_on_gpu({&x, &scale, &q, &q_t, &amax, &scale_inv, &dbias}, "fp8_quantize_dbias");
  cudaStream_t st = stream_of(ctx);
  bool fused = false;
  if (m > 0 && k > 0 && q_t.defined()) {  // Note [Vectorised transposed quantise]
    const int64_t tiles_r = (m + kVecTile - 1) / kVecTile;
    Tensor partial = ctx.workspace(size_t(tiles_r * k) * sizeof(float));
    float* pp = static_cast<float*>(partial.raw_data());
    const bool e4m3 = q_t.dtype() == DType::Float8E4M3;
    dispatch_float(x.dtype(), [&]<typename T>() {
      fused = launch_quantize_transpose_vec<T>(st, x, m, k, scale, q, q_t, e4m3, amax, pp);
    });
    if (fused) {
      CUDA_CHECK(cudaGetLastError());
      column_partials_finish_kernel<<<unsigned((k + kBlockSize - 1) / kBlockSize), kBlockSize, 0, st>>>(
          pp, tiles_r, k, f32_ptr(dbias));
      CUDA_CHECK(cudaGetLastError());
      if (scale_inv.defined()) {
        reciprocal_kernel<<<1, 32, 0, st>>>(f32_ptr(scale), f32_ptr(scale_inv), 1);
        CUDA_CHECK(cudaGetLastError());
      }
    }
  }
  if (fused) return;
  fp8_quantize(ctx, x, scale, q, q_t, amax, scale_inv);
  if (m == 0 || k == 0) return;
  dispatch_float(x.dtype(), [&]<typename T>() {
    column_sums_plain_kernel<T><<<unsigned((k + kBlockSize - 1) / kBlockSize), kBlockSize, 0, st>>>(
        dev_ptr<const T>(x), m, k, f32_ptr(dbias));
    CUDA_CHECK(cudaGetLastError());
  });
}

// Note [Quantising inside the activation]: the vector passes over the activation's source; other
// shapes make x with the activation's kernel and quantise it.
void fp8_quantize_activation(Context& ctx, Fp8Activation act, const Tensor& pre, const Tensor& grad,
                             const Tensor& scale, Tensor& q, Tensor& q_t, Tensor& amax, Tensor& scale_inv,
                             Tensor& dbias) {
  const auto [m, k] = ops::check_fp8_quantize_activation(act, pre, grad, scale, q, q_t, amax, scale_inv, dbias);
  check_on_gpu({&pre, &grad, &scale, &q, &q_t, &amax, &scale_inv, &dbias}, "fp8_quantize_activation");
  const bool swiglu = act == Fp8Activation::Swiglu;
  const int64_t f = swiglu ? pre.size(-1) / 2 : k;  // the width a source's vector must not straddle
  const bool e4m3 = (q.defined() ? q.dtype() : (q_t.defined() ? q_t.dtype() : DType::Float8E4M3)) ==
                    DType::Float8E4M3;
  const auto addr = [](const Tensor& t) { return reinterpret_cast<uintptr_t>(t.raw_data()); };
  cudaStream_t st = stream_of(ctx);
  bool done = false;
  dispatch_float(pre.dtype(), [&]<typename T>() {
    constexpr int64_t V = int64_t(16 / sizeof(T));
    const bool vectors = m > 0 && f > 0 && f % V == 0 && addr(pre) % 16 == 0 &&
                         (!grad.defined() || addr(grad) % 16 == 0) && (!q.defined() || addr(q) % uintptr_t(V) == 0);
    if (!vectors || (dbias.defined() && !q_t.defined())) return;  // the flat pass sums no columns
    const int64_t tiles_r = (m + kVecTile - 1) / kVecTile;
    float* partial = nullptr;
    if (dbias.defined()) partial = static_cast<float*>(ctx.workspace(size_t(tiles_r * k) * sizeof(float)).raw_data());
    auto run = [&](const auto& src) {
      if (q_t.defined()) {
        done = launch_quantize_transpose_vec<T>(st, src, true, m, k, scale, q, q_t, e4m3, amax, partial);
      } else {
        const int64_t per_row = k / V;
        const int64_t bx = std::min<int64_t>((per_row + kBlockSize - 1) / kBlockSize, 64);
        const dim3 grid(unsigned(bx), unsigned(std::min<int64_t>(m, std::max<int64_t>(1, 4096 / bx))));
        quantize_rows_vec_kernel<T><<<grid, kBlockSize, 0, st>>>(src, m, per_row, f32_ptr(scale), fp8_ptr(q), e4m3,
                                                                 f32_ptr(amax));
        done = true;
      }
    };
    const T* g = grad.defined() ? dev_ptr<const T>(grad) : nullptr;
    if (!swiglu) {
      run(GeluRows<T>{g, dev_ptr<const T>(pre), k});
    } else if (grad.defined()) {
      run(SwigluGradRows<T>{g, dev_ptr<const T>(pre), f});
    } else {
      run(SwigluRows<T>{dev_ptr<const T>(pre), f});
    }
    CUDA_CHECK(cudaGetLastError());
    if (done && partial != nullptr) {
      column_partials_finish_kernel<<<unsigned((k + kBlockSize - 1) / kBlockSize), kBlockSize, 0, st>>>(
          partial, tiles_r, k, f32_ptr(dbias));
      CUDA_CHECK(cudaGetLastError());
    }
  });
  if (done) {
    if (scale_inv.defined()) {
      reciprocal_kernel<<<1, 32, 0, st>>>(f32_ptr(scale), f32_ptr(scale_inv), 1);
      CUDA_CHECK(cudaGetLastError());
    }
    return;
  }
  const Tensor x = ops::fp8_activation_values(ctx, act, pre, grad);
  if (dbias.defined()) {
    fp8_quantize_dbias(ctx, x, scale, q, q_t, amax, scale_inv, dbias);
  } else {
    fp8_quantize(ctx, x, scale, q, q_t, amax, scale_inv);
  }
}

void fp8_amax(Context& ctx, const Tensor& x, Tensor& amax) {
  check_float_cuda(x, "x");
  check_fp32(amax, 1, "amax");
  CUDA_CHECK(cudaMemsetAsync(amax.raw_data(), 0, sizeof(float), stream_of(ctx)));
  if (x.numel() == 0) return;
  dispatch_float(x.dtype(), [&]<typename T>() {
    launch_quantize_flat<T>(stream_of(ctx), dev_ptr<const T>(x), x.numel(), nullptr, nullptr, true, f32_ptr(amax));
    CUDA_CHECK(cudaGetLastError());
  });
}

void fp8_dequantize(Context& ctx, const Tensor& q, const Tensor& scale_inv, Tensor& out) {
  MG_CHECK(q.defined() && is_fp8(q.dtype()), "fp8_dequantize: q must be fp8, got {}",
           q.defined() ? q.str() : "undefined");
  check_cuda(q, "q");
  check_fp32(scale_inv, 1, "scale_inv");
  check_float_cuda(out, "out");
  MG_ASSERT(out.numel() == q.numel(), "out is {}, q {}", out.str(), q.str());
  if (q.numel() == 0) return;
  dispatch_float(out.dtype(), [&]<typename T>() {
    dequantize_kernel<T><<<grid_for(q.numel()), kBlockSize, 0, stream_of(ctx)>>>(
        fp8_ptr(q), q.numel(), q.dtype() == DType::Float8E4M3, f32_ptr(scale_inv), dev_ptr<T>(out));
    CUDA_CHECK(cudaGetLastError());
  });
}

void fp8_scale_from_amax(Context& ctx, const Tensor& amax, float fp8_max, bool power_of_two_scales, Tensor& scale,
                         Tensor& scale_inv) {
  const int64_t n = amax.numel();
  check_fp32(amax, n, "amax");
  check_fp32(scale, n, "scale");
  if (scale_inv.defined()) check_fp32(scale_inv, n, "scale_inv");
  if (n == 0) return;
  scale_from_amax_kernel<<<unsigned((n + 255) / 256), 256, 0, stream_of(ctx)>>>(
      f32_ptr(amax), n, fp8_max, power_of_two_scales, f32_ptr(scale), f32_ptr(scale_inv));
  CUDA_CHECK(cudaGetLastError());
}

void fp8_delayed_scale_update(Context& ctx, Tensor& amax_history, Tensor& scale, const Fp8DelayedParams& p) {
  const auto [len, n] = ops::check_fp8_delayed_scale_update(amax_history, scale);
  check_on_gpu({&amax_history, &scale}, "fp8_delayed_scale_update");
  if (n == 0) return;
  delayed_scale_update_kernel<<<unsigned((n + 127) / 128), 128, 0, stream_of(ctx)>>>(
      f32_ptr(amax_history), len, n, f32_ptr(scale), p.scaled_max(), p.use_max);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace megatron::cuda
