// TikTokenizer: rank files, Megatron's split patterns and tiktoken's byte-pair merge.
#include "megatron/core/tokenizers/tiktokenizer.h"

#include <filesystem>
#include <fstream>
#include <limits>

#include "megatron/core/tokenizers/hf_pipeline.h"
#include "megatron/core/tokenizers/identifiers.h"
#include "megatron/runtime/check.h"

namespace megatron {

namespace {

// Megatron's _PATTERN_TIKTOKEN_V1 / _V2.
constexpr const char* kPatternV1 =
    R"([^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+)";
constexpr const char* kPatternV2 =
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr int64_t kDefaultVocab = int64_t(1) << 17;
const char* const kSpecialTokens[] = {"<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>"};

bool base64_decode(std::string_view in, std::string& out) {
  out.clear();
  uint32_t acc = 0;
  int bits = 0;
  for (char c : in) {
    int v;
    if (c >= 'A' && c <= 'Z')
      v = c - 'A';
    else if (c >= 'a' && c <= 'z')
      v = c - 'a' + 26;
    else if (c >= '0' && c <= '9')
      v = c - '0' + 52;
    else if (c == '+' || c == '-')
      v = 62;
    else if (c == '/' || c == '_')
      v = 63;
    else if (c == '=')
      break;
    else
      return false;
    acc = (acc << 6) | uint32_t(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(char((acc >> bits) & 0xFF));
    }
  }
  return true;
}

// rank -> token bytes, from either file format; ranks at or past `limit` are left out.
std::vector<std::string> read_ranks(const std::string& path, int64_t limit) {
  std::vector<std::string> by_rank;
  auto put = [&](int64_t rank, std::string bytes) {
    MG_CHECK(rank >= 0, "tiktoken file '{}' has a negative rank", path);
    if (rank >= limit) return;
    if (size_t(rank) >= by_rank.size()) by_rank.resize(size_t(rank) + 1);
    MG_CHECK(by_rank[size_t(rank)].empty(), "tiktoken file '{}' repeats rank {}", path, rank);
    by_rank[size_t(rank)] = std::move(bytes);
  };
  std::string bytes;
  if (path.size() >= 5 && path.compare(path.size() - 5, 5, ".json") == 0) {
    const auto j = read_json_file(path, "tiktoken vocab");
    MG_CHECK(j.is_array(), "tiktoken vocab '{}' must be a JSON list of {{rank, token_bytes, token_str}}", path);
    for (size_t i = 0; i < j.size() && int64_t(i) < limit; ++i) {
      MG_CHECK(j[i].is_object() && j[i].contains("rank") && j[i].contains("token_bytes") &&
                   j[i]["rank"].get<int64_t>() == int64_t(i),
               "tiktoken vocab '{}': entry {} must be {{\"rank\": {}, \"token_bytes\", \"token_str\"}}", path, i, i);
      MG_CHECK(base64_decode(j[i]["token_bytes"].get<std::string>(), bytes),
               "tiktoken vocab '{}': entry {} is not "
               "base64",
               path, i);
      put(int64_t(i), bytes);
    }
    return by_rank;
  }
  std::ifstream in(path);
  MG_CHECK(in.good(), "cannot open tiktoken file '{}'", path);
  std::string line;
  for (size_t lineno = 1; std::getline(in, line); ++lineno) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty()) continue;
    size_t sp = line.find(' ');
    int64_t rank = -1;
    bool ok = sp != std::string::npos && base64_decode(std::string_view(line).substr(0, sp), bytes);
    if (ok) {
      try {
        rank = std::stoll(line.substr(sp + 1));
      } catch (const std::exception&) {
        ok = false;
      }
    }
    MG_CHECK(ok, "tiktoken file '{}' line {} is not '<base64 token> <rank>'", path, lineno);
    put(rank, bytes);
  }
  return by_rank;
}

}  // namespace

