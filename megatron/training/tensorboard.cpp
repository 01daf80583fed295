// TensorBoard event-file writer (see tensorboard.h for the record format).
#include "megatron/training/tensorboard.h"

#include <fmt/format.h>
#include <unistd.h>

#include <atomic>
#include <boost/crc.hpp>
#include <cerrno>
#include <cstring>
#include <system_error>

#include "megatron/runtime/check.h"
#include "megatron/runtime/logging.h"
#include "megatron/training/tensorboard_event.pb.h"

namespace megatron {

namespace {

// crc32c: the Castagnoli polynomial, reflected, initial value and final xor all ones.
using Crc32c = boost::crc_optimal<32, 0x1EDC6F41, 0xFFFFFFFF, 0xFFFFFFFF, true, true>;

constexpr uint32_t kCrcMaskDelta = 0xa282ead8u;

void put_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

double unix_seconds_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string host_name() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0 || buf[0] == '\0') return "localhost";
  return buf;
}

// Writers opened by this process, so two opened within one second get different files.
std::atomic<int> writers_opened{0};

}  // namespace

uint32_t tfrecord_masked_crc32c(std::string_view data) {
  Crc32c crc;
  crc.process_bytes(data.data(), data.size());
  const uint32_t c = crc.checksum();
  return ((c >> 15) | (c << 17)) + kCrcMaskDelta;
}

std::string tfrecord_frame(std::string_view data) {
  std::string out;
  out.reserve(data.size() + 16);
  put_le(out, data.size(), 8);
  put_le(out, tfrecord_masked_crc32c(std::string_view(out.data(), 8)), 4);
  out.append(data);
  put_le(out, tfrecord_masked_crc32c(data), 4);
  return out;
}

TensorBoardWriter::TensorBoardWriter(const std::filesystem::path& log_dir, std::string_view filename_suffix,
                                     int max_queue, double flush_secs)
    : max_queue_(max_queue),
      flush_interval_(
          std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(flush_secs))),
      last_flush_(std::chrono::steady_clock::now()) {
  MG_CHECK(max_queue >= 1, "TensorBoard queue size must be at least 1, got {}", max_queue);
  MG_CHECK(flush_secs > 0, "TensorBoard flush interval must be positive, got {} seconds", flush_secs);
  MG_CHECK(!log_dir.empty(), "TensorBoard log directory is empty: pass --tensorboard-dir <dir>");
  std::error_code ec;
  std::filesystem::create_directories(log_dir, ec);
  MG_CHECK(!ec && std::filesystem::is_directory(log_dir),
           "cannot create TensorBoard log directory '{}': {}: choose a writable --tensorboard-dir", log_dir.string(),
           ec ? ec.message() : std::string("a file of that name exists"));

  const double now = unix_seconds_now();
  path_ = log_dir / fmt::format("events.out.tfevents.{}.{}.{}.{}{}", static_cast<int64_t>(now), host_name(),
                                static_cast<int64_t>(getpid()), writers_opened.fetch_add(1), filename_suffix);
  file_ = std::fopen(path_.c_str(), "wb");
  MG_CHECK(file_ != nullptr, "cannot open TensorBoard event file '{}' for writing: {}", path_.string(),
           std::strerror(errno));

  tensorboard::Event event;
  event.set_wall_time(now);
  event.set_file_version("brain.Event:2");
  std::lock_guard<std::mutex> lock(mutex_);
  append_event(event.SerializeAsString());
  flush_locked();
}

TensorBoardWriter::~TensorBoardWriter() {
  try {
    flush();
  } catch (const Error& e) {
    logging::warn(e.what());
  }
  std::fclose(file_);
}

void TensorBoardWriter::add_scalar(std::string_view tag, double value, int64_t step) {
  add_scalar(tag, value, step, unix_seconds_now());
}

void TensorBoardWriter::add_scalar(std::string_view tag, double value, int64_t step, double wall_time) {
  tensorboard::Event event;
  event.set_wall_time(wall_time);
  event.set_step(step);
  tensorboard::Summary::Value* v = event.mutable_summary()->add_value();
  v->set_tag(std::string(tag));
  v->set_simple_value(static_cast<float>(value));
  const std::string serialized = event.SerializeAsString();

  std::lock_guard<std::mutex> lock(mutex_);
  append_event(serialized);
  if (pending_events_ >= max_queue_ || std::chrono::steady_clock::now() - last_flush_ >= flush_interval_) {
    flush_locked();
  }
}

void TensorBoardWriter::flush() {
  std::lock_guard<std::mutex> lock(mutex_);
  flush_locked();
}

void TensorBoardWriter::append_event(const std::string& serialized_event) {
  pending_ += tfrecord_frame(serialized_event);
  ++pending_events_;
}

void TensorBoardWriter::flush_locked() {
  last_flush_ = std::chrono::steady_clock::now();
  // Taken out first: records that fail to reach the file are reported once, not again on every flush.
  const std::string records = std::move(pending_);
  pending_.clear();
  pending_events_ = 0;
  if (!records.empty()) {
    const size_t written = std::fwrite(records.data(), 1, records.size(), file_);
    MG_CHECK(written == records.size(), "cannot write TensorBoard event file '{}': {}", path_.string(),
             std::strerror(errno));
  }
  MG_CHECK(std::fflush(file_) == 0, "cannot write TensorBoard event file '{}': {}", path_.string(),
           std::strerror(errno));
}

}  // namespace megatron
