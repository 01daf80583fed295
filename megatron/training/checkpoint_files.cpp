// The checkpoint directory's files (checkpoint_files.h): the tracker, metadata.json and its checks,
// the checksums' record, atomic text writes and the stale temporary folders of killed saves.
#include "megatron/training/checkpoint_files.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <regex>

#include "megatron/core/dist_checkpointing/sharded.h"
#include "megatron/runtime/check.h"

namespace megatron {

namespace checkpoint_detail {

// `s` as it can be printed on one line: printable ASCII kept, every other byte as \xNN.
std::string printable(std::string_view s, size_t limit) {
  std::string out;
  for (size_t i = 0; i < s.size() && i < limit; ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7f)
      out.push_back(char(c));
    else
      out += fmt::format("\\x{:02x}", c);
  }
  if (s.size() > limit) out += "...";
  return out;
}

void fsync_path(const fs::path& p) {
  int fd = ::open(p.c_str(), O_RDONLY);
  MG_CHECK(fd >= 0, "cannot open {} to sync it to disk", p.string());
  int rc = ::fsync(fd);
  ::close(fd);
  MG_CHECK(rc == 0, "fsync of {} failed: the disk may be full or failing", p.string());
}

void write_text_atomically(const fs::path& path, const std::string& text) {
  const fs::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    MG_CHECK(out.good(), "cannot write {}: check the directory exists and is writable", tmp.string());
    out << text;
    out.flush();
    MG_CHECK(out.good(), "writing {} failed: the disk may be full", tmp.string());
  }
  fsync_path(tmp);
  fs::rename(tmp, path);
  fsync_path(path.parent_path().empty() ? fs::path(".") : path.parent_path());
}

void print_progress(const std::string& line) {
  std::fputs((line + "\n").c_str(), stdout);
  std::fflush(stdout);
}

// Reads latest_checkpointed_iteration.txt; nullopt when there is no checkpoint. As Megatron's
// read_metadata: the file, stripped of surrounding whitespace, is "release" or one iteration number;
// we also refuse what our writer never writes and int() would read (leading zeros, a sign).
std::optional<std::pair<std::string, int64_t>> read_tracker(const fs::path& load_dir) {
  const fs::path tracker = load_dir / kTracker;
  if (!fs::exists(tracker)) return std::nullopt;
  std::ifstream in(tracker, std::ios::binary);
  MG_CHECK(in.good(), "cannot read {}: check its permissions", tracker.string());
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  constexpr const char* kSpace = " \t\n\r\f\v";
  const size_t begin = text.find_first_not_of(kSpace);
  const std::string value =
      begin == std::string::npos ? "" : text.substr(begin, text.find_last_not_of(kSpace) + 1 - begin);
  if (value == "release") return std::make_pair(std::string("release"), int64_t(0));
  const bool digits = !value.empty() && value.size() <= 18 &&
                      std::all_of(value.begin(), value.end(), [](char c) { return c >= '0' && c <= '9'; });
  MG_CHECK(digits && (value == "0" || value[0] != '0'),
           "{} holds '{}', not an iteration number (decimal digits without leading zeros) or 'release': the "
           "checkpoint tracker is corrupt; write the iteration of the checkpoint to load into it",
           tracker.string(), printable(text));
  const int64_t iteration = std::stoll(value);
  return std::make_pair(checkpoint_dir_name(iteration), iteration);
}

nlohmann::json read_metadata(const fs::path& dir) {
  const fs::path meta = dir / "metadata.json";
  MG_CHECK(fs::exists(meta), "checkpoint {} is incomplete: it has no metadata.json", dir.string());
  std::ifstream in(meta);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    MG_CHECK(false, "{} is not valid JSON ({}): the checkpoint is corrupt", meta.string(), e.what());
  }
  MG_CHECK(j.is_object() && j.contains("format") && j["format"] == "megatron.cpp",
           "{} is not a megatron.cpp checkpoint", meta.string());
  MG_CHECK(j.contains("version") && j["version"].is_number_integer(),
           "{} has no integer \"version\": the checkpoint "
           "is corrupt",
           meta.string());
  const int64_t version = j["version"].get<int64_t>();
  MG_CHECK(version >= 1 && version <= kFormatVersion, "{} has format version {}, this build reads 1 to {}",
           meta.string(), version, kFormatVersion);
  return j;
}

