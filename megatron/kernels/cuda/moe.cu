// Mixture of experts on CUDA, the fast path of kernels/cpu/moe.cpp: routing forward/backward, the
// expert-bias update, the token permutation and the row scaling by the probabilities.
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
//
// Note [Permutation on the device]: the permuted order (Note [Permuted order]) is a stable
// partition of each routing-map column. Block (x, c) counts column x's routed tokens in chunk c of
// kChunk tokens; one block scans the chunk counts per expert and the experts' row counts; block
// (x, c) then ranks its chunk's tokens with a block scan and writes each routed token at
// offset[x] + rank (with drop-and-pad, the first `capacity` routed tokens, then unrouted ones at
// offset[x] + routed[x] + their rank among the unrouted). Besides sorted_indices and row_expert it
// writes token_rows [T, E] (the row of each pair, -1 for none), so every backward is a gather:
// a token's rows are summed in row order, the CPU's order, without atomics. The dropless row
// counts come back to the host in one copy (the caller sizes its buffers from them).
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

// ---- permutation (Note [Permutation on the device]) --------------------------------------------------

namespace {

constexpr int kScanThreads = 256, kScanItems = 4, kChunk = kScanThreads * kScanItems;

__global__ void chunk_counts_kernel(const uint8_t* __restrict__ map, int64_t t_count, int e, int chunks,
                                    int32_t* counts) {
  const int x = blockIdx.x, c = blockIdx.y;
  int n = 0;
  const int64_t t0 = int64_t(c) * kChunk;
  for (int i = threadIdx.x; i < kChunk; i += kScanThreads) {
    const int64_t t = t0 + i;
    if (t < t_count) n += map[t * e + x] != 0;
  }
  using Reduce = cub::BlockReduce<int, kScanThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  n = Reduce(tmp).Sum(n);
  if (threadIdx.x == 0) counts[int64_t(x) * chunks + c] = n;
}

// chunk counts -> each chunk's first rank within its expert (in place), routed[x], and the experts'
// first rows offset[x] and rows rows[x] (int64, for the host).
__global__ void chunk_offsets_kernel(int32_t* chunk, int e, int chunks, int64_t capacity, int32_t* routed,
                                     int32_t* offset, int64_t* rows) {
  for (int x = threadIdx.x; x < e; x += blockDim.x) {
    int32_t run = 0;
    for (int c = 0; c < chunks; ++c) {
      const int32_t n = chunk[int64_t(x) * chunks + c];
      chunk[int64_t(x) * chunks + c] = run;
      run += n;
    }
    routed[x] = run;
    rows[x] = capacity > 0 ? capacity : run;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t o = 0;
    for (int x = 0; x < e; ++x) offset[x] = int32_t(o), o += rows[x];
  }
}

__global__ void scatter_rows_kernel(const uint8_t* __restrict__ map, int64_t t_count, int e, int chunks,
                                    int64_t capacity, const int32_t* chunk_start, const int32_t* routed,
                                    const int32_t* offset, int32_t* sorted, int32_t* row_expert, int32_t* token_rows) {
  const int x = blockIdx.x, c = blockIdx.y;
  const int64_t t0 = int64_t(c) * kChunk + int64_t(threadIdx.x) * kScanItems;
  int flag[kScanItems], rank[kScanItems];
#pragma unroll
  for (int i = 0; i < kScanItems; ++i) flag[i] = (t0 + i < t_count && map[(t0 + i) * e + x] != 0) ? 1 : 0;
  using Scan = cub::BlockScan<int, kScanThreads>;
  __shared__ typename Scan::TempStorage tmp;
  Scan(tmp).ExclusiveSum(flag, rank);
  const int32_t base = chunk_start[int64_t(x) * chunks + c], n_routed = routed[x], first = offset[x];
#pragma unroll
  for (int i = 0; i < kScanItems; ++i) {
    const int64_t t = t0 + i;
    if (t >= t_count) continue;
    const int64_t r = base + rank[i];  // routed tokens of x before t
    int64_t row = -1;
    if (flag[i]) {
      if (capacity == 0 || r < capacity) row = first + r;
    } else if (capacity > 0) {
      const int64_t u = t - r;  // unrouted tokens of x before t
      if (n_routed + u < capacity) row = first + n_routed + u;
    }
    if (row < 0) continue;
    sorted[row] = int32_t(t);
    row_expert[row] = x;
    token_rows[t * e + x] = int32_t(row);
  }
}

}  // namespace

