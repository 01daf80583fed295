// Mixture of experts on CUDA, the fast path of kernels/cpu/moe.cpp: routing forward/backward, the
// expert-bias update, token dropping, the global aux loss and the input jitter (the token
// permutation and the row scaling by the probabilities: moe_permute.cu).
//
// Routing runs one thread per token over kernels/moe_routing_rows.h, the code the CPU reference
// loops over, so both choose the same experts; the routing logits are small ([T, E] fp32) next to
// the experts' GEMMs. The column sums the losses need (the aux scores and the aux map's counts, per
// sequence) are one block per (expert, sequence) in fp64 with a fixed reduction order, and one block
// finishes the losses: deterministic, no atomics.
//
// Note [Token dropping on the device]: Megatron's apply_router_token_dropping keeps, per expert, the
// `capacity` tokens of highest probability (--moe-token-drop-policy probs) or its routed tokens
// first (position), ties to the lower token (the CPU's stable sort). Here one stable radix sort of
// T·E keys orders every expert's column at once: key = expert · 2³² + the column value's bits made
// to sort descending, value = the token; the first `capacity` tokens of each expert's run are kept.
// The map becomes keep (padding) or map ∧ keep, the probabilities are zeroed off it, and the row
// counts and losses follow from the final map as on the CPU.
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_radix_sort.cuh>

#include <vector>

#include "megatron/kernels/cuda/cuda_common.cuh"
#include "megatron/kernels/cuda/cuda_ops.h"
#include "megatron/kernels/moe_routing_rows.h"

namespace megatron::cuda {

namespace {

void check_dev(const Tensor& t, DType dtype, int64_t numel, const char* name) {
  MG_ASSERT(t.defined() && t.device().is_cuda() && t.dtype() == dtype && t.numel() == numel,
            "{} is {}, expected {} with {} elements on a CUDA device", name, t.defined() ? t.str() : "undefined",
            to_string(dtype), numel);
}

unsigned blocks_for(int64_t n, int block) { return unsigned(std::max<int64_t>(1, (n + block - 1) / block)); }

constexpr int kRouteBlock = 128;

// ---- routing ---------------------------------------------------------------------------------------

__global__ void route_tokens_kernel(MoeRoutingParams c, int64_t t_count, const float* __restrict__ logits,
                                    const float* __restrict__ bias, float* scratch, float* p_top, float* probs,
                                    uint8_t* map, int32_t* top, float* aux_scores, uint8_t* aux_map, double* lse2) {
  const int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (t >= t_count) return;
  const int e = c.num_experts, k = c.topk;
  const float* l = logits + t * e;
  int32_t* tt = top + t * k;
  float* pt = p_top + t * k;
  moe_rows::route_row(c, l, bias, scratch + t * e, tt, pt);
  float* prow = probs + t * e;
  uint8_t* mrow = map + t * e;
  for (int i = 0; i < e; ++i) prow[i] = 0.0f, mrow[i] = 0;
  for (int j = 0; j < k; ++j) prow[tt[j]] = pt[j], mrow[tt[j]] = 1;
  if (aux_scores) moe_rows::aux_scores_row(c, l, aux_scores + t * e, aux_map + t * e);
  if (lse2) {
    const double lse = moe_rows::logsumexp_row(l, e);
    lse2[t] = lse * lse;
  }
}

constexpr int kSumBlock = 256;

__device__ double block_sum_double(double v) {
  using Reduce = cub::BlockReduce<double, kSumBlock>;
  __shared__ typename Reduce::TempStorage tmp;
  return Reduce(tmp).Sum(v);  // valid in thread 0
}

// out[b·E + x] = Σ_s v[(s·B + b)·E + x] in fp64, one block per (x, b); a fixed order.
template <typename T, typename Out = double>
__global__ void sequence_column_sums_kernel(const T* __restrict__ v, int64_t seq, int64_t mb, int e, Out* out) {
  const int x = blockIdx.x, b = blockIdx.y;
  double s = 0;
  for (int64_t i = threadIdx.x; i < seq; i += kSumBlock) s += double(v[(i * mb + b) * e + x]);
  s = block_sum_double(s);
  if (threadIdx.x == 0) out[int64_t(b) * e + x] = Out(s);
}

// ---- token dropping (Note [Token dropping on the device]) ----

// The fp32 bits as an unsigned key that sorts in descending value order.
__device__ uint32_t descending_key(float v) {
  const uint32_t u = __float_as_uint(v);
  const uint32_t ascending = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return ~ascending;
}

__global__ void drop_keys_kernel(const float* __restrict__ probs, const uint8_t* __restrict__ map, int64_t t_count,
                                 int e, bool by_position, uint64_t* keys, int32_t* tokens) {
  const int64_t n = t_count * e;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / e;
    const int x = int(i % e);
    const float v = by_position ? float(map[i]) : probs[i];
    keys[i] = (uint64_t(x) << 32) | descending_key(v);
    tokens[i] = int32_t(t);
  }
}

// Sorted run of expert x = entries [x·T, (x+1)·T): its first `capacity` tokens are kept.
__global__ void drop_keep_kernel(const int32_t* __restrict__ sorted_tokens, int64_t t_count, int e, int64_t capacity,
                                 uint8_t* keep) {
  const int64_t n = int64_t(e) * capacity;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t x = i / capacity, r = i % capacity;
    keep[int64_t(sorted_tokens[x * t_count + r]) * e + x] = 1;
  }
}

