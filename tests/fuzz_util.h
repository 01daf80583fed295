// A bounded mutation fuzzer for the readers of our file formats (.idx/.bin, safetensors, checkpoint
// metadata, tokenizer files, JSONL lines).
//
// Each try mutates a valid input (fixed seed, fixed count: the same tries on every run) and hands it
// to a target in a forked child, under a memory limit and a time limit, and is classified:
//   accepted     the target returned (it must then have read everything it claims to hold),
//   clean error  a megatron::Error: the one-line message a user gets,
//   crash        a signal (segfault, abort) or any other exception (std::bad_alloc, a json
//                exception that escaped): what a user sees as a crash or a bare "terminate",
//   hang         still running at the time limit.
// A test fails on any crash or hang, and prints the counts per format for the record. Tries run in
// batches (Note [Batched fuzzing]); run_in_child runs one function alone.
//
// Note [Fuzzing in a forked child]: the parent may already run OpenMP or BLAS thread pools, which a
// child of fork() does not have; the child therefore sets one OpenMP thread before the target runs,
// so a parallel region inside it stays on the calling thread instead of waiting for a pool.
#pragma once

#include <gtest/gtest.h>
#include <omp.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "megatron/runtime/check.h"

namespace megatron::testing {

struct FuzzReport {
  std::string format;
  int tries = 0, accepted = 0, clean_error = 0, crash = 0, hang = 0;
  std::vector<std::string> failures;  // the first few crashes and hangs: which try, what happened

