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
// model.safetensors.index.json (read either way; written as shards of at most --max-shard-size).
// The weights keep their dtype both ways (bf16 stays bf16; --bf16, --fp16 or --fp32 choose: Note
// [Converted weights' dtype]) and the round trip is exact; the HF config travels inside the
// checkpoint's metadata so it comes back unchanged. A model trained here exports as the HF type that
// computes what it computes, or is refused in one line naming the flag HF cannot express (Note [Which
// HF model a checkpoint exports as] in hf_config.cpp); its weights keep the run's dtype, and the
// tokenizer files the run used are copied in HF's layout, with generation_config.json giving its
// bos/eos ids.
//
// Note [Streaming conversion]
// Neither direction holds a model: the memory is one output tensor's sources, in their stored dtype.
// A mapping (hf_to_megatron / megatron_to_hf) hands each output tensor to a TensorSink as soon as it
// is made; sources are read from the memory-mapped files a chunk at a time, their pages dropped (Note
// [Bounded reads] in safetensors.h); each tensor is written at its place in the output file
// (safetensors::Writer, any order) and freed. A safetensors header lists every tensor before the
// data, so the mapping runs twice: a planning pass over uninitialised source tensors of the right
// shapes and dtypes (slices, row pieces and row blocks never touch them) records each output's name
// and shape and which sources were read, then the writing pass. Nothing is assembled: fused and
// padded tensors (QKV, [gate; up], the padded vocabulary) and split ones (q, k, v out of the fused
// QKV, interleaved RoPE's rows in HF's order) travel as row views of their source (RowParts), converted
// to the file's dtype a chunk at a time when the dtypes differ; GPT-2's Conv1D transposes are made in
// row blocks of about 4 MiB as the writer takes them (RowParts::Blocks), and GPT-OSS's stacked
// experts [E, ...] one expert at a time (each expert's slice computed in fp32); DeepSeek's MTP copies
// of the embedding and head are compared with the originals a chunk at a time from the files. So a
// tensor costs its source alone (1x the largest tensor, measured: docs/architecture.md). Left
// assembled: DeepSeek's interleaved rope rows (a copy of q_b_proj / kv_a_proj, small next to the
// embedding). Large blocks are mmapped by malloc so that a freed tensor leaves the resident set at once.
#include <fmt/format.h>
#include <malloc.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <utility>

#include "megatron/core/dist_checkpointing/safetensors.h"
#include "megatron/core/dist_checkpointing/sharded.h"
#include "megatron/core/models/gpt/hf_deepseek.h"
#include "megatron/core/models/gpt/hf_mapping.h"
#include "megatron/core/tokenizers/tokenizer.h"
#include "megatron/training/checkpointing.h"

using namespace megatron;
namespace fs = std::filesystem;