__global__ void drop_apply_kernel(const uint8_t* __restrict__ keep, int64_t n, bool pad, float* probs, uint8_t* map) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint8_t m = pad ? keep[i] : uint8_t(map[i] & keep[i]);
    map[i] = m;
    if (!m) probs[i] = 0.0f;
  }
}

unsigned grid_of(int64_t n, int block) { return unsigned(std::min<int64_t>(4096, std::max<int64_t>(1, (n + block - 1) / block))); }

void drop_tokens(Context& ctx, const MoeRoutingParams& c, int64_t t_count, Tensor& probs, Tensor& routing_map) {
  const int64_t e = c.num_experts;
  const int64_t capacity =
      int64_t(std::ceil(double(t_count * c.topk) / double(e) * double(c.capacity_factor)));  // get_capacity
  if (capacity > t_count || t_count == 0) return;
  MG_CHECK(t_count * e < (int64_t(1) << 31), "MoE token dropping on CUDA: {} tokens x {} experts exceed int32 indices",
           t_count, e);
  const cudaStream_t stream = stream_of(ctx);
  const int64_t n = t_count * e;
  Tensor keys = Tensor::empty({2 * n}, DType::Int64, ctx.device());
  Tensor tokens = Tensor::empty({2 * n}, DType::Int32, ctx.device());
  Tensor keep = Tensor::empty({n}, DType::UInt8, ctx.device());
  CUDA_CHECK(cudaMemsetAsync(keep.raw_data(), 0, size_t(n), stream));
  uint64_t* keys_in = dev_ptr<uint64_t>(keys);
  int32_t* tokens_in = dev_ptr<int32_t>(tokens);
  drop_keys_kernel<<<grid_of(n, kSumBlock), kSumBlock, 0, stream>>>(dev_ptr<const float>(probs),
                                                                  dev_ptr<const uint8_t>(routing_map), t_count, int(e),
                                                                  c.drop_by_position, keys_in, tokens_in);
  CUDA_CHECK_LAUNCH();
  int bits = 32;  // the value's bits, then enough for the expert
  while ((int64_t(1) << (bits - 32)) < e) ++bits;
  size_t temp_bytes = 0;
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys_in, keys_in + n, tokens_in, tokens_in + n,
                                             int(n), 0, bits, stream));
  Tensor temp = Tensor::empty({int64_t(std::max<size_t>(temp_bytes, 1))}, DType::UInt8, ctx.device());
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.raw_data(), temp_bytes, keys_in, keys_in + n, tokens_in,
                                             tokens_in + n, int(n), 0, bits, stream));
  drop_keep_kernel<<<grid_of(e * capacity, kSumBlock), kSumBlock, 0, stream>>>(tokens_in + n, t_count, int(e),
                                                                               capacity, dev_ptr<uint8_t>(keep));
  CUDA_CHECK_LAUNCH();
  drop_apply_kernel<<<grid_of(n, kSumBlock), kSumBlock, 0, stream>>>(dev_ptr<const uint8_t>(keep), n,
                                                                   c.pad_to_capacity, dev_ptr<float>(probs),
                                                                   dev_ptr<uint8_t>(routing_map));
  CUDA_CHECK_LAUNCH();
}

