// Megatron's command line: every flag of pretrain_gpt with Megatron's spelling, meaning and default
// (megatron/training/arguments.py), parsed with CLI11 and validated as Megatron's validate_args
// does. Unknown flags are an error naming the nearest known flag; --help lists the flags by group.
// The model flags are one table, model_arguments.inc: their members here, their definitions, their
// TransformerConfig fields and their place in checkpoints all come from it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "megatron/core/tokenizers/tokenizer.h"
#include "megatron/core/transformer/transformer_config.h"

namespace megatron {

struct OptimizerConfig;
struct SchedulerConfig;
struct Fp8Config;

struct Arguments {
  // ---- model: the table in model_arguments.inc
#define MG_MODEL_ARG(flag, field, type, default_value, choices, config, checkpoint, help) type field = default_value;
#include "megatron/training/model_arguments.inc"
#undef MG_MODEL_ARG

  // ---- parallelism
  int tensor_model_parallel_size = 1;
  int pipeline_model_parallel_size = 1;
  int num_layers_per_virtual_pipeline_stage = 0;
  int num_virtual_stages_per_pipeline_rank = 0;
  int virtual_pipeline_model_parallel_size = 1;  // derived: model chunks per pipeline rank
  int decoder_first_pipeline_num_layers = 0;
  int decoder_last_pipeline_num_layers = 0;
  int context_parallel_size = 1;
  std::string cp_comm_type = "p2p";                          // p2p | all_gather | a2a | a2a+p2p
  std::vector<int64_t> hierarchical_context_parallel_sizes;  // a2a+p2p: level sizes
  int expert_model_parallel_size = 1;
  int expert_tensor_parallel_size = 0;
  bool sequence_parallel = false;
  bool use_distributed_optimizer = false;
  bool overlap_grad_reduce = false;
  bool overlap_param_gather = false;
  int64_t ddp_bucket_size = 0;  // elements; 0: Megatron's default
  int nproc_per_node = 0;       // > 0: the built-in one-node launcher
  std::string distributed_backend = "nccl";
  int distributed_timeout_minutes = 10;
  int world_size = 1;          // from the launcher (1 for a single process)
  int data_parallel_size = 1;  // derived
  int data_parallel_rank = 0;  // this process's (set by pretrain)
  int context_parallel_rank = 0;  // this process's (set by pretrain)

  // ---- batches
  int micro_batch_size = 0;
  int global_batch_size = 0;
  std::vector<int64_t> rampup_batch_size;  // START INCR SAMPLES

  // ---- training length, learning rate, regularisation
  int64_t train_iters = 0;
  int64_t train_samples = 0;
  double lr = -1.0;  // unset: required unless --skip-train
  double min_lr = 0.0;
  double decoupled_lr = -1.0;      // Megatron's None: the embedding and output layer follow --lr
  double decoupled_min_lr = -1.0;  // None: --min-lr
  std::string lr_decay_style = "linear";
  int64_t lr_decay_iters = 0;
  int64_t lr_decay_samples = 0;
  int64_t lr_warmup_iters = 0;
  double lr_warmup_fraction = -1.0;
  int64_t lr_warmup_samples = 0;
  double lr_warmup_init = 0.0;
  std::string lr_wsd_decay_style = "exponential";
  int64_t lr_wsd_decay_iters = 0;
  int64_t lr_wsd_decay_samples = 0;
  double weight_decay = 0.01;
  double start_weight_decay = -1.0;
  double end_weight_decay = -1.0;
  std::string weight_decay_incr_style = "constant";
  double clip_grad = 1.0;
  double adam_beta1 = 0.9;
  double adam_beta2 = 0.999;
  double adam_eps = 1e-8;
  std::string optimizer = "adam";
  bool override_opt_param_scheduler = false;
  bool use_checkpoint_opt_param_scheduler = false;
  bool calculate_per_token_loss = false;

  // ---- data
  std::vector<std::string> data_path;
  std::string split;  // default per data source (validate)
  std::vector<std::string> train_data_path, valid_data_path, test_data_path;
  std::string data_cache_path;
  bool mock_data = false;
  std::string tokenizer_type;
  std::string vocab_file, merge_file, tokenizer_model;
  int64_t vocab_size = 0;
  std::string tiktoken_pattern;
  int num_workers = 2;
  bool reset_position_ids = false;
  bool reset_attention_mask = false;
  bool eod_mask_loss = false;
  bool no_create_attention_mask_in_dataloader = false;

  // ---- checkpoints
  std::string save, load, pretrained_checkpoint;
  int64_t save_interval = 0;
  bool no_save_optim = false, no_save_rng = false, no_load_optim = false, no_load_rng = false;
  bool finetune = false;
  bool async_save = false;
  std::string ckpt_format = "torch_dist";
  bool use_checkpoint_args = false;
  bool exit_on_missing_checkpoint = false;
  bool no_verify_checkpoint_checksums = false;  // ours: skip Note [Checkpoint checksums] on load

  // ---- evaluation
  int64_t eval_interval = 1000;
  int64_t eval_iters = 100;
  bool skip_train = false;

