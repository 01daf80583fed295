// Token and learned position embeddings, CUDA fast path (reference: kernels/cpu/embedding.cpp).
//
// tokens and position_ids are batch-first [b, s]; the output is sequence-first [s, b, h], so output row
// (si, bi) reads id [bi, si]. Forward: one block per output row, word + pos summed in fp32 and stored
// once (16-byte vectors when h and the pointers allow). Backward: the same walk, scatter-adding the
// row's gradient into the fp32 tables with float atomics (rows of a repeated id collide, so the sum
// order, and the last bits, may vary from run to run).
//
// Note [Device-side id checks]: an id outside its table is the user's mistake. The kernels never read
// or write out of bounds: they record the smallest flat [b, s] index of a bad id with atomicMin into a
// small device buffer and skip that row; the host syncs the stream after the forward's launch and
// throws megatron::Error naming the first bad id, as the CPU reference does. The backward skips bad
// ids without a check of its own (Note [No id check in backward]).
//
// Note [Host checks under capture]: while a CUDA graph is captured (Context::capturing) nothing may
// wait for the device, so the forward ops skip reading the bad-id buffer back (the kernels still
// skip bad rows); whoever captures checks the ids on the host before they reach the graph's input
// tensors, with the same messages (check_batch_ids, core/pipeline_parallel/schedules.h). The eager
// training step does the same (HostCheckedIds, runtime/context.h): each read-back is a wait for the
// device, and the GPU then idles until the host has queued enough work again — measured at ~3% of
// a GPT-2 124M step of eight microbatches together with the per-microbatch copies of the batch.
#include <algorithm>
#include <climits>
#include <cub/device/device_radix_sort.cuh>
#include <string>

#include "megatron/kernels/cuda/cuda_common.cuh"
#include "megatron/kernels/cuda/cuda_ops.h"
#include "megatron/kernels/ops.h"

namespace megatron::cuda {

namespace {

constexpr int kMaxRowThreads = 256;
constexpr unsigned long long kNoBadId = ~0ull;

// An [b, s] id tensor on the device: int32 or int64.
struct Ids {
  const void* data = nullptr;
  bool is64 = false;
  int64_t rows = 0;  // the table's row count: valid ids are [0, rows)
  __device__ __forceinline__ int64_t operator[](int64_t i) const {
    return is64 ? static_cast<const int64_t*>(data)[i] : int64_t(static_cast<const int32_t*>(data)[i]);
  }
};

// Output row `row` = (si, bi) of an [s, b, h] tensor reads ids at flat index bi·s + si. Returns the
// id, or -1 after recording a bad one (Note [Device-side id checks]).
__device__ __forceinline__ int64_t checked_id(const Ids& ids, int64_t flat, unsigned long long* bad) {
  const int64_t id = ids[flat];
  if (id >= 0 && id < ids.rows) return id;
  if (threadIdx.x == 0) atomicMin(bad, static_cast<unsigned long long>(flat));
  return -1;
}

// out[si, bi, :] = word[tokens[bi, si], :] + pos[position_ids[bi, si], :] (pos optional).
template <typename T, int VEC>
__global__ void embedding_forward_kernel(Ids tokens, Ids positions, const T* __restrict__ word,
                                         const T* __restrict__ pos, int64_t b, int64_t s, int64_t h,
                                         T* __restrict__ out, unsigned long long* bad) {
  const int64_t row = blockIdx.x, si = row / b, bi = row % b, flat = bi * s + si;
  const int64_t w = checked_id(tokens, flat, &bad[0]);
  const int64_t p = pos ? checked_id(positions, flat, &bad[1]) : 0;
  if (w < 0 || p < 0) return;
  const T* wr = word + w * h;
  const T* pr = pos ? pos + p * h : nullptr;
  T* orow = out + row * h;
  for (int64_t c = int64_t(threadIdx.x) * VEC; c < h; c += int64_t(blockDim.x) * VEC) {
    const Pack<T, VEC> a = *reinterpret_cast<const Pack<T, VEC>*>(wr + c);
    Pack<T, VEC> y;
    if (pr) {
      const Pack<T, VEC> q = *reinterpret_cast<const Pack<T, VEC>*>(pr + c);
#pragma unroll
      for (int k = 0; k < VEC; ++k) y.v[k] = store_float<T>(load_float(a.v[k]) + load_float(q.v[k]));
    } else {
      y = a;
    }
    *reinterpret_cast<Pack<T, VEC>*>(orow + c) = y;
  }
}

// word_grad[tokens[bi, si], :] += grad_out[si, bi, :], likewise pos_grad (either may be null).
// Note [Embedding backward by sorting]: scatter-adding every row with float atomics serialises on
// repeated ids (every sequence has the same positions) and costs one atomic per element. Instead
// the rows are sorted by id (cub radix sort, stable), and one block per run of equal ids sums its
// rows in a fixed order and adds the sum once: deterministic, and one read-modify-write per table
// row touched. keys[r] = id of grad_out row r (r = si·b + bi), INT_MAX for a bad id (skipped).
__global__ void embedding_sort_keys(Ids ids, int64_t b, int64_t s, int32_t* keys, int32_t* rows) {
  const int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (r >= b * s) return;
  const int64_t si = r / b, bi = r % b, flat = bi * s + si;
  const int64_t id = ids[flat];
  keys[r] = id >= 0 && id < ids.rows ? int32_t(id) : INT_MAX;  // Note [No id check in backward]
  rows[r] = int32_t(r);
}

// Adds grad_out's rows into table_grad by id (Note [Embedding backward by sorting]).
template <typename T>
void sorted_scatter_add(Context& ctx, const Ids& ids, int64_t b, int64_t s, const T* grad_out, int64_t h,
                        float* table_grad) {
  const int64_t n = b * s;
  cudaStream_t stream = stream_of(ctx);
  Tensor keys = Tensor::empty({2 * n}, DType::Int32, ctx.device());
  Tensor rows = Tensor::empty({2 * n}, DType::Int32, ctx.device());
  int32_t* keys_in = dev_ptr<int32_t>(keys);
  int32_t* rows_in = dev_ptr<int32_t>(rows);
  embedding_sort_keys<<<grid_for(n), kBlockSize, 0, stream>>>(ids, b, s, keys_in, rows_in);
  CUDA_CHECK_LAUNCH();
  const int bits = 32;  // INT_MAX marks bad ids: sort on every bit so they go last
  size_t temp_bytes = 0;
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys_in, keys_in + n, rows_in, rows_in + n,
                                             int(n), 0, bits, stream));
  Tensor temp = Tensor::empty({int64_t(std::max<size_t>(temp_bytes, 1))}, DType::UInt8, ctx.device());
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.raw_data(), temp_bytes, keys_in, keys_in + n, rows_in,
                                             rows_in + n, int(n), 0, bits, stream));
  const int threads = int(std::min<int64_t>(256, std::max<int64_t>(32, (h + 31) / 32 * 32)));
  sorted_segment_sum<T><<<unsigned(n), threads, 0, stream>>>(keys_in + n, rows_in + n, n, grad_out, h, table_grad);
  CUDA_CHECK_LAUNCH();
}

