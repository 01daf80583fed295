#include "megatron/training/training.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <map>

#include "megatron/core/comm/communicator.h"
#include "megatron/core/datasets/blended_megatron_dataset_builder.h"
#include "megatron/core/distributed/distributed_data_parallel.h"
#include "megatron/core/full_cuda_graph.h"
#include "megatron/core/optimizer/optimizer.h"
#include "megatron/core/optimizer/optimizer_param_scheduler.h"
#include "megatron/core/transformer/aux_loss_tracker.h"
#include "megatron/kernels/ops.h"
#include "megatron/runtime/profiler.h"
#include "megatron/runtime/logging.h"
#include "megatron/training/checkpointing.h"
#include "megatron/training/num_microbatches.h"
#include "megatron/training/signal_handler.h"
#include "megatron/training/tensorboard.h"
#include "megatron/training/timers.h"
#include "megatron/training/training_log.h"

namespace megatron {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Megatron prints from one rank (print_rank_last for the iteration log): here the last rank prints
// everything, the others stay quiet unless they have an error to report.
bool g_printing_rank = true;

void print_line(const std::string& s) { print_rank_last(s); }

// Megatron's get_train_valid_test_num_samples, printed by build_train_valid_test_datasets.
std::string dataset_target_sizes(const Arguments& a) {
  GPTDataArgs d;
  if (a.train_samples > 0) d.train_samples = a.train_samples;
  d.train_iters = a.train_iters;
  d.eval_interval = a.eval_interval;
  d.eval_iters = a.eval_iters;
  d.global_batch_size = a.global_batch_size;
  const SplitSizes n = train_valid_test_num_samples(d);
  auto str = [](const std::optional<int64_t>& v) { return v ? std::to_string(*v) : std::string("None"); };
  return fmt::format(" > datasets target sizes (minimum size):\n    train:      {}\n    validation: {}\n    test:       {}",
                     str(n[0]), str(n[1]), str(n[2]));
}

OptimizerConfig optimizer_config_from_args(const Arguments& a) {
  OptimizerConfig c;
  c.lr = a.lr;
  c.min_lr = a.min_lr;
  c.weight_decay = a.weight_decay;
  c.fp16 = a.fp16;
  c.bf16 = a.bf16;
  c.loss_scale = a.loss_scale;
  c.initial_loss_scale = a.initial_loss_scale;
  c.min_loss_scale = a.min_loss_scale;
  c.loss_scale_window = a.loss_scale_window;
  c.hysteresis = a.hysteresis;
  c.adam_beta1 = a.adam_beta1;
  c.adam_beta2 = a.adam_beta2;
  c.adam_eps = a.adam_eps;
  c.clip_grad = a.clip_grad;
  c.log_num_zeros_in_grad = a.log_num_zeros_in_grad;
  return c;
}

// Megatron's get_optimizer_param_scheduler: iteration-based flags become samples.
OptimizerParamSchedulerConfig scheduler_config_from_args(const Arguments& a) {
  if (a.train_iters > 0 || a.train_samples == 0) {
    IterationScheduleArgs s;
    s.train_iters = std::max<int64_t>(a.train_iters, 1);
    s.global_batch_size = a.global_batch_size;
    s.lr = std::max(a.lr, 0.0);
    s.min_lr = a.min_lr;
    s.lr_warmup_init = a.lr_warmup_init;
    s.lr_decay_style = lr_decay_style_from_string(a.lr_decay_style);
    if (a.lr_decay_iters > 0) s.lr_decay_iters = a.lr_decay_iters;
    s.lr_warmup_iters = a.lr_warmup_iters;
    if (a.lr_warmup_fraction >= 0) s.lr_warmup_fraction = a.lr_warmup_fraction;
    if (a.lr_wsd_decay_iters > 0) s.lr_wsd_decay_iters = a.lr_wsd_decay_iters;
    s.lr_wsd_decay_style = wsd_decay_style_from_string(a.lr_wsd_decay_style);
    s.weight_decay = a.weight_decay;
    s.start_weight_decay = a.start_weight_decay;
    s.end_weight_decay = a.end_weight_decay;
    s.weight_decay_incr_style = wd_incr_style_from_string(a.weight_decay_incr_style);
    OptimizerParamSchedulerConfig c = scheduler_config_from_iterations(s);
    c.override_opt_param_scheduler = a.override_opt_param_scheduler;
    c.use_checkpoint_opt_param_scheduler = !a.override_opt_param_scheduler;
    return c;
  }
  // Sample-based training (--train-samples).
  OptimizerParamSchedulerConfig c;
  c.init_lr = a.lr_warmup_init;
  c.max_lr = a.lr;
  c.min_lr = a.min_lr;
  c.lr_decay_steps = a.lr_decay_samples > 0 ? a.lr_decay_samples : a.train_samples;
  c.lr_warmup_steps =
      a.lr_warmup_fraction >= 0 ? a.lr_warmup_fraction * double(c.lr_decay_steps) : double(a.lr_warmup_samples);
  c.lr_decay_style = lr_decay_style_from_string(a.lr_decay_style);
  if (a.lr_wsd_decay_samples > 0) c.wsd_decay_steps = a.lr_wsd_decay_samples;
  c.lr_wsd_decay_style = wsd_decay_style_from_string(a.lr_wsd_decay_style);
  c.start_wd = a.start_weight_decay;
  c.end_wd = a.end_weight_decay;
  c.wd_incr_steps = a.train_samples;
  c.wd_incr_style = wd_incr_style_from_string(a.weight_decay_incr_style);
  c.override_opt_param_scheduler = a.override_opt_param_scheduler;
  c.use_checkpoint_opt_param_scheduler = !a.override_opt_param_scheduler;
  return c;
}

// The scheduler's values for the next step into the optimizer: lr and weight decay, and with
// --decoupled-lr the embedding and output layer's rate on the same schedule between
// --decoupled-lr and --decoupled-min-lr (default --min-lr), as Megatron's param group overrides.
void apply_scheduled_values(const Arguments& a, const OptimizerParamScheduler& scheduler, AdamOptimizer& optimizer) {
  const ScheduledValues v = scheduler.values();
  optimizer.set_lr(v.lr);
  optimizer.set_weight_decay(v.wd);
  if (a.decoupled_lr >= 0)
    optimizer.set_decoupled_lr(scheduler.get_lr(a.decoupled_lr, a.decoupled_min_lr >= 0 ? a.decoupled_min_lr : a.min_lr));
}

std::string memory_report(Device device, int64_t iteration) {
  MemoryStats m = memory_stats(device);
  const double mb = 1024.0 * 1024.0;
  return fmt::format("[Rank 0] (after {} iterations) memory (MB) | allocated: {:.2f} | max allocated: {:.2f}",
                     iteration, m.allocated / mb, m.peak_allocated / mb);
}

// This rank's parameters over all its model chunks (what a checkpoint saves and loads).
std::vector<Parameter*> chunk_parameters(const std::vector<std::unique_ptr<ModelChunk>>& chunks) {
  std::vector<Parameter*> v;
  for (const auto& c : chunks)
    for (Parameter* p : c->params().parameters()) v.push_back(p);
  return v;
}

// The non-parameter state a checkpoint carries (ModelChunk::buffers), over all model chunks.
std::vector<ModelBuffer> chunk_buffers(const std::vector<std::unique_ptr<ModelChunk>>& chunks) {
  std::vector<ModelBuffer> v;
  for (const auto& c : chunks)
    for (const auto& b : c->buffers()) v.push_back(b);
  return v;
}

// Note [Killing a rank]: MEGATRON_FAULT_INJECT=kill-rank:R:N makes world rank R send itself SIGKILL
// after iteration N (tests: a dead rank must end the job, never hang it).
void maybe_kill_rank(int rank, int64_t iteration) {
  const char* spec = std::getenv("MEGATRON_FAULT_INJECT");
  int r = -1;
  long long n = -1;
  if (spec && std::sscanf(spec, "kill-rank:%d:%lld", &r, &n) == 2 && r == rank && n == iteration) {
    std::fflush(stdout);
    ::raise(SIGKILL);
  }
}

// Everything the loop carries between iterations.
struct Trainer {
  Arguments& args;
  const PretrainCallbacks& callbacks;
  Context& ctx;
  ParallelState& ps;
  const TransformerConfig& config;
  std::vector<std::unique_ptr<ModelChunk>>& chunks;
  DistributedDataParallel& ddp;
  AdamOptimizer& optimizer;
  OptimizerParamScheduler& scheduler;
  Checkpointer& checkpointer;
  NumMicroBatchesCalculator& microbatches;
  DataIterators& data;
  TensorBoardWriter* tb;
  TrainingProgress& progress;
  Clock::time_point program_start;
  Timers timers{args.timing_log_level};
  SignalHandler* signals = nullptr;
  std::FILE* loss_log = nullptr;
  FullCudaGraph* cuda_graph = nullptr;  // --cuda-graph-impl local: the step's forward and backward as one graph
  AuxLossTracker* aux_losses = nullptr;  // the extra losses the model's modules report

