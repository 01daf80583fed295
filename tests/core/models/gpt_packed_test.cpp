// Packed sequences (Note [Packed sequences], core/packed_seq_params.h): a sequence holding several
// documents, with the documents' mask (--reset-attention-mask) and reset position ids, gives each
// document the loss and the parameter gradient of running that document alone — for the GPT style
// (learned positions, reset ids needed) and the Llama style (RoPE: relative by itself), on the
// plain and the fused-QKV attention paths, with several rows of different documents.
#include <gtest/gtest.h>

#include <cmath>

#include "megatron/core/models/gpt/gpt_model.h"
#include "megatron/core/packed_seq_params.h"
#include "megatron/kernels/ops.h"
#include "tests/core/model_test_util.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

TransformerConfig config(bool llama) {
  TransformerConfig c;
  c.num_layers = 2;
  c.hidden_size = 32;
  c.num_attention_heads = 4;
  c.vocab_size = 64;
  c.make_vocab_size_divisible_by = 16;
  c.max_position_embeddings = 32;
  c.hidden_dropout = 0.0f;
  c.attention_dropout = 0.0f;
  if (llama) {
    c.num_query_groups = 2;
    testing::use_llama_layers(c);
    c.ffn_hidden_size = 48;
  }
  return c;
}

std::vector<int64_t> ids(int64_t n, uint64_t seed, int64_t vocab) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  for (size_t i = 0; i < v.size(); ++i) v[i] = int64_t(philox_element(seed, 0, i) % uint64_t(vocab));
  return v;
}

struct Result {
  std::vector<float> losses;  // per token, row-major [b, s]
  std::vector<float> grads;   // the whole gradient buffer
};

// Forward, then backward of Σ over the tokens where `weight` is 1 of the per-token loss.
Result run(GPTModel& model, const Tensor& tokens, const Tensor& positions, const Tensor& labels, const Tensor& cu,
           const std::vector<float>& weight) {
  Context ctx(Device::cpu(), 7);
  model.params().zero_grad();
  GPTModel::Stash stash;
  Tensor losses = model.forward(ctx, tokens, positions, labels, stash, cu);
  Tensor grad = Tensor::from_floats(weight, losses.shape());
  model.backward(ctx, grad, stash);
  return {losses.to_floats(), model.params().grad_buffer().to_floats()};
}

double rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0, n = 0;
  for (size_t i = 0; i < a.size(); ++i) d += double(a[i] - b[i]) * (a[i] - b[i]), n += double(b[i]) * b[i];
  return std::sqrt(d / std::max(n, 1e-30));
}

// Two rows of s = 24 packing documents of lengths {5, 11, 8} and {24}; plus a row whose last
// "document" is the tail after the last EOD.
void check_documents_alone(bool llama, bool fused_qkv) {
  TransformerConfig c = config(llama);
  // GPT style: MHA without RoPE takes the fused path (Note [Fused QKV attention]), GQA the split one.
  if (!llama) c.num_query_groups = fused_qkv ? c.num_attention_heads : 2;
  GPTModel model(c);
  model.init_weights(11);
  const int64_t s = 24, vocab = c.vocab_size;
  const std::vector<std::vector<int64_t>> docs = {{5, 11, 8}, {24}, {9, 15}};
  const int64_t b = int64_t(docs.size());
  std::vector<int64_t> tok = ids(b * s, 1, vocab), lab = ids(b * s, 2, vocab), pos(size_t(b * s));
  std::vector<int64_t> cu_flat;
  size_t max_docs = 0;
  for (const auto& d : docs) max_docs = std::max(max_docs, d.size());
  for (int64_t i = 0; i < b; ++i) {
    int64_t start = 0;
    std::vector<int64_t> cu{0};
    for (int64_t len : docs[size_t(i)]) {
      for (int64_t j = 0; j < len; ++j) pos[size_t(i * s + start + j)] = j;  // --reset-position-ids
      start += len;
      cu.push_back(start);
    }
    cu.resize(max_docs + 1, s);
    cu_flat.insert(cu_flat.end(), cu.begin(), cu.end());
  }
  Tensor tokens = Tensor::from_ints(tok, {b, s}), labels = Tensor::from_ints(lab, {b, s});
  Tensor positions = Tensor::from_ints(pos, {b, s});
  Tensor cu = Tensor::from_ints(cu_flat, {b, int64_t(max_docs + 1)}, DType::Int32);

  for (int64_t i = 0; i < b; ++i) {
    int64_t start = 0;
    for (size_t t = 0; t < docs[size_t(i)].size(); ++t) {
      const int64_t len = docs[size_t(i)][t];
      std::vector<float> weight(size_t(b * s), 0.0f);
      for (int64_t j = 0; j < len; ++j) weight[size_t(i * s + start + j)] = 1.0f;
      const Result packed = run(model, tokens, positions, labels, cu, weight);

      std::vector<int64_t> dt(tok.begin() + i * s + start, tok.begin() + i * s + start + len);
      std::vector<int64_t> dl(lab.begin() + i * s + start, lab.begin() + i * s + start + len);
      const Result alone = run(model, Tensor::from_ints(dt, {1, len}), Tensor(), Tensor::from_ints(dl, {1, len}),
                               Tensor(), std::vector<float>(size_t(len), 1.0f));
      double worst_loss = 0;
      for (int64_t j = 0; j < len; ++j) {
        worst_loss = std::max(worst_loss, double(std::abs(packed.losses[size_t(i * s + start + j)] -
                                                          alone.losses[size_t(j)])));
      }
      const double grad_err = rel_diff(packed.grads, alone.grads);
      std::printf("%s%s row %lld document %zu (%lld tokens): loss err %.2e, gradient rel err %.2e\n",
                  llama ? "llama" : "gpt", fused_qkv ? " fused-qkv" : "", (long long)i, t, (long long)len, worst_loss,
                  grad_err);
      EXPECT_LT(worst_loss, 1e-5) << "row " << i << " document " << t;
      EXPECT_LT(grad_err, 1e-5) << "row " << i << " document " << t;
      start += len;
    }
  }
}

