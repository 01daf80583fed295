// Several FP8 linear layers over row blocks of one tensor — TE's GroupedLinear, which Megatron's
// TEGroupedMLP runs the MoE experts through: layer e multiplies rows [start_e, start_e + rows[e])
// of x by its weight W_e, each layer with its own scaling state (Fp8LinearState: Note [FP8 experts]).
//
// Note [Grouped FP8 linear layers]: the three GEMMs of each layer are the single layer's (Note [FP8
// linear layer]); what is grouped is the quantisation (Note [Grouped quantisation], fp8_ops.h):
//   forward   one pass quantises every layer's row block of x with its layer's input scale, one
//             pass every weight (those the weight cache or --fp8-param-gather do not already hold),
//             making the transposed copy too where the layer keeps it (Note [FP8 weight cache]:
//             the cache, or kept transposes — the experts at one microbatch);
//   backward  one pass over dy for both copies (its transposed blocks padded: below), one pass for
//             the transposed weights not kept, one for the transposed input blocks;
// and the GEMMs then run layer after layer on slices of those buffers (fp8_gemm_grouped: cuBLASLt as
// the bf16 experts', plans shared across row counts — Note [Plans for varying row counts]). The weight gradient's K is the layer's row count, which
// cuBLASLt's FP8 GEMM needs in multiples of 16 (kFp8GroupRowAlign): each transposed block is
// [cols, rows rounded up] with zero codes in the padding, written by the same pass — Megatron's
// Fp8Padding without copies of the rows (the forward and input-gradient GEMMs take any row count).
// A layer without rows is skipped (its delayed history does not roll). The per-tensor recipes
// only (delayed, tensorwise); the results are the bits of each layer's Fp8LinearState::forward /
// backward on its padded rows (the padding adds zero rows, which change no amax and no sum).
// The bias gradient, where the layers have biases, is the column sum of each block of dy in its own
// precision, as the single layer's.
#pragma once

#include <vector>

#include "megatron/core/tensor_parallel/fp8_linear.h"

namespace megatron {

/// Rows of each layer's transposed operands are padded to this multiple (Note [Grouped FP8 linear layers]).
inline constexpr int64_t kFp8GroupRowAlign = 16;
/// n rows rounded up to kFp8GroupRowAlign.
inline int64_t fp8_group_padded_rows(int64_t n) { return (n + kFp8GroupRowAlign - 1) / kFp8GroupRowAlign * kFp8GroupRowAlign; }

/// y [N, out] = for each layer e its rows of x [N, in] · W_eᵀ (+ b_e): rows[e] rows each, in order.
/// biases: empty or one per layer (undefined: none).
void fp8_grouped_forward(Context& ctx, const std::vector<Fp8LinearState*>& layers, const Tensor& x,
                         const std::vector<int64_t>& rows, const std::vector<Tensor>& weights,
                         const std::vector<Tensor>& biases, Tensor& y);
/// grad_in [N, in] (undefined: skipped) = each block of grad_out · W_e; weight_grads[e] fp32 +=
/// grad_eᵀ · x_e (empty: skipped); bias_grads[e] fp32 += Σ_rows grad_e (empty or undefined: skipped).
void fp8_grouped_backward(Context& ctx, const std::vector<Fp8LinearState*>& layers, const Tensor& grad_out,
                          const Tensor& x, const std::vector<int64_t>& rows, const std::vector<Tensor>& weights,
                          Tensor& grad_in, std::vector<Tensor>& weight_grads, std::vector<Tensor>& bias_grads);

}  // namespace megatron
