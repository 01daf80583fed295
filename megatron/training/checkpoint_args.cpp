// The model arguments a checkpoint carries (Megatron's --use-checkpoint-args set) and the identity
// check a load makes against them; the checkpoint files themselves are checkpointing.cpp's.
#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <string_view>
#include <type_traits>

#include "megatron/runtime/check.h"
#include "megatron/training/checkpointing.h"

namespace megatron {

namespace fs = std::filesystem;

// The model arguments a checkpoint carries: model_arguments.inc's saved and identity rows, then
// vocab_size, tokenizer_type, bf16 and fp16 (not model flags, written by hand), and the tokenizer's
// vocab_file, merge_file and tokenizer_model where the run gave them. The keys are the
// field names; nlohmann::json orders them, so metadata.json does not depend on the table's order.
namespace {

enum class ModelArgCheckpoint { none, recorded, saved, identity };

// "--norm-epsilon" of "--norm-epsilon,--layernorm-epsilon".
std::string first_name(const char* flag) {
  const std::string f = flag;
  return f.substr(0, f.find(','));
}

// What an identity row compares. Note [Rotary checkpoints]: --position-embedding-type rope and yarn
// are one rotary embedding with two scalings, and the scalings are saved, not identity (as
// --rotary-base): a rope checkpoint may continue as yarn (context extension) and back.
template <typename T>
T identity_value(const char*, const T& value) {
  return value;
}
std::string identity_value(const char* key, const std::string& value) {
  return std::string_view(key) == "position_embedding_type" && value == "yarn" ? "rope" : value;
}

// A model_arguments.inc identity row: the checkpoint's value (its default when an older checkpoint
// lacks the key) must be this run's.
template <typename T>
void check_identity(const nlohmann::json& saved, const char* key, const char* flag, const T& fallback, const T& ours,
                    const fs::path& dir) {
  const T theirs = saved.contains(key) ? saved.at(key).get<T>() : fallback;
  MG_CHECK(identity_value(key, theirs) == identity_value(key, ours),
           "checkpoint {} was saved from another model: {} is {} there and {} in this run (give the checkpoint's "
           "model flags, or --use-checkpoint-args)",
           dir.string(), first_name(flag), nlohmann::json(theirs).dump(), nlohmann::json(ours).dump());
}

}  // namespace

void check_model_identity(const nlohmann::json& meta, const Arguments& a, const fs::path& dir) {
  if (!meta.contains("args")) return;
  const nlohmann::json& saved = meta.at("args");
#define MG_MODEL_ARG(flag, field, type, default_value, choices, config, checkpoint, help) \
  if constexpr (ModelArgCheckpoint::checkpoint == ModelArgCheckpoint::identity) {         \
    check_identity<type>(saved, #field, flag, default_value, a.field, dir);               \
  }
#include "megatron/training/model_arguments.inc"
#undef MG_MODEL_ARG
}

void check_given_model_args(const nlohmann::json& meta, const Arguments& a, const std::vector<std::string>& given,
                            const fs::path& dir) {
  if (!meta.contains("args")) return;
  const nlohmann::json& saved = meta.at("args");
  auto was_given = [&](const char* flags) {
    std::string_view rest(flags);
    while (!rest.empty()) {
      const size_t comma = rest.find(',');
      const std::string_view name = rest.substr(0, comma);
      if (std::find(given.begin(), given.end(), name) != given.end()) return true;
      rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
    }
    return false;
  };
#define MG_MODEL_ARG(flag, field, type, default_value, choices, config, checkpoint, help)                          \
  if constexpr (ModelArgCheckpoint::checkpoint == ModelArgCheckpoint::saved ||                                     \
                ModelArgCheckpoint::checkpoint == ModelArgCheckpoint::identity) {                                  \
    if (was_given(flag) && saved.contains(#field)) {                                                               \
      const type theirs = saved.at(#field).get<type>();                                                            \
      MG_CHECK(identity_value(#field, theirs) == identity_value(#field, a.field),                                  \
               "{} {} does not match the checkpoint's {} ({}): drop the flag, or pass the checkpoint's value",     \
               first_name(flag), nlohmann::json(a.field).dump(), nlohmann::json(theirs).dump(), dir.string());   \
    }                                                                                                              \
  }
#include "megatron/training/model_arguments.inc"
#undef MG_MODEL_ARG
}

nlohmann::json model_args_to_json(const Arguments& a) {
  nlohmann::json j = nlohmann::json::object();
#define MG_MODEL_ARG(flag, field, type, default_value, choices, config, checkpoint, help) \
  if constexpr (ModelArgCheckpoint::checkpoint != ModelArgCheckpoint::none) j[#field] = a.field;
#include "megatron/training/model_arguments.inc"
#undef MG_MODEL_ARG
  j["vocab_size"] = a.vocab_size;
  j["tokenizer_type"] = a.tokenizer_type;
  j["bf16"] = a.bf16;
  j["fp16"] = a.fp16;
  // The tokenizer's files, absolute, where the run gave them: the HF export copies them
  // (tools/convert_checkpoint). Not taken with --use-checkpoint-args: the run's tokenizer flags win.
  for (const auto& [key, path] : {std::pair<const char*, const std::string*>{"vocab_file", &a.vocab_file},
                                  {"merge_file", &a.merge_file},
                                  {"tokenizer_model", &a.tokenizer_model}}) {
    if (!path->empty()) j[key] = fs::absolute(*path).lexically_normal().string();
  }
  return j;
}

namespace {
void apply_checkpoint_args_checked(Arguments& a, const std::string& load_dir, bool with_recorded) {
  std::string dir;
  nlohmann::json meta;
  try {
    meta = read_checkpoint_metadata(load_dir, &dir);
  } catch (const Error& e) {
    MG_CHECK(false, "--use-checkpoint-args: {}", e.what());
  }
  MG_CHECK(meta.contains("args"), "{} has no \"args\": the checkpoint is corrupt or not from megatron.cpp",
           (fs::path(dir) / "metadata.json").string());
  const nlohmann::json& m = meta.at("args");
  auto set = [&](const char* key, auto& field) {
    if (m.contains(key)) field = m.at(key).get<std::decay_t<decltype(field)>>();
  };
#define MG_MODEL_ARG(flag, field, type, default_value, choices, config, checkpoint, help) \
  if constexpr (ModelArgCheckpoint::checkpoint != ModelArgCheckpoint::none) {                       \
    if (with_recorded || ModelArgCheckpoint::checkpoint != ModelArgCheckpoint::recorded) set(#field, a.field); \
  }
#include "megatron/training/model_arguments.inc"
#undef MG_MODEL_ARG
  // The run's tokenizer wins; bf16/fp16 are the run's choice.
  if (a.vocab_size == 0) set("vocab_size", a.vocab_size);
  if (a.tokenizer_type.empty()) set("tokenizer_type", a.tokenizer_type);
}
}  // namespace

void apply_checkpoint_args(Arguments& a, const std::string& load_dir, bool with_recorded) {
  try {
    apply_checkpoint_args_checked(a, load_dir, with_recorded);
  } catch (const nlohmann::json::exception& e) {
    MG_CHECK(false,
             "--use-checkpoint-args: the checkpoint in {} has a model argument of an unexpected type ({}): the "
             "checkpoint is corrupt",
             load_dir, e.what());
  }
}

}  // namespace megatron
