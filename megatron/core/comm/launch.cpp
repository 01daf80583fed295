// How a run's processes find each other: the launch environment (mpirun/srun or torchrun), the
// world group built from it, and the built-in one-node launcher (--nproc-per-node).
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <thread>

#include <fmt/format.h>

#include "megatron/core/comm/comm_detail.h"
#include "megatron/core/comm/tcp_store.h"

namespace megatron {
namespace {

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

int env_int(const char* name, int fallback) {
  const char* v = env(name);
  if (!v) return fallback;
  int out = 0;
  auto [end, ec] = std::from_chars(v, v + std::strlen(v), out);
  MG_CHECK(ec == std::errc() && *end == '\0', "environment variable {}='{}' is not an integer", name, v);
  return out;
}

// A TCP port nobody listens on now (the kernel's choice), for MASTER_PORT.
int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  MG_CHECK(fd >= 0, "--nproc-per-node: cannot create a socket: {}", std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
            ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  ::close(fd);
  MG_CHECK(ok, "--nproc-per-node: cannot find a free TCP port: {}", std::strerror(errno));
  return ntohs(addr.sin_port);
}

int exit_status(int wstatus) {
  if (WIFEXITED(wstatus)) return WEXITSTATUS(wstatus);
  if (WIFSIGNALED(wstatus)) return 128 + WTERMSIG(wstatus);
  return 1;
}

// The launcher's workers (-1 once reaped), also read by the signal handler: a SIGTERM/SIGINT/SIGHUP
// to the launcher alone (a scheduler's kill, a `kill PID`) goes on to every worker, which would
// otherwise keep its GPU.
constexpr int kMaxWorkers = 1024;
volatile sig_atomic_t g_worker_count = 0;
pid_t g_workers[kMaxWorkers];

void forward_signal(int sig) {
  for (int i = 0; i < g_worker_count; ++i) {
    if (g_workers[i] > 0) ::kill(g_workers[i], sig);
  }
}

std::string self_exe(const char* argv0) {
  char buf[PATH_MAX];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, size_t(n)) : std::string(argv0);
}

}  // namespace

LaunchInfo detect_launch() {
  LaunchInfo info;
  auto finish = [&](const char* how) {
    MG_CHECK(info.world_size >= 1 && info.rank >= 0 && info.rank < info.world_size && info.local_rank >= 0,
             "inconsistent {} launch environment: rank {}, world size {}, local rank {}", how, info.rank,
             info.world_size, info.local_rank);
    return info;
  };
  if (env("OMPI_COMM_WORLD_SIZE")) {  // mpirun (OpenMPI)
    info.kind = LaunchInfo::Mpi;
    info.rank = env_int("OMPI_COMM_WORLD_RANK", -1);
    info.world_size = env_int("OMPI_COMM_WORLD_SIZE", 0);
    info.local_rank = env_int("OMPI_COMM_WORLD_LOCAL_RANK", 0);
    return finish("mpirun (OMPI_COMM_WORLD_*)");
  }
  if (env("PMI_SIZE")) {  // MPICH/Intel MPI's hydra
    info.kind = LaunchInfo::Mpi;
    info.rank = env_int("PMI_RANK", -1);
    info.world_size = env_int("PMI_SIZE", 0);
    info.local_rank = env_int("MPI_LOCALRANKID", 0);
    return finish("MPI (PMI_*)");
  }
  // torchrun before Slurm: a batch script's environment has SLURM_* even when it runs torchrun.
  if (env("RANK") || env("WORLD_SIZE")) {
    info.kind = LaunchInfo::Torchrun;
    info.rank = env_int("RANK", -1);
    info.world_size = env_int("WORLD_SIZE", 0);
    info.local_rank = env_int("LOCAL_RANK", 0);
    info.master_addr = env("MASTER_ADDR") ? env("MASTER_ADDR") : "";
    info.master_port = env_int("MASTER_PORT", 0);
    MG_CHECK(info.world_size == 1 || (!info.master_addr.empty() && info.master_port > 0),
             "torchrun-style launch (RANK={}, WORLD_SIZE={}) without MASTER_ADDR and MASTER_PORT: set both to rank "
             "0's address and a free port",
             info.rank, info.world_size);
    return finish("torchrun (RANK/WORLD_SIZE/LOCAL_RANK)");
  }
  if (env("SLURM_PROCID") && env("SLURM_NTASKS")) {  // srun
    info.kind = LaunchInfo::Mpi;
    info.rank = env_int("SLURM_PROCID", -1);
    info.world_size = env_int("SLURM_NTASKS", 0);
    info.local_rank = env_int("SLURM_LOCALID", 0);
    return finish("srun (SLURM_PROCID/SLURM_NTASKS)");
  }
  return info;
}