namespace {

// Reports conversion progress about once a second and at the end.
class Progress {
 public:
  Progress(std::string what, size_t total) : what_(std::move(what)), total_(total) {}
  void tick(size_t bytes, size_t count = 1) {
    done_ += count;
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
// model_arguments.inc's mapping back from the config, and what an HF model has no flag for. The
// weights' dtype is recorded as Megatron's converter records md.params_dtype: --bf16 / --fp16.
Arguments arguments_for(const TransformerConfig& c) {
  Arguments a = model_arguments_from_config(c);
  a.seq_length = c.max_position_embeddings;  // an HF config has no training length
  a.vocab_size = c.vocab_size;
  a.bf16 = c.params_dtype == DType::BFloat16;
  a.fp16 = c.params_dtype == DType::Float16;
  return a;
}

// Note [Converted weights' dtype]
// Megatron's converter saves in the params dtype it is given (its HF loaders take --bf16 / --fp16,
// else fp32). Here the default is the source's own, tensor by tensor: an HF import writes each
// tensor in the dtype of the HF tensors it is made from (bf16 stays bf16; where they differ, fp32,
// which holds both exactly), so a bf16 folder with fp32 norms or an fp32 router bias (DeepSeek's
// e_score_correction_bias) keeps both; the checkpoint records the dtype most of its weights have as
// its --bf16 / --fp16. An export writes the run's dtype (--bf16 / --fp16 of the checkpoint), or the
// stored dtype of a tensor's sources where that dtype cannot hold them (an fp32 buffer or norm of a
// bf16 checkpoint). The planning pass sees which sources each output reads (the reads since the
// previous output). --bf16, --fp16 or --fp32 write every tensor in that dtype instead (rounding to
// nearest even where they narrow; the norms of --apply-layernorm-1p stay fp32 on export). A bf16
// checkpoint trains as before: loading converts each tensor to the run's parameter dtype, and without
// optimizer state the fp32 main parameters are built from the loaded weights (the optimizer's
// reload_model_params), so an fp32 or --bf16 run starts from the same values as from an fp32
// checkpoint of the same weights (tests/functional/convert_test.cpp).

// Whether every value of dtype `from` is a value of `to`.
bool holds(DType to, DType from) { return to == from || to == DType::Float32; }

// The dtype that holds every one of `dtypes` exactly (fp32 when they differ; `otherwise` when empty).
DType holding(const std::set<DType>& dtypes, DType otherwise) {
  return dtypes.empty() ? otherwise : dtypes.size() == 1 ? *dtypes.begin() : DType::Float32;
}

// The dtype most of the planned values have.
DType dominant_dtype(const std::vector<safetensors::Writer::Spec>& plan) {
  std::map<DType, int64_t> values;
  for (const safetensors::Writer::Spec& t : plan) values[t.dtype] += shape_numel(t.shape);
  DType best = DType::Float32;
  for (const auto& [dtype, n] : values)
    if (n > values[best]) best = dtype;
  return best;
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
// model-0000k-of-0000n.safetensors with model.safetensors.index.json (HF's save_pretrained layout),
// from the planned tensors (by name); `produce` runs the mapping, each tensor going to its shard's
// writer (Note [Streaming conversion]). Progress is reported as tensors are written.
void write_hf_weights(const fs::path& save, const std::vector<safetensors::Writer::Spec>& plan, int64_t max_shard_bytes,
                      const std::function<void(TensorSink&)>& produce) {
  std::vector<std::vector<safetensors::Writer::Spec>> shards(1);
  int64_t bytes = 0, total = 0;
  for (const safetensors::Writer::Spec& t : plan) {
    const int64_t n = shape_numel(t.shape) * int64_t(size_of(t.dtype));
    if (!shards.back().empty() && bytes + n > max_shard_bytes) shards.emplace_back(), bytes = 0;
    shards.back().push_back(t);
    bytes += n, total += n;
  }
  std::vector<std::string> files;
  if (shards.size() == 1) files.push_back("model.safetensors");
  for (size_t k = 0; shards.size() > 1 && k < shards.size(); ++k)
    files.push_back(fmt::format("model-{:05d}-of-{:05d}.safetensors", k + 1, shards.size()));
  std::vector<std::unique_ptr<safetensors::Writer>> writers;
  std::map<std::string, safetensors::Writer*> writer_of;
  nlohmann::json weight_map = nlohmann::json::object();
  for (size_t k = 0; k < shards.size(); ++k) {
    writers.push_back(std::make_unique<safetensors::Writer>((save / files[k]).string(), shards[k],
                                                            safetensors::Metadata{{"format", "pt"}}));
    for (const safetensors::Writer::Spec& t : shards[k]) writer_of[t.name] = writers.back().get(), weight_map[t.name] = files[k];
  }
  Progress progress("writing HF tensors", plan.size());
  TensorSink sink([&](const std::string& name, RowParts t) {
    progress.tick(writer_of.at(name)->put(name, t.count(), [&](size_t k) { return t.piece(k); }, t.zero_rows));
  });
  produce(sink);
  for (auto& w : writers) w->commit();
  if (shards.size() == 1) return;
  std::ofstream out(save / "model.safetensors.index.json");
  out << nlohmann::json{{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}}.dump(2) << "\n";
  MG_CHECK(out.good(), "cannot write {}", (save / "model.safetensors.index.json").string());
}

void write_json(const fs::path& path, const nlohmann::json& j) {
  const fs::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp);
    out << j.dump(2) << "\n";
    MG_CHECK(out.good(), "cannot write {}", tmp.string());
  }
  fs::rename(tmp, path);
}

// HF's name of a dtype (config.json's torch_dtype).
std::string hf_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::BFloat16:
      return "bfloat16";
    case DType::Float16:
      return "float16";
    default:
      return "float32";
  }
}

