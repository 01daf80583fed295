// Cross-entropy loss and the masked token mean, CPU reference.
//
// logits [N, V] (any float dtype), labels [N] (int32/int64):
//   forward   losses[n] = lse[n] - logits[n, label],  lse[n] = log Σ_v exp(logits[n, v])
//   backward  grad_logits[n, v] = (exp(logits[n, v] - lse[n]) - [v == label])·grad_losses[n]
// The backward may run in place (grad_logits aliasing logits): every element is read before it is
// written. Work goes one row at a time, so bf16 logits are converted a row at a time and a big
// vocabulary never needs a second full fp32 copy. The log-sum-exp is accumulated in fp64; lse may be
// undefined in the forward when no backward follows.
// The loss mean Megatron takes over the tokens, Σ loss·mask / Σ mask, is split into its two sums
// (masked_loss_sums, reduced across ranks by the caller) and the backward's grad = mask·scale.
#include <algorithm>
#include <bit>
#include <cmath>
#include <optional>

#include "megatron/kernels/cpu/cpu_common.h"
#include "megatron/kernels/cpu/cpu_ops.h"
#include "megatron/kernels/ops.h"

namespace megatron::cpu {

namespace {

struct Vocab {
  int64_t n = 0, v = 0;
  std::vector<int64_t> labels;
};

// Checks shapes and that every label lies in [0, V).
Vocab load_labels(const Tensor& logits, const Tensor& labels) {
  assert_float(logits, "logits");
  MG_ASSERT(logits.dim() >= 1, "logits must be [N, V], got {}", logits.str());
  Vocab voc;
  voc.v = logits.size(-1);
  voc.n = rows_of(logits, voc.v, "logits");
  voc.labels = load_indices(labels, "labels");
  MG_ASSERT(int64_t(voc.labels.size()) == voc.n, "labels {} do not match logits {}", labels.str(), logits.str());
  for (int64_t n = 0; n < voc.n; ++n) {
    const int64_t label = voc.labels[n];
    if (label < 0 || label >= voc.v) ops::throw_bad_label(label, n, voc.v);
  }
  return voc;
}

}  // namespace

void cross_entropy_forward(Context& ctx, const Tensor& logits, const Tensor& labels, Tensor& losses, Tensor& lse) {
  const Vocab voc = load_labels(logits, labels);
  assert_fp32(losses, "losses");
  assert_numel(losses, voc.n, "losses");
  float* loss_out = losses.data<float>();
  float* lse_out = nullptr;
  if (lse.defined()) {
    assert_fp32(lse, "lse");
    assert_numel(lse, voc.n, "lse");
    lse_out = lse.data<float>();
  }
  // Rows are independent: split them over the cores (the per-row arithmetic, and so the result,
  // does not depend on the thread count). exp(x - max) <= 1 is exact enough in fp32; the sum is fp64.
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < voc.n; ++n) {
    const FloatIn row(logits.flat_slice(n * voc.v, voc.v));
    float m = -INFINITY;
    for (int64_t c = 0; c < voc.v; ++c) m = std::max(m, row[c]);
    double sum = 0.0;
    for (int64_t c = 0; c < voc.v; ++c) sum += double(std::exp(row[c] - m));
    const double l = m + std::log(sum);
    loss_out[n] = float(l - row[voc.labels[n]]);
    if (lse_out) lse_out[n] = float(l);
  }
}

void cross_entropy_backward(Context& ctx, const Tensor& grad_losses, const Tensor& logits, const Tensor& labels,
                            const Tensor& lse, Tensor& grad_logits) {
  load_labels(logits, labels);  // the labels' checks
  // The whole vocabulary is the one shard that starts at 0.
  vocab_parallel_cross_entropy_backward(ctx, grad_losses, logits, labels, 0, lse, grad_logits);
}

void masked_loss_sums(Context& ctx, const Tensor& losses, const Tensor& loss_mask, Tensor& sums) {
  assert_float(losses, "losses");
  assert_fp32(sums, "sums");
  assert_numel(sums, 2, "sums");
  const int64_t n = losses.numel();
  FloatIn loss(losses);
  std::optional<FloatIn> mask;
  if (loss_mask.defined()) {
    assert_numel(loss_mask, n, "loss_mask");
    mask.emplace(loss_mask);
  }
  double weighted = 0.0, count = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double w = mask ? (*mask)[i] : 1.0;
    weighted += double(loss[i]) * w;
    count += w;
  }
  sums.data<float>()[0] = float(weighted);
  sums.data<float>()[1] = float(count);
}

void masked_loss_backward(Context& ctx, const Tensor& loss_mask, float scale, Tensor& grad_losses) {
  assert_fp32(grad_losses, "grad_losses");
  const int64_t n = grad_losses.numel();
  float* g = grad_losses.data<float>();
  if (!loss_mask.defined()) {
    std::fill(g, g + n, scale);
    return;
  }
  assert_numel(loss_mask, n, "loss_mask");
  FloatIn mask(loss_mask);
  for (int64_t i = 0; i < n; ++i) g[i] = mask[i] * scale;
}

void masked_loss_backward_normalized(Context& ctx, const Tensor& loss_mask, const Tensor& sums, const Tensor& scale,
                                     Tensor& grad_losses) {
  assert_fp32(sums, "sums");
  assert_numel(sums, 2, "sums");
  assert_fp32(scale, "scale");
  assert_numel(scale, 1, "scale");
  const float count = sums.data<float>()[1];
  masked_loss_backward(ctx, loss_mask, count > 0 ? scale.data<float>()[0] / count : 0.0f, grad_losses);
}

}  // namespace megatron::cpu

namespace megatron::cpu {

// In the order of InferenceEngine's host log-softmax (sampling.cpp token_logprob): the max, then
// Σ exp(double(x) - max) left to right.
void logits_summary(Context&, const Tensor& logits, int64_t vocab, Tensor& argmax, Tensor& max_logit, Tensor& log_norm) {
  MG_ASSERT(logits.dim() == 2 && vocab > 0 && vocab <= logits.size(1), "logits_summary: logits {} for vocab {}",
            logits.str(), vocab);
  const int64_t n = logits.size(0), cols = logits.size(1);
  MG_ASSERT(argmax.dtype() == DType::Int64 && log_norm.dtype() == DType::Int64 && max_logit.dtype() == DType::Float32 &&
                argmax.numel() == n && max_logit.numel() == n && log_norm.numel() == n,
            "logits_summary: argmax {} (int64), max_logit {} (fp32), log_norm {} (int64) need {} entries", argmax.str(),
            max_logit.str(), log_norm.str(), n);
  FloatIn x(logits);
  for (int64_t r = 0; r < n; ++r) {
    const float* row = x.data() + r * cols;
    const int64_t best = int64_t(std::max_element(row, row + vocab) - row);
    const double max = row[best];
    double sum = 0;
    for (int64_t i = 0; i < vocab; ++i) sum += std::exp(double(row[i]) - max);
    argmax.data<int64_t>()[r] = best;
    max_logit.data<float>()[r] = row[best];
    log_norm.data<int64_t>()[r] = std::bit_cast<int64_t>(std::log(sum));
  }
}

}  // namespace megatron::cpu
