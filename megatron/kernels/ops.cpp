// Dispatch: each op runs on the Context's device — the CPU reference, or the CUDA fast path when
// the build has the CUDA op library (MEGATRON_WITH_CUDA_OPS).
#include "megatron/kernels/ops.h"

#include <fmt/format.h>

#include "megatron/kernels/cpu/cpu_ops.h"
#include "megatron/runtime/profiler.h"
#ifdef MEGATRON_WITH_CUDA_OPS
#include "megatron/kernels/cuda/cuda_ops.h"  // megatron::cuda::<op>
#endif

namespace megatron::ops {

namespace {
// True when the op must run on the GPU; refuses a CUDA Context when this build has no CUDA kernels.
bool on_cuda(const Context& ctx, const char* op) {
#ifdef MEGATRON_WITH_CUDA_OPS
  (void)op;
  return ctx.is_cuda();
#else
  MG_CHECK(!ctx.is_cuda(), "op {} was asked to run on {} but this build has no CUDA kernels: run on the CPU", op,
           ctx.device().str());
  return false;
#endif
}
}  // namespace

bool has_cuda_kernels() {
#ifdef MEGATRON_WITH_CUDA_OPS
  return true;
#else
  return false;
#endif
}

void embedding_forward(Context& ctx, const Tensor& tokens, const Tensor& position_ids, const Tensor& word_weight,
                       const Tensor& pos_weight, Tensor& out) {
  ProfileScope profile(ctx, "embedding_forward");
#ifdef MEGATRON_WITH_CUDA_OPS
  if (on_cuda(ctx, "embedding_forward"))
    return cuda::embedding_forward(ctx, tokens, position_ids, word_weight, pos_weight, out);
#else
  on_cuda(ctx, "embedding_forward");
#endif
  return cpu::embedding_forward(ctx, tokens, position_ids, word_weight, pos_weight, out);
}

void embedding_backward(Context& ctx, const Tensor& tokens, const Tensor& position_ids, const Tensor& grad_out,
                        Tensor& word_grad, Tensor& pos_grad) {
  ProfileScope profile(ctx, "embedding_backward");
#ifdef MEGATRON_WITH_CUDA_OPS
  if (on_cuda(ctx, "embedding_backward"))
    return cuda::embedding_backward(ctx, tokens, position_ids, grad_out, word_grad, pos_grad);
#else
  on_cuda(ctx, "embedding_backward");
#endif
  return cpu::embedding_backward(ctx, tokens, position_ids, grad_out, word_grad, pos_grad);
}

void layernorm_forward(Context& ctx, const Tensor& x, const Tensor& weight, const Tensor& bias, float eps,
                       bool zero_centered_gamma, Tensor& out, Tensor& mean, Tensor& rstd) {
  ProfileScope profile(ctx, "layernorm_forward");
#ifdef MEGATRON_WITH_CUDA_OPS
  if (on_cuda(ctx, "layernorm_forward"))
    return cuda::layernorm_forward(ctx, x, weight, bias, eps, zero_centered_gamma, out, mean, rstd);
#else
  on_cuda(ctx, "layernorm_forward");
#endif
  return cpu::layernorm_forward(ctx, x, weight, bias, eps, zero_centered_gamma, out, mean, rstd);
}

void layernorm_backward(Context& ctx, const Tensor& grad_out, const Tensor& x, const Tensor& weight, const Tensor& mean,
                        const Tensor& rstd, bool zero_centered_gamma, Tensor& grad_in, Tensor& weight_grad,
                        Tensor& bias_grad) {
  ProfileScope profile(ctx, "layernorm_backward");
#ifdef MEGATRON_WITH_CUDA_OPS
  if (on_cuda(ctx, "layernorm_backward"))
    return cuda::layernorm_backward(ctx, grad_out, x, weight, mean, rstd, zero_centered_gamma, grad_in, weight_grad,
                                    bias_grad);
#else
  on_cuda(ctx, "layernorm_backward");
#endif
  return cpu::layernorm_backward(ctx, grad_out, x, weight, mean, rstd, zero_centered_gamma, grad_in, weight_grad,
                                 bias_grad);
}

void rmsnorm_forward(Context& ctx, const Tensor& x, const Tensor& weight, float eps, bool zero_centered_gamma,
                     Tensor& out, Tensor& rstd) {
  ProfileScope profile(ctx, "rmsnorm_forward");
#ifdef MEGATRON_WITH_CUDA_OPS
  if (on_cuda(ctx, "rmsnorm_forward"))
    return cuda::rmsnorm_forward(ctx, x, weight, eps, zero_centered_gamma, out, rstd);
#else
  on_cuda(ctx, "rmsnorm_forward");
#endif
  return cpu::rmsnorm_forward(ctx, x, weight, eps, zero_centered_gamma, out, rstd);
}

void rmsnorm_backward(Context& ctx, const Tensor& grad_out, const Tensor& x, const Tensor& weight, const Tensor& rstd,
                      bool zero_centered_gamma, Tensor& grad_in, Tensor& weight_grad) {
  ProfileScope profile(ctx, "rmsnorm_backward");
#ifdef MEGATRON_WITH_CUDA_OPS
  if (on_cuda(ctx, "rmsnorm_backward"))
    return cuda::rmsnorm_backward(ctx, grad_out, x, weight, rstd, zero_centered_gamma, grad_in, weight_grad);
#else
  on_cuda(ctx, "rmsnorm_backward");
#endif
  return cpu::rmsnorm_backward(ctx, grad_out, x, weight, rstd, zero_centered_gamma, grad_in, weight_grad);
}

void linear_forward(Context& ctx, const Tensor& x, const Tensor& weight, const Tensor& bias, Tensor& y) {
  ProfileScope profile(ctx, "linear_forward");
#ifdef MEGATRON_WITH_CUDA_OPS
  if (on_cuda(ctx, "linear_forward")) return cuda::linear_forward(ctx, x, weight, bias, y);
#else
  on_cuda(ctx, "linear_forward");
#endif
  return cpu::linear_forward(ctx, x, weight, bias, y);
}

void linear_backward(Context& ctx, const Tensor& grad_out, const Tensor& x, const Tensor& weight, Tensor& grad_in,
                     Tensor& weight_grad, Tensor& bias_grad) {
  ProfileScope profile(ctx, "linear_backward");
#ifdef MEGATRON_WITH_CUDA_OPS
  if (on_cuda(ctx, "linear_backward"))
    return cuda::linear_backward(ctx, grad_out, x, weight, grad_in, weight_grad, bias_grad);
#else
  on_cuda(ctx, "linear_backward");
#endif
  return cpu::linear_backward(ctx, grad_out, x, weight, grad_in, weight_grad, bias_grad);
}

void linear_gelu_forward(Context& ctx, const Tensor& x, const Tensor& weight, const Tensor& bias, Tensor& pre,
                         Tensor& out) {
  ProfileScope profile(ctx, "linear_gelu_forward");
#ifdef MEGATRON_WITH_CUDA_OPS
  if (on_cuda(ctx, "linear_gelu_forward")) return cuda::linear_gelu_forward(ctx, x, weight, bias, pre, out);
#else
  on_cuda(ctx, "linear_gelu_forward");
#endif
  return cpu::linear_gelu_forward(ctx, x, weight, bias, pre, out);
}

void linear_dgelu_backward(Context& ctx, const Tensor& grad_out, const Tensor& weight, const Tensor& pre,
                           Tensor& grad_pre) {
  ProfileScope profile(ctx, "linear_dgelu_backward");
#ifdef MEGATRON_WITH_CUDA_OPS
  if (on_cuda(ctx, "linear_dgelu_backward")) return cuda::linear_dgelu_backward(ctx, grad_out, weight, pre, grad_pre);
#else
  on_cuda(ctx, "linear_dgelu_backward");
#endif
  return cpu::linear_dgelu_backward(ctx, grad_out, weight, pre, grad_pre);
}

void gelu_forward(Context& ctx, const Tensor& x, Tensor& out) {
  ProfileScope profile(ctx, "gelu_forward");
#ifdef MEGATRON_WITH_CUDA_OPS
  if (on_cuda(ctx, "gelu_forward")) return cuda::gelu_forward(ctx, x, out);
#else
  on_cuda(ctx, "gelu_forward");
#endif
  return cpu::gelu_forward(ctx, x, out);
}

void gelu_backward(Context& ctx, const Tensor& grad_out, const Tensor& x, Tensor& grad_in) {
  ProfileScope profile(ctx, "gelu_backward");
#ifdef MEGATRON_WITH_CUDA_OPS
  if (on_cuda(ctx, "gelu_backward")) return cuda::gelu_backward(ctx, grad_out, x, grad_in);
#else
  on_cuda(ctx, "gelu_backward");
#endif
  return cpu::gelu_backward(ctx, grad_out, x, grad_in);
}

void swiglu_forward(Context& ctx, const Tensor& x, Tensor& out) {
  ProfileScope profile(ctx, "swiglu_forward");
#ifdef MEGATRON_WITH_CUDA_OPS
  if (on_cuda(ctx, "swiglu_forward")) return cuda::swiglu_forward(ctx, x, out);
#else
  on_cuda(ctx, "swiglu_forward");
#endif
  return cpu::swiglu_forward(ctx, x, out);
}

void swiglu_backward(Context& ctx, const Tensor& grad_out, const Tensor& x, Tensor& grad_in) {
  ProfileScope profile(ctx, "swiglu_backward");
#ifdef MEGATRON_WITH_CUDA_OPS
  if (on_cuda(ctx, "swiglu_backward")) return cuda::swiglu_backward(ctx, grad_out, x, grad_in);
#else
  on_cuda(ctx, "swiglu_backward");
#endif
  return cpu::swiglu_backward(ctx, grad_out, x, grad_in);
}

void rope_forward(Context& ctx, const Tensor& x, const Tensor& freqs, bool interleaved, Tensor& out) {
  ProfileScope profile(ctx, "rope_forward");
#ifdef MEGATRON_WITH_CUDA_OPS
  if (on_cuda(ctx, "rope_forward")) return cuda::rope_forward(ctx, x, freqs, interleaved, out);
#else
  on_cuda(ctx, "rope_forward");
#endif
  return cpu::rope_forward(ctx, x, freqs, interleaved, out);
}

void rope_backward(Context& ctx, const Tensor& grad_out, const Tensor& freqs, bool interleaved, Tensor& grad_in) {
  ProfileScope profile(ctx, "rope_backward");
#ifdef MEGATRON_WITH_CUDA_OPS
  if (on_cuda(ctx, "rope_backward")) return cuda::rope_backward(ctx, grad_out, freqs, interleaved, grad_in);
#else
  on_cuda(ctx, "rope_backward");
#endif
  return cpu::rope_backward(ctx, grad_out, freqs, interleaved, grad_in);
}

void check_attention_mask(const AttnMask& mask, const Device& device, int64_t b, int64_t sq, int64_t sk) {
  MG_CHECK(mask.kind == AttnMask::Kind::CausalWithOffset || sq == sk,
           "attention: q has {} positions and k {}; only the CausalWithOffset mask takes different lengths", sq, sk);
  if (mask.kind != AttnMask::Kind::Documents) return;
  const Tensor& cu = mask.cu_seqlens;
  MG_CHECK(cu.defined() && cu.dtype() == DType::Int32 && cu.device() == device &&
               ((cu.dim() == 1 && cu.size(0) >= 2) || (cu.dim() == 2 && cu.size(0) == b && cu.size(1) >= 2)),
           "attention: the Documents mask takes cu_seqlens int32 [n + 1] or [{}, n + 1] on {}, got {}", b, device.str(),
           cu.defined() ? cu.str() : std::string("an undefined tensor"));
}

void attention_forward(Context& ctx, const Tensor& q, const Tensor& k, const Tensor& v, const AttnMask& mask,
                       float softmax_scale, float dropout_p, uint64_t seed, uint64_t offset, Tensor& out, Tensor& lse) {
  ProfileScope profile(ctx, "attention_forward");
#ifdef MEGATRON_WITH_CUDA_OPS
  if (on_cuda(ctx, "attention_forward"))
    return cuda::attention_forward(ctx, q, k, v, mask, softmax_scale, dropout_p, seed, offset, out, lse);
#else
  on_cuda(ctx, "attention_forward");
#endif
  return cpu::attention_forward(ctx, q, k, v, mask, softmax_scale, dropout_p, seed, offset, out, lse);
}

void attention_backward(Context& ctx, const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& out, const Tensor& lse, const AttnMask& mask, float softmax_scale,
                        float dropout_p, uint64_t seed, uint64_t offset, Tensor& grad_q, Tensor& grad_k,
                        Tensor& grad_v) {
  ProfileScope profile(ctx, "attention_backward");
#ifdef MEGATRON_WITH_CUDA_OPS
  if (on_cuda(ctx, "attention_backward"))
    return cuda::attention_backward(ctx, grad_out, q, k, v, out, lse, mask, softmax_scale, dropout_p, seed, offset,
                                    grad_q, grad_k, grad_v);
#else
  on_cuda(ctx, "attention_backward");
#endif
  return cpu::attention_backward(ctx, grad_out, q, k, v, out, lse, mask, softmax_scale, dropout_p, seed, offset, grad_q,
                                 grad_k, grad_v);
}

void attention_forward_qkv(Context& ctx, const Tensor& qkv, const AttnMask& mask, float softmax_scale, float dropout_p,
                           uint64_t seed, uint64_t offset, Tensor& out, Tensor& lse) {
  ProfileScope profile(ctx, "attention_forward_qkv");
#ifdef MEGATRON_WITH_CUDA_OPS
  if (on_cuda(ctx, "attention_forward_qkv"))
    return cuda::attention_forward_qkv(ctx, qkv, mask, softmax_scale, dropout_p, seed, offset, out, lse);
#else
  on_cuda(ctx, "attention_forward_qkv");
#endif
  return cpu::attention_forward_qkv(ctx, qkv, mask, softmax_scale, dropout_p, seed, offset, out, lse);
}

void attention_backward_qkv(Context& ctx, const Tensor& grad_out, const Tensor& qkv, const Tensor& out,
                            const Tensor& lse, const AttnMask& mask, float softmax_scale, float dropout_p,
                            uint64_t seed, uint64_t offset, Tensor& grad_qkv) {
  ProfileScope profile(ctx, "attention_backward_qkv");
#ifdef MEGATRON_WITH_CUDA_OPS
  if (on_cuda(ctx, "attention_backward_qkv"))
    return cuda::attention_backward_qkv(ctx, grad_out, qkv, out, lse, mask, softmax_scale, dropout_p, seed, offset,
                                        grad_qkv);
#else
  on_cuda(ctx, "attention_backward_qkv");
#endif
  return cpu::attention_backward_qkv(ctx, grad_out, qkv, out, lse, mask, softmax_scale, dropout_p, seed, offset,
                                     grad_qkv);
}

void attention_kv_cache_forward(Context& ctx, const Tensor& q, const Tensor& k_new, const Tensor& v_new,
                                const Tensor& slots, const Tensor& starts, float softmax_scale, Tensor& k_cache,
                                Tensor& v_cache, Tensor& out) {
  ProfileScope profile(ctx, "attention_kv_cache_forward");
#ifdef MEGATRON_WITH_CUDA_OPS
  if (on_cuda(ctx, "attention_kv_cache_forward"))
    return cuda::attention_kv_cache_forward(ctx, q, k_new, v_new, slots, starts, softmax_scale, k_cache, v_cache, out);
#else
  on_cuda(ctx, "attention_kv_cache_forward");
#endif
  return cpu::attention_kv_cache_forward(ctx, q, k_new, v_new, slots, starts, softmax_scale, k_cache, v_cache, out);
}

void qkv_split_forward(Context& ctx, const Tensor& qkv, Tensor& q, Tensor& k, Tensor& v) {
  ProfileScope profile(ctx, "qkv_split_forward");
#ifdef MEGATRON_WITH_CUDA_OPS
  if (on_cuda(ctx, "qkv_split_forward")) return cuda::qkv_split_forward(ctx, qkv, q, k, v);
#else
  on_cuda(ctx, "qkv_split_forward");
#endif
  return cpu::qkv_split_forward(ctx, qkv, q, k, v);
}

void qkv_split_backward(Context& ctx, const Tensor& grad_q, const Tensor& grad_k, const Tensor& grad_v,
                        Tensor& grad_qkv) {
  ProfileScope profile(ctx, "qkv_split_backward");
#ifdef MEGATRON_WITH_CUDA_OPS
  if (on_cuda(ctx, "qkv_split_backward")) return cuda::qkv_split_backward(ctx, grad_q, grad_k, grad_v, grad_qkv);
#else
  on_cuda(ctx, "qkv_split_backward");
#endif
  return cpu::qkv_split_backward(ctx, grad_q, grad_k, grad_v, grad_qkv);
}

void dropout_forward(Context& ctx, const Tensor& x, float p, uint64_t seed, uint64_t offset, Tensor& out) {
  ProfileScope profile(ctx, "dropout_forward");
#ifdef MEGATRON_WITH_CUDA_OPS
  if (on_cuda(ctx, "dropout_forward")) return cuda::dropout_forward(ctx, x, p, seed, offset, out);
#else
  on_cuda(ctx, "dropout_forward");
#endif
  return cpu::dropout_forward(ctx, x, p, seed, offset, out);
}

void dropout_backward(Context& ctx, const Tensor& grad_out, float p, uint64_t seed, uint64_t offset, Tensor& grad_in) {
  ProfileScope profile(ctx, "dropout_backward");
#ifdef MEGATRON_WITH_CUDA_OPS
  if (on_cuda(ctx, "dropout_backward")) return cuda::dropout_backward(ctx, grad_out, p, seed, offset, grad_in);
#else
  on_cuda(ctx, "dropout_backward");
#endif
  return cpu::dropout_backward(ctx, grad_out, p, seed, offset, grad_in);
}

void dropout_add_forward(Context& ctx, const Tensor& x, const Tensor& residual, float p, uint64_t seed, uint64_t offset,
                         Tensor& out) {
  ProfileScope profile(ctx, "dropout_add_forward");
#ifdef MEGATRON_WITH_CUDA_OPS
  if (on_cuda(ctx, "dropout_add_forward")) return cuda::dropout_add_forward(ctx, x, residual, p, seed, offset, out);
#else
  on_cuda(ctx, "dropout_add_forward");
#endif
  return cpu::dropout_add_forward(ctx, x, residual, p, seed, offset, out);
}

void add(Context& ctx, const Tensor& a, const Tensor& b, Tensor& out) {
  ProfileScope profile(ctx, "add");
#ifdef MEGATRON_WITH_CUDA_OPS
  if (on_cuda(ctx, "add")) return cuda::add(ctx, a, b, out);
#else
  on_cuda(ctx, "add");
#endif
  return cpu::add(ctx, a, b, out);
}

void cross_entropy_forward(Context& ctx, const Tensor& logits, const Tensor& labels, Tensor& losses, Tensor& lse) {
  ProfileScope profile(ctx, "cross_entropy_forward");
#ifdef MEGATRON_WITH_CUDA_OPS
  if (on_cuda(ctx, "cross_entropy_forward")) return cuda::cross_entropy_forward(ctx, logits, labels, losses, lse);
#else
  on_cuda(ctx, "cross_entropy_forward");
#endif
  return cpu::cross_entropy_forward(ctx, logits, labels, losses, lse);
}

void cross_entropy_backward(Context& ctx, const Tensor& grad_losses, const Tensor& logits, const Tensor& labels,
                            const Tensor& lse, Tensor& grad_logits) {
  ProfileScope profile(ctx, "cross_entropy_backward");
#ifdef MEGATRON_WITH_CUDA_OPS
  if (on_cuda(ctx, "cross_entropy_backward"))
    return cuda::cross_entropy_backward(ctx, grad_losses, logits, labels, lse, grad_logits);
#else
  on_cuda(ctx, "cross_entropy_backward");
#endif
  return cpu::cross_entropy_backward(ctx, grad_losses, logits, labels, lse, grad_logits);
}

void masked_loss_sums(Context& ctx, const Tensor& losses, const Tensor& loss_mask, Tensor& sums) {
  ProfileScope profile(ctx, "masked_loss_sums");
#ifdef MEGATRON_WITH_CUDA_OPS
  if (on_cuda(ctx, "masked_loss_sums")) return cuda::masked_loss_sums(ctx, losses, loss_mask, sums);
#else
  on_cuda(ctx, "masked_loss_sums");
#endif
  return cpu::masked_loss_sums(ctx, losses, loss_mask, sums);
}

void masked_loss_backward(Context& ctx, const Tensor& loss_mask, float scale, Tensor& grad_losses) {
  ProfileScope profile(ctx, "masked_loss_backward");
#ifdef MEGATRON_WITH_CUDA_OPS
  if (on_cuda(ctx, "masked_loss_backward")) return cuda::masked_loss_backward(ctx, loss_mask, scale, grad_losses);
#else
  on_cuda(ctx, "masked_loss_backward");
#endif
  return cpu::masked_loss_backward(ctx, loss_mask, scale, grad_losses);
}

void masked_loss_backward_normalized(Context& ctx, const Tensor& loss_mask, const Tensor& sums, const Tensor& scale,
                                     Tensor& grad_losses) {
  ProfileScope profile(ctx, "masked_loss_backward");
#ifdef MEGATRON_WITH_CUDA_OPS
  if (on_cuda(ctx, "masked_loss_backward_normalized"))
    return cuda::masked_loss_backward_normalized(ctx, loss_mask, sums, scale, grad_losses);
#else
  on_cuda(ctx, "masked_loss_backward_normalized");
#endif
  return cpu::masked_loss_backward_normalized(ctx, loss_mask, sums, scale, grad_losses);
}

void transpose_01(Context& ctx, const Tensor& x, Tensor& out) {
  ProfileScope profile(ctx, "transpose_01");
#ifdef MEGATRON_WITH_CUDA_OPS
  if (on_cuda(ctx, "transpose_01")) return cuda::transpose_01(ctx, x, out);
#else
  on_cuda(ctx, "transpose_01");
#endif
  return cpu::transpose_01(ctx, x, out);
}

void adamw_step_multi(Context& ctx, std::vector<AdamTensors>& params, const AdamHyperParams& hp) {
  ProfileScope profile(ctx, "adamw_step");
#ifdef MEGATRON_WITH_CUDA_OPS
  if (on_cuda(ctx, "adamw_step_multi")) return cuda::adamw_step_multi(ctx, params, hp);
#else
  on_cuda(ctx, "adamw_step_multi");
#endif
  return cpu::adamw_step_multi(ctx, params, hp);
}

void adamw_step(Context& ctx, Tensor& main_param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                const AdamHyperParams& hp, Tensor& model_param) {
  ProfileScope profile(ctx, "adamw_step");
#ifdef MEGATRON_WITH_CUDA_OPS
  if (on_cuda(ctx, "adamw_step")) return cuda::adamw_step(ctx, main_param, grad, exp_avg, exp_avg_sq, hp, model_param);
#else
  on_cuda(ctx, "adamw_step");
#endif
  return cpu::adamw_step(ctx, main_param, grad, exp_avg, exp_avg_sq, hp, model_param);
}

GradStats grad_stats(Context& ctx, const Tensor& grad) {
  ProfileScope profile(ctx, "grad_stats");
#ifdef MEGATRON_WITH_CUDA_OPS
  if (on_cuda(ctx, "grad_stats")) return cuda::grad_stats(ctx, grad);
#else
  on_cuda(ctx, "grad_stats");
#endif
  return cpu::grad_stats(ctx, grad);
}

void scale_(Context& ctx, Tensor& x, float s) {
  ProfileScope profile(ctx, "scale_");
#ifdef MEGATRON_WITH_CUDA_OPS
  if (on_cuda(ctx, "scale_")) return cuda::scale_(ctx, x, s);
#else
  on_cuda(ctx, "scale_");
#endif
  return cpu::scale_(ctx, x, s);
}

void vocab_parallel_embedding_forward(Context& ctx, const Tensor& tokens, const Tensor& word_shard, int64_t vocab_start,
                                      int64_t vocab_size, Tensor& out) {
  ProfileScope profile(ctx, "vocab_parallel_embedding_forward");
#ifdef MEGATRON_WITH_CUDA_OPS
  if (on_cuda(ctx, "vocab_parallel_embedding_forward"))
    return cuda::vocab_parallel_embedding_forward(ctx, tokens, word_shard, vocab_start, vocab_size, out);
#else
  on_cuda(ctx, "vocab_parallel_embedding_forward");
#endif
  return cpu::vocab_parallel_embedding_forward(ctx, tokens, word_shard, vocab_start, vocab_size, out);
}

void vocab_parallel_embedding_backward(Context& ctx, const Tensor& tokens, const Tensor& grad_out, int64_t vocab_start,
                                       Tensor& word_grad) {
  ProfileScope profile(ctx, "vocab_parallel_embedding_backward");
#ifdef MEGATRON_WITH_CUDA_OPS
  if (on_cuda(ctx, "vocab_parallel_embedding_backward"))
    return cuda::vocab_parallel_embedding_backward(ctx, tokens, grad_out, vocab_start, word_grad);
#else
  on_cuda(ctx, "vocab_parallel_embedding_backward");
#endif
  return cpu::vocab_parallel_embedding_backward(ctx, tokens, grad_out, vocab_start, word_grad);
}

void cross_entropy_local_max(Context& ctx, const Tensor& logits, Tensor& max) {
  ProfileScope profile(ctx, "cross_entropy_local_max");
#ifdef MEGATRON_WITH_CUDA_OPS
  if (on_cuda(ctx, "cross_entropy_local_max")) return cuda::cross_entropy_local_max(ctx, logits, max);
#else
  on_cuda(ctx, "cross_entropy_local_max");
#endif
  return cpu::cross_entropy_local_max(ctx, logits, max);
}

void cross_entropy_local_sums(Context& ctx, const Tensor& logits, const Tensor& labels, int64_t vocab_start,
                              const Tensor& max, Tensor& sums) {
  ProfileScope profile(ctx, "cross_entropy_local_sums");
#ifdef MEGATRON_WITH_CUDA_OPS
  if (on_cuda(ctx, "cross_entropy_local_sums"))
    return cuda::cross_entropy_local_sums(ctx, logits, labels, vocab_start, max, sums);
#else
  on_cuda(ctx, "cross_entropy_local_sums");
#endif
  return cpu::cross_entropy_local_sums(ctx, logits, labels, vocab_start, max, sums);
}

void cross_entropy_from_sums(Context& ctx, const Tensor& max, const Tensor& sums, Tensor& losses, Tensor& lse) {
  ProfileScope profile(ctx, "cross_entropy_from_sums");
#ifdef MEGATRON_WITH_CUDA_OPS
  if (on_cuda(ctx, "cross_entropy_from_sums")) return cuda::cross_entropy_from_sums(ctx, max, sums, losses, lse);
#else
  on_cuda(ctx, "cross_entropy_from_sums");
#endif
  return cpu::cross_entropy_from_sums(ctx, max, sums, losses, lse);
}

void vocab_parallel_cross_entropy_backward(Context& ctx, const Tensor& grad_losses, const Tensor& logits,
                                           const Tensor& labels, int64_t vocab_start, const Tensor& lse,
                                           Tensor& grad_logits) {
  ProfileScope profile(ctx, "vocab_parallel_cross_entropy_backward");
#ifdef MEGATRON_WITH_CUDA_OPS
  if (on_cuda(ctx, "vocab_parallel_cross_entropy_backward"))
    return cuda::vocab_parallel_cross_entropy_backward(ctx, grad_losses, logits, labels, vocab_start, lse,
                                                       grad_logits);
#else
  on_cuda(ctx, "vocab_parallel_cross_entropy_backward");
#endif
  return cpu::vocab_parallel_cross_entropy_backward(ctx, grad_losses, logits, labels, vocab_start, lse, grad_logits);
}

void throw_bad_table_id(const char* what, int64_t id, int64_t flat, int64_t s, int64_t rows) {
  throw Error(fmt::format("{} {} at [{}, {}] is outside the embedding table of {} rows: check the tokenizer's "
                          "vocabulary size (--vocab-size / --padded-vocab-size) or --max-position-embeddings",
                          what, id, flat / s, flat % s, rows));
}

void throw_bad_label(int64_t label, int64_t position, int64_t vocab) {
  throw Error(fmt::format("label {} at position {} is outside the vocabulary [0, {}): check the tokenizer and "
                          "--vocab-size (mask ignored tokens with the loss mask instead of a negative label)",
                          label, position, vocab));
}

}  // namespace megatron::ops