  std::string summary() const {
    return format + ": " + std::to_string(tries) + " tries: " + std::to_string(clean_error) + " clean errors, " +
           std::to_string(accepted) + " accepted, " + std::to_string(crash) + " crashes, " + std::to_string(hang) +
           " hangs";
  }
};

/// splitmix64: a small deterministic generator for the mutations.
struct FuzzRng {
  uint64_t s;
  explicit FuzzRng(uint64_t seed) : s(seed) {}
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  size_t below(size_t n) { return n == 0 ? 0 : size_t(next() % n); }
};

/// One random mutation of `in`: bit flips, interesting bytes and integers, inserted, deleted or
/// duplicated ranges, truncation, and for text a number replaced by an extreme one.
inline std::string mutate(const std::string& in, FuzzRng& rng) {
  std::string s = in;
  static const uint64_t kInteresting[] = {0,          1,          0x7f,        0x80,         0xff,
                                          0x7fff,     0x8000,     0xffff,      0x7fffffff,   0x80000000ull,
                                          0xffffffff, 1ull << 32, 1ull << 62,  ~uint64_t(0), ~uint64_t(0) >> 1};
  static const char* const kNumbers[] = {"-1", "0", "1e309", "1000000000", "4294967296", "-9223372036854775809",
                                         "18446744073709551616", "0.5", "1e-400", "null", "\"x\"", "[]", "{}"};
  const int ops = 1 + int(rng.below(3));
  for (int k = 0; k < ops; ++k) {
    const size_t pos = rng.below(s.size() + 1);
    switch (rng.below(9)) {
      case 0:  // flip a bit
        if (!s.empty()) s[rng.below(s.size())] ^= char(1u << rng.below(8));
        break;
      case 1:  // an interesting byte
        if (!s.empty()) s[rng.below(s.size())] = char(kInteresting[rng.below(std::size(kInteresting))]);
        break;
      case 2: {  // an interesting little-endian integer of 1, 2, 4 or 8 bytes
        const size_t width = size_t(1) << rng.below(4);
        if (s.size() < width) break;
        const size_t at = rng.below(s.size() - width + 1);
        const uint64_t v = kInteresting[rng.below(std::size(kInteresting))];
        for (size_t b = 0; b < width; ++b) s[at + b] = char(v >> (8 * b));
        break;
      }
      case 3:  // insert random bytes
        s.insert(pos, std::string(1 + rng.below(8), char(rng.next())));
        break;
      case 4:  // delete a range
        if (pos < s.size()) s.erase(pos, 1 + rng.below(std::min<size_t>(64, s.size() - pos)));
        break;
      case 5: {  // duplicate a range
        if (pos >= s.size()) break;
        const std::string piece = s.substr(pos, 1 + rng.below(32));
        s.insert(rng.below(s.size() + 1), piece);
        break;
      }
      case 6:  // truncate
        s.resize(rng.below(s.size() + 1));
        break;
      case 7: {  // a run of digits replaced by an extreme number (text formats)
        size_t start = s.find_first_of("0123456789", pos);
        if (start == std::string::npos) break;
        size_t end = s.find_first_not_of("0123456789.eE-", start);
        s.replace(start, (end == std::string::npos ? s.size() : end) - start, kNumbers[rng.below(std::size(kNumbers))]);
        break;
      }
      case 8:  // a structural character (text formats)
        if (!s.empty()) s[rng.below(s.size())] = "{}[]\",: \n\\"[rng.below(11)];
        break;
    }
  }
  return s;
}

enum class ChildOutcome { accepted, clean_error, crash, hang };

struct ChildResult {
  ChildOutcome outcome = ChildOutcome::crash;
  std::string message;  // the error's message, or what the crash was
};

/// Runs `fn` in a forked child with `memory_mb` of address space beyond what this process already
/// uses and `timeout_s` seconds, and says how it ended (a megatron::Error's message comes back).
inline ChildResult run_in_child(const std::function<void()>& fn, double timeout_s = 5.0, size_t memory_mb = 1024) {
  long pages = 0;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%ld", &pages) != 1) pages = 0;
    std::fclose(f);
  }
  const rlim_t limit = rlim_t(pages) * rlim_t(::sysconf(_SC_PAGESIZE)) + rlim_t(memory_mb) * (rlim_t(1) << 20);
  int fds[2];
  if (::pipe(fds) != 0) return {ChildOutcome::crash, "pipe failed"};
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    // Note [Fuzzing in a forked child].
    omp_set_num_threads(1);
    struct rlimit rl {limit, limit};
    ::setrlimit(RLIMIT_AS, &rl);
    int code = 0;
    std::string message;
    try {
      fn();
    } catch (const Error& e) {
      code = 1, message = e.what();
    } catch (const std::bad_alloc&) {
      code = 3, message = "std::bad_alloc";
    } catch (const std::exception& e) {
      code = 4, message = std::string("exception: ") + e.what();
    } catch (...) {
      code = 5, message = "unknown exception";
    }
    message = message.substr(0, 4000);
    if (::write(fds[1], message.data(), message.size()) < 0) code = 6;
    std::fflush(nullptr);
    ::_exit(code);
  }
  ::close(fds[1]);
  if (pid < 0) {
    ::close(fds[0]);
    return {ChildOutcome::crash, "fork failed"};
  }
  int status = 0;
  const auto start = std::chrono::steady_clock::now();
  bool done = false;
  while (!done) {
    if (::waitpid(pid, &status, WNOHANG) == pid) {
      done = true;
      break;
    }
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > timeout_s) break;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  ChildResult r;
  if (!done) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
    ::close(fds[0]);
    return {ChildOutcome::hang, "hang"};
  }
  char buf[4096];
  ssize_t n;
  while ((n = ::read(fds[0], buf, sizeof(buf))) > 0) r.message.append(buf, size_t(n));
  ::close(fds[0]);
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
    r.outcome = ChildOutcome::accepted;
  } else if (WIFEXITED(status) && WEXITSTATUS(status) == 1) {
    r.outcome = ChildOutcome::clean_error;
  } else {
    r.outcome = ChildOutcome::crash;
    if (WIFSIGNALED(status)) r.message = "signal " + std::to_string(WTERMSIG(status));
  }
  return r;
}

