// Special ids, vocab sizes, special tokens in text, NullTokenizer, TikTokenizer on a tiny rank file,
// unique_identifiers (NullTokenizer's against the index-cache fixture), thread safety, bad inputs.
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "megatron/core/tokenizers/huggingface_tokenizer.h"
#include "megatron/core/tokenizers/tiktokenizer.h"
#include "megatron/core/tokenizers/tokenizer.h"
#include "megatron/runtime/check.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

namespace fs = std::filesystem;

std::string fx(const std::string& rel) { return testing::data_fixtures_dir() + "/" + rel; }

TokenizerArgs gpt2_args() {
  TokenizerArgs a;
  a.tokenizer_type = "GPT2BPETokenizer";
  a.vocab_file = fx("tok-gpt2/vocab.json");
  a.merge_file = fx("tok-gpt2/merges.txt");
  return a;
}

TokenizerArgs model_args(const std::string& type, const std::string& model) {
  TokenizerArgs a;
  a.tokenizer_type = type;
  a.tokenizer_model = model;
  return a;
}

// A fresh temporary folder, removed at the end of the test.
struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() / ("mg_tok_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) +
                                        "_" + ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  std::string write(const std::string& name, const std::string& text) const {
    std::ofstream(path / name, std::ios::binary) << text;
    return (path / name).string();
  }
};

TEST(Tokenizers, GPT2SpecialIds) {
  auto tok = build_tokenizer(gpt2_args());
  EXPECT_EQ(tok->vocab_size(), 50257);
  EXPECT_EQ(tok->eod(), 50256);
  EXPECT_EQ(tok->eos(), 50256);
  EXPECT_EQ(tok->bos(), 50256);
  EXPECT_FALSE(tok->pad().has_value());
  EXPECT_EQ(tok->tokenize("Hello world"), (std::vector<int64_t>{15496, 995}));
  // <|endoftext|> in the text is the special token, never split.
  EXPECT_EQ(tok->tokenize("a<|endoftext|>b"), (std::vector<int64_t>{64, 50256, 65}));
  EXPECT_EQ(tok->detokenize({64, 50256, 65}), "a<|endoftext|>b");
  const std::string unicode = "naïve café — 日本語 🤗\n\n  x";
  EXPECT_EQ(tok->detokenize(tok->tokenize(unicode)), unicode);
}

TEST(Tokenizers, HuggingFaceLlama3SpecialTokens) {
  auto tok = build_tokenizer(model_args("HuggingFaceTokenizer", fx("tok-llama3bpe")));
  EXPECT_EQ(tok->vocab_size(), 1000);
  EXPECT_EQ(tok->eod(), 1);  // <|end_of_text|>
  EXPECT_EQ(tok->eos(), 1);
  EXPECT_EQ(tok->bos(), 0);  // <|begin_of_text|>
  EXPECT_FALSE(tok->pad().has_value());
  auto plain = tok->tokenize("Hello there");
  auto with = tok->tokenize("<|begin_of_text|>Hello there<|end_of_text|>");
  ASSERT_EQ(with.size(), plain.size() + 2);
  EXPECT_EQ(with.front(), 0);
  EXPECT_EQ(with.back(), 1);
  EXPECT_EQ(std::vector<int64_t>(with.begin() + 1, with.end() - 1), plain);
  EXPECT_EQ(tok->detokenize(with), "<|begin_of_text|>Hello there<|end_of_text|>");
}

TEST(Tokenizers, HuggingFaceGpt2FolderMatchesGPT2BPE) {
  auto hf = build_tokenizer(model_args("HuggingFaceTokenizer", fx("tok-gpt2")));
  auto gpt2 = build_tokenizer(gpt2_args());
  const std::string text = "It's 2024: don't   panic!\r\n\tOK?<|endoftext|>";
  EXPECT_EQ(hf->tokenize(text), gpt2->tokenize(text));
  EXPECT_EQ(hf->eod(), 50256);
  EXPECT_EQ(hf->vocab_size(), 50257);
}