void moe_permutation(Context& ctx, const Tensor& routing_map, int64_t capacity, MoePermutation& perm) {
  MG_CHECK(routing_map.defined() && routing_map.dim() == 2 && routing_map.dtype() == DType::UInt8,
           "moe_permutation: the routing map must be uint8 [tokens, experts], got {}",
           routing_map.defined() ? routing_map.str() : "undefined");
  check_cuda(routing_map, "routing_map");
  const int64_t t_count = routing_map.size(0), e = routing_map.size(1);
  MG_CHECK(capacity >= 0 && capacity <= t_count, "moe_permutation: expert capacity {} for {} tokens", capacity,
           t_count);
  MG_CHECK(t_count * e < (int64_t(1) << 31), "moe_permutation: {} tokens x {} experts exceed int32 row indices",
           t_count, e);
  MG_CHECK(capacity > 0 || !ctx.capturing(),
           "moe_permutation on CUDA: the dropless row counts are read back on the host, which a CUDA graph "
           "capture cannot do (use drop-and-pad or run the MoE layer outside the graph)");
  const cudaStream_t stream = stream_of(ctx);
  const int chunks = int(std::max<int64_t>(1, (t_count + kChunk - 1) / kChunk));
  Tensor meta32 = Tensor::empty({e * chunks + 2 * e}, DType::Int32, ctx.device());
  Tensor rows_dev = Tensor::empty({e}, DType::Int64, ctx.device());
  int32_t* chunk = dev_ptr<int32_t>(meta32);
  int32_t* routed = chunk + e * chunks;
  int32_t* offset = routed + e;
  const dim3 grid{unsigned(e), unsigned(chunks)};
  if (e > 0) {
    chunk_counts_kernel<<<grid, kScanThreads, 0, stream>>>(dev_ptr<const uint8_t>(routing_map), t_count, int(e),
                                                          chunks, chunk);
    CUDA_CHECK_LAUNCH();
    chunk_offsets_kernel<<<1, kScanThreads, 0, stream>>>(chunk, int(e), chunks, capacity, routed, offset,
                                                         dev_ptr<int64_t>(rows_dev));
    CUDA_CHECK_LAUNCH();
  }
  perm.rows_per_expert.assign(size_t(e), capacity);
  if (capacity == 0 && e > 0) {  // the one copy back: the caller sizes the experts' buffers from it
    CUDA_CHECK(cudaMemcpyAsync(perm.rows_per_expert.data(), rows_dev.raw_data(), size_t(e) * sizeof(int64_t),
                               cudaMemcpyDeviceToHost, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  perm.num_tokens = t_count;
  perm.num_experts = e;
  const int64_t n = perm.rows();
  perm.sorted_indices = Tensor::empty({n}, DType::Int32, ctx.device());
  perm.row_expert = Tensor::empty({n}, DType::Int32, ctx.device());
  perm.token_rows = Tensor::empty({t_count, e}, DType::Int32, ctx.device());
  if (t_count * e == 0) return;
  CUDA_CHECK(cudaMemsetAsync(perm.token_rows.raw_data(), 0xFF, perm.token_rows.nbytes(), stream));  // -1
  scatter_rows_kernel<<<grid, kScanThreads, 0, stream>>>(dev_ptr<const uint8_t>(routing_map), t_count, int(e), chunks,
                                                         capacity, chunk, routed, offset,
                                                         dev_ptr<int32_t>(perm.sorted_indices),
                                                         dev_ptr<int32_t>(perm.row_expert),
                                                         dev_ptr<int32_t>(perm.token_rows));
  CUDA_CHECK_LAUNCH();
}

namespace {

constexpr int kRowBlock = 256;

// Elements per vector access: 16 bytes when every row start is 16-byte aligned, else one.
template <typename T>
int pack_of(int64_t h, std::initializer_list<const void*> ptrs) {
  const int n = int(16 / sizeof(T));
  if (h % n != 0) return 1;
  for (const void* p : ptrs)
    if (p && !aligned16(p)) return 1;
  return n;
}

// out[r] = src[index[r]] (index null: r), row by row; a plain copy of the storage type.
template <typename T, int N>
__global__ void gather_rows_kernel(const T* __restrict__ src, const int32_t* __restrict__ index, int64_t rows,
                                   int64_t h, T* __restrict__ out) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* s = src + int64_t(index[r]) * h;
    T* o = out + r * h;
    for (int64_t j = int64_t(threadIdx.x) * N; j < h; j += int64_t(blockDim.x) * N)
      *reinterpret_cast<Pack<T, N>*>(o + j) = *reinterpret_cast<const Pack<T, N>*>(s + j);
  }
}

// out[t] = Σ over t's rows r (token_rows[t, :], in row order) of w[r] · rows[r] (w null: 1), fp32,
// rounded once. The token's rows are gathered into shared memory first.
template <typename T, int N>
__global__ void gather_sum_rows_kernel(const T* __restrict__ rows, const float* __restrict__ w,
                                       const int32_t* __restrict__ token_rows, int64_t t_count, int e, int64_t h,
                                       T* __restrict__ out) {
  extern __shared__ int32_t list[];  // [e] rows, then [e] weights (as float bits)
  __shared__ int count;
  float* wl = reinterpret_cast<float*>(list + e);
  for (int64_t t = blockIdx.x; t < t_count; t += gridDim.x) {
    __syncthreads();
    if (threadIdx.x == 0) {
      int n = 0;
      for (int x = 0; x < e; ++x) {
        const int32_t r = token_rows[t * e + x];
        if (r >= 0) list[n] = r, wl[n] = w ? w[r] : 1.0f, ++n;
      }
      count = n;
    }
    __syncthreads();
    for (int64_t j = int64_t(threadIdx.x) * N; j < h; j += int64_t(blockDim.x) * N) {
      float acc[N];
#pragma unroll
      for (int q = 0; q < N; ++q) acc[q] = 0.0f;
      for (int i = 0; i < count; ++i) {
        float v[N];
        load_pack<N>(rows + int64_t(list[i]) * h + j, v);
#pragma unroll
        for (int q = 0; q < N; ++q) acc[q] += wl[i] * v[q];
      }
      store_pack<N>(out + t * h + j, acc);
    }
  }
}

__device__ float block_sum_float(float v) {
  using Reduce = cub::BlockReduce<float, kRowBlock>;
  __shared__ typename Reduce::TempStorage tmp;
  return Reduce(tmp).Sum(v);
}

// Row r: gx[r] = w[r] · g[index[r]] (when gx), gp[r] = Σ_j g[index[r], j] · x[r, j] (when gp), fp32;
// index null: r (the row scaling's backward), w null: 1.
template <typename T, int N>
__global__ void scaled_rows_and_dots_kernel(const T* __restrict__ g, const int32_t* __restrict__ index,
                                            const T* __restrict__ x, const float* __restrict__ w, int64_t rows,
                                            int64_t h, T* __restrict__ gx, float* __restrict__ gp) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* gr = g + (index ? int64_t(index[r]) : r) * h;
    const float wr = w ? w[r] : 1.0f;
    float dot = 0.0f;
    for (int64_t j = int64_t(threadIdx.x) * N; j < h; j += int64_t(blockDim.x) * N) {
      float gv[N];
      load_pack<N>(gr + j, gv);
      if (gx) {
        float o[N];
#pragma unroll
        for (int q = 0; q < N; ++q) o[q] = gv[q] * wr;
        store_pack<N>(gx + r * h + j, o);
      }
      if (gp) {
        float xv[N];
        load_pack<N>(x + r * h + j, xv);
#pragma unroll
        for (int q = 0; q < N; ++q) dot += gv[q] * xv[q];
      }
    }
    if (gp) {
      dot = block_sum_float(dot);
      if (threadIdx.x == 0) gp[r] = dot;
      __syncthreads();  // the reduction's storage is reused by the next row
    }
  }
}