  // ---- logging
  int64_t log_interval = 100;
  bool log_throughput = false;
  std::string tensorboard_dir;
  int64_t tensorboard_log_interval = 1;
  int tensorboard_queue_size = 1000;
  bool log_timers_to_tensorboard = false;
  bool log_memory_to_tensorboard = false;
  bool log_validation_ppl_to_tensorboard = false;
  bool log_loss_scale_to_tensorboard = true;   // --no-log-loss-scale-to-tensorboard
  bool log_world_size_to_tensorboard = false;
  bool log_params_norm = false;
  bool log_num_zeros_in_grad = false;
  int timing_log_level = 0;
  bool profile = false;                        // --profile: the device profiler's range and our op table
  int64_t profile_step_start = 10;
  int64_t profile_step_end = 12;
  std::vector<int64_t> profile_ranks = {0};
  int logging_level = -1;  // Python logging level (10 DEBUG .. 50 CRITICAL); -1: Megatron's None

  // ---- precision
  bool bf16 = false;
  bool fp16 = false;
  double loss_scale = 0.0;
  double initial_loss_scale = 4294967296.0;
  double min_loss_scale = 1.0;
  int64_t loss_scale_window = 1000;
  int64_t hysteresis = 2;
  bool accumulate_allreduce_grads_in_fp32 = false;
  bool grad_reduce_in_bf16 = false;
  // FP8 (Megatron's names and defaults; megatron/core/fp8_utils.h)
  std::string fp8_format;  // e4m3 | hybrid; empty: off
  std::string fp8_recipe = "delayed";
  int fp8_margin = 0;
  int fp8_interval = 1;
  int fp8_amax_history_len = 1;
  std::string fp8_amax_compute_algo = "most_recent";
  bool first_last_layers_bf16 = false;
  int num_layers_at_start_in_bf16 = 1;
  int num_layers_at_end_in_bf16 = 1;
  bool fp8_param_gather = false;
  bool no_fp8_wgrad = false;  // --no-fp8-wgrad / --disable-fp8-wgrad (Megatron's fp8_wgrad = False)
  bool fp8_cpu_reference = false;  // ours: FP8 on the CPU through the reference ops (tests)
  bool disable_parameter_transpose_cache = false;  // Megatron's TransformerConfig field (Note [FP8 weight cache])

  // ---- activation recomputation
  std::string recompute_granularity;
  std::string recompute_method;
  int recompute_num_layers = 0;
  bool recompute_activations = false;

  // ---- exit
  int64_t exit_interval = 0;
  int empty_unused_memory_level = 0;  // 0, 1 or 2 (Megatron's torch.cuda.empty_cache points)
  double exit_duration_in_mins = 0.0;
  bool exit_signal_handler = false;

  // ---- CUDA graphs (core/full_cuda_graph.h)
  std::string cuda_graph_impl = "none";         // none | local | transformer_engine
  std::vector<std::string> cuda_graph_scope;    // local: full_iteration
  int cuda_graph_warmup_steps = 3;
  bool enable_cuda_graph = false;               // deprecated alias of --cuda-graph-impl local
  bool external_cuda_graph = false;             // deprecated alias of --cuda-graph-impl transformer_engine

  // ---- megatron.cpp's own
  std::string device = "auto";  // auto | cpu | cuda
};

/// Megatron's rule for --deterministic-mode over NCCL (several GPUs): NCCL_ALGO must name an
/// algorithm with a fixed reduction order. `uses_nccl`: this run's ranks talk through NCCL.
void check_deterministic_nccl(const Arguments& a, bool uses_nccl);

/// Parses argv (argv[0] is the program). Prints --help and returns std::nullopt when asked for help;
/// throws megatron::Error for unknown flags (naming the nearest), bad values and invalid combinations.
std::optional<Arguments> parse_args(int argc, const char* const* argv, const std::string& program_description);

/// Megatron's validate_args: derives defaults and checks every combination rule (throws).
void validate_args(Arguments& args);

/// The pieces other modules take.
/// The FP8 options (--fp8-*, --first-last-layers-bf16, ...); --fp8-recipe is checked by name here.
Fp8Config fp8_config_from_args(const Arguments& args);
TransformerConfig transformer_config_from_args(const Arguments& args, int64_t vocab_size);
/// The inverse for the model arguments: those that give `config` (a converted checkpoint's
/// arguments). Only the model_arguments.inc fields are set.
Arguments model_arguments_from_config(const TransformerConfig& config);
TokenizerArgs tokenizer_args_from_args(const Arguments& args);

/// Megatron's arguments block (_print_args): "------------------------ arguments ---...", then one
/// "  name ...... value" line per argument (dots to column 48, values as Python prints them,
/// sorted case-insensitively), then "-------------------- end of arguments ---...". No newline at the end.
std::string format_arguments(const Arguments& args);

/// Every flag name (for the nearest-flag suggestion and documentation), e.g. "--num-layers".
std::vector<std::string> known_flags();

/// The Levenshtein-nearest of `candidates` to `word`.
std::string nearest_flag(const std::string& word, const std::vector<std::string>& candidates);

}  // namespace megatron
