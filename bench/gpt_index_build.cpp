// GPTDataset index building at scale: synthetic sequence lengths (default 10M documents, ~1B
// tokens), the three indices built as Megatron builds them, then written to and read back from
// .npy files. One JSON line per configuration on stdout.
//   gpt_index_build [num_documents] [mean_length] [seq_length]
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "megatron/core/datasets/gpt_index.h"
#include "megatron/core/datasets/npy.h"

using namespace megatron;

namespace {
double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

int main(int argc, char** argv) {
  const int64_t num_docs = argc > 1 ? std::atoll(argv[1]) : 10'000'000;
  const int64_t mean = argc > 2 ? std::atoll(argv[2]) : 100;
  const int64_t seq = argc > 3 ? std::atoll(argv[3]) : 2048;
  std::mt19937_64 gen(0);
  std::uniform_int_distribution<int32_t> dist(1, int32_t(2 * mean - 1));
  std::vector<int32_t> lengths(static_cast<size_t>(num_docs));
  int64_t tokens = 0;
  for (auto& l : lengths) tokens += (l = dist(gen));
  const auto dir = std::filesystem::temp_directory_path() / fmt::format("mg_bench_gpt_index_{}", ::getpid());
  std::filesystem::create_directories(dir);

  for (double epochs : {1.0, 2.5}) {
    GPTIndexParams p;
    p.sequence_length = seq;
    p.num_samples = int64_t(epochs * double(tokens - 1) / double(seq));
    auto t0 = std::chrono::steady_clock::now();
    GPTIndices x = build_gpt_indices(lengths, 0, num_docs, p);
    const double build_s = seconds_since(t0);

    t0 = std::chrono::steady_clock::now();
    const std::string base = (dir / "bench-").string();
    const int64_t dshape[] = {int64_t(x.document_index.size())};
    write_npy(base + "document_index.npy", NpyDType::Int32, dshape, x.document_index.data());
    std::vector<int32_t> s32(x.sample_index.begin(), x.sample_index.end());
    const int64_t sshape[] = {int64_t(x.sample_index.size() / 2), 2};
    write_npy(base + "sample_index.npy", NpyDType::Int32, sshape, s32.data());
    std::vector<uint32_t> u32(x.shuffle_index.begin(), x.shuffle_index.end());
    const int64_t hshape[] = {int64_t(u32.size())};
    write_npy(base + "shuffle_index.npy", NpyDType::UInt32, hshape, u32.data());
    const double write_s = seconds_since(t0);

    t0 = std::chrono::steady_clock::now();
    NpyArray d = read_npy(base + "document_index.npy");
    NpyArray s = read_npy(base + "sample_index.npy");
    NpyArray h = read_npy(base + "shuffle_index.npy");
    const double read_s = seconds_since(t0);

    std::printf(
        "{\"bench\": \"gpt_index_build\", \"documents\": %lld, \"tokens\": %lld, \"seq_length\": %lld, "
        "\"num_samples\": %lld, \"epochs\": %lld, \"separate_final_epoch\": %s, \"built_samples\": %lld, "
        "\"build_s\": %.3f, \"write_npy_s\": %.3f, \"read_npy_s\": %.3f, \"check\": %lld}\n",
        (long long)num_docs, (long long)tokens, (long long)seq, (long long)*p.num_samples, (long long)x.num_epochs,
        x.separate_final_epoch ? "true" : "false", (long long)x.num_samples(), build_s, write_s, read_s,
        (long long)(d.numel() + s.numel() + h.numel()));
    std::fflush(stdout);
  }
  std::filesystem::remove_all(dir);
  return 0;
}
