// GPTDataset index building: document, sample and shuffle indices (see gpt_index.h).
#include "megatron/core/datasets/gpt_index.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "megatron/core/datasets/numpy_random.h"
#include "megatron/runtime/check.h"

namespace megatron {

int64_t gpt_tokens_per_epoch(std::span<const int32_t> sequence_lengths, int64_t beg, int64_t end) {
  MG_ASSERT(0 <= beg && beg <= end && end <= int64_t(sequence_lengths.size()), "bad range [{}, {})", beg, end);
  int64_t total = 0;
  for (int64_t i = beg; i < end; ++i) total += sequence_lengths[size_t(i)];
  return total;
}

int64_t gpt_num_epochs(int64_t tokens_per_epoch, const GPTIndexParams& p) {
  if (!p.num_samples) return 1;
  MG_CHECK(tokens_per_epoch > 0, "a dataset split holds no tokens but {} samples were requested from it",
           *p.num_samples);
  int64_t requested = *p.num_samples * p.sequence_length + (p.add_extra_token_to_sequence ? 1 : 0);
  return std::max<int64_t>(1, (requested + tokens_per_epoch - 1) / tokens_per_epoch);
}

namespace {

// The split's sequence ids tiled `epochs` times, shuffled as one array.
void append_shuffled_epochs(std::vector<int32_t>& out, int64_t beg, int64_t end, int64_t epochs,
                            NumpyRandomState& rng) {
  size_t start = out.size();
  for (int64_t e = 0; e < epochs; ++e)
    for (int64_t i = beg; i < end; ++i) out.push_back(int32_t(i));
  rng.shuffle(std::span<int32_t>(out.data() + start, out.size() - start));
}

template <typename T>
void append_shuffled_range(std::vector<int64_t>& out, int64_t beg, int64_t end, NumpyRandomState& rng) {
  // Shuffled in the saved dtype's width, as numpy does (the draws do not depend on it).
  std::vector<T> r(size_t(end - beg));
  std::iota(r.begin(), r.end(), T(beg));
  rng.shuffle(std::span<T>(r));
  out.insert(out.end(), r.begin(), r.end());
}

}  // namespace

std::vector<int64_t> build_sample_index(std::span<const int32_t> sizes, std::span<const int32_t> document_index,
                                        int64_t seq_length, int64_t num_epochs, int64_t tokens_per_epoch,
                                        bool drop_last_partial_sequence, bool add_extra_token_to_sequence) {
  const int64_t add = add_extra_token_to_sequence ? 1 : 0;
  MG_CHECK(seq_length > 1, "--seq-length must be > 1 (got {})", seq_length);
  MG_CHECK(tokens_per_epoch > 1, "a dataset split holds {} tokens; it needs at least 2", tokens_per_epoch);
  MG_ASSERT(num_epochs > 0 && !document_index.empty(), "bad sample-index arguments");
  int64_t num_samples;
  if (drop_last_partial_sequence) {
    num_samples = (num_epochs * tokens_per_epoch - add) / seq_length;
  } else {
    // helpers.cpp computes this in single precision: ceil(float(tokens - add) / seq_length).
    num_samples = int64_t(std::ceil(float(num_epochs * tokens_per_epoch - add) / float(seq_length)));
  }
  std::vector<int64_t> out(size_t(2 * (num_samples + 1)));
  int64_t d = 0, offset = 0;
  out[0] = 0;
  out[1] = 0;
  const int64_t last = int64_t(document_index.size()) - 1;
  for (int64_t s = 1; s <= num_samples; ++s) {
    int64_t remaining = seq_length + add;
    while (remaining != 0) {
      int64_t doc_length = sizes[size_t(document_index[size_t(d)])] - offset;
      remaining -= doc_length;
      if (remaining <= 0) {
        offset += remaining + doc_length - add;
        remaining = 0;
      } else {
        if (d == last) {
          MG_ASSERT(s == num_samples, "sample index ran out of documents at sample {} of {}", s, num_samples);
          offset = sizes[size_t(document_index[size_t(d)])] - add;
          break;
        }
        ++d;
        offset = 0;
      }
    }
    out[size_t(2 * s)] = d;
    out[size_t(2 * s + 1)] = offset;
  }
  return out;
}

GPTIndices build_gpt_indices(std::span<const int32_t> sequence_lengths, int64_t beg, int64_t end,
                             const GPTIndexParams& p) {
  const int64_t add = p.add_extra_token_to_sequence ? 1 : 0;
  const int64_t L = p.sequence_length;
  GPTIndices out;
  const int64_t tokens = gpt_tokens_per_epoch(sequence_lengths, beg, end);
  MG_CHECK(end > beg && tokens > 0, "a dataset split is empty (sequences [{}, {})); adjust --split or the data", beg,
           end);
  const int64_t epochs = gpt_num_epochs(tokens, p);
  out.num_epochs = epochs;

  int64_t samples_sans_final = 0;
  if (epochs > 1) {
    samples_sans_final = ((epochs - 1) * tokens - add) / L;
    int64_t from_final = *p.num_samples - samples_sans_final;
    int64_t per_epoch = (tokens - add) / L;
    MG_ASSERT(from_final >= 0 && from_final <= per_epoch + 1, "bad final-epoch sample count {}", from_final);
    out.separate_final_epoch = from_final < int64_t(0.80 * double(per_epoch));
  }

  NumpyRandomState rng(p.random_seed);
  out.document_index.reserve(size_t(epochs * (end - beg)));
  if (out.separate_final_epoch) {
    append_shuffled_epochs(out.document_index, beg, end, epochs - 1, rng);
    append_shuffled_epochs(out.document_index, beg, end, 1, rng);
  } else {
    append_shuffled_epochs(out.document_index, beg, end, epochs, rng);
  }

  out.sample_index = build_sample_index(sequence_lengths, out.document_index, L, epochs, tokens,
                                        p.drop_last_partial_sequence, p.add_extra_token_to_sequence);
  int64_t max_len = 0;
  for (int32_t v : sequence_lengths) max_len = std::max<int64_t>(max_len, v);
  out.sample_index_int64 =
      std::max<int64_t>(int64_t(out.document_index.size()), max_len) > std::numeric_limits<int32_t>::max();

  const int64_t n = out.num_samples();
  const int64_t first = out.separate_final_epoch ? samples_sans_final : n;
  out.shuffle_index_int64 = n >= int64_t(std::numeric_limits<uint32_t>::max()) - 1;
  out.shuffle_index.reserve(size_t(n));
  if (out.shuffle_index_int64) {
    append_shuffled_range<int64_t>(out.shuffle_index, 0, first, rng);
    if (first != n) append_shuffled_range<int64_t>(out.shuffle_index, first, n, rng);
  } else {
    append_shuffled_range<uint32_t>(out.shuffle_index, 0, first, rng);
    if (first != n) append_shuffled_range<uint32_t>(out.shuffle_index, first, n, rng);
  }
  return out;
}

}  // namespace megatron
