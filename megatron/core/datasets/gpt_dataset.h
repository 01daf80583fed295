// GPTDataset (Megatron-LM megatron/core/datasets/gpt_dataset.py): fixed-length samples drawn from
// the concatenated, shuffled sequences of one split of a low-level dataset, with the index arrays
// cached on disk exactly as Megatron caches them.
//
// Cache: <path_to_cache>/<md5>-GPTDataset-<split>-{description.txt, document_index.npy,
// sample_index.npy, shuffle_index.npy}, where description.txt is Python's json.dumps(indent=4) of
// the dataset's unique identifiers and md5 is its hash. When all four files exist they are read
// (whoever wrote them: Megatron or us); otherwise the indices are built and written atomically.
// MockGPTDataset (config.mock) draws from synthetic sequences and is never cached.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "megatron/core/datasets/gpt_index.h"
#include "megatron/core/datasets/utils.h"
#include "megatron/core/tokenizers/tokenizer.h"

namespace megatron {

class IndexedDataset;

/// Dataset prefixes and optional weights (Megatron's Tuple[List[str], Optional[List[float]]]).
struct Blend {
  std::vector<std::string> prefixes;
  std::optional<std::vector<double>> weights;
};

/// One split's [lo, hi) fractions of the low-level dataset, or none.
using SplitBookends = std::optional<std::pair<double, double>>;
using SplitMatrix = std::array<SplitBookends, kNumSplits>;

/// Megatron's GPTDatasetConfig (with the BlendedMegatronDatasetConfig fields).
struct GPTDatasetConfig {
  int64_t random_seed = 1234;
  int64_t sequence_length = 0;
  std::optional<Blend> blend;
  std::optional<std::array<std::optional<Blend>, kNumSplits>> blend_per_split;
  /// The raw --split string, e.g. "969, 30, 1" (it goes verbatim into the description).
  std::optional<std::string> split;
  /// Derived from `split` by finalize().
  std::optional<SplitMatrix> split_matrix;
  std::optional<std::string> path_to_cache;
  bool mmap_bin_files = true;
  bool mock = false;
  std::shared_ptr<const Tokenizer> tokenizer;
  bool reset_position_ids = false;
  bool reset_attention_mask = false;
  bool eod_mask_loss = false;
  bool create_attention_mask = true;
  bool drop_last_partial_validation_sequence = true;
  bool add_extra_token_to_sequence = true;
  double mid_level_dataset_surplus = 0.005;

  /// Checks the fields and derives split_matrix (Megatron's __post_init__); call once.
  void finalize();
};

/// Megatron's parse_and_normalize_split: numbers of "969, 30, 1" padded to 3, normalised.
std::array<double, kNumSplits> parse_and_normalize_split(const std::string& split);
/// Megatron's convert_split_vector_to_split_matrix: cumulative bookends, empty ranges -> none.
SplitMatrix convert_split_vector_to_split_matrix(const std::array<double, kNumSplits>& split);

/// The sequences a GPTDataset reads: lengths and token slices.
class LowLevelDataset {
 public:
  virtual ~LowLevelDataset() = default;
  virtual std::span<const int32_t> sequence_lengths() const = 0;
  /// Appends `length` tokens of sequence i starting at token `offset` to `out`.
  virtual void read_into(size_t i, int64_t offset, int64_t length, std::vector<int64_t>& out) const = 0;
};

/// An IndexedDataset (<prefix>.bin/.idx) as a LowLevelDataset.
class IndexedLowLevelDataset : public LowLevelDataset {
 public:
  explicit IndexedLowLevelDataset(const std::string& path_prefix);
  ~IndexedLowLevelDataset() override;
  std::span<const int32_t> sequence_lengths() const override;
  void read_into(size_t i, int64_t offset, int64_t length, std::vector<int64_t>& out) const override;
  const IndexedDataset& indexed() const { return *ds_; }

