// IndexedDataset / IndexedDatasetBuilder: the Megatron oracle files (fixtures/megatron_data/data),
// byte-identical rebuilds and merges, and every kind of corrupt .idx/.bin giving a clear error.
#include "megatron/core/datasets/indexed_dataset.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "megatron/runtime/check.h"
#include "tests/fuzz_util.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

namespace fs = std::filesystem;

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), std::streamsize(bytes.size()));
}

/// A fresh directory under the system temp dir, removed at the end of the test.
class TempDir {
 public:
  TempDir() {
    static std::atomic<int> counter{0};
    path_ = fs::temp_directory_path() / ("mg_indexed_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

std::string data_dir() { return testing::data_fixtures_dir() + "/data"; }

/// Expects `fn` to throw megatron::Error whose message contains every one of `needles`.
void expect_error(const std::function<void()>& fn, const std::vector<std::string>& needles) {
  try {
    fn();
    ADD_FAILURE() << "no megatron::Error thrown (expected one mentioning " << needles.front() << ")";
  } catch (const Error& e) {
    for (const auto& n : needles) EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what();
  }
}

TEST(IndexedDataset, DTypeRule) {
  EXPECT_EQ(optimal_index_dtype(50257), IndexDType::UInt16);
  EXPECT_EQ(optimal_index_dtype(65499), IndexDType::UInt16);
  EXPECT_EQ(optimal_index_dtype(65500), IndexDType::Int32);
  EXPECT_EQ(optimal_index_dtype(128256), IndexDType::Int32);
  EXPECT_EQ(optimal_index_dtype(std::nullopt), IndexDType::Int32);
  EXPECT_EQ(index_dtype_size(IndexDType::UInt16), 2u);
  EXPECT_EQ(index_dtype_size(IndexDType::Float64), 8u);
  EXPECT_STREQ(to_string(IndexDType::UInt16), "uint16");
}

TEST(IndexedDataset, ReadsMegatronFixture) {
  // Map each input text to its document number, then check the first expected documents.
  std::map<std::string, size_t> doc_of_text;
  std::ifstream in(testing::data_fixtures_dir() + "/in/shakespeare.jsonl");
  size_t n = 0;
  for (std::string line; std::getline(in, line); ++n)
    doc_of_text[nlohmann::json::parse(line)["text"].get<std::string>()] = n;
  ASSERT_EQ(n, 1371u);

  struct Case {
    const char* prefix;
    const char* key;
    std::optional<int64_t> eod;
  };
  for (const Case& c :
       {Case{"shakespeare_text_document", "gpt2", 50256}, Case{"shakespeare_spm_text_document", "spm", 2},
        Case{"shakespeare_l3_text_document", "llama3bpe", std::nullopt}}) {
    SCOPED_TRACE(c.prefix);
    IndexedDataset ds(data_dir() + "/" + c.prefix);
    EXPECT_EQ(ds.dtype(), IndexDType::UInt16);
    EXPECT_EQ(ds.size(), 1371u);
    EXPECT_EQ(ds.num_documents(), 1371u);
    EXPECT_EQ(int64_t(fs::file_size(data_dir() + "/" + c.prefix + ".bin")), ds.num_tokens() * 2);
    for (size_t d = 0; d <= ds.num_documents(); ++d) ASSERT_EQ(ds.document_indices()[d], int64_t(d));
    EXPECT_EQ(ds.sequence_pointers()[0], 0);
    std::ifstream expected(testing::data_fixtures_dir() + "/expected_ids_shared.jsonl");
    std::string line;
    for (int k = 0; k < 25 && std::getline(expected, line); ++k) {
      auto e = nlohmann::json::parse(line);
      std::vector<int64_t> ids = e[c.key].get<std::vector<int64_t>>();
      if (c.eod) ids.push_back(*c.eod);
      size_t doc = doc_of_text.at(e["text"].get<std::string>());
      EXPECT_EQ(ds.get(doc), ids) << "document " << doc;
    }
    // get(i, offset, length) is a window of get(i).
    std::vector<int64_t> full = ds.get(7);
    EXPECT_EQ(ds.get(7, 3, 5), std::vector<int64_t>(full.begin() + 3, full.begin() + 8));
    EXPECT_EQ(ds.get(7, 4), std::vector<int64_t>(full.begin() + 4, full.end()));
    EXPECT_EQ(ds.raw(7).size(), full.size() * 2);
  }
}

TEST(IndexedDataset, GetBoundsAreErrors) {
  IndexedDataset ds(data_dir() + "/shakespeare_text_document");
  const int64_t len = ds.sequence_lengths()[3];
  expect_error([&] { ds.get(1371); }, {"out of range", "shakespeare_text_document"});
  expect_error([&] { ds.get(3, len + 1); }, {"requested"});
  expect_error([&] { ds.get(3, 2, len); }, {"requested"});
  expect_error([&] { ds.get(3, -1, 2); }, {"requested"});
  EXPECT_TRUE(ds.get(3, len).empty());
}

TEST(IndexedDatasetBuilder, RebuildsFixtureByteIdentical) {
  TempDir tmp;
  const std::string src = data_dir() + "/shakespeare_text_document";
  IndexedDataset ds(src);
  IndexedDatasetBuilder b(tmp / "copy.bin", optimal_index_dtype(50257));
  for (size_t d = 0; d < ds.num_documents(); ++d) {
    for (int64_t s = ds.document_indices()[d]; s < ds.document_indices()[d + 1]; ++s) b.add_item(ds.get(size_t(s)));
    b.end_document();
  }
  b.finalize(tmp / "copy.idx");
  EXPECT_EQ(read_bytes(tmp / "copy.bin"), read_bytes(src + ".bin"));
  EXPECT_EQ(read_bytes(tmp / "copy.idx"), read_bytes(src + ".idx"));
}

TEST(IndexedDatasetBuilder, MergeOfSplitsEqualsWhole) {
  TempDir tmp;
  const std::string src = data_dir() + "/shakespeare_spm_text_document";
  IndexedDataset ds(src);
  // Three parts (documents [0,500), [500,501), [501,1371)), merged back in order.
  const std::vector<size_t> cuts = {0, 500, 501, ds.num_documents()};
  for (size_t p = 0; p + 1 < cuts.size(); ++p) {
    IndexedDatasetBuilder b(tmp / ("part" + std::to_string(p) + ".bin"), IndexDType::UInt16);
    for (size_t d = cuts[p]; d < cuts[p + 1]; ++d) {
      std::vector<int64_t> ids = ds.get(d);
      std::vector<int32_t> lengths = {int32_t(ids.size())};
      b.add_document(ids, lengths);
    }
    b.finalize(tmp / ("part" + std::to_string(p) + ".idx"));
  }
  IndexedDatasetBuilder merged(tmp / "merged.bin", IndexDType::UInt16);
  for (size_t p = 0; p + 1 < cuts.size(); ++p) merged.add_index(tmp / ("part" + std::to_string(p)));
  merged.finalize(tmp / "merged.idx");
  EXPECT_EQ(read_bytes(tmp / "merged.bin"), read_bytes(src + ".bin"));
  EXPECT_EQ(read_bytes(tmp / "merged.idx"), read_bytes(src + ".idx"));
}

TEST(IndexedDatasetBuilder, RoundTripWithEmptyDocumentsAndMerge) {
  TempDir tmp;
  {
    IndexedDatasetBuilder b(tmp / "a.bin", IndexDType::Int32);
    b.add_item(std::vector<int64_t>{1, 2, 3});
    b.add_item(std::vector<int64_t>{70000});
    b.end_document();
    b.end_document();  // an empty document
    std::vector<int64_t> ids = {4, 5, 6, 7};
    std::vector<int32_t> lengths = {1, 3};
    b.add_document(ids, lengths);
    EXPECT_EQ(b.num_sequences(), 4u);
    EXPECT_EQ(b.num_documents(), 3u);
    b.finalize(tmp / "a.idx");
  }
  IndexedDataset a(tmp / "a");
  EXPECT_EQ(a.dtype(), IndexDType::Int32);
  EXPECT_EQ(std::vector<int64_t>(a.document_indices().begin(), a.document_indices().end()),
            (std::vector<int64_t>{0, 2, 2, 4}));
  EXPECT_EQ(std::vector<int64_t>(a.sequence_pointers().begin(), a.sequence_pointers().end()),
            (std::vector<int64_t>{0, 12, 16, 20}));
  EXPECT_EQ(a.get(1), std::vector<int64_t>{70000});
  EXPECT_EQ(a.get(3), (std::vector<int64_t>{5, 6, 7}));
  // Megatron's merge: lengths appended, document indices shifted by the sequence count so far.
  IndexedDatasetBuilder m(tmp / "m.bin", IndexDType::Int32);
  m.add_item(std::vector<int64_t>{9});
  m.end_document();
  m.add_index(tmp / "a");
  m.add_index(tmp / "a");
  m.finalize(tmp / "m.idx");
  IndexedDataset merged(tmp / "m");
  EXPECT_EQ(std::vector<int64_t>(merged.document_indices().begin(), merged.document_indices().end()),
            (std::vector<int64_t>{0, 1, 3, 3, 5, 7, 7, 9}));
  EXPECT_EQ(merged.get(5), (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(merged.get(8), (std::vector<int64_t>{5, 6, 7}));
  EXPECT_EQ(read_bytes(tmp / "m.bin"),
            std::string(4, '\0').replace(0, 1, "\x09") + read_bytes(tmp / "a.bin") + read_bytes(tmp / "a.bin"));
}

TEST(IndexedDatasetBuilder, MultimodalModes) {
  TempDir tmp;
  IndexedDatasetBuilder b(tmp / "mm.bin", IndexDType::UInt8, /*multimodal=*/true);
  b.add_item(std::vector<int64_t>{1, 2}, 0);
  b.add_item(std::vector<int64_t>{3}, 1);
  b.end_document();
  b.finalize(tmp / "mm.idx");
  EXPECT_EQ(fs::file_size(tmp / "mm.idx"), 34u + 13 * 2 + 8 * 2);
  IndexedDataset ds(tmp / "mm", /*multimodal=*/true);
  EXPECT_EQ(std::vector<int8_t>(ds.sequence_modes().begin(), ds.sequence_modes().end()), (std::vector<int8_t>{0, 1}));
  IndexedDataset plain(tmp / "mm");  // a multimodal index reads as a plain one, modes ignored
  EXPECT_EQ(plain.get(1), std::vector<int64_t>{3});
}

TEST(IndexedDatasetBuilder, Errors) {
  TempDir tmp;
  IndexedDatasetBuilder b(tmp / "u16.bin", IndexDType::UInt16);
  expect_error([&] { b.add_item(std::vector<int64_t>{65536}); }, {"65536", "uint16", "u16.bin"});
  expect_error([&] { b.add_item(std::vector<int64_t>{-1}); }, {"does not fit"});
  expect_error([&] { b.add_index(data_dir() + "/missing"); }, {"missing.idx", "not found"});
  {
    IndexedDatasetBuilder i32(tmp / "i32.bin", IndexDType::Int32);
    i32.add_item(std::vector<int64_t>{1});
    i32.end_document();
    i32.finalize(tmp / "i32.idx");
  }
  expect_error([&] { b.add_index(tmp / "i32"); }, {"dtype", "int32", "uint16"});
  expect_error([] { IndexedDatasetBuilder("/nonexistent-dir/x.bin"); }, {"/nonexistent-dir/x.bin"});
  b.finalize(tmp / "u16.idx");
  expect_error([&] { b.finalize(tmp / "u16.idx"); }, {"already finalized"});
  IndexedDataset empty(tmp / "u16");
  EXPECT_EQ(empty.size(), 0u);
  EXPECT_EQ(empty.num_documents(), 0u);
  expect_error([&] { empty.require_nonempty("GPTDataset"); }, {"u16", "empty", "GPTDataset"});
}

// ---- corrupt files -------------------------------------------------------------------------------

/// A valid 3-sequence, 2-document uint16 dataset (lengths 2, 3, 1) to corrupt.
struct Corruptible {
  TempDir tmp;
  std::string idx, bin;
  Corruptible() {
    IndexedDatasetBuilder b(tmp / "good.bin", IndexDType::UInt16);
    b.add_item(std::vector<int64_t>{1, 2});
    b.end_document();
    b.add_item(std::vector<int64_t>{3, 4, 5});
    b.add_item(std::vector<int64_t>{6});
    b.end_document();
    b.finalize(tmp / "good.idx");
    idx = read_bytes(tmp / "good.idx");
    bin = read_bytes(tmp / "good.bin");
  }
  /// Writes <name>.idx / <name>.bin and returns the prefix.
  std::string make(const std::string& name, const std::string& idx_bytes, const std::string& bin_bytes) {
    write_bytes(tmp / (name + ".idx"), idx_bytes);
    write_bytes(tmp / (name + ".bin"), bin_bytes);
    return tmp / name;
  }
  template <typename T>
  std::string patched(size_t offset, T value) const {
    std::string s = idx;
    std::memcpy(s.data() + offset, &value, sizeof(T));
    return s;
  }
};

// Offsets in the 3-sequence index: lengths 34, pointers 46, document indices 70 (3 entries).
constexpr size_t kLengths = 34, kPointers = 46, kDocs = 70;

TEST(IndexedDatasetCorrupt, GoodFileReads) {
  Corruptible c;
  ASSERT_EQ(c.idx.size(), 94u);
  IndexedDataset ds(c.make("ok", c.idx, c.bin));
  EXPECT_EQ(ds.get(1), (std::vector<int64_t>{3, 4, 5}));
}

TEST(IndexedDatasetCorrupt, MissingFiles) {
  Corruptible c;
  write_bytes(c.tmp / "only_idx.idx", c.idx);
  write_bytes(c.tmp / "only_bin.bin", c.bin);
  expect_error([&] { IndexedDataset(c.tmp / "only_idx"); }, {"only_idx.bin", "not found"});
  expect_error([&] { IndexedDataset(c.tmp / "only_bin"); }, {"only_bin.idx", "not found"});
  EXPECT_FALSE(IndexedDataset::exists(c.tmp / "only_idx"));
}

TEST(IndexedDatasetCorrupt, HeaderErrors) {
  Corruptible c;
  std::string bad_magic = c.idx;
  bad_magic[0] = 'X';
  expect_error([&] { IndexedDataset(c.make("magic", bad_magic, c.bin)); }, {"magic.idx", "bad magic"});
  expect_error([&] { IndexedDataset(c.make("ver", c.patched<uint64_t>(9, 2), c.bin)); },
               {"ver.idx", "unsupported version 2"});
  expect_error([&] { IndexedDataset(c.make("code0", c.patched<uint8_t>(17, 0), c.bin)); },
               {"code0.idx", "dtype code 0"});
  expect_error([&] { IndexedDataset(c.make("code9", c.patched<uint8_t>(17, 9), c.bin)); },
               {"code9.idx", "dtype code 9"});
  expect_error([&] { IndexedDataset(c.make("empty", "", c.bin)); }, {"empty.idx", "truncated"});
  expect_error([&] { IndexedDataset(c.make("short", c.idx.substr(0, 20), c.bin)); }, {"short.idx", "truncated"});
}

TEST(IndexedDatasetCorrupt, TruncatedOrInconsistentCounts) {
  Corruptible c;
  for (size_t keep : {size_t(34), size_t(50), c.idx.size() - 1}) {
    expect_error([&] { IndexedDataset(c.make("cut", c.idx.substr(0, keep), c.bin)); }, {"cut.idx", "truncated"});
  }
  expect_error([&] { IndexedDataset(c.make("bigS", c.patched<uint64_t>(18, 4), c.bin)); }, {"bigS.idx", "truncated"});
  expect_error([&] { IndexedDataset(c.make("hugeS", c.patched<uint64_t>(18, ~uint64_t(0) / 3), c.bin)); },
               {"hugeS.idx", "truncated"});
  expect_error([&] { IndexedDataset(c.make("hugeD", c.patched<uint64_t>(26, uint64_t(1) << 62), c.bin)); },
               {"hugeD.idx", "truncated"});
  expect_error([&] { IndexedDataset(c.make("noD", c.patched<uint64_t>(26, 0), c.bin)); },
               {"noD.idx", "document count of 0"});
  // A smaller S leaves the document indices at the wrong offset: they no longer end at S.
  expect_error([&] { IndexedDataset(c.make("smallS", c.patched<uint64_t>(18, 2), c.bin)); }, {"smallS.idx"});
}

TEST(IndexedDatasetCorrupt, DocumentIndices) {
  Corruptible c;
  expect_error([&] { IndexedDataset(c.make("start", c.patched<int64_t>(kDocs, 1), c.bin)); },
               {"start.idx", "start at 0"});
  expect_error([&] { IndexedDataset(c.make("mono", c.patched<int64_t>(kDocs + 8, 5), c.bin)); },
               {"mono.idx", "not monotone"});
  expect_error([&] { IndexedDataset(c.make("last", c.patched<int64_t>(kDocs + 16, 2), c.bin)); },
               {"last.idx", "last document index is 2", "3 sequences"});
}

TEST(IndexedDatasetCorrupt, PointersAndLengthsPastTheBin) {
  Corruptible c;
  expect_error([&] { IndexedDataset(c.make("ptr", c.patched<int64_t>(kPointers + 16, 100), c.bin)); },
               {"ptr.bin", "too short", "sequence 2"});
  expect_error([&] { IndexedDataset(c.make("negptr", c.patched<int64_t>(kPointers, -8), c.bin)); },
               {"negptr.idx", "negative pointer", "sequence 0"});
  expect_error([&] { IndexedDataset(c.make("len", c.patched<int32_t>(kLengths + 4, 1 << 30), c.bin)); },
               {"len.bin", "too short", "sequence 1"});
  expect_error([&] { IndexedDataset(c.make("neglen", c.patched<int32_t>(kLengths, -1), c.bin)); },
               {"neglen.idx", "negative length"});
  expect_error([&] { IndexedDataset(c.make("shortbin", c.idx, c.bin.substr(0, 11))); }, {"shortbin.bin", "too short"});
  expect_error([&] { IndexedDataset(c.make("nobin", c.idx, "")); }, {"nobin.bin", "too short"});
  // The dtype code changes the item size: int64 items overrun the 12-byte .bin.
  expect_error([&] { IndexedDataset(c.make("wide", c.patched<uint8_t>(17, 5), c.bin)); }, {"wide.bin", "too short"});
}

TEST(IndexedDatasetCorrupt, MergeRejectsUnpackedBin) {
  Corruptible c;
  std::string longer = c.bin + "xx";
  std::string prefix = c.make("trailing", c.idx, longer);
  IndexedDatasetBuilder b(c.tmp / "out.bin", IndexDType::UInt16);
  expect_error([&] { b.add_index(prefix); }, {"trailing.bin", "14 bytes", "12"});
}

// Note [Packed index]: a .bin holds exactly its sequences, back to back, so the pointers are the
// running sums of length x item size and the .bin's size is their total. A dtype code of another
// item size, a pointer into the middle of another sequence and trailing bytes all break that.
TEST(IndexedDatasetCorrupt, ADtypeCodeOfAnotherItemSizeIsAnError) {
  Corruptible c;  // uint16 (code 8): pointers 0, 4, 10 and a 12-byte .bin
  expect_error([&] { IndexedDataset(c.make("u8", c.patched<uint8_t>(17, 1), c.bin)); }, {"u8.idx", "uint8"});
  expect_error([&] { IndexedDataset(c.make("i8", c.patched<uint8_t>(17, 2), c.bin)); }, {"i8.idx", "int8"});
  expect_error([&] { IndexedDataset(c.make("f32", c.patched<uint8_t>(17, 7), c.bin)); }, {"f32", "float32"});
}

TEST(IndexedDatasetCorrupt, PointersThatAreNotTheRunningSumsAreAnError) {
  Corruptible c;
  // Sequence 1 pointing into sequence 0 (in bounds, so a bounds check alone accepts it).
  expect_error([&] { IndexedDataset(c.make("overlap", c.patched<int64_t>(kPointers + 8, 2), c.bin)); },
               {"overlap.idx", "sequence 1", "starts at byte 2", "byte 4"});
  expect_error([&] { IndexedDataset(c.make("first", c.patched<int64_t>(kPointers, 2), c.bin)); },
               {"first.idx", "sequence 0", "starts at byte 2"});
  // A length shortened inside the .bin: the next pointer no longer follows it.
  expect_error([&] { IndexedDataset(c.make("shorter", c.patched<int32_t>(kLengths, 1), c.bin)); },
               {"shorter.idx", "sequence 1"});
  expect_error([&] { IndexedDataset(c.make("trail", c.idx, c.bin + "xx")); }, {"trail.bin", "14 bytes", "12"});
}

TEST(IndexedDatasetCorrupt, ASignedDtypeOfTheSameSizeIsCaughtAtTheFirstNegativeToken) {
  TempDir tmp;
  IndexedDatasetBuilder b(tmp / "big.bin", IndexDType::UInt16);
  b.add_item(std::vector<int64_t>{1, 40000, 3});
  b.end_document();
  b.finalize(tmp / "big.idx");
  std::string idx = read_bytes(tmp / "big.idx");
  idx[17] = char(3);  // int16: the same item size, so the index itself stays consistent
  write_bytes(tmp / "i16.idx", idx);
  write_bytes(tmp / "i16.bin", read_bytes(tmp / "big.bin"));
  IndexedDataset ds(tmp / "i16");
  expect_error([&] { ds.get(0); }, {"i16", "negative token", "sequence 0", "int16"});
}

// ---- fuzzing -------------------------------------------------------------------------------------

/// A 12-document uint16 dataset (some documents empty, some of several sequences) to mutate.
struct FuzzSeed {
  TempDir tmp;
  std::string idx, bin;
  FuzzSeed() {
    IndexedDatasetBuilder b(tmp / "seed.bin", IndexDType::UInt16);
    for (int d = 0; d < 12; ++d) {
      for (int s = 0; s < d % 3; ++s) {
        std::vector<int64_t> ids;
        for (int k = 0; k < 1 + (d * 7 + s) % 9; ++k) ids.push_back((d * 131 + k * 17) % 65000);
        b.add_item(ids);
      }
      b.end_document();
    }
    b.finalize(tmp / "seed.idx");
    idx = read_bytes(tmp / "seed.idx");
    bin = read_bytes(tmp / "seed.bin");
  }
};

/// Opens <dir>/<pid>.{idx,bin}; if accepted, reads every sequence and checks that the index is
/// exactly the .bin (Note [Packed index]): an inconsistent index that opens is a failure.
void open_and_read_all(const std::string& dir, const std::string& idx, const std::string& bin) {
  const std::string prefix = dir + "/" + std::to_string(::getpid());
  write_bytes(prefix + ".idx", idx);
  write_bytes(prefix + ".bin", bin);
  IndexedDataset ds(prefix);
  uint64_t bytes = 0;
  for (size_t i = 0; i < ds.size(); ++i) {
    bytes += ds.get(i).size() * index_dtype_size(ds.dtype());
    if (uint64_t(ds.sequence_pointers()[i]) + ds.sequence_lengths()[i] * index_dtype_size(ds.dtype()) != bytes)
      throw std::logic_error("accepted an index whose pointers are not the running sums");
  }
  if (bytes != ds.bin_bytes()) throw std::logic_error("accepted an index that does not cover its .bin exactly");
}

TEST(IndexedDatasetFuzz, MutatedIndexFilesAreCleanErrorsOrConsistent) {
  FuzzSeed seed;
  const std::string dir = seed.tmp / "";
  auto r = testing::fuzz(".idx", seed.idx, 400, 20, [&](const std::string& idx) { open_and_read_all(dir, idx, seed.bin); });
  testing::expect_no_crash_or_hang(r);
}

TEST(IndexedDatasetFuzz, MutatedDataFilesAreCleanErrorsOrConsistent) {
  FuzzSeed seed;
  const std::string dir = seed.tmp / "";
  auto r = testing::fuzz(".bin", seed.bin, 200, 21, [&](const std::string& bin) { open_and_read_all(dir, seed.idx, bin); });
  testing::expect_no_crash_or_hang(r);
}

}  // namespace
}  // namespace megatron
