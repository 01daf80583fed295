// Safetensors files: a reader over a read-only memory mapping and an atomic writer.
//
// Format: 8-byte little-endian header length N, N bytes of JSON
//   {"__metadata__": {str: str}, name: {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...}
// padded with spaces, then the data buffer (offsets are relative to its start).
//
// The reader validates the whole header when the file is opened, so every later call works on
// checked entries; each problem is one megatron::Error line naming the file (and the tensor).
// The writer orders tensors as the Python library does (Note [Tensor order] in the .cpp), so every
// tensor it writes is aligned to its element size and a zero-copy view of it is a typed array.
// Writer writes one tensor at a time in any order (the header comes from the declared tensors), so
// a converter never holds more than the tensor in hand; write() is a Writer fed in file order.
// Note [Bounded reads]: the reader copies and checksums in chunks and drops the mapped pages it has
// read (madvise), so reading a tensor adds at most one chunk of file pages to the resident set.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "megatron/runtime/allocator.h"
#include "megatron/runtime/tensor.h"

namespace megatron::safetensors {

/// The free-form string map stored under "__metadata__".
using Metadata = std::map<std::string, std::string>;

/// One tensor's header entry; `begin` and `end` are byte offsets into the data buffer.
struct Entry {
  DType dtype = DType::Float32;
  Shape shape;
  uint64_t begin = 0;
  uint64_t end = 0;
  size_t nbytes() const { return size_t(end - begin); }
};

/// A tensor's bytes inside the mapped file, without a copy. `storage` points at the first byte,
/// is read-only (writing through it faults) and keeps the mapping alive while referenced.
struct MappedTensor {
  DType dtype = DType::Float32;
  Shape shape;
  std::shared_ptr<Storage> storage;

  const void* data() const { return storage->data(); }
  size_t nbytes() const { return storage->nbytes(); }
  /// Typed pointer; the dtype must match T (checked).
  template <typename T>
  const T* data_as() const {
    MG_ASSERT(dtype == dtype_of<T>(), "mapped tensor is {}, accessed as {}", to_string(dtype),
              to_string(dtype_of<T>()));
    return static_cast<const T*>(data());
  }
};

/// An open safetensors file. Opening maps the file and validates the header (throws megatron::Error).
/// Copies share the mapping; tensors read from it are independent of it.
class File {
 public:
  explicit File(std::string path);

  const std::string& path() const { return path_; }
  /// Tensor names in ascending order.
  std::vector<std::string> names() const;
  size_t size() const { return entries_.size(); }
  bool contains(std::string_view name) const { return entries_.find(name) != entries_.end(); }
  /// The header entry of `name` (throws when the file has no such tensor).
  const Entry& entry(std::string_view name) const;
  /// The "__metadata__" map (empty when the file has none).
  const Metadata& metadata() const { return metadata_; }

  /// A new host tensor holding a copy of `name`, converted to `dtype` when given.
  Tensor read(std::string_view name, std::optional<DType> dtype = std::nullopt) const;
  /// Zero-copy access to `name` in the mapping (throws when its bytes are not aligned to its
  /// element size, which only files from other writers can cause; read() works for those).
  MappedTensor view(std::string_view name) const;

  /// The XXH3-64 checksum of the whole file (every byte of the mapping; Note [Checkpoint checksums]
  /// in training/checkpointing.h). Reads the file once, in chunks (Note [Bounded reads]).
  uint64_t checksum() const;
  /// Drops the resident pages of data-buffer bytes [begin, end) from this process (whole pages
  /// inside the range; the file is untouched and a later read faults them back in).
  void release(uint64_t begin, uint64_t end) const;

 private:
  struct Mapping;

  std::string path_;
  std::shared_ptr<const Mapping> mapping_;
  const std::byte* buffer_ = nullptr;  // start of the data buffer inside the mapping
  std::map<std::string, Entry, std::less<>> entries_;
  Metadata metadata_;
};

/// Writes `tensors` (any device; names unique) and `metadata` as a safetensors file at `path`:
/// to `path + ".tmp"`, fsynced, then renamed into place, so `path` is either the old file or the
/// complete new one. Throws megatron::Error naming the file on any I/O failure. Returns the XXH3-64
/// checksum of the bytes written (File::checksum() of the file), computed as they are written.
uint64_t write(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
               const Metadata& metadata = {});

/// A safetensors file written tensor by tensor: the constructor takes every tensor's name, dtype and
/// shape, lays them out as write() does (Note [Tensor order]) and writes the header to `path + ".tmp"`;
/// put() writes one tensor's bytes at its place, in any order; commit() checks that every tensor was
/// written, fsyncs and renames into place. The checksum is computed while writing when the tensors
/// come in file order, else by reading the file back once at commit. Destroyed uncommitted, it
/// removes the temporary file.
class Writer {
 public:
  struct Spec {
    std::string name;
    DType dtype = DType::Float32;
    Shape shape;
  };
  Writer(std::string path, const std::vector<Spec>& tensors, const Metadata& metadata = {});
  ~Writer();
  Writer(const Writer&) = delete;
  Writer& operator=(const Writer&) = delete;

  /// Writes tensor `name` as the concatenation along dim 0 of `parts` (host or device, any dtype:
  /// converted to the declared one in chunks) followed by `zero_rows` rows of zeros. The rows must
  /// add up to the declared shape. Returns the bytes written.
  size_t put(const std::string& name, const std::vector<Tensor>& parts, int64_t zero_rows = 0);
  /// The same with `count` parts made one at a time by part(k) when the writer reaches them (a
  /// transpose written in row blocks), each dropped before the next is made.
  size_t put(const std::string& name, size_t count, const std::function<Tensor(size_t)>& part, int64_t zero_rows = 0);
  /// The tensors in file order (put() in this order checksums as it writes).
  const std::vector<Spec>& order() const { return order_; }
  /// Publishes the file; returns its XXH3-64 checksum.
  uint64_t commit();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::vector<Spec> order_;
};

/// XXH3-64 of `n` bytes (the checksum File::checksum() and write() use).
uint64_t checksum_of(const void* data, size_t n);

}  // namespace megatron::safetensors