  // Interval accumulators (Megatron's total_loss_dict).
  double interval_loss = 0;
  std::map<std::string, double> interval_aux;  // per aux loss: Σ over the interval's advanced steps
  std::map<std::string, double> last_aux;      // the last step's aux losses
  int64_t interval_advanced = 0, interval_skipped = 0, interval_nan = 0;
  int64_t total_skipped = 0;
  Clock::time_point interval_start = Clock::now();
  OpProfiler op_profiler;  // --profile
  bool profile_started = false;
  Clock::time_point profile_start;
  bool reported_memory = false;

  float loss_scale() const { return optimizer.loss_scale(); }
  std::vector<const ModelChunk*> chunk_ptrs() const {
    std::vector<const ModelChunk*> v;
    for (const auto& c : chunks) v.push_back(c.get());
    return v;
  }

  ForwardBackwardArgs fb_args(float scale, bool forward_only) const {
    ForwardBackwardArgs a;
    a.num_microbatches = int(microbatches.num_microbatches());
    a.micro_batch_size = args.micro_batch_size;
    a.seq_length = args.seq_length;
    a.loss_scale = scale;
    a.forward_only = forward_only;
    a.calculate_per_token_loss = args.calculate_per_token_loss;
    return a;
  }
  /// Whether `flag` is set on any rank (Megatron all-reduces its exit conditions).
  bool any_rank(bool flag) {
    if (ps.world_size() == 1) return flag;
    Tensor t = Tensor::from_ints({flag ? 1 : 0}, {1}, DType::Int32, ctx.device());
    ps.world().all_reduce(ctx, t, ReduceOp::Max)->wait();
    return t.to(Device::cpu()).data<int32_t>()[0] != 0;
  }

