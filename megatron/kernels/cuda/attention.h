// The two implementations behind megatron::cuda::attention_forward / attention_backward and their
// fused-QKV forms attention_forward_qkv / attention_backward_qkv (kernels/cuda/attention.cu):
//  * cuDNN's fused flash attention through cudnn-frontend, for bf16 and fp16
//    (kernels/cuda/attention_cudnn.cpp, a host-only file compiled by g++: the frontend is heavy);
//  * row-wise CUDA kernels for every float dtype (fp32 compute), the fp32 path and the fallback
//    when cuDNN reports a configuration unsupported.
// Exposed here so the two halves can call each other and tests can pin a path.
#pragma once

#include <cstdint>
#include <string>

#include "megatron/kernels/ops.h"
#include "megatron/runtime/context.h"
#include "megatron/runtime/tensor.h"

namespace megatron::cuda {

/// Whether cuDNN's fused attention runs this configuration (bf16/fp16 q, k, v on ctx's device,
/// mask Causal or Documents), and if not, why. Builds (and caches) the graph, as the op would.
struct CudnnAttentionSupport {
  bool supported = false;
  std::string reason;
};
CudnnAttentionSupport cudnn_attention_support(Context& ctx, const Tensor& q, const Tensor& k, const AttnMask& mask,
                                              float softmax_scale, float dropout_p, bool backward);

/// cuDNN's fused attention; false (nothing launched) when cuDNN does not support the configuration
/// or a pointer is not 16-byte aligned. Shapes, dtypes and the mask are checked by the caller
/// (attention.cu).
bool cudnn_attention_forward(Context& ctx, const Tensor& q, const Tensor& k, const Tensor& v, const AttnMask& mask,
                             float softmax_scale, float dropout_p, uint64_t seed, uint64_t offset, Tensor& out,
                             Tensor& lse);
bool cudnn_attention_backward(Context& ctx, const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, const Tensor& lse, const AttnMask& mask, float softmax_scale,
                              float dropout_p, uint64_t seed, uint64_t offset, Tensor& grad_q, Tensor& grad_k,
                              Tensor& grad_v);

/// The same for attention read from the fused MHA QKV buffer (attention_forward_qkv): qkv
/// [s, b, 3·nq·d] bf16/fp16 holding q, k, v as strided views, out [s, b, nq, d]. Shapes and dtypes
/// are checked by the caller; false when cuDNN declines the strided configuration or a q/k/v
/// pointer (base + h·3d, + d, + 2d) is not 16-byte aligned (then the caller splits and retries).
CudnnAttentionSupport cudnn_attention_qkv_support(Context& ctx, const Tensor& qkv, const Tensor& out,
                                                  const AttnMask& mask, float softmax_scale, float dropout_p,
                                                  bool backward);
bool cudnn_attention_forward_qkv(Context& ctx, const Tensor& qkv, const AttnMask& mask, float softmax_scale,
                                 float dropout_p, uint64_t seed, uint64_t offset, Tensor& out, Tensor& lse);
bool cudnn_attention_backward_qkv(Context& ctx, const Tensor& grad_out, const Tensor& qkv, const Tensor& out,
                                  const Tensor& lse, const AttnMask& mask, float softmax_scale, float dropout_p,
                                  uint64_t seed, uint64_t offset, Tensor& grad_qkv);

/// The row-wise kernels (any float dtype, fp32 compute, dropout bit-compatible with the CPU
/// reference), with the same contract as attention_forward / attention_backward.
void attention_forward_rowwise(Context& ctx, const Tensor& q, const Tensor& k, const Tensor& v, const AttnMask& mask,
                               float softmax_scale, float dropout_p, uint64_t seed, uint64_t offset, Tensor& out,
                               Tensor& lse);
void attention_backward_rowwise(Context& ctx, const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
                                const Tensor& out, const Tensor& lse, const AttnMask& mask, float softmax_scale,
                                float dropout_p, uint64_t seed, uint64_t offset, Tensor& grad_q, Tensor& grad_k,
                                Tensor& grad_v);

/// Writes cuDNN's dropout seed and offset for our (seed, offset) as two int64 into device memory
/// `dst` on ctx's stream (cuDNN reads them from device tensors): the seed a mix of both, offset 0.
void write_cudnn_dropout_state(Context& ctx, int64_t* dst, uint64_t seed, uint64_t offset);

/// The device arrays by which cuDNN sees the Documents mask (Note [Documents on cuDNN] in
/// attention_cudnn.cpp), b·n entries (+ 1 for the offsets) for b batch rows of n documents.
struct CudnnDocumentIndex {
  int64_t* q_offsets;      // ragged offsets (elements) of each document's first row in q and dq
  int64_t* k_offsets;      // in k, v, dk, dv
  int64_t* o_offsets;      // in out and grad_out
  int64_t* stats_offsets;  // in lse [b, nq, s]
  int32_t* seq_lens;       // the documents' lengths, for both seq_len_q and seq_len_kv
};
/// Writes that index for mask.cu_seqlens on ctx's stream: q_row, k_row, o_row are the elements of one
/// (position, batch row) of q, k and out (nq·d, ng·d, nq·d; 3·nq·d for q and k in the fused buffer).
void write_cudnn_document_index(Context& ctx, const AttnMask& mask, int64_t b, int64_t s, int64_t nq, int64_t q_row,
                                int64_t k_row, int64_t o_row, const CudnnDocumentIndex& dst);

}  // namespace megatron::cuda
