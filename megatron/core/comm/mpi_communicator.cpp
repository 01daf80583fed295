// The MPI backend: host tensors, one MPI communicator per group, every operation a nonblocking MPI
// call (MPI_I*) whose wait() polls MPI_Test until the group's timeout.
//
// MPI is initialised lazily (make_mpi_world, from init_world) with MPI_THREAD_MULTIPLE, so groups
// may be used from several threads, and finalised at exit. Errors return (MPI_ERRORS_RETURN) and
// are thrown. After a timeout MPI_Finalize is skipped at exit: it synchronises with the stuck rank,
// while a process that exits without it makes mpirun end the whole job.
//
// Reductions: fp32, int32 and int64 with MPI's own operations; bf16/fp16 are staged through fp32
// (summed in fp32, rounded once, like the local backend). Results are identical on every rank (MPI
// reduces each element once or symmetrically) and from run to run for the same sizes, but the
// order of the additions is MPI's, not rank order.
#include <mpi.h>

#include <cstdio>

#include <atomic>
#include <climits>
#include <cstdlib>
#include <cstring>

#include <fmt/format.h>

#include "megatron/core/comm/comm_detail.h"

#define MPI_CHECK(stmt)                                                                   \
  do {                                                                                    \
    int mg_err_ = (stmt);                                                                 \
    if (mg_err_ != MPI_SUCCESS) [[unlikely]] {                                            \
      char mg_msg_[MPI_MAX_ERROR_STRING];                                                 \
      int mg_len_ = 0;                                                                    \
      MPI_Error_string(mg_err_, mg_msg_, &mg_len_);                                       \
      ::megatron::mg_library_failure("MPI", #stmt, __FILE__, __LINE__, std::string(mg_msg_, mg_len_), -1); \
    }                                                                                     \
  } while (0)

namespace megatron {
namespace {

using namespace comm_detail;

std::atomic<bool> g_timed_out{false};

bool mpi_live() {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  return init && !fin;
}

void finalize_at_exit() {
  if (mpi_live() && !g_timed_out) MPI_Finalize();
}

}  // namespace

void abort_job(int exit_code) {
  std::fflush(stdout);
  std::fflush(stderr);
  if (mpi_live()) MPI_Abort(MPI_COMM_WORLD, exit_code);
}

namespace {

MPI_Datatype element_type(DType t) {
  switch (t) {
    case DType::Float32: return MPI_FLOAT;
    case DType::Int32: return MPI_INT32_T;
    case DType::Int64: return MPI_INT64_T;
    case DType::BFloat16:
    case DType::Float16:
    case DType::UInt16: return MPI_UINT16_T;
    case DType::Float8E4M3:
    case DType::Float8E5M2:
    case DType::UInt8: return MPI_UINT8_T;
  }
  MG_ASSERT(false, "bad dtype {}", int(t));
}

MPI_Op mpi_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return MPI_SUM;
    case ReduceOp::Max: return MPI_MAX;
    case ReduceOp::Min: return MPI_MIN;
  }
  MG_ASSERT(false, "bad reduce op");
}

bool is_16bit_float(DType t) { return t == DType::BFloat16 || t == DType::Float16; }

class MpiCommunicator;

class MpiWork : public CommWork {
 public:
  MpiWork(const MpiCommunicator& comm, std::string op) : comm_(comm), op_(std::move(op)) {}
  ~MpiWork() override {
    // Nonblocking collectives cannot be freed unfinished; a dropped work still completes.
    if (!done_ && mpi_live()) {
      try {
        wait();
      } catch (...) {
      }
    }
  }
  void wait() override;

  std::vector<MPI_Request> requests;
  std::vector<Tensor> keep;      // buffers MPI uses until completion
  std::vector<int> counts;       // count and displacement arrays MPI reads until completion
  std::function<void()> finish;  // unstaging after completion

 private:
  const MpiCommunicator& comm_;
  std::string op_;
  bool done_ = false;
};

class MpiCommunicator : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, std::string name, std::chrono::milliseconds timeout)
      : comm_(comm), name_(std::move(name)), timeout_(timeout) {
    MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
    MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
    MPI_CHECK(MPI_Comm_size(comm_, &size_));
    MPI_Group group, world;
    MPI_CHECK(MPI_Comm_group(comm_, &group));
    MPI_CHECK(MPI_Comm_group(MPI_COMM_WORLD, &world));
    std::vector<int> mine(size_);
    for (int r = 0; r < size_; ++r) mine[r] = r;
    global_ranks_.resize(size_);
    MPI_CHECK(MPI_Group_translate_ranks(group, size_, mine.data(), world, global_ranks_.data()));
    MPI_Group_free(&group);
    MPI_Group_free(&world);
  }
  ~MpiCommunicator() override {
    if (mpi_live()) MPI_Comm_free(&comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "mpi"; }
  const std::string& name() const override { return name_; }
  const std::vector<int>& global_ranks() const override { return global_ranks_; }
  void set_timeout(std::chrono::milliseconds t) override { timeout_ = t; }
  std::chrono::milliseconds timeout() const override { return timeout_; }

  std::unique_ptr<CommWork> all_reduce(Context&, Tensor& tensor, ReduceOp op) override {
    check_device(*this, "all_reduce", tensor, false);
    check_reducible(*this, "all_reduce", tensor.dtype());
    auto work = std::make_unique<MpiWork>(*this, "all_reduce");
    Tensor buf = staged(tensor);
    work->requests.resize(1);
    MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, buf.raw_data(), count(buf), element_type(buf.dtype()), mpi_op(op), comm_,
                             &work->requests[0]));
    if (buf.raw_data() != tensor.raw_data()) work->finish = [buf, tensor]() mutable { tensor.copy_from(buf); };
    work->keep = {tensor, buf};
    return work;
  }

  std::unique_ptr<CommWork> reduce_scatter(Context&, const Tensor& input, Tensor& output, ReduceOp op) override {
    check_device(*this, "reduce_scatter", input, false);
    check_device(*this, "reduce_scatter", output, false);
    check_reduce_scatter(*this, input, output);
    check_reducible(*this, "reduce_scatter", input.dtype());
    auto work = std::make_unique<MpiWork>(*this, "reduce_scatter");
    // In place, MPI would leave the result at the front of the buffer, so the result goes to a
    // separate buffer (fp32 for 16-bit floats) and is copied into `output` on completion.
    Tensor in = staged(input);
    bool direct = in.raw_data() == input.raw_data() && !is_block_of(output, input, rank_);
    Tensor out = direct ? output : Tensor::empty(output.shape(), in.dtype());
    work->requests.resize(1);
    MPI_CHECK(MPI_Ireduce_scatter_block(in.raw_data(), out.raw_data(), count(out), element_type(in.dtype()), mpi_op(op),
                                        comm_, &work->requests[0]));
    if (!direct) work->finish = [out, output]() mutable { output.copy_from(out); };
    work->keep = {input, output, in, out};
    return work;
  }

  std::unique_ptr<CommWork> all_gather(Context&, const Tensor& input, Tensor& output) override {
    check_device(*this, "all_gather", input, false);
    check_device(*this, "all_gather", output, false);
    check_all_gather(*this, input, output);
    auto work = std::make_unique<MpiWork>(*this, "all_gather");
    bool in_place = is_block_of(input, output, rank_);  // MPI_IN_PLACE has the same meaning
    MPI_Datatype type = element_type(input.dtype());
    work->requests.resize(1);
    MPI_CHECK(MPI_Iallgather(in_place ? MPI_IN_PLACE : input.raw_data(), count(input), type, output.raw_data(),
                             count(input), type, comm_, &work->requests[0]));
    work->keep = {input, output};
    return work;
  }

  std::unique_ptr<CommWork> broadcast(Context&, Tensor& tensor, int root) override {
    check_device(*this, "broadcast", tensor, false);
    check_root(*this, "broadcast", root);
    auto work = std::make_unique<MpiWork>(*this, "broadcast");
    work->requests.resize(1);
    MPI_CHECK(MPI_Ibcast(tensor.raw_data(), count(tensor), element_type(tensor.dtype()), root, comm_,
                         &work->requests[0]));
    work->keep = {tensor};
    return work;
  }

  std::unique_ptr<CommWork> all_to_all(Context&, const Tensor& input, Tensor& output) override {
    check_device(*this, "all_to_all", input, false);
    check_device(*this, "all_to_all", output, false);
    check_all_to_all(*this, input, output);
    auto work = std::make_unique<MpiWork>(*this, "all_to_all");
    // libnbc's ialltoall has no in-place form: an aliased input is copied first.
    Tensor in = input.storage() == output.storage() ? input.clone() : input;
    MPI_Datatype type = element_type(input.dtype());
    int block = count(input) / size_;
    work->requests.resize(1);
    MPI_CHECK(MPI_Ialltoall(in.raw_data(), block, type, output.raw_data(), block, type, comm_, &work->requests[0]));
    work->keep = {in, output};
    return work;
  }

  std::unique_ptr<CommWork> all_to_all_v(Context&, const Tensor& input, const std::vector<int64_t>& input_splits,
                                         Tensor& output, const std::vector<int64_t>& output_splits) override {
    check_device(*this, "all_to_all_v", input, false);
    check_device(*this, "all_to_all_v", output, false);
    check_all_to_all_v(*this, input, input_splits, output, output_splits);
    // Counts and displacements are in rows of a one-row byte type, so MPI's int counts bound the
    // rows (and the bytes of one row), not the elements.
    const int64_t row_bytes = row_numel(input) * int64_t(size_of(input.dtype()));
    if (row_bytes == 0) return std::make_unique<DoneWork>();  // every rank's rows are empty
    MG_CHECK(row_bytes <= INT_MAX && input.size(0) <= INT_MAX && output.size(0) <= INT_MAX,
             "all_to_all_v on {}: input {} or output {} exceeds MPI's int counts ({} rows of at most {} bytes): "
             "use smaller buffers",
             describe_group(*this), input.str(), output.str(), INT_MAX, INT_MAX);
    auto work = std::make_unique<MpiWork>(*this, "all_to_all_v");
    const size_t n = size_t(size_);
    const std::vector<int64_t> send_at = split_offsets(input_splits), recv_at = split_offsets(output_splits);
    work->counts.resize(4 * n);
    for (size_t i = 0; i < n; ++i) {
      work->counts[i] = int(input_splits[i]);
      work->counts[n + i] = int(send_at[i]);
      work->counts[2 * n + i] = int(output_splits[i]);
      work->counts[3 * n + i] = int(recv_at[i]);
    }
    MPI_Datatype row;
    MPI_CHECK(MPI_Type_contiguous(int(row_bytes), MPI_BYTE, &row));
    MPI_CHECK(MPI_Type_commit(&row));
    const int* c = work->counts.data();
    work->requests.resize(1);
    MPI_CHECK(MPI_Ialltoallv(input.raw_data(), c, c + n, row, output.raw_data(), c + 2 * n, c + 3 * n, row, comm_,
                             &work->requests[0]));
    work->finish = [row]() mutable { MPI_Type_free(&row); };
    work->keep = {input, output};
    return work;
  }

  std::unique_ptr<CommWork> batch_isend_irecv(Context&, const std::vector<P2POp>& ops) override {
    check_p2p(*this, ops, false);
    auto work = std::make_unique<MpiWork>(*this, "batch_isend_irecv");
    work->requests.resize(ops.size());
    for (size_t i = 0; i < ops.size(); ++i) {
      const P2POp& p = ops[i];
      MPI_Datatype type = element_type(p.tensor.dtype());
      if (p.kind == P2POp::Send) {
        MPI_CHECK(MPI_Isend(p.tensor.raw_data(), count(p.tensor), type, p.peer, kP2PTag, comm_, &work->requests[i]));
      } else {
        MPI_CHECK(MPI_Irecv(p.tensor.raw_data(), count(p.tensor), type, p.peer, kP2PTag, comm_, &work->requests[i]));
      }
      work->keep.push_back(p.tensor);
    }
    return work;
  }

  void barrier(Context&) override { timed_barrier("barrier"); }

  std::unique_ptr<Communicator> split(int color, int key, const std::string& name) override {
    // MPI_Comm_split blocks without a deadline: a barrier first turns a missing rank into the
    // timeout error.
    timed_barrier("split");
    MPI_Comm comm;
    MPI_CHECK(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &comm));
    if (comm == MPI_COMM_NULL) return nullptr;
    return std::make_unique<MpiCommunicator>(comm, name, timeout_);
  }

 private:
  static constexpr int kP2PTag = 7;

  int count(const Tensor& t) const {
    MG_CHECK(t.numel() <= INT_MAX, "{} elements exceed MPI's count limit on {}: use smaller buffers (buckets)",
             t.numel(), describe_group(*this));
    return int(t.numel());
  }

  // bf16/fp16 values as fp32 (a copy); other tensors themselves.
  static Tensor staged(const Tensor& t) { return is_16bit_float(t.dtype()) ? t.to(DType::Float32) : t; }

  void timed_barrier(const char* op) {
    MpiWork work(*this, op);
    work.requests.resize(1);
    MPI_CHECK(MPI_Ibarrier(comm_, &work.requests[0]));
    work.wait();
  }

  MPI_Comm comm_;
  std::string name_;
  std::vector<int> global_ranks_;
  int rank_ = 0, size_ = 1;
  std::chrono::milliseconds timeout_;
};

