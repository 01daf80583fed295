// Block scaling on the GPU (fp8_ops.h's fp8_block_quantize, fp8_block_quantize_transposed and the
// distributed optimizer's shard ops; Note [FP8 block scaling]), the CUDA twin of the block part of
// kernels/cpu/fp8.cpp: one warp per 1x128 tile, one block per 128x128 tile, a shared-memory tile
// for the transposing 1x128 pass, one warp per row segment of a weight shard's tiles.
#include "megatron/kernels/cuda/fp8_common.cuh"
#include "megatron/kernels/fp8_ops.h"

namespace megatron::cuda {

namespace {

// One warp per (row, 128-column tile): each lane takes 4 columns.
template <typename T>
__global__ void block_quantize_1x128_kernel(const T* __restrict__ x, int64_t m, int64_t k, bool e4m3, bool pow2,
                                            float fp8_max, float inf_scale, uint8_t* __restrict__ q,
                                            float* __restrict__ scale_inv, int64_t ld) {
  const int64_t tiles_k = (k + kFp8BlockLen - 1) / kFp8BlockLen;
  const int64_t warp = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= m * tiles_k) return;  // whole warps leave together
  const int64_t r = warp / tiles_k, j = warp % tiles_k;
  float v[4];
  float local = 0.0f;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int64_t c = j * kFp8BlockLen + lane + 32 * e;
    v[e] = c < k ? load_float(x[r * k + c]) : 0.0f;
    local = fmaxf(local, fabsf(v[e]));
  }
  for (int o = 16; o > 0; o /= 2) local = fmaxf(local, __shfl_xor_sync(0xffffffffu, local, o));
  const float s = scale_from_amax(local, fp8_max, pow2, inf_scale);
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int64_t c = j * kFp8BlockLen + lane + 32 * e;
    if (c < k) q[r * k + c] = encode_fp8(v[e] * s, e4m3);
  }
  if (lane == 0) scale_inv[j * ld + r] = __frcp_rn(s);
}

// One block per 128x128 tile.
template <typename T>
__global__ void block_quantize_128x128_kernel(const T* __restrict__ x, int64_t m, int64_t k, bool e4m3, bool pow2,
                                              float fp8_max, float inf_scale, uint8_t* __restrict__ q,
                                              float* __restrict__ scale_inv, int64_t ld) {
  const int64_t r0 = int64_t(blockIdx.y) * kFp8BlockLen, c0 = int64_t(blockIdx.x) * kFp8BlockLen;
  const int64_t rows = min(kFp8BlockLen, m - r0), cols = min(kFp8BlockLen, k - c0);
  float local = 0.0f;
  for (int64_t e = threadIdx.x; e < rows * kFp8BlockLen; e += blockDim.x) {
    const int64_t r = e / kFp8BlockLen, c = e % kFp8BlockLen;
    if (c < cols) local = fmaxf(local, fabsf(load_float(x[(r0 + r) * k + c0 + c])));
  }
  const float s = scale_from_amax(block_max(local), fp8_max, pow2, inf_scale);
  for (int64_t e = threadIdx.x; e < rows * kFp8BlockLen; e += blockDim.x) {
    const int64_t r = e / kFp8BlockLen, c = e % kFp8BlockLen;
    if (c < cols) q[(r0 + r) * k + c0 + c] = encode_fp8(load_float(x[(r0 + r) * k + c0 + c]) * s, e4m3);
  }
  if (threadIdx.x == 0) scale_inv[int64_t(blockIdx.y) * ld + blockIdx.x] = __frcp_rn(s);
}

