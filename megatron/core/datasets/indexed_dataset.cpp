// Reader, writer and builder of Megatron's .idx/.bin pair (see indexed_dataset.h for the layout).
#include "megatron/core/datasets/indexed_dataset.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#include "megatron/runtime/check.h"

namespace megatron {

namespace {

// Calls f(T{}) with T the C++ element type of an index dtype.
template <typename F>
void visit_index_dtype(IndexDType dtype, F&& f) {
  switch (dtype) {
    case IndexDType::UInt8:
      return f(uint8_t{});
    case IndexDType::Int8:
      return f(int8_t{});
    case IndexDType::Int16:
      return f(int16_t{});
    case IndexDType::Int32:
      return f(int32_t{});
    case IndexDType::Int64:
      return f(int64_t{});
    case IndexDType::Float64:
      return f(double{});
    case IndexDType::Float32:
      return f(float{});
    case IndexDType::UInt16:
      return f(uint16_t{});
  }
}

constexpr std::array<char, 9> kMagic = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
constexpr size_t kHeaderSize = 34;  // magic 9 + version 8 + dtype 1 + S 8 + D 8

template <typename T>
T load(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

bool valid_code(uint8_t code) { return code >= 1 && code <= 8; }

/// Converts `n` elements of the file dtype at `src` to int64, appending to `out`.
void decode_tokens(IndexDType dtype, const std::byte* src, size_t n, std::vector<int64_t>& out) {
  size_t base = out.size();
  out.resize(base + n);
  int64_t* dst = out.data() + base;
  auto convert = [&]<typename T>(T) {
    if constexpr (std::is_floating_point_v<T>) {
      for (size_t k = 0; k < n; ++k) {  // NaN, infinities and negatives become -1 (refused by read_into)
        const T x = load<T>(src + k * sizeof(T));
        dst[k] = x >= 0 && x < T(9.0e18) ? static_cast<int64_t>(x) : -1;
      }
    } else {
      for (size_t k = 0; k < n; ++k) dst[k] = static_cast<int64_t>(load<T>(src + k * sizeof(T)));
    }
  };
  visit_index_dtype(dtype, convert);
}

bool is_unsigned(IndexDType dtype) { return dtype == IndexDType::UInt8 || dtype == IndexDType::UInt16; }

/// Converts ids to the file dtype into `out` (resized); an id the dtype cannot hold is an error.
void encode_tokens(IndexDType dtype, std::span<const int64_t> ids, std::vector<std::byte>& out,
                   const std::string& path) {
  out.resize(ids.size() * index_dtype_size(dtype));
  auto convert = [&]<typename T>(T) {
    for (size_t k = 0; k < ids.size(); ++k) {
      if constexpr (std::is_integral_v<T>) {
        MG_CHECK(ids[k] >= int64_t(std::numeric_limits<T>::min()) && ids[k] <= int64_t(std::numeric_limits<T>::max()),
                 "{}: token id {} does not fit the dataset dtype {}", path, ids[k], to_string(dtype));
      }
      T v = static_cast<T>(ids[k]);
      std::memcpy(out.data() + k * sizeof(T), &v, sizeof(T));
    }
  };
  visit_index_dtype(dtype, convert);
}

/// A read-only mapping of a whole file (nothing mapped for an empty file).
struct FileMap {
  const std::byte* data = nullptr;
  size_t size = 0;

  static FileMap open(const std::string& path, const char* what) {
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    MG_CHECK(fd >= 0, "cannot open {} {}: {}", what, path, std::strerror(errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      MG_CHECK(false, "{} {} is not a regular file", what, path);
    }
    FileMap m;
    m.size = size_t(st.st_size);
    if (m.size > 0) {
      void* p = ::mmap(nullptr, m.size, PROT_READ, MAP_SHARED, fd, 0);
      int err = errno;
      ::close(fd);
      MG_CHECK(p != MAP_FAILED, "cannot memory-map {} {}: {}", what, path, std::strerror(err));
      m.data = static_cast<const std::byte*>(p);
    } else {
      ::close(fd);
    }
    return m;
  }
  static void unmap(const std::byte* data, size_t size) {
    if (data != nullptr) ::munmap(const_cast<std::byte*>(data), size);
  }
};

bool file_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

}  // namespace

size_t index_dtype_size(IndexDType dtype) {
  switch (dtype) {
    case IndexDType::UInt8:
    case IndexDType::Int8:
      return 1;
    case IndexDType::Int16:
    case IndexDType::UInt16:
      return 2;
    case IndexDType::Int32:
    case IndexDType::Float32:
      return 4;
    case IndexDType::Int64:
    case IndexDType::Float64:
      return 8;
  }
  MG_ASSERT(false, "bad IndexDType {}", int(dtype));
  return 0;
}

const char* to_string(IndexDType dtype) {
  switch (dtype) {
    case IndexDType::UInt8:
      return "uint8";
    case IndexDType::Int8:
      return "int8";
    case IndexDType::Int16:
      return "int16";
    case IndexDType::Int32:
      return "int32";
    case IndexDType::Int64:
      return "int64";
    case IndexDType::Float64:
      return "float64";
    case IndexDType::Float32:
      return "float32";
    case IndexDType::UInt16:
      return "uint16";
  }
  return "?";
}

IndexDType optimal_index_dtype(std::optional<int64_t> vocab_size) {
  return vocab_size && *vocab_size < 65500 ? IndexDType::UInt16 : IndexDType::Int32;
}

std::string get_idx_path(const std::string& path_prefix) { return path_prefix + ".idx"; }
std::string get_bin_path(const std::string& path_prefix) { return path_prefix + ".bin"; }

// ---- writing the index ---------------------------------------------------------------------------

void write_index_file(const std::string& idx_path, IndexDType dtype, std::span<const int32_t> sequence_lengths,
                      std::span<const int64_t> document_indices,
                      std::optional<std::span<const int8_t>> sequence_modes) {
  MG_ASSERT(!sequence_modes || sequence_modes->size() == sequence_lengths.size(), "modes/lengths size mismatch");
  std::FILE* f = std::fopen(idx_path.c_str(), "wb");
  MG_CHECK(f != nullptr, "cannot create index file {}: {}", idx_path, std::strerror(errno));
  std::vector<char> buffer(1 << 22);
  std::setvbuf(f, buffer.data(), _IOFBF, buffer.size());
  bool ok = true;
  auto put = [&](const void* p, size_t n) { ok = ok && (n == 0 || std::fwrite(p, 1, n, f) == n); };

  put(kMagic.data(), kMagic.size());
  const uint64_t version = 1;
  put(&version, 8);
  const uint8_t code = uint8_t(dtype);
  put(&code, 1);
  const uint64_t s = sequence_lengths.size(), d = document_indices.size();
  put(&s, 8);
  put(&d, 8);
  put(sequence_lengths.data(), sequence_lengths.size_bytes());
  // Pointers are the running byte sums, computed in chunks rather than as a second S-sized array.
  const int64_t itemsize = int64_t(index_dtype_size(dtype));
  std::vector<int64_t> chunk(1 << 16);
  int64_t ptr = 0;
  for (size_t beg = 0; beg < sequence_lengths.size(); beg += chunk.size()) {
    size_t n = std::min(chunk.size(), sequence_lengths.size() - beg);
    for (size_t k = 0; k < n; ++k) {
      chunk[k] = ptr;
      ptr += int64_t(sequence_lengths[beg + k]) * itemsize;
    }
    put(chunk.data(), n * sizeof(int64_t));
  }
  put(document_indices.data(), document_indices.size_bytes());
  if (sequence_modes) put(sequence_modes->data(), sequence_modes->size_bytes());
  int err = ok ? 0 : errno;
  if (std::fclose(f) != 0 && ok) {
    ok = false;
    err = errno;
  }
  MG_CHECK(ok, "error writing index file {}: {}", idx_path, std::strerror(err));
}

// ---- IndexedDataset --------------------------------------------------------------------------------

IndexedDataset::IndexedDataset(std::string path_prefix, bool multimodal)
    : path_prefix_(std::move(path_prefix)), multimodal_(multimodal) {
  const std::string idx_path = get_idx_path(path_prefix_), bin_path = get_bin_path(path_prefix_);
  MG_CHECK(file_exists(idx_path), "indexed dataset {}: index file {} not found (expected {}.idx and {}.bin)",
           path_prefix_, idx_path, path_prefix_, path_prefix_);
  MG_CHECK(file_exists(bin_path), "indexed dataset {}: data file {} not found (expected {}.idx and {}.bin)",
           path_prefix_, bin_path, path_prefix_, path_prefix_);
  load_index(idx_path);
  map_bin(bin_path);
}

IndexedDataset::~IndexedDataset() { release(); }

IndexedDataset::IndexedDataset(IndexedDataset&& o) noexcept
    : path_prefix_(std::move(o.path_prefix_)),
      multimodal_(o.multimodal_),
      dtype_(o.dtype_),
      lengths_(std::move(o.lengths_)),
      pointers_(std::move(o.pointers_)),
      doc_indices_(std::move(o.doc_indices_)),
      modes_(std::move(o.modes_)),
      num_tokens_(o.num_tokens_),
      bin_(std::exchange(o.bin_, nullptr)),
      bin_size_(std::exchange(o.bin_size_, 0)) {}

IndexedDataset& IndexedDataset::operator=(IndexedDataset&& o) noexcept {
  if (this != &o) {
    release();
    path_prefix_ = std::move(o.path_prefix_);
    multimodal_ = o.multimodal_;
    dtype_ = o.dtype_;
    lengths_ = std::move(o.lengths_);
    pointers_ = std::move(o.pointers_);
    doc_indices_ = std::move(o.doc_indices_);
    modes_ = std::move(o.modes_);
    num_tokens_ = o.num_tokens_;
    bin_ = std::exchange(o.bin_, nullptr);
    bin_size_ = std::exchange(o.bin_size_, 0);
  }
  return *this;
}

void IndexedDataset::release() {
  FileMap::unmap(bin_, bin_size_);
  bin_ = nullptr;
  bin_size_ = 0;
}

bool IndexedDataset::exists(const std::string& path_prefix) {
  return file_exists(get_idx_path(path_prefix)) && file_exists(get_bin_path(path_prefix));
}

void IndexedDataset::load_index(const std::string& idx_path) {
  FileMap m = FileMap::open(idx_path, "index file");
  struct Unmap {
    FileMap& m;
    ~Unmap() { FileMap::unmap(m.data, m.size); }
  } unmap{m};

  MG_CHECK(m.size >= kHeaderSize, "index file {} is truncated: {} bytes, the header alone is {}", idx_path, m.size,
           kHeaderSize);
  MG_CHECK(std::memcmp(m.data, kMagic.data(), kMagic.size()) == 0,
           "index file {} has a bad magic: not a Megatron MMIDIDX index", idx_path);
  const uint64_t version = load<uint64_t>(m.data + 9);
  MG_CHECK(version == 1, "index file {} has unsupported version {} (only version 1 is supported)", idx_path, version);
  const uint8_t code = load<uint8_t>(m.data + 17);
  MG_CHECK(valid_code(code), "index file {} has an unknown dtype code {} (valid codes are 1..8)", idx_path, code);
  dtype_ = IndexDType(code);
  const uint64_t s = load<uint64_t>(m.data + 18);
  const uint64_t d = load<uint64_t>(m.data + 26);

  // Sizes checked against the file before any multiplication can overflow.
  const uint64_t body = m.size - kHeaderSize;
  const uint64_t per_sequence = multimodal_ ? 13 : 12;
  MG_CHECK(s <= body / per_sequence && d <= body / 8 && s * per_sequence + d * 8 <= body,
           "index file {} is truncated: {} bytes cannot hold {} sequences and {} document indices (needs {})", idx_path,
           m.size, s, d,
           (s <= (1ull << 58) && d <= (1ull << 58)) ? fmt::format("{} bytes", kHeaderSize + s * per_sequence + d * 8)
                                                    : std::string("more than the file"));
  MG_CHECK(d >= 1, "index file {} has a document count of 0 (it must be at least 1: the leading 0)", idx_path);

  const std::byte* p = m.data + kHeaderSize;
  auto take = [&p]<typename T>(std::vector<T>& v, size_t n) {
    v.resize(n);
    if (n > 0) std::memcpy(v.data(), p, n * sizeof(T));
    p += n * sizeof(T);
  };
  take(lengths_, s);
  take(pointers_, s);
  take(doc_indices_, d);
  if (multimodal_) take(modes_, s);

  MG_CHECK(doc_indices_[0] == 0, "index file {}: document indices must start at 0, found {}", idx_path,
           doc_indices_[0]);
  for (size_t k = 1; k < d; ++k) {
    MG_CHECK(doc_indices_[k] >= doc_indices_[k - 1],
             "index file {}: document indices are not monotone (entry {} is {} after {})", idx_path, k, doc_indices_[k],
             doc_indices_[k - 1]);
  }
  MG_CHECK(uint64_t(doc_indices_[d - 1]) == s,
           "index file {}: the last document index is {} but there are {} sequences", idx_path, doc_indices_[d - 1], s);
}

void IndexedDataset::map_bin(const std::string& bin_path) {
  FileMap m = FileMap::open(bin_path, "data file");
  struct Unmap {  // the destructor does not run for a constructor that throws
    FileMap* m;
    ~Unmap() {
      if (m != nullptr) FileMap::unmap(m->data, m->size);
    }
  } unmap{&m};
  // Note [Packed index]: Megatron's builders write the sequences back to back, so sequence k starts
  // where k - 1 ends and the .bin holds exactly their bytes. Checking that (one pass over the index,
  // no read of the .bin) catches a dtype code of another item size, pointers into another sequence
  // and a truncated or padded .bin; a code of the same size but another signedness is caught when a
  // token reads negative (read_into).
  const uint64_t itemsize = index_dtype_size(dtype_);
  const std::string idx_path = get_idx_path(path_prefix_);
  num_tokens_ = 0;
  uint64_t end = 0;  // where the sequences so far end
  for (size_t k = 0; k < lengths_.size(); ++k) {
    const int32_t len = lengths_[k];
    const int64_t ptr = pointers_[k];
    MG_CHECK(len >= 0, "index file {}: sequence {} has a negative length {}", idx_path, k, len);
    MG_CHECK(ptr >= 0, "index file {}: sequence {} has a negative pointer {}", idx_path, k, ptr);
    MG_CHECK(uint64_t(ptr) <= m.size && uint64_t(len) * itemsize <= m.size - uint64_t(ptr),
             "data file {} is too short for its index of {} tokens: sequence {} spans bytes [{}, {}) of {}", bin_path,
             to_string(dtype_), k, ptr, ptr + int64_t(len) * int64_t(itemsize), m.size);
    MG_CHECK(uint64_t(ptr) == end,
             "index file {}: sequence {} starts at byte {} but the sequences before it end at byte {}: the index does "
             "not describe a packed .bin of {} tokens (dtype code {}); the index is corrupt or its dtype code is wrong",
             idx_path, k, ptr, end, to_string(dtype_), int(dtype_));
    end += uint64_t(len) * itemsize;
    num_tokens_ += len;
  }
  MG_CHECK(end == m.size,
           "data file {} has {} bytes but its index covers {} ({} {} tokens): the .bin is truncated, padded or not "
           "this index's",
           bin_path, m.size, end, num_tokens_, to_string(dtype_));
  unmap.m = nullptr;
  bin_ = m.data;
  bin_size_ = m.size;
}

std::vector<int64_t> IndexedDataset::get(size_t i) const { return get(i, 0, std::nullopt); }

std::vector<int64_t> IndexedDataset::get(size_t i, int64_t offset, std::optional<int64_t> length) const {
  MG_CHECK(i < size(), "indexed dataset {}: sequence {} out of range (it has {})", path_prefix_, i, size());
  std::vector<int64_t> out;
  read_into(i, offset, length.value_or(int64_t(lengths_[i]) - offset), out);
  return out;
}

void IndexedDataset::read_into(size_t i, int64_t offset, int64_t length, std::vector<int64_t>& out) const {
  MG_CHECK(i < size(), "indexed dataset {}: sequence {} out of range (it has {})", path_prefix_, i, size());
  const int64_t len = lengths_[i];
  MG_CHECK(offset >= 0 && offset <= len && length >= 0 && length <= len - offset,
           "indexed dataset {}: tokens [{}, {}) requested from sequence {} of length {}", path_prefix_, offset,
           offset + length, i, len);
  const size_t itemsize = index_dtype_size(dtype_);
  const size_t first = out.size();
  decode_tokens(dtype_, bin_ + pointers_[i] + offset * int64_t(itemsize), size_t(length), out);
  if (is_unsigned(dtype_)) return;
  for (size_t k = first; k < out.size(); ++k) {  // Note [Packed index]: a code of the wrong signedness
    MG_CHECK(out[k] >= 0,
             "indexed dataset {}: sequence {} holds a negative token at position {}: the .bin does not hold {} token "
             "ids (is the dtype code {} of {} right?)",
             path_prefix_, i, offset + int64_t(k - first), to_string(dtype_), int(dtype_), get_idx_path(path_prefix_));
  }
}

std::span<const std::byte> IndexedDataset::raw(size_t i) const {
  MG_CHECK(i < size(), "indexed dataset {}: sequence {} out of range (it has {})", path_prefix_, i, size());
  if (lengths_[i] == 0) return {};
  return {bin_ + pointers_[i], size_t(lengths_[i]) * index_dtype_size(dtype_)};
}

void IndexedDataset::require_nonempty(const std::string& purpose) const {
  MG_CHECK(size() > 0, "indexed dataset {} is empty (no sequences in {}); {} needs at least one sequence", path_prefix_,
           get_idx_path(path_prefix_), purpose);
}

// ---- IndexedDatasetBuilder -------------------------------------------------------------------------

IndexedDatasetBuilder::IndexedDatasetBuilder(std::string bin_path, IndexDType dtype, bool multimodal)
    : bin_path_(std::move(bin_path)), dtype_(dtype), multimodal_(multimodal) {
  MG_CHECK(valid_code(uint8_t(dtype)), "IndexedDatasetBuilder {}: bad dtype code {}", bin_path_, int(dtype));
  file_ = std::fopen(bin_path_.c_str(), "wb");
  MG_CHECK(file_ != nullptr, "cannot create data file {}: {}", bin_path_, std::strerror(errno));
}

IndexedDatasetBuilder::~IndexedDatasetBuilder() {
  if (file_ != nullptr) std::fclose(file_);
}

void IndexedDatasetBuilder::write_bytes(const void* data, size_t n) {
  MG_CHECK(file_ != nullptr, "IndexedDatasetBuilder {}: already finalized", bin_path_);
  if (n == 0) return;
  MG_CHECK(std::fwrite(data, 1, n, file_) == n, "error writing data file {}: {}", bin_path_, std::strerror(errno));
}

void IndexedDatasetBuilder::add_item(std::span<const int64_t> ids, int8_t mode) {
  MG_CHECK(ids.size() <= size_t(std::numeric_limits<int32_t>::max()),
           "{}: a sequence of {} tokens does not fit the int32 length field", bin_path_, ids.size());
  encode_tokens(dtype_, ids, scratch_, bin_path_);
  write_bytes(scratch_.data(), scratch_.size());
  lengths_.push_back(int32_t(ids.size()));
  if (multimodal_) modes_.push_back(mode);
}

void IndexedDatasetBuilder::add_document(std::span<const int64_t> ids, std::span<const int32_t> lengths,
                                         std::span<const int8_t> modes) {
  MG_CHECK(modes.empty() || modes.size() == lengths.size(), "{}: {} modes given for {} sequences", bin_path_,
           modes.size(), lengths.size());
  size_t pos = 0;
  for (size_t k = 0; k < lengths.size(); ++k) {
    MG_CHECK(lengths[k] >= 0 && size_t(lengths[k]) <= ids.size() - pos,
             "{}: sequence lengths of a document exceed its {} tokens", bin_path_, ids.size());
    add_item(ids.subspan(pos, size_t(lengths[k])), modes.empty() ? int8_t(0) : modes[k]);
    pos += size_t(lengths[k]);
  }
  MG_CHECK(pos == ids.size(), "{}: sequence lengths of a document sum to {} but it has {} tokens", bin_path_, pos,
           ids.size());
  end_document();
}

void IndexedDatasetBuilder::end_document() { doc_indices_.push_back(int64_t(lengths_.size())); }

void IndexedDatasetBuilder::add_index(const std::string& path_prefix) {
  IndexedDataset other(path_prefix, multimodal_);
  MG_CHECK(other.dtype() == dtype_, "cannot merge {} (dtype {}) into {} (dtype {}): the dtypes differ", path_prefix,
           to_string(other.dtype()), bin_path_, to_string(dtype_));
  // The merged pointers are recomputed as running sums: every opened dataset is packed so (Note [Packed index]).
  const auto lengths = other.sequence_lengths();
  const int64_t base = int64_t(lengths_.size());
  lengths_.insert(lengths_.end(), lengths.begin(), lengths.end());
  for (size_t k = 1; k < other.document_indices().size(); ++k)
    doc_indices_.push_back(base + other.document_indices()[k]);
  if (multimodal_) modes_.insert(modes_.end(), other.sequence_modes().begin(), other.sequence_modes().end());
  // The whole .bin, as Megatron's shutil.copyfileobj (checked above to be exactly the sequences).
  const std::byte* data = other.bin_data();
  constexpr size_t kChunk = size_t(1) << 26;
  for (size_t off = 0; off < other.bin_bytes(); off += kChunk) {
    write_bytes(data + off, std::min(kChunk, other.bin_bytes() - off));
  }
}

void IndexedDatasetBuilder::finalize(const std::string& idx_path) {
  MG_CHECK(file_ != nullptr, "IndexedDatasetBuilder {}: already finalized", bin_path_);
  std::FILE* f = std::exchange(file_, nullptr);
  MG_CHECK(std::fclose(f) == 0, "error closing data file {}: {}", bin_path_, std::strerror(errno));
  std::optional<std::span<const int8_t>> modes;
  if (multimodal_) modes = std::span<const int8_t>(modes_);
  write_index_file(idx_path, dtype_, lengths_, doc_indices_, modes);
}

}  // namespace megatron
