// Loading and running the HuggingFace byte-level BPE pipeline (see hf_pipeline.h).
//
// Note [NFC normalizer]
// Qwen2's tokenizer.json asks for NFC normalization. Text below U+0300 is already NFC, and nearly
// all real text is stored NFC, so the normalizer is applied as the identity; tokenizer.json files
// with any other normalizer are refused with a clear error instead of being tokenized differently.
#include "megatron/core/tokenizers/hf_pipeline.h"

#include <fstream>
#include <sstream>
#include <unordered_set>

#include "megatron/runtime/check.h"

namespace megatron {

const char* const kGpt2SplitPattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

using nlohmann::json;

json read_json_file(const std::string& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  MG_CHECK(in.good(), "cannot open {} '{}': check that the file exists and is readable", what, path);
  std::stringstream ss;
  ss << in.rdbuf();
  try {
    return json::parse(ss.str());
  } catch (const json::exception& e) {
    MG_CHECK(false, "{} '{}' is not valid JSON ({}): pass an intact file", what, path, e.what());
  }
  return {};
}

namespace {

std::shared_ptr<const Regex> gpt2_regex() {
  static const auto re = std::make_shared<const Regex>(kGpt2SplitPattern);
  return re;
}

std::string escape_literal(const std::string& s) {
  std::string out;
  for (char c : s) {
    auto u = static_cast<unsigned char>(c);
    if (u < 0x80 && !std::isalnum(u)) out.push_back('\\');
    out.push_back(c);
  }
  return out;
}

// A special token of tokenizer_config.json: a string, {"content": ...}, or null.
std::optional<std::string> token_content(const json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
  return std::nullopt;
}

bool flag(const json& obj, const char* key) { return obj.is_object() && obj.value(key, false); }

}  // namespace

void HfPipeline::add_token(const std::string& content, std::optional<int64_t> id, bool lstrip, bool rstrip,
                           bool single_word) {
  if (auto it = added_by_content_.find(content); it != added_by_content_.end()) return;
  MG_CHECK(!id || (*id >= 0 && *id < id_limit_),
           "{}: added token '{}' has id {}, beyond the vocabulary's {} tokens: the file is corrupt (ids run from 0 to "
           "the number of tokens - 1)",
           source_, content, id.value_or(0), id_limit_);
  if (!id) {
    if (auto v = model_->token_to_id(content)) {
      id = v;
    } else {
      int64_t next = int64_t(model_->vocab().size());
      for (const auto& [i, c] : added_by_id_) next = std::max(next, i + 1);
      id = next;
    }
  }
  added_by_content_[content] = *id;
  added_by_id_[*id] = content;
  matcher_.add({content, *id, lstrip, rstrip, single_word});
}

void HfPipeline::resolve_roles(const json& config, bool gpt2_defaults) {
  const json cfg = config.is_object() ? config : json::object();
  if (cfg.contains("added_tokens_decoder") && cfg["added_tokens_decoder"].is_object()) {
    id_limit_ += int64_t(cfg["added_tokens_decoder"].size());
    for (const auto& [key, tok] : cfg["added_tokens_decoder"].items()) {
      if (auto content = token_content(tok)) {
        const bool number =
            !key.empty() && key.size() <= 18 && key.find_first_not_of("0123456789") == std::string::npos;
        MG_CHECK(number, "tokenizer config: added_tokens_decoder key '{}' is not a token id", key);
        add_token(*content, std::stoll(key), flag(tok, "lstrip"), flag(tok, "rstrip"), flag(tok, "single_word"));
      }
    }
  }
  std::unordered_map<std::string, std::optional<int64_t>> role_ids;
  for (const char* role :
       {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"}) {
    std::optional<std::string> content;
    if (cfg.contains(role)) {
      content = token_content(cfg[role]);
    } else if (gpt2_defaults && std::string_view(role) != "sep_token" && std::string_view(role) != "pad_token" &&
               std::string_view(role) != "cls_token" && std::string_view(role) != "mask_token") {
      content = "<|endoftext|>";
    }
    if (!content) continue;
    const json& obj = cfg.contains(role) ? cfg[role] : json();
    add_token(*content, std::nullopt, flag(obj, "lstrip"), flag(obj, "rstrip"), flag(obj, "single_word"));
    role_ids[role] = added_by_content_.at(*content);
  }
  if (cfg.contains("additional_special_tokens") && cfg["additional_special_tokens"].is_array()) {
    for (const auto& tok : cfg["additional_special_tokens"]) {
      if (auto content = token_content(tok)) {
        add_token(*content, std::nullopt, flag(tok, "lstrip"), flag(tok, "rstrip"), flag(tok, "single_word"));
      }
    }
  }
  auto role = [&](const char* name) { return role_ids.count(name) ? role_ids[name] : std::nullopt; };
  // Megatron's HuggingFaceTokenizer: eos falls back to sep, bos to cls.
  eos_ = role("eos_token") ? role("eos_token") : role("sep_token");
  bos_ = role("bos_token") ? role("bos_token") : role("cls_token");
  pad_ = role("pad_token");
  std::unordered_set<std::string> names;
  int64_t max_id = -1;
  for (const auto& [tok, id] : model_->vocab()) names.insert(tok), max_id = std::max(max_id, id);
  for (const auto& [tok, id] : added_by_content_) names.insert(tok), max_id = std::max(max_id, id);
  // Dense files have max_id + 1 tokens; one with holes (bounded by its token count) counts them too,
  // so that every id it produces is below vocab_size().
  vocab_size_ = std::max(int64_t(names.size()), max_id + 1);
  for (const std::vector<int64_t>* ids : {&prefix_, &suffix_}) {
    for (int64_t id : *ids) {
      MG_CHECK(id >= 0 && id < vocab_size_, "{}: the post-processor adds token id {}, outside the vocabulary of {}",
               source_, id, vocab_size_);
    }
  }
}

void HfPipeline::parse_pre_tokenizer(const json& j) {
  if (j.is_null()) return;
  const std::string type = j.value("type", "");
  if (type == "Sequence") {
    for (const auto& p : j.at("pretokenizers")) parse_pre_tokenizer(p);
  } else if (type == "Split") {
    Step step;
    const json& pat = j.at("pattern");
    if (pat.contains("Regex")) {
      step.regex = std::make_shared<const Regex>(pat["Regex"].get<std::string>());
    } else {
      step.regex = std::make_shared<const Regex>(escape_literal(pat.at("String").get<std::string>()));
    }
    const std::string behavior = j.value("behavior", "Isolated");
    if (behavior == "Removed")
      step.behavior = Behavior::Removed;
    else if (behavior == "Isolated")
      step.behavior = Behavior::Isolated;
    else if (behavior == "MergedWithPrevious")
      step.behavior = Behavior::MergedWithPrevious;
    else if (behavior == "MergedWithNext")
      step.behavior = Behavior::MergedWithNext;
    else if (behavior == "Contiguous")
      step.behavior = Behavior::Contiguous;
    else
      MG_CHECK(false, "tokenizer.json: unknown Split behavior '{}'", behavior);
    step.invert = j.value("invert", false);
    steps_.push_back(std::move(step));
  } else if (type == "ByteLevel") {
    Step step;
    step.byte_level = true;
    step.add_prefix_space = j.value("add_prefix_space", false);
    if (j.value("use_regex", true)) step.regex = gpt2_regex();
    steps_.push_back(std::move(step));
  } else {
    MG_CHECK(false,
             "tokenizer.json pre_tokenizer '{}' is not supported (supported: Sequence, Split, ByteLevel, as in "
             "GPT-2, Llama-3 and Qwen2 tokenizers)",
             type);
  }
}

void HfPipeline::parse_post_processor(const json& j) {
  if (j.is_null()) return;
  const std::string type = j.value("type", "");
  if (type == "Sequence") {
    for (const auto& p : j.at("processors")) parse_post_processor(p);
  } else if (type == "ByteLevel") {
    return;  // offsets only
  } else if (type == "TemplateProcessing") {
    bool after_sequence = false;
    for (const auto& piece : j.at("single")) {
      if (piece.contains("Sequence")) {
        after_sequence = true;
        continue;
      }
      const std::string name = piece.at("SpecialToken").at("id").get<std::string>();
      const json& spec = j.at("special_tokens").at(name);
      for (const auto& id : spec.at("ids")) (after_sequence ? suffix_ : prefix_).push_back(id.get<int64_t>());
    }
  } else if (type == "BertProcessing" || type == "RobertaProcessing") {
    prefix_.push_back(j.at("cls").at(1).get<int64_t>());
    suffix_.push_back(j.at("sep").at(1).get<int64_t>());
  } else {
    MG_CHECK(false, "tokenizer.json post_processor '{}' is not supported", type);
  }
}

std::unique_ptr<HfPipeline> HfPipeline::from_tokenizer_json(const std::string& path, const json& config) {
  const json tj = read_json_file(path, "tokenizer.json");
  std::unique_ptr<HfPipeline> p(new HfPipeline());
  try {
    MG_CHECK(tj.is_object() && tj.contains("model"), "'{}' has no \"model\": is it a HuggingFace tokenizer.json?",
             path);
    const json& m = tj["model"];
    const std::string type = m.value("type", "BPE");
    MG_CHECK(type == "BPE", "'{}': model type '{}' is not supported (byte-level BPE only)", path, type);
    MG_CHECK(!(m.contains("byte_fallback") && m["byte_fallback"].is_boolean() && m["byte_fallback"].get<bool>()),
             "'{}': byte_fallback BPE (Llama-2 style) is not supported: use SentencePieceTokenizer with its .model",
             path);
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
      MG_CHECK(!m.contains(key) || m[key].is_null() || m[key].get<std::string>().empty(),
               "'{}': BPE {} is not supported", path, key);
    }
    std::unordered_map<std::string, int64_t> vocab;
    MG_CHECK(m.contains("vocab") && m["vocab"].is_object(), "'{}': the BPE model's vocab is not a map of token -> id",
             path);
    for (const auto& [tok, id] : m.at("vocab").items()) {
      MG_CHECK(id.is_number_integer(), "'{}': token '{}' has id {}, not an integer; the file is corrupt", path, tok,
               id.dump());
      vocab.emplace(tok, id.get<int64_t>());
    }
    std::vector<std::pair<std::string, std::string>> merges;
    for (const auto& mg : m.at("merges")) {
      if (mg.is_array()) {
        merges.emplace_back(mg.at(0).get<std::string>(), mg.at(1).get<std::string>());
      } else {
        const std::string s = mg.get<std::string>();
        size_t sp = s.find(' ');
        MG_CHECK(sp != std::string::npos && s.find(' ', sp + 1) == std::string::npos,
                 "'{}': merge '{}' is not two tokens separated by one space", path, s);
        merges.emplace_back(s.substr(0, sp), s.substr(sp + 1));
      }
    }
    BpeModel::Options opt;
    opt.ignore_merges =
        m.contains("ignore_merges") && m["ignore_merges"].is_boolean() && m["ignore_merges"].get<bool>();
    if (m.contains("unk_token") && m["unk_token"].is_string()) opt.unk = m["unk_token"].get<std::string>();
    opt.fuse_unk = m.contains("fuse_unk") && m["fuse_unk"].is_boolean() && m["fuse_unk"].get<bool>();
    const json added = tj.value("added_tokens", json::array());
    MG_CHECK(added.is_array(), "'{}': added_tokens is not a list", path);
    opt.extra_ids = added.size();
    opt.source = "'" + path + "'";
    p->source_ = opt.source;
    p->id_limit_ = int64_t(vocab.size() + added.size());
    p->model_ = std::make_unique<BpeModel>(std::move(vocab), merges, opt);

    const json norm = tj.value("normalizer", json());
    const std::string ntype = norm.is_object() ? norm.value("type", "") : "";
    bool identity =
        norm.is_null() || ntype == "NFC" || (ntype == "Sequence" && norm.value("normalizers", json::array()).empty());
    MG_CHECK(identity, "'{}': normalizer '{}' is not supported (null or NFC only)", path, ntype);
    p->parse_pre_tokenizer(tj.value("pre_tokenizer", json()));
    p->parse_post_processor(tj.value("post_processor", json()));
    const json dec = tj.value("decoder", json());
    MG_CHECK(dec.is_null() || dec.value("type", "") == "ByteLevel",
             "'{}': decoder '{}' is not supported (ByteLevel only)", path,
             dec.is_object() ? dec.value("type", "") : "");
    p->byte_level_decoder_ = !dec.is_null();
    for (const auto& t : tj.value("added_tokens", json::array())) {
      p->add_token(t.at("content").get<std::string>(), t.at("id").get<int64_t>(), flag(t, "lstrip"), flag(t, "rstrip"),
                   flag(t, "single_word"));
    }
  } catch (const json::exception& e) {
    MG_CHECK(false, "'{}' is not a valid HuggingFace tokenizer.json ({})", path, e.what());
  }
  p->resolve_roles(config, /*gpt2_defaults=*/false);
  return p;
}

std::unique_ptr<HfPipeline> HfPipeline::from_gpt2_files(const std::string& vocab_file, const std::string& merges_file,
                                                        const json& config) {
  const json vj = read_json_file(vocab_file, "vocab file");
  MG_CHECK(vj.is_object(), "vocab file '{}' is not a JSON object of token -> id: pass GPT-2's vocab.json", vocab_file);
  std::unordered_map<std::string, int64_t> vocab;
  for (const auto& [tok, id] : vj.items()) {
    MG_CHECK(id.is_number_integer(), "vocab file '{}': token '{}' has a non-integer id", vocab_file, tok);
    vocab.emplace(tok, id.get<int64_t>());
  }
  std::ifstream in(merges_file);
  MG_CHECK(in.good(), "cannot open merges file '{}': check that the file exists and is readable", merges_file);
  std::vector<std::pair<std::string, std::string>> merges;
  std::string line;
  for (size_t lineno = 1; std::getline(in, line); ++lineno) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || (lineno == 1 && line.rfind("#version", 0) == 0)) continue;
    size_t sp = line.find(' ');
    MG_CHECK(sp != std::string::npos && sp > 0 && sp + 1 < line.size(),
             "merges file '{}' line {} is not two tokens separated by a space", merges_file, lineno);
    merges.emplace_back(line.substr(0, sp), line.substr(sp + 1));
  }
  std::unique_ptr<HfPipeline> p(new HfPipeline());
  BpeModel::Options opt;
  opt.source = "vocab file '" + vocab_file + "'";
  p->source_ = opt.source;
  p->id_limit_ = int64_t(vocab.size()) + 16;  // + the roles and extra tokens of a tokenizer config
  p->model_ = std::make_unique<BpeModel>(std::move(vocab), merges, opt);
  Step step;
  step.byte_level = true;
  step.add_prefix_space = config.is_object() && config.value("add_prefix_space", false);
  step.regex = gpt2_regex();
  p->steps_.push_back(std::move(step));
  p->byte_level_decoder_ = true;
  p->resolve_roles(config, /*gpt2_defaults=*/true);
  if (config.is_object() && config.value("add_bos_token", false) && p->bos_) p->prefix_.push_back(*p->bos_);
  if (config.is_object() && config.value("add_eos_token", false) && p->eos_) p->suffix_.push_back(*p->eos_);
  return p;
}

