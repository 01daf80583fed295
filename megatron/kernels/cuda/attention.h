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

#include "megatron/runtime/context.h"
#include "megatron/runtime/tensor.h"

namespace megatron::cuda {

/// Whether cuDNN's fused attention runs this configuration (bf16/fp16 q, k, v on ctx's device),
/// and if not, why. Builds (and caches) the graph, as the op would.
struct CudnnAttentionSupport {
  bool supported = false;
  std::string reason;
};
CudnnAttentionSupport cudnn_attention_support(Context& ctx, const Tensor& q, const Tensor& k, float softmax_scale,
                                              float dropout_p, bool backward);

/// cuDNN's fused attention; false (nothing launched) when cuDNN does not support the configuration
/// or a pointer is not 16-byte aligned. Shapes and dtypes are checked by the caller (attention.cu).
bool cudnn_attention_forward(Context& ctx, const Tensor& q, const Tensor& k, const Tensor& v, float softmax_scale,
                             float dropout_p, uint64_t seed, uint64_t offset, Tensor& out, Tensor& lse);
bool cudnn_attention_backward(Context& ctx, const Tensor& grad_out, const Tensor& q, const Tensor& k,
                              const Tensor& v, const Tensor& out, const Tensor& lse, float softmax_scale,
                              float dropout_p, uint64_t seed, uint64_t offset, Tensor& grad_q, Tensor& grad_k,
                              Tensor& grad_v);

/// The same for attention read from the fused MHA QKV buffer (attention_forward_qkv): qkv
/// [s, b, 3·nq·d] bf16/fp16 holding q, k, v as strided views, out [s, b, nq, d]. Shapes and dtypes
/// are checked by the caller; false when cuDNN declines the strided configuration or a q/k/v
/// pointer (base + h·3d, + d, + 2d) is not 16-byte aligned (then the caller splits and retries).
CudnnAttentionSupport cudnn_attention_qkv_support(Context& ctx, const Tensor& qkv, const Tensor& out,
                                                  float softmax_scale, float dropout_p, bool backward);
bool cudnn_attention_forward_qkv(Context& ctx, const Tensor& qkv, float softmax_scale, float dropout_p,
                                 uint64_t seed, uint64_t offset, Tensor& out, Tensor& lse);
bool cudnn_attention_backward_qkv(Context& ctx, const Tensor& grad_out, const Tensor& qkv, const Tensor& out,
                                  const Tensor& lse, float softmax_scale, float dropout_p, uint64_t seed,
                                  uint64_t offset, Tensor& grad_qkv);

/// The row-wise kernels (any float dtype, fp32 compute, dropout bit-compatible with the CPU
/// reference), with the same contract as attention_forward / attention_backward.
void attention_forward_rowwise(Context& ctx, const Tensor& q, const Tensor& k, const Tensor& v, float softmax_scale,
                               float dropout_p, uint64_t seed, uint64_t offset, Tensor& out, Tensor& lse);
void attention_backward_rowwise(Context& ctx, const Tensor& grad_out, const Tensor& q, const Tensor& k,
                                const Tensor& v, const Tensor& out, const Tensor& lse, float softmax_scale,
                                float dropout_p, uint64_t seed, uint64_t offset, Tensor& grad_q, Tensor& grad_k,
                                Tensor& grad_v);

/// Writes cuDNN's dropout seed and offset for our (seed, offset) as two int64 into device memory
/// `dst` on ctx's stream (cuDNN reads them from device tensors): the seed a mix of both, offset 0.
void write_cudnn_dropout_state(Context& ctx, int64_t* dst, uint64_t seed, uint64_t offset);

}  // namespace megatron::cuda
