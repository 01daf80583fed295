// GPTDataset: config, low-level datasets, the index cache and sample assembly (see gpt_dataset.h).
#include "megatron/core/datasets/gpt_dataset.h"

#include <fmt/format.h>

#include <cstdlib>
#include <filesystem>
#include <regex>

#include "megatron/core/datasets/indexed_dataset.h"
#include "megatron/core/datasets/npy.h"
#include "megatron/core/datasets/numpy_random.h"
#include "megatron/runtime/check.h"

namespace megatron {

namespace fs = std::filesystem;

// ---- config -------------------------------------------------------------------------------------------
std::array<double, kNumSplits> parse_and_normalize_split(const std::string& split) {
  static const std::regex number("[.0-9]+");
  std::vector<double> values;
  for (auto it = std::sregex_iterator(split.begin(), split.end(), number); it != std::sregex_iterator(); ++it) {
    std::string s = it->str();
    char* end = nullptr;
    double v = std::strtod(s.c_str(), &end);
    MG_CHECK(end == s.c_str() + s.size() && s != ".", "--split '{}': '{}' is not a number", split, s);
    values.push_back(v);
  }
  MG_CHECK(values.size() <= size_t(kNumSplits), "--split '{}' has {} numbers; give at most 3 (train, valid, test)",
           split, values.size());
  values.resize(kNumSplits, 0.0);
  double sum = values[0] + values[1] + values[2];
  MG_CHECK(sum > 0.0, "--split '{}' has no positive weight; e.g. use --split 969,30,1", split);
  std::vector<double> w = normalize(values);
  return {w[0], w[1], w[2]};
}

SplitMatrix convert_split_vector_to_split_matrix(const std::array<double, kNumSplits>& split) {
  std::array<double, kNumSplits + 1> bookends{0.0, 0.0, 0.0, 0.0};
  for (int i = 0; i < kNumSplits; ++i) bookends[size_t(i + 1)] = bookends[size_t(i)] + split[size_t(i)];
  SplitMatrix m;
  for (size_t i = 0; i < size_t(kNumSplits); ++i) {
    if (bookends[i + 1] <= bookends[i]) continue;
    m[i] = std::make_pair(bookends[i], bookends[i + 1]);
  }
  return m;
}

void GPTDatasetConfig::finalize() {
  MG_CHECK(sequence_length > 1, "--seq-length must be greater than 1 (got {})", sequence_length);
  MG_CHECK(tokenizer != nullptr, "a GPT dataset needs a tokenizer (its eod id and identifiers)");
  MG_CHECK(mid_level_dataset_surplus >= 0.0, "--mid-level-dataset-surplus must be >= 0");
  auto check_blend = [](const Blend& b, const char* what) {
    MG_CHECK(!b.prefixes.empty(), "{} names no dataset", what);
    MG_CHECK(!b.weights || b.weights->size() == b.prefixes.size(),
             "{}: blend prefixes and weights must be equal in number", what);
    if (b.weights)
      for (double w : *b.weights) MG_CHECK(w > 0.0, "{}: blend weights must be positive (got {})", what, w);
  };
  bool per_split = blend_per_split && ((*blend_per_split)[0] || (*blend_per_split)[1] || (*blend_per_split)[2]);
  if (!mock && per_split) {
    MG_CHECK(!blend, "--data-path and --train/valid/test-data-path are incompatible: give one of them");
    MG_CHECK(!split, "--split is incompatible with --train/valid/test-data-path");
    const char* names[] = {"--train-data-path", "--valid-data-path", "--test-data-path"};
    for (int i = 0; i < kNumSplits; ++i)
      if ((*blend_per_split)[size_t(i)]) check_blend(*(*blend_per_split)[size_t(i)], names[i]);
    split_matrix.reset();
    return;
  }
  if (!mock) {
    MG_CHECK(blend.has_value(), "no training data: give --data-path, --train-data-path ... or --mock-data");
    check_blend(*blend, "--data-path");
  }
  MG_CHECK(split.has_value(), "--split is required with --data-path (e.g. --split 969,30,1)");
  split_matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(*split));
}

// ---- low-level datasets ---------------------------------------------------------------------------------
IndexedLowLevelDataset::IndexedLowLevelDataset(const std::string& path_prefix)
    : ds_(std::make_unique<IndexedDataset>(path_prefix)) {}
