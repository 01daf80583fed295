// Python-compatible JSON/float spelling, md5 and atomic file writes for the dataset index cache.
#include "megatron/core/datasets/utils.h"

#include <fmt/format.h>
#include <openssl/evp.h>
#include <unistd.h>

#include <atomic>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <system_error>

#include "megatron/runtime/check.h"

namespace megatron {

const char* split_name(Split split) {
  switch (split) {
    case Split::train:
      return "train";
    case Split::valid:
      return "valid";
    case Split::test:
      return "test";
  }
  MG_ASSERT(false, "bad split {}", int(split));
}

std::vector<double> normalize(std::span<const double> weights) {
  // numpy.sum's pairwise summation: blocks of 8 partial sums for n <= 128, recursive halves above.
  auto pairwise = [](auto&& self, const double* a, size_t n) -> double {
    if (n < 8) {
      double s = 0.0;
      for (size_t i = 0; i < n; ++i) s += a[i];
      return s;
    }
    if (n <= 128) {
      double r[8];
      for (int k = 0; k < 8; ++k) r[k] = a[k];
      size_t i = 8;
      for (; i < n - (n % 8); i += 8)
        for (int k = 0; k < 8; ++k) r[k] += a[i + k];
      double s = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
      for (; i < n; ++i) s += a[i];
      return s;
    }
    size_t half = n / 2;
    half -= half % 8;
    return self(self, a, half) + self(self, a + half, n - half);
  };
  double sum = pairwise(pairwise, weights.data(), weights.size());
  std::vector<double> out(weights.size());
  for (size_t i = 0; i < weights.size(); ++i) out[i] = weights[i] / sum;
  return out;
}

std::string python_float_repr(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "Infinity" : "-Infinity";
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), value, std::chars_format::scientific);
  MG_ASSERT(res.ec == std::errc(), "to_chars failed");
  std::string_view s(buf, size_t(res.ptr - buf));
  std::string sign;
  if (s.front() == '-') {
    sign = "-";
    s.remove_prefix(1);
  }
  size_t e = s.find('e');
  std::string digits;
  for (char c : s.substr(0, e))
    if (c != '.') digits += c;
  int exponent = std::stoi(std::string(s.substr(e + 1)));
  while (digits.size() > 1 && digits.back() == '0') digits.pop_back();
  int decpt = exponent + 1;  // digits d1d2... represent 0.d1d2... * 10^decpt
  std::string out = sign;
  if (decpt <= -4 || decpt > 16) {
    out += digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    out += fmt::format("e{}{:02d}", exponent < 0 ? '-' : '+', std::abs(exponent));
  } else if (decpt <= 0) {
    out += "0." + std::string(size_t(-decpt), '0') + digits;
  } else if (size_t(decpt) >= digits.size()) {
    out += digits + std::string(size_t(decpt) - digits.size(), '0') + ".0";
  } else {
    out += digits.substr(0, size_t(decpt)) + "." + digits.substr(size_t(decpt));
  }
  return out;
}

namespace {

void append_json_string(std::string& out, const std::string& s) {
  out += '"';
  for (size_t i = 0; i < s.size();) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    uint32_t cp = c;
    size_t len = 1;
    if (c >= 0x80) {  // decode UTF-8 so non-ASCII becomes \uXXXX as Python's ensure_ascii does
      len = (c >= 0xF0) ? 4 : (c >= 0xE0) ? 3 : 2;
      MG_CHECK(i + len <= s.size(), "invalid UTF-8 in a dataset description string");
      cp = c & (0x3F >> (len - 1));
      for (size_t k = 1; k < len; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
    }
    i += len;
    switch (cp) {
      case '"':
        out += "\\\"";
        continue;
      case '\\':
        out += "\\\\";
        continue;
      case '\n':
        out += "\\n";
        continue;
      case '\r':
        out += "\\r";
        continue;
      case '\t':
        out += "\\t";
        continue;
      case '\b':
        out += "\\b";
        continue;
      case '\f':
        out += "\\f";
        continue;
      default:
        break;
    }
    if (cp < 0x20 || (cp >= 0x7F && cp < 0x10000)) {
      out += fmt::format("\\u{:04x}", cp);
    } else if (cp >= 0x10000) {
      uint32_t v = cp - 0x10000;
      out += fmt::format("\\u{:04x}\\u{:04x}", 0xD800 + (v >> 10), 0xDC00 + (v & 0x3FF));
    } else {
      out += char(cp);
    }
  }
  out += '"';
}

void dump(std::string& out, const nlohmann::ordered_json& v, int indent, int level) {
  using value_t = nlohmann::ordered_json::value_t;
  auto newline = [&](int lvl) {
    out += '\n';
    out.append(size_t(indent * lvl), ' ');
  };
  switch (v.type()) {
    case value_t::null:
      out += "null";
      return;
    case value_t::boolean:
      out += v.get<bool>() ? "true" : "false";
      return;
    case value_t::number_integer:
      out += std::to_string(v.get<int64_t>());
      return;
    case value_t::number_unsigned:
      out += std::to_string(v.get<uint64_t>());
      return;
    case value_t::number_float:
      out += python_float_repr(v.get<double>());
      return;
    case value_t::string:
      append_json_string(out, v.get<std::string>());
      return;
    case value_t::array: {
      if (v.empty()) {
        out += "[]";
        return;
      }
      out += '[';
      bool first = true;
      for (const auto& item : v) {
        if (!first) out += ',';
        first = false;
        newline(level + 1);
        dump(out, item, indent, level + 1);
      }
      newline(level);
      out += ']';
      return;
    }
    case value_t::object: {
      if (v.empty()) {
        out += "{}";
        return;
      }
      out += '{';
      bool first = true;
      for (const auto& [key, item] : v.items()) {
        if (!first) out += ',';
        first = false;
        newline(level + 1);
        append_json_string(out, key);
        out += ": ";
        dump(out, item, indent, level + 1);
      }
      newline(level);
      out += '}';
      return;
    }
    default:
      MG_CHECK(false, "a dataset description cannot hold a JSON value of this type");
  }
}

}  // namespace

std::string python_json_dumps(const nlohmann::ordered_json& value, int indent) {
  std::string out;
  dump(out, value, indent, 0);
  return out;
}

std::string md5_hex(std::string_view bytes) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  MG_ASSERT(ctx != nullptr, "EVP_MD_CTX_new failed");
  bool ok = EVP_DigestInit_ex(ctx, EVP_md5(), nullptr) == 1 && EVP_DigestUpdate(ctx, bytes.data(), bytes.size()) == 1 &&
            EVP_DigestFinal_ex(ctx, digest, &len) == 1;
  EVP_MD_CTX_free(ctx);
  MG_ASSERT(ok && len == 16, "md5 failed");
  std::string hex;
  for (unsigned int i = 0; i < len; ++i) hex += fmt::format("{:02x}", digest[i]);
  return hex;
}

void write_file_atomic(const std::string& path, std::string_view bytes) {
  static std::atomic<uint64_t> counter{0};
  std::string tmp = fmt::format("{}.tmp.{}.{}", path, ::getpid(), counter++);
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    MG_CHECK(f.good(), "cannot write {}: check that the cache directory is writable (--data-cache-path)", tmp);
    f.write(bytes.data(), std::streamsize(bytes.size()));
    f.flush();
    MG_CHECK(f.good(), "failed writing {} (disk full?)", tmp);
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::filesystem::remove(tmp, ec);
    MG_CHECK(false, "cannot rename {} to {}: check that the cache directory is writable", tmp, path);
  }
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  MG_CHECK(f.good(), "cannot open {}", path);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace megatron