TEST(Tokenizers, HuggingFaceTemplateAndAddedTokens) {
  // A tiny byte-level BPE whose post-processor prepends <s>, with an rstrip added token.
  TempDir dir;
  nlohmann::json vocab = nlohmann::json::object();
  int id = 0;
  for (const char* t : {"<s>", "</s>", "h", "i", "\xC4\xA0", "hi", "\xC4\xA0hi"}) vocab[t] = id++;
  nlohmann::json tj = {
      {"added_tokens",
       {{{"id", 0}, {"content", "<s>"}, {"special", true}},
        {{"id", 1}, {"content", "</s>"}, {"special", true}, {"rstrip", true}}}},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
      {"post_processor",
       {{"type", "TemplateProcessing"},
        {"single",
         {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}}, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
        {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {0}}, {"tokens", {"<s>"}}}}}}}},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", {"h i", {"\xC4\xA0", "hi"}}}}}};
  dir.write("tokenizer.json", tj.dump());
  dir.write("tokenizer_config.json", R"({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "</s>"})");
  HuggingFaceTokenizer tok(dir.path.string());
  EXPECT_EQ(tok.tokenize("hi hi</s>   hi"), (std::vector<int64_t>{0, 5, 6, 1, 5}));
  EXPECT_EQ(tok.bos(), 0);
  EXPECT_EQ(tok.eod(), 1);
  EXPECT_EQ(tok.pad(), 1);
  EXPECT_EQ(tok.vocab_size(), 7);
}

TEST(Tokenizers, SentencePieceSpecialIds) {
  for (const char* type : {"SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"}) {
    auto tok = build_tokenizer(model_args(type, fx("tok-spm.model")));
    EXPECT_EQ(tok->vocab_size(), 1000) << type;
    EXPECT_EQ(tok->eod(), 2) << type;
    EXPECT_EQ(tok->eos(), 2) << type;
    EXPECT_EQ(tok->bos(), 1) << type;
    EXPECT_FALSE(tok->pad().has_value()) << type;
    EXPECT_EQ(tok->detokenize(tok->tokenize("Hello world")), "Hello world") << type;
  }
}

TEST(Tokenizers, NullTokenizer) {
  TokenizerArgs a;
  a.tokenizer_type = "NullTokenizer";
  a.vocab_size = 50257;
  auto tok = build_tokenizer(a);
  EXPECT_EQ(tok->vocab_size(), 50257);
  EXPECT_EQ(tok->eod(), 50256);
  EXPECT_FALSE(tok->pad().has_value());
  EXPECT_EQ(tok->tokenize("5 17 0 50256"), (std::vector<int64_t>{5, 17, 0, 50256}));
  EXPECT_EQ(tok->detokenize({5, 17, 0, 50256}), "5 17 0 50256");
  EXPECT_EQ(tok->detokenize(tok->tokenize("1 2 3")), "1 2 3");
  EXPECT_THROW(tok->tokenize("1 x"), Error);
  EXPECT_THROW(tok->tokenize("1  2"), Error);  // Python: int('') fails too
}

TEST(Tokenizers, NullTokenizerIdentifiersMatchIndexCache) {
  const fs::path cache = fx("cache-shared");
  ASSERT_TRUE(fs::is_directory(cache)) << cache;
  TokenizerArgs a;
  a.tokenizer_type = "NullTokenizer";
  a.vocab_size = 50257;
  const auto ids = build_tokenizer(a)->unique_identifiers();
  int checked = 0;
  for (const auto& entry : fs::directory_iterator(cache)) {
    if (entry.path().string().find("-description.txt") == std::string::npos) continue;
    std::ifstream in(entry.path());
    auto desc = nlohmann::ordered_json::parse(in);
    EXPECT_EQ(desc["tokenizer"].dump(), ids.dump()) << entry.path();
    // json.dumps(indent=4) of the tokenizer block, byte for byte.
    EXPECT_EQ(desc["tokenizer"].dump(4), ids.dump(4));
    ++checked;
  }
  EXPECT_EQ(checked, 3);
  EXPECT_EQ(ids.dump(), R"({"class":"megatron.core.tokenizers.text.models.default_tokenizer.DefaultTokenizerText",)"
                        R"("tokenizer_path":null,"vocab_size":"50257","pad_id":"-1"})");
}

