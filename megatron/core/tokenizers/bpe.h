// The byte-level BPE engine shared by GPT2BPETokenizer, HuggingFaceTokenizer and TikTokenizer.
//
// Three pieces: the GPT-2 bytes <-> unicode alphabet (so every byte sequence is a string of vocab
// symbols), a merge-rank BPE model over symbol strings (HuggingFace tokenizers' BPE: repeatedly merge
// the adjacent pair of lowest rank, leftmost first), and a word cache that several preprocessing
// threads share through one const tokenizer (see Note [Tokenizer word cache]).
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace megatron {

/// Length in bytes of the UTF-8 sequence starting with byte c (1 for a stray byte).
size_t utf8_char_len(unsigned char c);
/// Bytes -> text, each maximal invalid subsequence replaced by U+FFFD (Python's errors="replace",
/// Rust's from_utf8_lossy).
std::string utf8_lossy(std::string_view bytes);

/// GPT-2's reversible byte -> unicode map: printable bytes map to themselves, the other 68 to
/// U+0100.. in ascending order.
class ByteUnicodeMap {
 public:
  static const ByteUnicodeMap& get();
  /// Raw bytes -> the byte-level symbol string (UTF-8).
  std::string encode(std::string_view bytes) const;
  /// A symbol string back to raw bytes; false when a character is outside the alphabet.
  bool decode(std::string_view symbols, std::string& out) const;

 private:
  ByteUnicodeMap();
  std::array<std::string, 256> byte_to_symbol_;
  std::unordered_map<uint32_t, unsigned char> codepoint_to_byte_;
};

// Note [Tokenizer word cache]
// preprocess_data tokenizes on several threads through one const tokenizer, so the cache of
// word -> ids is split into shards, each behind its own mutex: threads rarely meet on one shard.
// A shard that grows past its cap is cleared (documents repeat their common words quickly).
class WordCache {
 public:
  bool lookup(std::string_view word, std::vector<int64_t>& out) const;
  void insert(std::string_view word, const std::vector<int64_t>& ids) const;

 private:
  static constexpr size_t kShards = 64;
  static constexpr size_t kShardCap = 1 << 15;
  struct Shard {
    std::mutex mu;
    std::unordered_map<std::string, std::vector<int64_t>> map;
  };
  mutable std::array<Shard, kShards> shards_;
};

/// A BPE model: vocab (symbol string -> id) and ranked merges of symbol pairs.
class BpeModel {
 public:
  struct Options {
    bool ignore_merges = false;      // a word already in the vocab is emitted whole
    std::optional<std::string> unk;  // unknown characters -> unk (else dropped)
    bool fuse_unk = false;
    // Ids run from 0 to the vocabulary's size - 1; a file may leave up to `extra_ids` holes for its
    // added tokens. An id beyond that is an error naming `source` (the file), before any table of
    // the id's size is allocated.
    size_t extra_ids = 0;
    std::string source = "tokenizer vocabulary";
  };
  BpeModel(std::unordered_map<std::string, int64_t> vocab,
           const std::vector<std::pair<std::string, std::string>>& merges, Options options);

  /// Appends the ids of one pre-tokenized word (already in the model's alphabet) to out.
  void encode(std::string_view word, std::vector<int64_t>& out) const;

  std::optional<int64_t> token_to_id(std::string_view token) const;
  /// The symbol string of an id, or nullptr.
  const std::string* id_to_token(int64_t id) const;
  const std::unordered_map<std::string, int64_t>& vocab() const { return vocab_; }

 private:
  void merge_word(std::string_view word, std::vector<int64_t>& out) const;

  std::unordered_map<std::string, int64_t> vocab_;
  std::vector<const std::string*> id_to_token_;
  // (left id, right id) -> (rank, merged id)
  std::unordered_map<uint64_t, std::pair<int32_t, int64_t>> merges_;
  Options options_;
  std::optional<int64_t> unk_id_;
  WordCache cache_;
};

}  // namespace megatron