// out[i] = x[i] · p[i / c] in fp32, rounded once.
template <typename T, int N>
__global__ void scale_rows_kernel(const T* __restrict__ x, const float* __restrict__ p, int64_t n, int64_t c,
                                  T* __restrict__ out) {
  const int64_t total = n * c;
  for (int64_t i = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) * N; i < total;
       i += int64_t(gridDim.x) * blockDim.x * N) {
    float v[N];
    load_pack<N>(x + i, v);
#pragma unroll
    for (int q = 0; q < N; ++q) v[q] *= p[(i + q) / c];
    store_pack<N>(out + i, v);
  }
}

__global__ void permute_probs_kernel(const float* probs, const int32_t* sorted, const int32_t* expert, int64_t n,
                                     int e, float* out) {
  for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < n; r += int64_t(gridDim.x) * blockDim.x)
    out[r] = probs[int64_t(sorted[r]) * e + expert[r]];
}

__global__ void permute_probs_backward_kernel(const float* g, const int32_t* token_rows, int64_t total, float* out) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = token_rows[i] < 0 ? 0.0f : g[token_rows[i]];
}

struct PermDims {
  int64_t n = 0, h = 0;
};

PermDims check_perm(const MoePermutation& perm, const Tensor& permuted, const Tensor& tokens) {
  const int64_t n = perm.rows();
  MG_ASSERT(perm.sorted_indices.defined() && perm.sorted_indices.numel() == n && perm.token_rows.defined() &&
                perm.token_rows.numel() == perm.num_tokens * perm.num_experts && perm.sorted_indices.device().is_cuda(),
            "MoE permutation of {} rows is incomplete or not on a CUDA device", n);
  check_float_cuda(permuted, "permuted");
  check_float_cuda(tokens, "tokens");
  MG_ASSERT(permuted.dim() == 2 && tokens.dim() == 2 && permuted.size(0) == n && tokens.size(0) == perm.num_tokens &&
                permuted.size(1) == tokens.size(1) && permuted.dtype() == tokens.dtype(),
            "permuted {} and tokens {} for a permutation of {} tokens into {} rows", permuted.str(), tokens.str(),
            perm.num_tokens, n);
  return {n, tokens.size(1)};
}