IndexedLowLevelDataset::~IndexedLowLevelDataset() = default;

std::span<const int32_t> IndexedLowLevelDataset::sequence_lengths() const { return ds_->sequence_lengths(); }

void IndexedLowLevelDataset::read_into(size_t i, int64_t offset, int64_t length, std::vector<int64_t>& out) const {
  ds_->read_into(i, offset, length, out);
}

MockGPTLowLevelDataset::MockGPTLowLevelDataset(int64_t eod, int64_t vocab_size) : eod_(eod), vocab_size_(vocab_size) {
  MG_CHECK(vocab_size > 0, "mock data needs a tokenizer with a positive vocabulary size");
  lengths_ = NumpyGenerator(kSeed).integers_int32(1, kMaxSequenceLength, kSize);
}

void MockGPTLowLevelDataset::read_into(size_t i, int64_t offset, int64_t length, std::vector<int64_t>& out) const {
  MG_ASSERT(i < lengths_.size() && offset >= 0 && offset + length <= lengths_[i], "mock read out of range");
  const int64_t last = lengths_[i] - 1;
  for (int64_t p = offset; p < offset + length; ++p) out.push_back(p < last ? (p + 1) % vocab_size_ : eod_);
}

// ---- GPTDataset ------------------------------------------------------------------------------------------
GPTDataset::GPTDataset(std::shared_ptr<const LowLevelDataset> dataset, std::optional<std::string> dataset_path,
                       int64_t beg, int64_t end, std::optional<int64_t> num_samples, Split split,
                       GPTDatasetConfig config)
    : dataset_(std::move(dataset)),
      dataset_path_(std::move(dataset_path)),
      num_samples_(num_samples),
      split_(split),
      config_(std::move(config)) {
  MG_ASSERT(dataset_ && config_.tokenizer, "GPTDataset needs a dataset and a tokenizer");
  pad_id_ = config_.tokenizer->pad().value_or(-1);
  if (!config_.mock) {
    nlohmann::ordered_json& u = unique_identifiers_;
    u["class"] = "GPTDataset";
    u["dataset_path"] = dataset_path_ ? nlohmann::ordered_json(*dataset_path_) : nlohmann::ordered_json(nullptr);
    u["num_samples"] = num_samples_ ? nlohmann::ordered_json(*num_samples_) : nlohmann::ordered_json(nullptr);
    u["index_split"] = split_name(split_);
    u["random_seed"] = config_.random_seed;
    u["sequence_length"] = config_.sequence_length;
    u["split"] = config_.split ? nlohmann::ordered_json(*config_.split) : nlohmann::ordered_json(nullptr);
    if (config_.split_matrix) {
      nlohmann::ordered_json m = nlohmann::ordered_json::array();
      for (size_t i = 0; i < size_t(kNumSplits); ++i) {
        const SplitBookends& b = (*config_.split_matrix)[i];
        if (!b) {
          m.push_back(nullptr);
        } else if (i == 0) {
          // Python's bookends start from the integer 0: json writes "0", not "0.0".
          m.push_back({int64_t(0), b->second});
        } else {
          m.push_back({b->first, b->second});
        }
      }
      u["split_matrix"] = m;
    } else {
      u["split_matrix"] = nullptr;
    }
    u["tokenizer"] = config_.tokenizer->unique_identifiers();
    unique_description_ = python_json_dumps(u, 4);
    unique_description_hash_ = md5_hex(unique_description_);
  }
  build_or_load_indices(beg, end);
}