// Checks an id tensor [b, s] (int32/int64) against tokens' shape; `rows` is its table's size.
Ids make_ids(const Tensor& ids, const Tensor& tokens, int64_t rows, const char* what) {
  check_cuda(ids, what);
  MG_ASSERT(ids.dim() == 2 && (ids.dtype() == DType::Int32 || ids.dtype() == DType::Int64),
            "{} must be int32/int64 [b, s], got {}", what, ids.str());
  MG_ASSERT(ids.shape() == tokens.shape(), "{} {} and tokens {} differ in shape", what, ids.str(), tokens.str());
  return Ids{ids.raw_data(), ids.dtype() == DType::Int64, rows};
}

void check_rows_tensor(const Tensor& t, int64_t s, int64_t b, int64_t h, const char* name) {
  MG_ASSERT(t.dim() == 3 && t.size(0) == s && t.size(1) == b && t.size(2) == h, "{} is {}, expected [{}, {}, {}]",
            name, t.str(), s, b, h);
}


// The bad-id buffer: [0] tokens, [1] positions, each the smallest bad flat index or kNoBadId.
Tensor make_bad_buffer(const Context& ctx) {
  Tensor bad = Tensor::empty({2}, DType::Int64, ctx.device());
  CUDA_CHECK(cudaMemsetAsync(bad.raw_data(), 0xff, 2 * sizeof(unsigned long long), stream_of(ctx)));
  return bad;
}

