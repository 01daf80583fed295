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

/// Note [Bounded reads]: the unit in which files are copied, converted and checksummed.
constexpr size_t kChunkBytes = size_t(16) << 20;

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
  // Note [Bounded reads]: a chunk at a time, its pages dropped once converted.
  const size_t in = size_of(e.dtype), out = size_of(t.dtype()), n = size_t(t.numel());
  const size_t step = std::max<size_t>(1, kChunkBytes / in);
  auto* dst = static_cast<std::byte*>(t.raw_data());
  for (size_t i = 0; i < n; i += step) {
    const size_t count = std::min(step, n - i);
    convert_elements(buffer_ + e.begin + i * in, e.dtype, dst + i * out, t.dtype(), count);
    release(e.begin + i * in, e.begin + (i + count) * in);
  }
  return t;
}

void File::release(uint64_t begin, uint64_t end) const {
  static const uintptr_t page = uintptr_t(::sysconf(_SC_PAGESIZE));
  const uintptr_t lo = (reinterpret_cast<uintptr_t>(buffer_ + begin) + page - 1) / page * page;
  const uintptr_t hi = reinterpret_cast<uintptr_t>(buffer_ + end) / page * page;
  if (lo < hi) ::madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);  // advisory: an error changes nothing
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

uint64_t File::checksum() const {
  std::unique_ptr<XXH3_state_t, XXH_errorcode (*)(XXH3_state_t*)> hash(XXH3_createState(), XXH3_freeState);
  MG_CHECK(hash && XXH3_64bits_reset(hash.get()) == XXH_OK, "cannot checksum '{}': out of memory", path_);
  const auto* base = static_cast<const std::byte*>(mapping_->addr);
  for (size_t at = 0; at < mapping_->size; at += kChunkBytes) {  // Note [Bounded reads]
    const size_t n = std::min(kChunkBytes, mapping_->size - at);
    XXH3_64bits_update(hash.get(), base + at, n);
    ::madvise(const_cast<std::byte*>(base + at), n, MADV_DONTNEED);  // chunks start on page boundaries
  }
  return XXH3_64bits_digest(hash.get());
}

uint64_t checksum_of(const void* data, size_t n) { return XXH3_64bits(data, n); }

// ---- writer --------------------------------------------------------------------------------------

struct Writer::Impl {
  struct Slot {
    const Spec* spec = nullptr;
    uint64_t begin = 0, end = 0;  // file offsets
    bool written = false;
  };
  TempFile tmp;
  std::string path;
  int fd = -1;
  std::map<std::string, Slot, std::less<>> slots;
  std::unique_ptr<XXH3_state_t, XXH_errorcode (*)(XXH3_state_t*)> hash{XXH3_createState(), XXH3_freeState};
  uint64_t hashed_to = 0;  // the checksum covers the file's bytes [0, hashed_to)
  bool in_order = true;
  std::vector<std::byte> bounce;

  ~Impl() {
    if (fd >= 0) ::close(fd);
  }
  // Writes n bytes at file offset `at`, adding them to the checksum when they continue it.
  void put_bytes(uint64_t at, const void* data, size_t n) {
    if (in_order && at == hashed_to) {
      XXH3_64bits_update(hash.get(), data, n);
      hashed_to += n;
    } else {
      in_order = false;
    }
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      ssize_t w = ::pwrite(fd, p, std::min<size_t>(n, size_t(1) << 30), off_t(at));
      if (w < 0 && errno == EINTR) continue;
      MG_CHECK(w > 0, "cannot write '{}': {}; check free disk space and write permission", tmp.path,
               errno_message(w < 0 ? errno : EIO));
      p += w, at += uint64_t(w), n -= size_t(w);
    }
  }
};

