// Safetensors reader (mmap + nlohmann-json header) and atomic writer (tmp file, fsync, rename).
// The reader checks everything the header claims against the file before handing out a byte, so
// a corrupt or hostile file fails at open with one line naming the file and the tensor.
#include "megatron/core/dist_checkpointing/safetensors.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <system_error>

namespace megatron::safetensors {
namespace {

using nlohmann::json;

/// The Python library refuses larger headers; a length above it means the file is not safetensors.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

constexpr DType kAllDTypes[] = {
#define MG_DTYPE_VALUE(name, Enum, bytes, st) DType::Enum,
    MG_FORALL_DTYPES(MG_DTYPE_VALUE)
#undef MG_DTYPE_VALUE
};

std::string errno_message(int err) { return std::error_code(err, std::generic_category()).message(); }

std::optional<DType> dtype_from_safetensors_name(std::string_view s) {
  for (DType t : kAllDTypes) {
    if (safetensors_name(t) == s) return t;
  }
  return std::nullopt;
}

std::string supported_dtype_names() {
  std::vector<std::string_view> names;
  for (DType t : kAllDTypes) names.push_back(safetensors_name(t));
  return fmt::format("{}", fmt::join(names, ", "));
}

/// A file descriptor closed on scope exit.
struct Fd {
  int fd = -1;
  explicit Fd(int f) : fd(f) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

Shape parse_shape(const std::string& file, const std::string& name, const json& j) {
  MG_CHECK(j.is_array(), "safetensors file '{}': tensor '{}' has shape {}, not a list of sizes; the file is corrupt",
           file, name, j.dump());
  Shape shape;
  for (const json& d : j) {
    MG_CHECK(d.is_number_integer(),
             "safetensors file '{}': tensor '{}' has shape {} with a non-integer size; the file is corrupt", file, name,
             j.dump());
    MG_CHECK(d.is_number_unsigned() && d.get<uint64_t>() <= uint64_t(std::numeric_limits<int64_t>::max()),
             "safetensors file '{}': tensor '{}' has shape {} with a negative (or overflowing) dimension; the file "
             "is corrupt",
             file, name, j.dump());
    shape.push_back(d.get<int64_t>());
  }
  return shape;
}

Entry parse_entry(const std::string& file, const std::string& name, const json& j) {
  MG_CHECK(j.is_object(),
           "safetensors file '{}': header entry '{}' is {}, not an object with dtype, shape and data_offsets; the "
           "file is corrupt",
           file, name, j.dump());
  auto dtype_it = j.find("dtype");
  auto shape_it = j.find("shape");
  auto offsets_it = j.find("data_offsets");
  MG_CHECK(dtype_it != j.end() && shape_it != j.end() && offsets_it != j.end(),
           "safetensors file '{}': tensor '{}' lacks one of dtype, shape, data_offsets (entry {}); the file is corrupt",
           file, name, j.dump());
  MG_CHECK(dtype_it->is_string(), "safetensors file '{}': tensor '{}' has dtype {}, not a string; the file is corrupt",
           file, name, dtype_it->dump());
  const std::string& dtype_name = dtype_it->get_ref<const std::string&>();
  std::optional<DType> dtype = dtype_from_safetensors_name(dtype_name);
  MG_CHECK(dtype.has_value(),
           "safetensors file '{}': tensor '{}' has dtype '{}', which megatron.cpp does not read (supported: {}); "
           "convert it to one of those",
           file, name, dtype_name, supported_dtype_names());

  Entry e;
  e.dtype = *dtype;
  e.shape = parse_shape(file, name, *shape_it);

  const json& off = *offsets_it;
  MG_CHECK(off.is_array() && off.size() == 2 && off[0].is_number_unsigned() && off[1].is_number_unsigned() &&
               off[0].get<uint64_t>() <= off[1].get<uint64_t>(),
           "safetensors file '{}': tensor '{}' has data_offsets {}, not two increasing integers [begin, end]; the "
           "file is corrupt",
           file, name, off.dump());
  e.begin = off[0].get<uint64_t>();
  e.end = off[1].get<uint64_t>();

  // numel * element size, refusing to overflow (a hostile shape must not wrap around to a small size).
  unsigned __int128 expected = size_of(e.dtype);
  for (int64_t d : e.shape) expected = std::min<unsigned __int128>(expected * uint64_t(d), uint64_t(1) << 63);
  MG_CHECK(expected == e.end - e.begin,
           "safetensors file '{}': tensor '{}' ({} {}) needs {} bytes but its data_offsets [{}, {}] hold {}; the file "
           "is corrupt",
           file, name, safetensors_name(e.dtype), shape_str(e.shape), uint64_t(expected), e.begin, e.end,
           e.end - e.begin);
  return e;
}

Metadata parse_metadata(const std::string& file, const json& j) {
  MG_CHECK(j.is_object(), "safetensors file '{}': \"__metadata__\" is {}, not a map of strings; the file is corrupt",
           file, j.dump());
  Metadata m;
  for (const auto& [key, value] : j.items()) {
    MG_CHECK(value.is_string(),
             "safetensors file '{}': \"__metadata__\" key '{}' holds {}, not a string; the file is corrupt", file, key,
             value.dump());
    m.emplace(key, value.get<std::string>());
  }
  return m;
}

// Note [Tensor order]
// The Python library (its Rust core) sorts tensors by dtype, descending in the order of its Dtype
// enum (which increases with element size), then by name, and lays the data out in that order; the
// header is 8-byte padded and lists "__metadata__" first, then the tensors in data order. Every
// tensor therefore starts at a multiple of its element size. This is that enum's rank for our dtypes.
int python_dtype_rank(DType t) {
  switch (t) {
    case DType::UInt8:
      return 1;
    case DType::Float8E5M2:
      return 3;
    case DType::Float8E4M3:
      return 4;
    case DType::UInt16:
      return 6;
    case DType::Float16:
      return 7;
    case DType::BFloat16:
      return 8;
    case DType::Int32:
      return 9;
    case DType::Float32:
      return 11;
    case DType::Int64:
      return 13;
  }
  MG_ASSERT(false, "no safetensors rank for dtype {}", to_string(t));
}

/// A JSON string literal (throws megatron::Error naming the file when `s` is not valid UTF-8).
std::string quoted(const std::string& path, const std::string& s) {
  try {
    return json(s).dump();
  } catch (const json::exception&) {
    MG_CHECK(false, "cannot write safetensors file '{}': the name or metadata string '{}' is not valid UTF-8", path, s);
  }
  return {};
}

void write_all(int fd, const void* data, size_t n, const std::string& tmp) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::write(fd, p, std::min<size_t>(n, size_t(1) << 30));
    if (w < 0 && errno == EINTR) continue;
    MG_CHECK(w > 0, "cannot write '{}': {}; check free disk space and write permission", tmp,
             errno_message(w < 0 ? errno : EIO));
    p += w;
    n -= size_t(w);
  }
}

/// The temporary file of an atomic write: removed unless committed.
struct TempFile {
  std::string path;
  bool committed = false;
  ~TempFile() {
    if (!committed) ::unlink(path.c_str());
  }
};

}  // namespace