// fp8_block_quantize_transposed: block (bx, by) takes x[by·128 .. +128, bx·64 .. +64] into shared
// memory (loads along x's rows); each of its 64 columns is one 1x128 tile of q_t's row — its amax
// by 4 threads of 32 rows and two shuffles, the scale as block_quantize_1x128_kernel's — and q_t is
// written 16 consecutive bytes per thread (8 threads per q_t row segment of 128 bytes).
constexpr int kBlockTCols = 64, kBlockTThreads = 256;
template <typename T>
__global__ void __launch_bounds__(kBlockTThreads)
    block_quantize_1x128_t_kernel(const T* __restrict__ x, int64_t m, int64_t k, bool e4m3, bool pow2, float fp8_max,
                                  float inf_scale, uint8_t* __restrict__ q_t, float* __restrict__ scale_inv,
                                  int64_t ld, bool wide_store) {
  constexpr int R = int(kFp8BlockLen), C = kBlockTCols;
  __shared__ float tile[R][C + 1];
  __shared__ float col_scale[C];
  const int64_t r0 = int64_t(blockIdx.y) * R, c0 = int64_t(blockIdx.x) * C;
  for (int e = threadIdx.x; e < R * C; e += kBlockTThreads) {
    const int i = e / C, j = e % C;
    const int64_t r = r0 + i, c = c0 + j;
    tile[i][j] = r < m && c < k ? load_float(x[r * k + c]) : 0.0f;
  }
  __syncthreads();
  {
    const int j = int(threadIdx.x) / 4, part = int(threadIdx.x) % 4;  // 4 neighbouring lanes per column
    float a = 0.0f;
    for (int i = part * (R / 4); i < (part + 1) * (R / 4); ++i) a = fmaxf(a, fabsf(tile[i][j]));
    a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 1));
    a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 2));
    if (part == 0) {
      const float s = scale_from_amax(a, fp8_max, pow2, inf_scale);
      col_scale[j] = s;
      if (c0 + j < k) scale_inv[int64_t(blockIdx.y) * ld + c0 + j] = __frcp_rn(s);
    }
  }
  __syncthreads();
  for (int p = threadIdx.x; p < C * 8; p += kBlockTThreads) {
    const int j = p / 8, seg = p % 8 * 16;
    const int64_t c = c0 + j, r = r0 + seg;
    if (c >= k || r >= m) continue;
    const float s = col_scale[j];
    union {
      uint4 v;
      uint8_t b[16];
    } out;
#pragma unroll
    for (int e = 0; e < 16; ++e) out.b[e] = encode_fp8(tile[seg + e][j] * s, e4m3);
    uint8_t* dst = q_t + c * m + r;
    if (wide_store && r + 16 <= m) {
      *reinterpret_cast<uint4*>(dst) = out.v;
    } else {
      for (int e = 0; e < 16 && r + e < m; ++e) dst[e] = out.b[e];
    }
  }
}

// The distributed optimizer's shards of a 128x128-tiled weight (fp8_block_partial_amax /
// fp8_block_partial_quantize): one warp per segment — one row's columns inside one 128-column tile,
// cut to the shard [start, start + n) — so the tile, its scale and its amax are one lookup per warp
// (no per-element 64-bit division), loads and stores are coalesced, and the amax is one atomic max
// per segment (a warp reduction first). Segment s of the weight is row s / tiles_c, column tile
// s % tiles_c; the shard covers segments first .. first + segs - 1.
template <typename T>
__global__ void block_partial_kernel(const T* __restrict__ x, int64_t start, int64_t n, int64_t cols, int64_t ld,
                                     int64_t first, int64_t segs, float* __restrict__ amax,
                                     const float* __restrict__ scale, uint8_t* __restrict__ q, bool e4m3) {
  const int64_t warp = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= segs) return;  // whole warps leave together
  const int64_t tiles_c = (cols + kFp8BlockLen - 1) / kFp8BlockLen;
  const int64_t seg = first + warp, row = seg / tiles_c, ct = seg % tiles_c;
  const int64_t lo = max(start, row * cols + ct * kFp8BlockLen);
  const int64_t hi = min(start + n, row * cols + min(cols, (ct + 1) * kFp8BlockLen));
  const int64_t tile = (row / kFp8BlockLen) * ld + ct;
  if (amax != nullptr) {
    float local = 0.0f;
    for (int64_t f = lo + lane; f < hi; f += 32) local = fmaxf(local, fabsf(load_float(x[f - start])));
    for (int o = 16; o > 0; o /= 2) local = fmaxf(local, __shfl_xor_sync(0xffffffffu, local, o));
    if (lane == 0) atomic_max_nonneg(amax + tile, local);
  } else {
    const float s = scale[tile];
    for (int64_t f = lo + lane; f < hi; f += 32) q[f - start] = encode_fp8(load_float(x[f - start]) * s, e4m3);
  }
}

}  // namespace

