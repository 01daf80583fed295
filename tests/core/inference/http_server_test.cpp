// HttpServer alone (no model): the reactor's limits and timeouts with short settings, keep-alive and
// pipelining, Expect: 100-continue, the connection limit, a handler's exception, an address in use,
// and client_gone telling a closed client from a half-closed one. Raw sockets, bounded waits.
#include "megatron/core/inference/http_server.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <nlohmann/json.hpp>
#include <thread>

#include "megatron/runtime/check.h"

namespace megatron {
namespace {

using Clock = std::chrono::steady_clock;

int connect_to(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

void send_text(int fd, const std::string& s) { ASSERT_EQ(::send(fd, s.data(), s.size(), MSG_NOSIGNAL), ssize_t(s.size())); }

// Reads until the peer closes, `count` occurrences of `stop` have arrived, or `seconds` pass.
std::string read_for(int fd, double seconds, const std::string& stop = "", int count = 1) {
  std::string out;
  const auto end = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  while (Clock::now() < end) {
    pollfd p{fd, POLLIN, 0};
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - Clock::now()).count();
    if (::poll(&p, 1, int(std::max<int64_t>(left, 1))) <= 0) break;
    char buf[4096];
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    out.append(buf, size_t(n));
    if (!stop.empty()) {
      int seen = 0;
      for (size_t at = out.find(stop); at != std::string::npos; at = out.find(stop, at + 1)) ++seen;
      if (seen >= count) break;
    }
  }
  return out;
}

bool closed_by_peer(int fd, double seconds) {
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, int(seconds * 1000)) <= 0) return false;
  char c;
  return ::recv(fd, &c, 1, MSG_PEEK) == 0;
}

std::string body_of(const std::string& reply) {
  const size_t at = reply.find("\r\n\r\n");
  return at == std::string::npos ? "" : reply.substr(at + 4);
}

bool json_error(const std::string& body) {
  auto j = nlohmann::json::parse(body, nullptr, false);
  return j.is_object() && j.contains("error") && j["error"].is_string();
}

struct Served {
  HttpServer http;
  int port = 0;
  std::thread thread;
  std::atomic<int> gone{-1};  // /wait's verdict: 1 the client went away, 0 it finished waiting

  explicit Served(HttpServerOptions o) : http(o) {
    http.route(
        "GET", "/health",
        [](const httplib::Request&, httplib::Response& res) { res.set_content("{\"status\":\"ok\"}", "application/json"); },
        false);
    http.route(
        "POST", "/echo", [](const httplib::Request& req, httplib::Response& res) { res.set_content(req.body, "text/plain"); },
        true);
    http.route(
        "POST", "/throw",
        [](const httplib::Request&, httplib::Response&) { throw std::runtime_error("secret internal detail"); }, true);
    // Waits up to 1.5 s, watching for the client to hang up.
    http.route(
        "POST", "/wait",
        [this](const httplib::Request& req, httplib::Response& res) {
          for (int k = 0; k < 15; ++k) {
            std::this_thread::sleep_for(std::chrono::milliseconds(100));
            if (HttpServer::client_gone(req)) {
              gone = 1;
              return;
            }
          }
          gone = 0;
          res.set_content("{\"waited\":true}", "application/json");
        },
        true);
    port = http.bind("127.0.0.1", 0);
    thread = std::thread([this] { http.serve(); });
  }
  ~Served() {
    http.shutdown();
    thread.join();
  }
};

HttpServerOptions quick() {
  HttpServerOptions o;
  o.threads = 2;
  o.max_request_bytes = 1024;
  o.request_timeout_s = 0.6;
  o.keep_alive_timeout_s = 0.6;
  o.write_timeout_s = 1;
  o.max_connections = 8;
  return o;
}

std::string post(const std::string& path, const std::string& body, const std::string& extra = "") {
  return "POST " + path + " HTTP/1.1\r\nHost: x\r\n" + extra + "Content-Length: " + std::to_string(body.size()) +
         "\r\n\r\n" + body;
}

TEST(HttpServer, ARequestThatDoesNotArriveInTimeIs408AndIdleConnectionsClose) {
  Served s(quick());
  int slow = connect_to(s.port), idle = connect_to(s.port);
  send_text(slow, "GET /health HTTP/1.1\r\nHost: x\r\n");
  const auto t0 = Clock::now();
  const std::string reply = read_for(slow, 5);
  const double waited = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_EQ(reply.rfind("HTTP/1.1 408", 0), 0u) << reply;
  EXPECT_TRUE(json_error(body_of(reply))) << reply;
  EXPECT_GT(waited, 0.4);
  EXPECT_LT(waited, 3.0);
  EXPECT_TRUE(closed_by_peer(idle, 3)) << "a connection that never sent a byte stays open";
  ::close(slow);
  ::close(idle);
  for (int k = 0; k < 100 && s.http.open_connections() > 0; ++k) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(s.http.open_connections(), 0u);
}