std::optional<int64_t> HfPipeline::token_to_id(std::string_view token) const {
  if (auto it = added_by_content_.find(std::string(token)); it != added_by_content_.end()) return it->second;
  return model_->token_to_id(token);
}

void HfPipeline::apply_step(const Step& step, std::vector<std::string>& pieces) const {
  std::vector<std::string> out;
  std::vector<std::pair<size_t, size_t>> matches;
  struct Span {
    size_t b, e;
    bool match;
  };
  std::vector<Span> spans, merged;
  for (std::string& piece : pieces) {
    if (step.byte_level && step.add_prefix_space && piece.rfind(' ', 0) != 0) piece.insert(0, 1, ' ');
    if (!step.regex) {
      out.push_back(std::move(piece));
      continue;
    }
    step.regex->find_all(piece, matches);
    spans.clear();
    size_t prev = 0;
    for (auto [b, e] : matches) {
      if (b > prev) spans.push_back({prev, b, false});
      spans.push_back({b, e, true});
      prev = e;
    }
    if (prev < piece.size()) spans.push_back({prev, piece.size(), false});
    Behavior behavior = step.byte_level ? Behavior::Isolated : step.behavior;
    if (step.invert && !step.byte_level) {
      for (auto& s : spans) s.match = !s.match;
    }
    merged.clear();
    bool previous_match = false;
    switch (behavior) {
      case Behavior::Isolated:
        merged = spans;
        break;
      case Behavior::Removed:
        for (const auto& s : spans)
          if (!s.match) merged.push_back(s);
        break;
      case Behavior::MergedWithPrevious:
        for (const auto& s : spans) {
          if (s.match && !previous_match && !merged.empty())
            merged.back().e = s.e;
          else
            merged.push_back(s);
          previous_match = s.match;
        }
        break;
      case Behavior::MergedWithNext:
        for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
          if (it->match && !previous_match && !merged.empty())
            merged.back().b = it->b;
          else
            merged.push_back(*it);
          previous_match = it->match;
        }
        std::reverse(merged.begin(), merged.end());
        break;
      case Behavior::Contiguous:
        for (size_t i = 0; i < spans.size(); ++i) {
          if (i > 0 && spans[i].match == spans[i - 1].match)
            merged.back().e = spans[i].e;
          else
            merged.push_back(spans[i]);
        }
        break;
    }
    for (const auto& s : merged) {
      if (s.e > s.b) out.push_back(piece.substr(s.b, s.e - s.b));
    }
  }
  if (step.byte_level) {
    const auto& map = ByteUnicodeMap::get();
    for (auto& piece : out) piece = map.encode(piece);
  }
  pieces = std::move(out);
}

