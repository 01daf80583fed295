// Small pieces shared by the dataset classes (Megatron-LM megatron/core/datasets/utils.py and the
// bits of Python the index cache depends on).
//
// The index cache is named by the md5 of a description that Megatron writes with
// `json.dumps(identifiers, indent=4)`. A cache written by Megatron must be found by us, so the
// description is produced byte for byte as Python does: ordered keys, ", "/": " separators with
// indent 4, ASCII-only strings, and floats spelled as Python's repr (0.969, 1.0, 1e-05).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace megatron {

/// Megatron's Split enum: the three dataset splits in order.
enum class Split : int { train = 0, valid = 1, test = 2 };
inline constexpr int kNumSplits = 3;
/// "train", "valid" or "test" (Megatron's Split.name).
const char* split_name(Split split);

/// Megatron's utils.normalize: w / sum(w) in float64.
std::vector<double> normalize(std::span<const double> weights);

/// Python's repr(float): the shortest round-trip digits, fixed notation for 1e-4 <= |x| < 1e16
/// (with ".0" for integral values), else "1.5e+16" / "1e-05".
std::string python_float_repr(double value);

/// Python's json.dumps(value, indent=indent) with the default ensure_ascii=True.
std::string python_json_dumps(const nlohmann::ordered_json& value, int indent = 4);

/// Lower-case hex md5 of the bytes (hashlib.md5(s.encode("utf-8")).hexdigest()).
std::string md5_hex(std::string_view bytes);

/// Writes `bytes` to `path` atomically: a temporary file in the same directory, then rename.
void write_file_atomic(const std::string& path, std::string_view bytes);
/// The whole file as bytes; a missing or unreadable file is a megatron::Error.
std::string read_file(const std::string& path);

}  // namespace megatron
