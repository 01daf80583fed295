#include "megatron/training/checkpointing.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "megatron/core/dist_checkpointing/safetensors.h"

namespace megatron {

namespace fs = std::filesystem;

namespace {

constexpr const char* kTracker = "latest_checkpointed_iteration.txt";
constexpr const char* kModelFile = "model_rank00000.safetensors";
constexpr const char* kOptimFile = "optim_rank00000.safetensors";
constexpr int kFormatVersion = 1;

void fsync_path(const fs::path& p) {
  int fd = ::open(p.c_str(), O_RDONLY);
  MG_CHECK(fd >= 0, "cannot open {} to sync it to disk", p.string());
  int rc = ::fsync(fd);
  ::close(fd);
  MG_CHECK(rc == 0, "fsync of {} failed: the disk may be full or failing", p.string());
}

void write_text_atomically(const fs::path& path, const std::string& text) {
  const fs::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    MG_CHECK(out.good(), "cannot write {}: check the directory exists and is writable", tmp.string());
    out << text;
    out.flush();
    MG_CHECK(out.good(), "writing {} failed: the disk may be full", tmp.string());
  }
  fsync_path(tmp);
  fs::rename(tmp, path);
  fsync_path(path.parent_path().empty() ? fs::path(".") : path.parent_path());
}

// A host snapshot of everything a checkpoint writes, so an async save can run while training goes on.
struct Snapshot {
  fs::path save_dir;
  std::string dir_name;
  std::string tracker_value;
  nlohmann::json metadata;
  std::vector<std::pair<std::string, Tensor>> model_tensors;
  std::vector<std::pair<std::string, Tensor>> optim_tensors;
};

Tensor host_copy(const Tensor& t) { return t.to(Device::cpu()); }

nlohmann::json tensor_entry(const Tensor& t, const char* file) {
  return {{"shape", t.shape()},
          {"dtype", std::string(to_string(t.dtype()))},
          {"shards",
           nlohmann::json::array(
               {{{"file", file}, {"offsets", std::vector<int64_t>(t.shape().size(), 0)}, {"shape", t.shape()}}})}};
}

// Note [Fault injection]: MEGATRON_FAULT_INJECT=kill-during-save:N sends this process SIGKILL in the
// middle of its N-th checkpoint write — after the tensors are on disk, before the rename — so the
// atomicity test can show that a crash there leaves the previous checkpoint as the latest.
void maybe_inject_fault() {
  static std::atomic<int> saves{0};
  const char* spec = std::getenv("MEGATRON_FAULT_INJECT");
  const std::string prefix = "kill-during-save:";
  if (!spec || std::string(spec).rfind(prefix, 0) != 0) return;
  if (++saves == std::atoi(spec + prefix.size())) ::kill(::getpid(), SIGKILL);
}

void write_snapshot(const Snapshot& s) {
  const fs::path final_dir = s.save_dir / s.dir_name;
  const fs::path tmp_dir = s.save_dir / fmt::format("{}.tmp-{}", s.dir_name, ::getpid());
  fs::remove_all(tmp_dir);
  fs::create_directories(tmp_dir);
  safetensors::write((tmp_dir / kModelFile).string(), s.model_tensors, {{"format", "megatron.cpp"}});
  if (!s.optim_tensors.empty()) {
    safetensors::write((tmp_dir / kOptimFile).string(), s.optim_tensors, {{"format", "megatron.cpp"}});
  }
  maybe_inject_fault();
  write_text_atomically(tmp_dir / "metadata.json", s.metadata.dump(2));
  fsync_path(tmp_dir);
  if (fs::exists(final_dir)) {  // overwriting the same iteration: move the old one aside first
    const fs::path old = s.save_dir / fmt::format("{}.old-{}", s.dir_name, ::getpid());
    fs::rename(final_dir, old);
    fs::rename(tmp_dir, final_dir);
    fs::remove_all(old);
  } else {
    fs::rename(tmp_dir, final_dir);
  }
  fsync_path(s.save_dir);
  write_text_atomically(s.save_dir / kTracker, s.tracker_value);
}

const nlohmann::json& require(const nlohmann::json& j, const char* key, const fs::path& file) {
  MG_CHECK(j.contains(key), "{} has no \"{}\": the checkpoint is corrupt or not from megatron.cpp", file.string(), key);
  return j.at(key);
}

// Reads latest_checkpointed_iteration.txt; nullopt when there is no checkpoint.
std::optional<std::pair<std::string, int64_t>> read_tracker(const fs::path& load_dir) {
  const fs::path tracker = load_dir / kTracker;
  if (!fs::exists(tracker)) return std::nullopt;
  std::ifstream in(tracker);
  std::string value;
  in >> value;
  MG_CHECK(!value.empty(), "{} is empty: the checkpoint tracker is corrupt", tracker.string());
  if (value == "release") return std::make_pair(std::string("release"), int64_t(0));
  int64_t iteration = 0;
  try {
    size_t used = 0;
    iteration = std::stoll(value, &used);
    MG_CHECK(used == value.size() && iteration >= 0, "");
  } catch (...) {
    MG_CHECK(false, "{} holds '{}', expected an iteration number or 'release'", tracker.string(), value);
  }
  return std::make_pair(checkpoint_dir_name(iteration), iteration);
}

nlohmann::json read_metadata(const fs::path& dir) {
  const fs::path meta = dir / "metadata.json";
  MG_CHECK(fs::exists(meta), "checkpoint {} is incomplete: it has no metadata.json", dir.string());
  std::ifstream in(meta);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    MG_CHECK(false, "{} is not valid JSON ({}): the checkpoint is corrupt", meta.string(), e.what());
  }
  MG_CHECK(j.value("format", "") == "megatron.cpp", "{} is not a megatron.cpp checkpoint", meta.string());
  MG_CHECK(j.value("version", 0) == kFormatVersion, "{} has format version {}, this build reads {}", meta.string(),
           j.value("version", 0), kFormatVersion);
  return j;
}

}  // namespace

