// The local backend: a group of threads in one process sharing host memory (tests), and the world
// of a single-process run.
//
// A collective is two rendezvous on the group's shared state: every rank posts its buffers and
// waits for the others (1), computes its own result reading the others' buffers — reductions add
// the ranks' values in rank order, so every rank gets bitwise the same sum — into a private buffer,
// and waits until every rank has finished reading (2) before writing its output (in-place forms
// overwrite buffers the others read). Collectives therefore complete when they are called and their
// CommWork is a no-op; the group's timeout bounds each call. all_to_all_v posts its split lists
// too, so every rank checks that each pair of ranks agrees on the rows between them.
// Point-to-point sends are buffered (a copy is queued for the receiver, so a send never blocks);
// a receive is matched at post time to the next message from its peer (MPI's order) and waits for
// it in wait().
#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "megatron/core/comm/comm_detail.h"

namespace megatron {
namespace {

using Clock = std::chrono::steady_clock;
using namespace comm_detail;

struct Message {
  DType dtype;
  int64_t numel;
  std::vector<char> bytes;
};

// State shared by the ranks (threads) of one group.
struct LocalGroup {
  LocalGroup(int size, std::string name, std::vector<int> global_ranks)
      : size(size), name(std::move(name)), global_ranks(std::move(global_ranks)), posts(size), here(size, 0) {}

  struct Post {
    const char* op = nullptr;
    const void* data = nullptr;
    DType dtype = DType::Float32;
    int64_t numel = 0;
    int color = 0, key = 0;  // split
    const int64_t* send_splits = nullptr;  // all_to_all_v: rows to each rank
    const int64_t* recv_splits = nullptr;  // all_to_all_v: rows from each rank
  };

  const int size;
  const std::string name;
  const std::vector<int> global_ranks;

  std::mutex mu;
  std::condition_variable cv;
  // Rendezvous.
  std::vector<Post> posts;
  std::vector<char> here;  // who has reached the current rendezvous (for the timeout message)
  int arrived = 0;
  uint64_t generation = 0;
  // split: the new group of each color, created by the first of its ranks.
  std::map<int, std::shared_ptr<LocalGroup>> split_groups;
  // Point-to-point: per (src, dst) the messages by sequence number.
  struct Channel {
    uint64_t sent = 0, claimed = 0;
    std::map<uint64_t, Message> messages;
  };
  std::map<std::pair<int, int>, Channel> channels;
};

class LocalCommunicator;

class RecvWork : public CommWork {
 public:
  struct Recv {
    Tensor tensor;
    int peer;
    uint64_t seq;
  };
  RecvWork(const LocalCommunicator& comm, std::vector<Recv> recvs) : comm_(comm), recvs_(std::move(recvs)) {}
  void wait() override;

 private:
  const LocalCommunicator& comm_;
  std::vector<Recv> recvs_;
  bool done_ = false;
};

class LocalCommunicator : public Communicator {
 public:
  LocalCommunicator(std::shared_ptr<LocalGroup> group, int rank) : g_(std::move(group)), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return g_->size; }
  std::string backend() const override { return "local"; }
  const std::string& name() const override { return g_->name; }
  const std::vector<int>& global_ranks() const override { return g_->global_ranks; }
  void set_timeout(std::chrono::milliseconds t) override { timeout_ = t; }
  std::chrono::milliseconds timeout() const override { return timeout_; }
  LocalGroup& group() const { return *g_; }

  std::unique_ptr<CommWork> all_reduce(Context&, Tensor& tensor, ReduceOp op) override {
    check_local_device("all_reduce", tensor);
    check_reducible(*this, "all_reduce", tensor.dtype());
    if (size() == 1) return std::make_unique<DoneWork>();
    std::vector<char> result(tensor.nbytes());
    collective("all_reduce", {nullptr, tensor.raw_data(), tensor.dtype(), tensor.numel()}, [&](auto& posts) {
      reduce_in_order(tensor.dtype(), op, result.data(), sources(posts, 0), size_t(tensor.numel()));
    });
    std::memcpy(tensor.raw_data(), result.data(), result.size());
    return std::make_unique<DoneWork>();
  }

