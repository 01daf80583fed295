// TensorBoard event files: written by TensorBoardWriter, read back by a minimal TFRecord reader here
// (framing, both CRCs, Event parse) and by the tensorboard Python package's EventAccumulator.
#include "megatron/training/tensorboard.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <boost/crc.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "megatron/runtime/check.h"
#include "megatron/training/tensorboard_event.pb.h"

namespace megatron {
namespace {

namespace fs = std::filesystem;

// A fresh directory per test, removed afterwards.
class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = fs::temp_directory_path() /
            fmt::format("megatron_tb_{}_{}_{}", info->test_suite_name(), info->name(), static_cast<int>(getpid()));
    fs::remove_all(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

// The reader's own crc32c (boost's Castagnoli parameters), masked as TFRecord stores it.
uint32_t reader_masked_crc(std::string_view data) {
  boost::crc_optimal<32, 0x1EDC6F41, 0xFFFFFFFF, 0xFFFFFFFF, true, true> crc;
  crc.process_bytes(data.data(), data.size());
  const uint32_t c = crc.checksum();
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

uint64_t get_le(const std::string& s, size_t pos, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= uint64_t(static_cast<unsigned char>(s[pos + i])) << (8 * i);
  return v;
}

// Every record of an event file, each checked for complete framing and both CRCs.
std::vector<tensorboard::Event> read_events(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  EXPECT_TRUE(in) << "cannot open " << file;
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<tensorboard::Event> events;
  size_t pos = 0;
  while (pos < bytes.size()) {
    if (bytes.size() - pos < 12) {
      ADD_FAILURE() << "truncated record header at byte " << pos;
      break;
    }
    const uint64_t length = get_le(bytes, pos, 8);
    EXPECT_EQ(get_le(bytes, pos + 8, 4), reader_masked_crc(std::string_view(bytes).substr(pos, 8)))
        << "length CRC at byte " << pos;
    if (bytes.size() - pos - 12 < length + 4) {
      ADD_FAILURE() << "truncated record data at byte " << pos;
      break;
    }
    const std::string data = bytes.substr(pos + 12, length);
    EXPECT_EQ(get_le(bytes, pos + 12 + length, 4), reader_masked_crc(data)) << "data CRC at byte " << pos;
    tensorboard::Event event;
    EXPECT_TRUE(event.ParseFromString(data)) << "record at byte " << pos << " is not an Event";
    events.push_back(event);
    pos += 12 + length + 4;
  }
  return events;
}

// The single event file in `dir`.
fs::path event_file(const fs::path& dir) {
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(dir)) files.push_back(entry.path());
  EXPECT_EQ(files.size(), 1u) << "expected one event file in " << dir;
  return files.empty() ? fs::path() : files.front();
}

struct Scalar {
  std::string tag;
  int64_t step;
  float value;
  bool operator==(const Scalar&) const = default;
};

std::vector<Scalar> scalars_of(const std::vector<tensorboard::Event>& events) {
  std::vector<Scalar> out;
  for (const auto& e : events) {
    if (!e.has_summary()) continue;
    for (const auto& v : e.summary().value()) out.push_back({v.tag(), e.step(), v.simple_value()});
  }
  return out;
}

std::string run_command(const std::string& cmd, int* status) {
  std::string out;
  std::FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) {
    *status = -1;
    return out;
  }
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  *status = pclose(p);
  return out;
}

TEST(TensorBoard, MaskedCrc32cMatchesKnownVector) {
  // crc32c("123456789") = 0xE3069283, the Castagnoli check value.
  const uint32_t c = 0xE3069283u;
  EXPECT_EQ(tfrecord_masked_crc32c("123456789"), ((c >> 15) | (c << 17)) + 0xa282ead8u);
  const std::string framed = tfrecord_frame("abc");
  ASSERT_EQ(framed.size(), 8u + 4u + 3u + 4u);
  EXPECT_EQ(get_le(framed, 0, 8), 3u);
  EXPECT_EQ(framed.substr(12, 3), "abc");
}

TEST(TensorBoard, WritesScalarsThatReadBack) {
  TempDir dir;
  const std::vector<Scalar> written = {{"lm loss", 1, 10.5f},         {"lm loss", 2, 9.25f},
                                       {"learning-rate", 1, 0.0f},    {"learning-rate", 2, 3e-4f},
                                       {"grad-norm", 100000, -1.75f}, {"loss-scale", 3, 65536.0f}};
  const double before = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  {
    TensorBoardWriter writer(dir.path() / "nested" / "run");
    for (const auto& s : written) writer.add_scalar(s.tag, s.value, s.step);
  }
  const double after = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();

  const auto events = read_events(event_file(dir.path() / "nested" / "run"));
  ASSERT_EQ(events.size(), written.size() + 1);
  EXPECT_EQ(events[0].file_version(), "brain.Event:2");
  for (const auto& e : events) {
    EXPECT_GE(e.wall_time(), before - 1);
    EXPECT_LE(e.wall_time(), after + 1);
  }
  EXPECT_EQ(scalars_of(events), written);
}

TEST(TensorBoard, FileNameCarriesTimeHostAndSuffix) {
  TempDir dir;
  TensorBoardWriter writer(dir.path(), ".rank0");
  const std::string name = writer.path().filename().string();
  EXPECT_EQ(writer.path().parent_path(), dir.path());
  EXPECT_EQ(name.rfind("events.out.tfevents.", 0), 0u) << name;
  EXPECT_EQ(name.substr(name.size() - 6), ".rank0") << name;
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  EXPECT_NE(name.find(std::string(".") + host + "."), std::string::npos) << name;
  EXPECT_TRUE(fs::exists(writer.path()));

  // A second writer in the same second writes its own file.
  TensorBoardWriter second(dir.path(), ".rank0");
  EXPECT_NE(second.path(), writer.path());
}

TEST(TensorBoard, FlushesEveryMaxQueueEventsAndOnFlush) {
  TempDir dir;
  TensorBoardWriter writer(dir.path(), "", /*max_queue=*/3, /*flush_secs=*/3600);
  EXPECT_EQ(read_events(writer.path()).size(), 1u);  // the file_version record is written at once
  writer.add_scalar("a", 1, 1);
  writer.add_scalar("a", 2, 2);
  EXPECT_EQ(read_events(writer.path()).size(), 1u);
  writer.add_scalar("a", 3, 3);
  EXPECT_EQ(read_events(writer.path()).size(), 4u);
  writer.add_scalar("a", 4, 4);
  EXPECT_EQ(read_events(writer.path()).size(), 4u);
  writer.flush();
  EXPECT_EQ(read_events(writer.path()).size(), 5u);
}

TEST(TensorBoard, FlushesAfterFlushInterval) {
  TempDir dir;
  TensorBoardWriter writer(dir.path(), "", /*max_queue=*/1000, /*flush_secs=*/0.05);
  writer.add_scalar("a", 1, 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  writer.add_scalar("a", 2, 2);
  EXPECT_EQ(read_events(writer.path()).size(), 3u);
}

TEST(TensorBoard, ConcurrentWritersKeepRecordsWhole) {
  TempDir dir;
  fs::path path;
  {
    TensorBoardWriter writer(dir.path(), "", /*max_queue=*/7);
    path = writer.path();
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&writer, t] {
        for (int i = 0; i < 250; ++i) writer.add_scalar(fmt::format("thread{}", t), i, i);
      });
    }
    for (auto& th : threads) th.join();
  }
  const auto scalars = scalars_of(read_events(path));
  ASSERT_EQ(scalars.size(), 1000u);
  std::map<std::string, int64_t> next_step;
  for (const auto& s : scalars) {
    EXPECT_EQ(s.step, next_step[s.tag]++) << s.tag;
    EXPECT_EQ(s.value, float(s.step));
  }
}