// The dtype an HF tensor is written in: the run's (config.params_dtype: bf16 with --bf16, fp16 with
// --fp16, else fp32), converted from the fp32 values exactly: they hold values of that dtype. Note
// [Exporting zero-centered norms]: with --apply-layernorm-1p the norm weights are 1 + w, which
// bf16/fp16 would round (a stored w of 1e-3 becomes 1.0), so those stay fp32 and load exactly in fp32.
DType export_dtype(const std::string& name, const TransformerConfig& config) {
  const bool norm = name.ends_with("norm.weight") || name.ends_with("ln_1.weight") || name.ends_with("ln_2.weight") ||
                    name.ends_with("ln_f.weight");
  return config.layernorm_zero_centered_gamma && norm ? DType::Float32 : config.params_dtype;
}

// Note [Streaming conversion]: the planning pass. Runs `map` with sources that are uninitialised fp32
// tensors of the sources' shapes and returns each output's name and shape (dtype from `dtype_of`).
std::vector<safetensors::Writer::Spec> plan_outputs(const std::function<void(TensorSink&)>& map,
                                                    const std::function<DType(const std::string&)>& dtype_of) {
  std::vector<safetensors::Writer::Spec> plan;
  std::set<std::string> seen;
  TensorSink sink([&](const std::string& name, RowParts t) {
    MG_ASSERT(seen.insert(name).second, "the mapping produced '{}' twice", name);
    plan.push_back({name, dtype_of(name), t.shape()});
  });
  map(sink);
  std::sort(plan.begin(), plan.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  return plan;
}

// The tokenizer the run trained with: its type and files as the checkpoint recorded them, or null
// (with the reason in `why`) for a checkpoint without one (converted from HF) or whose files are gone.
std::unique_ptr<Tokenizer> open_run_tokenizer(const nlohmann::json& args, TokenizerArgs& t, std::string& why) {
  t.tokenizer_type = args.value("tokenizer_type", std::string());
  t.vocab_file = args.value("vocab_file", std::string());
  t.merge_file = args.value("merge_file", std::string());
  t.tokenizer_model = args.value("tokenizer_model", std::string());
  if (args.value("vocab_size", 0) > 0) t.vocab_size = args["vocab_size"].get<int64_t>();
  if (t.tokenizer_type.empty()) {
    why = "the checkpoint records no tokenizer";
    return nullptr;
  }
  try {
    return build_tokenizer(t);
  } catch (const std::exception& e) {
    why = fmt::format("the run's tokenizer ({}) cannot be opened: {}", t.tokenizer_type, e.what());
    return nullptr;
  }
}

// Copies the run's tokenizer files into the HF folder in HF's layout where there is a clear one.
void export_tokenizer_files(const TokenizerArgs& t, const fs::path& save, int64_t model_max_length) {
  std::vector<std::string> copied;
  auto copy = [&](const fs::path& from, const std::string& to) {
    fs::copy_file(from, save / to, fs::copy_options::overwrite_existing);
    copied.push_back(to);
  };
  if (t.tokenizer_type == "GPT2BPETokenizer") {
    // Megatron's GPT2BPETokenizer is HF's GPT2Tokenizer over the same vocab.json and merges.txt,
    // <|endoftext|> being bos, eos and unk, no special tokens added.
    copy(t.vocab_file, "vocab.json");
    copy(t.merge_file, "merges.txt");
    write_json(save / "tokenizer_config.json", {{"tokenizer_class", "GPT2Tokenizer"},
                                                {"bos_token", "<|endoftext|>"},
                                                {"eos_token", "<|endoftext|>"},
                                                {"unk_token", "<|endoftext|>"},
                                                {"add_prefix_space", false},
                                                {"model_max_length", model_max_length}});
    copied.push_back("tokenizer_config.json");
  } else if (t.tokenizer_type == "HuggingFaceTokenizer") {
    // The folder's tokenizer files as they are (AutoTokenizer reads them back); a tokenizer.json
    // given alone brings its folder's tokenizer_config.json and special_tokens_map.json.
    const fs::path model(t.tokenizer_model);
    const bool folder = fs::is_directory(model);
    const fs::path dir = folder ? model : model.parent_path();
    if (!folder) copy(model, "tokenizer.json");
    for (const std::string name : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                                   "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja"}) {
      if ((folder || name != "tokenizer.json") && fs::exists(dir / name)) copy(dir / name, name);
    }
    if (!t.vocab_file.empty()) copy(t.vocab_file, "vocab.json");
    if (!t.merge_file.empty()) copy(t.merge_file, "merges.txt");
  } else {
    std::fprintf(stderr,
                 "[convert] --tokenizer-type %s has no HuggingFace tokenizer layout this converter writes: only its "
                 "bos/eos ids are exported (config.json, generation_config.json)\n",
                 t.tokenizer_type.c_str());
    return;
  }
  std::string list;
  for (const std::string& f : copied) list += (list.empty() ? "" : ", ") + f;
  std::fprintf(stderr, "[convert] tokenizer (%s): wrote %s\n", t.tokenizer_type.c_str(), list.c_str());
}

