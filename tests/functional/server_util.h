// Helpers for the text generation server's tests: the gpt2 fixture converted to a checkpoint and
// served by tools/text_generation_server on a free loopback port (NullTokenizer: prompts are
// space-separated ids), and raw-socket clients with bounded waits so that a regression fails
// instead of hanging.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <httplib.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <map>
#include <nlohmann/json.hpp>

#include "megatron/core/dist_checkpointing/safetensors.h"
#include "tests/functional/run_util.h"

namespace megatron::testing {

inline std::string ids_text(const std::vector<int64_t>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? " " : "") + std::to_string(ids[i]);
  return s;
}

/// Converts the `model` fixture ("gpt2", "llama") into `dir`/ckpt (once per directory); returns the
/// checkpoint path.
inline std::string fixture_checkpoint(const fs::path& dir, const std::string& model) {
  if (fs::exists(dir / "ckpt")) return (dir / "ckpt").string();
  const fs::path fixtures = fs::absolute(fixtures_dir());
  const fs::path weights = fixtures / (model + "_model.safetensors");
  safetensors::File src(weights.string());
  fs::create_directories(dir / "hf");
  fs::copy_file(weights, dir / "hf/model.safetensors", fs::copy_options::overwrite_existing);
  std::ofstream(dir / "hf/config.json") << src.metadata().at("config");
  RunResult conv = run({bin("convert_checkpoint"), "--from", "hf", "--load", "hf", "--save", "ckpt"}, dir);
  EXPECT_EQ(conv.exit_code, 0) << conv.output;
  return (dir / "ckpt").string();
}

inline std::string gpt2_checkpoint(const fs::path& dir) { return fixture_checkpoint(dir, "gpt2"); }

/// A HuggingFace GPT-2 style tokenizer folder in `dir` that fits the gpt2 fixture's 512 rows: the 256
/// byte tokens (GPT-2's byte-to-unicode map), one merge ("\n\n", id 256), <|endoftext|> (257, the
/// eos and bos) and unreachable fillers up to 512, with `chat_template` in tokenizer_config.json
/// (none when empty). Returns the folder.
inline std::string byte_level_tokenizer(const fs::path& dir, const std::string& chat_template) {
  auto utf8 = [](int cp) {
    std::string s;
    if (cp < 0x80) {
      s.push_back(char(cp));
    } else {
      s.push_back(char(0xC0 | (cp >> 6)));
      s.push_back(char(0x80 | (cp & 0x3F)));
    }
    return s;
  };
  std::vector<int> printable;
  for (int b = '!'; b <= '~'; ++b) printable.push_back(b);
  for (int b = 0xA1; b <= 0xAC; ++b) printable.push_back(b);
  for (int b = 0xAE; b <= 0xFF; ++b) printable.push_back(b);
  std::map<int, std::string> byte_char;
  for (int b : printable) byte_char[b] = utf8(b);
  int extra = 0;
  for (int b = 0; b < 256; ++b)
    if (!byte_char.count(b)) byte_char[b] = utf8(256 + extra++);
  nlohmann::ordered_json vocab = nlohmann::ordered_json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_char[b]] = b;
  const std::string nl = byte_char['\n'];
  vocab[nl + nl] = 256;
  vocab["<|endoftext|>"] = 257;
  for (int i = 258; i < 512; ++i) vocab["<unused_" + std::to_string(i) + ">"] = i;
  fs::create_directories(dir);
  std::ofstream(dir / "vocab.json") << vocab.dump();
  std::ofstream(dir / "merges.txt") << "#version: 0.2\n" << nl << " " << nl << "\n";
  nlohmann::json config = {{"tokenizer_class", "GPT2Tokenizer"},
                           {"bos_token", "<|endoftext|>"},
                           {"eos_token", "<|endoftext|>"},
                           {"unk_token", "<|endoftext|>"},
                           {"model_max_length", 64}};
  if (!chat_template.empty()) config["chat_template"] = chat_template;
  std::ofstream(dir / "tokenizer_config.json") << config.dump();
  return dir.string();
}

/// tools/text_generation_server started in the background, its output in `log`.
struct ServerProcess {
  pid_t pid = -1;
  int port = 0;
  fs::path log;

  /// Starts the server on `port` with the fixture flags plus `extra`; does not wait for it. Port 0:
  /// the server binds a free port itself (no window between choosing a port and binding it, in
  /// which a parallel test could take it); wait_healthy reads it from the serving line.
  /// `launcher` goes before the server's path (e.g. mpirun -np 2: the server's ranks; Note [Server
  /// ranks] in tools/text_generation_server.cpp).
  void start(const std::string& ckpt, int port_, const fs::path& log_, const std::vector<std::string>& extra = {},
             const std::vector<std::string>& tokenizer = {"--tokenizer-type", "NullTokenizer", "--vocab-size", "512"},
             const std::vector<std::string>& launcher = {}) {
    port = port_;
    log = log_;
    std::vector<std::string> argv = launcher;
    for (const std::string& a : {bin("text_generation_server"), std::string("--load"), ckpt, std::string("--port"),
                                 std::to_string(port), std::string("--device"), std::string("cpu")})
      argv.push_back(a);
    argv.insert(argv.end(), tokenizer.begin(), tokenizer.end());
    argv.insert(argv.end(), extra.begin(), extra.end());
    pid = ::fork();
    if (pid == 0) {
      int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      std::vector<char*> args;
      for (std::string& a : argv) args.push_back(a.data());
      args.push_back(nullptr);
      ::execvp(args[0], args.data());
      ::_exit(127);
    }
  }

