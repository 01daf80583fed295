// Communicator: the collectives and point-to-point operations of one process group, behind one
// interface with three backends:
//   MPI    (mpi_communicator.cpp)   CPU tensors; launched by mpirun/srun.
//   NCCL   (nccl_communicator.cpp)  CUDA tensors, on streams; bootstrapped through MPI or a TCP
//                                   rendezvous at MASTER_ADDR:MASTER_PORT (torchrun-style launch).
//   local  (local_communicator.cpp) a group of threads in one process (tests) and the world of a
//                                   single process.
//
// Conventions (every backend):
//   - Every rank of the group calls the same operations in the same order with tensors of the same
//     shape and dtype (Megatron's torch.distributed semantics). Tensors live on the backend's device.
//   - Ranks are ranks *within this group*; global_ranks() maps them to world ranks (for messages).
//   - Every operation has an asynchronous form returning a CommWork; the blocking form is
//     `op(...)->wait()`. On NCCL an operation is enqueued on the communicator's own stream after the
//     context's stream has reached it, and wait() makes the context's stream wait for it (the host
//     does not block); on MPI/local wait() blocks the host until it is complete.
//   - A wait that exceeds the group's timeout (--distributed-timeout-minutes) throws
//     megatron::Error naming the operation, the group and its ranks — never a silent hang.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "megatron/runtime/context.h"
#include "megatron/runtime/tensor.h"

namespace megatron {

enum class ReduceOp { Sum, Max, Min };

/// An operation in flight.
class CommWork {
 public:
  virtual ~CommWork() = default;
  /// Completes the operation (see the conventions above). Idempotent.
  virtual void wait() = 0;
};

/// One half of a grouped send/recv (Megatron's batch_isend_irecv). `peer` is a rank of this group.
struct P2POp {
  enum Kind { Send, Recv } kind;
  Tensor tensor;
  int peer;
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  /// "mpi", "nccl" or "local".
  virtual std::string backend() const = 0;
  /// The group's name for messages, e.g. "tensor-parallel" ("world" for the world group).
  virtual const std::string& name() const = 0;
  /// World ranks of this group's members, in group-rank order.
  virtual const std::vector<int>& global_ranks() const = 0;

  /// In place: every rank ends with the reduction of all ranks' `tensor`.
  virtual std::unique_ptr<CommWork> all_reduce(Context& ctx, Tensor& tensor, ReduceOp op = ReduceOp::Sum) = 0;
  /// input.numel() == size() * output.numel(); rank r receives the reduction of every rank's
  /// input[r·n, (r+1)·n). `output` may be exactly that slice of `input` (in place).
  virtual std::unique_ptr<CommWork> reduce_scatter(Context& ctx, const Tensor& input, Tensor& output,
                                                   ReduceOp op = ReduceOp::Sum) = 0;
  /// output.numel() == size() * input.numel(); output[r·n, (r+1)·n) = rank r's input. `input` may
  /// be exactly this rank's slice of `output` (in place).
  virtual std::unique_ptr<CommWork> all_gather(Context& ctx, const Tensor& input, Tensor& output) = 0;
  /// In place: every rank ends with `root`'s tensor.
  virtual std::unique_ptr<CommWork> broadcast(Context& ctx, Tensor& tensor, int root) = 0;
  /// input and output hold size() equal blocks; block j of rank i's input becomes block i of rank
  /// j's output.
  virtual std::unique_ptr<CommWork> all_to_all(Context& ctx, const Tensor& input, Tensor& output) = 0;
  /// Uneven all-to-all along dim 0 (torch's all_to_all_single with split sizes, as Megatron's MoE
  /// token dispatcher calls it). A row is one index of dim 0 (the product of the trailing dims).
  /// This rank sends rows [sum(input_splits[0, j)), +input_splits[j]) of `input` to rank j, and
  /// receives output_splits[i] rows from rank i into `output`, in rank order. Both split lists
  /// have size() entries, non-negative (zero allowed), summing to dim 0 of their tensor; input
  /// and output have the same dtype and trailing shape and do not overlap; input_splits[j] here
  /// must equal output_splits[this rank] on rank j.
  virtual std::unique_ptr<CommWork> all_to_all_v(Context& ctx, const Tensor& input,
                                                 const std::vector<int64_t>& input_splits, Tensor& output,
                                                 const std::vector<int64_t>& output_splits) = 0;
  /// Sends and receives as one group (no ordering deadlock between them).
  virtual std::unique_ptr<CommWork> batch_isend_irecv(Context& ctx, const std::vector<P2POp>& ops) = 0;
  /// Returns when every rank has reached it (host-side on every backend).
  virtual void barrier(Context& ctx) = 0;

  /// Collective over this group: ranks passing the same color form a new group, ordered by key
  /// (then by rank). color < 0: this rank joins no group and gets nullptr.
  virtual std::unique_ptr<Communicator> split(int color, int key, const std::string& name) = 0;

  /// The time a wait may take before it is an error (default 10 minutes, Megatron's default).
  virtual void set_timeout(std::chrono::milliseconds timeout) = 0;
  virtual std::chrono::milliseconds timeout() const = 0;
};

// ---- launch --------------------------------------------------------------------------------------

/// How this process was started (megatron/core/comm/launch.cpp).
struct LaunchInfo {
  enum Kind { Single, Mpi, Torchrun } kind = Single;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr;  // torchrun
  int master_port = 0;      // torchrun
};

/// Reads the environment: OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK, PMI_RANK/PMI_SIZE or
/// SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID (Mpi); RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
/// MASTER_PORT (Torchrun); otherwise Single. Inconsistent values are a one-line megatron::Error.
LaunchInfo detect_launch();

/// The world group for tensors on `device`: MPI for CPU (Single: a one-rank local group); NCCL for
/// CUDA (its unique id broadcast through MPI, or through a TCP rendezvous for Torchrun; one rank
/// needs neither). Checks that every rank agrees on the world size. `timeout` applies to the
/// rendezvous and becomes the group's timeout.
std::unique_ptr<Communicator> init_world(const LaunchInfo& launch, Device device, std::chrono::milliseconds timeout);

/// The built-in one-node launcher (--nproc-per-node N): starts N copies of this program (argv
/// without --nproc-per-node) with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
/// MASTER_ADDR=127.0.0.1, a free MASTER_PORT), forwards their output, and returns the first
/// non-zero exit status (killing the others), or 0. CPU runs need MPI: the launcher then runs
/// `mpirun -np N` instead.
int launch_local_workers(int argc, char** argv, int nproc, bool cpu);

/// `values` summed over the ranks of `group`, exactly as doubles and in rank order, so every rank
/// gets the same bits (all-gathered as their bit patterns: the reductions have no fp64). Collective;
/// a one-rank group returns `values`. For the few scalars a step reports (losses, gradient norms).
std::vector<double> sum_in_rank_order(Context& ctx, Communicator& group, const std::vector<double>& values);

/// Ends every process of the job after an error on this rank (MPI_Abort under MPI), so the other
/// ranks do not wait for it until their timeout; a no-op when no MPI job is running (a single
/// process, or torchrun-style ranks, whose peers see the failure as a timeout naming the group).
void abort_job(int exit_code);

/// A group of `size` ranks that are threads of this process (tests): returns one communicator per
/// rank; each must be used from its own thread. Backend "local", CPU tensors.
std::vector<std::unique_ptr<Communicator>> make_local_group(int size, const std::string& name = "world");

}  // namespace megatron
