// Checkpoints (Megatron's checkpointing.py conventions, our contents — DESIGN.md "Checkpoints"):
//
//   <save>/latest_checkpointed_iteration.txt   "100" (or "release" for a converted model)
//   <save>/iter_0000100/metadata.json          format, iteration, consumed samples, model args, the
//                                              parallel layout that wrote it, scheduler, optimizer
//                                              and RNG state, and for every tensor its global shape,
//                                              dtype and shards (file, offsets, shape)
//   <save>/iter_0000100/model_rank<R>.safetensors   this rank's pieces of the parameters (model dtype)
//   <save>/iter_0000100/optim_rank<R>.safetensors   their fp32 masters and Adam moments
// R is the world rank (five digits); the pieces' places in the global tensors are in each file's
// metadata (Note [Sharded safetensors] in dist_checkpointing/sharded.h).
//
// Note [Checkpoint ownership]: a rank writes a parameter (and its optimizer state) iff it is on
// data- and context-parallel rank 0 (expert-data-parallel rank 0 for an expert's parameters, which are named by
// their global expert index, so an expert layout reshards like any other), the parameter is not a tensor-parallel
// duplicate on tp rank > 0 (norm weights, row-parallel biases), and it is not the last stage's copy of tied embeddings.
// So every global element is written once. The optimizer state goes through AdamOptimizer::gather_state, which every
// data-parallel rank calls for the same parameters in the same order (collective with the distributed optimizer); only
// dp rank 0 writes what it returns. Loading is layout-free: every rank opens all files of the checkpoint and fills its
// own parameters (ShardIndex::load_into with the parameter's ShardSpec) and optimizer state (scatter_state) — from a
// checkpoint written by any TP/PP/DP layout, single-process checkpoints of format 1 included.
//
// Note [Atomic checkpoints]: a checkpoint is written into "<dir>.tmp-<pid>" (the pid of rank 0),
// every file fsynced, the directory renamed into place and fsynced, and only then
// latest_checkpointed_iteration.txt replaced (temp file + rename). A process killed at any point
// leaves the previous checkpoint as the latest, intact; a leftover .tmp directory is never read.
// With several ranks: rank 0 creates the temporary directory; all ranks agree (all-reduce of an
// error flag, which is also the barrier); every rank writes and fsyncs its files; all agree again;
// rank 0 writes metadata.json (the tensor table read back from the files, which also checks that
// they cover every tensor), renames and updates the tracker; all agree a last time. An error on any
// rank fails the save on every rank, and nothing is published.
// With --async-save the tensors are copied to host memory first and written by a background
// thread while training goes on. In a single process that thread also publishes (renames and
// updates the tracker); with several ranks the publication is collective, so it happens on the
// main thread in finalize() (called by the next save() and at the end of training).
//
// Note [Checkpoint checksums]: metadata.json records, under "checksums", the XXH3-64 of every file
// of the checkpoint ({"algorithm": "xxh3-64", "files": {"model_rank00000.safetensors": "<16 hex>"}}),
// computed by each rank while it writes its files and gathered to rank 0 (an all-reduce of 16-bit
// pieces) before it publishes. load() verifies a file the first time it reads from it, so each rank
// checks the files it reads, and a byte flip anywhere in a file is one line naming the file. On by
// default (--no-verify-checkpoint-checksums turns it off); XXH3 runs at memory speed, so the cost
// is one more pass over the bytes read (bench/checkpoint_verify.cpp measures it). Checkpoints
// written before the checksums load unverified, saying so.
//
// The progress fields are checked as Megatron's read_metadata checks the tracker: the tracker holds
// "release" or one decimal iteration number (surrounding whitespace allowed), and metadata.json's
// iteration is a non-negative integer equal to it, its consumed sample counts non-negative
// integers and its FLOPs a finite non-negative number; anything else is one line naming the file.
// Note [Stale temporary checkpoints] (checkpointing.cpp): the next save removes the .tmp-PID
// folders of processes that are gone (rank 0, after the others agreed on the new one).
//
// Model identity: load() first compares the checkpoint's model arguments marked identity in
// model_arguments.inc (--qk-layernorm, --normalization, ...) with the run's and refuses a
// difference in one line: those change what the model computes while every tensor it needs may
// still be in the checkpoint with the right shape. Shapes are checked tensor by tensor after that.
//
// RNG: a single process restores the checkpoint's (seed, offset); in a parallel run only the offset
// (each rank's seed is derived from --seed and its ranks when it starts).
#pragma once