  void apply_schedule() { apply_scheduled_values(args, scheduler, optimizer); }

  // One iteration: all microbatches of the global batch, then the optimizer.
  OptimizerStepResult train_step(double& lm_loss) {
    ddp.zero_grad(ctx);
    ddp.finish_param_sync(ctx);  // --overlap-param-gather: the previous step's all-gathers
    // Megatron's MoEAuxLossAutoScaler.set_loss_scale: the aux losses' gradient, like the main loss's.
    // Megatron's MoEAuxLossAutoScaler scale: the loss scale over the microbatches, times the CP size
    // (each CP rank's aux loss is its part of the sequence's; the gradient mean over data × context
    // would otherwise shrink it, as for the main loss: Note [Loss under context parallelism]).
    // With a per-token loss (Note [Per-token loss]) the scale is the loss scale alone, as Megatron's.
    if (aux_losses) {
      aux_losses->set_backward_scale(args.calculate_per_token_loss
                                         ? loss_scale()
                                         : float(loss_scale() * double(ps.cp_size()) /
                                                 double(microbatches.num_microbatches())));
    }
    // Note [FP8 weight cache]: each FP8 weight quantised once for the step's microbatches; with one,
    // the experts keep their transposed weights from the forward to the backward.
    const bool keep_fp8_copies = !cuda_graph && !args.disable_parameter_transpose_cache;
    const bool cache_fp8_weights = microbatches.num_microbatches() > 1 && keep_fp8_copies;
    for (auto& c : chunks) c->begin_fp8_step(cache_fp8_weights, keep_fp8_copies);
    timers.start("forward-backward", 1);
    LossSums sums = cuda_graph ? cuda_graph->forward_backward(ctx, &ps, chunk_ptrs(), callbacks.forward_step,
                                                              data.train, fb_args(loss_scale(), false), &ddp)
                               : forward_backward(ctx, &ps, chunk_ptrs(), callbacks.forward_step, data.train,
                                                  fb_args(loss_scale(), false), &ddp);
    finalize_model_grads(ctx, ddp, args.calculate_per_token_loss ? std::optional<double>(sums.num_tokens) : std::nullopt);
    for (auto& c : chunks) c->finish_router_step(ctx);
    for (auto& c : chunks) c->finish_fp8_step(ctx);
    timers.stop("forward-backward");
    if (args.empty_unused_memory_level >= 1) empty_cache(ctx.device());
    if (aux_losses && !aux_losses->empty()) {  // Megatron's track_moe_metrics
      for (const auto& [name, value] : aux_losses->report(ctx, &ps.pipeline(), &ps.data(),
                                                          int(microbatches.num_microbatches()))) {
        last_aux[name] = value;
      }
    }
    timers.start("optimizer", 1);
    OptimizerStepResult r = optimizer.step(ctx);
    timers.stop("optimizer");
    if (args.empty_unused_memory_level >= 2) empty_cache(ctx.device());
    if (r.update_successful) {
      scheduler.step(microbatches.current_global_batch_size());
      apply_schedule();
    }
    lm_loss = sums.num_tokens > 0 ? sums.loss_sum / sums.num_tokens : 0.0;
    return r;
  }

  double params_norm() { return optimizer.params_norm(ctx); }