void GPTDataset::build_or_load_indices(int64_t beg, int64_t end) {
  if (!config_.mock) {
    if (config_.path_to_cache)
      cache_dir_ = *config_.path_to_cache;
    else if (dataset_path_)
      cache_dir_ = (fs::path(*dataset_path_) / "cache" / "GPTDataset_indices").string();
  }
  std::string base;
  if (cache_dir_) {
    base = (fs::path(*cache_dir_) / fmt::format("{}-GPTDataset-{}-", unique_description_hash_, split_name(split_)))
               .string();
    if (load_cache(base)) return;
  }
  GPTIndexParams p;
  p.sequence_length = config_.sequence_length;
  p.num_samples = num_samples_;
  p.add_extra_token_to_sequence = config_.add_extra_token_to_sequence;
  p.drop_last_partial_sequence = split_ == Split::valid ? config_.drop_last_partial_validation_sequence : true;
  MG_CHECK(config_.random_seed >= 0 && config_.random_seed <= 0xFFFFFFFFll,
           "--seed must be in [0, 2^32) for numpy's RandomState (got {})", config_.random_seed);
  p.random_seed = uint32_t(config_.random_seed);
  indices_ = build_gpt_indices(dataset_->sequence_lengths(), beg, end, p);
  built_anew_ = true;
  if (cache_dir_) write_cache(base);
}

bool GPTDataset::load_cache(const std::string& base) {
  const char* parts[] = {"description.txt", "document_index.npy", "sample_index.npy", "shuffle_index.npy"};
  for (const char* part : parts)
    if (!fs::is_regular_file(base + part)) return false;
  NpyArray doc = read_npy(base + "document_index.npy");
  NpyArray sample = read_npy(base + "sample_index.npy");
  NpyArray shuffle = read_npy(base + "shuffle_index.npy");
  auto bad = [&](const std::string& file, const std::string& why) {
    throw Error(fmt::format("index cache file {}{} does not fit its dataset ({}); delete the cache files to rebuild",
                            base, file, why));
  };
  if (doc.shape.size() != 1) bad("document_index.npy", "not 1-D");
  if (sample.shape.size() != 2 || sample.shape[1] != 2 || sample.shape[0] < 1) bad("sample_index.npy", "not (n+1) x 2");
  if (shuffle.shape.size() != 1) bad("shuffle_index.npy", "not 1-D");
  const int64_t num_sequences = int64_t(dataset_->sequence_lengths().size());
  GPTIndices idx;
  idx.document_index.resize(size_t(doc.numel()));
  for (int64_t i = 0; i < doc.numel(); ++i) {
    int64_t v = doc.at(i);
    if (v < 0 || v >= num_sequences) bad("document_index.npy", fmt::format("sequence id {} out of range", v));
    idx.document_index[size_t(i)] = int32_t(v);
  }
  idx.sample_index = sample.to_int64();
  for (size_t r = 0; r < idx.sample_index.size(); r += 2) {
    int64_t d = idx.sample_index[r];
    if (d < 0 || d >= doc.numel()) bad("sample_index.npy", fmt::format("document position {} out of range", d));
    if (idx.sample_index[r + 1] < 0) bad("sample_index.npy", "negative offset");
  }
  idx.sample_index_int64 = sample.dtype == NpyDType::Int64;
  idx.shuffle_index = shuffle.to_int64();
  const int64_t n = sample.shape[0] - 1;
  for (int64_t v : idx.shuffle_index)
    if (v < 0 || v >= n) bad("shuffle_index.npy", fmt::format("sample {} out of range [0, {})", v, n));
  idx.shuffle_index_int64 = shuffle.dtype == NpyDType::Int64;
  indices_ = std::move(idx);
  built_anew_ = false;
  return true;
}

void GPTDataset::write_cache(const std::string& base) const {
  std::error_code ec;
  fs::create_directories(*cache_dir_, ec);
  MG_CHECK(!ec, "cannot create the index cache directory {}: {} (set --data-cache-path to a writable directory)",
           *cache_dir_, ec.message());
  const GPTIndices& x = indices_;
  const int64_t doc_shape[] = {int64_t(x.document_index.size())};
  write_npy(base + "document_index.npy", NpyDType::Int32, doc_shape, x.document_index.data());
  const int64_t sample_shape[] = {int64_t(x.sample_index.size() / 2), 2};
  if (x.sample_index_int64) {
    write_npy(base + "sample_index.npy", NpyDType::Int64, sample_shape, x.sample_index.data());
  } else {
    std::vector<int32_t> narrow(x.sample_index.begin(), x.sample_index.end());
    write_npy(base + "sample_index.npy", NpyDType::Int32, sample_shape, narrow.data());
  }
  const int64_t shuffle_shape[] = {int64_t(x.shuffle_index.size())};
  if (x.shuffle_index_int64) {
    write_npy(base + "shuffle_index.npy", NpyDType::Int64, shuffle_shape, x.shuffle_index.data());
  } else {
    std::vector<uint32_t> narrow(x.shuffle_index.begin(), x.shuffle_index.end());
    write_npy(base + "shuffle_index.npy", NpyDType::UInt32, shuffle_shape, narrow.data());
  }
  // The description last: a reader that sees all four files sees complete arrays.
  write_file_atomic(base + "description.txt", unique_description_);
}

