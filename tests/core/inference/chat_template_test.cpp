// ChatTemplate (minja): a HuggingFace-style template renders as transformers' apply_chat_template
// does (the expected string was rendered by transformers 5 from the same template and messages),
// a template's raise_exception is an error with its message, and a tokenizer folder's
// tokenizer_config.json gives the template (a string or the "default" of a named list) or none.
#include "megatron/core/inference/chat_template.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "megatron/runtime/check.h"

namespace megatron {
namespace {

using nlohmann::ordered_json;

const char* kTemplate =
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) and "
    "message['role'] != 'system' %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] | trim + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ "
    "'<|im_start|>assistant\\n' }}{% endif %}";

TEST(ChatTemplate, RendersAsTransformers) {
  ChatTemplate t(kTemplate, "<s>", "</s>");
  const ordered_json messages = ordered_json::parse(
      R"([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "2+2?"}])");
  EXPECT_EQ(t.render(messages, true),
            "<s><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
            "<|im_start|>assistant\n");
  EXPECT_EQ(t.render(ordered_json::parse(R"([{"role": "user", "content": " x "}])"), false),
            "<s><|im_start|>user\nx<|im_end|>\n");
  try {
    t.render(ordered_json::parse(R"([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])"), true);
    FAIL() << "the template's raise_exception did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("Conversation roles must alternate"), std::string::npos) << e.what();
  }
  EXPECT_THROW(ChatTemplate("{% for m in messages %}", "", ""), Error);
}

TEST(ChatTemplate, FromTokenizerFolder) {
  const auto dir = std::filesystem::temp_directory_path() / ("chat_template_test_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  auto write = [&](const nlohmann::json& config) { std::ofstream(dir / "tokenizer_config.json") << config.dump(); };
  write({{"eos_token", "</s>"}});
  EXPECT_FALSE(ChatTemplate::from_tokenizer_folder(dir.string()).has_value());
  write({{"bos_token", {{"content", "<B>"}}}, {"chat_template", "{{ bos_token }}{{ messages[0]['content'] }}"}});
  auto t = ChatTemplate::from_tokenizer_folder(dir.string());
  ASSERT_TRUE(t.has_value());
  EXPECT_EQ(t->render(ordered_json::parse(R"([{"role": "user", "content": "q"}])"), true), "<B>q");
  write({{"chat_template", {{{"name", "tool_use"}, {"template", "T"}}, {{"name", "default"}, {"template", "D"}}}}});
  EXPECT_EQ(ChatTemplate::from_tokenizer_folder(dir.string())->render(ordered_json::array(), true), "D");
  write({{"chat_template", {{{"name", "tool_use"}, {"template", "T"}}}}});
  EXPECT_THROW(ChatTemplate::from_tokenizer_folder(dir.string()), Error);
  std::ofstream(dir / "tokenizer_config.json") << "{not json";
  EXPECT_THROW(ChatTemplate::from_tokenizer_folder(dir.string()), Error);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace megatron