std::string checkpoint_dir_name(int64_t iteration, bool release) {
  return release ? "release" : fmt::format("iter_{:07d}", iteration);
}

nlohmann::json model_args_to_json(const Arguments& a) {
  return {{"num_layers", a.num_layers},
          {"hidden_size", a.hidden_size},
          {"ffn_hidden_size", a.ffn_hidden_size},
          {"num_attention_heads", a.num_attention_heads},
          {"kv_channels", a.kv_channels},
          {"group_query_attention", a.group_query_attention},
          {"num_query_groups", a.num_query_groups},
          {"seq_length", a.seq_length},
          {"max_position_embeddings", a.max_position_embeddings},
          {"make_vocab_size_divisible_by", a.make_vocab_size_divisible_by},
          {"untie_embeddings_and_output_weights", a.untie_embeddings_and_output_weights},
          {"disable_bias_linear", a.disable_bias_linear},
          {"add_qkv_bias", a.add_qkv_bias},
          {"normalization", a.normalization},
          {"norm_epsilon", a.norm_epsilon},
          {"swiglu", a.swiglu},
          {"position_embedding_type", a.position_embedding_type},
          {"rotary_base", a.rotary_base},
          {"rotary_percent", a.rotary_percent},
          {"rotary_interleaved", a.rotary_interleaved},
          {"apply_layernorm_1p", a.apply_layernorm_1p},
          {"vocab_size", a.vocab_size},
          {"tokenizer_type", a.tokenizer_type},
          {"bf16", a.bf16},
          {"fp16", a.fp16}};
}

