// The FP8 op family: quantisation with scales and amax, the scaling recipes' device-side
// bookkeeping, block scaling and the FP8 GEMM. Declared in fp8_op_list.inc into megatron::ops
// (dispatching, fp8_ops.cpp), megatron::cpu (kernels/cpu/fp8.cpp, the reference) and
// megatron::cuda (kernels/cuda/fp8.cu; block scaling fp8_block.cu, the GEMM fp8_gemm.cu), as op_list.inc is for the other ops.
//
// Note [FP8 formats and scaling]: the two OCP 8-bit formats (runtime/dtype.h) are
//   e4m3  bias 7,  3 mantissa bits, no infinities, one NaN (S.1111.111), max ±448, min subnormal 2^-9
//   e5m2  bias 15, 2 mantissa bits, IEEE-like (inf S.11111.00, NaN S.11111.xx), max ±57344, min 2^-16.
// A tensor x is stored as q = fp8(x · s) with an fp32 scale s chosen so that amax(x) · s lands near
// the format's max; the GEMM multiplies its fp32 accumulator by s_a⁻¹ · s_b⁻¹ (scale_inv). The
// recipes differ only in where s comes from (megatron/core/fp8_utils.h):
//   delayed     s from the amax history of past steps (fp8_delayed_scale_update), the quantise of
//               this step recording its amax into the history's row 0 — one pass over x;
//   tensorwise  s from this tensor's own amax (fp8_amax, fp8_scale_from_amax, then fp8_quantize) —
//               two passes, no history;
//   blockwise   a scale per 1x128 or 128x128 tile (fp8_block_quantize), the GEMM applying them
//               inside its main loop.
// Megatron's --fp8-format e4m3 uses e4m3 everywhere, hybrid e4m3 for activations and weights and
// e5m2 (more range, less precision) for the gradients.
//
// Note [FP8 GEMM layouts]: on Hopper (sm_90) cuBLASLt's FP8 kernels take only the "TN" form,
// column-major op(A) = Aᵀ and op(B) = B, which for our row-major tensors is out [M, N] = A [M, K] ·
// B [N, K]ᵀ with K contiguous in both operands (TE: "Hopper only supports TN GEMMs for FP8";
// Blackwell lifts it). fp8_gemm therefore takes exactly that form, and the linear layer makes its
// three GEMMs fit it with transposed copies (fp8_quantize's q_t):
//   forward      y  [N, out] = x [N, in]   · W [out, in]ᵀ          A = x,     B = W
//   grad_in      dx [N, in]  = dy [N, out] · (Wᵀ [in, out])ᵀ       A = dy,    B = W_t
//   weight_grad  dW [out, in] += dyᵀ [out, N] · (xᵀ [in, N])ᵀ       A = dy_t,  B = x_t
// cuBLASLt further needs K a multiple of 16 (16-byte rows of fp8) and N a multiple of 8 (16-byte
// rows of a bf16 out); the op refuses other shapes with one line. The scale factors are device
// pointers (CUBLASLT_MATMUL_DESC_A/B_SCALE_POINTER), so nothing waits for the host and the GEMM
// can be captured in a CUDA graph.
//
// Note [FP8 block scaling]: CUDA 12.9+'s cuBLASLt takes per-block fp32 scales on sm_90 through
// CUBLASLT_MATMUL_DESC_{A,B}_SCALE_MODE = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F (one scale per 128
// elements along K of each row: activations and gradients, 1x128) or BLK128x128_32F (one per
// 128x128 tile: weights), in the compact layouts of fp8_block_scale_shape (rows padded to 4 for
// 16-byte alignment). Not both operands 128x128 (cuBLASLt has no 2D x 2D kernel). The GEMM applies
// the scales per K block in fp32 inside its main loop (no fast accumulation); TE's documentation
// calls these GEMMs software-emulated on Hopper (cheaper with one 128x128 operand than with two
// 1x128), and TE pads M and N of block-scaled operands to multiples of 8. Because a 128x128
// tile's amax does not depend on orientation, the weight's transposed copy for grad_in is
// fp8_block_quantize of Wᵀ with the same scales transposed; a 1x128 copy along the other dimension
// (the weight gradient's dy_t and x_t) is a quantisation of its own.
//
// Note [Quantising inside the activation] (TE's fused activation casts): two of an MLP's FP8
// operands are made by its activation — fc2's input act(fc1) (forward; again in backward for its
// transposed copy, Note [Activation recomputed in backward]) and fc1's output gradient
// act'(fc1)·d_act — and each would be written in bf16 by one pass only to be read by the
// quantisation pass after it. fp8_quantize_activation computes them inside the quantisation pass
// from fc1's output (and d_act) instead: per Llama-3-8B layer at 8192 tokens (SwiGLU) that removes
// ~1.9 GB of memory traffic per step (act written and read twice, the [M, 2f] gradient written
// and read once). The values are computed by the same device functions
// (kernels/cuda/activations.cuh) and rounded to the tensors' dtype before they are quantised, so
// the codes and amax equal the unfused ops' bit for bit; shapes the vector pass does not take (a
// width not a multiple of the 16-byte vector, unaligned tensors) materialise x and quantise it.
// The delayed recipe uses it (one pass: the scale is known); current scaling needs x's amax before
// its codes, and computing the activation twice measured slower than writing it once and reading
// it twice, so the tensorwise recipe materialises (Fp8TensorScaling::quantize).
//
// Note [Grouped quantisation] (TE's multi_tensor / grouped casts behind GroupedLinear): the MoE
// experts quantise one row block of a tensor per expert, each with its expert's scale, and each
// expert's weight; a pass per block and weight is a launch of a few microseconds' work each —
// for 64 fine-grained experts ~13 launches per expert and linear layer, more time than their FP8
// GEMMs. fp8_quantize_grouped takes the members as lists and does each step of all of them in one
// launch: on the GPU a table of up to 32 members per launch (their pointers, shapes and first block),
// each block two 64x64 tiles of one member (Note [Vectorised transposed quantise], cuda/fp8_tile.cuh)
// where the member has a transposed copy, else a flat chunk of its rows (cuda/fp8_grouped.cu);
// current scaling is a grouped amax pass and then the codes, each block computing its member's
// scale from the amax as fp8_scale_from_amax does (the member's first block stores it). The
// transposed copies can be padded with zero columns (the weight-gradient GEMM's K in multiples of
// 16) in the same pass, so the experts need no padded copies of their rows.
#pragma once

