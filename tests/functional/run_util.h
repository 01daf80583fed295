// Helpers for the functional tests: run the built binaries (build/bin) in a scratch directory and
// read what they print.
#pragma once

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/test_util.h"

namespace megatron::testing {

namespace fs = std::filesystem;

/// The built binary `name`: build/bin, or $MEGATRON_BIN_DIR (binaries staged on another machine).
inline std::string bin(const std::string& name) {
  const char* dir = std::getenv("MEGATRON_BIN_DIR");
  return (dir && *dir ? std::string(dir) : std::string(MEGATRON_BINARY_DIR) + "/bin") + "/" + name;
}

struct RunResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
};

inline std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

/// Runs `argv` in `cwd` (with extra environment assignments), waits, returns exit code and output.
inline RunResult run(const std::vector<std::string>& argv, const fs::path& cwd, const std::string& env = "") {
  std::string cmd = "cd " + shell_quote(cwd.string()) + " && " + env + " ";
  for (const std::string& a : argv) cmd += shell_quote(a) + " ";
  cmd += "2>&1";
  RunResult r;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) r.output.append(buf, n);
  int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

/// A scratch directory removed at the end of the test.
struct ScratchDir {
  fs::path path;
  explicit ScratchDir(const std::string& name) {
    path = fs::temp_directory_path() / ("megatron_" + name + "_" + std::to_string(::getpid()));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~ScratchDir() { fs::remove_all(path); }
};

/// Every "lm loss: X" of the iteration lines, in order, as printed.
inline std::vector<std::string> field_values(const std::string& output, const std::string& field) {
  std::vector<std::string> out;
  std::regex re(" " + field + ": +([^ |]+) \\|");
  std::istringstream in(output);
  std::string line;
  while (std::getline(in, line)) {
    if (line.find(" iteration ") == std::string::npos) continue;
    std::smatch m;
    if (std::regex_search(line, m, re)) out.push_back(m[1]);
  }
  return out;
}

inline std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

/// The fixture corpus with the SentencePiece tokenizer (vocabulary 1000: fast on the CPU).
inline std::vector<std::string> tiny_gpt_flags(int iters) {
  const std::string d = data_fixtures_dir();
  return {"--num-layers",
          "2",
          "--hidden-size",
          "64",
          "--num-attention-heads",
          "4",
          "--seq-length",
          "64",
          "--micro-batch-size",
          "4",
          "--global-batch-size",
          "8",
          "--train-iters",
          std::to_string(iters),
          "--lr",
          "3e-3",
          "--min-lr",
          "3e-4",
          "--lr-decay-style",
          "cosine",
          "--lr-warmup-iters",
          "1",
          "--data-path",
          d + "/data/shakespeare_spm_text_document",
          "--split",
          "98,2,0",
          "--tokenizer-type",
          "SentencePieceTokenizer",
          "--tokenizer-model",
          d + "/tok-spm.model",
          "--log-interval",
          "1",
          "--eval-interval",
          "1000",
          "--eval-iters",
          "1",
          "--device",
          "cpu"};
}

inline std::vector<std::string> concat(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

}  // namespace megatron::testing
