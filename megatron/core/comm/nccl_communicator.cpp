// The NCCL backend: CUDA tensors, one ncclComm_t and one CUDA stream per group.
//
// An operation waits (event) for the context's stream to reach it, runs on the group's stream, and
// its wait() makes the context's stream wait for it (an event; the host does not block). The work
// keeps its tensors alive until wait() (or its destructor), so the stream-ordered pool cannot reuse
// their memory while NCCL still reads or writes it.
//
// Timeouts: where the host blocks — barrier() and split() (a small all-gather first, polled with
// cudaEventQuery and ncclCommGetAsyncError against the deadline; then ncclCommSplit) — it throws
// the timeout error; every other operation is watched by the watchdog thread (Note [NCCL
// watchdog]), which ends the job when one passes the deadline. wait() also checks
// ncclCommGetAsyncError and throws a failed communicator's error.
// Threads: every call selects the group's device first, so a background thread may issue
// operations; one group must not be used from two threads at once (an NCCL communicator is not
// thread-safe). bf16/fp16 reductions are NCCL's (each step in fp32, rounded to the dtype).
#ifdef MEGATRON_WITH_CUDA

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "megatron/core/comm/comm_detail.h"
#include "megatron/core/comm/watchdog.h"
#include "megatron/runtime/cuda/cuda_check.h"

#define NCCL_CHECK(stmt)                                                                                   \
  do {                                                                                                     \
    ncclResult_t mg_res_ = (stmt);                                                                         \
    if (mg_res_ != ncclSuccess) [[unlikely]] {                                                             \
      int mg_dev_ = -1;                                                                                    \
      cudaGetDevice(&mg_dev_);                                                                             \
      ::megatron::mg_library_failure("NCCL", #stmt, __FILE__, __LINE__,                                    \
                                     std::string(ncclGetErrorString(mg_res_)) + ": " + ncclGetLastError(nullptr), \
                                     mg_dev_);                                                             \
    }                                                                                                      \
  } while (0)

namespace megatron {
namespace {

using namespace comm_detail;
static_assert(sizeof(ncclUniqueId) == kNcclUniqueIdBytes);

ncclDataType_t reduce_type(DType t) {
  switch (t) {
    case DType::Float32: return ncclFloat32;
    case DType::BFloat16: return ncclBfloat16;
    case DType::Float16: return ncclFloat16;
    case DType::Int32: return ncclInt32;
    case DType::Int64: return ncclInt64;
    default: MG_ASSERT(false, "reduction of {} (checked by check_reducible)", to_string(t));
  }
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return ncclSum;
    case ReduceOp::Max: return ncclMax;
    case ReduceOp::Min: return ncclMin;
  }
  MG_ASSERT(false, "bad reduce op");
}

cudaEvent_t new_event() {
  cudaEvent_t e;
  CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return e;
}

class NcclWork : public CommWork {
 public:
  NcclWork(ncclComm_t comm, int device, cudaStream_t waiter, cudaEvent_t done, std::vector<Tensor> keep)
      : comm_(comm), device_(device), waiter_(waiter), done_(done), keep_(std::move(keep)) {}
  ~NcclWork() override {
    if (done_) {
      try {
        wait();
      } catch (...) {
      }
    }
  }
  void wait() override {
    if (!done_) return;
    CUDA_CHECK(cudaSetDevice(device_));
    ncclResult_t async = ncclSuccess;
    NCCL_CHECK(ncclCommGetAsyncError(comm_, &async));
    NCCL_CHECK(async);
    CUDA_CHECK(cudaStreamWaitEvent(waiter_, done_, 0));
    CUDA_CHECK(cudaEventDestroy(done_));
    done_ = nullptr;
    keep_.clear();  // later frees on the context's stream are ordered after the operation
  }

