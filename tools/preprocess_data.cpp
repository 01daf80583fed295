// preprocess_data: JSONL -> Megatron indexed datasets (<output-prefix>_<key>_document.{bin,idx}).
//
// Megatron-LM's tools/preprocess_data.py, streaming: a reader thread cuts the input into batches of
// lines and hands them through a bounded queue to --workers threads (each with its own tokenizer);
// the main thread writes the encoded batches strictly in input order. At most kInFlightPerWorker
// batches per worker exist at any time, so memory stays constant whatever the input size.
// Outputs are written under temporary names and renamed once complete. --partitions > 1 follows
// Megatron: the input files (a glob) are dealt into partition files, each partition is encoded
// with workers/partitions threads, and the partition datasets are merged in partition order.
#include <fmt/format.h>
#include <glob.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "megatron/core/datasets/indexed_dataset.h"
#include "megatron/core/tokenizers/tokenizer.h"
#include "megatron/runtime/check.h"

namespace fs = std::filesystem;
using namespace megatron;

namespace {

constexpr size_t kBatchLines = 64;
constexpr size_t kBatchBytes = size_t(1) << 18;
constexpr size_t kInFlightPerWorker = 4;

struct Args {
  std::string input_pattern;  // --input (a glob with --partitions > 1)
  std::string output_prefix;
  std::vector<std::string> json_keys{"text"};
  TokenizerArgs tokenizer;
  bool append_eod = false;
  bool keep_sequential_samples = false;
  bool skip_invalid_lines = false;
  int workers = 0;
  int partitions = 1;
  int64_t log_interval = 1000;
};

const char* kUsage =
    "usage: preprocess_data --input FILE.jsonl --output-prefix PREFIX --tokenizer-type TYPE --workers N\n"
    "  [--json-keys KEY ...] [--vocab-file F] [--merge-file F] [--tokenizer-model F] [--vocab-size N]\n"
    "  [--tiktoken-pattern v1|v2] [--tiktoken-num-special-tokens N] [--append-eod] [--partitions N]\n"
    "  [--keep-sequential-samples] [--log-interval N] [--skip-invalid-lines]\n"
    "Writes PREFIX_<key>_document.bin/.idx for every json key (default: text).\n";

int64_t parse_int(const std::string& flag, const std::string& v) {
  int64_t x = 0;
  auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
  MG_CHECK(ec == std::errc() && end == v.data() + v.size(), "{} expects an integer, got '{}'", flag, v);
  return x;
}

Args parse_args(int argc, char** argv) {
  Args a;
  auto to_int = [](int& dst) {
    return [&dst](const std::string& f, const std::string& v) { dst = int(parse_int(f, v)); };
  };
  auto to_str = [](std::string& dst) { return [&dst](const std::string&, const std::string& v) { dst = v; }; };
  const std::map<std::string, std::function<void(const std::string&, const std::string&)>> valued = {
      {"--input", to_str(a.input_pattern)},
      {"--output-prefix", to_str(a.output_prefix)},
      {"--tokenizer-type", to_str(a.tokenizer.tokenizer_type)},
      {"--vocab-file", to_str(a.tokenizer.vocab_file)},
      {"--merge-file", to_str(a.tokenizer.merge_file)},
      {"--tokenizer-model", to_str(a.tokenizer.tokenizer_model)},
      {"--tiktoken-pattern", to_str(a.tokenizer.tiktoken_pattern)},
      {"--vocab-size", [&](auto& f, auto& v) { a.tokenizer.vocab_size = parse_int(f, v); }},
      {"--tiktoken-num-special-tokens",
       [&](auto& f, auto& v) { a.tokenizer.tiktoken_num_special_tokens = parse_int(f, v); }},
      {"--workers", to_int(a.workers)},
      {"--partitions", to_int(a.partitions)},
      {"--log-interval", [&](auto& f, auto& v) { a.log_interval = parse_int(f, v); }},
  };
  const std::map<std::string, bool*> switches = {{"--append-eod", &a.append_eod},
                                                 {"--keep-sequential-samples", &a.keep_sequential_samples},
                                                 {"--skip-invalid-lines", &a.skip_invalid_lines}};
  std::vector<std::string> toks;
  for (int i = 1; i < argc; ++i) {
    std::string t = argv[i];
    size_t eq = t.find('=');
    if (t.rfind("--", 0) == 0 && eq != std::string::npos) {
      toks.push_back(t.substr(0, eq));
      toks.push_back(t.substr(eq + 1));
    } else {
      toks.push_back(t);
    }
  }
  for (size_t i = 0; i < toks.size(); ++i) {
    const std::string& f = toks[i];
    if (f == "-h" || f == "--help") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else if (auto v = valued.find(f); v != valued.end()) {
      MG_CHECK(i + 1 < toks.size() && toks[i + 1].rfind("--", 0) != 0, "{} needs a value", f);
      v->second(f, toks[++i]);
    } else if (auto sw = switches.find(f); sw != switches.end()) {
      *sw->second = true;
    } else if (f == "--json-keys") {
      a.json_keys.clear();
      while (i + 1 < toks.size() && toks[i + 1].rfind("--", 0) != 0) a.json_keys.push_back(toks[++i]);
      MG_CHECK(!a.json_keys.empty(), "--json-keys needs at least one key");
    } else if (f == "--split-sentences" || f == "--keep-newlines" || f == "--lang") {
      MG_CHECK(false,
               "{} is not supported (sentence splitting needs NLTK's punkt model); split the text beforehand and "
               "store each document as a JSON list of sentences: every sentence then becomes one sequence",
               f);
    } else {
      MG_CHECK(false, "unknown argument '{}' (see --help)", f);
    }
  }
  MG_CHECK(!a.input_pattern.empty(), "--input is required (a JSONL file)");
  MG_CHECK(!a.output_prefix.empty(), "--output-prefix is required");
  MG_CHECK(!a.tokenizer.tokenizer_type.empty(), "--tokenizer-type is required");
  MG_CHECK(a.workers >= 1, "--workers (the number of tokenizing threads, at least 1) is required");
  MG_CHECK(a.partitions >= 1, "--partitions must be at least 1, got {}", a.partitions);
  MG_CHECK(a.workers % a.partitions == 0, "--workers ({}) must be divisible by --partitions ({})", a.workers,
           a.partitions);
  MG_CHECK(a.log_interval >= 1, "--log-interval must be at least 1, got {}", a.log_interval);
  fs::path dir = fs::path(a.output_prefix).parent_path();
  MG_CHECK(dir.empty() || fs::is_directory(dir), "the directory of --output-prefix, {}, does not exist", dir.string());
  return a;
}

std::string output_prefix_for(const std::string& prefix, const std::string& key) {
  return fmt::format("{}_{}_document", prefix, key);
}

// ---- the streaming pipeline ----------------------------------------------------------------------

struct Batch {
  uint64_t seq = 0;
  uint64_t first_line = 0;  // 1-based line number of lines[0]
  std::vector<std::string> lines;
  size_t bytes = 0;
};

/// An encoded batch: for every document kept, for every json key, its sequences.
struct Encoded {
  std::vector<std::vector<std::vector<std::vector<int64_t>>>> docs;
  size_t documents = 0;  // lines encoded, skipped ones included
  size_t bytes = 0;
  size_t skipped = 0;
  std::exception_ptr error;
};

struct Stats {
  size_t documents = 0;  // lines read (Megatron's "Processed N documents" counts them)
  size_t skipped = 0;    // invalid lines skipped
  size_t written = 0;    // documents written
};

/// Encodes the lines of a batch; a malformed line is an error naming its number unless skipping.
Encoded encode_batch(const Batch& batch, const Tokenizer& tok, const Args& args, const std::string& input) {
  Encoded out;
  out.bytes = batch.bytes;
  std::vector<std::string_view> sentences;
  for (size_t n = 0; n < batch.lines.size(); ++n) {
    const uint64_t line_no = batch.first_line + n;
    ++out.documents;
    nlohmann::json doc;
    std::string problem;
    try {
      doc = nlohmann::json::parse(batch.lines[n]);
      if (!doc.is_object()) problem = fmt::format("expected a JSON object, got {}", doc.type_name());
    } catch (const nlohmann::json::exception& e) {  // a syntax error, or a number out of range (1e400)
      problem = fmt::format("malformed JSON ({})", e.what());
    }
    for (size_t k = 0; problem.empty() && k < args.json_keys.size(); ++k) {
      auto it = doc.find(args.json_keys[k]);
      if (it == doc.end()) {
        problem = fmt::format("no key \"{}\"", args.json_keys[k]);
      } else if (!it->is_string() &&
                 !(it->is_array() && std::all_of(it->begin(), it->end(), [](auto& s) { return s.is_string(); }))) {
        problem =
            fmt::format("key \"{}\" is a {}, not a string or a list of strings", args.json_keys[k], it->type_name());
      }
    }
    if (!problem.empty()) {
      if (args.skip_invalid_lines) {
        ++out.skipped;
        continue;
      }
      out.error = std::make_exception_ptr(
          Error(fmt::format("{}:{}: {} (pass --skip-invalid-lines to skip such lines)", input, line_no, problem)));
      return out;
    }
    auto& keys = out.docs.emplace_back(args.json_keys.size());
    for (size_t k = 0; k < args.json_keys.size(); ++k) {
      const nlohmann::json& v = doc[args.json_keys[k]];
      sentences.clear();
      if (v.is_string()) {
        sentences.push_back(v.get_ref<const std::string&>());
      } else {
        for (const auto& s : v) sentences.push_back(s.get_ref<const std::string&>());
      }
      for (std::string_view s : sentences) {
        std::vector<int64_t> ids = tok.tokenize(s);
        if (!ids.empty()) keys[k].push_back(std::move(ids));
      }
      if (!keys[k].empty() && args.append_eod) keys[k].back().push_back(tok.eod());
    }
  }
  return out;
}

/// Runs reader, workers and the in-order writer over one input file; returns the counts.
Stats encode_file(const std::string& input, const std::vector<IndexedDatasetBuilder*>& builders,
                  const std::vector<std::unique_ptr<Tokenizer>>& tokenizers, const Args& args,
                  const std::string& label) {
  const int workers = int(tokenizers.size());
  std::FILE* fin = std::fopen(input.c_str(), "rb");
  MG_CHECK(fin != nullptr, "cannot open --input {}: {}", input, std::strerror(errno));
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> fin_guard(fin, &std::fclose);
  std::fprintf(stderr, "%sOpening %s\n", label.c_str(), input.c_str());

  std::mutex mu;
  std::condition_variable cv_work, cv_done, cv_space;
  std::deque<Batch> todo;
  std::map<uint64_t, Encoded> done;
  uint64_t produced = 0, written = 0;
  bool reader_finished = false, abort = false;
  std::exception_ptr reader_error;
  const uint64_t max_in_flight = uint64_t(workers) * kInFlightPerWorker;

  auto reader = [&] {
    try {
      char* line = nullptr;
      size_t cap = 0;
      struct FreeLine {
        char*& p;
        ~FreeLine() { std::free(p); }
      } free_line{line};
      uint64_t line_no = 0;
      Batch batch;
      auto push = [&]() -> bool {
        std::unique_lock lock(mu);
        cv_space.wait(lock, [&] { return abort || produced - written < max_in_flight; });
        if (abort) return false;
        batch.seq = produced++;
        todo.push_back(std::move(batch));
        batch = Batch{};
        cv_work.notify_one();
        return true;
      };
      ssize_t n;
      while ((n = ::getline(&line, &cap, fin)) > 0) {
        if (batch.lines.empty()) batch.first_line = line_no + 1;
        ++line_no;
        batch.bytes += size_t(n);
        batch.lines.emplace_back(line, size_t(n));
        if ((batch.lines.size() >= kBatchLines || batch.bytes >= kBatchBytes) && !push()) return;
      }
      MG_CHECK(!std::ferror(fin), "error reading {}: {}", input, std::strerror(errno));
      if (!batch.lines.empty()) push();
    } catch (...) {
      std::lock_guard lock(mu);
      reader_error = std::current_exception();
    }
    std::lock_guard lock(mu);
    reader_finished = true;
    cv_work.notify_all();
    cv_done.notify_all();
  };

  auto worker = [&](const Tokenizer* tok) {
    for (;;) {
      Batch batch;
      {
        std::unique_lock lock(mu);
        cv_work.wait(lock, [&] { return abort || !todo.empty() || reader_finished; });
        if (abort || todo.empty()) return;
        batch = std::move(todo.front());
        todo.pop_front();
      }
      Encoded enc;
      try {
        enc = encode_batch(batch, *tok, args, input);
      } catch (...) {
        enc.error = std::current_exception();
      }
      std::lock_guard lock(mu);
      done.emplace(batch.seq, std::move(enc));
      cv_done.notify_all();
    }
  };

  std::vector<std::thread> threads;
  auto stop = [&] {
    std::unique_lock lock(mu);
    abort = true;
    cv_work.notify_all();
    cv_space.notify_all();
    lock.unlock();
    for (auto& t : threads) t.join();
    threads.clear();
  };
  threads.emplace_back(reader);
  for (int w = 0; w < workers; ++w) threads.emplace_back(worker, tokenizers[size_t(w)].get());

  Stats stats;
  size_t total_bytes = 0;
  const auto start = std::chrono::steady_clock::now();
  try {
    for (;;) {
      Encoded enc;
      {
        std::unique_lock lock(mu);
        cv_done.wait(lock, [&] { return done.count(written) > 0 || (reader_finished && produced == written); });
        if (done.count(written) == 0) break;
        enc = std::move(done.at(written));
        done.erase(written);
        ++written;
        cv_space.notify_one();
      }
      if (enc.error) std::rethrow_exception(enc.error);
      for (const auto& keys : enc.docs) {
        for (size_t k = 0; k < builders.size(); ++k) {
          for (const auto& ids : keys[k]) builders[k]->add_item(ids);
          builders[k]->end_document();
        }
      }
      total_bytes += enc.bytes;
      stats.skipped += enc.skipped;
      stats.written += enc.docs.size();
      for (size_t d = 0; d < enc.documents; ++d) {
        if (++stats.documents % size_t(args.log_interval) != 0) continue;
        double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        secs = std::max(secs, 1e-9);
        std::fprintf(stderr, "%sProcessed %zu documents (%.1f docs/s, %.2f MB/s).\n", label.c_str(), stats.documents,
                     double(stats.documents) / secs, double(total_bytes) / secs / 1024 / 1024);
      }
    }
  } catch (...) {
    stop();
    throw;
  }
  stop();
  if (reader_error) std::rethrow_exception(reader_error);
  return stats;
}

/// Runs fn(0..n-1) on n threads; rethrows the first failure once all have finished.
void run_parallel(size_t n, const std::function<void(size_t)>& fn) {
  std::vector<std::exception_ptr> errors(n);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < n; ++i) {
    threads.emplace_back([&, i] {
      try {
        fn(i);
      } catch (...) {
        errors[i] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

/// Temporary outputs, removed unless commit() renamed them to their final names; scratch files,
/// always removed.
class PendingOutputs {
 public:
  void add(std::string final_path) { paths_.push_back(std::move(final_path)); }
  void add_scratch(std::string path) { scratch_.push_back(std::move(path)); }
  static std::string tmp(const std::string& p) { return fmt::format("{}.tmp{}", p, ::getpid()); }
  void commit() {
    for (const auto& p : paths_) fs::rename(tmp(p), p);
    paths_.clear();
  }
  ~PendingOutputs() {
    std::error_code ec;
    for (const auto& p : paths_) fs::remove(tmp(p), ec);
    for (const auto& p : scratch_) fs::remove(p, ec);
  }

 private:
  std::vector<std::string> paths_, scratch_;
};

/// Encodes one input into <prefix>_<key>_document.{bin,idx} for every key.
Stats process_input(const std::string& input, const std::string& prefix, const Args& args, int workers,
                    const std::string& label) {
  // One tokenizer per worker (as Megatron's per-process initializer), loaded concurrently.
  std::vector<std::unique_ptr<Tokenizer>> tokenizers(static_cast<size_t>(workers));
  run_parallel(tokenizers.size(), [&](size_t w) { tokenizers[w] = build_tokenizer(args.tokenizer); });
  const IndexDType dtype = optimal_index_dtype(tokenizers[0]->vocab_size());
  PendingOutputs pending;
  std::vector<std::unique_ptr<IndexedDatasetBuilder>> builders;
  std::vector<IndexedDatasetBuilder*> raw;
  for (const auto& key : args.json_keys) {
    std::string p = output_prefix_for(prefix, key);
    pending.add(get_bin_path(p));
    pending.add(get_idx_path(p));
    builders.push_back(std::make_unique<IndexedDatasetBuilder>(PendingOutputs::tmp(get_bin_path(p)), dtype));
    raw.push_back(builders.back().get());
  }
  Stats stats = encode_file(input, raw, tokenizers, args, label);
  for (size_t k = 0; k < builders.size(); ++k) {
    builders[k]->finalize(PendingOutputs::tmp(get_idx_path(output_prefix_for(prefix, args.json_keys[k]))));
  }
  pending.commit();
  return stats;
}

/// Megatron's partition file names: <input stem>_<i><ext> and <output-prefix>_<i>.
std::string partition_input(const std::string& pattern, int i) {
  fs::path p(pattern);
  std::string stem = (p.parent_path() / p.stem()).string();
  if (p.parent_path().empty()) stem = p.stem().string();
  return fmt::format("{}_{}{}", stem, i, p.extension().string());
}

Stats process_partitions(const Args& args) {
  glob_t g{};
  std::vector<std::string> inputs;
  if (::glob(args.input_pattern.c_str(), 0, nullptr, &g) == 0) {
    for (size_t i = 0; i < g.gl_pathc; ++i) inputs.emplace_back(g.gl_pathv[i]);
  }
  ::globfree(&g);
  MG_CHECK(!inputs.empty(), "--input {} matches no file", args.input_pattern);
  const int parts = args.partitions;
  auto for_each_line = [&](auto&& fn) {
    for (const auto& in : inputs) {
      std::ifstream f(in, std::ios::binary);
      MG_CHECK(f.good(), "cannot open --input {}", in);
      for (std::string line; std::getline(f, line);) fn(line);
    }
  };
  uint64_t partition_size = 0;
  if (args.keep_sequential_samples) {
    for_each_line([&](const std::string&) { ++partition_size; });
    partition_size = std::max<uint64_t>(1, (partition_size + uint64_t(parts) - 1) / uint64_t(parts));
  }
  // Deal the lines into the partition files (round-robin, or contiguous runs to keep the order).
  PendingOutputs pending;
  std::vector<std::string> part_inputs, part_prefixes;
  std::vector<std::ofstream> outs;
  for (int i = 0; i < parts; ++i) {
    part_inputs.push_back(partition_input(args.input_pattern, i));
    part_prefixes.push_back(fmt::format("{}_{}", args.output_prefix, i));
    pending.add_scratch(part_inputs.back());
    for (const auto& key : args.json_keys) {
      pending.add_scratch(get_bin_path(output_prefix_for(part_prefixes.back(), key)));
      pending.add_scratch(get_idx_path(output_prefix_for(part_prefixes.back(), key)));
    }
    outs.emplace_back(part_inputs.back(), std::ios::binary);
    MG_CHECK(outs.back().good(), "cannot create partition file {}", part_inputs.back());
  }
  size_t index = 0;
  uint64_t count = 0;
  for_each_line([&](const std::string& line) {
    outs[index] << line << '\n';
    if (!args.keep_sequential_samples) {
      index = (index + 1) % size_t(parts);
    } else if (++count % partition_size == 0) {
      index = std::min(index + 1, size_t(parts) - 1);
    }
  });
  for (auto& o : outs) {
    o.close();
    MG_CHECK(!o.fail(), "error writing the partition files of {}", args.input_pattern);
  }
  // Encode the partitions concurrently, then merge them in partition order.
  std::vector<Stats> stats(static_cast<size_t>(parts));
  run_parallel(stats.size(), [&](size_t i) {
    stats[i] =
        process_input(part_inputs[i], part_prefixes[i], args, args.workers / parts, fmt::format("[partition {}] ", i));
  });
  IndexDType dtype = optimal_index_dtype(build_tokenizer(args.tokenizer)->vocab_size());
  for (const auto& key : args.json_keys) {
    std::string p = output_prefix_for(args.output_prefix, key);
    pending.add(get_bin_path(p));
    pending.add(get_idx_path(p));
    IndexedDatasetBuilder builder(PendingOutputs::tmp(get_bin_path(p)), dtype);
    for (const auto& pp : part_prefixes) builder.add_index(output_prefix_for(pp, key));
    builder.finalize(PendingOutputs::tmp(get_idx_path(p)));
  }
  pending.commit();
  Stats total;
  for (const auto& s : stats)
    total = {total.documents + s.documents, total.skipped + s.skipped, total.written + s.written};
  return total;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Args args = parse_args(argc, argv);
    const auto start = std::chrono::steady_clock::now();
    Stats stats;
    if (args.partitions == 1) {
      stats = process_input(args.input_pattern, args.output_prefix, args, args.workers, "");
    } else {
      stats = process_partitions(args);
    }
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::fprintf(stderr, "Done: %zu document%s written (%zu lines read", stats.written, stats.written == 1 ? "" : "s",
                 stats.documents);
    if (args.skip_invalid_lines) std::fprintf(stderr, ", %zu invalid lines skipped", stats.skipped);
    std::fprintf(stderr, ") in %.2f s.\n", secs);
    for (const auto& key : args.json_keys) {
      std::fprintf(stderr, "Wrote %s.{bin,idx}\n", output_prefix_for(args.output_prefix, key).c_str());
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "preprocess_data: error: %s\n", e.what());
    return 1;
  }
}