unsigned row_grid(int64_t rows) { return unsigned(std::clamp<int64_t>(rows, 1, 65535 * 4)); }

void gather_sum_rows(Context& ctx, const Tensor& rows, const float* w, const MoePermutation& perm, Tensor& out) {
  const int64_t h = out.size(1), e = perm.num_experts;
  if (perm.num_tokens == 0 || h == 0) return;
  const size_t smem = size_t(e) * 8;
  dispatch_float(out.dtype(), [&]<typename T>() {
    auto launch = [&]<int N>() {
      gather_sum_rows_kernel<T, N><<<row_grid(perm.num_tokens), kRowBlock, smem, stream_of(ctx)>>>(
          dev_ptr<const T>(rows), w, dev_ptr<const int32_t>(perm.token_rows), perm.num_tokens, int(e), h,
          dev_ptr<T>(out));
    };
    if (pack_of<T>(h, {rows.raw_data(), out.raw_data()}) > 1) {
      launch.template operator()<int(16 / sizeof(T))>();
    } else {
      launch.template operator()<1>();
    }
  });
  CUDA_CHECK_LAUNCH();
}

// gx / gp of scaled_rows_and_dots_kernel; either may be undefined.
void scaled_rows_and_dots(Context& ctx, const Tensor& g, const int32_t* index, const Tensor& x, const float* w,
                          int64_t rows, int64_t h, Tensor& gx, Tensor& gp) {
  if (rows == 0 || (!gx.defined() && !gp.defined())) return;
  if (h == 0) {
    if (gp.defined()) CUDA_CHECK(cudaMemsetAsync(gp.raw_data(), 0, gp.nbytes(), stream_of(ctx)));
    return;
  }
  dispatch_float(g.dtype(), [&]<typename T>() {
    auto launch = [&]<int N>() {
      scaled_rows_and_dots_kernel<T, N><<<row_grid(rows), kRowBlock, 0, stream_of(ctx)>>>(
          dev_ptr<const T>(g), index, gp.defined() ? dev_ptr<const T>(x) : nullptr, w, rows, h,
          gx.defined() ? dev_ptr<T>(gx) : nullptr, gp.defined() ? dev_ptr<float>(gp) : nullptr);
    };
    const bool packed = pack_of<T>(h, {g.raw_data(), gp.defined() ? x.raw_data() : nullptr,
                                       gx.defined() ? gx.raw_data() : nullptr}) > 1;
    if (packed) {
      launch.template operator()<int(16 / sizeof(T))>();
    } else {
      launch.template operator()<1>();
    }
  });
  CUDA_CHECK_LAUNCH();
}

}  // namespace

