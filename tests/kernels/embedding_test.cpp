// Embedding: the sequence-first lookup, gradient checks of both tables, and bad ids.
#include <gtest/gtest.h>

#include "megatron/kernels/cpu/cpu_ops.h"
#include "tests/kernels/gradcheck.h"

namespace megatron {
namespace {

using testing::GradCheck;
using testing::random_tensor;
using testing::zeros_like;

constexpr int64_t kB = 2, kS = 3, kH = 4, kV = 5, kP = 6;

Tensor tokens() { return Tensor::from_ints({0, 4, 2, 2, 1, 4}, {kB, kS}, DType::Int32); }
Tensor positions() { return Tensor::from_ints({0, 1, 2, 3, 4, 5}, {kB, kS}, DType::Int64); }

TEST(Embedding, ForwardIsSequenceFirstSumOfTables) {
  Context ctx;
  Tensor word = random_tensor({kV, kH}, 1), pos = random_tensor({kP, kH}, 2);
  Tensor out = Tensor::empty({kS, kB, kH}, DType::Float32);
  cpu::embedding_forward(ctx, tokens(), positions(), word, pos, out);
  std::vector<int64_t> tok = tokens().to_ints(), p = positions().to_ints();
  std::vector<float> w = word.to_floats(), pe = pos.to_floats(), o = out.to_floats();
  for (int64_t s = 0; s < kS; ++s)
    for (int64_t b = 0; b < kB; ++b)
      for (int64_t c = 0; c < kH; ++c)
        EXPECT_FLOAT_EQ(o[size_t((s * kB + b) * kH + c)],
                        w[size_t(tok[size_t(b * kS + s)] * kH + c)] + pe[size_t(p[size_t(b * kS + s)] * kH + c)]);

  // Without position ids only the word table contributes.
  cpu::embedding_forward(ctx, tokens(), Tensor(), word, Tensor(), out);
  EXPECT_FLOAT_EQ(out.item((1 * kB + 0) * kH), w[size_t(4 * kH)]);
}

TEST(Embedding, GradCheckBothTables) {
  Context ctx;
  Tensor word = random_tensor({kV, kH}, 1), pos = random_tensor({kP, kH}, 2);
  GradCheck gc([&] {
    Tensor out = Tensor::empty({kS, kB, kH}, DType::Float32);
    cpu::embedding_forward(ctx, tokens(), positions(), word, pos, out);
    return std::vector<Tensor>{out};
  });
  Tensor word_grad = zeros_like(word), pos_grad = zeros_like(pos);
  cpu::embedding_backward(ctx, tokens(), positions(), gc.upstream(), word_grad, pos_grad);
  gc.check("word_grad", word, word_grad);
  gc.check("pos_grad", pos, pos_grad);

  // An undefined gradient is skipped; the other still accumulates.
  Tensor none;
  cpu::embedding_backward(ctx, tokens(), positions(), gc.upstream(), none, pos_grad);
  EXPECT_NEAR(pos_grad.item(0), 2 * gc.upstream().item(0), 1e-6);
}

TEST(Embedding, OutOfRangeIdIsAUserError) {
  Context ctx;
  Tensor word = random_tensor({kV, kH}, 1);
  Tensor out = Tensor::empty({kS, kB, kH}, DType::Float32);
  Tensor bad = Tensor::from_ints({0, 1, 2, 3, 4, kV}, {kB, kS}, DType::Int64);
  try {
    cpu::embedding_forward(ctx, bad, Tensor(), word, Tensor(), out);
    FAIL() << "expected megatron::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("token id 5"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("5 rows"), std::string::npos) << e.what();
    // The hint names flags megatron.cpp takes (it has no --padded-vocab-size).
    EXPECT_EQ(std::string(e.what()).find("--padded-vocab-size"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("--make-vocab-size-divisible-by"), std::string::npos) << e.what();
  }
  Tensor negative = Tensor::from_ints({0, -1, 2, 3, 4, 0}, {kB, kS}, DType::Int32);
  EXPECT_THROW(cpu::embedding_forward(ctx, negative, Tensor(), word, Tensor(), out), Error);
  Tensor word_grad = zeros_like(word), none;
  EXPECT_THROW(cpu::embedding_backward(ctx, bad, Tensor(), out, word_grad, none), Error);
}

}  // namespace
}  // namespace megatron
