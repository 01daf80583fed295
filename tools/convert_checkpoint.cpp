// convert_checkpoint: HuggingFace <-> megatron.cpp checkpoints for the GPT-2 and Llama families
// (Llama, Mistral, Qwen2, Qwen3) and the mixture-of-experts models Mixtral, Qwen2-MoE and Qwen3-MoE
// (one HF tensor per expert; Note [HF mixture of experts] in hf_mapping.h).
//
//   HF -> megatron.cpp (written as "release", loadable with pretrain_gpt --load / --finetune):
//     build/bin/convert_checkpoint --from hf --load /path/to/hf_model --save ckpt
//   megatron.cpp -> HF (config.json + model.safetensors):
//     build/bin/convert_checkpoint --from megatron --load ckpt --save /path/to/hf_out
//
// An HF folder holds config.json and model.safetensors, or shards listed in
// model.safetensors.index.json (read either way; written as shards of at most --max-shard-size). The round trip is exact (fp32); the HF config travels inside the
// checkpoint's metadata so it comes back unchanged.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>

#include "megatron/core/dist_checkpointing/safetensors.h"
#include "megatron/core/models/gpt/hf_mapping.h"
#include "megatron/training/checkpointing.h"

using namespace megatron;
namespace fs = std::filesystem;

namespace {

// Reports conversion progress about once a second and at the end.
class Progress {
 public:
  Progress(std::string what, size_t total) : what_(std::move(what)), total_(total) {}
  void tick(size_t bytes) {
    ++done_;
    bytes_ += bytes;
    auto now = std::chrono::steady_clock::now();
    if (done_ == total_ || now - last_ > std::chrono::seconds(1)) {
      std::fprintf(stderr, "[convert] %s: %zu/%zu tensors, %.1f MB\n", what_.c_str(), done_, total_,
                   double(bytes_) / 1e6);
      last_ = now;
    }
  }