 private:
  ncclComm_t comm_;
  int device_;
  cudaStream_t waiter_;
  cudaEvent_t done_;
  std::vector<Tensor> keep_;
};

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, int device, std::string name, std::vector<int> global_ranks,
                   std::chrono::milliseconds timeout)
      : comm_(comm), device_(device), name_(std::move(name)), global_ranks_(std::move(global_ranks)),
        timeout_(timeout) {
    CUDA_CHECK(cudaSetDevice(device_));
    NCCL_CHECK(ncclCommUserRank(comm_, &rank_));
    NCCL_CHECK(ncclCommCount(comm_, &size_));
    MG_ASSERT(int(global_ranks_.size()) == size_, "{} world ranks for a group of {}", global_ranks_.size(), size_);
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  ~NcclCommunicator() override {
    cudaSetDevice(device_);
    cudaStreamSynchronize(stream_);
    Watchdog::instance().forget_owner(this);
    ncclCommDestroy(comm_);
    cudaStreamDestroy(stream_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "nccl"; }
  const std::string& name() const override { return name_; }
  const std::vector<int>& global_ranks() const override { return global_ranks_; }
  void set_timeout(std::chrono::milliseconds t) override { timeout_ = t; }
  std::chrono::milliseconds timeout() const override { return timeout_; }

  std::unique_ptr<CommWork> all_reduce(Context& ctx, Tensor& t, ReduceOp op) override {
    check_device(*this, "all_reduce", t, true);
    check_reducible(*this, "all_reduce", t.dtype());
    return enqueue(ctx, "all_reduce", {t}, [&](cudaStream_t s) {
      NCCL_CHECK(ncclAllReduce(t.raw_data(), t.raw_data(), size_t(t.numel()), reduce_type(t.dtype()), nccl_op(op),
                               comm_, s));
    });
  }

  std::unique_ptr<CommWork> reduce_scatter(Context& ctx, const Tensor& input, Tensor& output, ReduceOp op) override {
    check_device(*this, "reduce_scatter", input, true);
    check_device(*this, "reduce_scatter", output, true);
    check_reduce_scatter(*this, input, output);
    check_reducible(*this, "reduce_scatter", input.dtype());
    // NCCL's in-place form is ours: output = this rank's block of input.
    return enqueue(ctx, "reduce_scatter", {input, output}, [&](cudaStream_t s) {
      NCCL_CHECK(ncclReduceScatter(input.raw_data(), output.raw_data(), size_t(output.numel()),
                                   reduce_type(input.dtype()), nccl_op(op), comm_, s));
    });
  }

  std::unique_ptr<CommWork> all_gather(Context& ctx, const Tensor& input, Tensor& output) override {
    check_device(*this, "all_gather", input, true);
    check_device(*this, "all_gather", output, true);
    check_all_gather(*this, input, output);
    return enqueue(ctx, "all_gather", {input, output}, [&](cudaStream_t s) {
      NCCL_CHECK(ncclAllGather(input.raw_data(), output.raw_data(), input.nbytes(), ncclUint8, comm_, s));
    });
  }

  std::unique_ptr<CommWork> broadcast(Context& ctx, Tensor& t, int root) override {
    check_device(*this, "broadcast", t, true);
    check_root(*this, "broadcast", root);
    return enqueue(ctx, "broadcast", {t}, [&](cudaStream_t s) {
      NCCL_CHECK(ncclBroadcast(t.raw_data(), t.raw_data(), t.nbytes(), ncclUint8, root, comm_, s));
    });
  }

  std::unique_ptr<CommWork> all_to_all(Context& ctx, const Tensor& input, Tensor& output) override {
    check_device(*this, "all_to_all", input, true);
    check_device(*this, "all_to_all", output, true);
    check_all_to_all(*this, input, output);
    MG_CHECK(input.storage() != output.storage(),
             "all_to_all on {}: the NCCL backend needs separate input and output tensors", describe_group(*this));
    size_t block = input.nbytes() / size_t(size_);
    return enqueue(ctx, "all_to_all", {input, output}, [&](cudaStream_t s) {
      NCCL_CHECK(ncclGroupStart());
      for (int j = 0; j < size_; ++j) {
        NCCL_CHECK(ncclSend(static_cast<const char*>(input.raw_data()) + j * block, block, ncclUint8, j, comm_, s));
        NCCL_CHECK(ncclRecv(static_cast<char*>(output.raw_data()) + j * block, block, ncclUint8, j, comm_, s));
      }
      NCCL_CHECK(ncclGroupEnd());
    });
  }

  std::unique_ptr<CommWork> all_to_all_v(Context& ctx, const Tensor& input, const std::vector<int64_t>& input_splits,
                                         Tensor& output, const std::vector<int64_t>& output_splits) override {
    check_device(*this, "all_to_all_v", input, true);
    check_device(*this, "all_to_all_v", output, true);
    check_all_to_all_v(*this, input, input_splits, output, output_splits);
    const size_t row = size_t(row_numel(input)) * size_of(input.dtype());
    const std::vector<int64_t> send_at = split_offsets(input_splits), recv_at = split_offsets(output_splits);
    // Empty parts are skipped on both sides (they match: rank j's output_splits[i] is rank i's
    // input_splits[j]), as torch's NCCL all_to_all_single does.
    return enqueue(ctx, "all_to_all_v", {input, output}, [&](cudaStream_t s) {
      NCCL_CHECK(ncclGroupStart());
      for (int j = 0; j < size_; ++j) {
        const size_t sends = size_t(input_splits[size_t(j)]) * row, recvs = size_t(output_splits[size_t(j)]) * row;
        if (sends > 0) {
          NCCL_CHECK(ncclSend(static_cast<const char*>(input.raw_data()) + size_t(send_at[size_t(j)]) * row, sends,
                              ncclUint8, j, comm_, s));
        }
        if (recvs > 0) {
          NCCL_CHECK(ncclRecv(static_cast<char*>(output.raw_data()) + size_t(recv_at[size_t(j)]) * row, recvs,
                              ncclUint8, j, comm_, s));
        }
      }
      NCCL_CHECK(ncclGroupEnd());
    });
  }

  std::unique_ptr<CommWork> batch_isend_irecv(Context& ctx, const std::vector<P2POp>& ops) override {
    check_p2p(*this, ops, true);
    std::vector<Tensor> keep;
    for (const P2POp& p : ops) keep.push_back(p.tensor);
    return enqueue(ctx, "batch_isend_irecv", std::move(keep), [&](cudaStream_t s) {
      NCCL_CHECK(ncclGroupStart());
      for (const P2POp& p : ops) {
        if (p.kind == P2POp::Send) {
          NCCL_CHECK(ncclSend(p.tensor.raw_data(), p.tensor.nbytes(), ncclUint8, p.peer, comm_, s));
        } else {
          NCCL_CHECK(ncclRecv(p.tensor.raw_data(), p.tensor.nbytes(), ncclUint8, p.peer, comm_, s));
        }
      }
      NCCL_CHECK(ncclGroupEnd());
    });
  }

  void barrier(Context& ctx) override {
    Tensor one = Tensor::zeros({1}, DType::Int32, Device::cuda(device_));
    all_reduce(ctx, one, ReduceOp::Sum)->wait();
    host_wait("barrier", (cudaStream_t)ctx.stream());
  }

  std::unique_ptr<Communicator> split(int color, int key, const std::string& name) override {
    // Every rank's (color, key, world rank) through an all-gather the host waits for with the
    // deadline (so a missing rank is the timeout error, not a hang in ncclCommSplit); the new
    // group's world ranks follow from them as in ncclCommSplit (by key, then by rank).
    Context ctx(Device::cuda(device_));
    Tensor mine = Tensor::from_ints({color, key, global_ranks_[size_t(rank_)]}, {3}, DType::Int32,
                                    Device::cuda(device_));
    Tensor all = Tensor::empty({int64_t(size_) * 3}, DType::Int32, Device::cuda(device_));
    all_gather(ctx, mine, all)->wait();
    host_wait("split", (cudaStream_t)ctx.stream());
    std::vector<int64_t> v = all.to_ints();
    ncclComm_t comm = nullptr;
    NCCL_CHECK(ncclCommSplit(comm_, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &comm, nullptr));
    if (color < 0) return nullptr;
    std::vector<int> members;
    for (int r = 0; r < size_; ++r) {
      if (v[3 * r] == color) members.push_back(r);
    }
    std::stable_sort(members.begin(), members.end(), [&](int a, int b) { return v[3 * a + 1] < v[3 * b + 1]; });
    std::vector<int> world;
    for (int r : members) world.push_back(int(v[3 * r + 2]));
    return std::make_unique<NcclCommunicator>(comm, device_, name, std::move(world), timeout_);
  }

 private:
  template <typename Issue>
  std::unique_ptr<CommWork> enqueue(Context& ctx, const char* op, std::vector<Tensor> keep, Issue&& issue) {
    CUDA_CHECK(cudaSetDevice(device_));
    auto waiter = static_cast<cudaStream_t>(ctx.stream());
    cudaEvent_t ready = new_event();
    CUDA_CHECK(cudaEventRecord(ready, waiter));
    CUDA_CHECK(cudaStreamWaitEvent(stream_, ready, 0));
    CUDA_CHECK(cudaEventDestroy(ready));
    issue(stream_);
    cudaEvent_t done = new_event();
    CUDA_CHECK(cudaEventRecord(done, stream_));
    watch(op, stream_);
    return std::make_unique<NcclWork>(comm_, device_, waiter, done, std::move(keep));
  }

  // Note [NCCL watchdog]: every operation's completion is also watched by the process's Watchdog
  // (watchdog.h): the host does not block on NCCL, so a collective that a dead or stuck rank never
  // joins would otherwise hang the next synchronisation forever. Past the group's timeout the
  // watchdog reports the operation and group, aborts the communicator and ends the job.
  void watch(const char* op, cudaStream_t stream) {
    if (timeout_.count() <= 0) return;
    cudaEvent_t ev = new_event();
    CUDA_CHECK(cudaEventRecord(ev, stream));
    Watchdog::Entry e;
    const int device = device_;
    e.done = [ev, device] {
      cudaSetDevice(device);
      return cudaEventQuery(ev) != cudaErrorNotReady;
    };
    e.release = [ev] { cudaEventDestroy(ev); };
    e.deadline = std::chrono::steady_clock::now() + timeout_;
    e.timeout = timeout_;
    e.what = fmt::format("{} on {}", op, describe_group(*this));
    e.owner = this;
    ncclComm_t comm = comm_;
    e.abort = [comm] { ncclCommAbort(comm); };
    Watchdog::instance().watch(std::move(e));
  }

  // Blocks the host until `stream` has drained, up to the timeout, watching for NCCL errors.
  void host_wait(const char* op, cudaStream_t stream) {
    cudaEvent_t done = new_event();
    CUDA_CHECK(cudaEventRecord(done, stream));
    cudaError_t state = cudaErrorNotReady;
    bool ok = poll_until(std::chrono::steady_clock::now() + timeout_, [&] {
      state = cudaEventQuery(done);
      ncclResult_t async = ncclSuccess;
      NCCL_CHECK(ncclCommGetAsyncError(comm_, &async));
      NCCL_CHECK(async);
      return state != cudaErrorNotReady;
    });
    if (!ok) {
      // The stream cannot drain: abort the communicator so the process can exit.
      ncclCommAbort(comm_);
      throw_timeout(op, *this, timeout_);
    }
    CUDA_CHECK(state);
    CUDA_CHECK(cudaEventDestroy(done));
  }

  ncclComm_t comm_;
  int device_;
  std::string name_;
  std::vector<int> global_ranks_;
  int rank_ = 0, size_ = 1;
  cudaStream_t stream_ = nullptr;
  std::chrono::milliseconds timeout_;
};

}  // namespace

namespace comm_detail {

std::vector<char> nccl_unique_id() {
  ncclUniqueId id;
  NCCL_CHECK(ncclGetUniqueId(&id));
  return std::vector<char>(id.internal, id.internal + sizeof id.internal);
}

std::unique_ptr<Communicator> make_nccl_world(int rank, int size, Device device, const std::vector<char>& unique_id,
                                              std::chrono::milliseconds timeout) {
  MG_ASSERT(unique_id.size() == sizeof(ncclUniqueId), "NCCL unique id of {} bytes", unique_id.size());
  ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data(), sizeof id.internal);
  CUDA_CHECK(cudaSetDevice(device.index));
  ncclComm_t comm = nullptr;
  NCCL_CHECK(ncclCommInitRank(&comm, size, id, rank));
  std::vector<int> ranks(size);
  for (int r = 0; r < size; ++r) ranks[r] = r;
  return std::make_unique<NcclCommunicator>(comm, device.index, "world", std::move(ranks), timeout);
}

}  // namespace comm_detail

}  // namespace megatron

#endif  // MEGATRON_WITH_CUDA
