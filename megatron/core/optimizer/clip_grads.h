// Gradient norm, clipping and zero counting over fp32 gradients, as Megatron-LM's clip_grads.py
// (L2 norm only). One ops::grad_stats pass per tensor gives Σg², the inf/nan flag and the zero count.
#pragma once

#include <cstdint>
#include <vector>

#include "megatron/core/comm/communicator.h"
#include "megatron/kernels/ops.h"

namespace megatron {

/// ops::grad_stats summed over the tensors (undefined tensors are skipped).
GradStats grad_stats_fp32(Context& ctx, const std::vector<Tensor>& grads);

/// `local` summed over the ranks of `group` (all-gathered, then added in rank order in double: every
/// rank gets the same bits). Collective; a one-rank group returns `local`.
GradStats all_reduce_grad_stats(Context& ctx, Communicator& group, const GradStats& local);

/// The L2 norm described by `stats`, times `scale` (e.g. 1/loss_scale for still-scaled grads).
/// inf or nan when a gradient is.
double grad_norm_from_stats(const GradStats& stats, double scale = 1.0);

/// Megatron's get_grad_norm_fp32 (norm_type 2): the L2 norm over all the tensors.
double get_grad_norm_fp32(Context& ctx, const std::vector<Tensor>& grads);

/// Megatron's clip coefficient max_norm / (total_norm + 1e-6); clipping applies only when it is < 1
/// (so never for a nan norm).
double clip_coefficient(double max_norm, double total_norm);

/// Multiplies the grads by clip_coefficient(max_norm, total_norm) when that is < 1.
void clip_grad_by_total_norm_fp32(Context& ctx, const std::vector<Tensor>& grads, double max_norm, double total_norm);

/// Norm, then clip (Megatron's clip_grad_norm_fp32); returns the norm before clipping.
double clip_grad_norm_fp32(Context& ctx, const std::vector<Tensor>& grads, double max_norm);

/// The number of exactly-zero elements over the tensors (Megatron's count_zeros_fp32).
int64_t count_zeros_fp32(Context& ctx, const std::vector<Tensor>& grads);

}  // namespace megatron
