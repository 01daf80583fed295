// Megatron's indexed dataset: a token file (<prefix>.bin) and its index (<prefix>.idx).
//
// The .idx layout (little-endian, packed; Megatron-LM megatron/core/datasets/indexed_dataset.py):
//   "MMIDIDX\0\0" | u64 version 1 | u8 dtype code | u64 sequence count S | u64 document count D |
//   int32 lengths[S] | int64 byte pointers[S] | int64 document indices[D] | int8 modes[S] (multimodal)
// The .bin is the raw concatenation of the sequences in the index dtype.
//
// IndexedDataset validates the whole index when it opens it: the pointers are the running sums of
// the lengths in the dtype's item size and the .bin holds exactly those bytes (Note [Packed index]
// in the .cpp), document indices are monotone from 0 to S; a signed dtype's negative token is an
// error when read. So a corrupt, truncated or mislabelled pair of files is one clear megatron::Error
// naming the file and never an out-of-bounds read. The index arrays are copied into aligned vectors
// (the file's int32 lengths start at the unaligned offset 34); the .bin stays memory-mapped.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace megatron {

/// Megatron's numeric dtype codes of the .idx header.
enum class IndexDType : uint8_t {
  UInt8 = 1,
  Int8 = 2,
  Int16 = 3,
  Int32 = 4,
  Int64 = 5,
  Float64 = 6,
  Float32 = 7,
  UInt16 = 8,
};

/// Bytes per element.
size_t index_dtype_size(IndexDType dtype);
/// numpy's name of the dtype ("uint16", ...).
const char* to_string(IndexDType dtype);
/// Megatron's DType.optimal_dtype: uint16 if the vocabulary has fewer than 65500 entries, else int32.
IndexDType optimal_index_dtype(std::optional<int64_t> vocab_size);

std::string get_idx_path(const std::string& path_prefix);  // prefix + ".idx"
std::string get_bin_path(const std::string& path_prefix);  // prefix + ".bin"

/// Writes a complete .idx file: header, lengths, pointers (running byte sums), document indices
/// and, if given, the multimodal sequence modes.
void write_index_file(const std::string& idx_path, IndexDType dtype, std::span<const int32_t> sequence_lengths,
                      std::span<const int64_t> document_indices,
                      std::optional<std::span<const int8_t>> sequence_modes = std::nullopt);

/// Read-only view of an indexed dataset (Megatron's IndexedDataset).
class IndexedDataset {
 public:
  /// Opens <prefix>.idx and <prefix>.bin and validates them; throws megatron::Error on any problem.
  explicit IndexedDataset(std::string path_prefix, bool multimodal = false);
  ~IndexedDataset();
  IndexedDataset(const IndexedDataset&) = delete;
  IndexedDataset& operator=(const IndexedDataset&) = delete;
  IndexedDataset(IndexedDataset&& other) noexcept;
  IndexedDataset& operator=(IndexedDataset&& other) noexcept;

  /// Whether both <prefix>.idx and <prefix>.bin exist.
  static bool exists(const std::string& path_prefix);

  const std::string& path_prefix() const { return path_prefix_; }
  IndexDType dtype() const { return dtype_; }
  bool multimodal() const { return multimodal_; }
  /// Number of sequences S (Megatron's len(dataset)).
  size_t size() const { return lengths_.size(); }
  /// Number of documents (D - 1).
  size_t num_documents() const { return doc_indices_.size() - 1; }
  /// Total number of tokens in the .bin.
  int64_t num_tokens() const { return num_tokens_; }

  std::span<const int32_t> sequence_lengths() const { return lengths_; }
  std::span<const int64_t> sequence_pointers() const { return pointers_; }
  /// D entries: 0, then the sequence count after each document; the last is S.
  std::span<const int64_t> document_indices() const { return doc_indices_; }
  /// Multimodal only (empty otherwise).
  std::span<const int8_t> sequence_modes() const { return modes_; }

  /// Tokens of sequence i (Megatron's get(idx)).
  std::vector<int64_t> get(size_t i) const;
  /// `length` tokens of sequence i from token `offset`; length nullopt = to the end of the sequence.
  std::vector<int64_t> get(size_t i, int64_t offset, std::optional<int64_t> length = std::nullopt) const;
  /// Like get(i, offset, length), appending to `out` (no allocation when `out` has capacity).
  void read_into(size_t i, int64_t offset, int64_t length, std::vector<int64_t>& out) const;
  /// Raw bytes of sequence i in the file dtype.
  std::span<const std::byte> raw(size_t i) const;

  /// The whole mapped .bin.
  const std::byte* bin_data() const { return bin_; }
  size_t bin_bytes() const { return bin_size_; }

  /// Throws megatron::Error if the dataset has no sequences, naming `purpose`.
  void require_nonempty(const std::string& purpose) const;

 private:
  void load_index(const std::string& idx_path);
  void map_bin(const std::string& bin_path);
  void release();

  std::string path_prefix_;
  bool multimodal_ = false;
  IndexDType dtype_ = IndexDType::Int32;
  std::vector<int32_t> lengths_;
  std::vector<int64_t> pointers_;
  std::vector<int64_t> doc_indices_;
  std::vector<int8_t> modes_;
  int64_t num_tokens_ = 0;
  const std::byte* bin_ = nullptr;
  size_t bin_size_ = 0;
};

/// Writes a .bin as items arrive and the .idx at finalize (Megatron's IndexedDatasetBuilder).
/// The files are byte-identical to Megatron's for the same items.
class IndexedDatasetBuilder {
 public:
  IndexedDatasetBuilder(std::string bin_path, IndexDType dtype = IndexDType::Int32, bool multimodal = false);
  ~IndexedDatasetBuilder();
  IndexedDatasetBuilder(const IndexedDatasetBuilder&) = delete;
  IndexedDatasetBuilder& operator=(const IndexedDatasetBuilder&) = delete;

  /// Appends one sequence (converted to the dtype; an id the dtype cannot hold is an error).
  void add_item(std::span<const int64_t> ids, int8_t mode = 0);
  /// Appends a whole document: `ids` split into sequences of `lengths` (may be empty: an empty
  /// document), then ends the document.
  void add_document(std::span<const int64_t> ids, std::span<const int32_t> lengths, std::span<const int8_t> modes = {});
  /// Ends the current document (for use with add_item).
  void end_document();
  /// Appends a whole dataset (<prefix>.idx/.bin) of the same dtype: Megatron's merge.
  void add_index(const std::string& path_prefix);
  /// Closes the .bin and writes the .idx.
  void finalize(const std::string& idx_path);

  IndexDType dtype() const { return dtype_; }
  size_t num_sequences() const { return lengths_.size(); }
  size_t num_documents() const { return doc_indices_.size() - 1; }

 private:
  void write_bytes(const void* data, size_t n);

  std::string bin_path_;
  IndexDType dtype_;
  bool multimodal_;
  std::FILE* file_ = nullptr;
  std::vector<int32_t> lengths_;
  std::vector<int64_t> doc_indices_{0};
  std::vector<int8_t> modes_;
  std::vector<std::byte> scratch_;
};

}  // namespace megatron
