// convert_checkpoint: HuggingFace <-> megatron.cpp checkpoints for the GPT-2 and Llama families
// (Llama, Mistral, Qwen2, Qwen3).
//
//   HF -> megatron.cpp (written as "release", loadable with pretrain_gpt --load / --finetune):
//     build/bin/convert_checkpoint --from hf --load /path/to/hf_model --save ckpt
//   megatron.cpp -> HF (config.json + model.safetensors):
//     build/bin/convert_checkpoint --from megatron --load ckpt --save /path/to/hf_out
//
// An HF folder holds config.json and model.safetensors, or shards listed in
// model.safetensors.index.json. The round trip is exact (fp32); the HF config travels inside the
// checkpoint's metadata so it comes back unchanged.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>

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

nlohmann::json read_json(const fs::path& p) {
  std::ifstream in(p);
  MG_CHECK(in.good(), "cannot read {}", p.string());
  try {
    return nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    MG_CHECK(false, "{} is not valid JSON: {}", p.string(), e.what());
  }
  return {};
}

// The HF weights: one model.safetensors or the shards of model.safetensors.index.json.
struct HFWeights {
  std::map<std::string, std::shared_ptr<safetensors::File>> by_tensor;
  explicit HFWeights(const fs::path& dir) {
    const fs::path single = dir / "model.safetensors", index = dir / "model.safetensors.index.json";
    if (fs::exists(index)) {
      nlohmann::json j = read_json(index);
      MG_CHECK(j.contains("weight_map"), "{} has no weight_map", index.string());
      std::map<std::string, std::shared_ptr<safetensors::File>> files;
      for (const auto& [name, file] : j["weight_map"].items()) {
        auto& f = files[file.get<std::string>()];
        if (!f) f = std::make_shared<safetensors::File>((dir / file.get<std::string>()).string());
        by_tensor[name] = f;
      }
    } else {
      MG_CHECK(fs::exists(single), "{} has neither model.safetensors nor model.safetensors.index.json", dir.string());
      auto f = std::make_shared<safetensors::File>(single.string());
      for (const std::string& n : f->names()) by_tensor[n] = f;
    }
  }
  Tensor get(const std::string& name) const {
    auto it = by_tensor.find(name);
    MG_CHECK(it != by_tensor.end(), "the HF checkpoint has no tensor '{}'", name);
    return it->second->read(name, DType::Float32);
  }
};

// pretrain_gpt's model arguments for a TransformerConfig (stored in the checkpoint's metadata):
// model_arguments.inc's mapping back from the config, and what an HF model has no flag for.
Arguments arguments_for(const TransformerConfig& c) {
  Arguments a = model_arguments_from_config(c);
  a.seq_length = c.max_position_embeddings;  // an HF config has no training length
  a.vocab_size = c.vocab_size;
  return a;
}

int convert_hf_to_megatron(const fs::path& load, const fs::path& save, int divisible_by) {
  nlohmann::json hf_config = read_json(load / "config.json");
  HFModelInfo info = config_from_hf(hf_config, divisible_by);
  HFWeights weights(load);
  Progress progress("reading HF tensors", weights.by_tensor.size());
  TensorMap state = hf_to_megatron(info, [&](const std::string& n) {
    Tensor t = weights.get(n);
    progress.tick(t.nbytes());
    return t;
  });
  GPTModel model(info.config);
  load_model_state_dict(model, state, load.string());
  Arguments args = arguments_for(info.config);
  save_model_checkpoint(save.string(), model, args, /*release=*/true, {{"hf_config", hf_config}});
  std::fprintf(stderr, "[convert] wrote %s/release (%lld parameters, padded vocabulary %d)\n", save.c_str(),
               (long long)model.params().numel(), info.config.padded_vocab_size);
  return 0;
}

int convert_megatron_to_hf(const fs::path& load, const fs::path& save) {
  std::string dir;
  nlohmann::json meta = read_checkpoint_metadata(load.string(), &dir);
  Arguments args;
  apply_checkpoint_args(args, load.string());
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
    info.family = config.gated_linear_unit ? HFFamily::Llama : HFFamily::GPT2;
    info.model_type = config.qk_layernorm ? "qwen3" : info.family == HFFamily::Llama ? "llama" : "gpt2";
    info.config = config;
    const std::string architecture = info.model_type == "qwen3" ? "Qwen3ForCausalLM" : "LlamaForCausalLM";
    hf_config = info.family == HFFamily::Llama
                    ? nlohmann::json{{"model_type", info.model_type},
                                     {"architectures", {architecture}},
                                     {"hidden_size", config.hidden_size},
                                     {"intermediate_size", config.ffn_hidden_size},
                                     {"num_hidden_layers", config.num_layers},
                                     {"num_attention_heads", config.num_attention_heads},
                                     {"num_key_value_heads", config.num_query_groups},
                                     {"head_dim", config.kv_channels},
                                     {"rms_norm_eps", config.layernorm_epsilon},
                                     {"rope_theta", config.rotary_base},
                                     {"max_position_embeddings", config.max_position_embeddings},
                                     {"vocab_size", config.vocab_size},
                                     {"hidden_act", "silu"},
                                     {"attention_bias", config.add_qkv_bias},
                                     {"tie_word_embeddings", config.share_embeddings_and_output_weights}}
                    : nlohmann::json{{"model_type", "gpt2"},
                                     {"architectures", {"GPT2LMHeadModel"}},
                                     {"n_embd", config.hidden_size},
                                     {"n_layer", config.num_layers},
                                     {"n_head", config.num_attention_heads},
                                     {"n_inner", config.ffn_hidden_size},
                                     {"n_positions", config.max_position_embeddings},
                                     {"vocab_size", config.vocab_size},
                                     {"layer_norm_epsilon", config.layernorm_epsilon},
                                     {"activation_function", "gelu_new"},
                                     {"tie_word_embeddings", true}};
    MG_CHECK(config.normalization == (info.family == HFFamily::Llama ? "RMSNorm" : "LayerNorm") &&
                 config.position_embedding_type == (info.family == HFFamily::Llama ? "rope" : "learned_absolute") &&
                 !(config.qk_layernorm && info.family == HFFamily::GPT2),
             "this checkpoint's architecture has no HuggingFace equivalent (GPT-2: LayerNorm, GeLU, learned "
             "positions; Llama: RMSNorm, SwiGLU, RoPE; Qwen3: Llama with --qk-layernorm)");
  }
  TensorMap hf = megatron_to_hf(info, model_state_dict(model));
  fs::create_directories(save);
  std::vector<std::pair<std::string, Tensor>> tensors(hf.begin(), hf.end());
  Progress progress("writing HF tensors", tensors.size());
  for (const auto& [name, t] : tensors) progress.tick(t.nbytes());
  safetensors::write((save / "model.safetensors").string(), tensors, {{"format", "pt"}});
  const fs::path config_path = save / "config.json", tmp = save / "config.json.tmp";
  {
    std::ofstream out(tmp);
    out << hf_config.dump(2) << "\n";
    MG_CHECK(out.good(), "cannot write {}", tmp.string());
  }
  fs::rename(tmp, config_path);
  std::fprintf(stderr, "[convert] wrote %s (model.safetensors, config.json)\n", save.c_str());
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
    try {
      app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      return app.exit(e);
    }
    return from == "hf" ? convert_hf_to_megatron(load, save, divisible_by) : convert_megatron_to_hf(load, save);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
