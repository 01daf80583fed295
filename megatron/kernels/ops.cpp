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

// Note [Generated dispatch]: every op of op_list.inc gets its entry point from the list: a profiler
// scope under the op's name (or its MG_OP_AS label), then the CUDA kernel when the Context is on a
// GPU (a CPU-only build refuses a GPU Context with one line), else the CPU reference. Only what is
// not mechanical is written below by hand.
#ifdef MEGATRON_WITH_CUDA_OPS
#define MG_DISPATCH_CUDA(name, args) \
  if (on_cuda(ctx, #name)) return cuda::name args;
#else
#define MG_DISPATCH_CUDA(name, args) on_cuda(ctx, #name);
#endif
#define MG_OP_AS(ret, name, label, params, args) \
  ret name params {                              \
    ProfileScope profile(ctx, label);            \
    MG_DISPATCH_CUDA(name, args)                 \
    return cpu::name args;                       \
  }
#define MG_OP(ret, name, params, args) MG_OP_AS(ret, name, #name, params, args)
#include "megatron/kernels/op_list.inc"
#undef MG_OP
#undef MG_OP_AS
#undef MG_DISPATCH_CUDA

void check_attention_mask(const AttnMask& mask, const Device& device, int64_t b, int64_t sq, int64_t sk) {
  MG_CHECK(mask.kind == AttnMask::Kind::CausalWithOffset || sq == sk,
           "attention: q has {} positions and k {}; only the CausalWithOffset mask takes different lengths", sq, sk);
  MG_CHECK(mask.window_left >= -1, "attention: the mask's left window is {}; expected -1 (none) or >= 0",
           mask.window_left);
  if (mask.kind != AttnMask::Kind::Documents) return;
  const Tensor& cu = mask.cu_seqlens;
  MG_CHECK(cu.defined() && cu.dtype() == DType::Int32 && cu.device() == device &&
               ((cu.dim() == 1 && cu.size(0) >= 2) || (cu.dim() == 2 && cu.size(0) == b && cu.size(1) >= 2)),
           "attention: the Documents mask takes cu_seqlens int32 [n + 1] or [{}, n + 1] on {}, got {}", b, device.str(),
           cu.defined() ? cu.str() : std::string("an undefined tensor"));
}

void check_moe_routing(const MoeRoutingParams& p, const Tensor& logits, const Tensor& expert_bias) {
  const int e = p.num_experts, k = p.topk;
  MG_CHECK(e > 0 && k >= 1 && k <= e, "MoE routing: --moe-router-topk {} must be between 1 and --num-experts {}", k, e);
  MG_CHECK(!p.pre_softmax || !p.sigmoid, "MoE routing: --moe-router-pre-softmax needs the softmax score function");
  if (p.group_topk > 0) {
    MG_CHECK(p.num_groups > 0 && p.num_groups <= 64 && e % p.num_groups == 0 && k % p.group_topk == 0 &&
                 p.group_topk <= p.num_groups && int64_t(p.group_topk) * (e / p.num_groups) >= k,
             "MoE routing: group-limited routing needs --moe-router-num-groups (at most 64) dividing --num-experts "
             "({}), --moe-router-group-topk ({}) dividing --moe-router-topk ({}), at most the groups ({}), and "
             "enough experts in the chosen groups",
             e, p.group_topk, k, p.num_groups);
    MG_CHECK(p.group_score_topk >= 0 && p.group_score_topk <= e / p.num_groups,
             "MoE routing: --moe-router-group-score-topk {} must be at most the experts of a group ({})",
             p.group_score_topk, e / p.num_groups);
  }
  MG_CHECK(p.capacity_factor >= 0.0f, "MoE routing: --moe-expert-capacity-factor must be positive (got {})",
           p.capacity_factor);
  MG_CHECK(p.global_aux_loss_coeff >= 0.0f && p.global_aux_group >= 1,
           "MoE routing: the global aux loss needs a coefficient >= 0 (got {}) over at least one rank (got {})",
           p.global_aux_loss_coeff, p.global_aux_group);
  MG_CHECK(logits.defined() && logits.dim() == 2 && logits.size(1) == e && logits.dtype() == DType::Float32,
           "MoE routing: logits must be fp32 [tokens, {}], got {}", e, logits.defined() ? logits.str() : "undefined");
  MG_CHECK(p.seq_length > 0 && p.micro_batch > 0 && p.seq_length * p.micro_batch == logits.size(0),
           "MoE routing: logits of {} tokens for a sequence of {} x micro-batch {}", logits.size(0), p.seq_length,
           p.micro_batch);
  MG_CHECK(!expert_bias.defined() || (expert_bias.dtype() == DType::Float32 && expert_bias.numel() == e &&
                                      expert_bias.device() == logits.device()),
           "MoE routing: the expert bias must be fp32 [{}] beside the logits, got {}", e,
           expert_bias.defined() ? expert_bias.str() : "undefined");
}

std::vector<int64_t> moe_expert_row_starts(const std::vector<int64_t>& rows_per_expert, size_t experts, int64_t rows) {
  MG_CHECK(rows_per_expert.size() == experts, "grouped GEMM: {} expert row counts for {} expert weights",
           rows_per_expert.size(), experts);
  std::vector<int64_t> starts(experts + 1, 0);
  for (size_t e = 0; e < experts; ++e) {
    MG_CHECK(rows_per_expert[e] >= 0, "grouped GEMM: expert {} has {} rows", e, rows_per_expert[e]);
    starts[e + 1] = starts[e] + rows_per_expert[e];
  }
  MG_CHECK(starts.back() == rows, "grouped GEMM: the experts' row counts sum to {} for {} rows", starts.back(), rows);
  return starts;
}

void throw_bad_table_id(const char* what, int64_t id, int64_t flat, int64_t s, int64_t rows) {
  throw Error(
      fmt::format("{} {} at [{}, {}] is outside the embedding table of {} rows: check that the data was "
                  "tokenized with this run's tokenizer (the table is its vocabulary padded to a multiple of "
                  "--make-vocab-size-divisible-by x --tensor-model-parallel-size; --vocab-size for "
                  "NullTokenizer) or --max-position-embeddings",
                  what, id, flat / s, flat % s, rows));
}

void throw_bad_label(int64_t label, int64_t position, int64_t vocab) {
  throw Error(fmt::format("label {} at position {} is outside the vocabulary [0, {}): check the tokenizer and "
                          "--vocab-size (mask ignored tokens with the loss mask instead of a negative label)",
                          label, position, vocab));
}

}  // namespace megatron::ops