TikTokenizer::TikTokenizer(const std::string& path, const Options& options)
    : path_(path), options_(options), vocab_size_(options.vocab_size.value_or(kDefaultVocab)) {
  MG_CHECK(!path.empty(), "TikTokenizer needs --tokenizer-model (a tiktoken ranks file)");
  MG_CHECK(std::filesystem::is_regular_file(path), "--tokenizer-model '{}' does not exist: pass a tiktoken ranks file",
           path);
  const std::string pattern = options.pattern.empty() ? "v2" : options.pattern;
  MG_CHECK(pattern == "v1" || pattern == "v2", "--tiktoken-pattern must be v1 or v2, got '{}'", pattern);
  const int64_t n = options.num_special_tokens;
  MG_CHECK(int64_t(std::size(kSpecialTokens)) <= n && n < vocab_size_,
           "TikTokenizer needs {} <= --tiktoken-num-special-tokens ({}) < vocab size ({})", std::size(kSpecialTokens),
           n, vocab_size_);
  for (const char* t : kSpecialTokens) special_tokens_.emplace_back(t);
  for (int64_t i = int64_t(special_tokens_.size()); i < n; ++i)
    special_tokens_.push_back(fmt::format("<SPECIAL_{}>", i));
  for (size_t i = 0; i < special_tokens_.size(); ++i) specials_.add({special_tokens_[i], int64_t(i)});

  const int64_t inner = vocab_size_ - n;
  id_to_bytes_ = read_ranks(path, inner);
  bool complete = int64_t(id_to_bytes_.size()) == inner;
  for (size_t r = 0; complete && r < id_to_bytes_.size(); ++r) complete = !id_to_bytes_[r].empty();
  MG_CHECK(complete,
           "tiktoken file '{}' must hold every rank 0..{} for vocab size {} with {} special tokens: set --vocab-size "
           "to {} + the number of ranks",
           path, inner - 1, vocab_size_, n, n);
  for (size_t r = 0; r < id_to_bytes_.size(); ++r) {
    MG_CHECK(token_to_id_.emplace(id_to_bytes_[r], int64_t(r) + n).second, "tiktoken file '{}' repeats a token", path);
  }
  regex_ = std::make_unique<Regex>(pattern == "v1" ? kPatternV1 : kPatternV2);
}

std::optional<int64_t> TikTokenizer::rank_of(std::string_view bytes) const {
  auto it = token_to_id_.find(std::string(bytes));
  if (it == token_to_id_.end()) return std::nullopt;
  return it->second;
}

void TikTokenizer::encode_piece(std::string_view piece, std::vector<int64_t>& out) const {
  if (auto id = rank_of(piece)) {
    out.push_back(*id);
    return;
  }
  if (cache_.lookup(piece, out)) return;
  // tiktoken's byte-pair merge: merge the adjacent pair whose concatenation has the lowest rank
  // (leftmost on ties), one pair at a time.
  std::vector<size_t> starts(piece.size() + 1);
  for (size_t i = 0; i <= piece.size(); ++i) starts[i] = i;
  while (starts.size() > 2) {
    int64_t best = std::numeric_limits<int64_t>::max();
    size_t best_i = 0;
    for (size_t i = 0; i + 2 < starts.size(); ++i) {
      auto r = rank_of(piece.substr(starts[i], starts[i + 2] - starts[i]));
      if (r && *r < best) {
        best = *r;
        best_i = i;
      }
    }
    if (best == std::numeric_limits<int64_t>::max()) break;
    starts.erase(starts.begin() + std::ptrdiff_t(best_i + 1));
  }
  std::vector<int64_t> ids;
  for (size_t i = 0; i + 1 < starts.size(); ++i) {
    auto r = rank_of(piece.substr(starts[i], starts[i + 1] - starts[i]));
    MG_CHECK(r.has_value(), "tiktoken file '{}' lacks a single-byte token needed for this text", path_);
    ids.push_back(*r);
  }
  if (piece.size() <= 256) cache_.insert(piece, ids);
  out.insert(out.end(), ids.begin(), ids.end());
}

std::vector<int64_t> TikTokenizer::tokenize(std::string_view text) const {
  std::vector<int64_t> ids;
  std::vector<std::pair<size_t, size_t>> matches;
  for (const TextSegment& seg : specials_.split(text)) {
    if (seg.token_id >= 0) {
      ids.push_back(seg.token_id);
      continue;
    }
    regex_->find_all(seg.text, matches);
    for (auto [b, e] : matches) encode_piece(seg.text.substr(b, e - b), ids);
  }
  return ids;
}

std::string TikTokenizer::detokenize(const std::vector<int64_t>& ids) const {
  std::string bytes;
  const int64_t n = options_.num_special_tokens;
  for (int64_t id : ids) {
    MG_CHECK(id >= 0 && id < vocab_size_, "id {} is outside the TikTokenizer vocab of {}", id, vocab_size_);
    bytes += id < n ? special_tokens_[size_t(id)] : id_to_bytes_[size_t(id - n)];
  }
  return utf8_lossy(bytes);
}

nlohmann::ordered_json TikTokenizer::unique_identifiers() const {
  std::vector<std::pair<std::string, std::string>> kwargs;
  if (!options_.pattern.empty()) kwargs.emplace_back("pattern", options_.pattern);
  if (options_.vocab_size) kwargs.emplace_back("vocab_size", std::to_string(*options_.vocab_size));
  kwargs.emplace_back("num_special_tokens", std::to_string(options_.num_special_tokens));
  kwargs.emplace_back("special_tokens", "None");
  return text_tokenizer_identifiers(path_, kwargs);
}

}  // namespace megatron
