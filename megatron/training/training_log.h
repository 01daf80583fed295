// What training prints: Megatron's iteration line, the validation block, the FLOPs formula behind
// TFLOP/s/GPU, and the theoretical-memory report (megatron/training/training.py training_log,
// evaluate_and_print_results, num_floating_point_operations; theoretical_memory_usage.py).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "megatron/training/arguments.h"

namespace megatron {

struct IterationLogFields {
  int64_t iteration = 0, train_iters = 0, consumed_samples = 0;
  double elapsed_ms_per_iteration = 0;
  std::optional<double> tflops_per_gpu;          // with --log-throughput
  std::optional<double> tokens_per_sec_per_gpu;  // with --log-throughput (megatron.cpp's addition)
  double learning_rate = 0;
  int64_t global_batch_size = 0;
  std::vector<std::pair<std::string, double>> losses;  // {"lm loss", value} averaged over the interval
  double loss_scale = 1.0;
  std::optional<double> grad_norm;
  std::optional<int64_t> num_zeros_in_grad;
  std::optional<double> params_norm;
  int64_t skipped_iterations = 0, nan_iterations = 0;
};

/// " [YYYY-MM-DD HH:MM:SS.ffffff] iteration ... |" exactly as Megatron prints it (timestamp now).
std::string format_iteration_line(const IterationLogFields& f);
/// The timestamp prefix Megatron uses: "[2026-12-01 04:09:55.123456]".
/// Megatron's print_datetime line: "[what] datetime: YYYY-mm-dd HH:MM:SS ".
std::string datetime_line(const std::string& what);
std::string timestamp_now();

/// The boxed validation block: a line of dashes, " validation loss at iteration N | lm loss value:
/// X | lm loss PPL: Y | ", dashes.
std::string format_validation_block(const std::string& prefix,
                                    const std::vector<std::pair<std::string, double>>& losses);

/// Megatron's num_floating_point_operations for a dense GPT (causal attention counted as half).
double num_floating_point_operations(const Arguments& args, int64_t padded_vocab_size, int64_t batch_size);

/// Megatron's weight-and-optimizer memory estimate in MB (theoretical_memory_usage.py), and the
/// activation estimate when --sequence-parallel with selective recomputation (else nullopt).
struct TheoreticalMemory {
  double weight_and_optimizer_mb = 0;
  std::optional<double> activation_mb;
};
TheoreticalMemory theoretical_memory(const Arguments& args, int64_t padded_vocab_size, int num_microbatches);
std::string format_theoretical_memory(const TheoreticalMemory& m);

}  // namespace megatron
