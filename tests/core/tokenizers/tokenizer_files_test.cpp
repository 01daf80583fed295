// Hostile tokenizer files: token ids beyond the vocabulary's size are one clear line with memory
// bounded by the file (not an allocation the size of the id), and a bounded mutation fuzzer over
// vocab.json, merges.txt, tokenizer.json and a SentencePiece .model (tests/fuzz_util.h).
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "megatron/core/tokenizers/bpe.h"
#include "megatron/core/tokenizers/tokenizer.h"
#include "megatron/runtime/check.h"
#include "tests/fuzz_util.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

namespace fs = std::filesystem;
using testing::ChildOutcome;
using testing::run_in_child;

std::string fx(const std::string& rel) { return testing::data_fixtures_dir() + "/" + rel; }

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

struct Dir {
  fs::path path;
  Dir() {
    static std::atomic<int> counter{0};
    path = fs::temp_directory_path() / ("mg_tokfiles_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~Dir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string write(const std::string& name, const std::string& bytes) const {
    std::ofstream(path / name, std::ios::binary | std::ios::trunc) << bytes;
    return (path / name).string();
  }
};

// A tiny byte-level BPE: the 256 byte symbols and a few merges (so files parse in microseconds).
struct TinyBpe {
  nlohmann::ordered_json vocab = nlohmann::ordered_json::object();
  std::vector<std::pair<std::string, std::string>> merges;
  TinyBpe() {
    const ByteUnicodeMap& m = ByteUnicodeMap::get();
    for (int b = 0; b < 256; ++b) vocab[m.encode(std::string(1, char(b)))] = b;
    auto merge = [&](const std::string& a, const std::string& c) {
      merges.emplace_back(a, c);
      if (!vocab.contains(a + c)) vocab[a + c] = int(vocab.size());
    };
    const std::string sp = m.encode(" ");
    merge("t", "h");
    merge("th", "e");
    merge(sp, "the");
    merge("i", "n");
    merge(sp, "in");
    merge("e", "r");
    vocab["<|endoftext|>"] = int(vocab.size());
  }
  std::string vocab_json() const { return vocab.dump(); }
  std::string merges_txt() const {
    std::string s = "#version: 0.2\n";
    for (const auto& [a, b] : merges) s += a + " " + b + "\n";
    return s;
  }
};

TokenizerArgs gpt2_files(const std::string& vocab, const std::string& merges) {
  TokenizerArgs a;
  a.tokenizer_type = "GPT2BPETokenizer";
  a.vocab_file = vocab;
  a.merge_file = merges;
  return a;
}

TokenizerArgs hf_file(const std::string& path) {
  TokenizerArgs a;
  a.tokenizer_type = "HuggingFaceTokenizer";
  a.tokenizer_model = path;
  return a;
}

/// Builds the tokenizer and uses it: every id it produces is inside its vocabulary.
void build_and_use(const TokenizerArgs& args) {
  auto tok = build_tokenizer(args);
  const std::vector<int64_t> ids = tok->tokenize("the inner thing <|endoftext|> in the end");
  for (int64_t id : ids) {
    if (id < 0 || id >= tok->vocab_size()) throw std::logic_error("an id outside the vocabulary");
  }
  (void)tok->detokenize(ids);
}

// A vocab.json id of 10^9 allocated a table of 10^9 entries (8 GB); one of 2^32 ended with a bare
// std::bad_alloc. Run in a child with 1 GB to spare: the error must come before any such allocation.
TEST(TokenizerFiles, AnIdBeyondTheVocabularyIsOneClearLine) {
  Dir dir;
  TinyBpe bpe;
  const std::string merges = dir.write("merges.txt", bpe.merges_txt());
  for (const char* id : {"1000000000", "4294967296"}) {
    nlohmann::ordered_json v = bpe.vocab;
    v["<|endoftext|>"] = nlohmann::json::parse(id);
    const std::string vocab = dir.write(std::string("vocab_") + id + ".json", v.dump());
    const auto r = run_in_child([&] { build_tokenizer(gpt2_files(vocab, merges)); }, 20.0, 512);
    EXPECT_EQ(r.outcome, ChildOutcome::clean_error) << id << ": " << r.message;
    EXPECT_NE(r.message.find(id), std::string::npos) << r.message;
    EXPECT_NE(r.message.find("<|endoftext|>"), std::string::npos) << r.message;
    EXPECT_NE(r.message.find("vocabulary"), std::string::npos) << r.message;
  }
  // A negative or fractional id.
  for (const char* id : {"-3", "2.5"}) {
    nlohmann::ordered_json v = bpe.vocab;
    v["er"] = nlohmann::json::parse(id);
    const std::string vocab = dir.write("vocab_bad.json", v.dump());
    const auto r = run_in_child([&] { build_tokenizer(gpt2_files(vocab, merges)); }, 20.0, 512);
    EXPECT_EQ(r.outcome, ChildOutcome::clean_error) << id << ": " << r.message;
    EXPECT_NE(r.message.find("'er'"), std::string::npos) << r.message;
  }
}

nlohmann::ordered_json tiny_tokenizer_json(const TinyBpe& bpe) {
  nlohmann::ordered_json vocab = bpe.vocab;
  const int eot = vocab["<|endoftext|>"].get<int>();
  vocab.erase("<|endoftext|>");
  nlohmann::ordered_json merges = nlohmann::ordered_json::array();
  for (const auto& [a, b] : bpe.merges) merges.push_back(a + " " + b);
  return {{"version", "1.0"},
          {"added_tokens", {{{"id", eot}, {"content", "<|endoftext|>"}, {"special", true}}}},
          {"normalizer", nullptr},
          {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
          {"post_processor", nullptr},
          {"decoder", {{"type", "ByteLevel"}}},
          {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}}}};
}