  void log(const OptimizerStepResult& r, int64_t train_iters) {
    const int64_t iterations = interval_advanced + interval_skipped;
    const double elapsed_ms = seconds_since(interval_start) * 1000.0 / double(std::max<int64_t>(iterations, 1));
    const int64_t gbs = microbatches.current_global_batch_size();
    IterationLogFields f;
    f.iteration = progress.iteration;
    f.train_iters = train_iters;
    f.consumed_samples = progress.consumed_train_samples;
    f.elapsed_ms_per_iteration = elapsed_ms;
    const double flops = num_floating_point_operations(args, config.padded_vocab_size, gbs);
    if (args.log_throughput) {
      f.tflops_per_gpu = flops / (elapsed_ms / 1000.0 * 1e12 * args.world_size);
      f.tokens_per_sec_per_gpu = double(gbs) * args.seq_length / (elapsed_ms / 1000.0) / args.world_size;
    }
    // Megatron's logged learning rate passes through a float32 tensor (its printed digits are the
    // fp32 value's; the schedule itself is computed in double).
    f.learning_rate = static_cast<float>(optimizer.lr());
    f.global_batch_size = gbs;
    if (interval_advanced > 0) f.losses.emplace_back("lm loss", interval_loss / double(interval_advanced));
    // Megatron's order: the MoE losses (track_moe_metrics), then the MTP losses (track_mtp_metrics).
    for (bool mtp : {false, true}) {
      for (const auto& [name, sum] : interval_aux) {
        if (interval_advanced > 0 && (name.rfind("mtp_", 0) == 0) == mtp)
          f.losses.emplace_back(name, sum / double(interval_advanced));
      }
    }
    f.loss_scale = loss_scale();
    f.grad_norm = r.grad_norm;
    f.num_zeros_in_grad = r.num_zeros_in_grad;
    if (args.log_params_norm) f.params_norm = params_norm();
    f.skipped_iterations = interval_skipped;
    f.nan_iterations = interval_nan;
    print_line(format_iteration_line(f));
    if (args.moe_per_layer_logging && aux_losses && aux_losses->tracks_tokens_per_expert()) {
      // --moe-per-layer-logging: each MoE layer's tokens per expert over the interval (summed over
      // the tensor, data and pipeline ranks: collective) and its aux losses of the last step.
      for (const auto& [layer, counts] :
           aux_losses->take_tokens_per_expert(ctx, {&ps.tensor(), &ps.data(), &ps.pipeline()})) {
        std::string line = fmt::format(" > layer {} tokens per expert:", layer);
        double total = 0, most = 0;
        for (double c : counts) line += fmt::format(" {:.0f}", c), total += c, most = std::max(most, c);
        line += fmt::format(" (max/mean {:.2f})", total > 0 ? most * double(counts.size()) / total : 0.0);
        for (const auto& [name, layers] : aux_losses->last_per_layer()) {
          if (auto it = layers.find(layer); it != layers.end()) line += fmt::format(" | {}: {:.6E}", name, it->second);
        }
        print_line(line);
        if (tb) {
          for (size_t e = 0; e < counts.size(); ++e)
            tb->add_scalar(fmt::format("moe/tokens_per_expert_layer_{}_expert_{}", layer, e), counts[e],
                           progress.iteration);
        }
      }
    }
    if (!reported_memory) {
      print_line(format_theoretical_memory(
          theoretical_memory(args, config.padded_vocab_size, microbatches.num_microbatches())));
      print_line(memory_report(ctx.device(), progress.iteration));
      reported_memory = true;
    }
    const std::string t = timers.log(double(std::max<int64_t>(iterations, 1)));
    if (!t.empty()) std::fputs(t.c_str(), stdout);
    if (tb) {  // the interval's timing, at the log interval as Megatron (the rest: write_tensorboard)
      const int64_t it = progress.iteration;
      tb->add_scalar("iteration-time", elapsed_ms / 1000.0, it);
      if (f.tflops_per_gpu) tb->add_scalar("throughput", *f.tflops_per_gpu, it);
      if (f.tokens_per_sec_per_gpu) tb->add_scalar("tokens-per-second-per-gpu", *f.tokens_per_sec_per_gpu, it);
      if (f.params_norm) tb->add_scalar("params-norm", *f.params_norm, it);  // collective: computed by log()
      tb->flush();
    }
    interval_loss = 0;
    interval_aux.clear();
    interval_advanced = interval_skipped = interval_nan = 0;
    interval_start = Clock::now();
  }

  // Note [TensorBoard values]: as Megatron's training_log, every --tensorboard-log-interval
  // iterations the values of that iteration (not the --log-interval averages the printed line
  // shows): learning rate, batch size, lm loss, loss scale, gradient norm (and zeros, memory with
  // their flags), each also against consumed samples; with --log-timers-to-tensorboard the printed
  // timers as "<name>-time" (seconds per iteration of the log interval so far, not reset).
  // Iteration time, throughput and the parameter norm (a collective the printing rank alone
  // cannot run) stay at the log interval.
  void write_tensorboard(const OptimizerStepResult& r, double lm_loss) {
    const int64_t it = progress.iteration, samples = progress.consumed_train_samples;
    const double lr = static_cast<float>(optimizer.lr()), gbs = double(microbatches.current_global_batch_size());
    tb->add_scalar("learning-rate", lr, it);
    tb->add_scalar("learning-rate vs samples", lr, samples);
    tb->add_scalar("batch-size", gbs, it);
    tb->add_scalar("batch-size vs samples", gbs, samples);
    if (r.update_successful) {
      tb->add_scalar("lm loss", lm_loss, it);
      tb->add_scalar("lm loss vs samples", lm_loss, samples);
    }
    if (args.log_loss_scale_to_tensorboard) {
      tb->add_scalar("loss-scale", loss_scale(), it);
      tb->add_scalar("loss-scale vs samples", loss_scale(), samples);
    }
    if (args.log_world_size_to_tensorboard) {
      tb->add_scalar("world-size", double(args.world_size), it);
      tb->add_scalar("world-size vs samples", double(args.world_size), samples);
    }
    if (r.grad_norm) {
      tb->add_scalar("grad-norm", *r.grad_norm, it);
      tb->add_scalar("grad-norm vs samples", *r.grad_norm, samples);
    }
    if (r.num_zeros_in_grad) tb->add_scalar("num-zeros", double(*r.num_zeros_in_grad), it);
    if (args.log_memory_to_tensorboard) {
      MemoryStats m = memory_stats(ctx.device());
      tb->add_scalar("mem-reserved-bytes", double(m.reserved), it);
      tb->add_scalar("mem-allocated-bytes", double(m.allocated), it);
      tb->add_scalar("mem-max-allocated-bytes", double(m.peak_allocated), it);
      tb->add_scalar("mem-allocated-count", double(m.num_allocs), it);
    }
    if (args.log_timers_to_tensorboard) {
      const double n = double(std::max<int64_t>(interval_advanced + interval_skipped, 1));
      for (const auto& [name, seconds] : timers.values(n)) tb->add_scalar(name + "-time", seconds, it);
    }
  }

