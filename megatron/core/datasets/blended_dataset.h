// BlendedDataset (Megatron-LM megatron/core/datasets/blended_dataset.py): a mixture of datasets of
// one split, sample s taken from dataset dataset_index[s] at dataset_sample_index[s].
//
// The indices come from helpers.cpp: build_blending_indices picks, for each sample, the dataset
// furthest behind its weight (ties to the lowest index); build_exhaustive_blending_indices draws
// exactly sizes[d] samples from each dataset. With a cache path they are cached as
// <md5>-BlendedDataset-<split>-{description.txt, dataset_index.npy (int16),
// dataset_sample_index.npy (int64)}, md5 of the description as for GPTDataset.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "megatron/core/datasets/gpt_dataset.h"

namespace megatron {

/// helpers.cpp build_blending_indices: `size` picks following the (normalised) weights.
void build_blending_indices(std::span<const double> weights, int64_t size, std::vector<int16_t>& dataset_index,
                            std::vector<int64_t>& dataset_sample_index);

/// helpers.cpp build_exhaustive_blending_indices: exactly sizes[d] samples from each dataset d.
void build_exhaustive_blending_indices(std::span<const int64_t> sizes, std::vector<int16_t>& dataset_index,
                                       std::vector<int64_t>& dataset_sample_index);

class BlendedDataset : public MegatronDataset {
 public:
  /// `weights` are normalised when `size` is given; with no size they are the exact per-dataset
  /// sample counts (integers) and the blend is exhaustive.
  BlendedDataset(std::vector<std::shared_ptr<const GPTDataset>> datasets, std::vector<double> weights,
                 std::optional<int64_t> size, const GPTDatasetConfig& config);

  int64_t size() const override { return int64_t(dataset_index_.size()); }
  void get(int64_t idx, GPTSample& out) const override;
  using MegatronDataset::get;
  Split index_split() const override { return split_; }

  const std::vector<std::shared_ptr<const GPTDataset>>& datasets() const { return datasets_; }
  const std::vector<int16_t>& dataset_index() const { return dataset_index_; }
  const std::vector<int64_t>& dataset_sample_index() const { return dataset_sample_index_; }
  const std::string& unique_description() const { return unique_description_; }
  const std::string& unique_description_hash() const { return unique_description_hash_; }
  bool built_anew_on_cache_miss() const { return built_anew_; }

 private:
  bool load_cache(const std::string& base);

  std::vector<std::shared_ptr<const GPTDataset>> datasets_;
  std::vector<double> weights_;
  std::optional<int64_t> size_;
  Split split_;
  std::string unique_description_;
  std::string unique_description_hash_;
  bool built_anew_ = false;
  std::vector<int16_t> dataset_index_;
  std::vector<int64_t> dataset_sample_index_;
};

}  // namespace megatron
