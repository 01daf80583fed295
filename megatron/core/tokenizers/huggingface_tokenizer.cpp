// HuggingFaceTokenizer: locating the tokenizer files of a folder the way AutoTokenizer does.
#include "megatron/core/tokenizers/huggingface_tokenizer.h"

#include <filesystem>

#include "megatron/core/tokenizers/identifiers.h"
#include "megatron/runtime/check.h"

namespace megatron {

namespace fs = std::filesystem;

namespace {

// tokenizer_config.json, with special_tokens_map.json filling the roles it does not name.
nlohmann::json read_config(const fs::path& dir) {
  nlohmann::json config = nlohmann::json::object();
  if (fs::exists(dir / "tokenizer_config.json")) {
    config = read_json_file((dir / "tokenizer_config.json").string(), "tokenizer config");
    MG_CHECK(config.is_object(), "'{}' is not a JSON object", (dir / "tokenizer_config.json").string());
  }
  if (fs::exists(dir / "special_tokens_map.json")) {
    auto map = read_json_file((dir / "special_tokens_map.json").string(), "special tokens map");
    if (map.is_object()) {
      for (const auto& [key, value] : map.items()) {
        if (!config.contains(key)) config[key] = value;
      }
    }
  }
  return config;
}

}  // namespace

HuggingFaceTokenizer::HuggingFaceTokenizer(const std::string& path, const std::string& vocab_file,
                                           const std::string& merge_file)
    : path_(path), vocab_file_(vocab_file), merge_file_(merge_file) {
  MG_CHECK(!path.empty(),
           "HuggingFaceTokenizer needs --tokenizer-model (a folder with tokenizer.json, or with "
           "vocab.json + merges.txt)");
  fs::path p(path);
  MG_CHECK(fs::exists(p),
           "--tokenizer-model '{}' does not exist: pass a local HuggingFace tokenizer folder or tokenizer.json "
           "(megatron.cpp does not download from the Hub)",
           path);
  if (fs::is_regular_file(p)) {
    pipeline_ = HfPipeline::from_tokenizer_json(path, read_config(p.parent_path()));
    return;
  }
  const nlohmann::json config = read_config(p);
  if (fs::exists(p / "tokenizer.json")) {
    pipeline_ = HfPipeline::from_tokenizer_json((p / "tokenizer.json").string(), config);
    return;
  }
  const std::string vocab = !vocab_file.empty() ? vocab_file : (p / "vocab.json").string();
  const std::string merges = !merge_file.empty() ? merge_file : (p / "merges.txt").string();
  MG_CHECK(fs::exists(vocab) && fs::exists(merges),
           "--tokenizer-model folder '{}' has neither tokenizer.json nor vocab.json + merges.txt", path);
  const std::string cls = config.value("tokenizer_class", "GPT2Tokenizer");
  MG_CHECK(cls == "GPT2Tokenizer" || cls == "GPT2TokenizerFast",
           "--tokenizer-model folder '{}' has no tokenizer.json and its tokenizer_class is {}: only GPT-2 style "
           "vocab.json + merges.txt folders are read without tokenizer.json",
           path, cls);
  pipeline_ = HfPipeline::from_gpt2_files(vocab, merges, config);
}

int64_t HuggingFaceTokenizer::eod() const {
  auto eos = pipeline_->eos_id();
  MG_CHECK(eos.has_value(),
           "HuggingFace tokenizer '{}' has no eos_token, which Megatron uses as eod: set eos_token in its "
           "tokenizer_config.json",
           path_);
  return *eos;
}

nlohmann::ordered_json HuggingFaceTokenizer::unique_identifiers() const {
  return text_tokenizer_identifiers(path_, {{"vocab_file", py_str_or_none(vocab_file_)},
                                            {"merges_file", py_str_or_none(merge_file_)},
                                            {"additional_special_tokens", "[]"},
                                            {"use_fast", "True"},
                                            {"trust_remote_code", "False"},
                                            {"include_special_tokens", "True"}});
}

}  // namespace megatron