TEST(TensorBoard, UncreatableDirectoryIsAClearError) {
  TempDir dir;
  fs::create_directories(dir.path());
  const fs::path blocker = dir.path() / "a_file";
  std::ofstream(blocker) << "not a directory";
  try {
    TensorBoardWriter writer(blocker / "logs");
    FAIL() << "expected megatron::Error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("cannot create TensorBoard log directory"), std::string::npos) << msg;
    EXPECT_NE(msg.find((blocker / "logs").string()), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
  EXPECT_THROW(TensorBoardWriter{blocker}, Error);  // exists, but is a file
  EXPECT_THROW((TensorBoardWriter{dir.path(), "", 0}), Error);
}

// The tensorboard package's own reader (EventAccumulator) sees the same tags, steps and values.
TEST(TensorBoard, TensorBoardPackageReadsTheFile) {
  int status = 0;
  run_command("python3 -c 'import tensorboard' 2>&1", &status);
  ASSERT_EQ(status, 0) << "the tensorboard Python package is missing (python3 -c 'import tensorboard' failed): "
                          "run scripts/setup to install it";

  TempDir dir;
  const std::vector<Scalar> written = {{"lm loss", 1, 10.5f},       {"lm loss", 2, 9.25f},
                                       {"lm loss", 3, 8.125f},      {"learning-rate", 1, 0.0f},
                                       {"learning-rate", 2, 3e-4f}, {"batch-size", 5, 512.0f}};
  {
    TensorBoardWriter writer(dir.path());
    for (const auto& s : written) writer.add_scalar(s.tag, s.value, s.step);
  }

  const std::string script =
      "import sys\n"
      "from tensorboard.backend.event_processing.event_accumulator import EventAccumulator\n"
      "ea = EventAccumulator(sys.argv[1], size_guidance={'scalars': 0})\n"
      "ea.Reload()\n"
      "print('VERSION', ea.file_version)\n"
      "for tag in ea.Tags()['scalars']:\n"
      "    for e in ea.Scalars(tag):\n"
      "        print('SCALAR', e.step, repr(e.value), tag)\n";
  const fs::path script_path = dir.path() / "read_events.py";
  std::ofstream(script_path) << script;
  const std::string output =
      run_command(fmt::format("python3 '{}' '{}' 2>&1", script_path.string(), dir.path().string()), &status);
  ASSERT_EQ(status, 0) << output;

  std::vector<Scalar> read;
  std::string version;
  std::istringstream lines(output);
  for (std::string line; std::getline(lines, line);) {
    std::istringstream fields(line);
    std::string kind;
    fields >> kind;
    if (kind == "VERSION") {
      fields >> version;
    } else if (kind == "SCALAR") {
      Scalar s;
      double value;
      fields >> s.step >> value >> std::ws;
      std::getline(fields, s.tag);
      s.value = static_cast<float>(value);
      read.push_back(s);
    }
  }
  EXPECT_EQ(version, "2.0") << output;  // EventAccumulator parses "brain.Event:2" as a float
  auto by_tag_step = [](const Scalar& a, const Scalar& b) { return std::tie(a.tag, a.step) < std::tie(b.tag, b.step); };
  std::vector<Scalar> expected = written;
  std::sort(expected.begin(), expected.end(), by_tag_step);
  std::sort(read.begin(), read.end(), by_tag_step);
  EXPECT_EQ(read, expected) << output;
}

}  // namespace
}  // namespace megatron