// ---- reader --------------------------------------------------------------------------------------

struct File::Mapping {
  void* addr;
  size_t size;
  Mapping(void* a, size_t s) : addr(a), size(s) {}
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() { ::munmap(addr, size); }
};

File::File(std::string path) : path_(std::move(path)) {
  Fd fd(::open(path_.c_str(), O_RDONLY | O_CLOEXEC));
  MG_CHECK(fd.fd >= 0, "cannot open safetensors file '{}': {}; check the path and its permissions", path_,
           errno_message(errno));
  struct stat st {};
  MG_CHECK(::fstat(fd.fd, &st) == 0, "cannot stat safetensors file '{}': {}", path_, errno_message(errno));
  MG_CHECK(S_ISREG(st.st_mode), "safetensors file '{}' is not a regular file; pass the path of a .safetensors file",
           path_);
  const uint64_t file_size = uint64_t(st.st_size);
  MG_CHECK(file_size >= 8,
           "safetensors file '{}' has {} bytes, fewer than the 8-byte header length; the file is truncated or empty",
           path_, file_size);

  void* addr = ::mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, fd.fd, 0);
  MG_CHECK(addr != MAP_FAILED, "cannot map safetensors file '{}': {}", path_, errno_message(errno));
  mapping_ = std::make_shared<const Mapping>(addr, file_size);
  const auto* base = static_cast<const std::byte*>(addr);

  uint8_t len_bytes[8];
  std::memcpy(len_bytes, base, 8);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | len_bytes[i];
  MG_CHECK(header_len <= kMaxHeaderBytes,
           "safetensors file '{}' declares a {}-byte header, over the 100 MB limit; it is not a safetensors file or "
           "it is corrupt",
           path_, header_len);
  MG_CHECK(header_len <= file_size - 8,
           "safetensors file '{}' declares a {}-byte header but has only {} bytes after the length; the file is "
           "truncated",
           path_, header_len, file_size - 8);

  const char* header_begin = reinterpret_cast<const char*>(base + 8);
  json header;
  try {
    header = json::parse(header_begin, header_begin + header_len);
  } catch (const json::exception& e) {
    MG_CHECK(false, "safetensors file '{}' has a header that is not valid JSON ({}); the file is corrupt", path_,
             e.what());
  }
  MG_CHECK(header.is_object(),
           "safetensors file '{}' has a header that is a JSON {}, not an object; the file is corrupt", path_,
           header.type_name());

  buffer_ = base + 8 + header_len;
  const uint64_t buffer_size = file_size - 8 - header_len;
  for (const auto& [key, value] : header.items()) {
    if (key == "__metadata__") {
      metadata_ = parse_metadata(path_, value);
      continue;
    }
    Entry e = parse_entry(path_, key, value);
    MG_CHECK(e.end <= buffer_size,
             "safetensors file '{}': tensor '{}' ends at byte {} of the data but the data has {} bytes; the file is "
             "truncated",
             path_, key, e.end, buffer_size);
    entries_.emplace(key, std::move(e));
  }

  std::vector<std::pair<const std::string*, const Entry*>> by_offset;
  for (const auto& [name, e] : entries_) {
    if (e.end > e.begin) by_offset.emplace_back(&name, &e);
  }
  std::sort(by_offset.begin(), by_offset.end(),
            [](const auto& a, const auto& b) { return a.second->begin < b.second->begin; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const auto& [prev_name, prev] = by_offset[i - 1];
    const auto& [name, e] = by_offset[i];
    MG_CHECK(e->begin >= prev->end,
             "safetensors file '{}': tensors '{}' [{}, {}) and '{}' [{}, {}) overlap; the file is corrupt", path_,
             *prev_name, prev->begin, prev->end, *name, e->begin, e->end);
  }
}