void MpiWork::wait() {
  if (done_) return;
  auto deadline = std::chrono::steady_clock::now() + comm_.timeout();
  bool ok = poll_until(deadline, [&] {
    int flag = 0;
    int err = MPI_Testall(int(requests.size()), requests.data(), &flag, MPI_STATUSES_IGNORE);
    if (err != MPI_SUCCESS) {
      done_ = true;  // the requests are released
      MPI_CHECK(err);
    }
    return flag != 0;
  });
  if (!ok) {
    g_timed_out = true;
    done_ = true;  // the requests are abandoned with the group
    throw_timeout(op_, comm_, comm_.timeout());
  }
  done_ = true;
  if (finish) finish();
  keep.clear();
}

}  // namespace

namespace comm_detail {

std::unique_ptr<Communicator> make_mpi_world(std::chrono::milliseconds timeout) {
  int init = 0;
  MPI_CHECK(MPI_Initialized(&init));
  if (!init) {
    int provided = 0;
    MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided));
    std::atexit(finalize_at_exit);
    MG_CHECK(provided >= MPI_THREAD_MULTIPLE,
             "the MPI library provides thread level {} but megatron.cpp needs MPI_THREAD_MULTIPLE ({}): use an MPI "
             "built with thread support (OpenMPI 4 has it)",
             provided, int(MPI_THREAD_MULTIPLE));
  }
  MPI_Comm world;
  MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &world));
  return std::make_unique<MpiCommunicator>(world, "world", timeout);
}

}  // namespace comm_detail

}  // namespace megatron
