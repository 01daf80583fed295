// A minimal TCP rendezvous for torchrun-style launches (MASTER_ADDR/MASTER_PORT): rank 0 listens,
// the others connect (retrying until the deadline, as they may start first), every rank reports
// its rank and world size, and rank 0 answers each with one blob (the NCCL unique id) — or with
// one error message that every rank throws, e.g. when the ranks disagree on the world size.
#pragma once

#include <chrono>
#include <string>
#include <vector>

namespace megatron {

/// Returns rank 0's `blob` on every rank (other ranks' `blob` is ignored). Throws megatron::Error
/// when the rendezvous does not complete within `timeout`, or the ranks' world sizes or ranks do
/// not fit together.
std::vector<char> tcp_rendezvous(const std::string& master_addr, int master_port, int rank, int world_size,
                                 const std::vector<char>& blob, std::chrono::milliseconds timeout);

}  // namespace megatron