  std::unique_ptr<CommWork> reduce_scatter(Context&, const Tensor& input, Tensor& output, ReduceOp op) override {
    check_local_device("reduce_scatter", input);
    check_local_device("reduce_scatter", output);
    check_reduce_scatter(*this, input, output);
    check_reducible(*this, "reduce_scatter", input.dtype());
    if (size() == 1) return copy(input, output);
    std::vector<char> result(output.nbytes());
    collective("reduce_scatter", {nullptr, input.raw_data(), input.dtype(), input.numel()}, [&](auto& posts) {
      reduce_in_order(input.dtype(), op, result.data(), sources(posts, size_t(rank_) * output.nbytes()),
                      size_t(output.numel()));
    });
    std::memcpy(output.raw_data(), result.data(), result.size());
    return std::make_unique<DoneWork>();
  }

  std::unique_ptr<CommWork> all_gather(Context&, const Tensor& input, Tensor& output) override {
    check_local_device("all_gather", input);
    check_local_device("all_gather", output);
    check_all_gather(*this, input, output);
    if (size() == 1) return copy(input, output);
    bool in_place = is_block_of(input, output, rank_);
    // Each rank writes only its own output, which no other rank reads (in place, its own block —
    // the one others read — is not written).
    collective("all_gather", {nullptr, input.raw_data(), input.dtype(), input.numel()}, [&](auto& posts) {
      for (int k = 0; k < size(); ++k) {
        if (k == rank_ && in_place) continue;
        std::memcpy(static_cast<char*>(output.raw_data()) + size_t(k) * input.nbytes(), posts[k].data, input.nbytes());
      }
    });
    return std::make_unique<DoneWork>();
  }

  std::unique_ptr<CommWork> broadcast(Context&, Tensor& tensor, int root) override {
    check_local_device("broadcast", tensor);
    check_root(*this, "broadcast", root);
    if (size() == 1) return std::make_unique<DoneWork>();
    collective("broadcast", {nullptr, tensor.raw_data(), tensor.dtype(), tensor.numel(), root}, [&](auto& posts) {
      if (rank_ != root) std::memcpy(tensor.raw_data(), posts[root].data, tensor.nbytes());
    });
    return std::make_unique<DoneWork>();
  }

  std::unique_ptr<CommWork> all_to_all(Context&, const Tensor& input, Tensor& output) override {
    check_local_device("all_to_all", input);
    check_local_device("all_to_all", output);
    check_all_to_all(*this, input, output);
    if (size() == 1) return copy(input, output);
    size_t block = input.nbytes() / size_t(size());
    std::vector<char> result(output.nbytes());
    collective("all_to_all", {nullptr, input.raw_data(), input.dtype(), input.numel()}, [&](auto& posts) {
      for (int i = 0; i < size(); ++i) {
        std::memcpy(result.data() + size_t(i) * block, static_cast<const char*>(posts[i].data) + size_t(rank_) * block,
                    block);
      }
    });
    std::memcpy(output.raw_data(), result.data(), result.size());
    return std::make_unique<DoneWork>();
  }

  std::unique_ptr<CommWork> all_to_all_v(Context&, const Tensor& input, const std::vector<int64_t>& input_splits,
                                         Tensor& output, const std::vector<int64_t>& output_splits) override {
    check_local_device("all_to_all_v", input);
    check_local_device("all_to_all_v", output);
    check_all_to_all_v(*this, input, input_splits, output, output_splits);
    if (size() == 1) return copy(input, output);
    // The posts' numel is the row's, which every rank shares; the row counts are the splits.
    const size_t row = size_t(row_numel(input)) * size_of(input.dtype());
    LocalGroup::Post mine{nullptr, input.raw_data(), input.dtype(), row_numel(input)};
    mine.send_splits = input_splits.data();
    mine.recv_splits = output_splits.data();
    std::vector<char> result(output.nbytes());
    std::string mismatch;
    collective("all_to_all_v", mine, [&](auto& posts) {
      // Every rank checks every pair, so all of them fail alike (after the second rendezvous: the
      // posts point into the callers' split vectors).
      for (int i = 0; i < size() && mismatch.empty(); ++i) {
        for (int j = 0; j < size() && mismatch.empty(); ++j) {
          if (posts[i].send_splits[j] == posts[j].recv_splits[i]) continue;
          mismatch = fmt::format(
              "all_to_all_v on {}: group rank {}'s input_splits[{}] is {} but group rank {}'s output_splits[{}] is {}: "
              "input_splits[j] on rank i must equal output_splits[i] on rank j",
              describe_group(*this), i, j, posts[i].send_splits[j], j, i, posts[j].recv_splits[i]);
        }
      }
      if (!mismatch.empty()) return;
      size_t dst = 0;
      for (int i = 0; i < size(); ++i) {
        int64_t first = 0;  // the first row rank i sends to this rank
        for (int j = 0; j < rank_; ++j) first += posts[i].send_splits[j];
        const size_t n = size_t(output_splits[size_t(i)]) * row;
        if (n > 0) std::memcpy(result.data() + dst, static_cast<const char*>(posts[i].data) + size_t(first) * row, n);
        dst += n;
      }
    });
    MG_CHECK(mismatch.empty(), "{}", mismatch);
    if (!result.empty()) std::memcpy(output.raw_data(), result.data(), result.size());
    return std::make_unique<DoneWork>();
  }