#include <cstdint>
#include <exception>
#include <filesystem>
#include <functional>
#include <future>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "megatron/core/dist_checkpointing/safetensors.h"
#include "megatron/core/dist_checkpointing/sharded.h"
#include "megatron/core/parallel_state.h"
#include "megatron/core/transformer/module.h"
#include "megatron/core/optimizer/optimizer.h"
#include "megatron/core/optimizer/optimizer_param_scheduler.h"
#include "megatron/core/parameter.h"
#include "megatron/core/parallel_state.h"
#include "megatron/training/arguments.h"

namespace megatron {

/// The non-tensor training state a checkpoint carries.
struct TrainingProgress {
  int64_t iteration = 0;
  int64_t consumed_train_samples = 0;
  int64_t consumed_valid_samples = 0;
  double floating_point_operations_so_far = 0;
};

/// "iter_0000100" (or "release").
std::string checkpoint_dir_name(int64_t iteration, bool release = false);

/// The model arguments stored in a checkpoint (Megatron's --use-checkpoint-args set): the recorded,
/// saved and identity rows of model_arguments.inc, vocab_size, tokenizer_type, bf16 and fp16.
nlohmann::json model_args_to_json(const Arguments& args);
/// Overwrites the model arguments of `args` with those of the checkpoint under `load_dir`.
/// with_recorded: also the "recorded" rows (the run's training settings, e.g. the aux-loss
/// coefficients), for tools that describe the checkpoint rather than continue its training.
void apply_checkpoint_args(Arguments& args, const std::string& load_dir, bool with_recorded = false);
/// Refuses, in one line naming the flag, a checkpoint (its metadata.json in `meta`, read from `dir`)
/// whose identity rows of model_arguments.inc differ from this run's (checkpoint_args.cpp).
void check_model_identity(const nlohmann::json& meta, const Arguments& args, const std::filesystem::path& dir);

/// Refuses, in one line naming the flag, a model flag given on the command line (`given_flags`: the
/// flag spellings the user typed, e.g. "--num-layers") whose value in `args` differs from the value
/// the checkpoint (metadata.json in `meta`, read from `dir`) saved: a tool that takes its model from
/// the checkpoint (the text generation server) says so instead of ignoring the flag.
void check_given_model_args(const nlohmann::json& meta, const Arguments& args,
                            const std::vector<std::string>& given_flags, const std::filesystem::path& dir);

class Checkpointer {
 public:
  /// `parallel`: the run's process groups; null (or a world of one rank) for a single process.
  /// With several ranks save(), finalize() and load() are collective over the world group.
  explicit Checkpointer(const Arguments& args, const ParallelState* parallel = nullptr);
  ~Checkpointer();
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  /// Saves iteration `progress.iteration` under --save (synchronously, or in the background with
  /// --async-save). `params`: this rank's parameters, all model chunks (each with its ShardSpec).
  /// `optimizer` may be null (--no-save-optim or a converted model). `extra` is merged into
  /// metadata.json (e.g. the HF config of a converted model).
  void save(Context& ctx, const std::vector<Parameter*>& params, const AdamOptimizer* optimizer,
            const OptimizerParamScheduler* scheduler, const TrainingProgress& progress, bool release = false,
            const nlohmann::json& extra = nlohmann::json::object());
  void save(Context& ctx, const ModelChunk& model, const AdamOptimizer* optimizer,
            const OptimizerParamScheduler* scheduler, const TrainingProgress& progress, bool release = false,
            const nlohmann::json& extra = nlohmann::json::object());
  /// Waits for a background save and publishes it (collectively with several ranks, on the context
  /// of that save); rethrows its error.
  void finalize();
  bool save_in_flight() const { return pending_.valid(); }

