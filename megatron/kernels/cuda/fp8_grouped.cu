// The grouped FP8 ops on the GPU (Note [Grouped quantisation], fp8_ops.h): fp8_quantize_grouped —
// tables of members, a 64x64 tile of one member a block — and fp8_delayed_scale_update_grouped.
// The CPU reference is the loop of the single ops (kernels/cpu/fp8.cpp); the bits are the same.
#include <cuda_fp8.h>

#include <algorithm>
#include <cfloat>

#include "megatron/kernels/cuda/cuda_common.cuh"
#include "megatron/kernels/cuda/cuda_ops.h"
#include "megatron/kernels/cuda/fp8_common.cuh"
#include "megatron/kernels/cuda/fp8_tile.cuh"
#include "megatron/kernels/fp8_ops.h"

namespace megatron::cuda {

namespace {

// ---- grouped quantise (Note [Grouped quantisation]) -------------------------------------------------

// One member of a grouped launch: its tensors (null: not wanted), x [m, k], q_t's row length p and
// its first tile in the launch's grid (tiles_x column tiles a row of tiles).
struct GroupMember {
  const void* x;
  uint8_t* q;
  uint8_t* q_t;
  float* scale;
  float* amax;
  float* scale_inv;
  int64_t m, k, p, first_tile;
  int tiles_x;
  bool wide_store;
};
constexpr int kGroupChunk = 32;  // members per launch: the table stays under 4 KB of parameters
struct GroupTable {
  GroupMember mem[kGroupChunk];
  int count;
};

// A member without a transposed copy — and every member in the amax pass — needs no tile: its
// blocks take flat chunks of kFlatChunk 16-byte vectors of x in row-major order (the rows are
// contiguous), each thread kFlatVecs of them a warp-width apart, all loaded before any is
// converted. A 64x64 tile moves 8 KB of bf16 a block; a chunk moves 16 KB in one coalesced
// sweep, without the shared tile. Measured (H200, bench/moe_grouped_gemm --fp8, 64 weights of
// 2048 x 2048): the weights' forward copies at 1.1 TB/s as tiles whose member a linear scan of the
// table found, 3.9 TB/s as chunks with the binary search below; the transposed copies 1.1 -> 2.8.
constexpr int kFlatVecs = 4;
constexpr int64_t kFlatChunk = int64_t(kVecThreads) * kFlatVecs;

__host__ __device__ inline bool flat_member(const GroupMember& mb, bool amax_pass) {
  return amax_pass || mb.q_t == nullptr;
}

// A member with a transposed copy: each block takes kTileRowsPerBlock 64x64 tiles down one column
// of tiles, one after the other (the block's setup — finding its member, reading the scale — paid
// once for them).
constexpr int64_t kTileRowsPerBlock = 2;

// The blocks a member takes in one pass: flat chunks, or runs of tiles over the rows its codes
// cover (q_t's p).
int64_t member_blocks(const GroupMember& mb, bool amax_pass, int64_t vec) {
  if (flat_member(mb, amax_pass)) return (mb.m * mb.k / vec + kFlatChunk - 1) / kFlatChunk;
  const int64_t row_tiles = (mb.p + kVecTile - 1) / kVecTile;
  return (row_tiles + kTileRowsPerBlock - 1) / kTileRowsPerBlock * mb.tiles_x;
}

// Chunk `chunk` of x's nvec vectors: codes into q (null: none); returns the thread's amax.
template <typename T>
__device__ __forceinline__ float quantize_flat_chunk(const T* __restrict__ x, int64_t nvec, int64_t chunk, float s,
                                                     uint8_t* __restrict__ q, bool e4m3) {
  constexpr int V = int(16 / sizeof(T));
  using Codes = std::conditional_t<V == 8, uint2, uint32_t>;
  const int64_t first = chunk * kFlatChunk + threadIdx.x;
  uint4 raw[kFlatVecs];
#pragma unroll
  for (int j = 0; j < kFlatVecs; ++j) {
    const int64_t i = first + int64_t(j) * kVecThreads;
    raw[j] = i < nvec ? reinterpret_cast<const uint4*>(x)[i] : make_uint4(0u, 0u, 0u, 0u);
  }
  float local = 0.0f;
#pragma unroll
  for (int j = 0; j < kFlatVecs; ++j) {
    const int64_t i = first + int64_t(j) * kVecThreads;
    const Codes codes = quantize_vector<T, Codes>(raw[j], s, e4m3, local);
    if (i < nvec && q != nullptr) reinterpret_cast<Codes*>(q)[i] = codes;
  }
  return local;
}

// amax_pass: each member's max |x| into its amax (zeroed before). Else the codes: scale from the
// member's amax (current scaling: fp8_scale_from_amax's arithmetic, stored by the member's first
// block with scale_inv) or its scale, recording the amax where the member has one (delayed).
template <typename T>
__global__ void __launch_bounds__(kVecThreads)
    quantize_grouped_kernel(const __grid_constant__ GroupTable g, bool amax_pass, bool current, float fp8_max,
                            bool e4m3) {
  const int64_t b = blockIdx.x;
  int i = 0, hi = g.count - 1;  // the last member whose first block is at most b (every member has one)
  while (i < hi) {
    const int mid = (i + hi + 1) / 2;
    if (g.mem[mid].first_tile <= b) {
      i = mid;
    } else {
      hi = mid - 1;
    }
  }
  const GroupMember& mb = g.mem[i];
  const int64_t t = b - mb.first_tile;
  float s = 1.0f;
  if (!amax_pass) {
    s = current ? scale_from_amax(*mb.amax, fp8_max, /*pow2=*/false, FLT_MAX) : *mb.scale;
    if (t == 0 && threadIdx.x == 0) {
      if (current) *mb.scale = s;
      if (mb.scale_inv != nullptr) *mb.scale_inv = __frcp_rn(s);
    }
  }
  float local;
  if (flat_member(mb, amax_pass)) {  // uniform across the block
    local = quantize_flat_chunk<T>(static_cast<const T*>(mb.x), mb.m * mb.k / int64_t(16 / sizeof(T)), t, s,
                                   amax_pass ? nullptr : mb.q, e4m3);
  } else {
    local = 0.0f;
    const int64_t first_row = t / mb.tiles_x * kTileRowsPerBlock * kVecTile, c0 = t % mb.tiles_x * kVecTile;
    for (int j = 0; j < kTileRowsPerBlock; ++j) {
      const int64_t r0 = first_row + j * kVecTile;
      if (r0 >= mb.p) break;  // uniform across the block
      if (j > 0) __syncthreads();  // the shared tile is written again
      local = fmaxf(local, quantize_tile<T>(TensorRows<T>{static_cast<const T*>(mb.x), mb.k}, mb.m, mb.k, mb.p, r0,
                                            c0, s, mb.q, mb.q_t, e4m3, mb.wide_store, nullptr, 0));
    }
  }
  if (amax_pass || (!current && mb.amax != nullptr)) {
    local = block_max(local);
    if (threadIdx.x == 0) atomic_max_nonneg(mb.amax, local);
  }
}

__global__ void zero_group_amax_kernel(const __grid_constant__ GroupTable g) {
  if (int(threadIdx.x) < g.count) *g.mem[threadIdx.x].amax = 0.0f;
}

// dbias[c] += Σ_t partial[t·k + c], the row tiles in order.

// fp8_delayed_scale_update_grouped: a block per state, a thread per tensor of it.
struct UpdateMember {
  float* h;
  float* scale;
  int64_t len, n;
};
constexpr int kUpdateChunk = 96;  // states per launch: the table stays under 4 KB
struct UpdateTable {
  UpdateMember mem[kUpdateChunk];
  int count;
};
__global__ void delayed_scale_update_grouped_kernel(const __grid_constant__ UpdateTable g, float scaled_max,
                                                    bool use_max) {
  const UpdateMember& mb = g.mem[blockIdx.x];
  for (int64_t j = threadIdx.x; j < mb.n; j += blockDim.x)
    delayed_update_column(mb.h, mb.len, mb.n, j, mb.scale, scaled_max, use_max);
}

}  // namespace

// Note [Grouped quantisation]: the members the tile pass takes go in tables of kGroupChunk; the
// others (a width not a multiple of the vector, unaligned tensors) take the single ops, their padding
// a strided copy.
void fp8_quantize_grouped(Context& ctx, const std::vector<Tensor>& x, std::vector<Tensor>& scale,
                          std::vector<Tensor>& q, std::vector<Tensor>& q_t, std::vector<Tensor>& amax,
                          std::vector<Tensor>& scale_inv, bool current_scaling, float fp8_max) {
  const size_t n = ops::check_fp8_quantize_grouped(x, scale, q, q_t, amax, scale_inv, current_scaling);
  if (n == 0) return;
  Tensor none;
  auto at = [&none](std::vector<Tensor>& v, size_t i) -> Tensor& { return v.empty() ? none : v[i]; };
  for (size_t i = 0; i < n; ++i) {
    check_on_gpu({&x[i], &scale[i], &at(q, i), &at(q_t, i), &at(amax, i), &at(scale_inv, i)}, "fp8_quantize_grouped");
  }
  const DType code_type = !q.empty() ? q[0].dtype() : (!q_t.empty() ? q_t[0].dtype() : DType::Float8E4M3);
  const bool e4m3 = code_type == DType::Float8E4M3;
  cudaStream_t st = stream_of(ctx);
  const auto addr = [](const Tensor& t) { return reinterpret_cast<uintptr_t>(t.raw_data()); };
  std::vector<size_t> single;
  dispatch_float(x[0].dtype(), [&]<typename T>() {
    constexpr int64_t V = int64_t(16 / sizeof(T));
    std::vector<GroupMember> members;
    for (size_t i = 0; i < n; ++i) {
      const Tensor &qi = at(q, i), &qt = at(q_t, i);
      const int64_t m = x[i].size(0), k = x[i].size(1);
      if (k % V != 0 || addr(x[i]) % 16 != 0 || (qi.defined() && addr(qi) % uintptr_t(V) != 0)) {
        single.push_back(i);
        continue;
      }
      const int64_t p = qt.defined() ? qt.size(1) : m;
      members.push_back({x[i].raw_data(), fp8_ptr(qi), fp8_ptr(qt), f32_ptr(scale[i]), f32_ptr(at(amax, i)),
                         f32_ptr(at(scale_inv, i)), m, k, p, 0, int((k + kVecTile - 1) / kVecTile),
                         p % 16 == 0 && (!qt.defined() || addr(qt) % 16 == 0)});
    }
    for (size_t c0 = 0; c0 < members.size(); c0 += kGroupChunk) {
      GroupTable table{};
      table.count = int(std::min<size_t>(kGroupChunk, members.size() - c0));
      // each member's first block for one pass
      auto lay_out = [&](bool amax_pass) {
        int64_t tiles = 0;
        for (int j = 0; j < table.count; ++j) {
          GroupMember& mb = table.mem[j];
          mb.first_tile = tiles;
          tiles += member_blocks(mb, amax_pass, V);
        }
        return tiles;
      };
      for (int j = 0; j < table.count; ++j) table.mem[j] = members[c0 + size_t(j)];
      if (current_scaling) {
        zero_group_amax_kernel<<<1, kGroupChunk, 0, st>>>(table);
        const int64_t tiles = lay_out(true);
        quantize_grouped_kernel<T><<<unsigned(tiles), kVecThreads, 0, st>>>(table, true, true, fp8_max, e4m3);
        CUDA_CHECK(cudaGetLastError());
      }
      const int64_t tiles = lay_out(false);
      quantize_grouped_kernel<T><<<unsigned(tiles), kVecThreads, 0, st>>>(table, false, current_scaling, fp8_max, e4m3);
      CUDA_CHECK(cudaGetLastError());
    }
  });
  for (size_t i : single) {
    Tensor &qi = at(q, i), &ai = at(amax, i), &si = at(scale_inv, i);
    const Tensor padded = at(q_t, i);
    const int64_t m = x[i].size(0), k = x[i].size(1);
    Tensor qt = padded.defined() ? Tensor::empty({k, m}, padded.dtype(), padded.device()) : none;
    ops::fp8_quantize_member(ctx, x[i], scale[i], qi, qt, ai, si, current_scaling, fp8_max);
    if (!padded.defined()) continue;
    const size_t p = size_t(padded.size(1));
    CUDA_CHECK(cudaMemcpy2DAsync(padded.raw_data(), p, qt.raw_data(), size_t(m), size_t(m), size_t(k),
                                 cudaMemcpyDeviceToDevice, st));
    if (p > size_t(m)) {
      CUDA_CHECK(cudaMemset2DAsync(fp8_ptr(padded) + m, p, 0, p - size_t(m), size_t(k), st));
    }
  }
}

void fp8_delayed_scale_update_grouped(Context& ctx, std::vector<Tensor>& amax_histories, std::vector<Tensor>& scales,
                                      const Fp8DelayedParams& p) {
  MG_CHECK(amax_histories.size() == scales.size(), "fp8_delayed_scale_update_grouped: {} histories for {} scales",
           amax_histories.size(), scales.size());
  std::vector<UpdateMember> members;
  for (size_t i = 0; i < scales.size(); ++i) {
    const auto [len, n] = ops::check_fp8_delayed_scale_update(amax_histories[i], scales[i]);
    check_on_gpu({&amax_histories[i], &scales[i]}, "fp8_delayed_scale_update_grouped");
    if (n > 0) members.push_back({f32_ptr(amax_histories[i]), f32_ptr(scales[i]), len, n});
  }
  for (size_t c0 = 0; c0 < members.size(); c0 += kUpdateChunk) {
    UpdateTable table{};
    table.count = int(std::min<size_t>(kUpdateChunk, members.size() - c0));
    for (int j = 0; j < table.count; ++j) table.mem[j] = members[c0 + size_t(j)];
    delayed_scale_update_grouped_kernel<<<unsigned(table.count), 32, 0, stream_of(ctx)>>>(table, p.scaled_max(),
                                                                                         p.use_max);
    CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace megatron::cuda