void GPTDataset::text(int64_t idx, std::vector<int64_t>& out) const {
  MG_CHECK(idx >= 0 && idx < size(), "sample {} is out of range for the {} dataset of {} samples", idx,
           split_name(split_), size());
  const int64_t add = config_.add_extra_token_to_sequence ? 1 : 0;
  const int64_t want = config_.sequence_length + add;
  const auto& s = indices_.sample_index;
  const auto& doc = indices_.document_index;
  const int64_t j = indices_.shuffle_index[size_t(idx)];
  const int64_t d0 = s[size_t(2 * j)], o0 = s[size_t(2 * j + 1)];
  const int64_t d1 = s[size_t(2 * j + 2)], o1 = s[size_t(2 * j + 3)];
  out.clear();
  out.reserve(size_t(want));
  if (d0 == d1) {
    dataset_->read_into(size_t(doc[size_t(d0)]), o0, o1 - o0 + add, out);
  } else {
    auto lengths = dataset_->sequence_lengths();
    for (int64_t i = d0; i <= d1; ++i) {
      const size_t seq = size_t(doc[size_t(i)]);
      const int64_t offset = i > d0 ? 0 : o0;
      const int64_t length = i < d1 ? lengths[seq] - offset : o1 + add;
      dataset_->read_into(seq, offset, length, out);
    }
  }
  if (int64_t(out.size()) < want) out.resize(size_t(want), pad_id_);
}

void GPTDataset::get(int64_t idx, GPTSample& out) const {
  thread_local std::vector<int64_t> buf;
  text(idx, buf);
  const size_t L = size_t(config_.sequence_length);
  if (config_.add_extra_token_to_sequence) {
    out.tokens.assign(buf.begin(), buf.begin() + L);
    out.labels.assign(buf.begin() + 1, buf.begin() + L + 1);
  } else {
    out.tokens.assign(buf.begin(), buf.begin() + L);
    out.labels.assign(buf.begin() + 1, buf.begin() + L);
    out.labels.push_back(pad_id_);
  }
  // Megatron's _get_ltor_masks_and_position_ids, on the tokens before pad replacement.
  const int64_t eod = config_.tokenizer->eod();
  out.loss_mask.assign(L, 1.0f);
  out.position_ids.resize(L);
  const bool segments = config_.reset_attention_mask && config_.create_attention_mask;
  out.attention_segments.assign(segments ? L : 0, 0);
  int64_t start = 0;  // position after the last EOD
  int32_t segment = 0;
  for (size_t q = 0; q < L; ++q) {
    out.position_ids[q] = config_.reset_position_ids ? int64_t(q) - start : int64_t(q);
    if (segments) out.attention_segments[q] = segment;
    if (out.tokens[q] == eod) {
      if (config_.eod_mask_loss) out.loss_mask[q] = 0.0f;
      start = int64_t(q) + 1;
      ++segment;
    }
  }
  for (size_t q = 0; q < L; ++q) {
    if (out.labels[q] == pad_id_) {
      out.loss_mask[q] = 0.0f;
      out.labels[q] = 0;
    }
    if (out.tokens[q] == pad_id_) out.tokens[q] = 0;
  }
}

std::vector<uint8_t> expand_attention_mask(const GPTSample& sample) {
  const size_t L = sample.tokens.size();
  const auto& seg = sample.attention_segments;
  MG_ASSERT(seg.empty() || seg.size() == L, "attention segments do not match the sample length");
  std::vector<uint8_t> mask(L * L, 1);
  for (size_t q = 0; q < L; ++q)
    for (size_t k = 0; k <= q; ++k) mask[q * L + k] = (seg.empty() || seg[k] == seg[q]) ? 0 : 1;
  return mask;
}

}  // namespace megatron