  // Megatron's evaluate_and_print_results.
  void evaluate(const std::string& prefix, BatchIterator& iterator, bool is_test) {
    if (!iterator || args.eval_iters <= 0) return;
    LossSums total;
    ddp.finish_param_sync(ctx);
    if (aux_losses) aux_losses->set_evaluating(true);  // evaluation reports the lm loss only
    for (int64_t k = 0; k < args.eval_iters; ++k) {
      LossSums s = forward_backward(ctx, &ps, chunk_ptrs(), callbacks.forward_step, iterator, fb_args(1.0f, true));
      if (args.empty_unused_memory_level >= 1) empty_cache(ctx.device());
      total.loss_sum += s.loss_sum;
      total.num_tokens += s.num_tokens;
      if (!is_test) progress.consumed_valid_samples += microbatches.current_global_batch_size();
    }
    if (aux_losses) aux_losses->set_evaluating(false);
    const double loss = total.num_tokens > 0 ? total.loss_sum / total.num_tokens : 0.0;
    print_line(format_validation_block(prefix, {{"lm loss", loss}}));
    if (tb) {
      const std::string split = is_test ? "test" : "validation";
      tb->add_scalar("lm loss " + split, loss, progress.iteration);
      tb->add_scalar("lm loss " + split + " vs samples", loss, progress.consumed_train_samples);
      if (args.log_validation_ppl_to_tensorboard) {
        tb->add_scalar("lm loss " + split + " ppl", std::exp(std::min(20.0, loss)), progress.iteration);
      }
      tb->flush();
    }
  }

  void save() {
    if (args.save.empty()) return;
    timers.start("save-checkpoint", 0);
    ddp.finish_param_sync(ctx);
    checkpointer.save(ctx, chunk_parameters(chunks), args.no_save_optim ? nullptr : &optimizer, &scheduler, progress);
    timers.stop("save-checkpoint");
    const double ms = timers.elapsed_ms("save-checkpoint", /*reset=*/false);
    print_line(fmt::format("  {} checkpoint at iteration {:7d} to {} in {:.1f} ms",
                           args.async_save ? "scheduled" : "saved", progress.iteration, args.save, ms));
  }

  // Megatron's checkpoint_and_decide_exit. Returns true when training must stop now.
  bool checkpoint_and_decide_exit() {
    if (signals && any_rank(signals->signal_received())) {  // every rank has a handler with the flag
      save();
      print_line(datetime_line("exiting program after receiving SIGTERM."));
      return true;
    }
    bool saved = false;
    if (args.save_interval > 0 && progress.iteration % args.save_interval == 0) {
      save();
      saved = !args.save.empty();
    }
    if (args.exit_duration_in_mins > 0) {
      const double minutes = seconds_since(program_start) / 60.0;
      if (any_rank(minutes > args.exit_duration_in_mins)) {
        if (!saved) save();
        print_line(datetime_line(fmt::format("exiting program after {:.3f} minutes", minutes)));
        return true;
      }
    }
    if (args.exit_interval > 0 && progress.iteration % args.exit_interval == 0) {
      if (!saved) save();
      print_line(datetime_line(fmt::format("exiting program at iteration {}", progress.iteration)));
      return true;
    }
    return false;
  }

  // --profile (Megatron's nsys path): iterations [--profile-step-start, --profile-step-end) of the
  // ranks in --profile-ranks run inside cudaProfilerStart/Stop, so `nsys profile
  // --capture-range=cudaProfilerApi` records just them; the op profiler (runtime/profiler.h)
  // brackets every op meanwhile and the rank prints where the time went. A captured CUDA graph
  // replays without the ops' brackets: then only the device range is set.
  bool profiling_rank() const {
    if (!args.profile) return false;
    return args.profile_ranks.empty() ||
           std::find(args.profile_ranks.begin(), args.profile_ranks.end(), int64_t(ps.rank())) !=
               args.profile_ranks.end();
  }
  void begin_profile() {
    ctx.synchronize();
    device_profiler_range(ctx.is_cuda(), true);
    if (!cuda_graph) ctx.set_profiler(&op_profiler);
    profile_started = true;
    profile_start = Clock::now();
  }
  void end_profile() {
    ctx.synchronize();
    const double wall_ms = seconds_since(profile_start) * 1000.0;
    device_profiler_range(ctx.is_cuda(), false);
    ctx.set_profiler(nullptr);
    profile_started = false;
    const int64_t n = args.profile_step_end - args.profile_step_start;
    std::string out = fmt::format(" > profile of rank {}, iterations {} to {} ({:.1f} ms per iteration){}\n",
                                  ps.rank(), args.profile_step_start + 1, args.profile_step_end,
                                  wall_ms / double(n),
                                  cuda_graph ? ": the steps replay a CUDA graph, so no op table (ops run unbracketed)"
                                             : "");
    if (!cuda_graph) out += format_op_table(op_profiler.collect(ctx), wall_ms, n);
    std::fputs(out.c_str(), stdout);
    std::fflush(stdout);
  }

