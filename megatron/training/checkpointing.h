// Checkpoints (Megatron's checkpointing.py conventions, our contents — DESIGN.md "Checkpoints"):
//
//   <save>/latest_checkpointed_iteration.txt   "100" (or "release" for a converted model)
//   <save>/iter_0000100/metadata.json          format, iteration, consumed samples, model args,
//                                              scheduler, optimizer and RNG state, and for every
//                                              tensor its global shape, dtype and shards
//   <save>/iter_0000100/model_rank00000.safetensors   model parameters (model dtype)
//   <save>/iter_0000100/optim_rank00000.safetensors   fp32 masters and Adam moments
//
// Note [Atomic checkpoints]: a checkpoint is written into "<dir>.tmp-<pid>", every file fsynced,
// the directory renamed into place and fsynced, and only then latest_checkpointed_iteration.txt
// replaced (temp file + rename). A process killed at any point leaves the previous checkpoint as
// the latest, intact; a leftover .tmp directory is never read. With --async-save the tensors are
// copied to host memory first and written by a background thread while training goes on; the
// tracker file is updated by that thread when the write is complete.
#pragma once

#include <cstdint>
#include <future>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "megatron/core/models/gpt/gpt_model.h"
#include "megatron/core/optimizer/optimizer.h"
#include "megatron/core/optimizer/optimizer_param_scheduler.h"
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

/// The model arguments stored in a checkpoint (Megatron's --use-checkpoint-args set).
nlohmann::json model_args_to_json(const Arguments& args);
/// Overwrites the model arguments of `args` with those of the checkpoint under `load_dir`.
void apply_checkpoint_args(Arguments& args, const std::string& load_dir);

class Checkpointer {
 public:
  explicit Checkpointer(const Arguments& args) : args_(args) {}
  ~Checkpointer();

  /// Saves iteration `progress.iteration` under --save (synchronously, or in the background with
  /// --async-save). `optimizer` may be null (--no-save-optim or a converted model).
  /// `extra` is merged into metadata.json (e.g. the HF config of a converted model).
  void save(Context& ctx, const GPTModel& model, const AdamOptimizer* optimizer,
            const OptimizerParamScheduler* scheduler, const TrainingProgress& progress, bool release = false,
            const nlohmann::json& extra = nlohmann::json::object());
  /// Waits for a background save and publishes it; rethrows its error.
  void finalize();
  bool save_in_flight() const { return pending_.valid(); }

  /// Loads the latest checkpoint under `load_dir` into the model (and optimizer, scheduler, RNG
  /// unless disabled by the flags). Returns nullopt when there is no checkpoint there.
  std::optional<TrainingProgress> load(Context& ctx, const std::string& load_dir, GPTModel& model,
                                       AdamOptimizer* optimizer, OptimizerParamScheduler* scheduler);

 private:
  const Arguments& args_;
  std::future<void> pending_;
};

/// Writes a model alone as a checkpoint directory (used by tools/convert_checkpoint for "release").
void save_model_checkpoint(const std::string& save_dir, const GPTModel& model, const Arguments& args, bool release,
                           const nlohmann::json& extra = nlohmann::json::object());
/// The metadata.json of the latest checkpoint under `load_dir` (and its directory).
nlohmann::json read_checkpoint_metadata(const std::string& load_dir, std::string* checkpoint_dir = nullptr);

}  // namespace megatron
