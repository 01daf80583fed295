// Process-wide log level and the log line format (logging.h).
#include "megatron/runtime/logging.h"

#include <fmt/format.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "megatron/runtime/check.h"

namespace megatron::logging {

namespace {
std::atomic<int> g_level{kInfo};
std::atomic<bool> g_single_rank{true};
}  // namespace

void set_level(int level) {
  MG_CHECK(level >= 0, "logging level {} must be >= 0 (10 debug, 20 info, 30 warning, 40 error, 50 critical)", level);
  g_level = level;
}
int level() { return g_level; }
bool enabled(int level) { return level >= g_level; }
void set_single_rank(bool is_logging_rank) { g_single_rank = is_logging_rank; }

std::string level_name(int level) {
  switch (level) {
    case kDebug: return "DEBUG";
    case kInfo: return "INFO";
    case kWarning: return "WARNING";
    case kError: return "ERROR";
    case kCritical: return "CRITICAL";
    default: return fmt::format("Level {}", level);
  }
}

void log(int level, std::string_view logger, std::string_view message) {
  if (!enabled(level)) return;
  const std::string line = fmt::format("{}:{}:{}\n", level_name(level), logger, message);
  std::fputs(line.c_str(), stdout);
  std::fflush(stdout);
}

void log_single_rank(int level, std::string_view logger, std::string_view message) {
  if (g_single_rank) log(level, logger, message);
}

void warn(std::string_view message) {
  if (!enabled(kWarning)) return;
  const std::string line = fmt::format("warning: {}\n", message);
  std::fputs(line.c_str(), stderr);
}

int level_from_flag_and_env(int flag) {
  if (flag >= 0) return flag;
  const char* env = std::getenv("MEGATRON_LOGGING_LEVEL");
  if (!env || !*env) return kInfo;
  size_t used = 0;
  int v = -1;
  try {
    v = std::stoi(env, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  MG_CHECK(used == std::string_view(env).size() && v >= 0,
           "MEGATRON_LOGGING_LEVEL={} must be a Python logging level, an integer >= 0 (10 debug, 20 info, 30 "
           "warning, 40 error, 50 critical)",
           env);
  return v;
}

}  // namespace megatron::logging