 private:
  std::unique_ptr<IndexedDataset> ds_;
};

/// Megatron's MockGPTLowLevelDataset: 100000 sequences with lengths
/// default_rng(0).integers(1, 4096, int32); sequence i is [1, 2, ..., len - 1] modulo the
/// tokenizer's vocabulary size, then eod (so every id is inside the vocabulary).
class MockGPTLowLevelDataset : public LowLevelDataset {
 public:
  static constexpr size_t kSize = 100000;
  static constexpr int32_t kMaxSequenceLength = 4096;
  static constexpr uint64_t kSeed = 0;

  MockGPTLowLevelDataset(int64_t eod, int64_t vocab_size);
  std::span<const int32_t> sequence_lengths() const override { return lengths_; }
  void read_into(size_t i, int64_t offset, int64_t length, std::vector<int64_t>& out) const override;

 private:
  std::vector<int32_t> lengths_;
  int64_t eod_;
  int64_t vocab_size_;
};

/// One training sample, each of length sequence_length.
struct GPTSample {
  std::vector<int64_t> tokens;
  std::vector<int64_t> labels;
  std::vector<float> loss_mask;
  std::vector<int64_t> position_ids;
  /// With reset_attention_mask (and create_attention_mask): the number of EOD tokens before each
  /// position. Query q may attend key k iff k <= q and segments equal; else empty (plain causal).
  std::vector<int32_t> attention_segments;
};

/// Megatron's boolean attention mask [L, L] (true = masked out) from a sample, row-major.
std::vector<uint8_t> expand_attention_mask(const GPTSample& sample);

/// Anything the data loader can draw samples from: a GPTDataset or a BlendedDataset.
class MegatronDataset {
 public:
  virtual ~MegatronDataset() = default;
  virtual int64_t size() const = 0;
  /// Sample idx into `out` (reusing its storage).
  virtual void get(int64_t idx, GPTSample& out) const = 0;
  virtual Split index_split() const = 0;
  GPTSample get(int64_t idx) const {
    GPTSample s;
    get(idx, s);
    return s;
  }
};

class GPTDataset : public MegatronDataset {
 public:
  /// Sequences [beg, end) of `dataset`; `dataset_path` is the prefix (none for mock data).
  GPTDataset(std::shared_ptr<const LowLevelDataset> dataset, std::optional<std::string> dataset_path, int64_t beg,
             int64_t end, std::optional<int64_t> num_samples, Split split, GPTDatasetConfig config);

  int64_t size() const override { return int64_t(indices_.sample_index.size() / 2) - 1; }
  void get(int64_t idx, GPTSample& out) const override;
  using MegatronDataset::get;
  Split index_split() const override { return split_; }

  /// The L + add token ids of sample idx (pad id where the data ran out).
  void text(int64_t idx, std::vector<int64_t>& out) const;

  std::optional<int64_t> num_samples() const { return num_samples_; }
  const GPTIndices& indices() const { return indices_; }
  /// Megatron's unique_identifiers / unique_description / unique_description_hash (not for mock).
  const nlohmann::ordered_json& unique_identifiers() const { return unique_identifiers_; }
  const std::string& unique_description() const { return unique_description_; }
  const std::string& unique_description_hash() const { return unique_description_hash_; }
  /// True when the indices were built here (cache miss or no cache), false when loaded.
  bool built_anew_on_cache_miss() const { return built_anew_; }
  /// The cache directory used, if any.
  const std::optional<std::string>& cache_dir() const { return cache_dir_; }
  const GPTDatasetConfig& config() const { return config_; }

 private:
  void build_or_load_indices(int64_t beg, int64_t end);
  bool load_cache(const std::string& base);
  void write_cache(const std::string& base) const;

  std::shared_ptr<const LowLevelDataset> dataset_;
  std::optional<std::string> dataset_path_;
  std::optional<int64_t> num_samples_;
  Split split_;
  GPTDatasetConfig config_;
  int64_t pad_id_ = -1;
  nlohmann::ordered_json unique_identifiers_;
  std::string unique_description_;
  std::string unique_description_hash_;
  std::optional<std::string> cache_dir_;
  bool built_anew_ = false;
  GPTIndices indices_;
};

}  // namespace megatron
