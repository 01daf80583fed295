// Byte-level alphabet, lossy UTF-8 decoding, the sharded word cache and the merge-rank BPE model.
#include "megatron/core/tokenizers/bpe.h"

#include <fmt/format.h>

#include <limits>
#include <queue>

#include "megatron/runtime/check.h"

namespace megatron {

namespace {

void append_utf8(uint32_t cp, std::string& out) {
  if (cp < 0x80) {
    out.push_back(char(cp));
  } else if (cp < 0x800) {
    out.push_back(char(0xC0 | (cp >> 6)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(char(0xE0 | (cp >> 12)));
    out.push_back(char(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(char(0xF0 | (cp >> 18)));
    out.push_back(char(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(char(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  }
}

// Decodes one valid UTF-8 character at s[i]; returns its length, 0 when invalid.
size_t decode_utf8(std::string_view s, size_t i, uint32_t& cp) {
  auto b = [&](size_t k) { return static_cast<unsigned char>(s[i + k]); };
  unsigned char c = b(0);
  if (c < 0x80) {
    cp = c;
    return 1;
  }
  size_t n = c >= 0xF0 && c <= 0xF4 ? 4 : c >= 0xE0 ? 3 : c >= 0xC2 && c < 0xE0 ? 2 : 0;
  if (n == 0 || i + n > s.size()) return 0;
  uint32_t v = c & (0x7F >> n);
  for (size_t k = 1; k < n; ++k) {
    if ((b(k) & 0xC0) != 0x80) return 0;
    v = (v << 6) | (b(k) & 0x3F);
  }
  if ((n == 3 && (v < 0x800 || (v >= 0xD800 && v <= 0xDFFF))) || (n == 4 && (v < 0x10000 || v > 0x10FFFF))) return 0;
  cp = v;
  return n;
}

// Length of the maximal prefix of an invalid sequence at s[i] that could start a valid character
// (the "maximal subpart" that is replaced by a single U+FFFD).
size_t invalid_subpart_len(std::string_view s, size_t i) {
  auto c = static_cast<unsigned char>(s[i]);
  size_t n = c >= 0xF0 && c <= 0xF4 ? 4 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xC2 && c <= 0xDF ? 2 : 1;
  size_t k = 1;
  for (; k < n && i + k < s.size(); ++k) {
    auto d = static_cast<unsigned char>(s[i + k]);
    unsigned char lo = 0x80, hi = 0xBF;
    if (k == 1) {
      if (c == 0xE0) lo = 0xA0;
      if (c == 0xED) hi = 0x9F;
      if (c == 0xF0) lo = 0x90;
      if (c == 0xF4) hi = 0x8F;
    }
    if (d < lo || d > hi) break;
  }
  return k;
}

}  // namespace

size_t utf8_char_len(unsigned char c) {
  if (c < 0x80) return 1;
  if (c >= 0xF0) return 4;
  if (c >= 0xE0) return 3;
  if (c >= 0xC0) return 2;
  return 1;
}

std::string utf8_lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  size_t i = 0;
  while (i < bytes.size()) {
    uint32_t cp;
    size_t n = decode_utf8(bytes, i, cp);
    if (n) {
      out.append(bytes.substr(i, n));
      i += n;
    } else {
      out.append("\xEF\xBF\xBD");
      i += invalid_subpart_len(bytes, i);
    }
  }
  return out;
}

ByteUnicodeMap::ByteUnicodeMap() {
  uint32_t next = 256;
  for (uint32_t b = 0; b < 256; ++b) {
    bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    uint32_t cp = printable ? b : next++;
    append_utf8(cp, byte_to_symbol_[b]);
    codepoint_to_byte_[cp] = static_cast<unsigned char>(b);
  }
}

const ByteUnicodeMap& ByteUnicodeMap::get() {
  static const ByteUnicodeMap map;
  return map;
}

std::string ByteUnicodeMap::encode(std::string_view bytes) const {
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) out += byte_to_symbol_[c];
  return out;
}

bool ByteUnicodeMap::decode(std::string_view symbols, std::string& out) const {
  size_t start = out.size();
  for (size_t i = 0; i < symbols.size();) {
    uint32_t cp;
    size_t n = decode_utf8(symbols, i, cp);
    auto it = n ? codepoint_to_byte_.find(cp) : codepoint_to_byte_.end();
    if (it == codepoint_to_byte_.end()) {
      out.resize(start);
      return false;
    }
    out.push_back(static_cast<char>(it->second));
    i += n;
  }
  return true;
}

bool WordCache::lookup(std::string_view word, std::vector<int64_t>& out) const {
  Shard& shard = shards_[std::hash<std::string_view>{}(word) % kShards];
  std::lock_guard<std::mutex> lock(shard.mu);
  auto it = shard.map.find(std::string(word));
  if (it == shard.map.end()) return false;
  out.insert(out.end(), it->second.begin(), it->second.end());
  return true;
}

void WordCache::insert(std::string_view word, const std::vector<int64_t>& ids) const {
  Shard& shard = shards_[std::hash<std::string_view>{}(word) % kShards];
  std::lock_guard<std::mutex> lock(shard.mu);
  if (shard.map.size() >= kShardCap) shard.map.clear();
  shard.map.emplace(std::string(word), ids);
}

BpeModel::BpeModel(std::unordered_map<std::string, int64_t> vocab,
                   const std::vector<std::pair<std::string, std::string>>& merges, Options options)
    : vocab_(std::move(vocab)), options_(std::move(options)) {
  int64_t max_id = -1;
  const uint64_t limit = uint64_t(vocab_.size()) + options_.extra_ids;
  for (const auto& [tok, id] : vocab_) {
    MG_CHECK(id >= 0, "{}: token '{}' has a negative id {}; the file is corrupt", options_.source, tok, id);
    MG_CHECK(uint64_t(id) < limit,
             "{}: token '{}' has id {}, beyond the vocabulary's {} entries{}: the file is corrupt (ids run from 0 to "
             "the number of tokens - 1)",
             options_.source, tok, id, vocab_.size(),
             options_.extra_ids ? fmt::format(" and {} added tokens", options_.extra_ids) : std::string());
    max_id = std::max(max_id, id);
  }
  id_to_token_.assign(size_t(max_id + 1), nullptr);
  for (const auto& [tok, id] : vocab_) id_to_token_[size_t(id)] = &tok;
  MG_CHECK(merges.size() < size_t(std::numeric_limits<int32_t>::max()), "too many BPE merges");
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [a, b] = merges[rank];
    auto ia = vocab_.find(a), ib = vocab_.find(b), iab = vocab_.find(a + b);
    MG_CHECK(ia != vocab_.end() && ib != vocab_.end(),
             "BPE merge {} ('{} {}') uses a token missing from the vocab; the vocab and merges files do not match",
             rank, a, b);
    MG_CHECK(iab != vocab_.end(), "BPE merge {} ('{} {}') makes a token missing from the vocab", rank, a, b);
    uint64_t key = (uint64_t(ia->second) << 32) | uint64_t(ib->second);
    merges_.try_emplace(key, int32_t(rank), iab->second);
  }
  if (options_.unk) {
    auto it = vocab_.find(*options_.unk);
    MG_CHECK(it != vocab_.end(), "BPE unk_token '{}' is not in the vocab", *options_.unk);
    unk_id_ = it->second;
  }
}

std::optional<int64_t> BpeModel::token_to_id(std::string_view token) const {
  auto it = vocab_.find(std::string(token));
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

const std::string* BpeModel::id_to_token(int64_t id) const {
  if (id < 0 || size_t(id) >= id_to_token_.size()) return nullptr;
  return id_to_token_[size_t(id)];
}

void BpeModel::encode(std::string_view word, std::vector<int64_t>& out) const {
  if (word.empty()) return;
  if (options_.ignore_merges) {
    if (auto it = vocab_.find(std::string(word)); it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  if (cache_.lookup(word, out)) return;
  std::vector<int64_t> ids;
  merge_word(word, ids);
  if (word.size() <= 256) cache_.insert(word, ids);
  out.insert(out.end(), ids.begin(), ids.end());
}

void BpeModel::merge_word(std::string_view word, std::vector<int64_t>& out) const {
  // Initial symbols: one per character; unknown characters become unk (fused if asked) or vanish.
  std::vector<int64_t> sym;
  sym.reserve(word.size());
  bool last_unk = false;
  for (size_t i = 0; i < word.size();) {
    size_t n = std::min(utf8_char_len(static_cast<unsigned char>(word[i])), word.size() - i);
    auto it = vocab_.find(std::string(word.substr(i, n)));
    i += n;
    if (it != vocab_.end()) {
      sym.push_back(it->second);
      last_unk = false;
    } else if (unk_id_) {
      if (!(options_.fuse_unk && last_unk)) sym.push_back(*unk_id_);
      last_unk = true;
    }
  }
  // Merge the lowest-ranked adjacent pair, leftmost first, until none has a merge (HuggingFace's
  // order). Symbols form a linked list; a min-heap holds candidate pairs, stale ones are skipped.
  const size_t n = sym.size();
  if (n < 2) {
    out.insert(out.end(), sym.begin(), sym.end());
    return;
  }
  std::vector<ptrdiff_t> prev(n), next(n);
  for (size_t i = 0; i < n; ++i) {
    prev[i] = ptrdiff_t(i) - 1;
    next[i] = i + 1 < n ? ptrdiff_t(i + 1) : -1;
  }
  struct Cand {
    int32_t rank;
    size_t pos;
    int64_t left, right;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
  auto push = [&](size_t i) {
    if (next[i] < 0) return;
    int64_t l = sym[i], r = sym[size_t(next[i])];
    auto it = merges_.find((uint64_t(l) << 32) | uint64_t(r));
    if (it != merges_.end()) heap.push({it->second.first, i, l, r});
  };
  for (size_t i = 0; i + 1 < n; ++i) push(i);
  while (!heap.empty()) {
    Cand c = heap.top();
    heap.pop();
    if (sym[c.pos] != c.left || next[c.pos] < 0 || sym[size_t(next[c.pos])] != c.right) continue;
    size_t right = size_t(next[c.pos]);
    sym[c.pos] = merges_.at((uint64_t(c.left) << 32) | uint64_t(c.right)).second;
    sym[right] = -1;
    next[c.pos] = next[right];
    if (next[right] >= 0) prev[size_t(next[right])] = ptrdiff_t(c.pos);
    if (prev[c.pos] >= 0) push(size_t(prev[c.pos]));
    push(c.pos);
  }
  for (size_t i = 0; i < n; ++i)
    if (sym[i] >= 0) out.push_back(sym[i]);
}

}  // namespace megatron