  std::unique_ptr<CommWork> batch_isend_irecv(Context&, const std::vector<P2POp>& ops) override {
    check_p2p(*this, ops, false);
    std::vector<RecvWork::Recv> recvs;
    {
      std::lock_guard lock(g_->mu);
      for (const P2POp& p : ops) {
        if (p.kind == P2POp::Send) {
          auto& ch = g_->channels[{rank_, p.peer}];
          const char* src = static_cast<const char*>(p.tensor.raw_data());
          ch.messages[ch.sent++] = Message{p.tensor.dtype(), p.tensor.numel(), {src, src + p.tensor.nbytes()}};
        } else {
          recvs.push_back({p.tensor, p.peer, g_->channels[{p.peer, rank_}].claimed++});
        }
      }
    }
    g_->cv.notify_all();
    return std::make_unique<RecvWork>(*this, std::move(recvs));
  }

  void barrier(Context&) override {
    if (size() > 1) collective("barrier", {}, [](auto&) {});
  }

  std::unique_ptr<Communicator> split(int color, int key, const std::string& name) override {
    std::shared_ptr<LocalGroup> mine;
    int new_rank = -1;
    collective("split", {nullptr, nullptr, DType::Float32, 0, color, key}, [&](auto& posts) {
      if (color < 0) return;
      std::vector<int> members;  // group ranks of the new group's members, in new-rank order
      for (int r = 0; r < size(); ++r) {
        if (posts[r].color == color) members.push_back(r);
      }
      std::stable_sort(members.begin(), members.end(), [&](int a, int b) { return posts[a].key < posts[b].key; });
      std::vector<int> world;
      for (int r : members) world.push_back(g_->global_ranks[r]);
      new_rank = int(std::find(members.begin(), members.end(), rank_) - members.begin());
      std::lock_guard lock(g_->mu);
      auto& slot = g_->split_groups[color];
      if (!slot) slot = std::make_shared<LocalGroup>(int(members.size()), name, std::move(world));
      mine = slot;
    });
    if (rank_ == 0) {  // every rank has taken its group (rendezvous 2); none can post the next split yet
      std::lock_guard lock(g_->mu);
      g_->split_groups.clear();
    }
    if (!mine) return nullptr;
    auto comm = std::make_unique<LocalCommunicator>(std::move(mine), new_rank);
    comm->set_timeout(timeout_);
    return comm;
  }

 private:
  // A group of one rank takes tensors on any device (it moves no data between ranks: the world of a
  // single-GPU run needs no communication library); larger groups share host memory.
  void check_local_device(const char* op, const Tensor& t) const {
    if (size() > 1) {
      check_device(*this, op, t, false);
    } else {
      MG_CHECK(t.defined(), "{} on {}: the tensor is undefined", op, describe_group(*this));
    }
  }

  std::unique_ptr<CommWork> copy(const Tensor& input, Tensor& output) {
    if (input.raw_data() != output.raw_data()) output.copy_from(input);
    return std::make_unique<DoneWork>();
  }

  std::vector<const void*> sources(const std::vector<LocalGroup::Post>& posts, size_t byte_offset) const {
    std::vector<const void*> srcs;
    for (const auto& p : posts) srcs.push_back(static_cast<const char*>(p.data) + byte_offset);
    return srcs;
  }

