// Helpers shared by the GPT dataset tests: temporary directories, file bytes, an in-memory
// low-level dataset and the fixture tokenizer.
#pragma once

#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "megatron/core/datasets/gpt_dataset.h"
#include "megatron/core/tokenizers/tokenizer.h"
#include "tests/test_util.h"

namespace megatron::testing {

/// A fresh directory under the system temp dir, removed (made writable first) at the end.
class ScratchDir {
 public:
  explicit ScratchDir(const std::string& tag) {
    static std::atomic<int> counter{0};
    path_ = std::filesystem::temp_directory_path() /
            ("mg_" + tag + "_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ec;
    for (auto& e : std::filesystem::recursive_directory_iterator(path_, ec))
      std::filesystem::permissions(e.path(), std::filesystem::perms::owner_all, std::filesystem::perm_options::add, ec);
    std::filesystem::permissions(path_, std::filesystem::perms::owner_all, std::filesystem::perm_options::add, ec);
    std::filesystem::remove_all(path_, ec);
  }
  const std::filesystem::path& path() const { return path_; }
  std::string str() const { return path_.string(); }

 private:
  std::filesystem::path path_;
};

/// Changes the working directory for a scope.
class ScopedCwd {
 public:
  explicit ScopedCwd(const std::filesystem::path& dir) : old_(std::filesystem::current_path()) {
    std::filesystem::current_path(dir);
  }
  ~ScopedCwd() { std::filesystem::current_path(old_); }

 private:
  std::filesystem::path old_;
};

inline std::string file_bytes(const std::filesystem::path& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

/// The Megatron data fixture folder (fixtures/megatron_data).
inline std::filesystem::path megatron_data() { return std::filesystem::path(data_fixtures_dir()); }

/// The fixture README's tokenizer: NullTokenizer with --vocab-size 50257.
inline std::shared_ptr<const Tokenizer> null_tokenizer(int64_t vocab = 50257) {
  TokenizerArgs a;
  a.tokenizer_type = "NullTokenizer";
  a.vocab_size = vocab;
  return std::shared_ptr<const Tokenizer>(build_tokenizer(a));
}

/// Sequences held in memory.
class VectorLowLevelDataset : public LowLevelDataset {
 public:
  explicit VectorLowLevelDataset(std::vector<std::vector<int64_t>> seqs) : seqs_(std::move(seqs)) {
    for (const auto& s : seqs_) lengths_.push_back(int32_t(s.size()));
  }
  std::span<const int32_t> sequence_lengths() const override { return lengths_; }
  void read_into(size_t i, int64_t offset, int64_t length, std::vector<int64_t>& out) const override {
    out.insert(out.end(), seqs_[i].begin() + offset, seqs_[i].begin() + offset + length);
  }
  const std::vector<int64_t>& seq(size_t i) const { return seqs_[i]; }

 private:
  std::vector<std::vector<int64_t>> seqs_;
  std::vector<int32_t> lengths_;
};

}  // namespace megatron::testing
