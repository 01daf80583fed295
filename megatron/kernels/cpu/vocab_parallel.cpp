// The vocab-parallel embedding and cross entropy, CPU reference (Megatron's VocabParallelEmbedding and
// _VocabParallelCrossEntropy).
//
// With tensor parallelism each rank holds a contiguous slice [vocab_start, vocab_start + Vl) of the
// vocabulary: Vl rows of the word table, Vl columns of the logits. The ops here are the per-rank
// pieces; the caller runs the collectives between them:
//   embedding  out = word_shard[id - vocab_start] for ids in the shard, 0 elsewhere  -> all-reduce Sum
//   loss       max = row max of the shard                                            -> all-reduce Max
//              sums = {Σ exp(x - max), x[label]} over the shard                       -> all-reduce Sum
//              losses = log Σ + max - x[label], lse = max + log Σ  (every rank, redundantly)
//              grad = (exp(x - lse) - onehot)·grad_losses, the one-hot on the label's rank only
// Combined over the shards these reproduce embedding_forward/backward and cross_entropy_forward/backward
// (tests/kernels/vocab_parallel_test.cpp). The exp-sums are accumulated in fp64 as in cross_entropy.cpp;
// rows go one at a time so bf16 logits are converted a row at a time.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "megatron/kernels/cpu/cpu_common.h"
#include "megatron/kernels/cpu/cpu_ops.h"
#include "megatron/kernels/ops.h"

namespace megatron::cpu {

namespace {

// The [b, s] token ids, batch-first.
struct Tokens {
  int64_t b = 0, s = 0;
  std::vector<int64_t> ids;
};

Tokens load_tokens(const Tensor& tokens) {
  MG_ASSERT(tokens.defined() && tokens.dim() == 2, "tokens must be [b, s], got {}",
            tokens.defined() ? tokens.str() : "undefined");
  return Tokens{tokens.size(0), tokens.size(1), load_indices(tokens, "tokens")};
}

void check_rows_tensor(const Tensor& t, const Tokens& tok, int64_t h, const char* name) {
  MG_ASSERT(t.dim() == 3 && t.size(0) == tok.s && t.size(1) == tok.b && t.size(2) == h,
            "{} is {}, expected [{}, {}, {}]", name, t.str(), tok.s, tok.b, h);
}

// logits [N, Vl]: the row count and the shard's width.
struct Shard {
  int64_t n = 0, v = 0;
};

Shard logits_shape(const Tensor& logits) {
  assert_float(logits, "logits");
  MG_ASSERT(logits.dim() >= 1, "logits must be [N, Vl], got {}", logits.str());
  Shard sh;
  sh.v = logits.size(-1);
  sh.n = sh.v == 0 ? 0 : rows_of(logits, sh.v, "logits");
  return sh;
}

// Labels [N] as global ids; a negative one is the user's mistake (the loss mask is how tokens are ignored).
std::vector<int64_t> load_labels(const Tensor& labels, int64_t n) {
  std::vector<int64_t> y = load_indices(labels, "labels");
  MG_ASSERT(int64_t(y.size()) == n, "labels {} do not match {} logit rows", labels.str(), n);
  for (int64_t i = 0; i < n; ++i) {
    MG_CHECK(y[size_t(i)] >= 0,
             "label {} at position {} is outside the vocabulary: mask ignored tokens with the loss mask instead of "
             "a negative label",
             y[size_t(i)], i);
  }
  return y;
}

}  // namespace

void vocab_parallel_embedding_forward(Context& ctx, const Tensor& tokens, const Tensor& word_shard, int64_t vocab_start,
                                      int64_t vocab_size, Tensor& out) {
  assert_float(word_shard, "word_shard");
  MG_ASSERT(word_shard.dim() == 2, "word_shard must be [Vl, h], got {}", word_shard.str());
  const int64_t vl = word_shard.size(0), h = word_shard.size(1);
  MG_ASSERT(vocab_start >= 0 && vocab_start + vl <= vocab_size, "shard [{}, {}) is outside the vocabulary [0, {})",
            vocab_start, vocab_start + vl, vocab_size);
  const Tokens tok = load_tokens(tokens);
  for (size_t i = 0; i < tok.ids.size(); ++i) {
    if (tok.ids[i] < 0 || tok.ids[i] >= vocab_size)
      ops::throw_bad_table_id("token id", tok.ids[i], int64_t(i), tok.s, vocab_size);
  }
  assert_float(out, "out");
  check_rows_tensor(out, tok, h, "out");

  const FloatIn w(word_shard);
  FloatOut o(out);
  for (int64_t si = 0; si < tok.s; ++si) {
    for (int64_t bi = 0; bi < tok.b; ++bi) {
      const int64_t local = tok.ids[size_t(bi * tok.s + si)] - vocab_start;
      float* dst = o.data() + (si * tok.b + bi) * h;
      if (local >= 0 && local < vl) {
        std::memcpy(dst, w.data() + local * h, size_t(h) * sizeof(float));
      } else {
        std::fill(dst, dst + h, 0.0f);
      }
    }
  }
}

void vocab_parallel_embedding_backward(Context& ctx, const Tensor& tokens, const Tensor& grad_out, int64_t vocab_start,
                                       Tensor& word_grad) {
  if (!word_grad.defined()) return;
  assert_float(grad_out, "grad_out");
  assert_fp32(word_grad, "word_grad");
  MG_ASSERT(grad_out.dim() == 3, "grad_out must be [s, b, h], got {}", grad_out.str());
  const int64_t h = grad_out.size(2);
  MG_ASSERT(word_grad.dim() == 2 && word_grad.size(1) == h, "word_grad is {}, expected [Vl, {}]", word_grad.str(), h);
  const int64_t vl = word_grad.size(0);
  const Tokens tok = load_tokens(tokens);
  check_rows_tensor(grad_out, tok, h, "grad_out");

  const FloatIn g(grad_out);
  float* table = word_grad.data<float>();
  for (int64_t si = 0; si < tok.s; ++si) {
    for (int64_t bi = 0; bi < tok.b; ++bi) {
      const int64_t local = tok.ids[size_t(bi * tok.s + si)] - vocab_start;
      if (local < 0 || local >= vl) continue;  // another rank's row
      const float* src = g.data() + (si * tok.b + bi) * h;
      float* dst = table + local * h;
      for (int64_t c = 0; c < h; ++c) dst[c] += src[c];
    }
  }
}

void cross_entropy_local_max(Context& ctx, const Tensor& logits, Tensor& max) {
  const Shard sh = logits_shape(logits);
  assert_fp32(max, "max");
  assert_numel(max, sh.n, "max");
  float* m_out = max.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < sh.n; ++n) {
    const FloatIn row(logits.flat_slice(n * sh.v, sh.v));
    float m = -INFINITY;
    for (int64_t c = 0; c < sh.v; ++c) m = std::max(m, row[c]);
    m_out[n] = m;
  }
}