int convert_hf_to_megatron(const fs::path& load, const fs::path& save, int divisible_by,
                           std::optional<DType> weights_dtype) {
  HFFolder folder(load.string());
  const nlohmann::json& hf_config = folder.config();
  HFModelInfo info = config_from_hf(folder, divisible_by);  // Note [HF DeepSeek-V3 MTP]: MTP when the folder has it
  if (info.family == HFFamily::DeepSeek) {
    // Compared a chunk at a time from the files (Note [Streaming conversion]).
    check_deepseek_mtp_copies(
        info, [&](const std::string& n) { return folder.shape(n); },
        [&](const std::string& a, const std::string& b) { return folder.same_bytes(a, b); });
  }
  // Planning pass (Note [Streaming conversion]): our tensors' shapes and the HF tensors they read.
  // Note [Converted weights' dtype]: each output in the dtype of the HF tensors read since the last
  // output (an output that read none, its sources read for an earlier one, gets fp32: exact).
  std::set<std::string> read;
  std::set<DType> pending;
  std::vector<safetensors::Writer::Spec> plan = plan_outputs(
      [&](TensorSink& sink) {
        hf_to_megatron(
            info,
            [&](const std::string& n) {
              read.insert(n);
              pending.insert(folder.dtype(n));
              return Tensor::empty(folder.shape(n), folder.dtype(n));
            },
            sink);
      },
      [&](const std::string&) {
        return weights_dtype ? *weights_dtype : holding(std::exchange(pending, {}), DType::Float32);
      });
  std::set<DType> folder_dtypes;
  for (const std::string& n : read) folder_dtypes.insert(folder.dtype(n));
  if (!weights_dtype && folder_dtypes.size() == 1) {  // one dtype: every output has it
    for (safetensors::Writer::Spec& t : plan) t.dtype = *folder_dtypes.begin();
  }
  info.config.params_dtype = dominant_dtype(plan);
  size_t others = 0;
  for (const safetensors::Writer::Spec& t : plan) others += t.dtype != info.config.params_dtype;
  std::fprintf(stderr, "[convert] weights written in %s%s (%s)\n", hf_dtype_name(info.config.params_dtype).c_str(),
               others ? fmt::format(", {} tensor(s) in float32 (their HF tensors' dtype)", others).c_str() : "",
               weights_dtype ? "as asked" : "the folder's tensors; --bf16, --fp16 or --fp32 choose");
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
  int64_t values = 0;
  for (const safetensors::Writer::Spec& t : plan) values += shape_numel(t.shape);
  Progress reading("reading HF tensors", read.size()), writing("writing tensors", plan.size());
  save_model_checkpoint(
      save.string(), plan,
      [&](safetensors::Writer& writer) {
        TensorSink sink([&](const std::string& name, RowParts t) {
          writing.tick(writer.put(name, t.count(), [&](size_t k) { return t.piece(k); }, t.zero_rows));
        });
        hf_to_megatron(
            info,
            [&](const std::string& n) {
              Tensor t = folder.read(n);  // in its stored dtype
              reading.tick(t.nbytes());
              return t;
            },
            sink);
      },
      arguments_for(info.config), /*release=*/true, {{"hf_config", hf_config}});
  std::fprintf(stderr, "[convert] wrote %s/release (%lld values in %zu tensors, padded vocabulary %d)\n", save.c_str(),
               (long long)values, plan.size(), info.config.padded_vocab_size);
  return 0;
}

