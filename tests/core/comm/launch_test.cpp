// The launch environment (detect_launch) and the TCP rendezvous of torchrun-style launches.
#include <gtest/gtest.h>

#include <sys/socket.h>
#include <netinet/in.h>
#include <unistd.h>

#include <cstdlib>
#include <future>

#include "megatron/core/comm/communicator.h"
#include "megatron/core/comm/tcp_store.h"

namespace megatron {
namespace {

// Sets variables for one test and restores the launch-related ones afterwards.
class LaunchEnv : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* v : kVars) {
      if (const char* old = std::getenv(v)) saved_.emplace_back(v, old);
      ::unsetenv(v);
    }
  }
  void TearDown() override {
    for (const char* v : kVars) ::unsetenv(v);
    for (auto& [k, v] : saved_) ::setenv(k.c_str(), v.c_str(), 1);
  }
  static constexpr const char* kVars[] = {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                                          "PMI_RANK", "PMI_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
                                          "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"};
  std::vector<std::pair<std::string, std::string>> saved_;
};

TEST_F(LaunchEnv, SingleMpiSlurmTorchrun) {
  EXPECT_EQ(detect_launch().kind, LaunchInfo::Single);
  ::setenv("SLURM_PROCID", "3", 1);
  ::setenv("SLURM_NTASKS", "8", 1);
  ::setenv("SLURM_LOCALID", "1", 1);
  LaunchInfo s = detect_launch();
  EXPECT_EQ(s.kind, LaunchInfo::Mpi);
  EXPECT_EQ(s.rank, 3);
  EXPECT_EQ(s.world_size, 8);
  EXPECT_EQ(s.local_rank, 1);
  // torchrun inside a Slurm allocation is torchrun.
  ::setenv("RANK", "1", 1);
  ::setenv("WORLD_SIZE", "2", 1);
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", "29500", 1);
  LaunchInfo t = detect_launch();
  EXPECT_EQ(t.kind, LaunchInfo::Torchrun);
  EXPECT_EQ(t.rank, 1);
  EXPECT_EQ(t.master_port, 29500);
  ::setenv("OMPI_COMM_WORLD_RANK", "0", 1);
  ::setenv("OMPI_COMM_WORLD_SIZE", "4", 1);
  EXPECT_EQ(detect_launch().world_size, 4);
}

TEST_F(LaunchEnv, InconsistentValuesAreErrors) {
  ::setenv("RANK", "2", 1);
  ::setenv("WORLD_SIZE", "2", 1);
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", "29500", 1);
  EXPECT_THROW(detect_launch(), Error);
  ::setenv("RANK", "x", 1);
  EXPECT_THROW(detect_launch(), Error);
  ::setenv("RANK", "0", 1);
  ::unsetenv("MASTER_PORT");
  EXPECT_THROW(detect_launch(), Error);
}

TEST_F(LaunchEnv, SingleProcessWorldIsLocal) {
  auto world = init_world(detect_launch(), Device::cpu(), std::chrono::seconds(5));
  EXPECT_EQ(world->size(), 1);
  EXPECT_EQ(world->backend(), "local");
  EXPECT_EQ(world->timeout(), std::chrono::seconds(5));
}

int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

TEST(TcpRendezvous, Rank0sBlobReachesEveryRank) {
  int port = free_port();
  std::vector<char> blob = {'n', 'c', 'c', 'l'};
  auto t = std::chrono::seconds(10);
  // Ranks 1 and 2 start before rank 0 listens.
  auto r1 = std::async(std::launch::async, [&] { return tcp_rendezvous("localhost", port, 1, 3, {}, t); });
  auto r2 = std::async(std::launch::async, [&] { return tcp_rendezvous("127.0.0.1", port, 2, 3, {}, t); });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(tcp_rendezvous("127.0.0.1", port, 0, 3, blob, t), blob);
  EXPECT_EQ(r1.get(), blob);
  EXPECT_EQ(r2.get(), blob);
}

TEST(TcpRendezvous, MismatchedWorldSizeIsOneErrorOnEveryRank) {
  int port = free_port();
  auto t = std::chrono::seconds(10);
  auto r1 = std::async(std::launch::async, [&] { return tcp_rendezvous("127.0.0.1", port, 1, 3, {}, t); });
  std::string msg0, msg1;
  try {
    tcp_rendezvous("127.0.0.1", port, 0, 2, {'x'}, t);
  } catch (const Error& e) {
    msg0 = e.what();
  }
  try {
    r1.get();
  } catch (const Error& e) {
    msg1 = e.what();
  }
  EXPECT_EQ(msg0, msg1);
  EXPECT_NE(msg0.find("rank 1 was started with WORLD_SIZE=3 but rank 0 with WORLD_SIZE=2"), std::string::npos) << msg0;
}

TEST(TcpRendezvous, MissingRank0TimesOut) {
  int port = free_port();
  EXPECT_THROW(tcp_rendezvous("127.0.0.1", port, 1, 2, {}, std::chrono::milliseconds(300)), Error);
}

}  // namespace
}  // namespace megatron