Writer::Writer(std::string path, const std::vector<Spec>& tensors, const Metadata& metadata)
    : impl_(std::make_unique<Impl>()) {
  impl_->tmp.path = path + ".tmp";
  impl_->path = path;
  std::set<std::string_view> seen;
  for (const Spec& t : tensors) {
    MG_CHECK(t.name != "__metadata__",
             "cannot write safetensors file '{}': '__metadata__' is reserved, rename the tensor", path);
    MG_CHECK(seen.insert(t.name).second, "cannot write safetensors file '{}': tensor name '{}' appears twice", path,
             t.name);
  }
  // Note [Tensor order].
  order_ = tensors;
  std::sort(order_.begin(), order_.end(), [](const Spec& a, const Spec& b) {
    int ra = python_dtype_rank(a.dtype), rb = python_dtype_rank(b.dtype);
    return ra != rb ? ra > rb : a.name < b.name;
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
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const Spec& t : order_) {
    const uint64_t n = uint64_t(shape_numel(t.shape)) * size_of(t.dtype);
    fields.push_back(fmt::format("{}:{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{},{}]}}", quoted(path, t.name),
                                 safetensors_name(t.dtype), fmt::join(t.shape, ","), offset, offset + n));
    ranges.emplace_back(offset, offset + n);
    offset += n;
  }
  std::string header = fmt::format("{{{}}}", fmt::join(fields, ","));
  header.append((8 - header.size() % 8) % 8, ' ');
  const uint64_t data_start = 8 + header.size();
  for (size_t i = 0; i < order_.size(); ++i) {
    impl_->slots[order_[i].name] = {&order_[i], data_start + ranges[i].first, data_start + ranges[i].second, false};
  }

  MG_CHECK(impl_->hash && XXH3_64bits_reset(impl_->hash.get()) == XXH_OK,
           "cannot write '{}': out of memory for its checksum", path);
  impl_->fd = ::open(impl_->tmp.path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  MG_CHECK(impl_->fd >= 0, "cannot create '{}': {}; check that the directory exists and is writable", impl_->tmp.path,
           errno_message(errno));
  uint8_t len_bytes[8];
  for (int i = 0; i < 8; ++i) len_bytes[i] = uint8_t(uint64_t(header.size()) >> (8 * i));
  impl_->put_bytes(0, len_bytes, 8);
  impl_->put_bytes(8, header.data(), header.size());
}

Writer::~Writer() = default;

size_t Writer::put(const std::string& name, const std::vector<Tensor>& parts, int64_t zero_rows) {
  return put(name, parts.size(), [&](size_t k) { return parts[k]; }, zero_rows);
}

size_t Writer::put(const std::string& name, size_t count, const std::function<Tensor(size_t)>& make_part,
                   int64_t zero_rows) {
  Impl& w = *impl_;
  auto it = w.slots.find(name);
  MG_CHECK(it != w.slots.end(), "cannot write safetensors file '{}': tensor '{}' was not declared", w.path, name);
  Impl::Slot& slot = it->second;
  MG_ASSERT(!slot.written, "safetensors file '{}': tensor '{}' written twice", w.path, name);
  const Spec& spec = *slot.spec;
  const int64_t numel = shape_numel(spec.shape);
  const int64_t row = spec.shape.empty() || spec.shape[0] == 0 ? numel : numel / spec.shape[0];
  MG_ASSERT(zero_rows >= 0, "safetensors file '{}': tensor '{}' given {} zero rows", w.path, name, zero_rows);
  const size_t out = size_of(spec.dtype);
  const uint64_t parts_end = slot.end - uint64_t(zero_rows * row) * out;
  uint64_t at = slot.begin;
  for (size_t k = 0; k < count; ++k) {
    const Tensor part = make_part(k);
    MG_CHECK(part.defined(), "cannot write safetensors file '{}': tensor '{}' is undefined", w.path, name);
    if (part.numel() == 0) continue;
    MG_ASSERT(at + uint64_t(part.numel()) * out <= parts_end,
              "safetensors file '{}': tensor '{}' declared {} but given more elements", w.path, name,
              shape_str(spec.shape));
    Tensor host = part.device().is_host() ? part : part.to(Device::cpu());
    const auto* src = static_cast<const std::byte*>(host.raw_data());
    const size_t in = size_of(host.dtype()), n = size_t(host.numel());
    if (host.dtype() == spec.dtype) {
      w.put_bytes(at, src, n * in);
      at += n * in;
      continue;
    }
    const size_t step = std::max<size_t>(1, kChunkBytes / out);
    w.bounce.resize(std::min(n, step) * out);
    for (size_t i = 0; i < n; i += step) {
      const size_t count_now = std::min(step, n - i);
      convert_elements(src + i * in, host.dtype(), w.bounce.data(), spec.dtype, count_now);
      w.put_bytes(at, w.bounce.data(), count_now * out);
      at += count_now * out;
    }
  }
  MG_ASSERT(at == parts_end, "safetensors file '{}': tensor '{}' declared {} but given {} of its {} bytes", w.path,
            name, shape_str(spec.shape), at - slot.begin, slot.end - slot.begin);
  for (uint64_t left = uint64_t(zero_rows * row) * out; left > 0;) {
    const size_t n = size_t(std::min<uint64_t>(left, kChunkBytes));
    w.bounce.assign(n, std::byte{0});
    w.put_bytes(at, w.bounce.data(), n);
    at += n, left -= n;
  }
  std::vector<std::byte>().swap(w.bounce);
  slot.written = true;
  return size_t(slot.end - slot.begin);
}

uint64_t Writer::commit() {
  Impl& w = *impl_;
  uint64_t size = 8;
  for (const auto& [name, slot] : w.slots) {
    MG_ASSERT(slot.written, "safetensors file '{}': tensor '{}' was declared but never written", w.path, name);
    size = std::max(size, slot.end);
  }
  if (w.slots.empty()) size = w.hashed_to;
  if (!w.in_order || w.hashed_to != size) {  // written out of order: checksum the file as it is on disk
    MG_CHECK(XXH3_64bits_reset(w.hash.get()) == XXH_OK, "cannot checksum '{}'", w.tmp.path);
    Fd in(::open(w.tmp.path.c_str(), O_RDONLY | O_CLOEXEC));
    MG_CHECK(in.fd >= 0, "cannot read back '{}': {}", w.tmp.path, errno_message(errno));
    std::vector<std::byte> buf(kChunkBytes);
    for (uint64_t at = 0; at < size;) {
      ssize_t r = ::pread(in.fd, buf.data(), size_t(std::min<uint64_t>(buf.size(), size - at)), off_t(at));
      if (r < 0 && errno == EINTR) continue;
      MG_CHECK(r > 0, "cannot read back '{}': {}", w.tmp.path, errno_message(r < 0 ? errno : EIO));
      XXH3_64bits_update(w.hash.get(), buf.data(), size_t(r));
      at += uint64_t(r);
    }
  }
  MG_CHECK(::fsync(w.fd) == 0, "cannot flush '{}' to disk: {}; check free disk space", w.tmp.path, errno_message(errno));
  const int closed = ::close(w.fd);
  w.fd = -1;
  MG_CHECK(closed == 0, "cannot close '{}': {}; check free disk space", w.tmp.path, errno_message(errno));
  MG_CHECK(::rename(w.tmp.path.c_str(), w.path.c_str()) == 0, "cannot rename '{}' to '{}': {}; check write permission",
           w.tmp.path, w.path, errno_message(errno));
  w.tmp.committed = true;

  // Make the rename itself durable.
  std::filesystem::path dir = std::filesystem::path(w.path).parent_path();
  Fd dir_fd(::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  MG_CHECK(dir_fd.fd >= 0 && ::fsync(dir_fd.fd) == 0, "wrote '{}' but cannot sync its directory: {}", w.path,
           errno_message(errno));
  return XXH3_64bits_digest(w.hash.get());
}

uint64_t write(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
               const Metadata& metadata) {
  std::vector<Writer::Spec> specs;
  std::map<std::string_view, const Tensor*> by_name;
  for (const auto& [name, t] : tensors) {
    MG_CHECK(t.defined(), "cannot write safetensors file '{}': tensor '{}' is undefined", path, name);
    specs.push_back({name, t.dtype(), t.shape()});
    by_name[name] = &t;
  }
  Writer writer(path, specs, metadata);
  for (const Writer::Spec& s : writer.order()) writer.put(s.name, {*by_name.at(s.name)});
  return writer.commit();
}

}  // namespace megatron::safetensors
