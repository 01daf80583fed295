// The three kinds of checks, defined once (PyTorch's TORCH_CHECK / TORCH_INTERNAL_ASSERT split).
//   MG_CHECK(cond, fmt, args...)   the user's mistake: throws megatron::Error with a one-line message
//                                  saying what was wrong and what to do.
//   MG_ASSERT(cond, fmt, args...)  our bug: throws megatron::InternalError naming the file and line.
//   MG_DASSERT(cond)               debug-only assert for hot paths.
// Library checks (CUDA_CHECK, CUBLAS_CHECK, ...) are built on mg_library_failure() in the files that
// include the library headers, so this header stays free of them.
// Library code never calls exit(): it throws; the binaries catch at main and print one line.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#if defined(__CUDACC__)
#include <sstream>
#else
#include <fmt/format.h>
#endif

namespace megatron {

/// A user-facing error: bad input, a bad flag, a missing file. The message is the whole story.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
};

/// A broken invariant inside megatron.cpp (a bug, not the user's fault).
class InternalError : public std::logic_error {
 public:
  explicit InternalError(const std::string& msg) : std::logic_error(msg) {}
};

[[noreturn]] void mg_internal_failure(const char* stmt, const char* file, int line, const std::string& msg);
/// Failure of a library call (cuda, cublas, cudnn, nccl, mpi) with the library's own error string.
[[noreturn]] void mg_library_failure(const char* library, const char* stmt, const char* file, int line,
                                     const std::string& error, int device);

namespace detail {
inline std::string check_message() { return {}; }
#if defined(__CUDACC__)
// fmt does not compile under nvcc in C++20 mode, so CUDA sources format their messages with a
// small positional formatter: each "{}" takes the next argument, printed with operator<<.
std::string format_positional(std::string_view f, const std::vector<std::string>& args);
template <typename T>
std::string arg_to_string(const T& v) {
  std::ostringstream os;
  os << v;
  return os.str();
}
template <typename... Args>
std::string check_message(std::string_view f, const Args&... args) {
  return format_positional(f, {arg_to_string(args)...});
}
#else
template <typename... Args>
std::string check_message(fmt::format_string<Args...> f, Args&&... args) {
  return fmt::format(f, std::forward<Args>(args)...);
}
#endif
}  // namespace detail

}  // namespace megatron

#define MG_CHECK(cond, ...)                                                 \
  do {                                                                      \
    if (!(cond)) [[unlikely]] {                                             \
      throw ::megatron::Error(::megatron::detail::check_message(__VA_ARGS__)); \
    }                                                                       \
  } while (0)

#define MG_ASSERT(cond, ...)                                                                         \
  do {                                                                                               \
    if (!(cond)) [[unlikely]] {                                                                      \
      ::megatron::mg_internal_failure(#cond, __FILE__, __LINE__,                                     \
                                      ::megatron::detail::check_message(__VA_ARGS__));               \
    }                                                                                                \
  } while (0)

#ifdef NDEBUG
#define MG_DASSERT(cond) ((void)0)
#else
#define MG_DASSERT(cond) MG_ASSERT(cond)
#endif