TEST(HttpServer, KeepAliveAndPipelinedRequests) {
  Served s(quick());
  int fd = connect_to(s.port);
  send_text(fd, post("/echo", "first") + post("/echo", "second"));  // two requests in one write
  std::string replies = read_for(fd, 5, "HTTP/1.1 200", 2);
  replies += read_for(fd, 0.3);
  EXPECT_NE(replies.find("first"), std::string::npos) << replies;
  EXPECT_NE(replies.find("second"), std::string::npos) << replies;
  send_text(fd, post("/echo", "third"));  // the same connection, later
  EXPECT_NE(read_for(fd, 5, "third").find("third"), std::string::npos);
  ::close(fd);
}

TEST(HttpServer, ExpectContinueAndTheBodyLimit) {
  Served s(quick());
  int fd = connect_to(s.port);
  send_text(fd, "POST /echo HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 4\r\n\r\n");
  EXPECT_EQ(read_for(fd, 5, "\r\n\r\n").rfind("HTTP/1.1 100 Continue", 0), 0u);
  send_text(fd, "abcd");
  const std::string reply = read_for(fd, 5, "abcd");
  EXPECT_EQ(reply.rfind("HTTP/1.1 200", 0), 0u) << reply;
  EXPECT_EQ(reply.find("100 Continue"), std::string::npos) << "a second interim response: " << reply;
  ::close(fd);
  // Beyond max_request_bytes: 413 before the body is sent.
  fd = connect_to(s.port);
  send_text(fd, "POST /echo HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 5000\r\n\r\n");
  const std::string refused = read_for(fd, 5);
  EXPECT_EQ(refused.rfind("HTTP/1.1 413", 0), 0u) << refused;
  EXPECT_TRUE(json_error(body_of(refused))) << refused;
  ::close(fd);
  // A head that never ends: 431.
  fd = connect_to(s.port);
  send_text(fd, "GET /health HTTP/1.1\r\nX-Long: " + std::string(70000, 'a'));
  EXPECT_EQ(read_for(fd, 5).rfind("HTTP/1.1 431", 0), 0u);
  ::close(fd);
}

TEST(HttpServer, TheConnectionLimitIs503) {
  HttpServerOptions o = quick();
  o.max_connections = 2;
  o.request_timeout_s = 5;
  Served s(o);
  int a = connect_to(s.port), b = connect_to(s.port);
  for (int k = 0; k < 50 && s.http.open_connections() < 2; ++k) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  int c = connect_to(s.port);
  const std::string reply = read_for(c, 5);
  EXPECT_EQ(reply.rfind("HTTP/1.1 503", 0), 0u) << reply;
  EXPECT_TRUE(json_error(body_of(reply))) << reply;
  ::close(a);
  ::close(b);
  ::close(c);
}

TEST(HttpServer, AHandlerExceptionIsAJson500WithNothingInternal) {
  Served s(quick());
  int fd = connect_to(s.port);
  send_text(fd, post("/throw", "x"));
  const std::string reply = read_for(fd, 5, "}");
  EXPECT_EQ(reply.rfind("HTTP/1.1 500", 0), 0u) << reply;
  EXPECT_EQ(reply.find("secret internal detail"), std::string::npos) << reply;
  EXPECT_EQ(reply.find("EXCEPTION_WHAT"), std::string::npos) << reply;
  EXPECT_TRUE(json_error(body_of(reply))) << reply;
  ::close(fd);
}

TEST(HttpServer, AnAddressInUseIsOneClearError) {
  Served s(quick());
  HttpServer second(quick());
  try {
    second.bind("127.0.0.1", s.port);
    FAIL() << "bound a port another server listens on";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("cannot listen on 127.0.0.1:" + std::to_string(s.port)), std::string::npos) << what;
    EXPECT_NE(what.find("in use"), std::string::npos) << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
  }
}

// Note [Hang-up probe]: a closed client is seen as gone; a half-closed one gets an interim 100 and
// then its reply.
TEST(HttpServer, ClientGoneTellsAClosedClientFromAHalfClosedOne) {
  Served s(quick());
  int fd = connect_to(s.port);
  send_text(fd, post("/wait", "{}"));
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  ::close(fd);
  for (int k = 0; k < 40 && s.gone < 0; ++k) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(s.gone.load(), 1) << "a closed client was not noticed";

  s.gone = -1;
  fd = connect_to(s.port);
  send_text(fd, post("/wait", "{}"));
  ::shutdown(fd, SHUT_WR);
  const std::string reply = read_for(fd, 5);
  EXPECT_EQ(s.gone.load(), 0) << "a half-closed client was taken for gone";
  EXPECT_EQ(reply.rfind("HTTP/1.1 100 Continue\r\n\r\n", 0), 0u) << reply;
  EXPECT_NE(reply.find("HTTP/1.1 200 OK"), std::string::npos) << reply;
  EXPECT_NE(reply.find("{\"waited\":true}"), std::string::npos) << reply;
  ::close(fd);
}

}  // namespace
}  // namespace megatron
