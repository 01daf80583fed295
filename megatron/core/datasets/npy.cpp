// NPY v1.0 writer and reader (numpy/lib/format.py semantics).
#include "megatron/core/datasets/npy.h"

#include <fmt/format.h>

#include <cstring>
#include <string_view>

#include "megatron/core/datasets/utils.h"
#include "megatron/runtime/check.h"

namespace megatron {

namespace {
constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicLen = 6;
constexpr size_t kArrayAlign = 64;
constexpr size_t kGrowthAxisMaxDigits = 21;

std::string shape_repr(std::span<const int64_t> shape) {
  if (shape.size() == 1) return fmt::format("({},)", shape[0]);
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + ")";
}
}  // namespace

const char* npy_descr(NpyDType dtype) {
  switch (dtype) {
    case NpyDType::Int16:
      return "<i2";
    case NpyDType::Int32:
      return "<i4";
    case NpyDType::Int64:
      return "<i8";
    case NpyDType::UInt32:
      return "<u4";
  }
  MG_ASSERT(false, "bad NpyDType");
}

size_t npy_itemsize(NpyDType dtype) {
  switch (dtype) {
    case NpyDType::Int16:
      return 2;
    case NpyDType::Int32:
      return 4;
    case NpyDType::Int64:
      return 8;
    case NpyDType::UInt32:
      return 4;
  }
  MG_ASSERT(false, "bad NpyDType");
}

int64_t NpyArray::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

int64_t NpyArray::at(int64_t i) const {
  const std::byte* p = data.data() + size_t(i) * npy_itemsize(dtype);
  switch (dtype) {
    case NpyDType::Int16: {
      int16_t v;
      std::memcpy(&v, p, 2);
      return v;
    }
    case NpyDType::Int32: {
      int32_t v;
      std::memcpy(&v, p, 4);
      return v;
    }
    case NpyDType::Int64: {
      int64_t v;
      std::memcpy(&v, p, 8);
      return v;
    }
    case NpyDType::UInt32: {
      uint32_t v;
      std::memcpy(&v, p, 4);
      return v;
    }
  }
  MG_ASSERT(false, "bad NpyDType");
}

std::vector<int64_t> NpyArray::to_int64() const {
  std::vector<int64_t> out(static_cast<size_t>(numel()));
  for (size_t i = 0; i < out.size(); ++i) out[i] = at(int64_t(i));
  return out;
}

std::string npy_header(NpyDType dtype, std::span<const int64_t> shape) {
  std::string dict =
      fmt::format("{{'descr': '{}', 'fortran_order': False, 'shape': {}, }}", npy_descr(dtype), shape_repr(shape));
  if (!shape.empty()) dict.append(kGrowthAxisMaxDigits - std::to_string(shape[0]).size(), ' ');
  size_t hlen = dict.size() + 1;  // + newline
  size_t padlen = kArrayAlign - ((kMagicLen + 2 + 2 + hlen) % kArrayAlign);
  size_t total = hlen + padlen;
  MG_ASSERT(total <= 0xFFFF, "npy header too long");
  std::string out(kMagic, kMagicLen);
  out += char(1);
  out += char(0);
  out += char(total & 0xFF);
  out += char((total >> 8) & 0xFF);
  out += dict;
  out.append(padlen, ' ');
  out += '\n';
  return out;
}

std::string npy_bytes(NpyDType dtype, std::span<const int64_t> shape, const void* data) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::string out = npy_header(dtype, shape);
  out.append(static_cast<const char*>(data), size_t(n) * npy_itemsize(dtype));
  return out;
}

void write_npy(const std::string& path, NpyDType dtype, std::span<const int64_t> shape, const void* data) {
  write_file_atomic(path, npy_bytes(dtype, shape, data));
}

NpyArray parse_npy(const std::string& bytes, const std::string& what) {
  auto fail = [&](std::string_view why) {
    throw Error(fmt::format("corrupt .npy file {}: {}; delete it to rebuild the index cache", what, why));
  };
  if (bytes.size() < 10 || std::memcmp(bytes.data(), kMagic, kMagicLen) != 0) fail("bad magic");
  int major = static_cast<unsigned char>(bytes[6]);
  size_t header_len = 0, prefix = 0;
  if (major == 1) {
    header_len = size_t(static_cast<unsigned char>(bytes[8])) | (size_t(static_cast<unsigned char>(bytes[9])) << 8);
    prefix = 10;
  } else if (major == 2 || major == 3) {
    if (bytes.size() < 12) fail("truncated header");
    for (int k = 0; k < 4; ++k) header_len |= size_t(static_cast<unsigned char>(bytes[8 + k])) << (8 * k);
    prefix = 12;
  } else {
    fail(fmt::format("unsupported format version {}", major));
  }
  if (prefix + header_len > bytes.size()) fail("truncated header");
  std::string_view header(bytes.data() + prefix, header_len);

  auto value_of = [&](std::string_view key) -> std::string_view {
    size_t k = header.find(fmt::format("'{}':", key));
    if (k == std::string_view::npos) fail(fmt::format("header has no '{}'", key));
    size_t v = k + key.size() + 3;
    while (v < header.size() && header[v] == ' ') ++v;
    return header.substr(v);
  };
  NpyArray arr;
  std::string_view descr = value_of("descr");
  bool found = false;
  for (NpyDType t : {NpyDType::Int16, NpyDType::Int32, NpyDType::Int64, NpyDType::UInt32}) {
    std::string q = fmt::format("'{}'", npy_descr(t));
    if (descr.substr(0, q.size()) == q) {
      arr.dtype = t;
      found = true;
    }
  }
  if (!found) fail(fmt::format("unsupported dtype {}", descr.substr(0, descr.find(','))));
  if (value_of("fortran_order").substr(0, 5) != "False") fail("fortran_order arrays are not supported");
  std::string_view shape = value_of("shape");
  if (shape.empty() || shape[0] != '(') fail("bad shape");
  size_t close = shape.find(')');
  if (close == std::string_view::npos) fail("bad shape");
  std::string_view dims = shape.substr(1, close - 1);
  size_t pos = 0;
  while (pos < dims.size()) {
    while (pos < dims.size() && (dims[pos] == ' ' || dims[pos] == ',')) ++pos;
    if (pos >= dims.size()) break;
    size_t end = pos;
    while (end < dims.size() && dims[end] >= '0' && dims[end] <= '9') ++end;
    if (end == pos) fail("bad shape");
    arr.shape.push_back(std::stoll(std::string(dims.substr(pos, end - pos))));
    pos = end;
  }
  size_t nbytes = size_t(arr.numel()) * npy_itemsize(arr.dtype);
  size_t offset = prefix + header_len;
  if (bytes.size() - offset != nbytes)
    fail(fmt::format("expected {} data bytes for shape {}, found {}", nbytes, shape.substr(0, close + 1),
                     bytes.size() - offset));
  arr.data.resize(nbytes);
  if (nbytes) std::memcpy(arr.data.data(), bytes.data() + offset, nbytes);
  return arr;
}

NpyArray read_npy(const std::string& path) { return parse_npy(read_file(path), path); }

}  // namespace megatron