TEST(Tokenizers, TextTokenizerIdentifiers) {
  auto gpt2 = build_tokenizer(gpt2_args())->unique_identifiers();
  nlohmann::ordered_json want = {
      {"class", "megatron.core.tokenizers.text.models.default_tokenizer.DefaultTokenizerText"},
      {"tokenizer_path", "GPT2BPETokenizer"},
      {"additional_special_tokens", "[]"},
      {"vocab_file", fx("tok-gpt2/vocab.json")},
      {"merges_file", fx("tok-gpt2/merges.txt")},
      {"use_fast", "True"},
      {"trust_remote_code", "False"},
      {"include_special_tokens", "True"}};
  EXPECT_EQ(gpt2.dump(), want.dump());
  auto hf = build_tokenizer(model_args("HuggingFaceTokenizer", fx("tok-llama3bpe")))->unique_identifiers();
  EXPECT_EQ(hf.dump(), nlohmann::ordered_json({{"class", want["class"]},
                                               {"tokenizer_path", fx("tok-llama3bpe")},
                                               {"vocab_file", "None"},
                                               {"merges_file", "None"},
                                               {"additional_special_tokens", "[]"},
                                               {"use_fast", "True"},
                                               {"trust_remote_code", "False"},
                                               {"include_special_tokens", "True"}})
                           .dump());
  auto spm = build_tokenizer(model_args("SentencePieceTokenizer", fx("tok-spm.model")))->unique_identifiers();
  EXPECT_EQ(spm.dump(), nlohmann::ordered_json({{"class", want["class"]},
                                                {"tokenizer_path", fx("tok-spm.model")},
                                                {"legacy", "False"},
                                                {"special_tokens", "None"}})
                            .dump());
}

// A rank file over bytes 'a'..'d' (the BPE needs every byte a text uses) plus merged tokens.
std::string tiny_ranks(const TempDir& dir) {
  const std::vector<std::pair<std::string, std::string>> tokens = {
      {"YQ==", "a"},  {"Yg==", "b"},  {"Yw==", "c"},        {"ZA==", "d"},  {"IA==", " "},
      {"YWI=", "ab"}, {"Y2Q=", "cd"}, {"YWJjZA==", "abcd"}, {"IGFi", " ab"}};
  std::string text;
  for (size_t i = 0; i < tokens.size(); ++i) text += tokens[i].first + " " + std::to_string(i) + "\n";
  return dir.write("tiny.tiktoken", text);
}