// The progress fields of metadata.json, each checked (Megatron's iteration, consumed samples and
// FLOPs): `iteration` a non-negative integer equal to the tracker's (the directory's name), the
// sample counts non-negative integers, the FLOPs a finite non-negative number.
TrainingProgress read_progress(const nlohmann::json& meta, const fs::path& dir, const std::string& dir_name,
                               int64_t tracker_iteration, bool release) {
  const fs::path file = dir / "metadata.json";
  auto count = [&](const char* key, bool required) -> int64_t {
    if (!meta.contains(key)) {
      MG_CHECK(!required, "{} has no \"{}\": the checkpoint is corrupt", file.string(), key);
      return 0;
    }
    const nlohmann::json& v = meta.at(key);
    MG_CHECK(v.is_number_integer() && (v.is_number_unsigned() || v.get<int64_t>() >= 0),
             "{} has \"{}\": {}, not a non-negative integer: the checkpoint is corrupt", file.string(), key,
             printable(v.dump()));
    MG_CHECK(!v.is_number_unsigned() || v.get<uint64_t>() <= uint64_t(INT64_MAX),
             "{} has \"{}\": {}, out of range: the checkpoint is corrupt", file.string(), key, printable(v.dump()));
    return v.get<int64_t>();
  };
  TrainingProgress p;
  p.iteration = count("iteration", true);
  MG_CHECK(release || p.iteration == tracker_iteration,
           "{} has \"iteration\": {} but it is the checkpoint {} of the tracker: the checkpoint is corrupt or was "
           "moved",
           file.string(), p.iteration, dir_name);
  p.consumed_train_samples = count("consumed_train_samples", false);
  p.consumed_valid_samples = count("consumed_valid_samples", false);
  if (meta.contains("floating_point_operations_so_far")) {
    const nlohmann::json& v = meta.at("floating_point_operations_so_far");
    MG_CHECK(v.is_number() && std::isfinite(v.get<double>()) && v.get<double>() >= 0,
             "{} has \"floating_point_operations_so_far\": {}, not a non-negative number: the checkpoint is corrupt",
             file.string(), printable(v.dump()));
    p.floating_point_operations_so_far = v.get<double>();
  }
  return p;
}

// metadata.json's checksums (Note [Checkpoint checksums]); nullopt for a checkpoint written before them.
std::optional<std::map<std::string, uint64_t>> recorded_checksums(const nlohmann::json& meta, const fs::path& dir) {
  if (!meta.contains("checksums")) return std::nullopt;
  const fs::path file = dir / "metadata.json";
  const nlohmann::json& c = meta.at("checksums");
  MG_CHECK(c.is_object() && c.contains("algorithm") && c["algorithm"] == kChecksumAlgorithm && c.contains("files") &&
               c["files"].is_object(),
           "{} has \"checksums\" that are not {{\"algorithm\": \"{}\", \"files\": {{...}}}}: the checkpoint is corrupt",
           file.string(), kChecksumAlgorithm);
  std::map<std::string, uint64_t> out;
  for (const auto& [name, value] : c["files"].items()) {
    const bool hex = value.is_string() && value.get_ref<const std::string&>().size() == 16 &&
                     value.get_ref<const std::string&>().find_first_not_of("0123456789abcdef") == std::string::npos;
    MG_CHECK(hex, "{}: the checksum of '{}' is {}, not 16 hex digits: the checkpoint is corrupt", file.string(),
             printable(name), printable(value.dump()));
    out[name] = std::stoull(value.get<std::string>(), nullptr, 16);
  }
  return out;
}

// Note [Stale temporary checkpoints]: "<iter_N|release>.tmp-PID" folders that a killed save (or a
// full disk) left behind are removed by the next save when PID is not a running process on this
// host. A live process's folder is left alone (another save in progress). PIDs are per host: with
// the save directory on a shared file system, two jobs saving into one directory at once are not
// supported anyway.
void remove_stale_temporary_checkpoints(const fs::path& save_dir) {
  static const std::regex kTmp(R"((iter_\d{7,}|release)\.tmp-(\d{1,9}))");
  std::error_code ec;
  if (!fs::is_directory(save_dir, ec)) return;
  for (const auto& entry : fs::directory_iterator(save_dir, ec)) {
    const std::string name = entry.path().filename().string();
    std::smatch m;
    if (!entry.is_directory(ec) || !std::regex_match(name, m, kTmp)) continue;
    const pid_t pid = pid_t(std::stol(m[2]));
    if (pid == ::getpid() || ::kill(pid, 0) == 0 || errno != ESRCH) continue;  // alive (or not ours to judge)
    fs::remove_all(entry.path(), ec);
    if (!ec)
      print_progress(fmt::format("  removed {}: a checkpoint save by process {}, which is gone, left it",
                                 entry.path().string(), pid));
  }
}

}  // namespace checkpoint_detail

using namespace checkpoint_detail;
using dist_checkpointing::ShardIndex;

std::string checkpoint_dir_name(int64_t iteration, bool release) {
  return release ? "release" : fmt::format("iter_{:07d}", iteration);
}

nlohmann::json read_checkpoint_metadata(const std::string& load_dir, std::string* checkpoint_dir) {
  auto latest = read_tracker(load_dir);
  MG_CHECK(latest.has_value(), "no checkpoint in {} (no {})", load_dir, kTracker);
  const fs::path dir = fs::path(load_dir) / latest->first;
  if (checkpoint_dir) *checkpoint_dir = dir.string();
  return read_metadata(dir);
}

dist_checkpointing::ShardIndex open_model_weights(const nlohmann::json& meta, const std::string& dir) {
  ShardIndex index(dir, kModelStem);
  if (auto checksums = recorded_checksums(meta, dir)) index.expect_checksums(*checksums);
  return index;
}

}  // namespace megatron
