// The streaming pieces of the HF mappings (Note [Streaming conversion] in tools/convert_checkpoint.cpp):
// transposed() made in row blocks equals the plain transpose of the chosen rows and columns in the
// source's dtype; rows_of() and the QKV row orders are views that give merge_qkv's inverse; and a
// bf16 export of a Llama (interleaved RoPE, q/k/v biases) hands on q, k, v and the embedding as bf16
// views of the checkpoint's tensors, never copies; HFFolder::same_bytes compares stored tensors.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <numeric>

#include "megatron/core/dist_checkpointing/safetensors.h"
#include "megatron/core/models/gpt/hf_mapping.h"
#include "megatron/core/models/gpt/hf_util.h"

namespace megatron {
namespace {

using namespace hf_detail;

Tensor counting(const Shape& shape, DType dtype) {
  std::vector<float> v(size_t(shape_numel(shape)));
  std::iota(v.begin(), v.end(), 0.0f);
  for (float& x : v) x = float(int(x) % 251);  // exact in bf16
  return Tensor::from_floats(v, shape, dtype);
}

TEST(HFStreaming, TransposedBlocksEqualThePlainTranspose) {
  const Tensor src = counting({3000, 1024}, DType::BFloat16);
  const RowParts t = transposed(src);
  EXPECT_EQ(t.shape(), Shape({1024, 3000}));
  EXPECT_EQ(t.dtype(), DType::BFloat16);
  EXPECT_EQ(t.count(), 2u) << "4 MiB blocks of 3000 bf16 columns: 699 rows each";
  const std::vector<float> s = src.to_floats(), out = t.materialize().to_floats();
  bool same = true;
  for (int64_t a = 0; a < 1024; ++a)
    for (int64_t b = 0; b < 3000; ++b) same = same && out[size_t(a * 3000 + b)] == s[size_t(b * 1024 + a)];
  EXPECT_TRUE(same);
  // Chosen rows and columns: out[a][b] = src[rows[b]][cols[a]].
  const Tensor small = counting({4, 5}, DType::Float32);
  const std::vector<int64_t> rows = {3, 0, 2}, cols = {4, 1};
  const std::vector<float> picked = transposed(small, rows, cols).materialize().to_floats(), v = small.to_floats();
  ASSERT_EQ(picked.size(), 6u);
  for (size_t a = 0; a < cols.size(); ++a)
    for (size_t b = 0; b < rows.size(); ++b) EXPECT_EQ(picked[a * 3 + b], v[size_t(rows[b] * 5 + cols[a])]);
}

Tensor offset(const Shape& shape, float base) {
  std::vector<float> v(size_t(shape_numel(shape)));
  std::iota(v.begin(), v.end(), base);
  return Tensor::from_floats(v, shape, DType::Float32);
}

TEST(HFStreaming, QkvRowOrdersAreMergeQkvsInverseAsViews) {
  const int64_t nq = 4, ng = 2, d = 3, h = 5;
  const Tensor q = offset({nq * d, h}, 0), k = offset({ng * d, h}, 1000), v = offset({ng * d, h}, 2000);
  const Tensor fused = merge_qkv(q, k, v, nq, ng, d);
  std::vector<int64_t> qs, ks, vs;
  split_qkv_order(nq, ng, d, qs, ks, vs);
  for (const auto& [order, want] : {std::pair{&qs, &q}, {&ks, &k}, {&vs, &v}}) {
    const RowParts rows = rows_of(fused, *order);
    EXPECT_EQ(rows.materialize().to_floats(), want->to_floats());
    for (const Tensor& piece : rows.parts) EXPECT_EQ(piece.storage(), fused.storage()) << "a view, not a copy";
  }
  EXPECT_EQ(rows_of(fused, qs).parts.size(), size_t(ng)) << "each group's q heads are one run of rows";
}

// A bf16 checkpoint exported (Qwen2: q/k/v biases; interleaved RoPE, whose rows the export reorders):
// q, k, v and the embedding are handed on as bf16 views of the checkpoint's tensors, never copies.
TEST(HFStreaming, Bf16ExportHandsOnViews) {
  const nlohmann::json j = {{"model_type", "qwen2"}, {"hidden_size", 32},        {"intermediate_size", 48},
                            {"num_hidden_layers", 1}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                            {"vocab_size", 100},      {"max_position_embeddings", 16}};
  HFModelInfo info = config_from_hf(j, 64);
  info.config.rotary_interleaved = true;  // Note [Exporting interleaved RoPE]
  GPTModel model(info.config);
  TensorMap state;
  for (const auto& [name, t] : model_state_dict(model)) state[name] = t.to(DType::BFloat16);
  const TensorSource source{[&](const std::string& n) { return state.at(n); },
                            [&](const std::string& n) { return state.count(n) > 0; }};
  std::map<std::string, std::string> from = {{"model.embed_tokens.weight", "embedding.word_embeddings.weight"}};
  for (const char* what : {"weight", "bias"})
    for (const char* p : {"q", "k", "v"})
      from[fmt::format("model.layers.0.self_attn.{}_proj.{}", p, what)] =
          fmt::format("decoder.layers.0.self_attention.linear_qkv.{}", what);
  size_t checked = 0;
  TensorSink sink([&](const std::string& name, RowParts t) {
    EXPECT_EQ(t.dtype(), DType::BFloat16) << name;
    if (!from.count(name)) return;
    ++checked;
    for (const Tensor& piece : t.parts) EXPECT_EQ(piece.storage(), state.at(from.at(name)).storage()) << name;
  });
  megatron_to_hf(info, source, sink);
  EXPECT_EQ(checked, from.size());
}

// HFFolder::same_bytes (DeepSeek's MTP copies, compared a chunk at a time from the file): equal
// bytes, one element changed, another dtype of the same values.
TEST(HFStreaming, SameBytesComparesTheStoredTensors) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("mg_hf_same_bytes_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "config.json") << R"({"model_type": "llama"})";
  const Tensor a = counting({300, 7}, DType::BFloat16);
  Tensor changed = a.clone();
  static_cast<uint16_t*>(changed.raw_data())[2099] ^= 1;  // the last element
  safetensors::write((dir / "model.safetensors").string(),
                     {{"a", a}, {"copy", a.clone()}, {"changed", changed}, {"fp32", a.to(DType::Float32)}});
  HFFolder folder(dir.string());
  EXPECT_TRUE(folder.same_bytes("a", "copy"));
  EXPECT_FALSE(folder.same_bytes("a", "changed"));
  EXPECT_FALSE(folder.same_bytes("a", "fp32"));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace megatron
