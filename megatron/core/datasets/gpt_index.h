// The three index arrays of a GPTDataset (Megatron-LM gpt_dataset.py and helpers.cpp), as pure
// functions of the sequence lengths, so they can be tested and benchmarked without any files.
//
//   document_index  int32: the split's sequence ids tiled once per epoch, shuffled (the last epoch
//                   shuffled on its own when it is used for less than 80% of its samples).
//   sample_index    (n + 1) x 2: (position in document_index, token offset) where sample k starts;
//                   with the sequences concatenated in document_index order as one stream, sample
//                   k is stream[k*L : k*L + L + add].
//   shuffle_index   a permutation of [0, n) (two shuffled ranges when the last epoch is separate).
// One numpy RandomState(seed) draws the document shuffles, then the sample shuffles, in that order.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

namespace megatron {

/// The index arrays with the dtypes Megatron saves them in.
struct GPTIndices {
  std::vector<int32_t> document_index;
  /// Row-major (n + 1) x 2.
  std::vector<int64_t> sample_index;
  /// Saved as int64 (else int32) when max(len(document_index), max sequence length) > INT32_MAX.
  bool sample_index_int64 = false;
  std::vector<int64_t> shuffle_index;
  /// Saved as int64 (else uint32) when the sample count is >= 2^32 - 2.
  bool shuffle_index_int64 = false;
  int64_t num_epochs = 1;
  bool separate_final_epoch = false;

  int64_t num_samples() const { return int64_t(sample_index.size() / 2) - 1; }
};

/// What the indices are built from.
struct GPTIndexParams {
  int64_t sequence_length = 0;
  /// None: exactly one epoch.
  std::optional<int64_t> num_samples;
  bool add_extra_token_to_sequence = true;
  /// False keeps a last partial sample (Megatron: validation with drop_last_partial_validation_sequence off).
  bool drop_last_partial_sequence = true;
  uint32_t random_seed = 1234;
};

/// Tokens in sequences [beg, end).
int64_t gpt_tokens_per_epoch(std::span<const int32_t> sequence_lengths, int64_t beg, int64_t end);

/// The smallest E >= 1 with E * tokens_per_epoch >= num_samples * L + add (1 when num_samples is None).
int64_t gpt_num_epochs(int64_t tokens_per_epoch, const GPTIndexParams& p);

/// helpers.cpp build_sample_idx: (num_samples + 1) x 2, row-major.
std::vector<int64_t> build_sample_index(std::span<const int32_t> sequence_lengths,
                                        std::span<const int32_t> document_index, int64_t sequence_length,
                                        int64_t num_epochs, int64_t tokens_per_epoch, bool drop_last_partial_sequence,
                                        bool add_extra_token_to_sequence);

/// All three arrays for the sequences [beg, end) of a dataset with these sequence lengths.
GPTIndices build_gpt_indices(std::span<const int32_t> sequence_lengths, int64_t beg, int64_t end,
                             const GPTIndexParams& params);

}  // namespace megatron
