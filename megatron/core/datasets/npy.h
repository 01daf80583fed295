// NPY v1.0 files as numpy.save writes them, for the dataset index cache.
//
// numpy's header is the dict "{'descr': '<i4', 'fortran_order': False, 'shape': (N,), }", then
// (numpy >= 1.24) 21 - len(repr(shape[0])) spaces of room to grow the first axis in place, then
// spaces and a newline so that magic + header length + header is a multiple of 64 bytes. We write
// exactly that, so our cache files are byte-identical to Megatron's; we read any v1/v2/v3 header
// with a little-endian integer dtype and C order, and reject anything else with a clear error.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace megatron {

/// The element types of the index cache files.
enum class NpyDType { Int16, Int32, Int64, UInt32 };

/// numpy's descr: "<i2", "<i4", "<i8", "<u4".
const char* npy_descr(NpyDType dtype);
size_t npy_itemsize(NpyDType dtype);

template <typename T>
constexpr NpyDType npy_dtype_of();
template <>
constexpr NpyDType npy_dtype_of<int16_t>() {
  return NpyDType::Int16;
}
template <>
constexpr NpyDType npy_dtype_of<int32_t>() {
  return NpyDType::Int32;
}
template <>
constexpr NpyDType npy_dtype_of<int64_t>() {
  return NpyDType::Int64;
}
template <>
constexpr NpyDType npy_dtype_of<uint32_t>() {
  return NpyDType::UInt32;
}

/// A loaded .npy array: dtype, shape and the raw little-endian bytes.
struct NpyArray {
  NpyDType dtype = NpyDType::Int32;
  std::vector<int64_t> shape;
  std::vector<std::byte> data;

  int64_t numel() const;
  /// Element i converted to int64 (any of the supported dtypes).
  int64_t at(int64_t i) const;
  /// All elements converted to int64.
  std::vector<int64_t> to_int64() const;
};

/// The full header (magic, version, length, dict, padding, newline) numpy.save writes.
std::string npy_header(NpyDType dtype, std::span<const int64_t> shape);

/// Serialises an array to .npy bytes.
std::string npy_bytes(NpyDType dtype, std::span<const int64_t> shape, const void* data);

/// Writes an array as <path> atomically (temporary file + rename).
void write_npy(const std::string& path, NpyDType dtype, std::span<const int64_t> shape, const void* data);
template <typename T>
void write_npy(const std::string& path, std::span<const T> values, std::span<const int64_t> shape) {
  write_npy(path, npy_dtype_of<T>(), shape, values.data());
}

/// Reads a .npy file; a bad magic, header, dtype or size is a megatron::Error naming the file.
NpyArray read_npy(const std::string& path);
/// Parses .npy bytes (`what` names the source in error messages).
NpyArray parse_npy(const std::string& bytes, const std::string& what);

}  // namespace megatron