void apply_checkpoint_args(Arguments& a, const std::string& load_dir) {
  auto latest = read_tracker(load_dir);
  MG_CHECK(latest.has_value(), "--use-checkpoint-args: no checkpoint in {} (no {})", load_dir, kTracker);
  const fs::path dir = fs::path(load_dir) / latest->first;
  nlohmann::json meta = read_metadata(dir);
  const nlohmann::json& m = require(meta, "args", dir / "metadata.json");
  auto set = [&](const char* key, auto& field) {
    if (m.contains(key)) field = m.at(key).get<std::decay_t<decltype(field)>>();
  };
  set("num_layers", a.num_layers);
  set("hidden_size", a.hidden_size);
  set("ffn_hidden_size", a.ffn_hidden_size);
  set("num_attention_heads", a.num_attention_heads);
  set("kv_channels", a.kv_channels);
  set("group_query_attention", a.group_query_attention);
  set("num_query_groups", a.num_query_groups);
  set("seq_length", a.seq_length);
  set("max_position_embeddings", a.max_position_embeddings);
  set("make_vocab_size_divisible_by", a.make_vocab_size_divisible_by);
  set("untie_embeddings_and_output_weights", a.untie_embeddings_and_output_weights);
  set("disable_bias_linear", a.disable_bias_linear);
  set("add_qkv_bias", a.add_qkv_bias);
  set("normalization", a.normalization);
  set("norm_epsilon", a.norm_epsilon);
  set("swiglu", a.swiglu);
  set("position_embedding_type", a.position_embedding_type);
  set("rotary_base", a.rotary_base);
  set("rotary_percent", a.rotary_percent);
  set("rotary_interleaved", a.rotary_interleaved);
  set("apply_layernorm_1p", a.apply_layernorm_1p);
  if (a.vocab_size == 0) set("vocab_size", a.vocab_size);
  if (a.tokenizer_type.empty()) set("tokenizer_type", a.tokenizer_type);
}

Checkpointer::~Checkpointer() {
  if (pending_.valid()) {
    try {
      pending_.get();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "error: background checkpoint save failed: %s\n", e.what());
    }
  }
}

void Checkpointer::finalize() {
  if (pending_.valid()) pending_.get();
}

void Checkpointer::save(Context& ctx, const GPTModel& model, const AdamOptimizer* optimizer,
                        const OptimizerParamScheduler* scheduler, const TrainingProgress& progress, bool release,
                        const nlohmann::json& extra) {
  MG_CHECK(!args_.save.empty(), "saving a checkpoint needs --save");
  finalize();  // one save in flight at a time
  ctx.synchronize();
  Snapshot s;
  s.save_dir = args_.save;
  fs::create_directories(s.save_dir);
  s.dir_name = checkpoint_dir_name(progress.iteration, release);
  s.tracker_value = release ? "release" : std::to_string(progress.iteration);
  nlohmann::json tensors = nlohmann::json::object();
  for (const Parameter* p : model.params().parameters()) {
    s.model_tensors.emplace_back(p->name, host_copy(p->data));
    tensors[p->name] = tensor_entry(p->data, kModelFile);
  }
  nlohmann::json meta = {{"format", "megatron.cpp"},
                         {"version", kFormatVersion},
                         {"iteration", progress.iteration},
                         {"consumed_train_samples", progress.consumed_train_samples},
                         {"consumed_valid_samples", progress.consumed_valid_samples},
                         {"floating_point_operations_so_far", progress.floating_point_operations_so_far},
                         {"args", model_args_to_json(args_)}};
  if (scheduler) meta["opt_param_scheduler"] = scheduler->state_dict();
  if (optimizer && !args_.no_save_optim) {
    meta["optimizer"] = optimizer->state_dict();
    for (const Parameter& p : optimizer->parameters()) {
      const AdamParamState& st = optimizer->state(p.name);
      for (const auto& [suffix, t] : {std::pair<const char*, const Tensor*>{"master", &st.master},
                                      {"exp_avg", &st.exp_avg},
                                      {"exp_avg_sq", &st.exp_avg_sq}}) {
        const std::string key = p.name + "." + suffix;
        s.optim_tensors.emplace_back(key, host_copy(*t));
        tensors[key] = tensor_entry(*t, kOptimFile);
      }
    }
  }
  if (!args_.no_save_rng) meta["rng"] = {{"seed", ctx.rng().seed}, {"offset", ctx.rng().offset}};
  for (const auto& [key, value] : extra.items()) meta[key] = value;
  meta["tensors"] = std::move(tensors);
  s.metadata = std::move(meta);
  if (args_.async_save) {
    pending_ = std::async(std::launch::async, [snap = std::move(s)] { write_snapshot(snap); });
  } else {
    write_snapshot(s);
  }
}

