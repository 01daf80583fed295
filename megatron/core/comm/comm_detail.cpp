#include "megatron/core/comm/comm_detail.h"

#include <algorithm>
#include <cstring>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace megatron {

std::vector<double> sum_in_rank_order(Context& ctx, Communicator& group, const std::vector<double>& values) {
  if (group.size() == 1 || values.empty()) return values;
  const int64_t n = int64_t(values.size());
  Tensor mine = Tensor::empty({n}, DType::Int64);
  std::memcpy(mine.raw_data(), values.data(), values.size() * sizeof(double));
  Tensor all = Tensor::empty({n * group.size()}, DType::Int64, ctx.device());
  group.all_gather(ctx, mine.to(ctx.device()), all)->wait();
  const Tensor host = all.to(Device::cpu());
  std::vector<double> sum(values.size(), 0.0), v(values.size());
  for (int r = 0; r < group.size(); ++r) {
    std::memcpy(v.data(), static_cast<const int64_t*>(host.raw_data()) + r * n, values.size() * sizeof(double));
    for (size_t i = 0; i < v.size(); ++i) sum[i] += v[i];
  }
  return sum;
}

}  // namespace megatron

namespace megatron::comm_detail {

std::string describe_group(const Communicator& g) {
  const auto& ranks = g.global_ranks();
  std::string list;
  if (ranks.size() > 16) {
    list = fmt::format("{}, ... ({} ranks)", fmt::join(ranks.begin(), ranks.begin() + 8, ", "), ranks.size());
  } else {
    list = fmt::format("{}", fmt::join(ranks, ", "));
  }
  return fmt::format("the {} group (world rank{} {})", g.name(), ranks.size() == 1 ? "" : "s", list);
}

std::string format_duration(std::chrono::milliseconds d) {
  auto ms = d.count();
  if (ms % 60000 == 0) return fmt::format("{} minute{}", ms / 60000, ms == 60000 ? "" : "s");
  if (ms % 1000 == 0) return fmt::format("{} second{}", ms / 1000, ms == 1000 ? "" : "s");
  return fmt::format("{} ms", ms);
}

void throw_timeout(const std::string& op, const Communicator& g, std::chrono::milliseconds timeout,
                   const std::string& detail) {
  throw Error(fmt::format("{} on {} did not complete within {} (--distributed-timeout-minutes): a rank of the group "
                          "is dead or stuck{}",
                          op, describe_group(g), format_duration(timeout), detail));
}

void check_device(const Communicator& g, const char* op, const Tensor& t, bool want_cuda) {
  MG_CHECK(t.defined(), "{} on {}: the tensor is undefined", op, describe_group(g));
  MG_CHECK(want_cuda ? t.device().is_cuda() : t.device().is_host(),
           "{} on {}: the {} backend takes {} tensors, got {} (use the {} backend for them)", op, describe_group(g),
           g.backend(), want_cuda ? "CUDA" : "host", t.str(), want_cuda ? "mpi" : "nccl");
}

void check_reduce_scatter(const Communicator& g, const Tensor& input, const Tensor& output) {
  MG_CHECK(input.dtype() == output.dtype() && input.numel() == int64_t(g.size()) * output.numel(),
           "reduce_scatter on {}: input {} must hold {} blocks of output {}", describe_group(g), input.str(), g.size(),
           output.str());
}

void check_all_gather(const Communicator& g, const Tensor& input, const Tensor& output) {
  MG_CHECK(input.dtype() == output.dtype() && output.numel() == int64_t(g.size()) * input.numel(),
           "all_gather on {}: output {} must hold {} blocks of input {}", describe_group(g), output.str(), g.size(),
           input.str());
}

void check_all_to_all(const Communicator& g, const Tensor& input, const Tensor& output) {
  MG_CHECK(input.dtype() == output.dtype() && input.numel() == output.numel() && input.numel() % g.size() == 0,
           "all_to_all on {}: input {} and output {} must have the same dtype and numel, a multiple of {}",
           describe_group(g), input.str(), output.str(), g.size());
}

namespace {

void check_splits(const Communicator& g, const char* which, const std::vector<int64_t>& splits, const Tensor& t) {
  MG_CHECK(splits.size() == size_t(g.size()),
           "all_to_all_v on {}: {} has {} entries for a group of {} ranks: pass one row count per rank",
           describe_group(g), which, splits.size(), g.size());
  int64_t sum = 0;
  for (size_t i = 0; i < splits.size(); ++i) {
    MG_CHECK(splits[i] >= 0, "all_to_all_v on {}: {}[{}] is {}: row counts must be non-negative", describe_group(g),
             which, i, splits[i]);
    sum += splits[i];
  }
  MG_CHECK(sum == t.size(0),
           "all_to_all_v on {}: {} ({}) sum to {} rows but the tensor {} has {}: they must sum to its dim 0",
           describe_group(g), which, fmt::join(splits, ", "), sum, t.str(), t.size(0));
}

}  // namespace

void check_all_to_all_v(const Communicator& g, const Tensor& input, const std::vector<int64_t>& input_splits,
                        const Tensor& output, const std::vector<int64_t>& output_splits) {
  MG_CHECK(input.dim() >= 1 && output.dim() >= 1,
           "all_to_all_v on {}: input {} and output {} need a dim 0 to split (give scalars the shape [1])",
           describe_group(g), input.str(), output.str());
  const bool same_rows =
      std::equal(input.shape().begin() + 1, input.shape().end(), output.shape().begin() + 1, output.shape().end());
  MG_CHECK(input.dtype() == output.dtype() && same_rows,
           "all_to_all_v on {}: input {} and output {} must have the same dtype and the same shape after dim 0",
           describe_group(g), input.str(), output.str());
  check_splits(g, "input_splits", input_splits, input);
  check_splits(g, "output_splits", output_splits, output);
  const char* in = static_cast<const char*>(input.raw_data());
  const char* out = static_cast<const char*>(output.raw_data());
  const bool overlap = input.storage() == output.storage() && input.nbytes() > 0 && output.nbytes() > 0 &&
                       in < out + output.nbytes() && out < in + input.nbytes();
  MG_CHECK(!overlap, "all_to_all_v on {}: input {} and output {} overlap: pass a separate output tensor",
           describe_group(g), input.str(), output.str());
}

int64_t row_numel(const Tensor& t) {
  int64_t n = 1;
  for (int d = 1; d < t.dim(); ++d) n *= t.size(d);
  return n;
}

std::vector<int64_t> split_offsets(const std::vector<int64_t>& splits) {
  std::vector<int64_t> offsets(splits.size(), 0);
  for (size_t i = 1; i < splits.size(); ++i) offsets[i] = offsets[i - 1] + splits[i - 1];
  return offsets;
}

void check_root(const Communicator& g, const char* op, int root) {
  MG_CHECK(root >= 0 && root < g.size(), "{} on {}: root {} is not a rank of the group (size {})", op,
           describe_group(g), root, g.size());
}

void check_p2p(const Communicator& g, const std::vector<P2POp>& ops, bool want_cuda) {
  for (const P2POp& p : ops) {
    const char* what = p.kind == P2POp::Send ? "send" : "recv";
    check_device(g, what, p.tensor, want_cuda);
    MG_CHECK(p.peer >= 0 && p.peer < g.size() && p.peer != g.rank(),
             "{} on {}: peer {} must be another rank of the group (this is rank {} of {})", what, describe_group(g),
             p.peer, g.rank(), g.size());
  }
}

bool is_block_of(const Tensor& part, const Tensor& whole, int index) {
  return part.storage() == whole.storage() &&
         static_cast<const char*>(part.raw_data()) ==
             static_cast<const char*>(whole.raw_data()) + size_t(index) * part.nbytes();
}

void check_reducible(const Communicator& g, const char* op, DType dtype) {
  bool ok = dtype == DType::Float32 || dtype == DType::BFloat16 || dtype == DType::Float16 || dtype == DType::Int32 ||
            dtype == DType::Int64;
  MG_CHECK(ok, "{} on {}: cannot reduce {} tensors (fp32, bf16, fp16, int32 and int64 can be reduced)", op,
           describe_group(g), to_string(dtype));
}

bool poll_until(std::chrono::steady_clock::time_point deadline, const std::function<bool()>& done) {
  // MPI and CUDA progress only when polled; back off so a long wait does not take a core from the
  // rank's other threads (OpenMPI's own waits spin).
  auto pause = std::chrono::microseconds(0);
  for (int polls = 0;; ++polls) {
    if (done()) return true;
    if (std::chrono::steady_clock::now() >= deadline) return done();
    if (polls < 100) {
      std::this_thread::yield();
    } else {
      pause = std::min(std::chrono::microseconds(1000), pause + std::chrono::microseconds(10));
      std::this_thread::sleep_for(pause);
    }
  }
}

namespace {

template <typename T>
struct Acc {
  using type = T;
  static T load(T x) { return x; }
  static T store(T x) { return x; }
};
template <>
struct Acc<bf16> {
  using type = float;
  static float load(bf16 x) { return to_float(x); }
  static bf16 store(float x) { return to_bf16(x); }
};
template <>
struct Acc<fp16> {
  using type = float;
  static float load(fp16 x) { return to_float(x); }
  static fp16 store(float x) { return to_fp16(x); }
};

template <typename T>
void reduce_typed(ReduceOp op, void* dst_v, const std::vector<const void*>& srcs_v, size_t n) {
  using A = typename Acc<T>::type;
  // Blocks keep the accumulator in cache while each source is added in rank order.
  constexpr size_t kBlock = 2048;
  A acc[kBlock];
  T* dst = static_cast<T*>(dst_v);
  for (size_t start = 0; start < n; start += kBlock) {
    size_t m = std::min(kBlock, n - start);
    const T* s0 = static_cast<const T*>(srcs_v[0]) + start;
    for (size_t i = 0; i < m; ++i) acc[i] = Acc<T>::load(s0[i]);
    for (size_t k = 1; k < srcs_v.size(); ++k) {
      const T* s = static_cast<const T*>(srcs_v[k]) + start;
      switch (op) {
        case ReduceOp::Sum:
          for (size_t i = 0; i < m; ++i) acc[i] += Acc<T>::load(s[i]);
          break;
        case ReduceOp::Max:
          for (size_t i = 0; i < m; ++i) acc[i] = std::max(acc[i], A(Acc<T>::load(s[i])));
          break;
        case ReduceOp::Min:
          for (size_t i = 0; i < m; ++i) acc[i] = std::min(acc[i], A(Acc<T>::load(s[i])));
          break;
      }
    }
    for (size_t i = 0; i < m; ++i) dst[start + i] = Acc<T>::store(acc[i]);
  }
}

}  // namespace

void reduce_in_order(DType dtype, ReduceOp op, void* dst, const std::vector<const void*>& srcs, size_t n) {
  MG_ASSERT(!srcs.empty(), "reduction of no sources");
  switch (dtype) {
    case DType::Float32: return reduce_typed<float>(op, dst, srcs, n);
    case DType::BFloat16: return reduce_typed<bf16>(op, dst, srcs, n);
    case DType::Float16: return reduce_typed<fp16>(op, dst, srcs, n);
    case DType::Int32: return reduce_typed<int32_t>(op, dst, srcs, n);
    case DType::Int64: return reduce_typed<int64_t>(op, dst, srcs, n);
    default: MG_ASSERT(false, "reduction of {} (checked by check_reducible)", to_string(dtype));
  }
}

}  // namespace megatron::comm_detail
