// ChatTemplate: a HuggingFace tokenizer's chat template (tokenizer_config.json "chat_template"),
// rendered as transformers' apply_chat_template renders it (tokenize=False), with google/minja
// (third_party/minja), a C++ Jinja2 subset built for these templates. bos_token and eos_token are
// the config's strings; minja's polyfills (a system role folded into the first user message, tool
// calls) are off, so a template renders what it says, as in transformers. Kept apart from the
// server so that minja's large header is compiled in one place.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

namespace minja {
class chat_template;
}

namespace megatron {

class ChatTemplate {
 public:
  ChatTemplate(const std::string& source, const std::string& bos_token, const std::string& eos_token);
  ~ChatTemplate();
  ChatTemplate(ChatTemplate&&) noexcept;
  ChatTemplate& operator=(ChatTemplate&&) noexcept;

  /// The template of a HuggingFace tokenizer folder (--tokenizer-model, or the folder of its
  /// tokenizer.json): tokenizer_config.json's chat_template (a string, or a list of named templates,
  /// of which "default" is taken), else chat_template.jinja beside it; nullopt when it has none.
  /// A config that cannot be read or a template that does not parse is a megatron::Error.
  static std::optional<ChatTemplate> from_tokenizer_folder(const std::string& path);

  /// Renders `messages` ([{"role": ..., "content": ...}, ...]). A template that raises (e.g. roles
  /// that do not alternate) is a megatron::Error with its message.
  std::string render(const nlohmann::ordered_json& messages, bool add_generation_prompt) const;

 private:
  std::unique_ptr<minja::chat_template> impl_;
};

}  // namespace megatron