int convert_megatron_to_hf(const fs::path& load, const fs::path& save, int64_t max_shard_bytes,
                           std::optional<DType> weights_dtype) {
  std::string dir;
  nlohmann::json meta = read_checkpoint_metadata(load.string(), &dir);
  Arguments args;
  apply_checkpoint_args(args, load.string(), /*with_recorded=*/true);
  args.no_load_rng = args.no_load_optim = true;
  const nlohmann::json saved_args = meta.value("args", nlohmann::json::object());
  TokenizerArgs tokenizer_args;
  std::string no_tokenizer;
  const std::unique_ptr<Tokenizer> tokenizer = open_run_tokenizer(saved_args, tokenizer_args, no_tokenizer);
  // A run with a tokenizer records no --vocab-size: the tokenizer's is the model's.
  if (args.vocab_size == 0 && tokenizer) args.vocab_size = int(tokenizer->vocab_size());
  MG_CHECK(args.vocab_size > 0,
           "checkpoint {} records neither its vocabulary size nor a tokenizer that can be opened: export a checkpoint "
           "of a run whose --tokenizer-model / --vocab-file still exist",
           dir);
  if (args.max_position_embeddings == 0) args.max_position_embeddings = args.seq_length;
  // The run's precision: the parameters are read (and exported) in the dtype they were trained in.
  args.bf16 = saved_args.value("bf16", false);
  args.fp16 = saved_args.value("fp16", false);
  TransformerConfig config = transformer_config_from_args(args, args.vocab_size);
  if (weights_dtype) config.params_dtype = *weights_dtype;  // Note [Converted weights' dtype]

  // The HF config first: a model HF cannot express is refused before anything is read or written.
  HFModelInfo info;
  nlohmann::json hf_config;
  if (meta.contains("hf_config")) {
    hf_config = meta["hf_config"];
    info = config_from_hf(hf_config, config.make_vocab_size_divisible_by);
    // The checkpoint says whether the model has MTP layers (an import from a folder without their
    // weights has none, whatever num_nextn_predict_layers says: Note [HF DeepSeek-V3 MTP]).
    MG_CHECK(config.mtp_num_layers == 0 || info.family == HFFamily::DeepSeek,
             "--mtp-num-layers {} has no HuggingFace export to {} (only deepseek_v3 stores MTP layers): export a "
             "checkpoint trained without MTP",
             config.mtp_num_layers, info.model_type);
    info.config.mtp_num_layers = config.mtp_num_layers;
    if (config.mtp_num_layers > 0) hf_config["num_nextn_predict_layers"] = config.mtp_num_layers;
  } else {
    hf_config = hf_config_from_megatron(config);
    info = config_from_hf(hf_config, config.make_vocab_size_divisible_by);
    info.config = config;
  }

  // Our tensors one at a time (the parameters and the MoE routers' expert biases, DeepSeek's
  // e_score_correction_bias), from files of any parallel layout, each file's checksum verified.
  const dist_checkpointing::ShardIndex index = open_model_weights(meta, dir);
  Progress reading(fmt::format("reading {}", dir), index.names().size());
  const TensorSource source{[&](const std::string& name) {
                              MG_CHECK(index.contains(name), "checkpoint {} has no tensor '{}' that a {} model needs",
                                       dir, name, info.model_type);
                              // In its stored dtype (Note [Streaming conversion]).
                              Tensor t = Tensor::empty(index.tensor(name).shape, index.tensor(name).dtype);
                              reading.tick(index.load_into(name, ShardSpec{}, t));
                              return t;
                            },
                            [&](const std::string& name) { return index.contains(name); }};
  std::set<DType> pending;  // the stored dtypes of the sources read since the last output
  const TensorSource planning{[&](const std::string& name) {
                                MG_CHECK(index.contains(name), "checkpoint {} has no tensor '{}' that a {} model needs",
                                         dir, name, info.model_type);
                                pending.insert(index.tensor(name).dtype);
                                return Tensor::empty(index.tensor(name).shape, index.tensor(name).dtype);
                              },
                              source.has};
  // Note [Streaming conversion]: the HF tensors' shapes first, then each written as it is made.
  // Note [Converted weights' dtype]: the run's dtype, or fp32 for sources it cannot hold.
  const auto plan = plan_outputs([&](TensorSink& sink) { megatron_to_hf(info, planning, sink); },
                                 [&](const std::string& name) {
                                   const std::set<DType> sources = std::exchange(pending, {});
                                   DType dtype = export_dtype(name, config);
                                   for (const DType s : sources)
                                     if (!weights_dtype && !holds(dtype, s)) dtype = DType::Float32;
                                   return dtype;
                                 });
  fs::create_directories(save);
  write_hf_weights(save, plan, max_shard_bytes, [&](TensorSink& sink) { megatron_to_hf(info, source, sink); });

  // config.json says the dtype of the weights written (an HF config that had no dtype and gets fp32
  // weights is left as it was, so an HF -> megatron.cpp -> HF round trip gives its config back).
  const std::string dtype = hf_dtype_name(config.params_dtype);
  if (hf_config.contains("dtype")) hf_config["dtype"] = dtype;
  if (hf_config.contains("torch_dtype") || !meta.contains("hf_config") || dtype != "float32") {
    hf_config["torch_dtype"] = dtype;
  }
  // The tokenizer's ids (eos: Megatron's eod where the tokenizer names no eos) in config.json and
  // generation_config.json, which HF's generate() reads.
  nlohmann::json generation = nlohmann::json::object();
  if (tokenizer) {
    export_tokenizer_files(tokenizer_args, save, args.seq_length);
    const std::optional<int64_t> eos = tokenizer->eos() ? tokenizer->eos() : tokenizer->eod();
    for (const auto& [key, id] :
         {std::pair{"bos_token_id", tokenizer->bos()}, {"eos_token_id", eos}, {"pad_token_id", tokenizer->pad()}}) {
      if (!id) continue;
      hf_config[key] = *id;
      generation[key] = *id;
    }
    write_json(save / "generation_config.json", generation);
  } else {
    std::fprintf(stderr, "[convert] %s: no tokenizer files or bos/eos ids written\n", no_tokenizer.c_str());
  }
  write_json(save / "config.json", hf_config);
  std::fprintf(stderr, "[convert] wrote %s (%s, config.json%s, %s weights)\n", save.c_str(),
               hf_config.value("model_type", "").c_str(), tokenizer ? ", generation_config.json" : "", dtype.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // Note [Streaming conversion]: blocks of 1 MiB and more are mmapped, so a freed tensor's memory
  // leaves the process at once instead of staying in the heap.
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
  try {
    std::string from, load, save;
    int divisible_by = 128;
    CLI::App app("Convert between HuggingFace and megatron.cpp checkpoints");
    app.add_option("--from", from, "hf or megatron")->required()->check(CLI::IsMember({"hf", "megatron"}));
    app.add_option("--load", load, "Source: HF folder or megatron.cpp checkpoint directory")->required();
    app.add_option("--save", save, "Destination directory")->required();
    app.add_option("--make-vocab-size-divisible-by", divisible_by, "Vocabulary padding (HF -> megatron)")
        ->capture_default_str();
    bool bf16 = false, fp16 = false, fp32 = false;
    auto* bf16_flag = app.add_flag("--bf16", bf16, "Write the weights in bf16 (default: the source's dtype)");
    auto* fp16_flag = app.add_flag("--fp16", fp16, "Write the weights in fp16 (default: the source's dtype)");
    app.add_flag("--fp32", fp32, "Write the weights in fp32 (default: the source's dtype)")
        ->excludes(bf16_flag)
        ->excludes(fp16_flag);
    bf16_flag->excludes(fp16_flag);
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
    const std::optional<DType> weights_dtype = bf16   ? std::optional(DType::BFloat16)
                                               : fp16 ? std::optional(DType::Float16)
                                               : fp32 ? std::optional(DType::Float32)
                                                      : std::nullopt;
    return from == "hf" ? convert_hf_to_megatron(load, save, divisible_by, weights_dtype)
                        : convert_megatron_to_hf(load, save, parse_size(max_shard_size), weights_dtype);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