  // Returns true when an exit condition stopped training.
  bool train(int64_t train_iters) {
    bool first = true;
    while (args.train_iters > 0 ? progress.iteration < args.train_iters
                                : progress.consumed_train_samples < args.train_samples) {
      microbatches.update(progress.consumed_train_samples);
      if (profiling_rank() && progress.iteration == args.profile_step_start) begin_profile();
      double lm_loss = 0;
      OptimizerStepResult r = train_step(lm_loss);
      if (first) {
        print_line(fmt::format("time from process start to the end of the first iteration (seconds): {:.3f}",
                               seconds_since(program_start)));
        first = false;
      }
      progress.iteration += 1;
      progress.consumed_train_samples += microbatches.current_global_batch_size();
      if (profile_started && progress.iteration == args.profile_step_end) end_profile();
      maybe_kill_rank(ps.rank(), progress.iteration);
      if (loss_log) {  // MEGATRON_LOSS_LOG: every iteration's loss in full precision (tests)
        std::string aux;  // the step's aux losses (track_moe_metrics' values)
        for (const auto& [name, value] : last_aux) aux += fmt::format(", \"{}\": {:.17g}", name, value);
        std::fprintf(loss_log, "{\"iteration\": %lld, \"lm_loss\": %.17g, \"grad_norm\": %.17g%s}\n",
                     static_cast<long long>(progress.iteration), lm_loss, r.grad_norm.value_or(0.0), aux.c_str());
        std::fflush(loss_log);
      }
      progress.floating_point_operations_so_far += num_floating_point_operations(
          args, config.padded_vocab_size, microbatches.current_global_batch_size());
      if (r.update_successful) {
        interval_advanced += 1;
        interval_loss += lm_loss;
        for (const auto& [name, value] : last_aux) interval_aux[name] += value;
        if (tb) {
          for (const auto& [name, value] : last_aux) tb->add_scalar(name, value, progress.iteration);
          if (args.moe_per_layer_logging) {  // Megatron's track_moe_metrics with per_layer_logging
            for (const auto& [name, layers] : aux_losses->last_per_layer())
              for (const auto& [layer, value] : layers)
                tb->add_scalar(fmt::format("moe/{}_layer_{}", name, layer), value, progress.iteration);
          }
        }
      } else {
        interval_skipped += 1;
        total_skipped += 1;
      }
      if (!std::isfinite(lm_loss)) interval_nan += 1;
      if (tb && progress.iteration % args.tensorboard_log_interval == 0) write_tensorboard(r, lm_loss);
      if (progress.iteration % args.log_interval == 0) log(r, train_iters);
      if (args.eval_interval > 0 && progress.iteration % args.eval_interval == 0) {
        evaluate(fmt::format("iteration {}", progress.iteration), data.valid, false);
      }
      if (checkpoint_and_decide_exit()) return true;
    }
    return false;
  }
};

}  // namespace

void print_rank_last(const std::string& line) {
  if (!g_printing_rank) return;
  std::fputs(line.c_str(), stdout);
  std::fputc('\n', stdout);
  std::fflush(stdout);
}

Device select_device(const std::string& requested, int local_rank) {
  const bool gpu = ops::has_cuda_kernels() && cuda_device_count() > 0;
  if (requested == "cpu") return Device::cpu();
  if (requested == "cuda") {
    MG_CHECK(ops::has_cuda_kernels(), "--device cuda: this build has no CUDA kernels; rebuild with -DMEGATRON_CUDA=ON");
    MG_CHECK(cuda_device_count() > 0, "--device cuda: no GPU is visible to this process");
  } else if (!gpu) {
    return Device::cpu();
  }
  return Device::cuda(local_rank % cuda_device_count());  // one process per GPU
}

static void check_fp8_device(const Arguments& args, Device device) {
  if (args.fp8_format.empty()) return;
  if (!device.is_cuda()) {
    MG_CHECK(args.fp8_cpu_reference,
             "--fp8-format {} needs a Hopper (sm_90) or newer GPU, and this run is on the CPU (add "
             "--fp8-cpu-reference to run the slow CPU reference of the FP8 ops, for tests)",
             args.fp8_format);
    return;
  }
  const int cc = cuda_compute_capability(device.index);
  MG_CHECK(cc >= 90,
           "--fp8-format {} needs a Hopper (sm_90) or newer GPU: {} has compute capability {}.{} (train with --bf16)",
           args.fp8_format, device.str(), cc / 10, cc % 10);
}

