// The checkpoint directory's files, shared by the Checkpointer (checkpointing.cpp) and the readers
// of checkpoint_files.cpp: the tracker (latest_checkpointed_iteration.txt, as Megatron's),
// metadata.json and its checks, the checksums' record (Note [Checkpoint checksums]), atomic text
// writes and the stale temporary folders of killed saves (Note [Stale temporary checkpoints]).
// Internal to megatron/training: the public entry points are in checkpointing.h.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include <nlohmann/json.hpp>

#include "megatron/training/checkpointing.h"

namespace megatron::checkpoint_detail {

namespace fs = std::filesystem;

inline constexpr const char* kTracker = "latest_checkpointed_iteration.txt";
inline constexpr const char* kModelStem = "model";
inline constexpr const char* kOptimStem = "optim";
// 1: one model_rank00000/optim_rank00000 pair without shard metadata; 2: shards of any layout.
inline constexpr int kFormatVersion = 2;
inline constexpr const char* kChecksumAlgorithm = "xxh3-64";

/// `s` as it can be printed on one line: printable ASCII kept, every other byte as \xNN.
std::string printable(std::string_view s, size_t limit = 80);
/// fsync of a file or directory (one line when it fails).
void fsync_path(const fs::path& p);
/// `text` into `path` through a synced temporary file and a rename.
void write_text_atomically(const fs::path& path, const std::string& text);
/// One line on stdout, flushed.
void print_progress(const std::string& line);
/// The tracker's checkpoint ("iter_NNNNNNN" or "release") and iteration; nullopt without a tracker.
std::optional<std::pair<std::string, int64_t>> read_tracker(const fs::path& load_dir);
/// dir/metadata.json, checked to be a megatron.cpp checkpoint of a version this build reads.
nlohmann::json read_metadata(const fs::path& dir);
/// metadata.json's progress fields, each checked against the tracker's iteration.
TrainingProgress read_progress(const nlohmann::json& meta, const fs::path& dir, const std::string& dir_name,
                               int64_t tracker_iteration, bool release);
/// metadata.json's checksums (Note [Checkpoint checksums]); nullopt for a checkpoint written before them.
std::optional<std::map<std::string, uint64_t>> recorded_checksums(const nlohmann::json& meta, const fs::path& dir);
/// Note [Stale temporary checkpoints].
void remove_stale_temporary_checkpoints(const fs::path& save_dir);

}  // namespace megatron::checkpoint_detail
