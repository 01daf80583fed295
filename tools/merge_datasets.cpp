// merge_datasets: concatenates every indexed dataset (<prefix>.bin/.idx pair) of a directory, in
// sorted prefix order, into one (Megatron-LM's tools/merge_datasets.py; byte-identical output).
// Every file of the directory must belong to a pair. The output is written under temporary names
// and renamed once complete.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "megatron/core/datasets/indexed_dataset.h"
#include "megatron/runtime/check.h"

namespace fs = std::filesystem;
using namespace megatron;

namespace {

const char* kUsage =
    "usage: merge_datasets --input DIR --output-prefix PREFIX [--multimodal]\n"
    "Merges every <prefix>.bin/.idx pair in DIR (sorted by prefix) into PREFIX.bin/.idx.\n";

struct Args {
  std::string input;
  std::string output_prefix;
  bool multimodal = false;
};

Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string f = argv[i], v;
    if (size_t eq = f.find('='); f.rfind("--", 0) == 0 && eq != std::string::npos) {
      v = f.substr(eq + 1);
      f = f.substr(0, eq);
    } else if ((f == "--input" || f == "--output-prefix") && i + 1 < argc) {
      v = argv[++i];
    }
    if (f == "-h" || f == "--help") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else if (f == "--input") {
      a.input = v;
    } else if (f == "--output-prefix") {
      a.output_prefix = v;
    } else if (f == "--multimodal") {
      a.multimodal = true;
    } else {
      MG_CHECK(false, "unknown argument '{}' (see --help)", f);
    }
  }
  MG_CHECK(!a.input.empty(), "--input is required (a directory of .bin/.idx pairs)");
  MG_CHECK(!a.output_prefix.empty(), "--output-prefix is required");
  MG_CHECK(fs::is_directory(a.input), "--input {} is not a directory or does not exist", a.input);
  fs::path dir = fs::path(a.output_prefix).parent_path();
  MG_CHECK(dir.empty() || fs::is_directory(dir), "the directory of --output-prefix, {}, does not exist", dir.string());
  return a;
}

/// The dataset prefixes of a directory, sorted; a file without its .bin/.idx partner is an error.
std::vector<std::string> dataset_prefixes(const std::string& dir) {
  std::set<std::string> prefixes;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (!entry.is_regular_file()) continue;
    const fs::path& p = entry.path();
    const std::string prefix = (p.parent_path() / p.stem()).string();
    if (prefixes.count(prefix) > 0) continue;
    const std::string pair = prefix + (p.extension() == ".idx" ? ".bin" : ".idx");
    MG_CHECK(fs::is_regular_file(pair), "{}: {} has no partner {} (every file must belong to a .bin/.idx pair)", dir,
             p.string(), pair);
    prefixes.insert(prefix);
  }
  return {prefixes.begin(), prefixes.end()};
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Args args = parse_args(argc, argv);
    const std::vector<std::string> prefixes = dataset_prefixes(args.input);
    MG_CHECK(!prefixes.empty(), "--input {} contains no datasets (.bin/.idx pairs) to merge", args.input);
    const IndexDType dtype = IndexedDataset(prefixes.front(), args.multimodal).dtype();
    const std::string bin = get_bin_path(args.output_prefix), idx = get_idx_path(args.output_prefix);
    const std::string tmp_bin = fmt::format("{}.tmp{}", bin, ::getpid());
    const std::string tmp_idx = fmt::format("{}.tmp{}", idx, ::getpid());
    try {
      IndexedDatasetBuilder builder(tmp_bin, dtype, args.multimodal);
      for (const auto& prefix : prefixes) {
        builder.add_index(prefix);
        std::fprintf(stderr, "Added %s (%zu sequences so far)\n", prefix.c_str(), builder.num_sequences());
      }
      builder.finalize(tmp_idx);
      fs::rename(tmp_bin, bin);
      fs::rename(tmp_idx, idx);
    } catch (...) {
      std::error_code ec;
      fs::remove(tmp_bin, ec);
      fs::remove(tmp_idx, ec);
      throw;
    }
    std::fprintf(stderr, "Merged %zu datasets into %s.{bin,idx}\n", prefixes.size(), args.output_prefix.c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "merge_datasets: error: %s\n", e.what());
    return 1;
  }
}