  // Posts `mine`, waits for every rank, checks they called the same operation on the same kind of
  // tensor, runs `body` (reading the posts), and waits until every rank has finished its body.
  template <typename Body>
  void collective(const char* op, LocalGroup::Post mine, Body&& body) {
    auto deadline = Clock::now() + timeout_;
    mine.op = op;
    {
      std::lock_guard lock(g_->mu);
      g_->posts[rank_] = mine;
    }
    rendezvous(op, deadline);
    // Nobody writes the posts before rendezvous 2, so they are read without the lock.
    const auto& posts = g_->posts;
    for (int r = 0; r < size(); ++r) {
      const auto& p = posts[r];
      MG_CHECK(std::strcmp(p.op, op) == 0 && p.dtype == mine.dtype && p.numel == mine.numel,
               "collective mismatch on {}: group rank {} called {} with {}[{}] elements while group rank {} called {} "
               "with {}[{}]: every rank must call the same operations in the same order with the same tensor sizes",
               describe_group(*this), rank_, op, to_string(mine.dtype), mine.numel, r, p.op, to_string(p.dtype),
               p.numel);
      if (std::strcmp(op, "broadcast") == 0) {
        MG_CHECK(p.color == mine.color, "broadcast on {}: group rank {} passed root {} but group rank {} passed root {}",
                 describe_group(*this), rank_, mine.color, r, p.color);
      }
    }
    body(posts);
    rendezvous(op, deadline);
  }

  void rendezvous(const char* op, Clock::time_point deadline) {
    std::unique_lock lock(g_->mu);
    uint64_t gen = g_->generation;
    g_->here[rank_] = 1;
    if (++g_->arrived == size()) {
      g_->arrived = 0;
      std::fill(g_->here.begin(), g_->here.end(), 0);
      ++g_->generation;
      g_->cv.notify_all();
      return;
    }
    if (!g_->cv.wait_until(lock, deadline, [&] { return g_->generation != gen; })) {
      std::vector<int> missing;
      for (int r = 0; r < size(); ++r) {
        if (!g_->here[r]) missing.push_back(r);
      }
      throw_timeout(op, *this, timeout_, fmt::format(" (group ranks {} had not reached it)", fmt::join(missing, ", ")));
    }
  }

  std::shared_ptr<LocalGroup> g_;
  int rank_;
  std::chrono::milliseconds timeout_ = std::chrono::minutes(10);
};

void RecvWork::wait() {
  if (done_) return;
  LocalGroup& g = comm_.group();
  auto deadline = Clock::now() + comm_.timeout();
  std::unique_lock lock(g.mu);
  for (auto& r : recvs_) {
    auto& ch = g.channels[{r.peer, comm_.rank()}];
    if (!g.cv.wait_until(lock, deadline, [&] { return ch.messages.count(r.seq) > 0; })) {
      throw_timeout(fmt::format("recv from group rank {}", r.peer), comm_, comm_.timeout());
    }
    auto it = ch.messages.find(r.seq);
    Message& m = it->second;
    MG_CHECK(m.dtype == r.tensor.dtype() && m.numel == r.tensor.numel(),
             "recv on {}: group rank {} expected {}[{}] elements from group rank {}, which sent {}[{}]",
             describe_group(comm_), comm_.rank(), to_string(r.tensor.dtype()), r.tensor.numel(), r.peer,
             to_string(m.dtype), m.numel);
    std::memcpy(r.tensor.raw_data(), m.bytes.data(), m.bytes.size());
    ch.messages.erase(it);
  }
  done_ = true;
}

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_local_group(int size, const std::string& name) {
  MG_CHECK(size >= 1, "make_local_group: size must be at least 1, got {}", size);
  std::vector<int> ranks(size);
  for (int r = 0; r < size; ++r) ranks[r] = r;
  auto group = std::make_shared<LocalGroup>(size, name, ranks);
  std::vector<std::unique_ptr<Communicator>> comms;
  for (int r = 0; r < size; ++r) comms.push_back(std::make_unique<LocalCommunicator>(group, r));
  return comms;
}

}  // namespace megatron
