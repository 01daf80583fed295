// Layout changes on CUDA: transpose_01 and the grouped QKV split/merge — the fast path of
// kernels/cpu/{layout,qkv}.cpp. All three are pure copies of contiguous rows, so they share one
// kernel: copy_rows walks destination-or-source rows, a small map says where each row comes from
// and goes, and the threads of a row copy it in the widest unit (16, 8, 4, 2 or 1 bytes) that the
// row size and every base pointer allow. No dtype conversion happens, so any dtype works.
//   transpose_01   out row (j, i) <- x row (i, j); a row is prod(rest) elements
//   qkv split      qkv row (t, g, slot) -> q/k/v head row; a row is one head of d elements
// A transpose whose rows are single elements of 1, 2, 4 or 8 bytes (a plain 2-D transpose, as the
// FP8 block-scaled weight gradient needs) goes through 32x32 tiles in shared memory instead, so
// that both its reads and its writes are coalesced.
#include <algorithm>
#include <utility>

#include "megatron/kernels/cuda/cuda_common.cuh"
#include "megatron/kernels/cuda/cuda_ops.h"

namespace megatron::cuda {

namespace {

template <typename U>
struct RowPtrs {
  const U* src;
  U* dst;
};

// Copies `rows` rows of `units` units each; map(row) gives the row's source and destination.
// Threads (x, y): x walks the units of a row, y picks one of blockDim.y rows per block.
template <typename U, typename Map>
__global__ void copy_rows_kernel(int64_t rows, int64_t units, Map map) {
  for (int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y; row < rows;
       row += int64_t(gridDim.x) * blockDim.y) {
    const RowPtrs<U> p = map(row);
    for (int64_t u = threadIdx.x; u < units; u += blockDim.x) p.dst[u] = p.src[u];
  }
}

template <typename U>
struct TransposeMap {
  const U* x;
  U* out;
  int64_t a, b, units;
  __device__ RowPtrs<U> operator()(int64_t row) const {  // row of out = j·a + i
    const int64_t j = row / a, i = row - j * a;
    return {x + (i * b + j) * units, out + row * units};
  }
};

// Walks qkv rows (t, g, slot) with slot in [0, per_group + 2): query heads, then key, then value.
// forward: qkv -> q/k/v; otherwise q/k/v -> qkv.
template <typename U>
struct QkvMap {
  U* qkv;
  U* q;
  U* k;
  U* v;
  int64_t nq, ng, per_group, units;
  bool forward;
  __device__ RowPtrs<U> operator()(int64_t row) const {
    const int64_t slots = per_group + 2;
    const int64_t tg = row / slots, slot = row - tg * slots;
    const int64_t t = tg / ng, g = tg - t * ng;
    U* part;
    if (slot < per_group) {
      part = q + (t * nq + g * per_group + slot) * units;
    } else {
      part = (slot == per_group ? k : v) + (t * ng + g) * units;
    }
    U* whole = qkv + row * units;
    return forward ? RowPtrs<U>{whole, part} : RowPtrs<U>{part, whole};
  }
};

// The widest copy unit dividing the row size and every pointer's address.
size_t copy_unit(size_t row_bytes, std::initializer_list<const void*> ptrs) {
  size_t unit = 16;
  while (unit > 1) {
    bool ok = row_bytes % unit == 0;
    for (const void* p : ptrs) ok = ok && reinterpret_cast<uintptr_t>(p) % unit == 0;
    if (ok) break;
    unit /= 2;
  }
  return unit;
}

// Calls f.template operator()<U>() with U the unsigned type of `unit` bytes.
template <typename F>
void dispatch_unit(size_t unit, F&& f) {
  switch (unit) {
    case 16:
      f.template operator()<uint4>();
      return;
    case 8:
      f.template operator()<uint2>();
      return;
    case 4:
      f.template operator()<uint32_t>();
      return;
    case 2:
      f.template operator()<uint16_t>();
      return;
    default:
      f.template operator()<uint8_t>();
      return;
  }
}

// out [b, a] = x [a, b]ᵀ of U elements: block (bx, by) takes the 32x32 tile x[by·32 .., bx·32 ..];
// threads (32, 8).
template <typename U>
__global__ void transpose_tiled_kernel(const U* __restrict__ x, U* __restrict__ out, int64_t a, int64_t b) {
  __shared__ U tile[32][33];
  const int64_t i0 = int64_t(blockIdx.y) * 32, j0 = int64_t(blockIdx.x) * 32;
  for (int r = threadIdx.y; r < 32; r += 8) {
    const int64_t i = i0 + r, j = j0 + threadIdx.x;
    if (i < a && j < b) tile[r][threadIdx.x] = x[i * b + j];
  }
  __syncthreads();
  for (int r = threadIdx.y; r < 32; r += 8) {
    const int64_t j = j0 + r, i = i0 + threadIdx.x;
    if (i < a && j < b) out[j * a + i] = tile[threadIdx.x][r];
  }
}

template <typename U, typename Map>
void launch_copy_rows(Context& ctx, int64_t rows, int64_t units, const Map& map) {
  if (rows == 0 || units == 0) return;
  // Short rows share a block: round the row's units up to a warp, fill the block with rows.
  const int bx = int(std::min<int64_t>(kBlockSize, (units + 31) / 32 * 32));
  const int by = kBlockSize / bx;
  const dim3 block{unsigned(bx), unsigned(by)};
  const unsigned grid = grid_for(rows, by);
  copy_rows_kernel<U, Map><<<grid, block, 0, stream_of(ctx)>>>(rows, units, map);
  CUDA_CHECK_LAUNCH();
}

void check_qkv_shapes(const Tensor& qkv, const Tensor& q, const Tensor& k, const Tensor& v) {
  check_cuda(qkv, "qkv");
  check_cuda(q, "q");
  check_cuda(k, "k");
  check_cuda(v, "v");
  MG_ASSERT(q.dim() == 4 && k.dim() == 4 && v.shape() == k.shape(), "q {} k {} v {}", shape_str(q.shape()),
            shape_str(k.shape()), shape_str(v.shape()));
  MG_ASSERT(k.size(2) > 0 && q.size(2) % k.size(2) == 0 && q.size(3) == k.size(3), "q {} k {}",
            shape_str(q.shape()), shape_str(k.shape()));
  MG_ASSERT(q.size(0) == k.size(0) && q.size(1) == k.size(1), "q {} k {}", shape_str(q.shape()),
            shape_str(k.shape()));
  MG_ASSERT(qkv.numel() == q.numel() + 2 * k.numel(), "qkv {} for q {} k {}", shape_str(qkv.shape()),
            shape_str(q.shape()), shape_str(k.shape()));
  MG_ASSERT(qkv.dtype() == q.dtype() && k.dtype() == q.dtype() && v.dtype() == q.dtype(), "mixed dtypes");
}

void qkv_copy(Context& ctx, const Tensor& qkv, const Tensor& q, const Tensor& k, const Tensor& v, bool forward) {
  const int64_t sb = q.size(0) * q.size(1), nq = q.size(2), ng = k.size(2), d = q.size(3);
  const int64_t per_group = nq / ng;
  const size_t es = size_of(q.dtype());
  const size_t unit = copy_unit(size_t(d) * es, {qkv.raw_data(), q.raw_data(), k.raw_data(), v.raw_data()});
  dispatch_unit(unit, [&]<typename U>() {
    QkvMap<U> map{static_cast<U*>(qkv.raw_data()),
                  static_cast<U*>(q.raw_data()),
                  static_cast<U*>(k.raw_data()),
                  static_cast<U*>(v.raw_data()),
                  nq,
                  ng,
                  per_group,
                  int64_t(size_t(d) * es / unit),
                  forward};
    launch_copy_rows<U>(ctx, sb * ng * (per_group + 2), map.units, map);
  });
}

}  // namespace

void transpose_01(Context& ctx, const Tensor& x, Tensor& out) {
  MG_ASSERT(x.defined() && out.defined() && x.dim() >= 2, "transpose_01 needs x [a, b, ...], got {}",
            x.defined() ? x.str() : "undefined");
  check_cuda(x, "x");
  check_cuda(out, "out");
  Shape want = x.shape();
  std::swap(want[0], want[1]);
  MG_ASSERT(out.shape() == want && out.dtype() == x.dtype(), "out is {}, expected {} {}", out.str(),
            to_string(x.dtype()), shape_str(want));
  MG_ASSERT(out.raw_data() != x.raw_data() || x.numel() == 0, "transpose_01 cannot run in place");
  const int64_t a = x.size(0), b = x.size(1);
  if (a * b == 0 || x.numel() == 0) return;
  const size_t row_bytes = x.nbytes() / size_t(a * b);
  if (row_bytes <= 8 && (row_bytes & (row_bytes - 1)) == 0) {  // rows of one element: tiles
    const dim3 grid(unsigned((b + 31) / 32), unsigned((a + 31) / 32));
    MG_CHECK(grid.y <= 65535u, "transpose_01: {} rows are too many for one tiled pass", a);
    dispatch_unit(row_bytes, [&]<typename U>() {
      transpose_tiled_kernel<U><<<grid, dim3(32, 8), 0, stream_of(ctx)>>>(static_cast<const U*>(x.raw_data()),
                                                                         static_cast<U*>(out.raw_data()), a, b);
    });
    CUDA_CHECK(cudaGetLastError());
    return;
  }
  const size_t unit = copy_unit(row_bytes, {x.raw_data(), out.raw_data()});
  dispatch_unit(unit, [&]<typename U>() {
    const int64_t units = int64_t(row_bytes / unit);
    TransposeMap<U> map{static_cast<const U*>(x.raw_data()), static_cast<U*>(out.raw_data()), a, b, units};
    launch_copy_rows<U>(ctx, a * b, units, map);
  });
}

void qkv_split_forward(Context& ctx, const Tensor& qkv, Tensor& q, Tensor& k, Tensor& v) {
  check_qkv_shapes(qkv, q, k, v);
  qkv_copy(ctx, qkv, q, k, v, /*forward=*/true);
}

void qkv_split_backward(Context& ctx, const Tensor& grad_q, const Tensor& grad_k, const Tensor& grad_v,
                        Tensor& grad_qkv) {
  check_qkv_shapes(grad_qkv, grad_q, grad_k, grad_v);
  qkv_copy(ctx, grad_qkv, grad_q, grad_k, grad_v, /*forward=*/false);
}

}  // namespace megatron::cuda