  /// Waits (at most `seconds`) for /health to answer 200.
  bool wait_healthy(double seconds = 30) {
    for (auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
         std::chrono::steady_clock::now() < end;) {
      if (port == 0) {  // "serving <ckpt> on http://<host>:<port> (...)"
        const std::string out = output();
        const size_t at = out.find("serving ");
        const size_t colon = at == std::string::npos ? at : out.find(" on http://", at);
        if (colon != std::string::npos) {
          const size_t p = out.find(':', colon + 11);
          if (p != std::string::npos) port = std::atoi(out.c_str() + p + 1);
        }
      }
      if (port > 0) {
        httplib::Client cli("127.0.0.1", port);
        cli.set_connection_timeout(1, 0);
        cli.set_read_timeout(1, 0);
        if (auto r = cli.Get("/health"); r && r->status == 200) return true;
      }
      if (!alive()) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return false;
  }

  bool alive() const {
    int status = 0;
    return pid > 0 && ::waitpid(pid, &status, WNOHANG) == 0;
  }

  /// Waits (at most `seconds`) for the process to end; its exit code, or -1 if still running.
  int wait_exit(double seconds) {
    for (auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
         std::chrono::steady_clock::now() < end;) {
      int status = 0;
      if (::waitpid(pid, &status, WNOHANG) == pid) {
        pid = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return -1;
  }

  /// SIGTERM, then SIGKILL after 20 s; the exit code (0 on a clean shutdown).
  int stop() {
    if (pid <= 0) return -1;
    ::kill(pid, SIGTERM);
    int code = wait_exit(20);
    if (code == -1) {
      ::kill(pid, SIGKILL);
      code = wait_exit(5);
    }
    return code;
  }

  std::string output() const { return read_file(log); }

  httplib::Client client(int read_timeout_s = 60) const {
    httplib::Client cli("127.0.0.1", port);
    cli.set_connection_timeout(5, 0);
    cli.set_read_timeout(read_timeout_s, 0);
    return cli;
  }
};

/// A raw TCP connection to the loopback port; every wait is bounded.
struct RawConnection {
  int fd = -1;
  explicit RawConnection(int port) {
    fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(uint16_t(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
      ::close(fd);
      fd = -1;
    }
  }
  ~RawConnection() { close(); }
  RawConnection(const RawConnection&) = delete;
  RawConnection& operator=(const RawConnection&) = delete;
  RawConnection(RawConnection&& o) noexcept : fd(o.fd) { o.fd = -1; }

  bool ok() const { return fd >= 0; }
  bool send(const std::string& s) const {
    size_t off = 0;
    while (off < s.size()) {
      ssize_t n = ::send(fd, s.data() + off, s.size() - off, MSG_NOSIGNAL);
      if (n <= 0) return false;
      off += size_t(n);
    }
    return true;
  }
  /// Reads until the server closes the connection, `stop` appears, or `seconds` pass.
  std::string read_until(double seconds, const std::string& stop = "") const {
    std::string out;
    const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    while (true) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - std::chrono::steady_clock::now());
      if (left.count() <= 0) break;
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, int(left.count())) <= 0) break;
      char buf[4096];
      ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
      if (n <= 0) break;
      out.append(buf, size_t(n));
      if (!stop.empty() && out.find(stop) != std::string::npos) break;
    }
    return out;
  }
  void close() {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
};

inline std::string http_request(const std::string& method, const std::string& path, const std::string& body,
                                const std::string& extra_headers = "") {
  return method + " " + path + " HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n" + extra_headers +
         "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
}

/// The one-line message of an error body, in any of the server's shapes (Note [Error shapes] in
/// tools/text_generation_server.cpp): {"error": "<line>"} (the HTTP layer), {"error": {"message":
/// "<line>", "type", "code"}} (/v1, OpenAI's), {"message": "<line>"} (/api, Megatron's); "" if none.
inline std::string error_message(const std::string& body) {
  nlohmann::json j = nlohmann::json::parse(body, nullptr, false);
  if (!j.is_object()) return "";
  const nlohmann::json* m = nullptr;
  if (j.contains("error") && j["error"].is_string()) m = &j["error"];
  if (j.contains("error") && j["error"].is_object() && j["error"].contains("message") && j["error"].contains("type") &&
      j["error"].contains("code"))
    m = &j["error"]["message"];
  if (j.size() == 1 && j.contains("message")) m = &j["message"];
  return m && m->is_string() && m->get<std::string>().find('\n') == std::string::npos ? m->get<std::string>() : "";
}

/// Every 4xx and 5xx of the server carries a one-line message in one of those shapes.
inline bool is_json_error(const std::string& body) { return !error_message(body).empty(); }

}  // namespace megatron::testing
