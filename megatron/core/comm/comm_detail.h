// What the communicator backends share (internal to megatron/core/comm): argument checks with the
// same one-line messages on every backend, the timeout error, and the rank-order reduction.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "megatron/core/comm/communicator.h"

namespace megatron::comm_detail {

/// "the data-parallel group (world ranks 0, 1)".
std::string describe_group(const Communicator& group);
/// "10 minutes", "3 seconds", "250 ms".
std::string format_duration(std::chrono::milliseconds d);
/// The timeout error of every backend: "<op> on <group> did not complete within <t>
/// (--distributed-timeout-minutes): a rank of the group is dead or stuck<detail>".
[[noreturn]] void throw_timeout(const std::string& op, const Communicator& group, std::chrono::milliseconds timeout,
                                const std::string& detail = {});
/// A completed operation (the blocking backends finish some operations before returning).
class DoneWork : public CommWork {
 public:
  void wait() override {}
};

// Argument checks (each a one-line megatron::Error naming the operation and the group).
void check_device(const Communicator& g, const char* op, const Tensor& t, bool want_cuda);
void check_reduce_scatter(const Communicator& g, const Tensor& input, const Tensor& output);
void check_all_gather(const Communicator& g, const Tensor& input, const Tensor& output);
void check_all_to_all(const Communicator& g, const Tensor& input, const Tensor& output);
/// all_to_all_v's arguments (communicator.h): splits of size() non-negative row counts summing to
/// dim 0 of their tensor, the same dtype and trailing shape, input and output not overlapping.
void check_all_to_all_v(const Communicator& g, const Tensor& input, const std::vector<int64_t>& input_splits,
                        const Tensor& output, const std::vector<int64_t>& output_splits);
/// Elements per row of dim 0 (the product of the trailing dims; 1 for a 1-D tensor).
int64_t row_numel(const Tensor& t);
/// Exclusive prefix sums of `splits`: the first row of each rank's part.
std::vector<int64_t> split_offsets(const std::vector<int64_t>& splits);
void check_root(const Communicator& g, const char* op, int root);
void check_p2p(const Communicator& g, const std::vector<P2POp>& ops, bool want_cuda);
/// Whether `part` is exactly block `index` (of part.numel() elements) of `whole`.
bool is_block_of(const Tensor& part, const Tensor& whole, int index);
/// The reductions we support: fp32, bf16, fp16, int32, int64 (16-bit floats accumulate in fp32).
void check_reducible(const Communicator& g, const char* op, DType dtype);

/// dst[i] = srcs[0][i] op srcs[1][i] op ... in that order (rank order), all of `dtype`; bf16/fp16
/// accumulate in fp32 and round once. dst may alias srcs[0] only.
void reduce_in_order(DType dtype, ReduceOp op, void* dst, const std::vector<const void*>& srcs, size_t n);

/// Polls `done` until it returns true (yielding, then sleeping up to 1 ms between polls); false
/// when `deadline` passes first.
bool poll_until(std::chrono::steady_clock::time_point deadline, const std::function<bool()>& done);

// ---- backends' constructors (launch.cpp builds the world from them) ----
/// MPI's world (initialises MPI with MPI_THREAD_MULTIPLE on first use; MPI_Finalize at exit).
std::unique_ptr<Communicator> make_mpi_world(std::chrono::milliseconds timeout);
#ifdef MEGATRON_WITH_CUDA
/// The NCCL world on `device`: `unique_id` (ncclUniqueId's bytes) is the same on every rank.
std::unique_ptr<Communicator> make_nccl_world(int rank, int size, Device device, const std::vector<char>& unique_id,
                                              std::chrono::milliseconds timeout);
/// sizeof(ncclUniqueId) (NCCL_UNIQUE_ID_BYTES; checked in nccl_communicator.cpp).
constexpr size_t kNcclUniqueIdBytes = 128;
/// A fresh ncclUniqueId's bytes (rank 0 creates it; the others receive it).
std::vector<char> nccl_unique_id();
#endif

}  // namespace megatron::comm_detail
