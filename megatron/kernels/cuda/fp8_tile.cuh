// The vector quantisation every per-tensor FP8 pass shares (fp8.cu: the single tensor's passes;
// fp8_grouped.cu: Note [Grouped quantisation]): one 16-byte vector quantised, the tensor source, and
// one 64x64 tile of the transposing pass.
#pragma once

#include <type_traits>

#include "megatron/kernels/cuda/fp8_common.cuh"

namespace megatron::cuda {

// Note [Quantisation kernels]: memory-bound passes, so (1) each thread moves 16 bytes of x at a
// time where the tensor allows (alignment and a multiple of the vector), (2) the amax is reduced
// within the block first and then one atomic max per block (a same-address atomic per warp
// serialises: it made the transposed pass ~7x slower than the memory allows), and (3) the
// transposed copy is written 4 bytes per thread (a warp writes 128 consecutive bytes of q_t).

// One 16-byte vector of x (V = 16 / sizeof(T) elements) quantised: the V codes packed into Codes,
// amax = fmax(amax, |x|) over them, and colsum[e] += x_e where colsum is given.
template <typename T, typename Codes>
__device__ __forceinline__ Codes quantize_vector(const uint4& raw, float s, bool e4m3, float& amax,
                                                 float* colsum = nullptr) {
  constexpr int V = int(16 / sizeof(T));
  static_assert(sizeof(Codes) == V, "one code byte per element");
  const T* v = reinterpret_cast<const T*>(&raw);
  union {
    Codes packed;
    uint8_t b[V];
  } codes;
#pragma unroll
  for (int e = 0; e < V; ++e) {
    const float f = load_float(v[e]);
    amax = fmaxf(amax, fabsf(f));
    if (colsum != nullptr) colsum[e] += f;
    codes.b[e] = encode_fp8(f * s, e4m3);
  }
  return codes.packed;
}

// Note [Quantisation sources]: where the vector passes get x [m, k], one 16-byte vector (V =
// 16 / sizeof(T) elements, c a multiple of V) at a time — load(r, c), or (a tensor) load_vec(i) for
// the i-th vector in row-major order: a tensor, or values computed in the pass from the activation's
// operands (Note [Quantising inside the activation], fp8_ops.h), rounded to T as the activation
// kernels store them.
template <typename T>
struct TensorRows {  // x itself
  const T* x;
  int64_t k;
  __device__ uint4 load(int64_t r, int64_t c) const { return *reinterpret_cast<const uint4*>(x + r * k + c); }
  __device__ uint4 load_vec(int64_t i) const { return reinterpret_cast<const uint4*>(x)[i]; }
};

// Note [Vectorised transposed quantise]: the pass that writes q_t (every output gradient; x's and
// the weight's transposed copies) moves 16 bytes of x per thread, as the flat pass does. Block
// (bx, by) takes the 64x64 tile x[by·64 .. +64, bx·64 .. +64] with 256 threads: each loads its
// rows' 16-byte vectors (all loads issued before any conversion), stores the codes to q and into a
// shared tile, and then writes 16 consecutive bytes of one q_t row (a column of the tile; a warp
// reads 32 neighbouring tile columns: no bank conflicts). With col_partial it also sums the tile's
// columns in a fixed order — each thread its rows, then the threads in row order — into
// col_partial [gridDim.y, k], which column_partials_finish_kernel adds up tile by tile: the bias
// gradient of the output gradient at no extra pass over it (TE's cast_transpose_dbias), and
// deterministic. Needs k % (16 / sizeof(T)) == 0 and 16-byte aligned x (Note [Quantisation
// sources]: or the tensors it is computed from); the codes' stores need q aligned to the vector;
// q_t's 16-byte stores need m % 16 == 0 (else bytes).
constexpr int kVecTile = 64, kVecThreads = 256;

// One tile of Note [Vectorised transposed quantise]: x[r0 .. +64, c0 .. +64] of x [m, k], with q_t's
// rows p >= m long (Note [Grouped quantisation]: the tile's rows m .. p are zero codes, the GEMM's
// padding). q, q_t and col_partial may be null (none of them: an amax pass). Returns the thread's
// amax; every thread of the block must call it (it synchronises the block).
template <typename T, typename Src>
__device__ __forceinline__ float quantize_tile(const Src& x, int64_t m, int64_t k, int64_t p, int64_t r0, int64_t c0,
                                               float s, uint8_t* __restrict__ q, uint8_t* __restrict__ q_t, bool e4m3,
                                               bool wide_store, float* __restrict__ col_partial, int64_t tile_row) {
  constexpr int V = int(16 / sizeof(T));                     // elements per 16-byte load
  constexpr int kLanesPerRow = kVecTile / V;                 // 8 (16-bit x) or 16 (fp32)
  constexpr int kRowsPerPass = kVecThreads / kLanesPerRow;   // 32 or 16
  constexpr int kPasses = kVecTile / kRowsPerPass;           // 2 or 4
  static_assert(V == 4 || V == 8, "16-byte vectors of 2- or 4-byte elements");
  using Codes = std::conditional_t<V == 8, uint2, uint32_t>;
  __shared__ __align__(16) uint8_t tile[kVecTile][kVecTile + 8];
  __shared__ float sums[kRowsPerPass][kVecTile + 1];
  const int lane_c = int(threadIdx.x) % kLanesPerRow * V, lane_r = int(threadIdx.x) / kLanesPerRow;
  const int64_t c = c0 + lane_c;
  const bool col_in = c < k;  // k % V == 0: a vector is wholly inside or outside
  const int64_t rows_t = q_t != nullptr ? p : m;  // rows the tile's codes cover
  uint4 raw[kPasses];
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    const int64_t r = r0 + pass * kRowsPerPass + lane_r;
    raw[pass] = col_in && r < m ? x.load(r, c) : make_uint4(0u, 0u, 0u, 0u);
  }
  float local = 0.0f;
  float colsum[V];
#pragma unroll
  for (int e = 0; e < V; ++e) colsum[e] = 0.0f;
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    const int i = pass * kRowsPerPass + lane_r;
    const int64_t r = r0 + i;
    const Codes codes = quantize_vector<T, Codes>(raw[pass], s, e4m3, local, colsum);
    if (col_in && r < m && q != nullptr) *reinterpret_cast<Codes*>(q + r * k + c) = codes;
    if (col_in && r < rows_t && q_t != nullptr) *reinterpret_cast<Codes*>(&tile[i][lane_c]) = codes;
  }
  if (col_partial != nullptr) {
#pragma unroll
    for (int e = 0; e < V; ++e) sums[lane_r][lane_c + e] = colsum[e];
  }
  __syncthreads();
  if (q_t != nullptr) {  // q_t[col, r .. r + 16) for the tile's column cc, rows seg .. seg + 16
    const int cc = int(threadIdx.x) % kVecTile, seg = int(threadIdx.x) / kVecTile * 16;
    const int64_t col = c0 + cc, r = r0 + seg;
    if (col < k && r < p) {
      uint8_t* dst = q_t + col * p + r;
      if (wide_store) {
        union {
          uint4 v;
          uint8_t b[16];
        } out;
#pragma unroll
        for (int e = 0; e < 16; ++e) out.b[e] = tile[seg + e][cc];
        *reinterpret_cast<uint4*>(dst) = out.v;
      } else {
        for (int e = 0; e < 16 && r + e < p; ++e) dst[e] = tile[seg + e][cc];
      }
    }
  }
  if (col_partial != nullptr && threadIdx.x < kVecTile) {
    const int64_t col = c0 + threadIdx.x;
    float total = 0.0f;
    for (int j = 0; j < kRowsPerPass; ++j) total += sums[j][threadIdx.x];
    if (col < k) col_partial[tile_row * k + col] = total;
  }
  return local;
}

}  // namespace megatron::cuda