#include <cstdint>

#include "megatron/kernels/ops.h"

namespace megatron {

/// The largest finite value of an fp8 dtype (448 for e4m3, 57344 for e5m2); throws for others.
float fp8_max_of(DType t);
inline bool is_fp8(DType t) { return t == DType::Float8E4M3 || t == DType::Float8E5M2; }

/// The activations fp8_quantize_activation computes (Note [Quantising inside the activation]).
enum class Fp8Activation : uint8_t { Swiglu, Gelu };

/// The tile edge of block scaling.
inline constexpr int64_t kFp8BlockLen = 128;

/// How an FP8 GEMM operand's scale_inv is laid out (Note [FP8 block scaling]).
enum class Fp8ScaleMode : uint8_t {
  Tensor,       // scale_inv [1]: one for the whole tensor
  Block1x128,   // scale_inv fp8_block_scale_shape(rows, K, false)
  Block128x128  // scale_inv fp8_block_scale_shape(rows, K, true)
};

/// The scale_inv shape of block scaling for data [rows, cols] (Note [FP8 block scaling]).
Shape fp8_block_scale_shape(int64_t rows, int64_t cols, bool tile_2d);

/// One operand of fp8_gemm: data [rows, K] fp8 row-major and its scale_inv (fp32, on data's device).
struct Fp8Operand {
  Tensor data;
  Tensor scale_inv;
  Fp8ScaleMode mode = Fp8ScaleMode::Tensor;
};

/// The delayed recipe's update options (fp8_delayed_scale_update).
struct Fp8DelayedParams {
  float fp8_max = 448.0f;   // of the format these tensors are quantised to
  int margin = 0;           // --fp8-margin
  bool use_max = false;     // --fp8-amax-compute-algo max (else most_recent)
  /// fp8_max · 2^-margin, as TE computes it (on the host, in fp32).
  float scaled_max() const;
};

}  // namespace megatron

