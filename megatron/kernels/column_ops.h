// Column copies between row-major 2-D tensors: the splits and concatenations along the last
// dimension that multi-latent attention needs (Note [MLA tensor layout] in
// core/transformer/multi_latent_attention.h) — the compressed kv and the rope key out of
// linear_kv_down_proj's output, the rope part of each query head, the key heads built from their
// no-position part and the rope key shared by every head, and the value heads. Declared once into
// megatron::ops (dispatching, column_ops.cpp), megatron::cpu (kernels/cpu/columns.cpp, the
// reference) and megatron::cuda (kernels/cuda/columns.cu), as op_list.inc is for the other ops.
//
// copy_columns: src [R, Cs], dst [R, Cd] (2-D views of any tensor: R = rows, C its last dimension;
// one float dtype, one device). For every row r and j < width:
//   dst[r, dst_col + j] = src[r, src_col + j]                 (accumulate = false)
//   dst[r, dst_col + j] = dst[r, dst_col + j] + src[r, src_col + j]   (accumulate = true, fp32 math,
//                                                              rounded once to dst's dtype)
// Other columns of dst are untouched. The backward of a copy is the copy the other way (with
// accumulate where the forward broadcast one source to several places).
#pragma once

#include <cstdint>

#include "megatron/runtime/context.h"
#include "megatron/runtime/tensor.h"

namespace megatron::ops {
void copy_columns(Context& ctx, const Tensor& src, int64_t src_col, Tensor& dst, int64_t dst_col, int64_t width,
                  bool accumulate);
/// The checks both backends share: one float dtype and device, 2-D shapes, column ranges in bounds.
void check_copy_columns(const Tensor& src, int64_t src_col, const Tensor& dst, int64_t dst_col, int64_t width);
}  // namespace megatron::ops

namespace megatron::cpu {
void copy_columns(Context& ctx, const Tensor& src, int64_t src_col, Tensor& dst, int64_t dst_col, int64_t width,
                  bool accumulate);
}  // namespace megatron::cpu

#ifdef MEGATRON_WITH_CUDA_OPS
namespace megatron::cuda {
void copy_columns(Context& ctx, const Tensor& src, int64_t src_col, Tensor& dst, int64_t dst_col, int64_t width,
                  bool accumulate);
}  // namespace megatron::cuda
#endif