TEST(PackedSequences, GptDocumentsEqualRunningEachAlone) { check_documents_alone(false, false); }
TEST(PackedSequences, GptFusedQkvDocumentsEqualRunningEachAlone) { check_documents_alone(false, true); }
TEST(PackedSequences, LlamaDocumentsEqualRunningEachAlone) { check_documents_alone(true, false); }

// The data loader's EOD counts -> cumulative document lengths, rows padded with empty documents.
TEST(PackedSequences, CuSeqlensFromSegments) {
  // Row 0: EODs at 2 and 5 (each ends its document): segments 0 0 0 1 1 1 2 2; row 1: none.
  Tensor seg = Tensor::from_ints({0, 0, 0, 1, 1, 1, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0}, {2, 8}, DType::Int32);
  Tensor cu = cu_seqlens_from_segments(seg);
  EXPECT_EQ(cu.shape(), (Shape{2, 4}));
  EXPECT_EQ(cu.to_ints(), (std::vector<int64_t>{0, 3, 6, 8, 0, 8, 8, 8}));
  PackedSeqParams p = make_packed_seq_params(cu, Device::cpu());
  EXPECT_EQ(p.max_documents, 3);
  EXPECT_EQ(p.seq_length, 8);
  // Context parallelism over 2 ranks: 4 chunks of 2 (one row only).
  PackedSeqParams one = make_packed_seq_params(cu_seqlens_from_segments(seg.slice(0, 1)), Device::cpu());
  add_context_parallel_chunks(one, 2, Device::cpu());
  ASSERT_EQ(one.chunk_cu_seqlens.size(), 4u);
  EXPECT_EQ(one.chunk_cu_seqlens[0].to_ints(), (std::vector<int64_t>{0, 2}));
  EXPECT_EQ(one.chunk_cu_seqlens[1].to_ints(), (std::vector<int64_t>{0, 1, 2}));  // boundary at 3
  EXPECT_EQ(one.chunk_cu_seqlens[2].to_ints(), (std::vector<int64_t>{0, 2}));
  EXPECT_EQ(one.chunk_cu_seqlens[3].to_ints(), (std::vector<int64_t>{0, 2}));  // boundary at 6 = chunk start
}

TEST(PackedSequences, BadDocumentsAreOneLine) {
  GPTModel model(config(true));
  model.init_weights(1);
  Context ctx(Device::cpu(), 1);
  GPTModel::Stash stash;
  Tensor t = Tensor::from_ints(ids(8, 3, 64), {1, 8});
  std::string e = testing::error_of(
      [&] { model.forward(ctx, t, Tensor(), t, stash, Tensor::from_ints({0, 5, 4, 8}, {1, 4}, DType::Int32)); });
  EXPECT_NE(e.find("decreases at document 1"), std::string::npos) << e;
  e = testing::error_of(
      [&] { model.forward(ctx, t, Tensor(), t, stash, Tensor::from_ints({0, 5, 12}, {1, 3}, DType::Int32)); });
  EXPECT_NE(e.find("not those of 1 sequences of 8 positions"), std::string::npos) << e;
}

}  // namespace
}  // namespace megatron
