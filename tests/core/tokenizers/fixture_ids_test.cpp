// Every document of megatron_data/expected_ids_shared.jsonl through our tokenizers must give exactly
// the ids HuggingFace transformers / sentencepiece gave (keys gpt2, llama3bpe, spm).
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "megatron/core/tokenizers/gpt2_bpe.h"
#include "megatron/core/tokenizers/huggingface_tokenizer.h"
#include "megatron/core/tokenizers/sentencepiece_tokenizer.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

struct Doc {
  std::string text;
  std::vector<int64_t> gpt2, llama3bpe, spm;
};

const std::vector<Doc>& docs() {
  static const std::vector<Doc> all = [] {
    std::vector<Doc> out;
    std::ifstream in(testing::data_fixtures_dir() + "/expected_ids_shared.jsonl");
    std::string line;
    while (std::getline(in, line)) {
      auto j = nlohmann::json::parse(line);
      out.push_back({j["text"].get<std::string>(), j["gpt2"].get<std::vector<int64_t>>(),
                     j["llama3bpe"].get<std::vector<int64_t>>(), j["spm"].get<std::vector<int64_t>>()});
    }
    return out;
  }();
  return all;
}

std::string fx(const std::string& rel) { return testing::data_fixtures_dir() + "/" + rel; }

// Tokenizes every document, expects the fixture ids, and (when lossless) the text back.
template <typename Field>
void check_all(const Tokenizer& tok, Field field, bool lossless, const char* name) {
  ASSERT_EQ(docs().size(), 300u) << "fixture not found under " << testing::data_fixtures_dir();
  size_t matched = 0;
  for (size_t i = 0; i < docs().size(); ++i) {
    const Doc& d = docs()[i];
    auto ids = tok.tokenize(d.text);
    if (ids == d.*field)
      ++matched;
    else
      ADD_FAILURE() << name << ": document " << i << " differs";
    if (lossless) EXPECT_EQ(tok.detokenize(ids), d.text) << name << ": document " << i << " does not round-trip";
  }
  EXPECT_EQ(matched, docs().size());
  std::printf("[ %s ] %zu / %zu fixture documents match\n", name, matched, docs().size());
}

TEST(FixtureIds, GPT2BPEOnFixtureFiles) {
  GPT2BPETokenizer tok(fx("tok-gpt2/vocab.json"), fx("tok-gpt2/merges.txt"));
  check_all(tok, &Doc::gpt2, true, "GPT2BPETokenizer tok-gpt2");
}

TEST(FixtureIds, GPT2BPEOnSharedData) {
  const std::string data = testing::fixtures_dir() + "/../data";
  if (!std::filesystem::exists(data + "/gpt2-vocab.json")) GTEST_SKIP() << "no " << data << "/gpt2-vocab.json";
  GPT2BPETokenizer tok(data + "/gpt2-vocab.json", data + "/gpt2-merges.txt");
  check_all(tok, &Doc::gpt2, true, "GPT2BPETokenizer shared/data");
}

TEST(FixtureIds, HuggingFaceLlama3Bpe) {
  HuggingFaceTokenizer tok(fx("tok-llama3bpe"));
  check_all(tok, &Doc::llama3bpe, true, "HuggingFaceTokenizer tok-llama3bpe");
}

TEST(FixtureIds, HuggingFaceLlama3BpeTokenizerJsonPath) {
  HuggingFaceTokenizer tok(fx("tok-llama3bpe/tokenizer.json"));
  EXPECT_EQ(tok.tokenize(docs()[0].text), docs()[0].llama3bpe);
  EXPECT_EQ(tok.eod(), 1);
}

TEST(FixtureIds, HuggingFaceGpt2Folder) {
  HuggingFaceTokenizer tok(fx("tok-gpt2"));
  check_all(tok, &Doc::gpt2, true, "HuggingFaceTokenizer tok-gpt2");
}

// The server's logprob token strings: a piece with "\u2581" reads with its space, so a text's
// token strings join to the text with the dummy-prefix space in front.
TEST(FixtureIds, SentencePieceTokenTextKeepsTheLeadingSpace) {
  SentencePieceTokenizer tok(fx("tok-spm.model"));
  const std::string text = "the cat sat on the mat";
  std::string joined;
  for (int64_t id : tok.tokenize(text)) joined += tok.token_text(id);
  EXPECT_EQ(joined, " " + text);
  EXPECT_EQ(tok.detokenize(tok.tokenize(text)), text);
}

TEST(FixtureIds, SentencePiece) {
  SentencePieceTokenizer tok(fx("tok-spm.model"));
  check_all(tok, &Doc::spm, false, "SentencePieceTokenizer tok-spm.model");
  // The model decodes its own ids to the same ids again.
  for (size_t i = 0; i < 20; ++i) {
    auto ids = tok.tokenize(docs()[i].text);
    EXPECT_EQ(tok.tokenize(tok.detokenize(ids)), ids);
  }
}

}  // namespace
}  // namespace megatron