std::vector<std::string> File::names() const {
  std::vector<std::string> out;
  out.reserve(entries_.size());
  for (const auto& [name, e] : entries_) out.push_back(name);
  return out;
}

const Entry& File::entry(std::string_view name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) [[unlikely]] {
    std::vector<std::string_view> examples;
    for (auto e = entries_.begin(); e != entries_.end() && examples.size() < 3; ++e) examples.push_back(e->first);
    MG_CHECK(false, "tensor '{}' not found in {}; it has {} tensors{}{}", name, path_, entries_.size(),
             entries_.empty() ? "" : ", e.g. ", fmt::join(examples, ", "));
  }
  return it->second;
}

Tensor File::read(std::string_view name, std::optional<DType> dtype) const {
  const Entry& e = entry(name);
  Tensor t = Tensor::empty(e.shape, dtype.value_or(e.dtype));
  convert_elements(buffer_ + e.begin, e.dtype, t.raw_data(), t.dtype(), size_t(t.numel()));
  return t;
}

MappedTensor File::view(std::string_view name) const {
  const Entry& e = entry(name);
  const std::byte* data = buffer_ + e.begin;
  MG_CHECK(reinterpret_cast<uintptr_t>(data) % size_of(e.dtype) == 0,
           "tensor '{}' in {} is not aligned to its {}-byte elements, so it cannot be viewed in place; read() it "
           "instead",
           name, path_, size_of(e.dtype));
  MappedTensor m;
  m.dtype = e.dtype;
  m.shape = e.shape;
  // The deleter owns a reference to the mapping: it is unmapped after the last view goes away.
  m.storage = std::make_shared<Storage>(const_cast<std::byte*>(data), e.nbytes(), Device::cpu(),
                                        [mapping = mapping_](void*, size_t) {});
  return m;
}

uint64_t File::checksum() const { return checksum_of(mapping_->addr, mapping_->size); }