void moe_permute_forward(Context& ctx, const Tensor& tokens, const MoePermutation& perm, Tensor& permuted) {
  const PermDims d = check_perm(perm, permuted, tokens);
  if (d.n == 0 || d.h == 0) return;
  dispatch_float(tokens.dtype(), [&]<typename T>() {
    auto launch = [&]<int N>() {
      gather_rows_kernel<T, N><<<row_grid(d.n), kRowBlock, 0, stream_of(ctx)>>>(
          dev_ptr<const T>(tokens), dev_ptr<const int32_t>(perm.sorted_indices), d.n, d.h, dev_ptr<T>(permuted));
    };
    if (pack_of<T>(d.h, {tokens.raw_data(), permuted.raw_data()}) > 1) {
      launch.template operator()<int(16 / sizeof(T))>();
    } else {
      launch.template operator()<1>();
    }
  });
  CUDA_CHECK_LAUNCH();
}

void moe_permute_backward(Context& ctx, const Tensor& grad_permuted, const MoePermutation& perm,
                          Tensor& grad_tokens) {
  check_perm(perm, grad_permuted, grad_tokens);
  gather_sum_rows(ctx, grad_permuted, nullptr, perm, grad_tokens);
}

void moe_unpermute_forward(Context& ctx, const Tensor& permuted, const Tensor& probs_permuted,
                           const MoePermutation& perm, Tensor& out) {
  const PermDims d = check_perm(perm, permuted, out);
  if (probs_permuted.defined()) check_dev(probs_permuted, DType::Float32, d.n, "probs_permuted");
  gather_sum_rows(ctx, permuted, probs_permuted.defined() ? dev_ptr<const float>(probs_permuted) : nullptr, perm,
                  out);
}

void moe_unpermute_backward(Context& ctx, const Tensor& grad_out, const Tensor& permuted, const Tensor& probs_permuted,
                            const MoePermutation& perm, Tensor& grad_permuted, Tensor& grad_probs_permuted) {
  const PermDims d = check_perm(perm, permuted, grad_out);
  const bool weighted = probs_permuted.defined();
  if (weighted) check_dev(probs_permuted, DType::Float32, d.n, "probs_permuted");
  if (grad_permuted.defined()) {
    check_float_cuda(grad_permuted, "grad_permuted");
    MG_ASSERT(grad_permuted.numel() == d.n * d.h && grad_permuted.dtype() == grad_out.dtype(),
              "grad_permuted is {}, expected {} [{}, {}]", grad_permuted.str(), to_string(grad_out.dtype()), d.n, d.h);
  }
  Tensor gp = weighted ? grad_probs_permuted : Tensor();
  if (gp.defined()) check_dev(gp, DType::Float32, d.n, "grad_probs_permuted");
  scaled_rows_and_dots(ctx, grad_out, dev_ptr<const int32_t>(perm.sorted_indices), permuted,
                       weighted ? dev_ptr<const float>(probs_permuted) : nullptr, d.n, d.h, grad_permuted, gp);
}