TEST(Tokenizers, TikTokenizerTinyRanks) {
  TempDir dir;
  TokenizerArgs a = model_args("TikTokenizer", tiny_ranks(dir));
  a.tiktoken_num_special_tokens = 10;
  a.vocab_size = 19;
  a.tiktoken_pattern = "v2";
  auto tok = build_tokenizer(a);
  EXPECT_EQ(tok->vocab_size(), 19);
  EXPECT_EQ(tok->eod(), 2);
  EXPECT_EQ(tok->bos(), 1);
  EXPECT_EQ(tok->pad(), 4);
  // "abcd" is one word (rank 7 -> id 17); " ab" (rank 8 -> 18); "dcab": d, c, ab.
  EXPECT_EQ(tok->tokenize("abcd ab"), (std::vector<int64_t>{17, 18}));
  EXPECT_EQ(tok->tokenize("dcab"), (std::vector<int64_t>{13, 12, 15}));
  EXPECT_EQ(tok->tokenize("<s>ab</s>"), (std::vector<int64_t>{1, 15, 2}));
  EXPECT_EQ(tok->detokenize({1, 15, 2, 14}), "<s>ab</s> ");
  EXPECT_EQ(tok->detokenize(tok->tokenize("abc dab")), "abc dab");
  auto ids = tok->unique_identifiers();
  EXPECT_EQ(ids["pattern"], "v2");
  EXPECT_EQ(ids["vocab_size"], "19");
  EXPECT_EQ(ids["num_special_tokens"], "10");
  EXPECT_EQ(ids["special_tokens"], "None");
  // The same ranks in Megatron's JSON list format.
  nlohmann::json list = nlohmann::json::array();
  for (auto [b64, s] : std::vector<std::pair<std::string, std::string>>{{"YQ==", "a"}, {"Yg==", "b"}})
    list.push_back({{"rank", list.size()}, {"token_bytes", b64}, {"token_str", s}});
  TikTokenizer::Options o;
  o.vocab_size = 9;
  o.num_special_tokens = 7;
  TikTokenizer json_tok(dir.write("ranks.json", list.dump()), o);
  EXPECT_EQ(json_tok.tokenize("ab"), (std::vector<int64_t>{7, 8}));
  // A vocab size the ranks cannot fill is a clear error.
  a.vocab_size = 30;
  EXPECT_THROW(build_tokenizer(a), Error);
}

TEST(Tokenizers, ConcurrentTokenizeIsConsistent) {
  auto tok = build_tokenizer(gpt2_args());
  std::vector<std::string> texts;
  for (int i = 0; i < 64; ++i)
    texts.push_back("Document " + std::to_string(i) + ": the quick brown fox, again and again.");
  std::vector<std::vector<int64_t>> want;
  for (const auto& t : texts) want.push_back(tok->tokenize(t));
  std::vector<std::thread> threads;
  std::atomic<int> bad{0};
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int rep = 0; rep < 50; ++rep) {
        size_t i = size_t(t * 7 + rep) % texts.size();
        if (tok->tokenize(texts[i]) != want[i]) ++bad;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad.load(), 0);
}

TEST(Tokenizers, BadInputsAreClearErrors) {
  TempDir dir;
  TokenizerArgs a = gpt2_args();
  a.vocab_file = (dir.path / "missing.json").string();
  EXPECT_THROW(build_tokenizer(a), Error);
  a.vocab_file = dir.write("corrupt.json", "{\"a\": 0, ");
  try {
    build_tokenizer(a);
    ADD_FAILURE() << "corrupt vocab accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("corrupt.json"), std::string::npos) << e.what();
  }
  a = gpt2_args();
  a.merge_file.clear();
  EXPECT_THROW(build_tokenizer(a), Error);
  EXPECT_THROW(build_tokenizer(model_args("HuggingFaceTokenizer", "")), Error);
  EXPECT_THROW(build_tokenizer(model_args("HuggingFaceTokenizer", dir.path.string())), Error);  // empty folder
  dir.write("tokenizer.json", "not json");
  EXPECT_THROW(build_tokenizer(model_args("HuggingFaceTokenizer", dir.path.string())), Error);
  EXPECT_THROW(build_tokenizer(model_args("SentencePieceTokenizer", dir.write("bad.model", "garbage"))), Error);
  EXPECT_THROW(build_tokenizer(model_args("TikTokenizer", (dir.path / "none").string())), Error);
  TokenizerArgs null_args;
  null_args.tokenizer_type = "NullTokenizer";
  EXPECT_THROW(build_tokenizer(null_args), Error);
  try {
    build_tokenizer(model_args("BertWordPieceCase2", ""));
    ADD_FAILURE() << "unknown type accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown --tokenizer-type 'BertWordPieceCase2'"), std::string::npos);
  }
}

}  // namespace
}  // namespace megatron
