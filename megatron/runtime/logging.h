// Log levels and log lines as Megatron's Python logging gives them (--logging-level,
// MEGATRON_LOGGING_LEVEL): levels are Python's numbers (10 DEBUG, 20 INFO, 30 WARNING, 40 ERROR,
// 50 CRITICAL), a message shows when its level is at least the set one (default INFO, as
// Megatron's training.py configures it), and a logger line reads "LEVEL:logger:message" on stdout
// (Python's basic format through Megatron's CustomHandler). Megatron's print_rank_0 output (the
// startup and iteration lines) is not logging and shows at every level.
//
// The level and whether this process is the one that logs single-rank messages are process-wide,
// as Python's root logger is: set once at start (pretrain), read anywhere.
#pragma once

#include <string>
#include <string_view>

namespace megatron::logging {

constexpr int kDebug = 10, kInfo = 20, kWarning = 30, kError = 40, kCritical = 50;

/// Sets the level (Python's setLevel: any integer >= 0).
void set_level(int level);
int level();
bool enabled(int level);
/// Whether this process prints log_single_rank's messages (Megatron: rank 0; here the rank that
/// prints the iteration lines). Default true.
void set_single_rank(bool is_logging_rank);

/// Python's level name: "DEBUG", "INFO", ... or "Level N".
std::string level_name(int level);

/// "LEVEL:logger:message" on stdout when `level` is enabled (every rank).
void log(int level, std::string_view logger, std::string_view message);
/// The same on the logging rank only (Megatron's log_single_rank).
void log_single_rank(int level, std::string_view logger, std::string_view message);
/// "warning: message" on stderr when WARNING is enabled (every rank): our warnings about flags.
void warn(std::string_view message);

/// The level a run asks for: `flag` when >= 0 (--logging-level), else MEGATRON_LOGGING_LEVEL when
/// set (an integer; anything else is a user error), else INFO.
int level_from_flag_and_env(int flag);

}  // namespace megatron::logging