std::optional<TrainingProgress> Checkpointer::load(Context& ctx, const std::string& load_dir, GPTModel& model,
                                                   AdamOptimizer* optimizer, OptimizerParamScheduler* scheduler) {
  auto latest = read_tracker(load_dir);
  if (!latest) {
    MG_CHECK(!args_.exit_on_missing_checkpoint, "--exit-on-missing-checkpoint: no checkpoint in {}", load_dir);
    return std::nullopt;
  }
  const bool release = latest->first == "release";
  const fs::path dir = fs::path(load_dir) / latest->first;
  const nlohmann::json meta = read_metadata(dir);
  const nlohmann::json& entries = require(meta, "tensors", dir / "metadata.json");

  // Model weights: every parameter must be there with its shape (else: another model).
  safetensors::File model_file((dir / kModelFile).string());
  for (Parameter* p : model.params().parameters()) {
    MG_CHECK(entries.contains(p->name), "checkpoint {} has no tensor '{}': it was saved from another model",
             dir.string(), p->name);
    const Shape shape = entries[p->name].at("shape").get<Shape>();
    MG_CHECK(shape == p->data.shape(),
             "checkpoint {} was saved from another model: tensor '{}' has shape {} there, {} in this model",
             dir.string(), p->name, shape_str(shape), shape_str(p->data.shape()));
    p->data.copy_from(model_file.read(p->name));
  }

  TrainingProgress progress;
  const bool finetune = args_.finetune || release;
  if (!finetune) {
    progress.iteration = meta.value("iteration", int64_t(0));
    progress.consumed_train_samples = meta.value("consumed_train_samples", int64_t(0));
    progress.consumed_valid_samples = meta.value("consumed_valid_samples", int64_t(0));
    progress.floating_point_operations_so_far = meta.value("floating_point_operations_so_far", 0.0);
  }
  if (optimizer) {
    const bool load_optim = !finetune && !args_.no_load_optim && meta.contains("optimizer");
    if (load_optim) {
      safetensors::File optim_file((dir / kOptimFile).string());
      for (const Parameter& p : optimizer->parameters()) {
        AdamParamState& st = optimizer->state(p.name);
        st.master.copy_from(optim_file.read(p.name + ".master"));
        st.exp_avg.copy_from(optim_file.read(p.name + ".exp_avg"));
        st.exp_avg_sq.copy_from(optim_file.read(p.name + ".exp_avg_sq"));
      }
      optimizer->load_state_dict(meta.at("optimizer"));
      optimizer->copy_main_params_to_model_params();
    } else {
      optimizer->reload_model_params();
    }
  }
  if (scheduler && !finetune && meta.contains("opt_param_scheduler")) {
    scheduler->load_state_dict(meta.at("opt_param_scheduler"));
  }
  if (!finetune && !args_.no_load_rng && meta.contains("rng")) {
    ctx.rng().seed = meta["rng"].at("seed").get<uint64_t>();
    ctx.rng().offset = meta["rng"].at("offset").get<uint64_t>();
  }
  return progress;
}

nlohmann::json read_checkpoint_metadata(const std::string& load_dir, std::string* checkpoint_dir) {
  auto latest = read_tracker(load_dir);
  MG_CHECK(latest.has_value(), "no checkpoint in {} (no {})", load_dir, kTracker);
  const fs::path dir = fs::path(load_dir) / latest->first;
  if (checkpoint_dir) *checkpoint_dir = dir.string();
  return read_metadata(dir);
}

void save_model_checkpoint(const std::string& save_dir, const GPTModel& model, const Arguments& args, bool release,
                           const nlohmann::json& extra) {
  Arguments a = args;
  a.save = save_dir;
  a.async_save = false;
  a.no_save_rng = true;
  Checkpointer ck(a);
  Context ctx;
  ck.save(ctx, model, nullptr, nullptr, TrainingProgress{}, release, extra);
}

}  // namespace megatron