uint64_t checksum_of(const void* data, size_t n) { return XXH3_64bits(data, n); }

// ---- writer --------------------------------------------------------------------------------------

uint64_t write(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
               const Metadata& metadata) {
  std::set<std::string_view> seen;
  for (const auto& [name, t] : tensors) {
    MG_CHECK(name != "__metadata__",
             "cannot write safetensors file '{}': '__metadata__' is reserved, rename the tensor", path);
    MG_CHECK(t.defined(), "cannot write safetensors file '{}': tensor '{}' is undefined", path, name);
    MG_CHECK(seen.insert(name).second, "cannot write safetensors file '{}': tensor name '{}' appears twice", path,
             name);
  }

  // Note [Tensor order].
  std::vector<const std::pair<std::string, Tensor>*> order;
  for (const auto& item : tensors) order.push_back(&item);
  std::sort(order.begin(), order.end(), [](const auto* a, const auto* b) {
    int ra = python_dtype_rank(a->second.dtype()), rb = python_dtype_rank(b->second.dtype());
    return ra != rb ? ra > rb : a->first < b->first;
  });

  // Compact JSON as the Python library writes it (serde_json): no spaces, fields in this order.
  std::vector<std::string> fields;
  if (!metadata.empty()) {
    std::vector<std::string> items;
    for (const auto& [key, value] : metadata)
      items.push_back(fmt::format("{}:{}", quoted(path, key), quoted(path, value)));
    fields.push_back(fmt::format("\"__metadata__\":{{{}}}", fmt::join(items, ",")));
  }
  uint64_t offset = 0;
  for (const auto* item : order) {
    const Tensor& t = item->second;
    fields.push_back(fmt::format("{}:{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{},{}]}}",
                                 quoted(path, item->first), safetensors_name(t.dtype()), fmt::join(t.shape(), ","),
                                 offset, offset + t.nbytes()));
    offset += t.nbytes();
  }
  std::string header = fmt::format("{{{}}}", fmt::join(fields, ","));
  header.append((8 - header.size() % 8) % 8, ' ');

  TempFile tmp{path + ".tmp"};
  std::unique_ptr<XXH3_state_t, XXH_errorcode (*)(XXH3_state_t*)> hash(XXH3_createState(), XXH3_freeState);
  MG_CHECK(hash && XXH3_64bits_reset(hash.get()) == XXH_OK, "cannot write '{}': out of memory for its checksum", path);
  auto put = [&](int fd, const void* data, size_t n) {
    XXH3_64bits_update(hash.get(), data, n);
    write_all(fd, data, n, tmp.path);
  };
  {
    Fd fd(::open(tmp.path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    MG_CHECK(fd.fd >= 0, "cannot create '{}': {}; check that the directory exists and is writable", tmp.path,
             errno_message(errno));
    uint8_t len_bytes[8];
    for (int i = 0; i < 8; ++i) len_bytes[i] = uint8_t(uint64_t(header.size()) >> (8 * i));
    put(fd.fd, len_bytes, 8);
    put(fd.fd, header.data(), header.size());
    for (const auto* item : order) {
      const Tensor& t = item->second;
      if (t.numel() == 0) continue;
      Tensor host = t.device().is_host() ? t : t.to(Device::cpu());
      put(fd.fd, host.raw_data(), host.nbytes());
    }
    MG_CHECK(::fsync(fd.fd) == 0, "cannot flush '{}' to disk: {}; check free disk space", tmp.path,
             errno_message(errno));
    const int closed = ::close(fd.fd);
    fd.fd = -1;
    MG_CHECK(closed == 0, "cannot close '{}': {}; check free disk space", tmp.path, errno_message(errno));
  }
  MG_CHECK(::rename(tmp.path.c_str(), path.c_str()) == 0, "cannot rename '{}' to '{}': {}; check write permission",
           tmp.path, path, errno_message(errno));
  tmp.committed = true;

  // Make the rename itself durable.
  std::filesystem::path dir = std::filesystem::path(path).parent_path();
  Fd dir_fd(::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  MG_CHECK(dir_fd.fd >= 0 && ::fsync(dir_fd.fd) == 0, "wrote '{}' but cannot sync its directory: {}", path,
           errno_message(errno));
  return XXH3_64bits_digest(hash.get());
}

}  // namespace megatron::safetensors
