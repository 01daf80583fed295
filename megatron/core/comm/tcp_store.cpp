// Wire format: a rank sends {int32 rank, int32 world_size}; rank 0 answers {int32 status (0 ok, 1
// error), uint32 length, bytes} where the bytes are the blob or the error message.
#include "megatron/core/comm/tcp_store.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "megatron/core/comm/comm_detail.h"
#include "megatron/runtime/check.h"

namespace megatron {
namespace {

using Clock = std::chrono::steady_clock;

struct Fd {
  int fd = -1;
  explicit Fd(int f = -1) : fd(f) {}
  Fd(Fd&& o) noexcept : fd(o.fd) { o.fd = -1; }
  Fd& operator=(Fd&& o) noexcept {
    std::swap(fd, o.fd);
    return *this;
  }
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

int ms_left(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return int(std::max<int64_t>(0, std::min<int64_t>(left, INT32_MAX)));
}

// Whole-buffer I/O with a deadline; false on timeout or a closed peer.
bool io_all(int fd, void* data, size_t n, bool write, Clock::time_point deadline) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    pollfd pfd{fd, short(write ? POLLOUT : POLLIN), 0};
    int ready = ::poll(&pfd, 1, ms_left(deadline));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) return false;
    ssize_t k = write ? ::send(fd, p, n, MSG_NOSIGNAL) : ::recv(fd, p, n, 0);
    if (k < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (k <= 0) return false;
    p += k;
    n -= size_t(k);
  }
  return true;
}

bool send_reply(int fd, int32_t status, const std::vector<char>& bytes, Clock::time_point deadline) {
  int32_t head[2] = {status, int32_t(bytes.size())};
  return io_all(fd, head, sizeof head, true, deadline) &&
         io_all(fd, const_cast<char*>(bytes.data()), bytes.size(), true, deadline);
}

std::vector<char> serve(const std::string& where, int port, int world_size, const std::vector<char>& blob,
                        std::chrono::milliseconds timeout, Clock::time_point deadline) {
  Fd listener(::socket(AF_INET6, SOCK_STREAM, 0));
  bool v6 = listener.fd >= 0;
  if (!v6) listener = Fd(::socket(AF_INET, SOCK_STREAM, 0));
  MG_CHECK(listener.fd >= 0, "rendezvous at {}: cannot create a socket: {}", where, std::strerror(errno));
  int one = 1, zero = 0;
  ::setsockopt(listener.fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  int bound;
  if (v6) {
    ::setsockopt(listener.fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);  // IPv4 too
    sockaddr_in6 addr{};
    addr.sin6_family = AF_INET6;
    addr.sin6_addr = in6addr_any;
    addr.sin6_port = htons(uint16_t(port));
    bound = ::bind(listener.fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  } else {
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    addr.sin_port = htons(uint16_t(port));
    bound = ::bind(listener.fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  }
  MG_CHECK(bound == 0 && ::listen(listener.fd, 128) == 0,
           "rendezvous at {}: rank 0 cannot listen on port {}: {}: choose a free MASTER_PORT", where, port,
           std::strerror(errno));

  std::vector<Fd> peers;
  std::vector<int> seen(world_size, 0);
  std::string error;
  while (int(peers.size()) < world_size - 1 && error.empty()) {
    pollfd pfd{listener.fd, POLLIN, 0};
    int ready = ::poll(&pfd, 1, ms_left(deadline));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) {
      std::vector<int> missing;
      for (int r = 1; r < world_size; ++r) {
        if (!seen[r]) missing.push_back(r);
      }
      MG_CHECK(false, "rendezvous at {}: rank{} {} did not connect within {}: check that every rank was started with "
               "the same MASTER_ADDR/MASTER_PORT and WORLD_SIZE={}",
               where, missing.size() == 1 ? "" : "s", fmt::join(missing, ", "), comm_detail::format_duration(timeout),
               world_size);
    }
    Fd peer(::accept(listener.fd, nullptr, nullptr));
    if (peer.fd < 0) continue;
    int32_t hello[2];
    if (!io_all(peer.fd, hello, sizeof hello, false, deadline)) continue;  // not one of ours
    int r = hello[0], ws = hello[1];
    if (ws != world_size) {
      error = fmt::format("rendezvous at {}: rank {} was started with WORLD_SIZE={} but rank 0 with WORLD_SIZE={}: "
                          "start every rank with the same world size",
                          where, r, ws, world_size);
    } else if (r <= 0 || r >= world_size || seen[r]) {
      error = fmt::format("rendezvous at {}: two processes claim rank {} (WORLD_SIZE={}): give every process its "
                          "own RANK",
                          where, r, world_size);
    } else {
      seen[r] = 1;
    }
    peers.push_back(std::move(peer));
  }
  std::vector<char> reply = error.empty() ? blob : std::vector<char>(error.begin(), error.end());
  for (Fd& p : peers) send_reply(p.fd, error.empty() ? 0 : 1, reply, deadline);
  MG_CHECK(error.empty(), "{}", error);
  return blob;
}

std::vector<char> join(const std::string& addr, int port, const std::string& where, int rank, int world_size,
                       std::chrono::milliseconds timeout, Clock::time_point deadline) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  int rc = ::getaddrinfo(addr.c_str(), std::to_string(port).c_str(), &hints, &found);
  MG_CHECK(rc == 0, "rendezvous at {}: cannot resolve MASTER_ADDR '{}': {}", where, addr, ::gai_strerror(rc));
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> guard(found, ::freeaddrinfo);
  // Rank 0 may not be listening yet: retry until the deadline.
  while (true) {
    for (addrinfo* a = found; a; a = a->ai_next) {
      Fd s(::socket(a->ai_family, a->ai_socktype, a->ai_protocol));
      if (s.fd < 0 || ::connect(s.fd, a->ai_addr, a->ai_addrlen) != 0) continue;
      int32_t hello[2] = {rank, world_size};
      int32_t head[2];
      MG_CHECK(io_all(s.fd, hello, sizeof hello, true, deadline) && io_all(s.fd, head, sizeof head, false, deadline),
               "rendezvous at {}: rank 0 accepted rank {} but did not answer within {}: is every rank started "
               "(WORLD_SIZE={})?",
               where, rank, comm_detail::format_duration(timeout), world_size);
      std::vector<char> bytes(static_cast<uint32_t>(head[1]));
      MG_CHECK(io_all(s.fd, bytes.data(), bytes.size(), false, deadline),
               "rendezvous at {}: rank 0 closed the connection", where);
      MG_CHECK(head[0] == 0, "{}", std::string(bytes.begin(), bytes.end()));
      return bytes;
    }
    MG_CHECK(Clock::now() < deadline,
             "rendezvous at {}: rank {} could not reach rank 0 within {}: check MASTER_ADDR/MASTER_PORT and that rank "
             "0 is running",
             where, rank, comm_detail::format_duration(timeout));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

}  // namespace

std::vector<char> tcp_rendezvous(const std::string& master_addr, int master_port, int rank, int world_size,
                                 const std::vector<char>& blob, std::chrono::milliseconds timeout) {
  std::string where = fmt::format("{}:{} (MASTER_ADDR:MASTER_PORT)", master_addr, master_port);
  MG_CHECK(master_port > 0 && master_port < 65536, "rendezvous: MASTER_PORT={} is not a TCP port", master_port);
  MG_CHECK(rank >= 0 && rank < world_size, "rendezvous at {}: RANK={} is outside WORLD_SIZE={}", where, rank,
           world_size);
  auto deadline = Clock::now() + timeout;
  if (world_size == 1) return blob;
  if (rank == 0) return serve(where, master_port, world_size, blob, timeout, deadline);
  return join(master_addr, master_port, where, rank, world_size, timeout, deadline);
}

}  // namespace megatron