void fp8_block_quantize(Context& ctx, const Tensor& x, bool tile_2d, bool power_of_two_scales, Tensor& q,
                        Tensor& scale_inv) {
  const auto [m, k] = ops::check_fp8_block_quantize(x, tile_2d, q, scale_inv);
  check_on_gpu({&x, &q, &scale_inv}, "fp8_block_quantize");
  if (m == 0 || k == 0) return;
  const bool e4m3 = q.dtype() == DType::Float8E4M3;
  const float fp8_max = fp8_max_of(q.dtype());
  const int64_t ld = scale_inv.size(1);
  cudaStream_t st = stream_of(ctx);
  dispatch_float(x.dtype(), [&]<typename T>() {
    if (tile_2d) {
      const dim3 grid(unsigned((k + kFp8BlockLen - 1) / kFp8BlockLen), unsigned((m + kFp8BlockLen - 1) / kFp8BlockLen));
      MG_CHECK(grid.y <= 65535u, "fp8_block_quantize: {} rows are too many", m);
      block_quantize_128x128_kernel<T><<<grid, 256, 0, st>>>(dev_ptr<const T>(x), m, k, e4m3, power_of_two_scales,
                                                             fp8_max, max_finite<T>(), fp8_ptr(q), f32_ptr(scale_inv),
                                                             ld);
    } else {
      const int64_t warps = m * ((k + kFp8BlockLen - 1) / kFp8BlockLen);
      const int64_t blocks = (warps * 32 + 255) / 256;
      MG_CHECK(blocks <= INT32_MAX, "fp8_block_quantize: too many tiles ({})", warps);
      block_quantize_1x128_kernel<T><<<unsigned(blocks), 256, 0, st>>>(dev_ptr<const T>(x), m, k, e4m3,
                                                                       power_of_two_scales, fp8_max, max_finite<T>(),
                                                                       fp8_ptr(q), f32_ptr(scale_inv), ld);
    }
    CUDA_CHECK(cudaGetLastError());
  });
}

void fp8_block_quantize_transposed(Context& ctx, const Tensor& x, bool power_of_two_scales, Tensor& q_t,
                                   Tensor& scale_inv) {
  const auto [m, k] = ops::check_fp8_block_quantize_transposed(x, q_t, scale_inv);
  check_on_gpu({&x, &q_t, &scale_inv}, "fp8_block_quantize_transposed");
  if (m == 0 || k == 0) return;
  const dim3 grid(unsigned((k + kBlockTCols - 1) / kBlockTCols), unsigned((m + kFp8BlockLen - 1) / kFp8BlockLen));
  MG_CHECK(grid.y <= 65535u, "fp8_block_quantize_transposed: {} rows are too many", m);
  const bool wide_store = m % 16 == 0 && reinterpret_cast<uintptr_t>(q_t.raw_data()) % 16 == 0;
  dispatch_float(x.dtype(), [&]<typename T>() {
    block_quantize_1x128_t_kernel<T><<<grid, kBlockTThreads, 0, stream_of(ctx)>>>(
        dev_ptr<const T>(x), m, k, q_t.dtype() == DType::Float8E4M3, power_of_two_scales, fp8_max_of(q_t.dtype()),
        max_finite<T>(), fp8_ptr(q_t), f32_ptr(scale_inv), scale_inv.size(1), wide_store);
    CUDA_CHECK(cudaGetLastError());
  });
}

namespace {
// block_partial_kernel over the segments that the shard [start, start + n) touches.
void launch_block_partial(Context& ctx, const Tensor& x, int64_t start, int64_t cols, int64_t ld, float* amax,
                          const float* scale, uint8_t* q, bool e4m3) {
  const int64_t n = x.numel();
  if (n == 0) return;
  const int64_t tiles_c = (cols + kFp8BlockLen - 1) / kFp8BlockLen;
  auto segment = [&](int64_t f) { return (f / cols) * tiles_c + (f % cols) / kFp8BlockLen; };
  const int64_t first = segment(start), segs = segment(start + n - 1) - first + 1;
  const int64_t blocks = (segs * 32 + 255) / 256;
  MG_CHECK(blocks <= INT32_MAX, "fp8_block_partial: too many segments ({})", segs);
  dispatch_float(x.dtype(), [&]<typename T>() {
    block_partial_kernel<T><<<unsigned(blocks), 256, 0, stream_of(ctx)>>>(dev_ptr<const T>(x), start, n, cols, ld,
                                                                          first, segs, amax, scale, q, e4m3);
    CUDA_CHECK(cudaGetLastError());
  });
}
}  // namespace

void fp8_block_partial_amax(Context& ctx, const Tensor& x, int64_t start, int64_t cols, Tensor& amax) {
  Tensor none;
  ops::check_fp8_block_partial("fp8_block_partial_amax", x, start, cols, amax, none);
  check_on_gpu({&x, &amax}, "fp8_block_partial_amax");
  launch_block_partial(ctx, x, start, cols, amax.size(1), f32_ptr(amax), nullptr, nullptr, true);
}

void fp8_block_partial_quantize(Context& ctx, const Tensor& x, int64_t start, int64_t cols, const Tensor& scale,
                                Tensor& q) {
  ops::check_fp8_block_partial("fp8_block_partial_quantize", x, start, cols, scale, q);
  MG_CHECK(q.defined(), "fp8_block_partial_quantize: q must be given");
  check_on_gpu({&x, &scale, &q}, "fp8_block_partial_quantize");
  launch_block_partial(ctx, x, start, cols, scale.size(1), nullptr, f32_ptr(scale), fp8_ptr(q),
                       q.dtype() == DType::Float8E4M3);
}

}  // namespace megatron::cuda
