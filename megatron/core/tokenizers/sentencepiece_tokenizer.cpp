// SentencePiece tokenizers on libsentencepiece (encoding through one processor is thread-safe).
#include "megatron/core/tokenizers/sentencepiece_tokenizer.h"

#include <sentencepiece_processor.h>

#include <filesystem>

#include "megatron/core/tokenizers/identifiers.h"
#include "megatron/runtime/check.h"

namespace megatron {

namespace {
std::optional<int64_t> valid(int id) { return id >= 0 ? std::optional<int64_t>(id) : std::nullopt; }
}  // namespace

SentencePieceTokenizer::SentencePieceTokenizer(const std::string& model_file)
    : model_file_(model_file), sp_(std::make_unique<sentencepiece::SentencePieceProcessor>()) {
  MG_CHECK(!model_file.empty(), "SentencePiece tokenizers need --tokenizer-model (a SentencePiece .model file)");
  MG_CHECK(std::filesystem::is_regular_file(model_file),
           "--tokenizer-model '{}' does not exist: pass a SentencePiece .model file", model_file);
  const auto status = sp_->Load(model_file);
  MG_CHECK(status.ok(), "--tokenizer-model '{}' is not a SentencePiece model ({}): pass an intact .model file",
           model_file, status.ToString());
}

SentencePieceTokenizer::~SentencePieceTokenizer() = default;

std::vector<int64_t> SentencePieceTokenizer::tokenize(std::string_view text) const {
  std::vector<int> ids;
  const auto status = sp_->Encode(text, &ids);
  MG_CHECK(status.ok(), "SentencePiece encode failed: {}", status.ToString());
  return {ids.begin(), ids.end()};
}

std::string SentencePieceTokenizer::detokenize(const std::vector<int64_t>& ids) const {
  std::vector<int> v;
  v.reserve(ids.size());
  for (int64_t id : ids) {
    MG_CHECK(id >= 0 && id < sp_->GetPieceSize(), "id {} is outside the SentencePiece vocab of {}", id,
             sp_->GetPieceSize());
    v.push_back(int(id));
  }
  std::string text;
  const auto status = sp_->Decode(v, &text);
  MG_CHECK(status.ok(), "SentencePiece decode failed: {}", status.ToString());
  return text;
}

// Decoding a text strips the space of its first piece's "\u2581" (the dummy prefix); inside a text
// the piece keeps it.
std::string SentencePieceTokenizer::token_text(int64_t id) const {
  std::string text = detokenize({id});
  static const std::string kSpace = "\xE2\x96\x81";  // U+2581
  if (sp_->IdToPiece(int(id)).rfind(kSpace, 0) == 0 && text.rfind(' ', 0) != 0) text.insert(0, " ");
  return text;
}

int64_t SentencePieceTokenizer::vocab_size() const { return sp_->GetPieceSize(); }
int64_t SentencePieceTokenizer::eod() const { return sp_->eos_id(); }
std::optional<int64_t> SentencePieceTokenizer::bos() const { return valid(sp_->bos_id()); }
std::optional<int64_t> SentencePieceTokenizer::eos() const { return valid(sp_->eos_id()); }
std::optional<int64_t> SentencePieceTokenizer::pad() const { return valid(sp_->pad_id()); }

nlohmann::ordered_json SentencePieceTokenizer::unique_identifiers() const {
  return text_tokenizer_identifiers(model_file_, {{"legacy", "False"}, {"special_tokens", "None"}});
}

}  // namespace megatron