// tokens_per_expert, and losses {aux, seq_aux, z} from the column sums (counts over map, scores and
// aux-map per sequence) and lse² per token. One block.
__global__ void routing_losses_kernel(MoeRoutingParams c, int64_t t_count, const double* map_counts,
                                      const double* score_sums, const double* aux_counts, const double* lse2,
                                      float* tokens_per_expert, float* losses) {
  const int e = c.num_experts;
  const int64_t mb = c.micro_batch;
  double aux = 0, seq_aux = 0, z = 0;
  for (int x = threadIdx.x; x < e; x += kSumBlock) {
    float n = 0;
    for (int64_t b = 0; b < mb; ++b) n += float(map_counts[b * e + x]);
    tokens_per_expert[x] = n;
    if (score_sums) {
      double p = 0, a = 0;
      for (int64_t b = 0; b < mb; ++b) {
        p += score_sums[b * e + x], a += aux_counts[b * e + x];
        seq_aux += score_sums[b * e + x] * aux_counts[b * e + x];
      }
      aux += p * a;
    }
  }
  if (lse2)
    for (int64_t t = threadIdx.x; t < t_count; t += kSumBlock) z += lse2[t];
  aux = block_sum_double(aux);
  __syncthreads();
  seq_aux = block_sum_double(seq_aux);
  __syncthreads();
  z = block_sum_double(z);
  if (threadIdx.x == 0) {
    losses[0] = c.aux_loss_coeff > 0 ? float(aux * moe_rows::aux_loss_scale_of(c, t_count)) : 0.0f;
    losses[1] = c.seq_aux_loss_coeff > 0 ? float(seq_aux * moe_rows::seq_aux_loss_scale_of(c)) : 0.0f;
    losses[2] = c.z_loss_coeff > 0 ? float(z / double(t_count) * c.z_loss_coeff) : 0.0f;
  }
}

// counts[x] = Σ_b seq_counts[b·E + x] (in b order, as the CPU).
__global__ void total_counts_kernel(const double* seq_counts, int64_t mb, int e, double* counts) {
  for (int x = blockIdx.x * blockDim.x + threadIdx.x; x < e; x += gridDim.x * blockDim.x) {
    double n = 0;
    for (int64_t b = 0; b < mb; ++b) n += seq_counts[b * e + x];
    counts[x] = n;
  }
}

__global__ void routing_backward_kernel(MoeRoutingParams c, int64_t t_count, const float* __restrict__ logits,
                                        const int32_t* __restrict__ top, const uint8_t* __restrict__ map,
                                        const float* __restrict__ grad_probs, const float* __restrict__ aux_scores,
                                        const double* counts, const double* seq_counts, float aux_loss_scale,
                                        float* scratch, float* grad_logits) {
  const int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (t >= t_count) return;
  const int e = c.num_experts;
  moe_rows::routing_backward_row(c, t_count, logits + t * e, top + t * c.topk, map + t * e, grad_probs + t * e,
                                 aux_scores ? aux_scores + t * e : nullptr, counts,
                                 seq_counts ? seq_counts + (t % c.micro_batch) * e : nullptr, aux_loss_scale,
                                 scratch + t * e, grad_logits + t * e);
}

__global__ void expert_bias_update_kernel(const float* n, int e, float rate, float* bias) {
  __shared__ float mean;
  if (threadIdx.x == 0) {  // the CPU's order: a running fp32 sum
    float m = 0;
    for (int i = 0; i < e; ++i) m += n[i];
    mean = m / float(e);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < e; i += blockDim.x) {
    const float off = mean - n[i];
    bias[i] += (off > 0 ? 1.0f : off < 0 ? -1.0f : 0.0f) * rate;
  }
}

}  // namespace