void moe_permute_probs_forward(Context& ctx, const Tensor& probs, const MoePermutation& perm, Tensor& probs_permuted) {
  const int64_t n = perm.rows(), e = perm.num_experts;
  check_dev(probs, DType::Float32, perm.num_tokens * e, "probs");
  check_dev(probs_permuted, DType::Float32, n, "probs_permuted");
  if (n == 0) return;
  permute_probs_kernel<<<grid_for(n), kBlockSize, 0, stream_of(ctx)>>>(
      dev_ptr<const float>(probs), dev_ptr<const int32_t>(perm.sorted_indices),
      dev_ptr<const int32_t>(perm.row_expert), n, int(e), dev_ptr<float>(probs_permuted));
  CUDA_CHECK_LAUNCH();
}

void moe_permute_probs_backward(Context& ctx, const Tensor& grad_probs_permuted, const MoePermutation& perm,
                                Tensor& grad_probs) {
  const int64_t n = perm.rows(), total = perm.num_tokens * perm.num_experts;
  check_dev(grad_probs_permuted, DType::Float32, n, "grad_probs_permuted");
  check_dev(grad_probs, DType::Float32, total, "grad_probs");
  if (total == 0) return;
  permute_probs_backward_kernel<<<grid_for(total), kBlockSize, 0, stream_of(ctx)>>>(
      dev_ptr<const float>(grad_probs_permuted), dev_ptr<const int32_t>(perm.token_rows), total,
      dev_ptr<float>(grad_probs));
  CUDA_CHECK_LAUNCH();
}

// ---- row scaling ------------------------------------------------------------------------------------

void moe_scale_rows_forward(Context& ctx, const Tensor& x, const Tensor& probs, Tensor& out) {
  check_float_cuda(x, "x");
  check_float_cuda(out, "out");
  const int64_t n = probs.numel(), c = n == 0 ? 0 : x.numel() / n;
  check_dev(probs, DType::Float32, n, "probs");
  MG_ASSERT(x.numel() == n * c && out.numel() == n * c && out.dtype() == x.dtype(),
            "moe_scale_rows: x {} and out {} for {} probabilities", x.str(), out.str(), n);
  if (n * c == 0) return;
  dispatch_float(x.dtype(), [&]<typename T>() {
    auto launch = [&]<int N>() {
      scale_rows_kernel<T, N><<<grid_for(n * c / N), kBlockSize, 0, stream_of(ctx)>>>(
          dev_ptr<const T>(x), dev_ptr<const float>(probs), n, c, dev_ptr<T>(out));
    };
    if (pack_of<T>(c, {x.raw_data(), out.raw_data()}) > 1) {
      launch.template operator()<int(16 / sizeof(T))>();
    } else {
      launch.template operator()<1>();
    }
  });
  CUDA_CHECK_LAUNCH();
}

void moe_scale_rows_backward(Context& ctx, const Tensor& grad_out, const Tensor& x, const Tensor& probs,
                             Tensor& grad_x, Tensor& grad_probs) {
  check_float_cuda(grad_out, "grad_out");
  const int64_t n = probs.numel(), c = n == 0 ? 0 : grad_out.numel() / n;
  check_dev(probs, DType::Float32, n, "probs");
  if (grad_x.defined()) {
    check_float_cuda(grad_x, "grad_x");
    MG_ASSERT(grad_x.numel() == n * c && grad_x.dtype() == grad_out.dtype(), "grad_x is {}, expected {} like {}",
              grad_x.str(), n * c, grad_out.str());
  }
  if (grad_probs.defined()) {
    check_dev(grad_probs, DType::Float32, n, "grad_probs");
    check_float_cuda(x, "x");
    MG_ASSERT(x.numel() == n * c && x.dtype() == grad_out.dtype(), "x is {}, expected {} like {}", x.str(), n * c,
              grad_out.str());
  }
  scaled_rows_and_dots(ctx, grad_out, nullptr, x, dev_ptr<const float>(probs), n, c, grad_x, grad_probs);
}

}  // namespace megatron::cuda