// Syncs and throws the first bad id (Note [Device-side id checks]): token ids before position ids.
void raise_bad_ids(const Context& ctx, const Tensor& bad, const Tensor& tokens, const Tensor& position_ids,
                   int64_t word_rows, int64_t pos_rows) {
  cudaStream_t stream = stream_of(ctx);
  unsigned long long found[2];
  CUDA_CHECK(cudaMemcpyAsync(found, bad.raw_data(), sizeof(found), cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  for (int which = 0; which < 2; ++which) {
    if (found[which] == kNoBadId) continue;
    const Tensor& ids = which == 0 ? tokens : position_ids;
    const int64_t flat = int64_t(found[which]), s = ids.size(1);
    int64_t id = 0;
    if (ids.dtype() == DType::Int64) {
      CUDA_CHECK(cudaMemcpy(&id, static_cast<const int64_t*>(ids.raw_data()) + flat, 8, cudaMemcpyDeviceToHost));
    } else {
      int32_t id32 = 0;
      CUDA_CHECK(cudaMemcpy(&id32, static_cast<const int32_t*>(ids.raw_data()) + flat, 4, cudaMemcpyDeviceToHost));
      id = id32;
    }
    ops::throw_bad_table_id(which == 0 ? "token id" : "position id", id, flat, s, which == 0 ? word_rows : pos_rows);
  }
}

}  // namespace

void embedding_forward(Context& ctx, const Tensor& tokens, const Tensor& position_ids, const Tensor& word_weight,
                       const Tensor& pos_weight, Tensor& out) {
  check_cuda(word_weight, "word_weight");
  MG_ASSERT(word_weight.dim() == 2, "word_weight must be [V, h], got {}", word_weight.str());
  const int64_t h = word_weight.size(1);
  const Ids words = make_ids(tokens, tokens, word_weight.size(0), "token ids");
  const int64_t b = tokens.size(0), s = tokens.size(1);
  check_cuda(out, "out");
  check_rows_tensor(out, s, b, h, "out");
  MG_ASSERT(out.dtype() == word_weight.dtype(), "the CUDA embedding needs out {} in the dtype of word_weight {}",
            out.str(), word_weight.str());
  Ids positions;
  const bool has_pos = position_ids.defined();
  if (has_pos) {
    check_cuda(pos_weight, "pos_weight");
    MG_ASSERT(pos_weight.dim() == 2 && pos_weight.size(1) == h && pos_weight.dtype() == word_weight.dtype(),
              "pos_weight is {}, expected [P, {}] in the dtype of word_weight {}", pos_weight.str(), h,
              word_weight.str());
    positions = make_ids(position_ids, tokens, pos_weight.size(0), "position ids");
  }
  if (b * s == 0 || h == 0) return;
  Tensor bad = make_bad_buffer(ctx);
  cudaStream_t stream = stream_of(ctx);
  dispatch_float(out.dtype(), [&]<typename T>() {
    constexpr int kVec = 16 / sizeof(T);
    const T* pos = has_pos ? dev_ptr<T>(pos_weight) : nullptr;
    const bool vec = h % kVec == 0 && aligned16(word_weight.raw_data()) && aligned16(out.raw_data()) &&
                     (!pos || aligned16(pos));
    auto* bad_ptr = static_cast<unsigned long long*>(bad.raw_data());
    if (vec) {
      embedding_forward_kernel<T, kVec><<<unsigned(b * s), row_threads(h / kVec, kMaxRowThreads), 0, stream>>>(
          words, positions, dev_ptr<T>(word_weight), pos, b, s, h, dev_ptr<T>(out), bad_ptr);
    } else {
      embedding_forward_kernel<T, 1><<<unsigned(b * s), row_threads(h, kMaxRowThreads), 0, stream>>>(
          words, positions, dev_ptr<T>(word_weight), pos, b, s, h, dev_ptr<T>(out), bad_ptr);
    }
  });
  CUDA_CHECK_LAUNCH();
  if (ctx.ids_checked_on_host()) return;  // Note [Host checks under capture]
  raise_bad_ids(ctx, bad, tokens, position_ids, words.rows, positions.rows);
}

void embedding_backward(Context& ctx, const Tensor& tokens, const Tensor& position_ids, const Tensor& grad_out,
                        Tensor& word_grad, Tensor& pos_grad) {
  check_cuda(grad_out, "grad_out");
  MG_ASSERT(grad_out.dim() == 3, "grad_out must be [s, b, h], got {}", grad_out.str());
  const int64_t h = grad_out.size(2);
  MG_ASSERT(tokens.defined() && tokens.dim() == 2, "tokens must be [b, s], got {}",
            tokens.defined() ? tokens.str() : "undefined");
  const int64_t b = tokens.size(0), s = tokens.size(1);
  check_rows_tensor(grad_out, s, b, h, "grad_out");
  Ids words, positions;
  float* word_ptr = nullptr;
  float* pos_ptr = nullptr;
  if (word_grad.defined()) {
    check_cuda(word_grad, "word_grad");
    MG_ASSERT(word_grad.dtype() == DType::Float32 && word_grad.dim() == 2 && word_grad.size(1) == h,
              "word_grad is {}, expected fp32 [V, {}]", word_grad.str(), h);
    words = make_ids(tokens, tokens, word_grad.size(0), "token ids");
    word_ptr = dev_ptr<float>(word_grad);
  }
  if (pos_grad.defined() && position_ids.defined()) {
    check_cuda(pos_grad, "pos_grad");
    MG_ASSERT(pos_grad.dtype() == DType::Float32 && pos_grad.dim() == 2 && pos_grad.size(1) == h,
              "pos_grad is {}, expected fp32 [P, {}]", pos_grad.str(), h);
    positions = make_ids(position_ids, tokens, pos_grad.size(0), "position ids");
    pos_ptr = dev_ptr<float>(pos_grad);
  }
  if ((!word_ptr && !pos_ptr) || b * s == 0 || h == 0) return;
  dispatch_float(grad_out.dtype(), [&]<typename T>() {
    if (word_ptr) sorted_scatter_add<T>(ctx, words, b, s, dev_ptr<T>(grad_out), h, word_ptr);
    if (pos_ptr) sorted_scatter_add<T>(ctx, positions, b, s, dev_ptr<T>(grad_out), h, pos_ptr);
  });
  // Note [No id check in backward]: the forward checked these ids (and raised); checking again
  // would cost a host synchronisation at the end of every backward pass. Rows of out-of-range ids
  // are skipped (their keys sort last).
}

}  // namespace megatron::cuda
