// Megatron's validation rules for the parsed arguments (validate_args in Megatron's arguments.py):
// one clear line per broken rule, derived values filled in; and the FP8 options gathered into
// their config. The flag table and parsing are in arguments.cpp.
#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>

#include "megatron/core/datasets/blended_megatron_dataset_builder.h"
#include "megatron/core/fp8_utils.h"
#include "megatron/runtime/check.h"
#include "megatron/runtime/logging.h"
#include "megatron/training/arguments.h"

namespace megatron {

namespace {
// The MoE part of validate_args: what needs the world size or the command line's spelling.
void validate_moe_args(Arguments& a) {
  if (a.expert_tensor_parallel_size == 0) a.expert_tensor_parallel_size = a.tensor_model_parallel_size;
  const int ep = a.expert_model_parallel_size, etp = a.expert_tensor_parallel_size;
  MG_CHECK(ep >= 1 && etp >= 1, "--expert-model-parallel-size and --expert-tensor-parallel-size must be positive");
  MG_CHECK(a.num_experts > 0 || ep == 1, "--expert-model-parallel-size {} needs --num-experts", ep);
  if (a.num_experts == 0) return;
  const int expert_model_parallel = etp * ep * a.pipeline_model_parallel_size;
  MG_CHECK(a.world_size % expert_model_parallel == 0,
           "world size ({}) is not divisible by expert tensor ({}) x expert model ({}) x pipeline ({}) parallel size: "
           "launch a multiple of {} processes",
           a.world_size, etp, ep, a.pipeline_model_parallel_size, expert_model_parallel);
  if (!a.moe_expert_capacity_factor.empty()) {
    size_t used = 0;
    float f = 0;
    try {
      f = std::stof(a.moe_expert_capacity_factor, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    MG_CHECK(used == a.moe_expert_capacity_factor.size() && f > 0,
             "--moe-expert-capacity-factor must be a positive number (got '{}'); leave it out for dropless MoE",
             a.moe_expert_capacity_factor);
  }
  // The model's own rules (top-k, experts over EP, SP with TP, padding needs a capacity) are
  // TransformerConfig::finalize_moe's and the router's.
}

// Context parallelism and packed sequences (core/transformer/context_parallel.h, core/packed_seq_params.h).
void validate_context_parallel_args(const Arguments& a) {
  const int cp = a.context_parallel_size, tp = a.tensor_model_parallel_size;
  MG_CHECK(!a.reset_attention_mask || !a.no_create_attention_mask_in_dataloader,
           "--reset-attention-mask needs the documents the data loader finds: leave out "
           "--no-create-attention-mask-in-dataloader (with it Megatron would attend across documents)");
  if (!a.hierarchical_context_parallel_sizes.empty() || a.cp_comm_type == "a2a+p2p") {
    MG_CHECK(a.cp_comm_type == "a2a+p2p", "--hierarchical-context-parallel-sizes goes with --cp-comm-type a2a+p2p");
    MG_CHECK(a.hierarchical_context_parallel_sizes.size() == 2,
             "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A P (the a2a and p2p level sizes)");
    const int64_t prod = a.hierarchical_context_parallel_sizes[0] * a.hierarchical_context_parallel_sizes[1];
    MG_CHECK(prod == cp, "--hierarchical-context-parallel-sizes {} {} multiply to {}, not --context-parallel-size {}",
             a.hierarchical_context_parallel_sizes[0], a.hierarchical_context_parallel_sizes[1], prod, cp);
  }
  if (cp == 1) return;
  MG_CHECK(a.seq_length % (2 * cp) == 0,
           "--seq-length ({}) must be divisible by 2 x --context-parallel-size ({}): each rank holds two of the 2 x CP "
           "chunks of the sequence",
           a.seq_length, 2 * cp);
  MG_CHECK(!a.sequence_parallel || (a.seq_length / cp) % tp == 0,
           "--sequence-parallel with context parallelism: --seq-length / --context-parallel-size ({}) must be "
           "divisible by --tensor-model-parallel-size ({})",
           a.seq_length / cp, tp);
  MG_CHECK(!a.reset_attention_mask || a.micro_batch_size == 1,
           "--reset-attention-mask with --context-parallel-size > 1 needs --micro-batch-size 1 (Megatron's packed THD "
           "format), got {}",
           a.micro_batch_size);
  if (a.cp_comm_type == "a2a" || a.cp_comm_type == "a2a+p2p") {
    const int64_t ranks = a.cp_comm_type == "a2a" ? cp : a.hierarchical_context_parallel_sizes[0];
    const int groups = a.group_query_attention ? a.num_query_groups : a.num_attention_heads;
    MG_CHECK(a.num_attention_heads % (tp * ranks) == 0 && groups % (tp * ranks) == 0,
             "--cp-comm-type {} splits the heads over {} ranks: --num-attention-heads ({}) and the query groups ({}) "
             "must be divisible by tensor parallel ({}) x {}",
             a.cp_comm_type, ranks, a.num_attention_heads, groups, tp, ranks);
  }
}
}  // namespace

namespace {
// A shape or batch field: 0 is "not given" (validate_args also runs on Arguments built in code).
void require_positive(const char* flag, int64_t v) {
  MG_CHECK(v != 0, "{} is required", flag);
  MG_CHECK(v > 0, "{} must be a positive integer, got {}", flag, v);
}

// Creates `dir` (as the first save would) and a file in it, removed at once.
void check_writable_directory(const char* flag, const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  MG_CHECK(!ec && std::filesystem::is_directory(dir),
           "{} {}: cannot create the directory ({}): give a writable directory", flag, dir,
           ec ? ec.message() : std::string("a file is in the way"));
  const std::string probe = fmt::format("{}/.megatron-write-test-{}", dir, ::getpid());
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  const int err = errno;
  MG_CHECK(fd >= 0, "{} {} is not writable ({}): give a writable directory", flag, dir, std::strerror(err));
  ::close(fd);
  ::unlink(probe.c_str());
}
}  // namespace

Fp8Config fp8_config_from_args(const Arguments& a) {
  Fp8Config c;
  c.format = a.fp8_format;
  c.recipe = fp8_recipe_from_string(a.fp8_recipe);
  c.margin = a.fp8_margin;
  c.interval = a.fp8_interval;
  c.amax_history_len = a.fp8_amax_history_len;
  c.amax_compute_max = a.fp8_amax_compute_algo == "max";
  c.first_last_layers_bf16 = a.first_last_layers_bf16;
  c.num_layers_at_start_in_bf16 = a.num_layers_at_start_in_bf16;
  c.num_layers_at_end_in_bf16 = a.num_layers_at_end_in_bf16;
  c.param_gather = a.fp8_param_gather;
  c.wgrad = !a.no_fp8_wgrad;
  return c;
}

void validate_args(Arguments& a) {
  // ---- parallel layout (Megatron's order tp-cp-ep-dp-pp)
  const int model_parallel = a.tensor_model_parallel_size * a.pipeline_model_parallel_size * a.context_parallel_size;
  MG_CHECK(model_parallel > 0 && a.world_size % model_parallel == 0,
           "world size ({}) is not divisible by tensor ({}) x pipeline ({}) x context ({}) parallel size: launch a "
           "multiple of {} processes",
           a.world_size, a.tensor_model_parallel_size, a.pipeline_model_parallel_size, a.context_parallel_size,
           model_parallel);
  a.data_parallel_size = a.world_size / model_parallel;
  validate_moe_args(a);
  if (a.sequence_parallel && a.tensor_model_parallel_size == 1) a.sequence_parallel = false;  // as Megatron
  MG_CHECK(!a.apply_residual_connection_post_layernorm, "--apply-residual-connection-post-layernorm is not supported");

  // ---- model shape
  require_positive("--num-layers", a.num_layers);
  require_positive("--hidden-size", a.hidden_size);
  require_positive("--num-attention-heads", a.num_attention_heads);
  const int pp = a.pipeline_model_parallel_size;
  MG_CHECK(pp >= 1, "--pipeline-model-parallel-size must be >= 1");
  MG_CHECK(!(a.num_layers_per_virtual_pipeline_stage > 0 && a.num_virtual_stages_per_pipeline_rank > 0),
           "give only one of --num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank");
  if (a.num_layers_per_virtual_pipeline_stage > 0) {
    MG_CHECK(pp > 1, "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1");
    MG_CHECK(a.num_layers % (pp * a.num_layers_per_virtual_pipeline_stage) == 0,
             "--num-layers ({}) must be divisible by --pipeline-model-parallel-size ({}) x "
             "--num-layers-per-virtual-pipeline-stage ({})",
             a.num_layers, pp, a.num_layers_per_virtual_pipeline_stage);
    a.virtual_pipeline_model_parallel_size = a.num_layers / pp / a.num_layers_per_virtual_pipeline_stage;
  } else if (a.num_virtual_stages_per_pipeline_rank > 0) {
    MG_CHECK(pp > 1 || a.num_virtual_stages_per_pipeline_rank == 1,
             "--num-virtual-stages-per-pipeline-rank needs --pipeline-model-parallel-size > 1");
    a.virtual_pipeline_model_parallel_size = a.num_virtual_stages_per_pipeline_rank;
  }
  if (a.decoder_first_pipeline_num_layers == 0 && a.decoder_last_pipeline_num_layers == 0) {
    MG_CHECK(a.num_layers % (pp * a.virtual_pipeline_model_parallel_size) == 0,
             "--num-layers ({}) must be divisible by --pipeline-model-parallel-size ({}){}", a.num_layers, pp,
             a.virtual_pipeline_model_parallel_size > 1
                 ? fmt::format(" x virtual stages per rank ({})", a.virtual_pipeline_model_parallel_size)
                 : std::string());
  }
  MG_CHECK(!a.overlap_param_gather || a.use_distributed_optimizer,
           "--overlap-param-gather needs --use-distributed-optimizer");
  if (a.use_rotary_position_embeddings) a.position_embedding_type = "rope";
  // Megatron's rule: only RoPE goes without a learned position embedding under this old flag.
  MG_CHECK(!a.no_position_embedding || a.position_embedding_type == "rope",
           "--no-position-embedding is deprecated, use --position-embedding-type (it is accepted with rope only)");
  MG_CHECK(a.multi_latent_attention || a.rope_type != "yarn",
           "--rope-type yarn is Megatron's choice for multi-latent attention; standard attention takes only rope: for "
           "YaRN give --position-embedding-type yarn");
  // Megatron's MLA takes its RoPE from --rope-type (yarn unless given), whatever --position-embedding-type says.
  if (a.multi_latent_attention) a.position_embedding_type = a.rope_type.empty() ? "yarn" : a.rope_type;
  if (a.ffn_hidden_size == 0) {
    a.ffn_hidden_size = a.swiglu ? int((4.0 * a.hidden_size * 2.0 / 3.0) / 64.0) * 64 : 4 * a.hidden_size;
  }
  if (!a.group_query_attention) a.num_query_groups = a.num_attention_heads;
  // ---- FP8: Megatron's checks first, so a wrong combination says what is wrong
  fp8_config_from_args(a).validate(a.num_layers, pp, a.use_distributed_optimizer, a.hidden_size, a.ffn_hidden_size);
  if (!a.fp8_format.empty() && a.num_experts > 0 && fp8_recipe_from_string(a.fp8_recipe) == Fp8Recipe::Blockwise) {
    // Note [FP8 experts]: the experts and shared experts run in FP8 too, with their own widths.
    const int moe_ffn = a.moe_ffn_hidden_size > 0 ? a.moe_ffn_hidden_size : a.ffn_hidden_size;
    MG_CHECK(moe_ffn % kFp8BlockLen == 0 && a.moe_shared_expert_intermediate_size % kFp8BlockLen == 0,
             "--fp8-recipe blockwise needs --moe-ffn-hidden-size ({}) and --moe-shared-expert-intermediate-size ({}) "
             "to be multiples of the {} block",
             moe_ffn, a.moe_shared_expert_intermediate_size, kFp8BlockLen);
  }
  MG_CHECK(a.fp8_format.empty() || !(a.fp16), "--fp8-format with --fp16 is not supported: train FP8 with --bf16");
  require_positive("--seq-length", a.seq_length);
  MG_CHECK(!a.sequence_parallel || a.seq_length % a.tensor_model_parallel_size == 0,
           "--sequence-parallel splits the sequence over the tensor-parallel ranks: --seq-length ({}) must be "
           "divisible by --tensor-model-parallel-size ({})",
           a.seq_length, a.tensor_model_parallel_size);
  validate_context_parallel_args(a);
  if (a.max_position_embeddings == 0) a.max_position_embeddings = a.seq_length;
  if (a.position_embedding_type == "learned_absolute") {
    MG_CHECK(a.max_position_embeddings >= a.seq_length,
             "--max-position-embeddings ({}) must be at least --seq-length ({}) with learned position embeddings",
             a.max_position_embeddings, a.seq_length);
  }

  // ---- batches
  require_positive("--micro-batch-size", a.micro_batch_size);
  if (a.global_batch_size == 0) a.global_batch_size = a.micro_batch_size * a.data_parallel_size;
  MG_CHECK(a.global_batch_size % (a.micro_batch_size * a.data_parallel_size) == 0,
           "--global-batch-size ({}) must be divisible by --micro-batch-size ({}) x data-parallel size ({})",
           a.global_batch_size, a.micro_batch_size, a.data_parallel_size);
  if (!a.rampup_batch_size.empty()) {
    MG_CHECK(a.rampup_batch_size.size() == 3, "--rampup-batch-size takes three values: START INCR SAMPLES");
    MG_CHECK(a.train_iters == 0, "--rampup-batch-size needs sample-based training (--train-samples), as in Megatron");
  }

  // ---- training length and schedule
  if (!a.skip_train) {
    MG_CHECK((a.train_iters > 0) != (a.train_samples > 0), "give exactly one of --train-iters and --train-samples");
    MG_CHECK(a.lr >= 0.0 || a.lr == -1.0, "--lr must be a finite number >= 0, got {}", a.lr);
    MG_CHECK(a.lr >= 0.0, "--lr is required");
  }
  if (a.train_iters > 0) {
    MG_CHECK(a.lr_decay_samples == 0, "expected iteration-based learning rate decay (--lr-decay-iters)");
    MG_CHECK(a.lr_warmup_samples == 0, "expected iteration-based learning rate warmup (--lr-warmup-iters)");
  }
  if (a.train_samples > 0) {
    MG_CHECK(a.lr_decay_iters == 0, "expected sample-based learning rate decay (--lr-decay-samples)");
    MG_CHECK(a.lr_warmup_iters == 0, "expected sample-based learning rate warmup (--lr-warmup-samples)");
  }
  MG_CHECK(!(a.lr_warmup_fraction >= 0.0 && (a.lr_warmup_iters > 0 || a.lr_warmup_samples > 0)),
           "--lr-warmup-fraction and --lr-warmup-iters/--lr-warmup-samples cannot both be given");
  if (a.weight_decay_incr_style == "constant") {
    MG_CHECK(a.start_weight_decay < 0 && a.end_weight_decay < 0,
             "--start-weight-decay/--end-weight-decay need --weight-decay-incr-style linear or cosine");
    a.start_weight_decay = a.end_weight_decay = a.weight_decay;
  } else {
    MG_CHECK(a.start_weight_decay >= 0 && a.end_weight_decay >= 0,
             "--weight-decay-incr-style {} needs --start-weight-decay and --end-weight-decay",
             a.weight_decay_incr_style);
  }

  // ---- precision and recomputation
  MG_CHECK(!(a.bf16 && a.fp16), "--bf16 and --fp16 cannot both be given");
  // Megatron reduces in the parameters' dtype when not in fp32 (grad_reduce_in_fp32 = not
  // grad_reduce_in_bf16): only a bf16 model reduces in bf16.
  MG_CHECK(!a.grad_reduce_in_bf16 || a.bf16,
           "--grad-reduce-in-bf16 needs --bf16 (the gradients are reduced in the parameters' dtype, which is {} here)",
           a.fp16 ? "fp16" : "fp32");
  if (a.decoupled_min_lr >= 0 && a.decoupled_lr < 0) {
    logging::warn("--decoupled-min-lr has no effect without --decoupled-lr (as in Megatron)");
  }
  if (a.recompute_activations) a.recompute_granularity = "selective";
  if (a.recompute_granularity == "full") {
    MG_CHECK(!a.recompute_method.empty(), "--recompute-granularity full needs --recompute-method uniform or block");
  }

  // ---- data
  const bool per_split = !a.train_data_path.empty() || !a.valid_data_path.empty() || !a.test_data_path.empty();
  if (!a.skip_train || a.eval_iters > 0) {
    MG_CHECK(a.mock_data || !a.data_path.empty() || per_split,
             "no data: give --data-path (or --train-data-path/--valid-data-path/--test-data-path) or --mock-data");
  }
  MG_CHECK(!(per_split && !a.data_path.empty()), "give --data-path or the per-split paths, not both");
  // The blends' form (weights paired with prefixes) is checked now, not when the data is built.
  get_blend_from_list(a.data_path);
  get_blend_from_list(a.train_data_path);
  get_blend_from_list(a.valid_data_path);
  get_blend_from_list(a.test_data_path);
  if (a.split.empty()) a.split = a.mock_data ? "1,1,1" : "969, 30, 1";
  MG_CHECK(a.eval_interval > 0, "--eval-interval must be positive");
  MG_CHECK(a.log_interval > 0, "--log-interval must be positive");
  MG_CHECK(a.tensorboard_log_interval > 0, "--tensorboard-log-interval must be positive");
  if (a.profile) {
    MG_CHECK(a.profile_step_start >= 0 && a.profile_step_end > a.profile_step_start,
             "--profile needs 0 <= --profile-step-start < --profile-step-end (got {} and {})", a.profile_step_start,
             a.profile_step_end);
  }
  MG_CHECK(a.device == "auto" || a.device == "cpu" || a.device == "cuda", "--device must be auto, cpu or cuda");

  // ---- checkpoints: an unwritable --save fails now, not at the first save
  MG_CHECK(!a.use_checkpoint_args || !a.load.empty(),
           "--use-checkpoint-args takes the model arguments from the checkpoint in --load: give --load");
  if (!a.save.empty()) check_writable_directory("--save", a.save);

  // ---- CUDA graphs (what the full-iteration graph can follow: core/full_cuda_graph.h)
  if (a.enable_cuda_graph) a.cuda_graph_impl = "local";
  if (a.external_cuda_graph) a.cuda_graph_impl = "transformer_engine";
  MG_CHECK(a.cuda_graph_impl != "transformer_engine",
           "--cuda-graph-impl transformer_engine (--external-cuda-graph) needs TransformerEngine, which this build "
           "does not use: give --cuda-graph-impl local --cuda-graph-scope full_iteration");
  MG_CHECK(!a.fp8_param_gather || a.cuda_graph_impl != "local",
           "--fp8-param-gather with --cuda-graph-impl local is not supported: the FP8 weights' transposed copies are "
           "made anew after each optimizer step, which a replayed graph would not do; drop one of the flags");
  if (a.cuda_graph_impl == "local") {
    const bool full_iteration = a.cuda_graph_scope.size() == 1 && a.cuda_graph_scope[0] == "full_iteration";
    MG_CHECK(full_iteration,
             "--cuda-graph-impl local captures the whole step only: give --cuda-graph-scope full_iteration "
             "(per-layer scopes are not built)");
    MG_CHECK(a.device != "cpu", "CUDA graphs need a GPU: drop --device cpu or --cuda-graph-impl");
    MG_CHECK(a.cuda_graph_warmup_steps >= 1,
             "--cuda-graph-warmup-steps must be at least 1 (the eager steps build the plans the graph replays)");
    MG_CHECK(a.tensor_model_parallel_size == 1 && a.pipeline_model_parallel_size == 1 && a.context_parallel_size == 1,
             "the full-iteration CUDA graph does not capture tensor, pipeline or context parallelism yet: give "
             "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1, or drop --cuda-graph-impl");
    MG_CHECK(!a.reset_attention_mask,
             "the full-iteration CUDA graph cannot capture --reset-attention-mask (each batch's documents are copied "
             "to the GPU inside the step): drop one of them");
    MG_CHECK(!a.overlap_grad_reduce,
             "--overlap-grad-reduce would launch the gradient reduction inside the CUDA graph: drop it (the "
             "reduction runs after the graph) or drop --cuda-graph-impl");
  } else {
    MG_CHECK(a.cuda_graph_scope.empty(), "--cuda-graph-scope needs --cuda-graph-impl local");
  }

  // ---- multi-token prediction (the model's own rules: TransformerConfig::finalize_mtp)
  if (a.mtp_num_layers > 0) {
    MG_CHECK(!a.reset_attention_mask,
             "--mtp-num-layers with --reset-attention-mask is not supported: the MTP block would shift tokens across "
             "the packed documents' boundaries; drop one of them");
    MG_CHECK(a.cuda_graph_impl != "local",
             "--mtp-num-layers with --cuda-graph-impl local is not supported: drop --cuda-graph-impl");
  }
}

void check_deterministic_nccl(const Arguments& a, bool uses_nccl) {
  if (!a.deterministic_mode || !uses_nccl) return;
  const char* algo = std::getenv("NCCL_ALGO");
  const std::string v = algo ? algo : "";
  MG_CHECK(v == "Tree" || v == "Ring" || v == "CollnetDirect" || v == "CollnetChain" || v == "^NVLS",
           "--deterministic-mode on several GPUs needs NCCL_ALGO set to one of Tree, Ring, CollnetDirect, "
           "CollnetChain, ^NVLS (got '{}'): export it before the launch", v);
}

}  // namespace megatron