void cross_entropy_local_sums(Context& ctx, const Tensor& logits, const Tensor& labels, int64_t vocab_start,
                              const Tensor& max, Tensor& sums) {
  const Shard sh = logits_shape(logits);
  const std::vector<int64_t> y = load_labels(labels, sh.n);
  assert_fp32(max, "max");
  assert_numel(max, sh.n, "max");
  assert_fp32(sums, "sums");
  assert_numel(sums, 2 * sh.n, "sums");
  const float* m_in = max.data<float>();
  float* exp_sums = sums.data<float>();
  float* label_logits = exp_sums + sh.n;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < sh.n; ++n) {
    const FloatIn row(logits.flat_slice(n * sh.v, sh.v));
    double sum = 0.0;
    for (int64_t c = 0; c < sh.v; ++c) sum += double(std::exp(row[c] - m_in[n]));
    exp_sums[n] = float(sum);
    const int64_t local = y[size_t(n)] - vocab_start;
    label_logits[n] = local >= 0 && local < sh.v ? row[local] : 0.0f;
  }
}

void cross_entropy_from_sums(Context& ctx, const Tensor& max, const Tensor& sums, Tensor& losses, Tensor& lse) {
  assert_fp32(max, "max");
  const int64_t n = max.numel();
  assert_fp32(sums, "sums");
  assert_numel(sums, 2 * n, "sums");
  assert_fp32(losses, "losses");
  assert_numel(losses, n, "losses");
  float* lse_out = nullptr;
  if (lse.defined()) {
    assert_fp32(lse, "lse");
    assert_numel(lse, n, "lse");
    lse_out = lse.data<float>();
  }
  const float* m = max.data<float>();
  const float* s = sums.data<float>();
  float* loss_out = losses.data<float>();
  for (int64_t i = 0; i < n; ++i) {
    const float l = m[i] + std::log(s[i]);
    loss_out[i] = l - s[n + i];
    if (lse_out) lse_out[i] = l;
  }
}

void vocab_parallel_cross_entropy_backward(Context& ctx, const Tensor& grad_losses, const Tensor& logits,
                                           const Tensor& labels, int64_t vocab_start, const Tensor& lse,
                                           Tensor& grad_logits) {
  const Shard sh = logits_shape(logits);
  const std::vector<int64_t> y = load_indices(labels, "labels");
  MG_ASSERT(int64_t(y.size()) == sh.n, "labels {} do not match logits {}", labels.str(), logits.str());
  assert_fp32(grad_losses, "grad_losses");
  assert_numel(grad_losses, sh.n, "grad_losses");
  assert_fp32(lse, "lse");
  assert_numel(lse, sh.n, "lse");
  assert_float(grad_logits, "grad_logits");
  assert_numel(grad_logits, logits.numel(), "grad_logits");
  const float* gl = grad_losses.data<float>();
  const float* lse_in = lse.data<float>();
  // In place is safe: each row is converted (FloatIn) before its FloatOut is written back.
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < sh.n; ++n) {
    const FloatIn row(logits.flat_slice(n * sh.v, sh.v));
    Tensor grad_row = grad_logits.flat_slice(n * sh.v, sh.v);
    FloatOut out(grad_row);
    for (int64_t c = 0; c < sh.v; ++c) out[c] = std::exp(row[c] - lse_in[n]) * gl[n];
    const int64_t local = y[size_t(n)] - vocab_start;
    if (local >= 0 && local < sh.v) out[local] -= gl[n];
  }
}

}  // namespace megatron::cpu