void HfPipeline::encode_plain(std::string_view text, std::vector<int64_t>& out) const {
  std::vector<std::string> pieces{std::string(text)};
  for (const Step& step : steps_) apply_step(step, pieces);
  for (const auto& piece : pieces) model_->encode(piece, out);
}

std::vector<int64_t> HfPipeline::encode(std::string_view text) const {
  std::vector<int64_t> ids(prefix_);
  ids.reserve(text.size() / 3 + prefix_.size() + suffix_.size());
  for (const TextSegment& seg : matcher_.split(text)) {
    if (seg.token_id >= 0)
      ids.push_back(seg.token_id);
    else
      encode_plain(seg.text, ids);
  }
  ids.insert(ids.end(), suffix_.begin(), suffix_.end());
  return ids;
}

std::string HfPipeline::decode(const std::vector<int64_t>& ids) const {
  const auto& map = ByteUnicodeMap::get();
  std::string bytes;
  bool first = true;
  for (int64_t id : ids) {
    const std::string* tok = nullptr;
    if (auto it = added_by_id_.find(id); it != added_by_id_.end())
      tok = &it->second;
    else
      tok = model_->id_to_token(id);
    if (!tok) continue;  // HuggingFace drops ids it does not know
    if (byte_level_decoder_) {
      if (!map.decode(*tok, bytes)) bytes += *tok;
    } else {
      if (!first) bytes.push_back(' ');
      bytes += *tok;
    }
    first = false;
  }
  return utf8_lossy(bytes);
}

}  // namespace megatron
