// TensorBoard event-file writer: what Megatron-LM gets from torch.utils.tensorboard.SummaryWriter,
// for the one call it makes (writer.add_scalar(tag, value, step)).
//
// A file is a sequence of TFRecords, each an Event protobuf (tensorboard_event.proto):
//   uint64 length | uint32 masked_crc32c(length bytes) | data[length] | uint32 masked_crc32c(data)
// all little-endian, where masked_crc32c(x) = rotate_right(crc32c(x), 15) + 0xa282ead8.
// The first record carries file_version "brain.Event:2"; each later one a Summary with one scalar.
// Records are buffered in memory and written out every `max_queue` events, every `flush_secs`
// seconds (checked when an event is added), on flush() and on destruction.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <mutex>
#include <string>
#include <string_view>

namespace megatron {

/// crc32c (Castagnoli) of `data`, masked as TFRecord framing stores it.
uint32_t tfrecord_masked_crc32c(std::string_view data);

/// One TFRecord: the framing above around `data`.
std::string tfrecord_frame(std::string_view data);

/// Writes scalars to <log_dir>/events.out.tfevents.<unix seconds>.<hostname>.<pid>.<n><suffix>,
/// where n counts the writers this process opened. Safe to call from several threads.
class TensorBoardWriter {
 public:
  /// Creates `log_dir` (and its parents) and the event file, and writes the file_version record.
  /// Throws megatron::Error when the directory cannot be created or the file not written.
  explicit TensorBoardWriter(const std::filesystem::path& log_dir, std::string_view filename_suffix = "",
                             int max_queue = 10, double flush_secs = 120.0);
  /// Flushes what is buffered; an error here is reported on stderr, not thrown.
  ~TensorBoardWriter();

  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  /// Records `value` (stored as float, as TensorBoard does) under `tag` at `step`, wall time now.
  void add_scalar(std::string_view tag, double value, int64_t step);
  /// The same with an explicit wall time, in seconds since the Unix epoch.
  void add_scalar(std::string_view tag, double value, int64_t step, double wall_time);

  /// Writes the buffered records to the file and flushes it. Throws megatron::Error on failure.
  void flush();

  const std::filesystem::path& path() const { return path_; }

 private:
  void append_event(const std::string& serialized_event);
  void flush_locked();

  std::filesystem::path path_;
  std::FILE* file_ = nullptr;
  int max_queue_;
  std::chrono::steady_clock::duration flush_interval_;
  std::chrono::steady_clock::time_point last_flush_;
  std::string pending_;  // framed records not yet written
  int pending_events_ = 0;
  std::mutex mutex_;
};

}  // namespace megatron