namespace megatron::ops {
/// The checks of an FP8 GEMM's operands, worded once for both backends: fp8 data [M, K] and [N, K]
/// on one device, not both e5m2, scale_inv of each operand's mode (not both 128x128), out [M, N] bf16
/// or fp32 (fp32 to accumulate), bias [N] bf16/fp32 or undefined (not with accumulate). `cuda` adds cuBLASLt's alignment rules (K % 16, N % 8).
void check_fp8_gemm(const Fp8Operand& a, const Fp8Operand& b, const Tensor& bias, const Tensor& out, bool accumulate,
                    bool cuda);
/// fp8_gemm_grouped's lists: one a, b and out per member, bias empty or one per member.
void check_fp8_gemm_grouped(const std::vector<Fp8Operand>& a, const std::vector<Fp8Operand>& b,
                            const std::vector<Tensor>& bias, const std::vector<Tensor>& out);
/// The checks of fp8_quantize's tensors: x float [M, K], scale [1] fp32, q x's shape, q_t [K, M],
/// both fp8 of one dtype, amax / scale_inv [1] fp32 (each output may be undefined). Returns M and K.
std::pair<int64_t, int64_t> check_fp8_quantize(const Tensor& x, const Tensor& scale, const Tensor& q,
                                               const Tensor& q_t, const Tensor& amax, const Tensor& scale_inv);
/// check_fp8_quantize and dbias fp32 [K] beside x.
std::pair<int64_t, int64_t> check_fp8_quantize_dbias(const Tensor& x, const Tensor& scale, const Tensor& q,
                                                     const Tensor& q_t, const Tensor& amax, const Tensor& scale_inv,
                                                     const Tensor& dbias);
/// fp8_quantize_activation's: pre float (SwiGLU: [..., 2f]), grad undefined or pre's dtype in the
/// activation's output shape, the outputs as check_fp8_quantize's for x (act(pre)'s shape without
/// grad, pre's with it), dbias undefined or fp32 [K]. Returns x's M and K.
std::pair<int64_t, int64_t> check_fp8_quantize_activation(Fp8Activation act, const Tensor& pre, const Tensor& grad,
                                                          const Tensor& scale, const Tensor& q, const Tensor& q_t,
                                                          const Tensor& amax, const Tensor& scale_inv,
                                                          const Tensor& dbias);
/// The tensor fp8_quantize_activation quantises, in memory: act(pre) (grad undefined) or the
/// activation's input gradient for grad, in pre's dtype on ctx's device, through the dispatching
/// ops (the CPU reference, the GPU's fallback for shapes its passes do not take, and
/// ProducedTensor::materialize).
Tensor fp8_activation_values(Context& ctx, Fp8Activation act, const Tensor& pre, const Tensor& grad);
/// One member of fp8_quantize_grouped through the single dispatching ops (q_t unpadded, [K, M]): the
/// CPU reference's definition and the GPU's fallback for members its tile pass does not take.
void fp8_quantize_member(Context& ctx, const Tensor& x, Tensor& scale, Tensor& q, Tensor& q_t, Tensor& amax,
                         Tensor& scale_inv, bool current_scaling, float fp8_max);
/// The checks of fp8_block_quantize's tensors; returns M and K.
std::pair<int64_t, int64_t> check_fp8_block_quantize(const Tensor& x, bool tile_2d, const Tensor& q,
                                                     const Tensor& scale_inv);
/// fp8_block_quantize_transposed's: x float [M, K], q_t fp8 [K, M], scale_inv fp32 of the 1x128
/// tiles of [K, M]. Returns M and K.
std::pair<int64_t, int64_t> check_fp8_block_quantize_transposed(const Tensor& x, const Tensor& q_t,
                                                                const Tensor& scale_inv);
/// fp8_quantize_grouped's: as check_fp8_quantize's per member, q_t [K_i, P_i >= M_i], M_i > 0, one x
/// dtype, each list empty or one per member (amax and scale_inv given under current scaling). Returns
/// the member count.
size_t check_fp8_quantize_grouped(const std::vector<Tensor>& x, const std::vector<Tensor>& scale,
                                  const std::vector<Tensor>& q, const std::vector<Tensor>& q_t,
                                  const std::vector<Tensor>& amax, const std::vector<Tensor>& scale_inv,
                                  bool current_scaling);
/// The checks of fp8_delayed_scale_update's tensors; returns L and n.
std::pair<int64_t, int64_t> check_fp8_delayed_scale_update(const Tensor& amax_history, const Tensor& scale);
/// fp8_block_partial_amax / fp8_block_partial_quantize: x a shard of a [rows, cols] weight (rows from
/// the grid: the checks need only that the shard's last tile is in it); grid the amax or scale tiles;
/// q (undefined for the amax) fp8 of x's size.
void check_fp8_block_partial(const char* op, const Tensor& x, int64_t start, int64_t cols, const Tensor& grid,
                             const Tensor& q);

#define MG_OP(ret, name, params, args) ret name params;
#define MG_OP_AS(ret, name, label, params, args) ret name params;
#include "megatron/kernels/fp8_op_list.inc"
#undef MG_OP
#undef MG_OP_AS
}  // namespace megatron::ops

namespace megatron::cpu {
#define MG_OP(ret, name, params, args) ret name params;
#define MG_OP_AS(ret, name, label, params, args) ret name params;
#include "megatron/kernels/fp8_op_list.inc"
#undef MG_OP
#undef MG_OP_AS
}  // namespace megatron::cpu

#ifdef MEGATRON_WITH_CUDA_OPS
namespace megatron::cuda {
#define MG_OP(ret, name, params, args) ret name params;
#define MG_OP_AS(ret, name, label, params, args) ret name params;
#include "megatron/kernels/fp8_op_list.inc"
#undef MG_OP
#undef MG_OP_AS
}  // namespace megatron::cuda
#endif