// Note [Batched fuzzing]: a fork per try costs tens of milliseconds in a test binary that maps the
// CUDA kernels, so one child runs the tries in order and reports each outcome on a pipe; a child
// that dies (a crash) or stops reporting within the time limit (a hang, killed) is charged with the
// try it was on, and a fresh child goes on from the next try.
inline FuzzReport fuzz(const std::string& format, const std::string& seed_input, int tries, uint64_t seed,
                       const std::function<void(const std::string&)>& target, double timeout_s = 5.0,
                       size_t memory_mb = 1024) {
  FuzzReport report;
  report.format = format;
  FuzzRng rng(seed);
  std::vector<std::string> inputs;
  for (int t = 0; t < tries; ++t) inputs.push_back(mutate(seed_input, rng));
  long pages = 0;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%ld", &pages) != 1) pages = 0;
    std::fclose(f);
  }
  const rlim_t limit = rlim_t(pages) * rlim_t(::sysconf(_SC_PAGESIZE)) + rlim_t(memory_mb) * (rlim_t(1) << 20);
  auto fail = [&](int t, const std::string& what) {
    if (report.failures.size() < 5) report.failures.push_back("try " + std::to_string(t) + ": " + what);
  };
  int next = 0;
  while (next < tries) {
    int fds[2];
    if (::pipe(fds) != 0) {
      ADD_FAILURE() << "pipe failed";
      break;
    }
    std::fflush(nullptr);
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::close(fds[0]);
      // Note [Fuzzing in a forked child].
      omp_set_num_threads(1);
      struct rlimit rl {limit, limit};
      ::setrlimit(RLIMIT_AS, &rl);
      for (int t = next; t < tries; ++t) {
        char code = 0;
        std::string message;
        try {
          target(inputs[size_t(t)]);
        } catch (const Error&) {
          code = 1;
        } catch (const std::bad_alloc&) {
          code = 3, message = "std::bad_alloc";
        } catch (const std::exception& e) {
          code = 4, message = std::string("exception: ") + e.what();
        } catch (...) {
          code = 5, message = "unknown exception";
        }
        std::string record(1, code);
        if (code >= 3) {
          message = message.substr(0, 1000);
          record.push_back(char(message.size() & 0xff));
          record.push_back(char(message.size() >> 8));
          record += message;
        }
        if (::write(fds[1], record.data(), record.size()) != ssize_t(record.size())) ::_exit(9);
      }
      std::fflush(nullptr);
      ::_exit(0);
    }
    ::close(fds[1]);
    if (pid < 0) {
      ::close(fds[0]);
      ADD_FAILURE() << "fork failed";
      break;
    }
    // Reads exactly n bytes unless the child dies (false) or the deadline passes (hang = true).
    auto read_bytes = [&](char* out, size_t n, bool& hang) {
      size_t got = 0;
      const auto start = std::chrono::steady_clock::now();
      while (got < n) {
        struct pollfd pfd {fds[0], POLLIN, 0};
        const double left = timeout_s - std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        if (left <= 0) {
          hang = true;
          return false;
        }
        const int ready = ::poll(&pfd, 1, int(left * 1000) + 1);
        if (ready == 0) continue;
        const ssize_t r = ::read(fds[0], out + got, n - got);
        if (r <= 0) return false;
        got += size_t(r);
      }
      return true;
    };
    bool hang = false;
    while (next < tries) {
      char code = 0;
      if (!read_bytes(&code, 1, hang)) break;
      std::string message;
      if (code >= 3) {
        char len[2];
        if (!read_bytes(len, 2, hang)) break;
        message.resize(size_t(uint8_t(len[0])) | (size_t(uint8_t(len[1])) << 8));
        if (!read_bytes(message.data(), message.size(), hang)) break;
      }
      ++report.tries;
      if (code == 0) {
        ++report.accepted;
      } else if (code == 1) {
        ++report.clean_error;
      } else {
        ++report.crash;
        fail(next, message);
      }
      ++next;
    }
    int status = 0;
    if (next < tries) {  // the child stopped on try `next`
      if (hang) ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      ++report.tries;
      if (hang) {
        ++report.hang;
        fail(next, "hang");
      } else {
        ++report.crash;
        fail(next, WIFSIGNALED(status) ? "signal " + std::to_string(WTERMSIG(status)) : "the child died");
      }
      ++next;
    } else {
      ::waitpid(pid, &status, 0);
    }
    ::close(fds[0]);
  }
  return report;
}

/// Prints the report and fails the test on any crash or hang.
inline void expect_no_crash_or_hang(const FuzzReport& r) {
  std::printf("[fuzz] %s\n", r.summary().c_str());
  std::string failures;
  for (const std::string& f : r.failures) failures += "\n  " + f;
  EXPECT_EQ(r.crash, 0) << r.summary() << failures;
  EXPECT_EQ(r.hang, 0) << r.summary() << failures;
  EXPECT_GT(r.clean_error, 0) << "the mutations never reached an error: the fuzzer is not exercising " << r.format;
}

}  // namespace megatron::testing