TEST(TokenizerFiles, ATokenizerJsonIdBeyondTheVocabularyIsOneClearLine) {
  Dir dir;
  TinyBpe bpe;
  ASSERT_NO_THROW(build_and_use(hf_file(dir.write("good.json", tiny_tokenizer_json(bpe).dump()))));
  // In the model's vocabulary, in an added token, and 2^32 (the bare std::bad_alloc).
  for (const char* id : {"1000000000", "4294967296"}) {
    nlohmann::ordered_json t = tiny_tokenizer_json(bpe);
    t["model"]["vocab"]["er"] = nlohmann::json::parse(id);
    const std::string path = dir.write("model_id.json", t.dump());
    auto r = run_in_child([&] { build_tokenizer(hf_file(path)); }, 20.0, 512);
    EXPECT_EQ(r.outcome, ChildOutcome::clean_error) << id << ": " << r.message;
    EXPECT_NE(r.message.find(id), std::string::npos) << r.message;
    EXPECT_NE(r.message.find("vocabulary"), std::string::npos) << r.message;

    t = tiny_tokenizer_json(bpe);
    t["added_tokens"][0]["id"] = nlohmann::json::parse(id);
    const std::string added = dir.write("added_id.json", t.dump());
    r = run_in_child([&] { build_tokenizer(hf_file(added)); }, 20.0, 512);
    EXPECT_EQ(r.outcome, ChildOutcome::clean_error) << id << ": " << r.message;
    EXPECT_NE(r.message.find(id), std::string::npos) << r.message;
    EXPECT_NE(r.message.find("<|endoftext|>"), std::string::npos) << r.message;
  }
}

// ---- fuzzing -------------------------------------------------------------------------------------

TEST(TokenizerFilesFuzz, VocabJson) {
  Dir dir;
  TinyBpe bpe;
  const std::string merges = dir.write("merges.txt", bpe.merges_txt());
  auto r = testing::fuzz("vocab.json", bpe.vocab_json(), 300, 30, [&](const std::string& v) {
    build_and_use(gpt2_files(dir.write("v" + std::to_string(::getpid()) + ".json", v), merges));
  });
  testing::expect_no_crash_or_hang(r);
}

TEST(TokenizerFilesFuzz, MergesTxt) {
  Dir dir;
  TinyBpe bpe;
  const std::string vocab = dir.write("vocab.json", bpe.vocab_json());
  auto r = testing::fuzz("merges.txt", bpe.merges_txt(), 300, 31, [&](const std::string& m) {
    build_and_use(gpt2_files(vocab, dir.write("m" + std::to_string(::getpid()) + ".txt", m)));
  });
  testing::expect_no_crash_or_hang(r);
}

TEST(TokenizerFilesFuzz, TokenizerJson) {
  Dir dir;
  // The Llama-3 style fixture (Split pre-tokenizer with a regex, post-processor, added tokens).
  const std::string seed = read_bytes(fx("tok-llama3bpe/tokenizer.json"));
  ASSERT_FALSE(seed.empty());
  auto r = testing::fuzz("tokenizer.json", seed, 300, 32, [&](const std::string& t) {
    build_and_use(hf_file(dir.write("t" + std::to_string(::getpid()) + ".json", t)));
  });
  testing::expect_no_crash_or_hang(r);
}

TEST(TokenizerFilesFuzz, SentencePieceModel) {
  Dir dir;
  const std::string seed = read_bytes(fx("tok-spm.model"));
  ASSERT_FALSE(seed.empty());
  auto r = testing::fuzz("SentencePiece .model", seed, 300, 33, [&](const std::string& m) {
    TokenizerArgs a;
    a.tokenizer_type = "SentencePieceTokenizer";
    a.tokenizer_model = dir.write("s" + std::to_string(::getpid()) + ".model", m);
    build_and_use(a);
  });
  testing::expect_no_crash_or_hang(r);
}

}  // namespace
}  // namespace megatron
