// Indexed dataset at scale: 10M documents / ~1B tokens of synthetic lengths (1..199, mean ~100).
// Measures, in seconds (one JSON line each):
//   write_idx      the .idx alone through write_index_file (what a builder's finalize costs)
//   sparse_bin     a matching sparse uint16 .bin (ftruncate, no data written)
//   open_validate  IndexedDataset open: load the index and validate every pointer/length
//   random_get     1M get() calls of random sequences from the mmapped .bin
//   builder_full   IndexedDatasetBuilder add_item/end_document for every document, real .bin
//                  writes and finalize (skipped with --no-full)
//
// usage: index_build [--dir DIR] [--documents N] [--no-full]
#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "megatron/core/datasets/indexed_dataset.h"

using namespace megatron;

namespace {

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

void report(const char* what, double secs, size_t docs, int64_t tokens, const std::string& extra = "") {
  std::printf(
      "{\"bench\": \"index_build\", \"step\": \"%s\", \"documents\": %zu, \"tokens\": %lld, \"seconds\": %.3f%s}\n",
      what, docs, static_cast<long long>(tokens), secs, extra.c_str());
  std::fflush(stdout);
}

int32_t length_of(size_t doc) {
  uint64_t x = doc * 0x9E3779B97F4A7C15ull;
  x ^= x >> 29;
  return int32_t(1 + x % 199);
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir = "/tmp";
  size_t docs = 10'000'000;
  bool full = true;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--dir" && i + 1 < argc) {
      dir = argv[++i];
    } else if (a == "--documents" && i + 1 < argc) {
      docs = std::stoull(argv[++i]);
    } else if (a == "--no-full") {
      full = false;
    } else {
      std::fprintf(stderr, "usage: index_build [--dir DIR] [--documents N] [--no-full]\n");
      return 2;
    }
  }
  const std::string prefix = fmt::format("{}/index_build_bench_{}", dir, ::getpid());
  try {
    auto t = std::chrono::steady_clock::now();
    std::vector<int32_t> lengths(docs);
    std::vector<int64_t> doc_indices(docs + 1);
    int64_t tokens = 0;
    for (size_t d = 0; d < docs; ++d) {
      lengths[d] = length_of(d);
      tokens += lengths[d];
      doc_indices[d + 1] = int64_t(d + 1);
    }
    const double gen = seconds_since(t);
    t = std::chrono::steady_clock::now();
    write_index_file(get_idx_path(prefix), IndexDType::UInt16, lengths, doc_indices);
    report("write_idx", seconds_since(t), docs, tokens,
           fmt::format(", \"idx_bytes\": {}, \"generate_lengths_s\": {:.3f}",
                       std::filesystem::file_size(get_idx_path(prefix)), gen));

    t = std::chrono::steady_clock::now();
    int fd = ::open(get_bin_path(prefix).c_str(), O_CREAT | O_TRUNC | O_WRONLY, 0644);
    if (fd < 0 || ::ftruncate(fd, off_t(tokens) * 2) != 0) throw std::runtime_error("cannot create sparse .bin");
    ::close(fd);
    report("sparse_bin", seconds_since(t), docs, tokens);

    t = std::chrono::steady_clock::now();
    {
      IndexedDataset ds(prefix);
      report("open_validate", seconds_since(t), ds.num_documents(), ds.num_tokens());
      std::mt19937_64 rng(1234);
      std::vector<int64_t> out;
      int64_t sum = 0;
      t = std::chrono::steady_clock::now();
      constexpr int kGets = 1'000'000;
      for (int k = 0; k < kGets; ++k) {
        out.clear();
        size_t i = rng() % ds.size();
        ds.read_into(i, 0, ds.sequence_lengths()[i], out);
        sum += int64_t(out.size());
      }
      report("random_get", seconds_since(t), size_t(kGets), sum);
    }
    std::filesystem::remove(get_bin_path(prefix));
    std::filesystem::remove(get_idx_path(prefix));

    if (full) {
      std::vector<int64_t> ids(200);
      for (size_t k = 0; k < ids.size(); ++k) ids[k] = int64_t(k * 251 % 50257);
      t = std::chrono::steady_clock::now();
      {
        IndexedDatasetBuilder b(get_bin_path(prefix), IndexDType::UInt16);
        for (size_t d = 0; d < docs; ++d) {
          b.add_item(std::span<const int64_t>(ids).first(size_t(lengths[d])));
          b.end_document();
        }
        b.finalize(get_idx_path(prefix));
      }
      report("builder_full", seconds_since(t), docs, tokens,
             fmt::format(", \"bin_bytes\": {}", std::filesystem::file_size(get_bin_path(prefix))));
      std::filesystem::remove(get_bin_path(prefix));
      std::filesystem::remove(get_idx_path(prefix));
    }
  } catch (const std::exception& e) {
    std::error_code ec;
    std::filesystem::remove(get_bin_path(prefix), ec);
    std::filesystem::remove(get_idx_path(prefix), ec);
    std::fprintf(stderr, "index_build: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
