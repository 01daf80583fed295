#include "megatron/core/inference/chat_template.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "megatron/runtime/check.h"
#include "third_party/minja/minja/chat-template.hpp"

namespace megatron {

namespace fs = std::filesystem;

ChatTemplate::ChatTemplate(const std::string& source, const std::string& bos_token, const std::string& eos_token) {
  try {
    impl_ = std::make_unique<minja::chat_template>(source, bos_token, eos_token);
  } catch (const std::exception& e) {
    MG_CHECK(false, "the chat template does not parse: {}", e.what());
  }
}

ChatTemplate::~ChatTemplate() = default;
ChatTemplate::ChatTemplate(ChatTemplate&&) noexcept = default;
ChatTemplate& ChatTemplate::operator=(ChatTemplate&&) noexcept = default;

namespace {

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  MG_CHECK(in.good(), "cannot read '{}'", p.string());
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// A special token in tokenizer_config.json: a string, or an AddedToken object {"content": ...}.
std::string special_token(const nlohmann::json& config, const char* key) {
  if (!config.contains(key)) return "";
  const nlohmann::json& t = config.at(key);
  if (t.is_string()) return t.get<std::string>();
  if (t.is_object() && t.contains("content") && t.at("content").is_string()) return t.at("content").get<std::string>();
  return "";
}

}  // namespace

std::optional<ChatTemplate> ChatTemplate::from_tokenizer_folder(const std::string& path) {
  fs::path dir(path);
  if (fs::is_regular_file(dir)) dir = dir.parent_path();
  if (!fs::is_directory(dir)) return std::nullopt;
  nlohmann::json config = nlohmann::json::object();
  if (fs::exists(dir / "tokenizer_config.json")) {
    try {
      config = nlohmann::json::parse(read_text(dir / "tokenizer_config.json"));
    } catch (const nlohmann::json::exception& e) {
      MG_CHECK(false, "'{}' is not valid JSON: {}", (dir / "tokenizer_config.json").string(), e.what());
    }
  }
  std::string source;
  if (config.contains("chat_template")) {
    const nlohmann::json& t = config.at("chat_template");
    if (t.is_string()) {
      source = t.get<std::string>();
    } else if (t.is_array()) {  // [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
      for (const nlohmann::json& named : t)
        if (named.value("name", "") == "default") source = named.value("template", "");
      MG_CHECK(!source.empty(), "'{}' lists chat templates but none named \"default\"",
               (dir / "tokenizer_config.json").string());
    } else {
      MG_CHECK(t.is_null(), "'{}': chat_template must be a string or a list of named templates",
               (dir / "tokenizer_config.json").string());
    }
  }
  if (source.empty() && fs::exists(dir / "chat_template.jinja")) source = read_text(dir / "chat_template.jinja");
  if (source.empty()) return std::nullopt;
  return ChatTemplate(source, special_token(config, "bos_token"), special_token(config, "eos_token"));
}

std::string ChatTemplate::render(const nlohmann::ordered_json& messages, bool add_generation_prompt) const {
  minja::chat_template_inputs inputs;
  inputs.messages = messages;
  inputs.add_generation_prompt = add_generation_prompt;
  minja::chat_template_options options;
  options.apply_polyfills = false;
  try {
    return impl_->apply(inputs, options);
  } catch (const std::exception& e) {
    MG_CHECK(false, "the chat template failed on these messages: {}", e.what());
  }
  return "";
}

}  // namespace megatron