int pretrain(Arguments args, const PretrainCallbacks& callbacks, Clock::time_point program_start) {
  const LaunchInfo launch = detect_launch();
  args.world_size = launch.world_size;
  if (args.use_checkpoint_args && !args.load.empty()) apply_checkpoint_args(args, args.load);
  validate_args(args);
  const Device device = select_device(args.device, launch.local_rank);
  check_fp8_device(args, device);
  check_deterministic_nccl(args, args.world_size > 1 && device.is_cuda());
  ParallelConfig layout;
  layout.tensor_model_parallel_size = args.tensor_model_parallel_size;
  layout.pipeline_model_parallel_size = args.pipeline_model_parallel_size;
  layout.context_parallel_size = args.context_parallel_size;
  for (int64_t h : args.hierarchical_context_parallel_sizes) layout.hierarchical_context_parallel_sizes.push_back(int(h));
  layout.expert_model_parallel_size = args.expert_model_parallel_size;
  layout.expert_tensor_parallel_size = args.expert_tensor_parallel_size;
  layout.virtual_pipeline_model_parallel_size = args.virtual_pipeline_model_parallel_size;
  layout.sequence_parallel = args.sequence_parallel;
  ParallelState ps(init_world(launch, device, std::chrono::minutes(args.distributed_timeout_minutes)), layout);
  g_printing_rank = ps.rank() == ps.world_size() - 1;
  logging::set_single_rank(g_printing_rank);
  args.data_parallel_rank = ps.dp_rank();
  args.context_parallel_rank = ps.cp_rank();
  // Megatron's validate_args output: the layout, then every argument.
  print_line(fmt::format(
      "using world size: {}, data-parallel size: {}, context-parallel size: {}, hierarchical context-parallel sizes: "
      "{}, tensor-model-parallel size: {}, pipeline-model-parallel size: {}",
      args.world_size, args.data_parallel_size, args.context_parallel_size,
      args.hierarchical_context_parallel_sizes.empty() ? std::string("None")
                                                        : fmt::format("[{}]", fmt::join(args.hierarchical_context_parallel_sizes, ", ")),
      args.tensor_model_parallel_size, args.pipeline_model_parallel_size));
  print_line(format_arguments(args));
  if (args.rampup_batch_size.empty()) {
    logging::log_single_rank(logging::kInfo, "megatron.core.num_microbatches_calculator",
                             fmt::format("setting number of microbatches to constant {}",
                                         args.global_batch_size / (args.micro_batch_size * args.data_parallel_size)));
  }
  if (const char* env = std::getenv("MEGATRON_LOGGING_LEVEL"); args.logging_level >= 0 || (env && *env)) {
    logging::log_single_rank(logging::kInfo, "megatron.training.initialize",
                             fmt::format("Setting logging level to {}", logging::level()));
  }
  Context ctx(device, uint64_t(args.seed));
  ctx.set_deterministic(args.deterministic_mode);

  std::unique_ptr<Tokenizer> tokenizer;
  if (args.tokenizer_type.empty() && args.vocab_size > 0) args.tokenizer_type = "NullTokenizer";
  MG_CHECK(!args.tokenizer_type.empty(), "--tokenizer-type is required (or --vocab-size for a NullTokenizer)");
  tokenizer = build_tokenizer(tokenizer_args_from_args(args));
  print_line(fmt::format("> building {} tokenizer ...", args.tokenizer_type));

  TransformerConfig config = transformer_config_from_args(args, tokenizer->vocab_size());
  print_line(fmt::format(" > padded vocab (size: {}) with {} dummy tokens (new size: {})", tokenizer->vocab_size(),
                         config.padded_vocab_size - tokenizer->vocab_size(), config.padded_vocab_size));
  print_line(fmt::format("> initialized tensor model parallel with size {}", ps.tp_size()));
  print_line(fmt::format("> initialized pipeline model parallel with size {}", ps.pp_size()));
  print_line(fmt::format("> setting random seeds to {} ...", args.seed));
  // Megatron prints this once the distributed setup and the tokenizer are done, before the model.
  print_line(fmt::format("time to initialize megatron (seconds): {:.3f}", seconds_since(program_start)));
  print_line(datetime_line("after megatron is initialized"));
  const Clock::time_point setup_start = Clock::now();
  DDPConfig ddp_config;
  ddp_config.overlap_grad_reduce = args.overlap_grad_reduce;
  ddp_config.use_distributed_optimizer = args.use_distributed_optimizer;
  ddp_config.overlap_param_gather = args.overlap_param_gather;
  ddp_config.grad_reduce_in_fp32 = !args.grad_reduce_in_bf16;
  ddp_config.calculate_per_token_loss = args.calculate_per_token_loss;
  if (args.ddp_bucket_size > 0) ddp_config.bucket_size = args.ddp_bucket_size;
  MG_CHECK(callbacks.model_provider, "pretrain needs a model provider");
  std::vector<std::unique_ptr<ModelChunk>> chunks;
  AuxLossTracker aux_losses;
  if (args.moe_per_layer_logging && args.num_experts > 0) aux_losses.declare_tokens_per_expert(args.num_layers + args.mtp_num_layers, args.num_experts);
  int64_t num_params = 0;
  for (int v = 0; v < ps.vpp_size(); ++v) {
    chunks.push_back(callbacks.model_provider(config, device, ps, v));
    MG_CHECK(chunks.back() != nullptr, "the model provider gave no model for virtual pipeline stage {}", v);
    chunks.back()->set_aux_loss_tracker(&aux_losses);
    chunks.back()->init_weights(uint64_t(args.seed));
    num_params += chunks.back()->params().numel();
  }
  if (ps.dp_rank() == 0) {  // as Megatron, every model-parallel rank reports its share
    std::printf(" > number of parameters on (tensor, pipeline) model parallel rank (%d, %d): %lld\n", ps.tp_rank(),
                ps.pp_rank(), static_cast<long long>(num_params));
    std::fflush(stdout);
  }
  print_line(fmt::format(" > running on {}{}", device.str(),
                         ps.world_size() > 1 ? fmt::format(" ({} ranks: tp {}, pp {}, dp {}{})", ps.world_size(),
                                                           ps.tp_size(), ps.pp_size(), ps.dp_size(),
                                                           ps.vpp_size() > 1 ? fmt::format(", vpp {}", ps.vpp_size())
                                                                             : std::string())
                                             : std::string()));

  std::vector<ParamAndGradBuffer*> buffers;
  for (auto& c : chunks) buffers.push_back(&c->params());
  DistributedDataParallel ddp(ps, buffers, ddp_config);
  for (auto& c : chunks) {
    for (const auto& [param, times] : c->repeated_accumulations()) ddp.set_expected_accumulations(param, times);
  }
  AdamOptimizer optimizer(ddp.parameters(), optimizer_config_from_args(args), ddp);
  // Note [FP8 parameters]: the FP8 weights' first values, quantised from the masters (collective).
  if (optimizer.has_fp8_params()) optimizer.copy_main_params_to_model_params(ctx);
  OptimizerParamScheduler scheduler(scheduler_config_from_args(args));
  Checkpointer checkpointer(args, &ps);
  checkpointer.set_model_buffers(chunk_buffers(chunks));
  TrainingProgress progress;
  if (!args.load.empty()) {
    auto loaded = checkpointer.load(ctx, args.load, chunk_parameters(chunks), &optimizer, &scheduler);
    if (loaded) {
      progress = *loaded;
      print_line(
          fmt::format("  successfully loaded checkpoint from {} at iteration {}", args.load, progress.iteration));
    } else {
      print_line(fmt::format("WARNING: could not find a checkpoint in {}: training from scratch", args.load));
    }
  }
  apply_scheduled_values(args, scheduler, optimizer);

  const double model_setup_ms = seconds_since(setup_start) * 1000.0;
  print_line(datetime_line("after model, optimizer, and learning rate scheduler are built"));
  const Clock::time_point data_start = Clock::now();

  NumMicroBatchesCalculator microbatches(args.global_batch_size, args.micro_batch_size, args.data_parallel_size,
                                         args.rampup_batch_size);
  microbatches.update(progress.consumed_train_samples);
  // Rank 0 builds (or finds) the dataset index caches first; the others then read them (Megatron).
  print_line("> building train, validation, and test datasets ...");
  print_line(dataset_target_sizes(args));
  DataIterators data;
  if (ps.rank() == 0) {
    data = callbacks.data_iterators(args, tokenizer.get(), progress.consumed_train_samples,
                                    progress.consumed_valid_samples);
  }
  ps.world().barrier(ctx);
  if (ps.rank() != 0) {
    data = callbacks.data_iterators(args, tokenizer.get(), progress.consumed_train_samples,
                                    progress.consumed_valid_samples);
  }
  std::unique_ptr<TensorBoardWriter> tb;
  if (!args.tensorboard_dir.empty() && g_printing_rank) tb = std::make_unique<TensorBoardWriter>(args.tensorboard_dir);
  std::unique_ptr<SignalHandler> signals;
  if (args.exit_signal_handler) signals = std::make_unique<SignalHandler>();
  const double data_setup_ms = seconds_since(data_start) * 1000.0;
  print_line(datetime_line("after dataloaders are built"));
  {
    // Megatron's setup timers: (min, max) over the ranks, one all-reduce of (t, -t) with max.
    Tensor t = Tensor::from_floats({float(model_setup_ms), float(data_setup_ms), -float(model_setup_ms),
                                    -float(data_setup_ms)},
                                   {4}, DType::Float32, device);
    ps.world().all_reduce(ctx, t, ReduceOp::Max)->wait();
    const std::vector<float> v = t.to_floats();
    print_line("done with setup ...");
    auto row = [](const std::string& name, float lo, float hi) {
      std::string label = name + " ";
      label.resize(std::max<size_t>(label.size(), 48), '.');
      return fmt::format("    {}: ({:.2f}, {:.2f})", label, lo, hi);
    };
    print_line("(min, max) time across ranks (ms):\n" + row("model-and-optimizer-setup", -v[2], v[0]) + "\n" +
               row("train/valid/test-data-iterators-setup", -v[3], v[1]));
  }
  if (!args.skip_train) print_line("training ...");
  print_line(datetime_line("before the start of training step"));

  const int64_t train_iters = args.train_iters > 0 ? args.train_iters : args.train_samples / args.global_batch_size;
  Trainer trainer{args,      callbacks,    ctx,          ps,   config,   chunks,   ddp,          optimizer,
                  scheduler, checkpointer, microbatches, data, tb.get(), progress, program_start};
  trainer.signals = signals.get();
  trainer.aux_losses = &aux_losses;
  std::unique_ptr<FullCudaGraph> cuda_graph;
  if (args.cuda_graph_impl == "local") {
    MG_CHECK(ctx.is_cuda(), "--cuda-graph-impl local needs a GPU, and this run is on {}", ctx.device().str());
    cuda_graph = std::make_unique<FullCudaGraph>(args.cuda_graph_warmup_steps);
    trainer.cuda_graph = cuda_graph.get();
    print_line(fmt::format(" > CUDA graph: the forward and backward passes of each step after {} eager step(s)",
                           args.cuda_graph_warmup_steps));
  }
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> loss_log(nullptr, &std::fclose);
  if (const char* path = std::getenv("MEGATRON_LOSS_LOG"); path && *path && g_printing_rank) {
    loss_log.reset(std::fopen(path, "a"));
    MG_CHECK(loss_log != nullptr, "MEGATRON_LOSS_LOG={}: cannot open it for appending", path);
    trainer.loss_log = loss_log.get();
  }
  bool exited = false;
  const int64_t start_iteration = progress.iteration;
  if (!args.skip_train) {
    exited = trainer.train(train_iters);
    print_line(datetime_line("after training is done"));
  }
  if (!exited) {
    if (!args.skip_train && !args.save.empty() && progress.iteration != start_iteration &&
        (args.save_interval == 0 || progress.iteration % args.save_interval != 0)) {
      trainer.save();
    }
    trainer.evaluate(fmt::format("iteration {} on validation set", progress.iteration), data.valid, false);
    trainer.evaluate(fmt::format("iteration {} on test set", progress.iteration), data.test, true);
  }
  checkpointer.finalize();
  if (tb) tb->flush();
  return 0;
}

}  // namespace megatron