  /// Loads the latest checkpoint under `load_dir` into `params` (this rank's parameters, any
  /// layout) and the optimizer, scheduler and RNG unless disabled by the flags. Returns nullopt
  /// when there is no checkpoint there.
  std::optional<TrainingProgress> load(Context& ctx, const std::string& load_dir, const std::vector<Parameter*>& params,
                                       AdamOptimizer* optimizer, OptimizerParamScheduler* scheduler);
  std::optional<TrainingProgress> load(Context& ctx, const std::string& load_dir, ModelChunk& model,
                                       AdamOptimizer* optimizer, OptimizerParamScheduler* scheduler);

  /// Model state that is not a parameter (ModelBuffer: the MoE routers' expert biases, the FP8
  /// scaling state), by name, the same on every rank that holds it: saved with the model weights by
  /// data- and tensor-parallel rank 0, and loaded with them (a required one must be in the checkpoint).
  void set_model_buffers(std::vector<ModelBuffer> buffers) { buffers_ = std::move(buffers); }

  struct SaveJob;  // a save's host snapshot and its progress (checkpointing.cpp)

 private:
  std::vector<ModelBuffer> buffers_;
  bool distributed() const { return parallel_ != nullptr && parallel_->world_size() > 1; }
  int rank() const { return distributed() ? parallel_->rank() : 0; }
  /// With several ranks: true on every rank iff `ok` on every rank (all-reduce; also a barrier).
  bool all_ok(Context& ctx, bool ok) const;
  /// The collective end of a save: agree on the writes, rank 0 publishes, agree on that.
  void publish_collective(Context& ctx, SaveJob& job, std::exception_ptr write_error);
  /// Every rank's file checksums into job.checksums (collective over the world).
  void gather_checksums(Context& ctx, SaveJob& job) const;
  std::optional<TrainingProgress> load_checked(Context& ctx, const std::string& load_dir,
                                               const std::vector<Parameter*>& params, AdamOptimizer* optimizer,
                                               OptimizerParamScheduler* scheduler);

  const Arguments& args_;
  const ParallelState* parallel_;
  std::future<void> pending_;
  std::shared_ptr<SaveJob> job_;  // of the save in flight
  Context* pending_ctx_ = nullptr;
};

/// Writes a model alone as a checkpoint directory (used by tools/convert_checkpoint for "release").
void save_model_checkpoint(const std::string& save_dir, const ModelChunk& model, const Arguments& args, bool release,
                           const nlohmann::json& extra = nlohmann::json::object());
/// The same checkpoint written tensor by tensor, for a model never held in memory whole
/// (tools/convert_checkpoint): `tensors` declares every tensor (whole, in its stored dtype) and
/// `write` puts each into the writer (safetensors::Writer::put, any order). The files, metadata.json,
/// checksums and the atomic publication are save_model_checkpoint's.
void save_model_checkpoint(const std::string& save_dir, const std::vector<safetensors::Writer::Spec>& tensors,
                           const std::function<void(safetensors::Writer&)>& write, const Arguments& args, bool release,
                           const nlohmann::json& extra = nlohmann::json::object());
/// The model weights (model_rank*.safetensors) of checkpoint directory `dir`, whose metadata.json is
/// `meta`: each file is verified against its recorded checksum the first time it is read from.
dist_checkpointing::ShardIndex open_model_weights(const nlohmann::json& meta, const std::string& dir);
/// The metadata.json of the latest checkpoint under `load_dir` (and its directory).
nlohmann::json read_checkpoint_metadata(const std::string& load_dir, std::string* checkpoint_dir = nullptr);

}  // namespace megatron