std::unique_ptr<Communicator> init_world(const LaunchInfo& launch, Device device, std::chrono::milliseconds timeout) {
  // A world of one rank (a plain run, or a launcher's single process) moves no data: the local
  // one-rank group serves it on any device, with no MPI or NCCL to initialise. (An mpirun of one
  // process also counts: MPI is not needed to talk to nobody.)
  if (launch.world_size == 1) {
    auto world = std::move(make_local_group(1).front());
    world->set_timeout(timeout);
    return world;
  }
  if (device.is_host()) {
    MG_CHECK(launch.kind == LaunchInfo::Mpi,
             "a torchrun-style launch (RANK/WORLD_SIZE) of {} processes cannot run on the CPU: CPU runs communicate "
             "through MPI: start them with mpirun -np {} (or --nproc-per-node {})",
             launch.world_size, launch.world_size, launch.world_size);
    auto world = comm_detail::make_mpi_world(timeout);
    MG_CHECK(world->size() == launch.world_size && world->rank() == launch.rank,
             "MPI's world (rank {} of {}) disagrees with the launch environment (rank {} of {}): start the run "
             "with one mpirun/srun",
             world->rank(), world->size(), launch.rank, launch.world_size);
    return world;
  }
#ifdef MEGATRON_WITH_CUDA
  std::vector<char> id;
  if (launch.kind == LaunchInfo::Mpi) {
    // The unique id travels over MPI's world.
    auto mpi = comm_detail::make_mpi_world(timeout);
    MG_CHECK(mpi->size() == launch.world_size,
             "MPI's world has {} ranks but the launch environment says {}: start the run with one mpirun/srun",
             mpi->size(), launch.world_size);
    Tensor bytes = Tensor::zeros({int64_t(comm_detail::kNcclUniqueIdBytes)}, DType::UInt8);
    if (mpi->rank() == 0) {
      id = comm_detail::nccl_unique_id();
      std::memcpy(bytes.raw_data(), id.data(), id.size());
    }
    Context cpu;
    mpi->broadcast(cpu, bytes, 0)->wait();
    const char* p = static_cast<const char*>(bytes.raw_data());
    id.assign(p, p + bytes.nbytes());
  } else {
    if (launch.rank == 0) id = comm_detail::nccl_unique_id();
    id = tcp_rendezvous(launch.master_addr, launch.master_port, launch.rank, launch.world_size, id, timeout);
  }
  return comm_detail::make_nccl_world(launch.rank, launch.world_size, device, id, timeout);
#else
  MG_CHECK(false, "this build has no CUDA: tensors on {} need a CUDA build (cmake -DMEGATRON_CUDA=ON)", device.str());
  return nullptr;
#endif
}

int launch_local_workers(int argc, char** argv, int nproc, bool cpu) {
  MG_CHECK(nproc >= 1 && nproc <= kMaxWorkers, "--nproc-per-node must be 1 to {}, got {}", kMaxWorkers, nproc);
  std::string exe = self_exe(argv[0]);
  std::vector<std::string> args;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--nproc-per-node" || a == "--nproc_per_node") {
      ++i;  // and its value
    } else if (a.rfind("--nproc-per-node=", 0) != 0 && a.rfind("--nproc_per_node=", 0) != 0) {
      args.push_back(a);
    }
  }
  // Each worker's command line; CPU runs go through one mpirun (CPU communication is MPI), which
  // forwards the output and ends the job when a rank fails.
  std::vector<std::vector<std::string>> commands;
  if (cpu) {
    std::vector<std::string> cmd = {"mpirun", "-np", std::to_string(nproc), "--oversubscribe"};
    if (::geteuid() == 0) cmd.push_back("--allow-run-as-root");
    cmd.push_back(exe);
    cmd.insert(cmd.end(), args.begin(), args.end());
    commands.push_back(cmd);
  } else {
    for (int r = 0; r < nproc; ++r) {
      std::vector<std::string> cmd = {exe};
      cmd.insert(cmd.end(), args.begin(), args.end());
      commands.push_back(cmd);
    }
  }
  int port = cpu ? 0 : free_port();
  g_worker_count = 0;
  for (size_t r = 0; r < commands.size(); ++r) {
    std::vector<char*> cargv;
    for (auto& s : commands[r]) cargv.push_back(s.data());
    cargv.push_back(nullptr);
    pid_t pid = ::fork();
    if (pid < 0) {
      forward_signal(SIGKILL);
      MG_CHECK(false, "--nproc-per-node: fork failed: {}", std::strerror(errno));
    }
    if (pid == 0) {  // the worker: torchrun's environment, then this program again
      if (!cpu) {
        ::setenv("RANK", std::to_string(r).c_str(), 1);
        ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
        ::setenv("WORLD_SIZE", std::to_string(nproc).c_str(), 1);
        ::setenv("LOCAL_WORLD_SIZE", std::to_string(nproc).c_str(), 1);
        ::setenv("MASTER_ADDR", "127.0.0.1", 1);
        ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      }
      ::execvp(cargv[0], cargv.data());
      std::fprintf(stderr, "--nproc-per-node: cannot run %s: %s%s\n", cargv[0], std::strerror(errno),
                   cpu ? " (CPU runs need OpenMPI's mpirun: apt-get install openmpi-bin)" : "");
      ::_exit(127);
    }
    g_workers[g_worker_count] = pid;
    g_worker_count = g_worker_count + 1;
  }
  for (int sig : {SIGTERM, SIGINT, SIGHUP}) {
    struct sigaction sa {};
    sa.sa_handler = forward_signal;
    sigemptyset(&sa.sa_mask);
    ::sigaction(sig, &sa, nullptr);
  }
  // The first failure ends the others (torchrun's behaviour): SIGTERM, then SIGKILL after 5 s.
  int result = 0;
  int running = g_worker_count;
  std::chrono::steady_clock::time_point kill_at{};
  while (running > 0) {
    int wstatus = 0;
    pid_t pid = ::waitpid(-1, &wstatus, WNOHANG);
    if (pid < 0 && errno != EINTR) break;
    const pid_t* it = std::find(g_workers, g_workers + g_worker_count, pid);
    if (pid <= 0 || it == g_workers + g_worker_count) {
      if (result != 0 && std::chrono::steady_clock::now() > kill_at) forward_signal(SIGKILL);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      continue;
    }
    const int worker = int(it - g_workers);
    g_workers[worker] = -1;
    --running;
    int status = exit_status(wstatus);
    if (status != 0 && result == 0) {
      result = status;
      if (running > 0) {
        std::fprintf(stderr, "--nproc-per-node: worker %d exited with status %d; stopping the others\n", worker,
                     status);
      }
      forward_signal(SIGTERM);
      kill_at = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    }
  }
  return result;
}

}  // namespace megatron