void moe_routing_forward(Context& ctx, const Tensor& logits, const Tensor& expert_bias, const MoeRoutingParams& c,
                         Tensor& probs, Tensor& routing_map, Tensor& topk_indices, Tensor& aux_scores, Tensor& aux_map,
                         Tensor& tokens_per_expert, Tensor& losses) {
  ops::check_moe_routing(c, logits, expert_bias);
  const int64_t t_count = logits.size(0), e = c.num_experts, k = c.topk, mb = c.micro_batch;
  check_dev(logits, DType::Float32, t_count * e, "logits");
  check_dev(probs, DType::Float32, t_count * e, "probs");
  check_dev(routing_map, DType::UInt8, t_count * e, "routing_map");
  check_dev(topk_indices, DType::Int32, t_count * k, "topk_indices");
  check_dev(tokens_per_expert, DType::Float32, e, "tokens_per_expert");
  check_dev(losses, DType::Float32, 3, "losses");
  if (c.aux_on()) {
    check_dev(aux_scores, DType::Float32, t_count * e, "aux_scores");
    check_dev(aux_map, DType::UInt8, t_count * e, "aux_map");
  }
  const cudaStream_t stream = stream_of(ctx);
  Tensor scratch = Tensor::empty({t_count * (e + k)}, DType::Float32, ctx.device());
  // fp64 sums (8-byte storage; there is no fp64 dtype): map counts [B, E], aux score sums [B, E],
  // aux-map counts [B, E], lse² [T]
  Tensor sums = Tensor::empty({3 * mb * e + t_count}, DType::Int64, ctx.device());
  double* map_counts = dev_ptr<double>(sums);
  double* score_sums = c.aux_on() ? map_counts + mb * e : nullptr;
  double* aux_counts = c.aux_on() ? map_counts + 2 * mb * e : nullptr;
  double* lse2 = c.z_loss_coeff > 0 ? map_counts + 3 * mb * e : nullptr;
  if (t_count > 0) {
    route_tokens_kernel<<<blocks_for(t_count, kRouteBlock), kRouteBlock, 0, stream>>>(
        c, t_count, dev_ptr<const float>(logits),
        expert_bias.defined() ? dev_ptr<const float>(expert_bias) : nullptr, dev_ptr<float>(scratch),
        dev_ptr<float>(scratch) + t_count * e, dev_ptr<float>(probs), dev_ptr<uint8_t>(routing_map),
        dev_ptr<int32_t>(topk_indices), c.aux_on() ? dev_ptr<float>(aux_scores) : nullptr,
        c.aux_on() ? dev_ptr<uint8_t>(aux_map) : nullptr, lse2);
    CUDA_CHECK_LAUNCH();
  }
  if (c.capacity_factor > 0) drop_tokens(ctx, c, t_count, probs, routing_map);
  const dim3 grid{unsigned(e), unsigned(mb)};
  sequence_column_sums_kernel<uint8_t><<<grid, kSumBlock, 0, stream>>>(dev_ptr<const uint8_t>(routing_map),
                                                                       c.seq_length, mb, int(e), map_counts);
  CUDA_CHECK_LAUNCH();
  if (c.aux_on()) {
    sequence_column_sums_kernel<float><<<grid, kSumBlock, 0, stream>>>(dev_ptr<const float>(aux_scores),
                                                                       c.seq_length, mb, int(e), score_sums);
    CUDA_CHECK_LAUNCH();
    sequence_column_sums_kernel<uint8_t><<<grid, kSumBlock, 0, stream>>>(dev_ptr<const uint8_t>(aux_map),
                                                                         c.seq_length, mb, int(e), aux_counts);
    CUDA_CHECK_LAUNCH();
  }
  routing_losses_kernel<<<1, kSumBlock, 0, stream>>>(c, t_count, map_counts, score_sums, aux_counts, lse2,
                                                     dev_ptr<float>(tokens_per_expert), dev_ptr<float>(losses));
  CUDA_CHECK_LAUNCH();
}

