// The cost of checkpoint checksums (Note [Checkpoint checksums] in training/checkpointing.h):
// writes one safetensors file of --gb GB of fp32 (the checksum is computed while writing), then
// measures, in seconds and seconds per GB (one JSON line each):
//   write            safetensors::write of the file, checksum included (page cache, fsynced)
//   read_pass        one plain pass over the mapped file (summing 64-bit words): the floor of any
//                    verification that has to touch every byte
//   verify           File::checksum() over the mapped file, as load() does per file
// The file is in the page cache for read_pass and verify (just written): on a cold cache both add
// the disk's read time, which load() pays anyway when it copies the tensors out.
//
// usage: checkpoint_verify [--dir DIR] [--gb G]
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "megatron/core/dist_checkpointing/safetensors.h"

using namespace megatron;

namespace {

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

void report(const char* step, double secs, double gb, const std::string& extra = "") {
  std::printf(
      "{\"bench\": \"checkpoint_verify\", \"step\": \"%s\", \"gb\": %.3f, \"seconds\": %.3f, "
      "\"seconds_per_gb\": %.3f%s}\n",
      step, gb, secs, secs / gb, extra.c_str());
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir = std::filesystem::temp_directory_path().string();
  double gb = 1.0;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--dir") == 0) dir = argv[i + 1];
    if (std::strcmp(argv[i], "--gb") == 0) gb = std::stod(argv[i + 1]);
  }
  const std::string path = dir + "/checkpoint_verify_bench.safetensors";
  // 64 MB tensors, filled with a pattern (the hash does not care about the values).
  const int64_t per_tensor = int64_t(16) << 20;  // floats
  const int tensors = std::max(1, int(gb * 1e9 / double(per_tensor * 4) + 0.5));
  std::vector<std::pair<std::string, Tensor>> items;
  for (int t = 0; t < tensors; ++t) {
    Tensor x = Tensor::empty({per_tensor}, DType::Float32);
    float* p = static_cast<float*>(x.raw_data());
    for (int64_t i = 0; i < per_tensor; ++i) p[i] = float((i * 2654435761u + uint64_t(t)) & 0xffff);
    items.emplace_back(fmt::format("layers.{}.weight", t), std::move(x));
  }
  const double actual_gb = double(tensors) * double(per_tensor) * 4 / 1e9;

  auto start = std::chrono::steady_clock::now();
  const uint64_t written = safetensors::write(path, items);
  report("write", seconds_since(start), actual_gb);
  items.clear();

  safetensors::File f(path);
  {
    // The whole mapping through one tensor view per tensor, summed.
    start = std::chrono::steady_clock::now();
    uint64_t sum = 0;
    for (const std::string& name : f.names()) {
      const safetensors::MappedTensor m = f.view(name);
      const auto* w = static_cast<const uint64_t*>(m.data());
      for (size_t i = 0; i < m.nbytes() / 8; ++i) sum += w[i];
    }
    report("read_pass", seconds_since(start), actual_gb, fmt::format(", \"sum\": {}", sum % 1000));
  }
  start = std::chrono::steady_clock::now();
  const uint64_t verified = f.checksum();
  report("verify", seconds_since(start), actual_gb,
         fmt::format(", \"matches_write\": {}", verified == written ? "true" : "false"));
  std::filesystem::remove(path);
  return verified == written ? 0 : 1;
}
