// preprocess_data and merge_datasets end to end: the exact commands of the Megatron oracle
// (fixtures/megatron_data/README.md), run from a temporary copy of the fixture folder, must write
// .bin/.idx files byte-identical to Megatron's; malformed input is reported by line number.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

#include "megatron/core/datasets/indexed_dataset.h"
#include "tests/fuzz_util.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

namespace fs = std::filesystem;

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << text;
}

std::string tool(const std::string& name) { return std::string(MEGATRON_BINARY_DIR) + "/bin/" + name; }

/// A temporary copy of the fixture folder's inputs and tokenizers, with an empty data/ beside them.
class FixtureCopy {
 public:
  FixtureCopy() {
    static std::atomic<int> counter{0};
    dir_ =
        fs::temp_directory_path() / ("mg_preprocess_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    const fs::path src = testing::data_fixtures_dir();
    fs::create_directories(dir_ / "data");
    for (const char* entry : {"in", "tok-gpt2", "tok-llama3bpe", "tok-spm.model", "tok-spm.vocab"}) {
      fs::copy(src / entry, dir_ / entry, fs::copy_options::recursive);
    }
    for (const auto& e : fs::recursive_directory_iterator(dir_)) {
      fs::permissions(e.path(), fs::perms::owner_write, fs::perm_options::add);
    }
  }
  ~FixtureCopy() {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::string path(const std::string& rel) const { return (dir_ / rel).string(); }

  /// Runs `command` (a tool and its arguments) from the copy; returns the exit status, keeps stderr.
  int run(const std::string& command) {
    std::string full = "cd '" + dir_.string() + "' && " + command + " > stdout.txt 2> stderr.txt";
    int status = std::system(full.c_str());
    stderr_ = read_bytes(path("stderr.txt"));
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }
  const std::string& stderr_text() const { return stderr_; }

 private:
  fs::path dir_;
  std::string stderr_;
};

std::string expected(const std::string& file) { return read_bytes(testing::data_fixtures_dir() + "/data/" + file); }

void expect_same_dataset(const FixtureCopy& fx, const std::string& ours, const std::string& megatron) {
  for (const char* ext : {".bin", ".idx"}) {
    ASSERT_TRUE(fs::exists(fx.path(ours + ext))) << ours << ext;
    EXPECT_TRUE(read_bytes(fx.path(ours + ext)) == expected(megatron + ext)) << ours << ext << " differs";
  }
}

const std::string kGpt2 =
    "--tokenizer-type GPT2BPETokenizer --vocab-file tok-gpt2/vocab.json --merge-file tok-gpt2/merges.txt";

TEST(PreprocessData, Gpt2MatchesMegatron) {
  FixtureCopy fx;
  ASSERT_EQ(fx.run(tool("preprocess_data") + " --input in/shakespeare.jsonl --output-prefix data/shakespeare " + kGpt2 +
                   " --append-eod --workers 2"),
            0)
      << fx.stderr_text();
  expect_same_dataset(fx, "data/shakespeare_text_document", "shakespeare_text_document");
  EXPECT_NE(fx.stderr_text().find("Processed 1000 documents"), std::string::npos) << fx.stderr_text();
  EXPECT_NE(fx.stderr_text().find("MB/s"), std::string::npos);
  for (const auto& e : fs::directory_iterator(fx.path("data"))) {
    EXPECT_EQ(e.path().string().find(".tmp"), std::string::npos) << "temporary file left: " << e.path();
  }
}

TEST(PreprocessData, SentencePieceMatchesMegatron) {
  FixtureCopy fx;
  ASSERT_EQ(fx.run(tool("preprocess_data") +
                   " --input in/shakespeare.jsonl --output-prefix data/shakespeare_spm --tokenizer-type "
                   "SentencePieceTokenizer --tokenizer-model tok-spm.model --append-eod --workers 2"),
            0)
      << fx.stderr_text();
  expect_same_dataset(fx, "data/shakespeare_spm_text_document", "shakespeare_spm_text_document");
}

TEST(PreprocessData, HuggingFaceMatchesMegatron) {
  FixtureCopy fx;
  ASSERT_EQ(fx.run(tool("preprocess_data") +
                   " --input in/shakespeare.jsonl --output-prefix data/shakespeare_l3 --tokenizer-type "
                   "HuggingFaceTokenizer --tokenizer-model tok-llama3bpe --workers 2"),
            0)
      << fx.stderr_text();
  expect_same_dataset(fx, "data/shakespeare_l3_text_document", "shakespeare_l3_text_document");
}

TEST(PreprocessData, WorkerCountDoesNotChangeOutput) {
  FixtureCopy fx;
  ASSERT_EQ(fx.run(tool("preprocess_data") + " --input in/shakespeare.jsonl --output-prefix data/w5 " + kGpt2 +
                   " --append-eod --workers 5 --log-interval 100"),
            0)
      << fx.stderr_text();
  expect_same_dataset(fx, "data/w5_text_document", "shakespeare_text_document");
  EXPECT_NE(fx.stderr_text().find("Processed 1300 documents"), std::string::npos);
}

TEST(PreprocessData, PartitionsFollowMegatron) {
  FixtureCopy fx;
  // Sequential partitions keep the input order: the merge equals the single-partition output.
  ASSERT_EQ(fx.run(tool("preprocess_data") + " --input in/shakespeare.jsonl --output-prefix data/seq " + kGpt2 +
                   " --append-eod --workers 2 --partitions 2 --keep-sequential-samples"),
            0)
      << fx.stderr_text();
  expect_same_dataset(fx, "data/seq_text_document", "shakespeare_text_document");
  // Round-robin partitions (Megatron's default): even lines first, then odd lines.
  ASSERT_EQ(fx.run(tool("preprocess_data") + " --input in/shakespeare.jsonl --output-prefix data/rr " + kGpt2 +
                   " --append-eod --workers 2 --partitions 2"),
            0)
      << fx.stderr_text();
  IndexedDataset rr(fx.path("data/rr_text_document"));
  IndexedDataset ref(testing::data_fixtures_dir() + "/data/shakespeare_text_document");
  ASSERT_EQ(rr.size(), ref.size());
  const size_t half = (ref.size() + 1) / 2;
  for (size_t i = 0; i < ref.size(); ++i) {
    const size_t src = i < half ? 2 * i : 2 * (i - half) + 1;
    ASSERT_EQ(rr.get(i), ref.get(src)) << "sequence " << i;
  }
  // The partition files and per-partition outputs are scratch, removed afterwards.
  EXPECT_FALSE(fs::exists(fx.path("in/shakespeare_0.jsonl")));
  EXPECT_FALSE(fs::exists(fx.path("data/rr_0_text_document.bin")));
}

TEST(PreprocessData, MalformedLineIsAnErrorWithItsNumber) {
  FixtureCopy fx;
  write_text(fx.path("bad.jsonl"), "{\"text\": \"hello world\"}\n{\"text\": \"fine\"}\n{\"text\": \"broken\n");
  EXPECT_NE(fx.run(tool("preprocess_data") + " --input bad.jsonl --output-prefix data/bad " + kGpt2 + " --workers 2"),
            0);
  EXPECT_NE(fx.stderr_text().find("bad.jsonl:3:"), std::string::npos) << fx.stderr_text();
  EXPECT_NE(fx.stderr_text().find("--skip-invalid-lines"), std::string::npos) << fx.stderr_text();
  EXPECT_TRUE(fs::is_empty(fx.path("data"))) << "no output (not even temporary files) after an error";

  write_text(fx.path("nokey.jsonl"), "{\"text\": \"a\"}\n{\"body\": \"b\"}\n");
  EXPECT_NE(
      fx.run(tool("preprocess_data") + " --input nokey.jsonl --output-prefix data/nokey " + kGpt2 + " --workers 1"), 0);
  EXPECT_NE(fx.stderr_text().find("nokey.jsonl:2: no key \"text\""), std::string::npos) << fx.stderr_text();
}

TEST(PreprocessData, SkipInvalidLinesReportsTheCount) {
  FixtureCopy fx;
  write_text(fx.path("mixed.jsonl"),
             "{\"text\": \"hello world\"}\nnot json\n{\"text\": \"\"}\n{\"text\": 5}\n{\"text\": [\"a b\", \"\", "
             "\"c\"]}\n{\"text\": \"last\"}");
  ASSERT_EQ(fx.run(tool("preprocess_data") + " --input mixed.jsonl --output-prefix data/mixed " + kGpt2 +
                   " --append-eod --workers 2 --skip-invalid-lines"),
            0)
      << fx.stderr_text();
  EXPECT_NE(fx.stderr_text().find("Done: 4 documents written (6 lines read, 2 invalid lines skipped)"),
            std::string::npos)
      << fx.stderr_text();
  IndexedDataset ds(fx.path("data/mixed_text_document"));
  // Documents: "hello world", "" (empty: no sequence), ["a b", "", "c"] (two sequences), "last".
  EXPECT_EQ(ds.num_documents(), 4u);
  EXPECT_EQ(std::vector<int64_t>(ds.document_indices().begin(), ds.document_indices().end()),
            (std::vector<int64_t>{0, 1, 1, 3, 4}));
  EXPECT_EQ(ds.get(0), (std::vector<int64_t>{31373, 995, 50256}));
  EXPECT_EQ(ds.get(1), (std::vector<int64_t>{64, 275}));
  EXPECT_EQ(ds.get(2), (std::vector<int64_t>{66, 50256}));
}

// "Done: N documents" counted the lines read; it counts the documents written.
TEST(PreprocessData, DoneCountsTheDocumentsWritten) {
  FixtureCopy fx;
  write_text(fx.path("one.jsonl"), "{\"text\": \"hello\"}\nnot json\n[1]\n{\"body\": \"x\"}\n");
  ASSERT_EQ(fx.run(tool("preprocess_data") + " --input one.jsonl --output-prefix data/one " + kGpt2 +
                   " --workers 1 --skip-invalid-lines"),
            0)
      << fx.stderr_text();
  EXPECT_NE(fx.stderr_text().find("Done: 1 document written (4 lines read, 3 invalid lines skipped)"),
            std::string::npos)
      << fx.stderr_text();
  EXPECT_EQ(IndexedDataset(fx.path("data/one_text_document")).num_documents(), 1u);
}

// A vocab.json id of 10^9 made preprocess_data allocate 7.8 GB and write int32 tokens; 2^32 ended
// with a bare std::bad_alloc. Run under a 2 GB address-space limit: one clear line, nothing written.
TEST(PreprocessData, AVocabIdBeyondTheVocabularyIsOneClearLine) {
  FixtureCopy fx;
  const std::string good = read_bytes(fx.path("tok-gpt2/vocab.json"));
  for (const std::string id : {"1000000000", "4294967296"}) {
    std::string vocab = good;
    const std::string key = "\"<|endoftext|>\": 50256";
    const size_t at = vocab.find(key);
    ASSERT_NE(at, std::string::npos);
    vocab.replace(at, key.size(), "\"<|endoftext|>\": " + id);
    write_text(fx.path("tok-gpt2/vocab.json"), vocab);
    EXPECT_EQ(fx.run("ulimit -v 2000000 && " + tool("preprocess_data") +
                     " --input in/shakespeare.jsonl --output-prefix data/big " + kGpt2 + " --workers 1"),
              1)
        << fx.stderr_text();
    EXPECT_NE(fx.stderr_text().find(id), std::string::npos) << fx.stderr_text();
    EXPECT_NE(fx.stderr_text().find("vocabulary"), std::string::npos) << fx.stderr_text();
    EXPECT_EQ(fx.stderr_text().find("bad_alloc"), std::string::npos) << fx.stderr_text();
    EXPECT_TRUE(fs::is_empty(fx.path("data"))) << "no output after an error";
  }
}

// The JSONL fuzzer: mutated lines (tests/fuzz_util.h's mutations, fixed seed) in one file, run with
// --skip-invalid-lines under a time limit; every line is either written or skipped as invalid, and
// the tool neither crashes nor hangs. Then the same file without skipping: one clean error line.
TEST(PreprocessData, FuzzJsonlLines) {
  FixtureCopy fx;
  const std::string seed = "{\"text\": \"The quick brown fox\\njumps \\u00e9 over\", \"id\": 17, \"meta\": [1, 2.5, null]}";
  testing::FuzzRng rng(50);
  std::string file;
  int tries = 0;
  for (; tries < 400; ++tries) {
    std::string line = testing::mutate(seed, rng);
    for (char& c : line) if (c == '\n' || c == '\r') c = ' ';  // one try per line
    file += line + "\n";
  }
  write_text(fx.path("fuzz.jsonl"), file);
  const int rc = fx.run("timeout 120 " + tool("preprocess_data") + " --input fuzz.jsonl --output-prefix data/fuzz " +
                        kGpt2 + " --workers 2 --skip-invalid-lines");
  ASSERT_EQ(rc, 0) << "crash or hang: " << fx.stderr_text();
  const std::string& err = fx.stderr_text();
  const size_t done = err.find("Done: ");
  ASSERT_NE(done, std::string::npos) << err;
  std::smatch m;
  const std::regex re(R"(Done: (\d+) documents? written \((\d+) lines read, (\d+) invalid)");
  ASSERT_TRUE(std::regex_search(err, m, re)) << err;
  const size_t written = std::stoul(m[1]), read = std::stoul(m[2]), skipped = std::stoul(m[3]);
  EXPECT_EQ(read, size_t(tries));
  EXPECT_EQ(written + skipped, read);
  EXPECT_GT(skipped, 0u);
  EXPECT_EQ(IndexedDataset(fx.path("data/fuzz_text_document")).num_documents(), written);
  std::printf("[fuzz] JSONL lines: %d tries: %zu clean errors (skipped as invalid), %zu accepted, 0 crashes, 0 hangs\n",
              tries, skipped, written);
  EXPECT_EQ(fx.run("timeout 120 " + tool("preprocess_data") + " --input fuzz.jsonl --output-prefix data/fuzz2 " + kGpt2 +
                   " --workers 2"),
            1);
  EXPECT_NE(fx.stderr_text().find("fuzz.jsonl:"), std::string::npos) << fx.stderr_text();
}

TEST(PreprocessData, FlagErrors) {
  FixtureCopy fx;
  EXPECT_NE(fx.run(tool("preprocess_data") + " --input in/shakespeare.jsonl --output-prefix data/x " + kGpt2 +
                   " --workers 1 --split-sentences"),
            0);
  EXPECT_NE(fx.stderr_text().find("--split-sentences is not supported"), std::string::npos) << fx.stderr_text();
  EXPECT_NE(fx.run(tool("preprocess_data") + " --input missing.jsonl --output-prefix data/x " + kGpt2 + " --workers 1"),
            0);
  EXPECT_NE(fx.stderr_text().find("missing.jsonl"), std::string::npos) << fx.stderr_text();
  EXPECT_NE(fx.run(tool("preprocess_data") + " --input in/shakespeare.jsonl --output-prefix nodir/x " + kGpt2 +
                   " --workers 1"),
            0);
  EXPECT_NE(fx.stderr_text().find("nodir"), std::string::npos) << fx.stderr_text();
  EXPECT_NE(fx.run(tool("preprocess_data") + " --input in/shakespeare.jsonl --output-prefix data/x " + kGpt2 +
                   " --workers 3 --partitions 2"),
            0);
  EXPECT_NE(fx.stderr_text().find("divisible"), std::string::npos) << fx.stderr_text();
}

TEST(MergeDatasets, SplitThenMergeEqualsWhole) {
  FixtureCopy fx;
  std::ifstream in(fx.path("in/shakespeare.jsonl"));
  std::ofstream a(fx.path("a.jsonl")), b(fx.path("b.jsonl"));
  int n = 0;
  for (std::string line; std::getline(in, line); ++n) (n < 700 ? a : b) << line << '\n';
  a.close();
  b.close();
  fs::create_directories(fx.path("parts"));
  // Prefixes chosen so that sorted order ("p1_..." < "p2_...") is the input order.
  ASSERT_EQ(fx.run(tool("preprocess_data") + " --input a.jsonl --output-prefix parts/p1 " + kGpt2 +
                   " --append-eod --workers 2"),
            0)
      << fx.stderr_text();
  ASSERT_EQ(fx.run(tool("preprocess_data") + " --input b.jsonl --output-prefix parts/p2 " + kGpt2 +
                   " --append-eod --workers 2"),
            0)
      << fx.stderr_text();
  ASSERT_EQ(fx.run(tool("merge_datasets") + " --input parts --output-prefix data/merged"), 0) << fx.stderr_text();
  expect_same_dataset(fx, "data/merged", "shakespeare_text_document");

  write_text(fx.path("parts/stray.txt"), "x");
  EXPECT_NE(fx.run(tool("merge_datasets") + " --input parts --output-prefix data/merged2"), 0);
  EXPECT_NE(fx.stderr_text().find("stray"), std::string::npos) << fx.stderr_text();
  fs::create_directories(fx.path("none"));
  EXPECT_NE(fx.run(tool("merge_datasets") + " --input none --output-prefix data/merged3"), 0);
  EXPECT_NE(fx.stderr_text().find("no datasets"), std::string::npos) << fx.stderr_text();
}

}  // namespace
}  // namespace megatron