void moe_routing_backward(Context& ctx, const Tensor& grad_probs, const Tensor& logits, const Tensor& topk_indices,
                          const Tensor& routing_map, const Tensor& aux_scores, const Tensor& aux_map,
                          const MoeRoutingParams& c, float aux_loss_scale, Tensor& grad_logits) {
  ops::check_moe_routing(c, logits, Tensor());
  const int64_t t_count = logits.size(0), e = c.num_experts, k = c.topk, mb = c.micro_batch;
  check_dev(logits, DType::Float32, t_count * e, "logits");
  check_dev(grad_probs, DType::Float32, t_count * e, "grad_probs");
  check_dev(topk_indices, DType::Int32, t_count * k, "topk_indices");
  check_dev(routing_map, DType::UInt8, t_count * e, "routing_map");
  check_dev(grad_logits, DType::Float32, t_count * e, "grad_logits");
  if (t_count == 0) return;
  const cudaStream_t stream = stream_of(ctx);
  Tensor counts;
  if (c.local_aux_on()) {
    check_dev(aux_scores, DType::Float32, t_count * e, "aux_scores");
    check_dev(aux_map, DType::UInt8, t_count * e, "aux_map");
    counts = Tensor::empty({(mb + 1) * e}, DType::Int64, ctx.device());  // fp64: [E] totals, [B, E]
    sequence_column_sums_kernel<uint8_t><<<dim3{unsigned(e), unsigned(mb)}, kSumBlock, 0, stream>>>(
        dev_ptr<const uint8_t>(aux_map), c.seq_length, mb, int(e), dev_ptr<double>(counts) + e);
    CUDA_CHECK_LAUNCH();
    total_counts_kernel<<<blocks_for(e, kSumBlock), kSumBlock, 0, stream>>>(dev_ptr<const double>(counts) + e, mb,
                                                                            int(e), dev_ptr<double>(counts));
    CUDA_CHECK_LAUNCH();
  }
  Tensor scratch = Tensor::empty({t_count * e}, DType::Float32, ctx.device());
  routing_backward_kernel<<<blocks_for(t_count, kRouteBlock), kRouteBlock, 0, stream>>>(
      c, t_count, dev_ptr<const float>(logits), dev_ptr<const int32_t>(topk_indices),
      dev_ptr<const uint8_t>(routing_map), dev_ptr<const float>(grad_probs),
      c.local_aux_on() ? dev_ptr<const float>(aux_scores) : nullptr,
      c.local_aux_on() ? dev_ptr<const double>(counts) : nullptr,
      c.local_aux_on() ? dev_ptr<const double>(counts) + e : nullptr, aux_loss_scale, dev_ptr<float>(scratch),
      dev_ptr<float>(grad_logits));
  CUDA_CHECK_LAUNCH();
}

void moe_expert_bias_update(Context& ctx, const Tensor& tokens_per_expert, float update_rate, Tensor& expert_bias) {
  const int64_t e = expert_bias.numel();
  check_dev(expert_bias, DType::Float32, e, "expert_bias");
  check_dev(tokens_per_expert, DType::Float32, e, "tokens_per_expert");
  if (e == 0) return;
  expert_bias_update_kernel<<<1, kSumBlock, 0, stream_of(ctx)>>>(dev_ptr<const float>(tokens_per_expert), int(e),
                                                                 update_rate, dev_ptr<float>(expert_bias));
  CUDA_CHECK_LAUNCH();
}

// ---- the global aux loss (Note [Global aux loss] in core/transformer/moe/router.h) -------------------

namespace {

// loss = scale · Σ_x score_sums[x] · tokens[x] (fp64), one block.
__global__ void global_aux_loss_kernel(const double* score_sums, const float* tokens, int e, double scale,
                                       float* loss) {
  double v = 0;
  for (int x = threadIdx.x; x < e; x += kSumBlock) v += score_sums[x] * double(tokens[x]);
  v = block_sum_double(v);
  if (threadIdx.x == 0) loss[0] = float(v * scale);
}

__global__ void global_aux_loss_backward_kernel(MoeRoutingParams c, int64_t t_count, const float* __restrict__ logits,
                                                const float* __restrict__ aux_scores, const float* __restrict__ tokens,
                                                double scale, float* scratch, float* grad_logits) {
  const int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (t >= t_count) return;
  const int e = c.num_experts;
  moe_rows::aux_scores_backward_row(c, logits + t * e, aux_scores + t * e, scratch + t * e, grad_logits + t * e,
                                    [&](int i) { return double(tokens[i]) * scale; });
}

__global__ void input_jitter_kernel(const float* __restrict__ x, int64_t t_count, int64_t h, float eps, uint64_t seed,
                                    uint64_t offset, const uint64_t* shift, int64_t mb, int64_t seq_offset, float* out) {
  const uint64_t off = offset + (shift ? *shift : 0);  // Note [Random offsets under CUDA graphs]
  const int64_t n = t_count * h;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / h, j = i % h;
    const int64_t row = (seq_offset + t / mb) * mb + t % mb;
    out[i] = x[i] * moe_rows::jitter_factor(eps, seed, off, uint64_t(row * h + j));
  }
}

}  // namespace

