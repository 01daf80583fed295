// Token and learned position embeddings, CPU reference.
//
// tokens and position_ids are batch-first [b, s] (as the data loader produces them); the output is
// sequence-first [s, b, h], so the lookup does the transpose. Row (si, bi) of the output is
// word[tokens[bi, si]] + pos[position_ids[bi, si]]. The backward scatter-adds each output row's
// gradient into the fp32 tables' gradients. Ids are checked against the tables before any work.
#include <cstring>

#include "megatron/kernels/cpu/cpu_common.h"
#include "megatron/kernels/cpu/cpu_ops.h"
#include "megatron/kernels/ops.h"

namespace megatron::cpu {

namespace {

struct Lookup {
  int64_t b = 0, s = 0;
  std::vector<int64_t> ids;  // [b, s]
};

// Loads ids [b, s] and checks every one lies in [0, rows) of the table.
Lookup load_ids(const Tensor& ids, int64_t rows, const char* what) {
  MG_ASSERT(ids.defined() && ids.dim() == 2, "{} must be [b, s], got {}", what,
            ids.defined() ? ids.str() : "undefined");
  Lookup l{ids.size(0), ids.size(1), load_indices(ids, what)};
  for (size_t i = 0; i < l.ids.size(); ++i) {
    if (l.ids[i] < 0 || l.ids[i] >= rows) ops::throw_bad_table_id(what, l.ids[i], int64_t(i), l.s, rows);
  }
  return l;
}

// out[si, bi, :] (+)= table[ids[bi, si], :]
void gather_rows(const Lookup& l, const float* table, int64_t h, bool accumulate, float* out) {
  for (int64_t si = 0; si < l.s; ++si) {
    for (int64_t bi = 0; bi < l.b; ++bi) {
      const float* src = table + l.ids[size_t(bi * l.s + si)] * h;
      float* dst = out + (si * l.b + bi) * h;
      if (accumulate) {
        for (int64_t c = 0; c < h; ++c) dst[c] += src[c];
      } else {
        std::memcpy(dst, src, size_t(h) * sizeof(float));
      }
    }
  }
}

// grad_table[ids[bi, si], :] += grad_out[si, bi, :]
void scatter_add_rows(const Lookup& l, const float* grad_out, int64_t h, float* grad_table) {
  for (int64_t si = 0; si < l.s; ++si) {
    for (int64_t bi = 0; bi < l.b; ++bi) {
      const float* src = grad_out + (si * l.b + bi) * h;
      float* dst = grad_table + l.ids[size_t(bi * l.s + si)] * h;
      for (int64_t c = 0; c < h; ++c) dst[c] += src[c];
    }
  }
}

void check_output_shape(const Tensor& t, const Lookup& l, int64_t h, const char* name) {
  MG_ASSERT(t.dim() == 3 && t.size(0) == l.s && t.size(1) == l.b && t.size(2) == h, "{} is {}, expected [{}, {}, {}]",
            name, t.str(), l.s, l.b, h);
}

}  // namespace

void embedding_forward(Context& ctx, const Tensor& tokens, const Tensor& position_ids, const Tensor& word_weight,
                       const Tensor& pos_weight, Tensor& out) {
  assert_float(word_weight, "word_weight");
  MG_ASSERT(word_weight.dim() == 2, "word_weight must be [V, h], got {}", word_weight.str());
  const int64_t h = word_weight.size(1);
  Lookup words = load_ids(tokens, word_weight.size(0), "token id");
  assert_float(out, "out");
  check_output_shape(out, words, h, "out");

  FloatOut o(out);
  gather_rows(words, FloatIn(word_weight).data(), h, /*accumulate=*/false, o.data());
  if (position_ids.defined()) {
    assert_float(pos_weight, "pos_weight");
    MG_ASSERT(pos_weight.dim() == 2 && pos_weight.size(1) == h, "pos_weight is {}, expected [P, {}]", pos_weight.str(),
              h);
    Lookup pos = load_ids(position_ids, pos_weight.size(0), "position id");
    MG_ASSERT(pos.b == words.b && pos.s == words.s, "position_ids {} and tokens {} differ in shape", position_ids.str(),
              tokens.str());
    gather_rows(pos, FloatIn(pos_weight).data(), h, /*accumulate=*/true, o.data());
  }
}

void embedding_backward(Context& ctx, const Tensor& tokens, const Tensor& position_ids, const Tensor& grad_out,
                        Tensor& word_grad, Tensor& pos_grad) {
  assert_float(grad_out, "grad_out");
  MG_ASSERT(grad_out.dim() == 3, "grad_out must be [s, b, h], got {}", grad_out.str());
  const int64_t h = grad_out.size(2);
  FloatIn g(grad_out);
  if (word_grad.defined()) {
    assert_fp32(word_grad, "word_grad");
    MG_ASSERT(word_grad.dim() == 2 && word_grad.size(1) == h, "word_grad is {}, expected [V, {}]", word_grad.str(), h);
    Lookup words = load_ids(tokens, word_grad.size(0), "token id");
    check_output_shape(grad_out, words, h, "grad_out");
    scatter_add_rows(words, g.data(), h, word_grad.data<float>());
  }
  if (pos_grad.defined() && position_ids.defined()) {
    assert_fp32(pos_grad, "pos_grad");
    MG_ASSERT(pos_grad.dim() == 2 && pos_grad.size(1) == h, "pos_grad is {}, expected [P, {}]", pos_grad.str(), h);
    Lookup pos = load_ids(position_ids, pos_grad.size(0), "position id");
    check_output_shape(grad_out, pos, h, "grad_out");
    scatter_add_rows(pos, g.data(), h, pos_grad.data<float>());
  }
}

}  // namespace megatron::cpu
