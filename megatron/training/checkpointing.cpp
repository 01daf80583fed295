#include "megatron/training/checkpointing.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>

#include "megatron/core/dist_checkpointing/safetensors.h"
#include "megatron/core/dist_checkpointing/sharded.h"
#include "megatron/core/fp8_utils.h"
#include "megatron/training/checkpoint_files.h"

namespace megatron {

namespace fs = std::filesystem;
using namespace checkpoint_detail;
using dist_checkpointing::ShardedTensor;
using dist_checkpointing::ShardIndex;

// A save's host snapshot: what this rank writes and, on the publishing rank (0), the metadata.
struct Checkpointer::SaveJob {
  fs::path save_dir;
  std::string dir_name;       // "iter_0000100"
  fs::path tmp_dir;           // Note [Atomic checkpoints]
  std::string tracker_value;  // "100"
  int rank = 0;               // the world rank: the files' suffix
  bool create_tmp_dir = true; // single process: the writer creates it (several ranks: rank 0 before)
  bool publish = true;        // rank 0: writes metadata.json, renames, updates the tracker
  bool has_optim = false;     // the checkpoint has optim_rank* files (on any rank)
  nlohmann::json metadata;    // without "tensors" (filled from the files when publishing)
  std::vector<ShardedTensor> model_tensors, optim_tensors;
  bool async = false;         // written on a background thread
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  uint64_t total_bytes = 0;   // of every rank's files, known after publishing
  size_t num_files = 0;
  std::vector<dist_checkpointing::SavedShardFile> written;  // this rank's files, once written
  std::map<std::string, uint64_t> checksums;  // publishing rank: every rank's files (Note [Checkpoint checksums])
  double seconds = 0;         // from the snapshot to the publication
};

namespace {

using Clock = std::chrono::steady_clock;


Tensor host_copy(const Tensor& t) { return t.to(Device::cpu()); }

// Note [FP8 parameters in checkpoints]: an FP8 weight (--fp8-param-gather) is saved in its model
// dtype (bf16, or fp32), rounded from the optimizer's fp32 master — the value the weight would have
// in a run without the flag, not the FP8 bytes dequantised — so FP8-parameter and plain
// checkpoints are interchangeable both ways; loading sets the masters from it (or from the
// optimizer state, when loaded) and quantises. Without an optimizer the FP8 data is dequantised.
Tensor fp8_param_value(Context& ctx, const Parameter& p, const AdamOptimizer* optimizer) {
  if (optimizer) return optimizer->gather_state(ctx, p.name).master.to(p.fp8->model_dtype);
  Tensor out = Tensor::empty(p.data.shape(), p.fp8->model_dtype, p.data.device());
  p.fp8->dequantize(ctx, p.data, out);
  return out;
}

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::string bytes_str(uint64_t bytes) {
  if (bytes >= uint64_t(1) << 30) return fmt::format("{:.2f} GB", double(bytes) / 1e9);
  if (bytes >= uint64_t(1) << 20) return fmt::format("{:.1f} MB", double(bytes) / 1e6);
  return fmt::format("{:.1f} kB", double(bytes) / 1e3);
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

// A vocabulary-sized tensor whose rows differ: the padding (a multiple of
// --make-vocab-size-divisible-by x TP) changed with the tensor-parallel size.
std::string vocabulary_hint(const std::string& name, const Shape& saved, const Shape& here) {
  const bool vocab = name.find("word_embeddings") != std::string::npos || name == "output_layer.weight";
  if (!vocab || saved.size() != 2 || here.size() != 2 || saved[1] != here[1]) return "";
  return fmt::format(" (the padded vocabulary is a multiple of --make-vocab-size-divisible-by x "
                     "--tensor-model-parallel-size: choose --make-vocab-size-divisible-by so that it is {} rows "
                     "again)",
                     saved[0]);
}

// metadata.json's table of tensors: global shape, dtype and where each piece is, from the files.
nlohmann::json tensor_table(const ShardIndex& index) {
  nlohmann::json table = nlohmann::json::object();
  for (const std::string& name : index.names()) {
    const ShardIndex::Global& g = index.tensor(name);
    nlohmann::json shards = nlohmann::json::array();
    for (const ShardIndex::Piece& p : g.pieces) {
      shards.push_back({{"file", fs::path(index.files()[p.file].path()).filename().string()},
                        {"offsets", p.box.global_offset},
                        {"shape", p.box.shape}});
    }
    table[name] = {{"shape", g.shape}, {"dtype", std::string(to_string(g.dtype))}, {"shards", std::move(shards)}};
  }
  return table;
}

// metadata.json's fields that every save writes (the rest: scheduler, optimizer, RNG, extra, tensors, checksums).
nlohmann::json base_metadata(const Arguments& args, const ParallelState* ps, const TrainingProgress& progress) {
  return {{"format", "megatron.cpp"},
          {"version", kFormatVersion},
          {"iteration", progress.iteration},
          {"consumed_train_samples", progress.consumed_train_samples},
          {"consumed_valid_samples", progress.consumed_valid_samples},
          {"floating_point_operations_so_far", progress.floating_point_operations_so_far},
          {"args", model_args_to_json(args)},
          {"parallel",
           {{"world_size", ps ? ps->world_size() : 1},
            {"tensor_model_parallel_size", ps ? ps->tp_size() : 1},
            {"pipeline_model_parallel_size", ps ? ps->pp_size() : 1},
            {"context_parallel_size", ps ? ps->cp_size() : 1},
            {"data_parallel_size", ps ? ps->dp_size() : 1},
            {"virtual_pipeline_model_parallel_size", ps ? ps->vpp_size() : 1},
            {"use_distributed_optimizer", args.use_distributed_optimizer}}}};
}

// This rank's files, into the temporary directory (any thread).
void write_files(Checkpointer::SaveJob& job) {
  if (job.create_tmp_dir) {
    fs::remove_all(job.tmp_dir);
    fs::create_directories(job.tmp_dir);
  }
  const safetensors::Metadata meta = {{"format", "megatron.cpp"}};
  job.written.clear();
  if (!job.model_tensors.empty())
    job.written.push_back(
        dist_checkpointing::save_shards(job.tmp_dir.string(), kModelStem, job.rank, job.model_tensors, meta));
  if (!job.optim_tensors.empty())
    job.written.push_back(
        dist_checkpointing::save_shards(job.tmp_dir.string(), kOptimStem, job.rank, job.optim_tensors, meta));
  for (const auto& f : job.written) job.checksums[f.file] = f.checksum;  // a single process: all of them
  maybe_inject_fault();
}

// Rank 0, after every rank's files are on disk: metadata.json, the rename, the tracker.
void publish(Checkpointer::SaveJob& job) {
  const fs::path final_dir = job.save_dir / job.dir_name;
  nlohmann::json meta = job.metadata;
  ShardIndex model(job.tmp_dir.string(), kModelStem);
  model.expect_checksums(job.checksums);  // every file on disk was written by a rank of this save
  nlohmann::json tensors = tensor_table(model);
  job.total_bytes = model.total_bytes();
  job.num_files = model.files().size();
  if (job.has_optim) {
    ShardIndex optim(job.tmp_dir.string(), kOptimStem);
    optim.expect_checksums(job.checksums);
    const nlohmann::json optim_tensors = tensor_table(optim);
    for (const auto& [key, value] : optim_tensors.items()) tensors[key] = value;
    job.total_bytes += optim.total_bytes();
    job.num_files += optim.files().size();
  }
  meta["tensors"] = std::move(tensors);
  nlohmann::json files = nlohmann::json::object();
  for (const auto& [file, checksum] : job.checksums) files[file] = fmt::format("{:016x}", checksum);
  meta["checksums"] = {{"algorithm", kChecksumAlgorithm}, {"files", std::move(files)}};
  write_text_atomically(job.tmp_dir / "metadata.json", meta.dump(2));
  fsync_path(job.tmp_dir);
  if (fs::exists(final_dir)) {  // overwriting the same iteration: move the old one aside first
    const fs::path old = job.save_dir / fmt::format("{}.old-{}", job.dir_name, ::getpid());
    fs::rename(final_dir, old);
    fs::rename(job.tmp_dir, final_dir);
    fs::remove_all(old);
  } else {
    fs::rename(job.tmp_dir, final_dir);
  }
  fsync_path(job.save_dir);
  write_text_atomically(job.save_dir / kTracker, job.tracker_value);
  job.seconds = seconds_since(job.start);
}

void report_save(const Checkpointer::SaveJob& job) {
  print_progress(fmt::format("  wrote checkpoint {} ({} in {} files) {} {:.3f} s", (job.save_dir / job.dir_name).string(),
                             bytes_str(job.total_bytes), job.num_files,
                             job.async ? "in the background, published after" : "in", job.seconds));
}

}  // namespace

Checkpointer::Checkpointer(const Arguments& args, const ParallelState* parallel) : args_(args), parallel_(parallel) {}

Checkpointer::~Checkpointer() {
  if (!pending_.valid()) return;
  try {
    pending_.get();
    if (distributed()) {
      std::fprintf(stderr, "warning: checkpoint %s was written but not published: call finalize() before exiting\n",
                   (job_->save_dir / job_->dir_name).c_str());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: background checkpoint save failed: %s\n", e.what());
  }
}

bool Checkpointer::all_ok(Context& ctx, bool ok) const {
  if (!distributed()) return ok;
  Tensor flag = Tensor::from_floats({ok ? 0.0f : 1.0f}, {1}, DType::Float32, ctx.device());
  parallel_->world().all_reduce(ctx, flag, ReduceOp::Max)->wait();
  ctx.synchronize();
  return flag.to_floats()[0] == 0.0f;
}

void Checkpointer::publish_collective(Context& ctx, SaveJob& job, std::exception_ptr write_error) {
  const std::string where = (job.save_dir / job.dir_name).string();
  auto discard = [&] {
    if (!job.publish) return;
    std::error_code ec;
    fs::remove_all(job.tmp_dir, ec);
  };
  if (!all_ok(ctx, !write_error)) {
    discard();
    if (write_error) std::rethrow_exception(write_error);
    MG_CHECK(false, "saving checkpoint {} failed on another rank (see its error); the previous checkpoint stays the "
             "latest", where);
  }
  gather_checksums(ctx, job);
  std::exception_ptr publish_error;
  if (job.publish) {
    try {
      publish(job);
    } catch (...) {
      publish_error = std::current_exception();
    }
  }
  if (!all_ok(ctx, !publish_error)) {
    discard();
    if (publish_error) std::rethrow_exception(publish_error);
    MG_CHECK(false, "rank 0 could not publish checkpoint {} (see its error); the previous checkpoint stays the latest",
             where);
  }
  if (job.publish) report_save(job);
}

// Every rank's file checksums to rank 0: each rank puts its (at most two) files' checksums as 16-bit
// pieces (exact in float32) into its own slots of a zero tensor; a sum over the world fills them all.
void Checkpointer::gather_checksums(Context& ctx, SaveJob& job) const {
  constexpr size_t kStems = 2, kSlot = 5;  // model, optim; present flag + four 16-bit pieces
  const size_t world = size_t(parallel_->world_size());
  std::vector<float> v(world * kStems * kSlot, 0.0f);
  for (const auto& f : job.written) {
    const size_t stem = f.file.rfind(kOptimStem, 0) == 0 ? 1 : 0;
    float* slot = &v[(size_t(job.rank) * kStems + stem) * kSlot];
    slot[0] = 1.0f;
    for (size_t k = 0; k < 4; ++k) slot[1 + k] = float((f.checksum >> (16 * k)) & 0xffff);
  }
  Tensor t = Tensor::from_floats(v, {int64_t(v.size())}, DType::Float32, ctx.device());
  parallel_->world().all_reduce(ctx, t, ReduceOp::Sum)->wait();
  ctx.synchronize();
  const std::vector<float> all = t.to_floats();
  job.checksums.clear();
  for (size_t r = 0; r < world; ++r) {
    for (size_t stem = 0; stem < kStems; ++stem) {
      const float* slot = &all[(r * kStems + stem) * kSlot];
      if (slot[0] != 1.0f) continue;
      uint64_t c = 0;
      for (size_t k = 0; k < 4; ++k) c |= uint64_t(slot[1 + k]) << (16 * k);
      job.checksums[dist_checkpointing::shard_file_name(stem == 0 ? kModelStem : kOptimStem, int(r))] = c;
    }
  }
}

void Checkpointer::finalize() {
  if (!pending_.valid()) return;
  std::exception_ptr error;
  try {
    pending_.get();
  } catch (...) {
    error = std::current_exception();
  }
  std::shared_ptr<SaveJob> job = std::move(job_);
  if (distributed()) {
    publish_collective(*pending_ctx_, *job, error);
    return;
  }
  if (error) std::rethrow_exception(error);
  report_save(*job);
}

void Checkpointer::save(Context& ctx, const ModelChunk& model, const AdamOptimizer* optimizer,
                        const OptimizerParamScheduler* scheduler, const TrainingProgress& progress, bool release,
                        const nlohmann::json& extra) {
  // The model's buffers (the MoE routers' expert biases) are saved with it, as training saves them.
  // buffers() hands out pointers for loading too, hence not const; saving only reads them.
  set_model_buffers(const_cast<ModelChunk&>(model).buffers());
  save(ctx, model.params().parameters(), optimizer, scheduler, progress, release, extra);
}

void Checkpointer::save(Context& ctx, const std::vector<Parameter*>& params, const AdamOptimizer* optimizer,
                        const OptimizerParamScheduler* scheduler, const TrainingProgress& progress, bool release,
                        const nlohmann::json& extra) {
  MG_CHECK(!args_.save.empty(), "saving a checkpoint needs --save");
  finalize();  // one save in flight at a time
  ctx.synchronize();
  auto job = std::make_shared<SaveJob>();
  job->save_dir = args_.save;
  job->dir_name = checkpoint_dir_name(progress.iteration, release);
  job->tracker_value = release ? "release" : std::to_string(progress.iteration);
  job->rank = rank();
  job->publish = rank() == 0;
  job->async = args_.async_save;

  // Note [Checkpoint ownership].
  const int tp_rank = distributed() ? parallel_->tp_rank() : 0;
  // Dense replicas span data × context parallelism: its rank (0, 0) writes.
  const bool dp_writer = !distributed() || (parallel_->dp_rank() == 0 && parallel_->cp_rank() == 0);
  const bool edp_writer = !distributed() || parallel_->edp_rank() == 0;
  // Dense parameters are written by data-context rank 0, experts by expert-data rank 0.
  auto writer = [&](const Parameter& p) { return p.reduce_group == GradReduceGroup::ExpertData ? edp_writer : dp_writer; };
  auto owned = [&](const Parameter& p) { return !p.shared_embedding_copy && !(p.tp_duplicate && tp_rank != 0); };
  for (const Parameter* p : params) {
    if (p->fp8) {
      // Collective over the weight's group with an optimizer: every rank of it calls (an expert's
      // group may span dense tensor-parallel ranks that do not own it).
      const Tensor value = fp8_param_value(ctx, *p, optimizer);
      if (owned(*p) && writer(*p)) job->model_tensors.push_back({p->name, host_copy(value), p->shard});
      continue;
    }
    if (!owned(*p)) continue;
    if (writer(*p)) job->model_tensors.push_back({p->name, host_copy(p->data), p->shard});
  }
  const int etp_rank = distributed() ? parallel_->etp_rank() : 0;
  for (const ModelBuffer& b : buffers_) {
    if (b.expert ? edp_writer && etp_rank == 0 : dp_writer && tp_rank == 0)
      job->model_tensors.push_back({b.name, host_copy(*b.tensor), ShardSpec{}});
  }
  const bool save_optim = optimizer && !args_.no_save_optim;
  job->has_optim = save_optim && !optimizer->parameters().empty();
  if (save_optim) {
    for (const Parameter& p : optimizer->parameters()) {
      if (!owned(p)) continue;  // the same on every rank of the data-parallel group
      const AdamParamState st = optimizer->gather_state(ctx, p.name);
      if (!writer(p)) continue;
      for (const auto& [suffix, t] : {std::pair<const char*, const Tensor*>{"master", &st.master},
                                      {"exp_avg", &st.exp_avg},
                                      {"exp_avg_sq", &st.exp_avg_sq}}) {
        job->optim_tensors.push_back({p.name + "." + suffix, host_copy(*t), p.shard});
      }
    }
  }

  if (job->publish) {
    nlohmann::json meta = base_metadata(args_, distributed() ? parallel_ : nullptr, progress);
    if (scheduler) meta["opt_param_scheduler"] = scheduler->state_dict();
    if (save_optim) meta["optimizer"] = optimizer->state_dict();
    if (!args_.no_save_rng) meta["rng"] = {{"seed", ctx.rng().seed}, {"offset", ctx.rng().offset}};
    for (const auto& [key, value] : extra.items()) meta[key] = value;
    job->metadata = std::move(meta);
  }

  if (!distributed()) {
    job->tmp_dir = job->save_dir / fmt::format("{}.tmp-{}", job->dir_name, ::getpid());
    fs::create_directories(job->save_dir);
    remove_stale_temporary_checkpoints(job->save_dir);
    auto write_and_publish = [job] {
      write_files(*job);
      publish(*job);
    };
    if (args_.async_save) {
      pending_ = std::async(std::launch::async, write_and_publish);
      job_ = std::move(job);
    } else {
      write_and_publish();
      report_save(*job);
    }
    return;
  }

  // Several ranks (Note [Atomic checkpoints]): rank 0 makes the temporary directory, named by its pid.
  Tensor pid = Tensor::from_floats({float(::getpid())}, {1}, DType::Float32, ctx.device());
  parallel_->world().broadcast(ctx, pid, 0)->wait();
  ctx.synchronize();
  job->tmp_dir = job->save_dir / fmt::format("{}.tmp-{}", job->dir_name, int64_t(pid.to_floats()[0]));
  job->create_tmp_dir = false;
  std::exception_ptr error;
  if (rank() == 0) {
    try {
      fs::create_directories(job->save_dir);
      fs::remove_all(job->tmp_dir);
      fs::create_directories(job->tmp_dir);
    } catch (...) {
      error = std::current_exception();
    }
  }
  if (!all_ok(ctx, !error)) {
    if (error) std::rethrow_exception(error);
    MG_CHECK(false, "rank 0 could not create checkpoint directory {} (see its error)", job->tmp_dir.string());
  }
  if (rank() == 0) remove_stale_temporary_checkpoints(job->save_dir);  // the others agreed: nothing of theirs
  if (args_.async_save) {
    pending_ = std::async(std::launch::async, [job] { write_files(*job); });
    job_ = std::move(job);
    pending_ctx_ = &ctx;
    return;
  }
  std::exception_ptr write_error;
  try {
    write_files(*job);
  } catch (...) {
    write_error = std::current_exception();
  }
  publish_collective(ctx, *job, write_error);
}

std::optional<TrainingProgress> Checkpointer::load(Context& ctx, const std::string& load_dir, ModelChunk& model,
                                                   AdamOptimizer* optimizer, OptimizerParamScheduler* scheduler) {
  set_model_buffers(model.buffers());  // the expert biases (and FP8 state) come back with the weights
  return load(ctx, load_dir, model.params().parameters(), optimizer, scheduler);
}

std::optional<TrainingProgress> Checkpointer::load(Context& ctx, const std::string& load_dir,
                                                   const std::vector<Parameter*>& params, AdamOptimizer* optimizer,
                                                   OptimizerParamScheduler* scheduler) {
  // A metadata.json that parses but holds a value of the wrong type somewhere deeper (the optimizer
  // or scheduler state) is a corrupt checkpoint too: one line, not a JSON library exception.
  try {
    return load_checked(ctx, load_dir, params, optimizer, scheduler);
  } catch (const nlohmann::json::exception& e) {
    MG_CHECK(false, "the checkpoint in {} has a metadata.json with an unexpected value ({}): the checkpoint is corrupt",
             load_dir, e.what());
  }
  return std::nullopt;
}

std::optional<TrainingProgress> Checkpointer::load_checked(Context& ctx, const std::string& load_dir,
                                                           const std::vector<Parameter*>& params,
                                                           AdamOptimizer* optimizer,
                                                           OptimizerParamScheduler* scheduler) {
  const Clock::time_point start = Clock::now();
  auto latest = read_tracker(load_dir);
  if (!latest) {
    MG_CHECK(!args_.exit_on_missing_checkpoint, "--exit-on-missing-checkpoint: no checkpoint in {}", load_dir);
    return std::nullopt;
  }
  const bool release = latest->first == "release";
  const fs::path dir = fs::path(load_dir) / latest->first;
  const nlohmann::json meta = read_metadata(dir);
  check_model_identity(meta, args_, dir);
  const TrainingProgress recorded = read_progress(meta, dir, latest->first, latest->second, release);
  // Note [Checkpoint checksums]: each file is verified the first time this rank reads from it.
  std::optional<std::map<std::string, uint64_t>> checksums;
  if (!args_.no_verify_checkpoint_checksums) checksums = recorded_checksums(meta, dir);

  // A failure that depends on the rank (a corrupt file that only some ranks read) fails every rank
  // at the next agreement, so that no rank is left waiting in a collective.
  auto agree = [&](std::exception_ptr error) {
    if (all_ok(ctx, !error)) return;
    if (error) std::rethrow_exception(error);
    MG_CHECK(false, "loading checkpoint {} failed on another rank (see its error)", dir.string());
  };

  // Model weights: every parameter must be there with its global shape (else: another model).
  uint64_t bytes = 0;
  double verify_seconds = 0;
  ShardIndex model_index(dir.string(), kModelStem);
  if (checksums) model_index.expect_checksums(*checksums);
  std::exception_ptr model_error;
  std::vector<std::pair<Parameter*, Tensor>> fp8_values;  // Note [FP8 parameters in checkpoints]
  try {
    for (Parameter* p : params) {
      MG_CHECK(model_index.contains(p->name), "checkpoint {} has no tensor '{}': it was saved from another model",
               dir.string(), p->name);
      const Shape& shape = model_index.tensor(p->name).shape;
      const Shape& want = p->shard.global_shape.empty() ? p->data.shape() : p->shard.global_shape;
      MG_CHECK(shape == want,
               "checkpoint {} was saved from another model: tensor '{}' has shape {} there, {} in this model{}",
               dir.string(), p->name, shape_str(shape), shape_str(want), vocabulary_hint(p->name, shape, want));
      if (p->fp8) {
        MG_CHECK(optimizer, "loading FP8 parameter '{}' (--fp8-param-gather) needs the optimizer", p->name);
        fp8_values.emplace_back(p, Tensor::empty(p->data.shape(), p->fp8->model_dtype, p->data.device()));
        bytes += model_index.load_into(p->name, p->shard, fp8_values.back().second);
        continue;
      }
      bytes += model_index.load_into(p->name, p->shard, p->data);
    }
    for (const ModelBuffer& b : buffers_) {
      if (b.optional && !model_index.contains(b.name)) continue;
      MG_CHECK(model_index.contains(b.name), "checkpoint {} has no tensor '{}': it was saved from another model",
               dir.string(), b.name);
      const Shape& shape = model_index.tensor(b.name).shape;
      MG_CHECK(shape == b.tensor->shape(), "checkpoint {}: '{}' has shape {} there, {} in this run{}", dir.string(),
               b.name, shape_str(shape), shape_str(b.tensor->shape()),
               b.name.find("amax_history") != std::string::npos ? " (another --fp8-amax-history-len)" : "");
      bytes += model_index.load_into(b.name, ShardSpec{}, *b.tensor);
    }
  } catch (...) {
    model_error = std::current_exception();
  }
  agree(model_error);

  verify_seconds += model_index.verify_seconds();
  TrainingProgress progress;
  const bool finetune = args_.finetune || release;
  if (!finetune) progress = recorded;
  if (optimizer) {
    const bool load_optim = !finetune && !args_.no_load_optim && meta.contains("optimizer");
    if (load_optim) {
      ShardIndex optim_index(dir.string(), kOptimStem);
      if (checksums) optim_index.expect_checksums(*checksums);
      // Every state this rank reads is there and its files verified before the collectives of the
      // loop (the ranks of different stages hold different parameters: one agreement for all).
      std::exception_ptr optim_error;
      try {
        for (const Parameter& p : optimizer->parameters()) {
          for (const char* suffix : {"master", "exp_avg", "exp_avg_sq"}) {
            const std::string key = p.name + "." + suffix;
            MG_CHECK(optim_index.contains(key),
                     "checkpoint {} has no optimizer state '{}': it was saved from another model (--no-load-optim "
                     "loads the weights alone)",
                     dir.string(), key);
            optim_index.verify_files_for(key, p.shard, p.data.shape());
          }
        }
      } catch (...) {
        optim_error = std::current_exception();
      }
      agree(optim_error);
      for (const Parameter& p : optimizer->parameters()) {
        AdamParamState st;
        for (auto& [suffix, t] : {std::pair<const char*, Tensor*>{"master", &st.master},
                                  {"exp_avg", &st.exp_avg},
                                  {"exp_avg_sq", &st.exp_avg_sq}}) {
          *t = Tensor::empty(p.data.shape(), DType::Float32, p.data.device());
          bytes += optim_index.load_into(p.name + "." + suffix, p.shard, *t);
        }
        optimizer->scatter_state(ctx, p.name, st);  // collective over data-parallel ranks, same order everywhere
      }
      verify_seconds += optim_index.verify_seconds();
      optimizer->load_state_dict(meta.at("optimizer"));
      optimizer->copy_main_params_to_model_params(ctx);  // collective with the distributed optimizer
    } else {
      optimizer->reload_model_params();
      for (const auto& [p, value] : fp8_values) optimizer->set_main_param(p->name, value);
      if (!fp8_values.empty()) optimizer->copy_main_params_to_model_params(ctx);  // quantises them
    }
  }
  if (scheduler && !finetune && meta.contains("opt_param_scheduler")) {
    scheduler->load_state_dict(meta.at("opt_param_scheduler"));
  }
  if (!finetune && !args_.no_load_rng && meta.contains("rng")) {
    if (!distributed()) ctx.rng().seed = meta["rng"].at("seed").get<uint64_t>();
    ctx.rng().offset = meta["rng"].at("offset").get<uint64_t>();
  }
  if (rank() == 0) {
    print_progress(fmt::format(
        "  read checkpoint {} ({} into rank 0) in {:.3f} s{}", dir.string(), bytes_str(bytes), seconds_since(start),
        checksums ? fmt::format(" (checksums verified in {:.3f} s)", verify_seconds)
                  : std::string(args_.no_verify_checkpoint_checksums
                                    ? " (checksums not verified: --no-verify-checkpoint-checksums)"
                                    : " (no checksums: written before they were recorded)")));
  }
  return progress;
}

void save_model_checkpoint(const std::string& save_dir, const ModelChunk& model, const Arguments& args, bool release,
                           const nlohmann::json& extra) {
  Arguments a = args;
  a.save = save_dir;
  a.async_save = false;
  a.no_save_rng = true;
  Checkpointer ck(a);
  Context ctx;
  ck.save(ctx, model, nullptr, nullptr, TrainingProgress{}, release, extra);
}

void save_model_checkpoint(const std::string& save_dir, const std::vector<safetensors::Writer::Spec>& tensors,
                           const std::function<void(safetensors::Writer&)>& write, const Arguments& args, bool release,
                           const nlohmann::json& extra) {
  Checkpointer::SaveJob job;
  job.save_dir = save_dir;
  job.dir_name = checkpoint_dir_name(0, release);
  job.tracker_value = release ? "release" : "0";
  job.metadata = base_metadata(args, nullptr, TrainingProgress{});
  for (const auto& [key, value] : extra.items()) job.metadata[key] = value;
  job.tmp_dir = job.save_dir / fmt::format("{}.tmp-{}", job.dir_name, ::getpid());  // Note [Atomic checkpoints]
  fs::create_directories(job.save_dir);
  remove_stale_temporary_checkpoints(job.save_dir);
  try {
    fs::remove_all(job.tmp_dir);
    fs::create_directories(job.tmp_dir);
    std::vector<dist_checkpointing::ShardDecl> decls;
    for (const safetensors::Writer::Spec& t : tensors) decls.push_back({t.name, t.shape, ShardSpec{}});
    const std::string file = dist_checkpointing::shard_file_name(kModelStem, 0);
    safetensors::Writer writer((job.tmp_dir / file).string(), tensors,
                               dist_checkpointing::shard_metadata(decls, {{"format", "megatron.cpp"}}));
    write(writer);
    const uint64_t checksum = writer.commit();
    job.written = {{file, fs::file_size(job.tmp_dir / file), checksum}};
    job.checksums[file] = checksum;
    publish(job);
  } catch (...) {
    std::error_code ignored;
    fs::remove_all(job.tmp_dir, ignored);
    throw;
  }
  report_save(job);
}

}  // namespace megatron
