#include "megatron/training/training_log.h"

#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <ctime>

namespace megatron {

std::string timestamp_now() {
  auto now = std::chrono::system_clock::now();
  std::time_t t = std::chrono::system_clock::to_time_t(now);
  auto us = std::chrono::duration_cast<std::chrono::microseconds>(now.time_since_epoch()).count() % 1000000;
  std::tm tm{};
  localtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d %H:%M:%S", &tm);
  return fmt::format("[{}.{:06d}]", buf, us);
}

std::string datetime_line(const std::string& what) {
  // Megatron's print_datetime: strftime('%Y-%m-%d %H:%M:%S.%f'), the timestamp without its brackets.
  const std::string stamp = timestamp_now();
  return fmt::format("[{}] datetime: {} ", what, stamp.substr(1, stamp.size() - 2));
}

std::string format_iteration_line(const IterationLogFields& f) {
  std::string s = fmt::format(" {} iteration {:8d}/{:8d} |", timestamp_now(), f.iteration, f.train_iters);
  s += fmt::format(" consumed samples: {:12d} |", f.consumed_samples);
  s += fmt::format(" elapsed time per iteration (ms): {:.1f} |", f.elapsed_ms_per_iteration);
  if (f.tflops_per_gpu) s += fmt::format(" throughput per GPU (TFLOP/s/GPU): {:.1f} |", *f.tflops_per_gpu);
  if (f.tokens_per_sec_per_gpu) s += fmt::format(" tokens per second per GPU: {:.1f} |", *f.tokens_per_sec_per_gpu);
  s += fmt::format(" learning rate: {:.6E} |", f.learning_rate);
  s += fmt::format(" global batch size: {:5d} |", f.global_batch_size);
  for (const auto& [name, value] : f.losses) s += fmt::format(" {}: {:.6E} |", name, value);
  s += fmt::format(" loss scale: {:.1f} |", f.loss_scale);
  if (f.grad_norm) s += fmt::format(" grad norm: {:.3f} |", *f.grad_norm);
  if (f.num_zeros_in_grad) s += fmt::format(" num zeros: {} |", *f.num_zeros_in_grad);
  if (f.params_norm) s += fmt::format(" params norm: {:.3f} |", *f.params_norm);
  s += fmt::format(" number of skipped iterations: {:3d} |", f.skipped_iterations);
  s += fmt::format(" number of nan iterations: {:3d} |", f.nan_iterations);
  return s;
}

std::string format_validation_block(const std::string& prefix,
                                    const std::vector<std::pair<std::string, double>>& losses) {
  std::string s = fmt::format(" validation loss at {} | ", prefix);
  for (const auto& [name, value] : losses) {
    s += fmt::format("{} value: {:.6E} | ", name, value);
    s += fmt::format("{} PPL: {:.6E} | ", name, std::exp(std::min(20.0, value)));
  }
  const std::string dashes(s.size() + 1, '-');
  return dashes + "\n" + s + "\n" + dashes;
}

namespace {
struct MoeLayerCounts {
  int dense = 0, moe = 0;
  int64_t moe_ffn = 0;
};
MoeLayerCounts moe_layer_counts(const Arguments& a) {
  MoeLayerCounts n;
  if (a.num_experts == 0) {
    n.dense = a.num_layers;
    return n;
  }
  for (int x : moe_layer_pattern(a.moe_layer_freq, a.num_layers)) (x ? n.moe : n.dense) += 1;
  n.moe_ffn = a.moe_ffn_hidden_size > 0 ? a.moe_ffn_hidden_size : a.ffn_hidden_size;
  return n;
}
}  // namespace

double num_floating_point_operations(const Arguments& a, int64_t padded_vocab_size, int64_t batch_size) {
  const double h = a.hidden_size, s = a.seq_length, L = a.num_layers;
  const double kv = a.kv_channels > 0 ? a.kv_channels : double(a.hidden_size) / a.num_attention_heads;
  const double groups = a.group_query_attention ? a.num_query_groups : a.num_attention_heads;
  const double q = kv * a.num_attention_heads, k = kv * groups, v = kv * groups;
  const double fb = 3, fma = 2, ffn_expansion = a.swiglu ? 3 : 2;
  double attn = fb * fma * (h * (q + k + v) + q * s / 2 * 2 + q * h);
  if (a.multi_latent_attention) {  // Megatron's MLA terms: the projections, then the causal core
    const double N = a.num_attention_heads, qk = a.qk_head_dim, pe = a.qk_pos_emb_head_dim, dv = a.v_head_dim;
    const double q_term = a.q_lora_rank > 0 ? a.q_lora_rank * (h + N * (qk + pe) + 1) : h * N * (qk + pe);
    attn = fb * fma *
           (q_term + a.kv_lora_rank * (h + N * (qk + dv) + 1) + h * pe + N * dv * h +
            s * (N * (qk + pe) / 2 + N * dv / 2));
  }
  // MoE: the active experts' FLOPs (top-k routed experts and the shared ones per MoE layer), as
  // Megatron counts them (the router's GEMM is not counted).
  MoeLayerCounts n = moe_layer_counts(a);
  // Multi-token prediction: each depth is one more layer of the decoder's last kind, its norms and
  // eh_proj, and one more pass of the output layer (Megatron's count).
  const double mtp = a.mtp_num_layers;
  const bool last_is_moe = a.num_experts > 0 && moe_layer_pattern(a.moe_layer_freq, a.num_layers).back() != 0;
  (last_is_moe ? n.moe : n.dense) += a.mtp_num_layers;
  const double mlp = fb * fma * h *
                     (double(a.ffn_hidden_size) * ffn_expansion * n.dense +
                      double(n.moe_ffn) * a.moe_router_topk * ffn_expansion * n.moe +
                      double(a.moe_shared_expert_intermediate_size) * ffn_expansion * n.moe);
  const double mtp_proj = fb * fma * mtp * (3 * h + 2 * h * h);
  const double logit = fb * fma * h * double(padded_vocab_size) * (1 + mtp);
  return double(batch_size) * s * (mlp + attn * (L + mtp) + mtp_proj + logit);
}

TheoreticalMemory theoretical_memory(const Arguments& a, int64_t padded_vocab_size, int num_microbatches) {
  // megatron/training/theoretical_memory_usage.py (compute_weight_and_optimizer_memory,
  // compute_activation_memory: the activation formula is Megatron's dense one for MoE too).
  const double h = a.hidden_size, L = a.num_layers, tp = a.tensor_model_parallel_size,
               pp = a.pipeline_model_parallel_size;
  const double kv = a.kv_channels > 0 ? a.kv_channels : h / a.num_attention_heads;
  const double groups = a.group_query_attention ? a.num_query_groups : a.num_attention_heads;
  const double q_ratio = kv * a.num_attention_heads / h;
  const double glu = a.swiglu ? 1.5 : 1.0;
  const double norm_size = a.normalization == "RMSNorm" ? 1 : 2;
  double self_attn = 2 * h * h * ((1 + groups / a.num_attention_heads) * q_ratio);
  if (a.multi_latent_attention) {  // Megatron's MLA count: q (low-rank or not), kv latent and rope key, o
    const double N = a.num_attention_heads, qk = a.qk_head_dim, pe = a.qk_pos_emb_head_dim, dv = a.v_head_dim;
    const double q_term = a.q_lora_rank > 0 ? a.q_lora_rank * (h + N * (qk + pe) + norm_size) : h * N * (qk + pe);
    self_attn = q_term + a.kv_lora_rank * (h + N * (qk + dv) + norm_size) + h * pe + N * dv * h;
  }
  const double embedding = h * double(padded_vocab_size);
  // Megatron's split of the parameters by how each rank holds them: tensor-parallel shards,
  // replicas (norms, routers, the shared experts' gate), and the routed experts, sharded over
  // expert-TP × EP and their optimizer state over the expert-data-parallel ranks.
  const MoeLayerCounts n = moe_layer_counts(a);
  const double experts = a.num_experts > 0 ? a.num_experts : 1;
  const double dense_mlp = 2 * h * double(a.ffn_hidden_size) * glu;
  const double shared = 2 * h * double(a.moe_shared_expert_intermediate_size) * glu;
  const double routed = 2 * h * double(n.moe_ffn) * experts * glu;
  const double norms = 2 * h * norm_size;
  const double router = a.num_experts > 0 ? h * experts + (a.disable_bias_linear ? 0 : experts) : 0;
  const double shared_gate = a.moe_shared_expert_intermediate_size > 0 && a.moe_shared_expert_gate ? h : 0;
  const double tp_sharded = (self_attn + dense_mlp) * n.dense + (self_attn + shared) * n.moe;
  const double replicated = norms * n.dense + (norms + router + shared_gate) * n.moe + norm_size * h;
  const double expert_sharded = routed * n.moe;
  const double etp = a.expert_tensor_parallel_size > 0 ? a.expert_tensor_parallel_size : tp;
  const double ep = a.expert_model_parallel_size;
  double tp_most_loaded = (tp_sharded / pp + embedding) / tp;
  if (a.untie_embeddings_and_output_weights && a.pipeline_model_parallel_size == 1) tp_most_loaded += embedding / tp;
  const double replicated_most_loaded = replicated / pp;
  const double expert_most_loaded = expert_sharded / pp / (etp * ep);
  auto bytes_per_param = [&](double dp) { return a.use_distributed_optimizer ? 6 + 12.0 / dp : 18; };
  const double edp = std::max(1.0, double(a.world_size) / (etp * ep * pp));
  TheoreticalMemory m;
  m.weight_and_optimizer_mb = ((tp_most_loaded + replicated_most_loaded) * bytes_per_param(a.data_parallel_size) +
                               expert_most_loaded * bytes_per_param(edp)) /
                              (1024.0 * 1024.0);

  const double sbh = double(a.seq_length) * a.micro_batch_size * h, sb = double(a.seq_length) * a.micro_batch_size;
  const bool interleaved = a.num_layers_per_virtual_pipeline_stage > 0;
  const double vpp = interleaved ? L / pp / a.num_layers_per_virtual_pipeline_stage : 0;
  auto pipeline_factor = [&](double act) {
    if (interleaved) act *= 1 + (pp - 1) / (pp * vpp);
    if (!interleaved && pp > 1) act *= std::min(1.0, double(num_microbatches) / pp);
    return act;
  };
  double act;
  if (a.sequence_parallel && a.recompute_granularity == "selective") {
    act = sbh * (18 + 4 * (a.ffn_hidden_size / h)) * L;
    act += 8 * sb * pp + sbh * pp;
    act = pipeline_factor(act);
    if (pp == 1) act += sbh * 4 * (1 + double(padded_vocab_size) / h);
    act /= tp;
  } else {
    act = sbh * (10 + 24 / tp) * L;
    act += 8 * sb * pp + sbh * pp;
    act = pipeline_factor(act);
    if (pp == 1) act += (sb * double(padded_vocab_size) / tp + sbh) * 2;
    act *= 1.05;
  }
  m.activation_mb = act / (1024.0 * 1024.0);
  return m;
}

std::string format_theoretical_memory(const TheoreticalMemory& m) {
  if (!m.activation_mb) {
    return fmt::format("Theoretical memory footprints: weight and optimizer={:.2f} MB", m.weight_and_optimizer_mb);
  }
  return fmt::format(
      "Theoretical memory footprints: weight and optimizer={:.2f} MB, activation={:.2f} MB, total={:.2f} MB",
      m.weight_and_optimizer_mb, *m.activation_mb, m.weight_and_optimizer_mb + *m.activation_mb);
}

}  // namespace megatron