 private:
  std::string what_;
  size_t total_, done_ = 0, bytes_ = 0;
  std::chrono::steady_clock::time_point last_ = std::chrono::steady_clock::now();
};

// pretrain_gpt's model arguments for a TransformerConfig (stored in the checkpoint's metadata):
// model_arguments.inc's mapping back from the config, and what an HF model has no flag for.
Arguments arguments_for(const TransformerConfig& c) {
  Arguments a = model_arguments_from_config(c);
  a.seq_length = c.max_position_embeddings;  // an HF config has no training length
  a.vocab_size = c.vocab_size;
  return a;
}

// "5GB", "500MB", "2GiB", "1000" (bytes) -> bytes, as HF's max_shard_size reads them.
int64_t parse_size(const std::string& text) {
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  const std::string unit = text.substr(used);
  static const std::map<std::string, double> units = {{"", 1},     {"B", 1},      {"KB", 1e3},         {"MB", 1e6},
                                                      {"GB", 1e9}, {"KiB", 1024}, {"MiB", 1048576.0}, {"GiB", 1073741824.0}};
  auto it = units.find(unit);
  MG_CHECK(used > 0 && value > 0 && it != units.end(), "--max-shard-size '{}' is not a size such as 5GB or 500MB", text);
  return int64_t(value * it->second);
}

// model.safetensors when everything fits in one shard of max_shard_bytes, else
// model-0000k-of-0000n.safetensors with model.safetensors.index.json (HF's save_pretrained layout).
void write_hf_weights(const fs::path& save, const TensorMap& hf, int64_t max_shard_bytes) {
  std::vector<std::vector<std::pair<std::string, Tensor>>> shards(1);
  int64_t bytes = 0, total = 0;
  for (const auto& [name, t] : hf) {
    const int64_t n = int64_t(t.nbytes());
    if (!shards.back().empty() && bytes + n > max_shard_bytes) shards.emplace_back(), bytes = 0;
    shards.back().emplace_back(name, t);
    bytes += n, total += n;
  }
  Progress progress("writing HF tensors", hf.size());
  if (shards.size() == 1) {
    for (const auto& [name, t] : shards[0]) progress.tick(t.nbytes());
    safetensors::write((save / "model.safetensors").string(), shards[0], {{"format", "pt"}});
    return;
  }
  nlohmann::json weight_map = nlohmann::json::object();
  for (size_t k = 0; k < shards.size(); ++k) {
    const std::string file = fmt::format("model-{:05d}-of-{:05d}.safetensors", k + 1, shards.size());
    for (const auto& [name, t] : shards[k]) weight_map[name] = file, progress.tick(t.nbytes());
    safetensors::write((save / file).string(), shards[k], {{"format", "pt"}});
  }
  std::ofstream out(save / "model.safetensors.index.json");
  out << nlohmann::json{{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}}.dump(2) << "\n";
  MG_CHECK(out.good(), "cannot write {}", (save / "model.safetensors.index.json").string());
}

int convert_hf_to_megatron(const fs::path& load, const fs::path& save, int divisible_by) {
  HFFolder folder(load.string());
  const nlohmann::json& hf_config = folder.config();
  HFModelInfo info = config_from_hf(hf_config, divisible_by);
  Progress progress("reading HF tensors", folder.tensor_names().size());
  std::set<std::string> read;
  TensorMap state = hf_to_megatron(info, [&](const std::string& n) {
    Tensor t = folder.get(n);
    read.insert(n);
    progress.tick(t.nbytes());
    return t;
  });
  // Nothing is dropped silently: a tensor the model does not read is an error (another model, or a
  // config that does not describe the weights), except the buffers older transformers versions
  // saved (rotary inverse frequencies, GPT-2's causal masks), which are named and skipped.
  std::vector<std::string> skipped;
  for (const std::string& n : folder.tensor_names()) {
    if (read.count(n)) continue;
    const bool buffer = n.ends_with(".rotary_emb.inv_freq") || n.ends_with(".attn.bias") ||
                        n.ends_with(".attn.masked_bias") || (n == "lm_head.weight" && info.config.share_embeddings_and_output_weights);
    MG_CHECK(buffer,
             "the HF checkpoint {} has tensor '{}' that a {} model of its config.json does not use: check the config "
             "(e.g. the number of layers or experts) or the folder",
             load.string(), n, info.model_type);
    skipped.push_back(n);
  }
  if (!skipped.empty()) {
    std::fprintf(stderr, "[convert] skipped %zu buffer tensor(s) the model recomputes (e.g. %s)\n", skipped.size(),
                 skipped.front().c_str());
  }
  GPTModel model(info.config);
  load_model_state_dict(model, state, load.string());
  Arguments args = arguments_for(info.config);
  save_model_checkpoint(save.string(), model, args, /*release=*/true, {{"hf_config", hf_config}});
  std::fprintf(stderr, "[convert] wrote %s/release (%lld parameters, padded vocabulary %d)\n", save.c_str(),
               (long long)model.params().numel(), info.config.padded_vocab_size);
  return 0;
}

int convert_megatron_to_hf(const fs::path& load, const fs::path& save, int64_t max_shard_bytes) {
  std::string dir;
  nlohmann::json meta = read_checkpoint_metadata(load.string(), &dir);
  Arguments args;
  apply_checkpoint_args(args, load.string(), /*with_recorded=*/true);
  args.no_load_rng = args.no_load_optim = true;
  MG_CHECK(args.vocab_size > 0, "checkpoint {} does not record its vocabulary size", dir);
  if (args.max_position_embeddings == 0) args.max_position_embeddings = args.seq_length;
  TransformerConfig config = transformer_config_from_args(args, args.vocab_size);
  GPTModel model(config);
  Checkpointer checkpointer(args);
  Context ctx;
  checkpointer.load(ctx, load.string(), model, nullptr, nullptr);

  HFModelInfo info;
  nlohmann::json hf_config;
  if (meta.contains("hf_config")) {
    hf_config = meta["hf_config"];
    info = config_from_hf(hf_config, config.make_vocab_size_divisible_by);
  } else {
    hf_config = hf_config_from_megatron(config);
    info = config_from_hf(hf_config, config.make_vocab_size_divisible_by);
    info.config = config;
  }
  TensorMap hf = megatron_to_hf(info, model_state_dict(model));
  fs::create_directories(save);
  write_hf_weights(save, hf, max_shard_bytes);
  const fs::path config_path = save / "config.json", tmp = save / "config.json.tmp";
  {
    std::ofstream out(tmp);
    out << hf_config.dump(2) << "\n";
    MG_CHECK(out.good(), "cannot write {}", tmp.string());
  }
  fs::rename(tmp, config_path);
  std::fprintf(stderr, "[convert] wrote %s (config.json and the weights)\n", save.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    std::string from, load, save;
    int divisible_by = 128;
    CLI::App app("Convert between HuggingFace and megatron.cpp checkpoints");
    app.add_option("--from", from, "hf or megatron")->required()->check(CLI::IsMember({"hf", "megatron"}));
    app.add_option("--load", load, "Source: HF folder or megatron.cpp checkpoint directory")->required();
    app.add_option("--save", save, "Destination directory")->required();
    app.add_option("--make-vocab-size-divisible-by", divisible_by, "Vocabulary padding (HF -> megatron)")
        ->capture_default_str();
    std::string max_shard_size = "5GB";
    app.add_option("--max-shard-size", max_shard_size,
                   "Largest HF weight file (megatron -> HF); more weights go to shards listed in "
                   "model.safetensors.index.json")
        ->capture_default_str();
    try {
      app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      return app.exit(e);
    }
    return from == "hf" ? convert_hf_to_megatron(load, save, divisible_by) : convert_megatron_to_hf(load, save, parse_size(max_shard_size));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
