// Context-parallel attention's helpers on CUDA, the fast path of kernels/cpu/attention_merge.cpp:
// attention_merge (Note [Merging attention over key blocks], kernels/op_list.inc) as one thread per
// (row, batch, head) walking its d channels, lse_copy_rows and copy_rows as stream-ordered
// device copies (nothing waits for the device, so the ring runs under a CUDA graph too).
#include <cmath>

#include "megatron/kernels/cuda/cuda_common.cuh"
#include "megatron/kernels/cuda/cuda_ops.h"

namespace megatron::cuda {

namespace {

template <typename T>
__global__ void attention_merge_kernel(const T* __restrict__ out_blk, const float* __restrict__ lse_blk,
                                       int64_t row_offset, int64_t r, int64_t b, int64_t nq, int64_t d, int64_t R,
                                       T* __restrict__ out_acc, float* __restrict__ lse_acc) {
  const int64_t n = r * b * nq;
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < n; idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t h = idx % nq, bi = (idx / nq) % b, i = idx / (nq * b);  // idx = (i·b + bi)·nq + h
    const float l2 = lse_blk[(bi * nq + h) * r + i];
    if (l2 == -INFINITY) continue;
    float* la = lse_acc + (bi * nq + h) * R + row_offset + i;
    const float l1 = *la;
    const float m = fmaxf(l1, l2);
    const float lse = m + logf(expf(l1 - m) + expf(l2 - m));
    const float w1 = expf(l1 - lse), w2 = expf(l2 - lse);
    T* acc = out_acc + (((row_offset + i) * b + bi) * nq + h) * d;
    const T* blk = out_blk + idx * d;
    for (int64_t e = 0; e < d; ++e) acc[e] = store_float<T>(w1 * load_float(acc[e]) + w2 * load_float(blk[e]));
    *la = lse;
  }
}

}  // namespace

void attention_merge(Context& ctx, const Tensor& out_blk, const Tensor& lse_blk, int64_t row_offset, Tensor& out_acc,
                     Tensor& lse_acc) {
  check_float_cuda(out_blk, "out_blk");
  check_float_cuda(out_acc, "out_acc");
  MG_ASSERT(out_blk.dim() == 4 && out_acc.dim() == 4 && out_acc.dtype() == out_blk.dtype(),
            "attention_merge: out_blk {} and out_acc {}", out_blk.str(), out_acc.str());
  const int64_t r = out_blk.size(0), b = out_blk.size(1), nq = out_blk.size(2), d = out_blk.size(3);
  const int64_t R = out_acc.size(0);
  MG_ASSERT(out_acc.size(1) == b && out_acc.size(2) == nq && out_acc.size(3) == d && row_offset >= 0 &&
                row_offset + r <= R,
            "attention_merge: rows [{}, +{}) of out_acc {}", row_offset, r, out_acc.str());
  check_fp32(lse_blk, b * nq * r, "lse_blk");
  check_fp32(lse_acc, b * nq * R, "lse_acc");
  if (r * b * nq == 0) return;
  dispatch_float(out_blk.dtype(), [&]<typename T>() {
    attention_merge_kernel<T><<<grid_for(r * b * nq), kBlockSize, 0, stream_of(ctx)>>>(
        dev_ptr<T>(out_blk), dev_ptr<float>(lse_blk), row_offset, r, b, nq, d, R, dev_ptr<T>(out_acc),
        dev_ptr<float>(lse_acc));
  });
  CUDA_CHECK(cudaGetLastError());
}

void lse_copy_rows(Context& ctx, const Tensor& src, int64_t src_row, Tensor& dst, int64_t dst_row, int64_t rows) {
  check_cuda(src, "src");
  check_cuda(dst, "dst");
  MG_ASSERT(src.dim() == 3 && dst.dim() == 3 && src.dtype() == DType::Float32 && dst.dtype() == DType::Float32 &&
                src.size(0) == dst.size(0) && src.size(1) == dst.size(1) && src_row >= 0 && dst_row >= 0 &&
                src_row + rows <= src.size(2) && dst_row + rows <= dst.size(2),
            "lse_copy_rows: rows [{}, +{}) of {} into [{}, +{}) of {}", src_row, rows, src.str(), dst_row, rows,
            dst.str());
  if (rows == 0 || src.size(0) * src.size(1) == 0) return;
  // One 2-D copy: b·nq rows of `rows` floats, each at its own pitch.
  CUDA_CHECK(cudaMemcpy2DAsync(dev_ptr<float>(dst) + dst_row, size_t(dst.size(2)) * sizeof(float),
                               dev_ptr<float>(src) + src_row, size_t(src.size(2)) * sizeof(float),
                               size_t(rows) * sizeof(float), size_t(src.size(0) * src.size(1)),
                               cudaMemcpyDeviceToDevice, stream_of(ctx)));
}

void copy_rows(Context& ctx, const Tensor& src, int64_t src_row, Tensor& dst, int64_t dst_row, int64_t rows) {
  check_cuda(src, "src");
  check_cuda(dst, "dst");
  MG_ASSERT(src.dim() >= 1 && dst.dim() >= 1 && src.dtype() == dst.dtype(), "copy_rows: src {} and dst {}", src.str(),
            dst.str());
  const int64_t row_elems = src.size(0) == 0 ? 0 : src.numel() / src.size(0);
  MG_ASSERT((dst.size(0) == 0 || dst.numel() / dst.size(0) == row_elems) && src_row >= 0 && dst_row >= 0 &&
                src_row + rows <= src.size(0) && dst_row + rows <= dst.size(0),
            "copy_rows: rows [{}, +{}) of {} into [{}, +{}) of {}", src_row, rows, src.str(), dst_row, rows, dst.str());
  const size_t row_bytes = size_t(row_elems) * size_of(src.dtype());
  if (rows == 0 || row_bytes == 0) return;
  CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(dst.raw_data()) + size_t(dst_row) * row_bytes,
                             static_cast<const char*>(src.raw_data()) + size_t(src_row) * row_bytes,
                             size_t(rows) * row_bytes, cudaMemcpyDeviceToDevice, stream_of(ctx)));
}

}  // namespace megatron::cuda
