// The flag table (CLI11) and parsing (Megatron's validation rules are in arguments_validate.cpp). Flags are declared group by group in the
// order of Megatron's arguments.py, the model group from model_arguments.inc (which also gives the
// mapping to TransformerConfig below); a few Megatron flags that select implementations we do not have
// (TransformerEngine, apex fusions, flash-attn) are accepted with a warning and no effect, so
// launch scripts run unchanged.
#include "megatron/training/arguments.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <set>
#include <type_traits>

#include "megatron/core/datasets/blended_megatron_dataset_builder.h"
#include "megatron/core/fp8_utils.h"
#include "megatron/runtime/check.h"
#include "megatron/runtime/logging.h"

namespace megatron {

namespace {

// Megatron flags that select implementation details megatron.cpp does not have; accepted so that
// launch scripts run, with a warning when given.
const char* const kNoEffectFlags[] = {
    "--use-mcore-models",
    "--use-flash-attn",
    "--no-masked-softmax-fusion",
    "--no-bias-gelu-fusion",
    "--no-bias-swiglu-fusion",
    "--no-bias-dropout-fusion",
    "--no-rope-fusion",
    "--no-gradient-accumulation-fusion",
    "--no-async-tensor-model-parallel-allreduce",
    "--attention-softmax-in-fp32",
    "--apply-query-key-layer-scaling",
    "--no-persist-layer-norm",
    "--manual-gc",
    "--tp-comm-overlap",
    "--no-check-for-nan-in-loss-and-grad",
    "--check-for-nan-in-loss-and-grad",
    "--log-progress",
    "--log-batch-size-to-tensorboard",
    "--log-learning-rate-to-tensorboard",
    "--no-mmap-bin-files",
    "--dist-ckpt-strictness",
    "--cross-entropy-loss-fusion",  // the cross entropy is one fused pass over the logits already
};
const char* const kNoEffectOptions[] = {
    "--transformer-impl", "--attention-backend", "--data-impl", "--ckpt-fully-parallel-save",
    "--eval-split",       "--num-dataset-builder-threads", "--cross-entropy-fusion-impl",
};

// Megatron flags we refuse with a reason beyond "not supported": what to use instead.
const std::pair<const char*, const char*> kRefusedWithReason[] = {
    {"--use-torch-fsdp2", "not supported: shard the optimizer state with --use-distributed-optimizer"},
    {"--use-megatron-fsdp", "not supported: shard the optimizer state with --use-distributed-optimizer"},
    {"--wandb-project", "not supported: Weights & Biases has no maintained C++ client; use --tensorboard-dir"},
    {"--wandb-exp-name", "not supported: Weights & Biases has no maintained C++ client; use --tensorboard-dir"},
    {"--wandb-save-dir", "not supported: Weights & Biases has no maintained C++ client; use --tensorboard-dir"},
    {"--wandb-entity", "not supported: Weights & Biases has no maintained C++ client; use --tensorboard-dir"},
};

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  for (size_t start = 0; start <= s.size();) {
    const size_t end = std::min(s.find(sep, start), s.size());
    out.push_back(s.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

// Python's str() of an argument's value, as Megatron's _print_args shows it: True/False, None for
// an empty string or list, lists as ['a', 'b'] and [1, 2], floats always with a '.' or an exponent.
std::string python_str(bool v) { return v ? "True" : "False"; }
std::string python_str(const std::string& v) { return v.empty() ? "None" : v; }
template <typename T>
std::string python_str(const T& v) {
  if constexpr (std::is_floating_point_v<T>) {
    std::string s = fmt::format("{}", v);
    if (s.find_first_of(".eEn") == std::string::npos) s += ".0";  // n: inf, nan
    return s;
  } else {
    return fmt::format("{}", v);
  }
}
template <typename T>
std::string python_str(const std::vector<T>& v) {
  if (v.empty()) return "None";
  std::vector<std::string> items;
  for (const T& x : v) {
    if constexpr (std::is_same_v<T, std::string>) {
      items.push_back("'" + x + "'");
    } else {
      items.push_back(python_str(x));
    }
  }
  return fmt::format("[{}]", fmt::join(items, ", "));
}

// Megatron's argparse dest of a flag: its first spelling without the dashes, '-' as '_'.
std::string dest_name(const std::string& names) {
  std::string n = split(names, ',').front();
  n = n.substr(n.find_first_not_of('-'));
  std::replace(n.begin(), n.end(), '-', '_');
  return n;
}

struct Parser {
  CLI::App app;
  Arguments& a;
  std::vector<std::string> flags;
  std::vector<std::pair<std::string, bool*>> no_effect_flags;
  std::vector<std::pair<std::string, std::string*>> no_effect_options;
  std::vector<std::unique_ptr<bool>> flag_storage;
  std::vector<std::unique_ptr<std::string>> option_storage;
  // Each implemented flag's dest and its value now, for the arguments block (format_arguments).
  std::vector<std::pair<std::string, std::function<std::string()>>> values;
  bool record_values = true;

  Parser(Arguments& args, const std::string& description) : app(description), a(args) {
    app.set_help_flag("-h,--help", "Print this help and exit");
    app.get_formatter()->column_width(44);
  }

  // `name` may hold aliases ("--a,--b") and negations ("--a,!--no-a": --no-a sets false), as CLI11
  // takes them; each is a known flag.
  void add_names(const std::string& name) {
    for (std::string& n : split(name, ',')) flags.push_back(n.starts_with('!') ? n.substr(1) : std::move(n));
  }

  template <typename T>
  CLI::Option* opt(const char* group, const char* name, T& field, const char* help) {
    add_names(name);
    if (record_values) values.emplace_back(dest_name(name), [&field] { return python_str(field); });
    // A repeated flag takes its last value, as argparse does (launch scripts append overrides).
    CLI::Option* o = app.add_option(name, field, help)->group(group)->capture_default_str();
    if constexpr (!std::is_same_v<T, std::vector<std::string>> && !std::is_same_v<T, std::vector<int64_t>>) {
      o->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
    }
    return o;
  }
  CLI::Option* flag(const char* group, const char* name, bool& field, const char* help) {
    add_names(name);
    if (record_values) values.emplace_back(dest_name(name), [&field] { return python_str(field); });
    return app.add_flag(name, field, help)->group(group);
  }
  // A model_arguments.inc row: a switch for bool, else an option; `choices` "A|B" restricts it.
  template <typename T>
  void model_arg(const char* group, const char* name, T& field, const std::string& choices, const char* help) {
    if constexpr (std::is_same_v<T, bool>) {
      flag(group, name, field, help);
    } else {
      CLI::Option* o = opt(group, name, field, help);
      if (!choices.empty()) o->check(CLI::IsMember(split(choices, '|')));
    }
  }
  void no_effect() {
    record_values = false;  // not ours: not in the arguments block
    for (const char* name : kNoEffectFlags) {
      flag_storage.push_back(std::make_unique<bool>(false));
      flag("Accepted for compatibility (no effect)", name, *flag_storage.back(), "");
      no_effect_flags.emplace_back(name, flag_storage.back().get());
    }
    for (const char* name : kNoEffectOptions) {
      option_storage.push_back(std::make_unique<std::string>());
      opt("Accepted for compatibility (no effect)", name, *option_storage.back(), "");
      no_effect_options.emplace_back(name, option_storage.back().get());
    }
  }

  void define() {
    const char* g = "Model";
#define MG_MODEL_GROUP(title) g = title;
#define MG_MODEL_ARG(flag, field, type, default_value, choices, config, checkpoint, help) \
  model_arg(g, flag, a.field, choices, help);
#include "megatron/training/model_arguments.inc"
#undef MG_MODEL_ARG
#undef MG_MODEL_GROUP

    g = "Parallelism";
    opt(g, "--tensor-model-parallel-size", a.tensor_model_parallel_size, "Tensor-parallel size");
    opt(g, "--pipeline-model-parallel-size", a.pipeline_model_parallel_size, "Pipeline-parallel size");
    opt(g, "--num-layers-per-virtual-pipeline-stage", a.num_layers_per_virtual_pipeline_stage, "Interleaved pipeline");
    opt(g, "--num-virtual-stages-per-pipeline-rank", a.num_virtual_stages_per_pipeline_rank,
        "Model chunks per pipeline rank (interleaved)");
    opt(g, "--decoder-first-pipeline-num-layers", a.decoder_first_pipeline_num_layers, "Layers on the first stage");
    opt(g, "--decoder-last-pipeline-num-layers", a.decoder_last_pipeline_num_layers, "Layers on the last stage");
    opt(g, "--context-parallel-size", a.context_parallel_size, "Context-parallel size");
    opt(g, "--cp-comm-type", a.cp_comm_type, "Context-parallel attention: p2p (ring), all_gather, a2a (Ulysses), a2a+p2p")
        ->check(CLI::IsMember({"p2p", "all_gather", "a2a", "a2a+p2p"}));
    opt(g, "--hierarchical-context-parallel-sizes", a.hierarchical_context_parallel_sizes,
        "a2a+p2p: the a2a and p2p level sizes (their product is --context-parallel-size)")
        ->expected(1, 8);
    opt(g, "--expert-model-parallel-size", a.expert_model_parallel_size, "Expert-parallel size");
    opt(g, "--expert-tensor-parallel-size", a.expert_tensor_parallel_size, "Expert tensor-parallel size");
    flag(g, "--sequence-parallel", a.sequence_parallel, "Sequence parallelism (with TP)");
    flag(g, "--use-distributed-optimizer", a.use_distributed_optimizer, "Shard optimizer state over data parallel");
    flag(g, "--overlap-grad-reduce", a.overlap_grad_reduce, "Overlap the gradient reduction with backward");
    flag(g, "--overlap-param-gather", a.overlap_param_gather, "Overlap the parameter gather with forward");
    opt(g, "--ddp-bucket-size", a.ddp_bucket_size, "Gradient-reduction bucket size (elements)");
    opt(g, "--nproc-per-node", a.nproc_per_node, "Start this many processes on this node (built-in launcher)");
    opt(g, "--distributed-backend", a.distributed_backend, "nccl, gloo or mpi (the device decides here)");
    opt(g, "--distributed-timeout-minutes", a.distributed_timeout_minutes, "Collective timeout");

    g = "Batches";
    opt(g, "--micro-batch-size", a.micro_batch_size, "Samples per microbatch per data-parallel rank");
    opt(g, "--global-batch-size", a.global_batch_size, "Samples per iteration (default micro x DP)");
    opt(g, "--rampup-batch-size", a.rampup_batch_size, "START INCR SAMPLES: ramp the global batch up")->expected(3);

    g = "Training";
    opt(g, "--train-iters", a.train_iters, "Iterations to train");
    opt(g, "--train-samples", a.train_samples, "Samples to train (instead of --train-iters)");
    opt(g, "--lr", a.lr, "Peak learning rate");
    opt(g, "--min-lr", a.min_lr, "Minimum learning rate");
    opt(g, "--decoupled-lr", a.decoupled_lr, "Learning rate of the input embedding and output layer (default --lr)");
    opt(g, "--decoupled-min-lr", a.decoupled_min_lr,
        "Minimum learning rate of the input embedding and output layer with --decoupled-lr (default --min-lr)");
    opt(g, "--lr-decay-style", a.lr_decay_style, "constant, linear, cosine, inverse-square-root or WSD")
        ->check(CLI::IsMember({"constant", "linear", "cosine", "inverse-square-root", "WSD"}));
    opt(g, "--lr-decay-iters", a.lr_decay_iters, "Iterations to decay over (default --train-iters)");
    opt(g, "--lr-decay-samples", a.lr_decay_samples, "Samples to decay over");
    opt(g, "--lr-warmup-iters", a.lr_warmup_iters, "Warmup iterations");
    opt(g, "--lr-warmup-fraction", a.lr_warmup_fraction, "Warmup as a fraction of the decay");
    opt(g, "--lr-warmup-samples", a.lr_warmup_samples, "Warmup samples");
    opt(g, "--lr-warmup-init", a.lr_warmup_init, "Learning rate at the start of warmup");
    opt(g, "--lr-wsd-decay-style", a.lr_wsd_decay_style, "WSD decay: linear, cosine, exponential or minus_sqrt")
        ->check(CLI::IsMember({"linear", "cosine", "exponential", "minus_sqrt"}));
    opt(g, "--lr-wsd-decay-iters", a.lr_wsd_decay_iters, "WSD decay iterations");
    opt(g, "--lr-wsd-decay-samples", a.lr_wsd_decay_samples, "WSD decay samples");
    opt(g, "--weight-decay", a.weight_decay, "Weight decay");
    opt(g, "--start-weight-decay", a.start_weight_decay, "Weight decay at the start of the increment");
    opt(g, "--end-weight-decay", a.end_weight_decay, "Weight decay at the end of the increment");
    opt(g, "--weight-decay-incr-style", a.weight_decay_incr_style, "constant, linear or cosine")
        ->check(CLI::IsMember({"constant", "linear", "cosine"}));
    opt(g, "--clip-grad", a.clip_grad, "Clip gradients to this global L2 norm (0: off)");
    opt(g, "--adam-beta1", a.adam_beta1, "Adam beta1");
    opt(g, "--adam-beta2", a.adam_beta2, "Adam beta2");
    opt(g, "--adam-eps", a.adam_eps, "Adam epsilon");
    opt(g, "--optimizer", a.optimizer, "adam")->check(CLI::IsMember({"adam"}));
    opt(g, "--empty-unused-memory-level", a.empty_unused_memory_level,
        "Give cached device memory back: 1 after forward-backward and evaluation steps, 2 also after the optimizer")
        ->check(CLI::Range(0, 2));
    flag(g, "--override-opt-param-scheduler", a.override_opt_param_scheduler, "Take scheduler values from the flags");
    flag(g, "--use-checkpoint-opt-param-scheduler", a.use_checkpoint_opt_param_scheduler,
         "Take them from the checkpoint");
    flag(g, "--calculate-per-token-loss", a.calculate_per_token_loss,
         "Divide the summed loss by the global batch's unmasked tokens (not each microbatch's mean over microbatches)");

    g = "Data";
    opt(g, "--data-path", a.data_path, "[weight] prefix ... : the training data blend")->expected(1, 1 << 20);
    opt(g, "--split", a.split, "Train/valid/test split, e.g. 969,30,1");
    opt(g, "--train-data-path", a.train_data_path, "Training data blend")->expected(1, 1 << 20);
    opt(g, "--valid-data-path", a.valid_data_path, "Validation data blend")->expected(1, 1 << 20);
    opt(g, "--test-data-path", a.test_data_path, "Test data blend")->expected(1, 1 << 20);
    opt(g, "--data-cache-path", a.data_cache_path, "Where the dataset index caches live");
    flag(g, "--mock-data", a.mock_data, "Synthetic data (no files)");
    opt(g, "--tokenizer-type", a.tokenizer_type, "GPT2BPETokenizer, HuggingFaceTokenizer, SentencePieceTokenizer, ...");
    opt(g, "--vocab-file", a.vocab_file, "Vocabulary file");
    opt(g, "--merge-file", a.merge_file, "BPE merges file");
    opt(g, "--tokenizer-model", a.tokenizer_model, "Tokenizer model file or folder");
    opt(g, "--vocab-size", a.vocab_size, "Vocabulary size (NullTokenizer)");
    opt(g, "--tiktoken-pattern", a.tiktoken_pattern, "v1 or v2");
    opt(g, "--num-workers", a.num_workers, "Data loader workers");
    flag(g, "--reset-position-ids", a.reset_position_ids, "Restart position ids after each EOD");
    flag(g, "--reset-attention-mask", a.reset_attention_mask, "Block attention across EODs");
    flag(g, "--eod-mask-loss", a.eod_mask_loss, "No loss on EOD tokens");
    flag(g, "--no-create-attention-mask-in-dataloader", a.no_create_attention_mask_in_dataloader, "");

    g = "Checkpoints";
    opt(g, "--save", a.save, "Directory to save checkpoints to");
    opt(g, "--load", a.load, "Directory to load checkpoints from");
    opt(g, "--pretrained-checkpoint", a.pretrained_checkpoint, "Directory of a pretrained model for finetuning");
    opt(g, "--save-interval", a.save_interval, "Save every N iterations");
    flag(g, "--no-save-optim", a.no_save_optim, "Do not save the optimizer state");
    flag(g, "--no-save-rng", a.no_save_rng, "Do not save the RNG state");
    flag(g, "--no-load-optim", a.no_load_optim, "Do not load the optimizer state");
    flag(g, "--no-load-rng", a.no_load_rng, "Do not load the RNG state");
    flag(g, "--finetune", a.finetune, "Load weights only; start at iteration 0 with a fresh optimizer");
    flag(g, "--async-save", a.async_save, "Write checkpoints on a background thread");
    opt(g, "--ckpt-format", a.ckpt_format, "Checkpoint format (accepted; megatron.cpp writes its own)");
    flag(g, "--use-checkpoint-args", a.use_checkpoint_args, "Take the model arguments from the checkpoint");
    flag(g, "--exit-on-missing-checkpoint", a.exit_on_missing_checkpoint, "Fail if --load has no checkpoint");
    flag(g, "--no-verify-checkpoint-checksums", a.no_verify_checkpoint_checksums,
         "Load without verifying the files' checksums (megatron.cpp)");

    g = "Evaluation";
    opt(g, "--eval-interval", a.eval_interval, "Evaluate every N iterations");
    opt(g, "--eval-iters", a.eval_iters, "Iterations per evaluation");
    flag(g, "--skip-train", a.skip_train, "Evaluate only");

    g = "Logging";
    opt(g, "--log-interval", a.log_interval, "Print the iteration line every N iterations");
    flag(g, "--log-throughput", a.log_throughput, "Add TFLOP/s/GPU and tokens/s/GPU");
    opt(g, "--tensorboard-dir", a.tensorboard_dir, "Write TensorBoard events here");
    opt(g, "--tensorboard-log-interval", a.tensorboard_log_interval, "TensorBoard every N iterations");
    opt(g, "--tensorboard-queue-size", a.tensorboard_queue_size, "Events buffered before a flush");
    flag(g, "--log-timers-to-tensorboard", a.log_timers_to_tensorboard, "Timers to TensorBoard");
    flag(g, "--log-memory-to-tensorboard", a.log_memory_to_tensorboard, "Memory to TensorBoard");
    flag(g, "--log-validation-ppl-to-tensorboard", a.log_validation_ppl_to_tensorboard,
         "Validation PPL to TensorBoard");
    flag(g, "--log-loss-scale-to-tensorboard,!--no-log-loss-scale-to-tensorboard", a.log_loss_scale_to_tensorboard,
         "Loss scale to TensorBoard (default on)");
    flag(g, "--log-world-size-to-tensorboard", a.log_world_size_to_tensorboard, "World size to TensorBoard");
    flag(g, "--log-params-norm", a.log_params_norm, "Print the parameter norm");
    flag(g, "--log-num-zeros-in-grad", a.log_num_zeros_in_grad, "Print the number of zero gradients");
    opt(g, "--timing-log-level", a.timing_log_level, "0, 1 or 2")->check(CLI::Range(0, 2));
    flag(g, "--profile", a.profile,
         "Profile iterations [--profile-step-start, --profile-step-end): the CUDA profiler's range (nsys "
         "--capture-range=cudaProfilerApi) and a table of where the time went, op by op");
    opt(g, "--profile-step-start", a.profile_step_start, "First profiled iteration (0-based, as Megatron)");
    opt(g, "--profile-step-end", a.profile_step_end, "Iteration at which profiling stops");
    opt(g, "--profile-ranks", a.profile_ranks, "Global ranks to profile")->expected(1, 1 << 20);
    opt(g, "--logging-level", a.logging_level,
        "Python logging level: 10 debug, 20 info, 30 warning, 40 error, 50 critical (default: MEGATRON_LOGGING_LEVEL, else info)");

    g = "Precision";
    flag(g, "--bf16", a.bf16, "bf16 parameters and activations, fp32 master weights and grads");
    flag(g, "--fp16", a.fp16, "fp16 with a loss scaler");
    opt(g, "--loss-scale", a.loss_scale, "Constant loss scale (default: dynamic with --fp16)");
    opt(g, "--initial-loss-scale", a.initial_loss_scale, "Initial dynamic loss scale");
    opt(g, "--min-loss-scale", a.min_loss_scale, "Minimum dynamic loss scale");
    opt(g, "--loss-scale-window", a.loss_scale_window, "Iterations without overflow before growing the scale");
    opt(g, "--hysteresis", a.hysteresis, "Overflows tolerated before backing off");
    flag(g, "--accumulate-allreduce-grads-in-fp32", a.accumulate_allreduce_grads_in_fp32, "fp32 grads (always on)");
    flag(g, "--grad-reduce-in-bf16", a.grad_reduce_in_bf16,
         "Reduce gradients over data-parallel ranks in bf16 (the optimizer still updates fp32 masters)");
    opt(g, "--fp8-format", a.fp8_format, "FP8 GEMMs: e4m3, or hybrid (e4m3 forward, e5m2 gradients)")
        ->check(CLI::IsMember({"e4m3", "hybrid"}));
    opt(g, "--fp8-recipe", a.fp8_recipe, "delayed, tensorwise or blockwise (mxfp8: Blackwell only)");
    opt(g, "--fp8-margin", a.fp8_margin, "Scale with fp8_max / amax / 2^margin (delayed recipe)");
    opt(g, "--fp8-interval", a.fp8_interval, "Scaling update interval (deprecated in Megatron: ignored)");
    opt(g, "--fp8-amax-history-len", a.fp8_amax_history_len, "Steps of amax history (delayed recipe)");
    opt(g, "--fp8-amax-compute-algo", a.fp8_amax_compute_algo, "max or most_recent: the amax the scale comes from")
        ->check(CLI::IsMember({"max", "most_recent"}));
    flag(g, "--first-last-layers-bf16", a.first_last_layers_bf16, "Keep the first and last layers in bf16");
    opt(g, "--num-layers-at-start-in-bf16", a.num_layers_at_start_in_bf16,
        "Layers kept in bf16 at the start with --first-last-layers-bf16");
    opt(g, "--num-layers-at-end-in-bf16", a.num_layers_at_end_in_bf16,
        "Layers kept in bf16 at the end with --first-last-layers-bf16");
    flag(g, "--fp8-param-gather", a.fp8_param_gather,
         "Keep the FP8 layers' weights in fp8 and all-gather them in fp8 (distributed optimizer)");
    flag(g, "--no-fp8-wgrad,--disable-fp8-wgrad", a.no_fp8_wgrad,
         "Run the FP8 layers' weight-gradient GEMMs in bf16 (Megatron applies it to the delayed recipe only)");
    flag(g, "--disable-parameter-transpose-cache", a.disable_parameter_transpose_cache,
         "Quantise the FP8 weights at every microbatch instead of once a step (TransformerConfig's "
         "disable_parameter_transpose_cache)");
    flag(g, "--fp8-cpu-reference", a.fp8_cpu_reference,
         "Allow --fp8-format on the CPU: the FP8 ops' reference implementation (slow; for tests)");

    g = "Activation recomputation";
    opt(g, "--recompute-granularity", a.recompute_granularity, "full or selective")
        ->check(CLI::IsMember({"full", "selective"}));
    opt(g, "--recompute-method", a.recompute_method, "uniform or block")->check(CLI::IsMember({"uniform", "block"}));
    opt(g, "--recompute-num-layers", a.recompute_num_layers, "Layers per recomputed chunk (or recomputed layers)");
    flag(g, "--recompute-activations", a.recompute_activations, "Alias of --recompute-granularity selective");

    g = "Exit";
    opt(g, "--exit-interval", a.exit_interval, "Exit after this iteration");
    opt(g, "--exit-duration-in-mins", a.exit_duration_in_mins, "Exit after this many minutes");
    flag(g, "--exit-signal-handler", a.exit_signal_handler, "On SIGTERM: save a checkpoint, then exit");

    g = "CUDA graphs";
    opt(g, "--cuda-graph-impl", a.cuda_graph_impl,
        "none, or local: the forward and backward passes of a training step as one CUDA graph (with "
        "--cuda-graph-scope full_iteration)")
        ->check(CLI::IsMember({"none", "local", "transformer_engine"}));
    opt(g, "--cuda-graph-scope", a.cuda_graph_scope, "What is captured: full_iteration")->expected(1, 16);
    opt(g, "--cuda-graph-warmup-steps", a.cuda_graph_warmup_steps, "Eager steps before the capture");
    flag(g, "--enable-cuda-graph", a.enable_cuda_graph, "Deprecated: --cuda-graph-impl local");
    flag(g, "--external-cuda-graph", a.external_cuda_graph, "Deprecated: --cuda-graph-impl transformer_engine");

    g = "megatron.cpp";
    opt(g, "--device", a.device, "auto (GPU when present), cpu or cuda")->check(CLI::IsMember({"auto", "cpu", "cuda"}));
    no_effect();
  }
};

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

}  // namespace

std::string nearest_flag(const std::string& word, const std::vector<std::string>& candidates) {
  std::string best;
  size_t best_d = SIZE_MAX;
  for (const std::string& c : candidates) {
    size_t d = edit_distance(word, c);
    if (d < best_d) best_d = d, best = c;
  }
  return best;
}

namespace {
// A list option given twice (--moe-aux-loss-coeff 1e-2 ... --moe-aux-loss-coeff 1e-3): argparse's
// nargs='+' keeps the last occurrence, CLI11 would append them; drop the earlier occurrences.
std::vector<std::string> last_occurrences_of_lists(const CLI::App& app, const std::vector<std::string>& args) {
  auto list_option = [&](const std::string& word) -> const CLI::Option* {
    if (word.rfind("--", 0) != 0) return nullptr;
    const CLI::Option* o = app.get_option_no_throw(word.substr(0, word.find('=')));
    return o && o->get_expected_max() > 1 ? o : nullptr;
  };
  std::map<const CLI::Option*, size_t> last;
  for (size_t i = 0; i < args.size(); ++i)
    if (const CLI::Option* o = list_option(args[i])) last[o] = i;
  std::vector<std::string> out;
  for (size_t i = 0; i < args.size(); ++i) {
    const CLI::Option* o = list_option(args[i]);
    if (!o || last[o] == i) {
      out.push_back(args[i]);
      continue;
    }
    if (args[i].find('=') != std::string::npos) continue;
    while (i + 1 < args.size() && args[i + 1].rfind("--", 0) != 0) ++i;  // its values
  }
  return out;
}
}  // namespace

namespace {

// Megatron's own flags (megatron_flags.inc): an unknown flag in this list is one we do not implement.
const char* const kMegatronFlags[] = {
#include "megatron/training/megatron_flags.inc"
};

// The end of --help: every Megatron flag that is not ours, refused at start when given.
std::string unsupported_flags_footer(const std::vector<std::string>& known) {
  const std::set<std::string> ours(known.begin(), known.end());
  std::vector<std::string> refused;
  for (const char* m : kMegatronFlags) {
    if (!ours.count(m) && std::string_view(m) != "--help") refused.push_back(m);
  }
  std::string out = fmt::format(
      "\nMegatron-LM flags megatron.cpp does not implement ({} of Megatron's {}; each is refused at start with one "
      "line):\n",
      refused.size(), std::size(kMegatronFlags));
  std::string line = " ";
  for (const std::string& f : refused) {
    if (line.size() + f.size() + 1 > 110) {
      out += line + "\n";
      line = " ";
    }
    line += " " + f;
  }
  return out + line + "\n";
}

// The hint for an unknown flag (Note [Unknown flags]).
std::string unknown_flag_hint(const std::string& name, const std::vector<std::string>& known) {
  std::string dashed = name;
  std::replace(dashed.begin(), dashed.end(), '_', '-');
  if (dashed != name && std::find(known.begin(), known.end(), dashed) != known.end())
    return fmt::format("did you mean {}?", dashed);
  for (const auto& [flag, reason] : kRefusedWithReason) {
    if (name == flag || dashed == flag) return reason;
  }
  for (const char* m : kMegatronFlags) {
    if (name == m || dashed == m) return "a Megatron flag that megatron.cpp does not support";
  }
  const std::string nearest = nearest_flag(dashed, known);
  const size_t d = edit_distance(dashed, nearest);
  if (!nearest.empty() && d <= std::max<size_t>(2, dashed.size() / 6)) return fmt::format("did you mean {}?", nearest);
  return "no similar flag";
}

// Note [Unknown flags]: every "--name" of the command line that is not ours is reported in one line,
// each with a hint that does not mislead: a Megatron flag megatron.cpp does not implement says so
// (it is not "corrected" to another flag that happens to be spelled alike); a misspelling names the
// nearest flag, when one is within a couple of edits; anything else gets no suggestion.
void report_unknown_flags(const std::vector<std::string>& args, const std::vector<std::string>& known) {
  const std::set<std::string> ours(known.begin(), known.end());
  std::vector<std::string> unknown;
  for (const std::string& word : args) {
    if (word.rfind("--", 0) != 0 || word == "--") continue;
    const std::string name = word.substr(0, word.find('='));
    if (name == "--help" || ours.count(name) || std::find(unknown.begin(), unknown.end(), name) != unknown.end())
      continue;
    unknown.push_back(name);
  }
  if (unknown.empty()) return;
  std::vector<std::string> items;
  for (const std::string& name : unknown) items.push_back(fmt::format("{} ({})", name, unknown_flag_hint(name, known)));
  MG_CHECK(false, "{} {}; see --help",
           unknown.size() == 1 ? std::string("unknown flag") : fmt::format("{} unknown flags:", unknown.size()),
           fmt::join(items, ", "));
}

// Values that are given but impossible, each named with what is wrong (validate_args says "is
// required" only for what is missing).
void check_given_values(const CLI::App& app, const Arguments& a) {
  auto given = [&](const char* flag) { return app.count(flag) > 0; };
  auto positive = [&](const char* flag, int64_t v) {
    MG_CHECK(!given(flag) || v > 0, "{} must be a positive integer, got {}", flag, v);
  };
  auto non_negative = [&](const char* flag, int64_t v) {
    MG_CHECK(!given(flag) || v >= 0, "{} must be an integer >= 0, got {}", flag, v);
  };
  auto non_negative_real = [&](const char* flag, double v) {
    MG_CHECK(!given(flag) || (std::isfinite(v) && v >= 0), "{} must be a finite number >= 0, got {}", flag, v);
  };
  auto probability = [&](const char* flag, double v) {
    MG_CHECK(!given(flag) || (v >= 0 && v < 1), "{} must be in [0, 1), got {}", flag, v);
  };
  positive("--num-layers", a.num_layers);
  positive("--hidden-size", a.hidden_size);
  positive("--num-attention-heads", a.num_attention_heads);
  positive("--ffn-hidden-size", a.ffn_hidden_size);
  positive("--kv-channels", a.kv_channels);
  positive("--num-query-groups", a.num_query_groups);
  positive("--seq-length", a.seq_length);
  positive("--max-position-embeddings", a.max_position_embeddings);
  positive("--micro-batch-size", a.micro_batch_size);
  positive("--global-batch-size", a.global_batch_size);
  non_negative("--train-iters", a.train_iters);  // 0 with --skip-train
  non_negative("--train-samples", a.train_samples);
  positive("--tensor-model-parallel-size", a.tensor_model_parallel_size);
  positive("--pipeline-model-parallel-size", a.pipeline_model_parallel_size);
  positive("--context-parallel-size", a.context_parallel_size);
  positive("--eval-interval", a.eval_interval);
  positive("--log-interval", a.log_interval);
  non_negative("--save-interval", a.save_interval);  // 0: no interval saves, as Megatron's falsy value
  non_negative("--eval-iters", a.eval_iters);
  non_negative("--lr-warmup-iters", a.lr_warmup_iters);
  non_negative("--lr-decay-iters", a.lr_decay_iters);
  non_negative("--exit-interval", a.exit_interval);
  non_negative_real("--lr", a.lr);
  non_negative_real("--min-lr", a.min_lr);
  non_negative_real("--decoupled-lr", a.decoupled_lr);
  non_negative_real("--decoupled-min-lr", a.decoupled_min_lr);
  MG_CHECK(!given("--logging-level") || a.logging_level >= 0,
           "--logging-level must be a Python logging level >= 0 (10 debug, 20 info, 30 warning, 40 error, 50 "
           "critical), got {}",
           a.logging_level);
  non_negative_real("--lr-warmup-init", a.lr_warmup_init);
  non_negative_real("--weight-decay", a.weight_decay);
  non_negative_real("--clip-grad", a.clip_grad);
  probability("--hidden-dropout", a.hidden_dropout);
  probability("--attention-dropout", a.attention_dropout);
}

}  // namespace

std::string format_arguments(const Arguments& args) {
  Arguments a = args;
  Parser p(a, "");
  p.define();
  std::vector<std::pair<std::string, std::string>> rows;
  // Megatron's None defaults that are a negative value here.
  static const std::set<std::string> negative_is_none = {"lr",           "decoupled_lr",       "decoupled_min_lr",
                                                         "lr_warmup_fraction", "start_weight_decay", "end_weight_decay",
                                                         "logging_level"};
  for (const auto& [name, value] : p.values) {
    std::string v = value();
    if (negative_is_none.count(name) && v.starts_with('-')) v = "None";
    rows.emplace_back(name, v);
  }
  // Derived values Megatron's Namespace holds too.
  rows.emplace_back("world_size", python_str(a.world_size));
  rows.emplace_back("data_parallel_size", python_str(a.data_parallel_size));
  rows.emplace_back("virtual_pipeline_model_parallel_size", python_str(a.virtual_pipeline_model_parallel_size));
  std::vector<std::string> lines;
  for (const auto& [name, value] : rows) {
    const size_t dots = name.size() < 48 ? 48 - name.size() : 0;
    lines.push_back(fmt::format("  {} {} {}", name, std::string(dots, '.'), value));
  }
  auto lower = [](std::string s) {
    std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return char(std::tolower(c)); });
    return s;
  };
  std::stable_sort(lines.begin(), lines.end(), [&](const std::string& x, const std::string& y) { return lower(x) < lower(y); });
  std::string out = "------------------------ arguments ------------------------\n";
  for (const std::string& l : lines) out += l + "\n";
  return out + "-------------------- end of arguments ---------------------";
}

std::vector<std::string> known_flags() {
  Arguments a;
  Parser p(a, "");
  p.define();
  return p.flags;
}

std::optional<Arguments> parse_args(int argc, const char* const* argv, const std::string& description) {
  Arguments a;
  Parser p(a, description);
  p.define();
  p.app.footer(unsupported_flags_footer(p.flags));
  report_unknown_flags(std::vector<std::string>(argv + 1, argv + argc), p.flags);
  std::vector<std::string> args = last_occurrences_of_lists(p.app, std::vector<std::string>(argv + 1, argv + argc));
  // CLI11 takes "--flag=value" and "--flag value"; Megatron's argparse takes both too.
  std::reverse(args.begin(), args.end());
  try {
    p.app.parse(args);
  } catch (const CLI::CallForHelp&) {
    std::fputs(p.app.help().c_str(), stdout);
    return std::nullopt;
  } catch (const CLI::ExtrasError& e) {
    std::string first;
    for (auto it = args.rbegin(); it != args.rend(); ++it) {
      if (it->rfind("-", 0) == 0) {
        first = it->substr(0, it->find('='));
        break;
      }
    }
    if (first.empty()) MG_CHECK(false, "unexpected argument(s): {} (see --help)", e.what());
    MG_CHECK(false, "unknown flag {}: did you mean {}? (see --help)", first, nearest_flag(first, p.flags));
  } catch (const CLI::ParseError& e) {
    MG_CHECK(false, "bad command line: {} (see --help)", e.what());
  }
  check_given_values(p.app, a);
  // --logging-level, else MEGATRON_LOGGING_LEVEL, else INFO (Megatron's setup_logging), before any warning.
  logging::set_level(logging::level_from_flag_and_env(a.logging_level));
  for (const auto& [name, set] : p.no_effect_flags) {
    if (*set) logging::warn(fmt::format("{} has no effect in megatron.cpp", name));
  }
  for (const auto& [name, value] : p.no_effect_options) {
    if (!value->empty()) logging::warn(fmt::format("{} has no effect in megatron.cpp", name));
  }
  return a;
}

// ---- model arguments <-> TransformerConfig -----------------------------------------------------
// The MG_CFG columns of model_arguments.inc are assigned field to field, both ways.
// Note [Model arguments that are not 1:1]: the rows marked MG_NO_CFG whose flags still shape the
// config follow these rules, written by hand because a flag there is not one config field:
//   --group-query-attention       gates --num-query-groups: without it, one group per head (MHA)
//   --disable-bias-linear         add_bias_linear is its negation
//   --swiglu                      activation "swiglu" and gated_linear_unit (else "gelu")
//   --quick-geglu                 activation "quick_geglu" and gated_linear_unit
//   --window-size L,R             window_size_left = L (Megatron's tuple; R must be 0); empty: -1
//   --untie-embeddings-and-output-weights   share_embeddings_and_output_weights is its negation
//   --use-rotary-position-embeddings        position_embedding_type "rope" (an alias)
//   --rope-type                   with --multi-latent-attention, position_embedding_type (yarn when
//                                 absent: Megatron's MLA default, whatever --position-embedding-type says)
//   --moe-expert-capacity-factor  a number, or absent (Megatron's None: dropless); the config holds
//                                 0 for absent
// and back (model_arguments_from_config): group_query_attention when the groups are fewer than the
// heads; add_qkv_bias only where it adds something (without the linear biases), as checkpoints
// converted before this table recorded it.
namespace {

// Megatron's --window-size tuple "L,R" (tuple_type; parentheses allowed) as the left window (-1, as
// TransformerEngine reads it: none); the right one must be 0 (keys after the query are never seen here).
int window_size_left_from_flag(const std::string& flag) {
  if (flag.empty()) return -1;
  std::string t;
  for (char ch : flag)
    if (ch != '(' && ch != ')' && ch != ' ') t.push_back(ch);
  const std::vector<std::string> parts = split(t, ',');
  int left = -1, right = -1;
  bool ok = parts.size() == 2;
  if (ok) {
    try {
      size_t u1 = 0, u2 = 0;
      left = std::stoi(parts[0], &u1);
      right = std::stoi(parts[1], &u2);
      ok = u1 == parts[0].size() && u2 == parts[1].size();
    } catch (const std::exception&) {
      ok = false;
    }
  }
  MG_CHECK(ok && left >= -1, "--window-size '{}' must be two integers 'left,right' with left >= 0 (-1: none)", flag);
  MG_CHECK(right == 0, "--window-size '{}': a right window ({}) is not supported; causal attention needs 0", flag,
           right);
  return left;
}

#define MG_CFG(field) &TransformerConfig::field
#define MG_NO_CFG nullptr

template <typename C, typename V>
void to_config(TransformerConfig& c, C TransformerConfig::*member, const V& value) {
  c.*member = C(value);
}
template <typename V>
void to_config(TransformerConfig&, std::nullptr_t, const V&) {}

template <typename C, typename V>
void from_config(const TransformerConfig& c, C TransformerConfig::*member, V& value) {
  value = V(c.*member);
}
template <typename V>
void from_config(const TransformerConfig&, std::nullptr_t, V&) {}

}  // namespace

TransformerConfig transformer_config_from_args(const Arguments& a, int64_t vocab_size) {
  TransformerConfig c;
#define MG_MODEL_ARG(flag, field, type, default_value, choices, config, checkpoint, help) to_config(c, config, a.field);
#include "megatron/training/model_arguments.inc"
#undef MG_MODEL_ARG
  // Note [Model arguments that are not 1:1].
  c.num_query_groups = a.group_query_attention ? a.num_query_groups : a.num_attention_heads;
  c.add_bias_linear = !a.disable_bias_linear;
  MG_CHECK(!(a.swiglu && a.quick_geglu), "--swiglu and --quick-geglu cannot both be given");
  c.activation = a.swiglu ? "swiglu" : a.quick_geglu ? "quick_geglu" : "gelu";
  c.gated_linear_unit = a.swiglu || a.quick_geglu;
  c.window_size_left = window_size_left_from_flag(a.window_size);
  c.share_embeddings_and_output_weights = !a.untie_embeddings_and_output_weights;
  if (a.use_rotary_position_embeddings) c.position_embedding_type = "rope";
  if (a.multi_latent_attention) c.position_embedding_type = a.rope_type.empty() ? "yarn" : a.rope_type;
  if (!a.moe_expert_capacity_factor.empty()) c.moe_expert_capacity_factor = std::stof(a.moe_expert_capacity_factor);

  c.vocab_size = int(vocab_size);
  c.bf16 = a.bf16;
  c.fp16 = a.fp16;
  c.calculate_per_token_loss = a.calculate_per_token_loss;
  c.recompute_granularity = a.recompute_granularity;
  c.recompute_method = a.recompute_method;
  c.recompute_num_layers = a.recompute_num_layers;
  c.tensor_model_parallel_size = a.tensor_model_parallel_size;
  c.sequence_parallel = a.sequence_parallel;
  c.pipeline_model_parallel_size = a.pipeline_model_parallel_size;
  c.virtual_pipeline_model_parallel_size = a.virtual_pipeline_model_parallel_size;
  c.decoder_first_pipeline_num_layers = a.decoder_first_pipeline_num_layers;
  c.decoder_last_pipeline_num_layers = a.decoder_last_pipeline_num_layers;
  c.expert_model_parallel_size = a.expert_model_parallel_size;
  c.expert_tensor_parallel_size = a.expert_tensor_parallel_size;
  c.context_parallel_size = a.context_parallel_size;
  c.cp_comm_type = a.cp_comm_type;
  c.fp8 = fp8_config_from_args(a);
  c.finalize();
  return c;
}

Arguments model_arguments_from_config(const TransformerConfig& c) {
  Arguments a;
#define MG_MODEL_ARG(flag, field, type, default_value, choices, config, checkpoint, help) \
  from_config(c, config, a.field);
#include "megatron/training/model_arguments.inc"
#undef MG_MODEL_ARG
  // Note [Model arguments that are not 1:1].
  a.group_query_attention = c.num_query_groups != c.num_attention_heads;
  a.num_query_groups = c.num_query_groups;
  a.disable_bias_linear = !c.add_bias_linear;
  a.add_qkv_bias = c.add_qkv_bias && !c.add_bias_linear;
  a.swiglu = c.activation == "swiglu";
  a.quick_geglu = c.activation == "quick_geglu";
  a.window_size = c.window_size_left >= 0 ? fmt::format("{},0", c.window_size_left) : std::string();
  a.untie_embeddings_and_output_weights = !c.share_embeddings_and_output_weights;
  if (c.multi_latent_attention) a.rope_type = c.position_embedding_type;
  if (c.moe_expert_capacity_factor > 0) a.moe_expert_capacity_factor = fmt::format("{}", c.moe_expert_capacity_factor);
  return a;
}

#undef MG_CFG
#undef MG_NO_CFG

TokenizerArgs tokenizer_args_from_args(const Arguments& a) {
  TokenizerArgs t;
  t.tokenizer_type = a.tokenizer_type;
  t.vocab_file = a.vocab_file;
  t.merge_file = a.merge_file;
  t.tokenizer_model = a.tokenizer_model;
  if (a.vocab_size > 0) t.vocab_size = a.vocab_size;
  t.tiktoken_pattern = a.tiktoken_pattern;
  return t;
}

}  // namespace megatron