void moe_expert_counts(Context& ctx, const Tensor& map, Tensor& counts) {
  MG_CHECK(map.defined() && map.dim() == 2 && map.dtype() == DType::UInt8,
           "moe_expert_counts: the map must be uint8 [tokens, experts], got {}", map.defined() ? map.str() : "undefined");
  const int64_t t_count = map.size(0), e = map.size(1);
  check_dev(map, DType::UInt8, t_count * e, "map");
  check_dev(counts, DType::Float32, e, "counts");
  if (e == 0) return;
  sequence_column_sums_kernel<uint8_t, float><<<dim3{unsigned(e), 1u}, kSumBlock, 0, stream_of(ctx)>>>(
      dev_ptr<const uint8_t>(map), t_count, 1, int(e), dev_ptr<float>(counts));
  CUDA_CHECK_LAUNCH();
}

void moe_global_aux_loss_forward(Context& ctx, const Tensor& aux_scores, const Tensor& tokens,
                                 const MoeRoutingParams& c, Tensor& loss) {
  ops::check_moe_routing(c, aux_scores, Tensor());
  const int64_t t_count = aux_scores.size(0), e = c.num_experts;
  check_dev(aux_scores, DType::Float32, t_count * e, "aux_scores");
  check_dev(tokens, DType::Float32, e, "tokens");
  check_dev(loss, DType::Float32, 1, "loss");
  const cudaStream_t stream = stream_of(ctx);
  Tensor sums = Tensor::empty({e}, DType::Int64, ctx.device());  // fp64 [E]
  sequence_column_sums_kernel<float><<<dim3{unsigned(e), 1u}, kSumBlock, 0, stream>>>(
      dev_ptr<const float>(aux_scores), t_count, 1, int(e), dev_ptr<double>(sums));
  CUDA_CHECK_LAUNCH();
  global_aux_loss_kernel<<<1, kSumBlock, 0, stream>>>(dev_ptr<const double>(sums), dev_ptr<const float>(tokens),
                                                      int(e), moe_rows::global_aux_loss_scale_of(c, t_count),
                                                      dev_ptr<float>(loss));
  CUDA_CHECK_LAUNCH();
}

void moe_global_aux_loss_backward(Context& ctx, const Tensor& logits, const Tensor& aux_scores, const Tensor& tokens,
                                  const MoeRoutingParams& c, float aux_loss_scale, Tensor& grad_logits) {
  ops::check_moe_routing(c, logits, Tensor());
  const int64_t t_count = logits.size(0), e = c.num_experts;
  check_dev(logits, DType::Float32, t_count * e, "logits");
  check_dev(aux_scores, DType::Float32, t_count * e, "aux_scores");
  check_dev(tokens, DType::Float32, e, "tokens");
  check_dev(grad_logits, DType::Float32, t_count * e, "grad_logits");
  if (t_count == 0) return;
  Tensor scratch = Tensor::empty({t_count * e}, DType::Float32, ctx.device());
  global_aux_loss_backward_kernel<<<blocks_for(t_count, kRouteBlock), kRouteBlock, 0, stream_of(ctx)>>>(
      c, t_count, dev_ptr<const float>(logits), dev_ptr<const float>(aux_scores), dev_ptr<const float>(tokens),
      moe_rows::global_aux_loss_scale_of(c, t_count) * aux_loss_scale, dev_ptr<float>(scratch),
      dev_ptr<float>(grad_logits));
  CUDA_CHECK_LAUNCH();
}

void moe_input_jitter(Context& ctx, const Tensor& x, float eps, uint64_t seed, uint64_t offset, int64_t micro_batch,
                      int64_t seq_offset, Tensor& out) {
  MG_CHECK(x.defined() && x.dim() == 2 && x.dtype() == DType::Float32 && micro_batch > 0 &&
               x.size(0) % micro_batch == 0 && seq_offset >= 0,
           "moe_input_jitter: x must be fp32 [tokens, hidden] of whole micro-batches of {}, got {}", micro_batch,
           x.defined() ? x.str() : "undefined");
  const int64_t t_count = x.size(0), h = x.size(1);
  check_dev(x, DType::Float32, t_count * h, "x");
  check_dev(out, DType::Float32, t_count * h, "out");
  if (t_count * h == 0) return;
  input_jitter_kernel<<<grid_of(t_count * h, kSumBlock), kSumBlock, 0, stream_of(ctx)>>>(
      dev_ptr<const float>(x), t_count, h, eps, seed, offset, rng_shift_of(ctx), micro_batch, seq_offset,
      dev_ptr<float>(out));
  CUDA_CHECK_LAUNCH();
}

}  // namespace megatron::cuda
