#include "megatron/runtime/check.h"

namespace megatron {

void mg_internal_failure(const char* stmt, const char* file, int line, const std::string& msg) {
  throw InternalError(fmt::format("internal error: {} failed at {}:{}{}{} (this is a bug in megatron.cpp)", stmt,
                                  file, line, msg.empty() ? "" : ": ", msg));
}

void mg_library_failure(const char* library, const char* stmt, const char* file, int line, const std::string& error,
                        int device) {
  std::string where = device >= 0 ? fmt::format(" on device {}", device) : std::string();
  throw Error(fmt::format("{} error{}: {} ({}) at {}:{}", library, where, error, stmt, file, line));
}

namespace detail {
std::string format_positional(std::string_view f, const std::vector<std::string>& args) {
  std::string out;
  size_t next = 0;
  for (size_t i = 0; i < f.size(); ++i) {
    if (f[i] == '{' && i + 1 < f.size() && f[i + 1] == '}') {
      out += next < args.size() ? args[next++] : "{}";
      ++i;
    } else {
      out += f[i];
    }
  }
  return out;
}
}  // namespace detail

}  // namespace megatron
