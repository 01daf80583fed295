// HttpServer: cpp-httplib's request parsing and routing behind a connection reactor of our own, so
// that no client, slow, huge or gone, can hold the text generation server.
//
// cpp-httplib gives each connection a pool thread from accept to close: connections that trickle
// one header line a second hold every thread, and /health goes unanswered. Here the accept loop
// hands each socket to one reactor thread, which polls every open connection and buffers a
// request until its head and its whole body (Content-Length, at most max_request_bytes) have
// arrived; only then does a thread parse and answer it (Note [Reactor]). A request must arrive
// within request_timeout_s (else 408), an idle keep-alive connection is closed after
// keep_alive_timeout_s, a client that reads nothing for write_timeout_s is dropped. Routes marked
// blocking (generation) run on the worker pool; everything else (health, errors) on a control
// thread of its own, so it is answered while every worker waits on the engine.
//
// Every error reply is {"error": "<one line>"}: 404 for an unknown path, 405 with Allow for a
// known path and the wrong method, 408, 411 (chunked request bodies are not accepted), 413 (the
// body limit), 500 for an exception that escaped a handler (logged; nothing internal in headers).
// bind() fails, with one line, on a port another process listens on (no SO_REUSEPORT).
#pragma once

#include <httplib.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace megatron {

struct HttpServerOptions {
  size_t threads = 32;                   // workers for the blocking routes
  size_t max_request_bytes = 8u << 20;   // largest request body (413 beyond)
  double request_timeout_s = 30;         // a request's head and body must arrive within this (408)
  double keep_alive_timeout_s = 5;       // an idle connection is closed after this
  double write_timeout_s = 30;           // a client that takes no byte for this long is dropped
  size_t max_connections = 512;          // open connections; more get a 503 at once
};

class HttpServer : private httplib::Server {
 public:
  using Handler = httplib::Server::Handler;

  explicit HttpServer(HttpServerOptions options = {});
  ~HttpServer() override;
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  /// Serves `method` (GET, POST or PUT) on the literal `path`. A blocking handler may wait (on the
  /// engine) and runs on the worker pool; others run on the control thread and must be quick.
  void route(const std::string& method, const std::string& path, Handler handler, bool blocking);

  /// Binds and listens on host:port (0: any free port); returns the port. Throws megatron::Error
  /// (one line) when it cannot: the port is in use, or the host is not an address of this machine.
  int bind(const std::string& host, int port);
  /// Serves until shutdown(); call once, after bind().
  void serve();
  /// Stops accepting, lets the running handlers finish, closes every connection. Any thread.
  void shutdown();

  /// Within a blocking handler: whether its client has hung up (Note [Hang-up probe]). A client
  /// that only half-closed (shut its sending side after the request) has not.
  static bool client_gone(const httplib::Request& req);

  size_t open_connections() const { return open_.load(); }

  struct Connection;

 private:
  bool process_and_close_socket(socket_t sock) override;

  void reactor_loop();
  void hand_to_reactor(std::shared_ptr<Connection> c);
  void wake();
  void serve_request(const std::shared_ptr<Connection>& c);
  void close_connection(Connection& c);
  bool blocking_route(const std::string& method, const std::string& target) const;

  struct Route {
    std::set<std::string> methods;
    bool blocking = false;
  };

  HttpServerOptions options_;
  std::map<std::string, Route> routes_;
  std::unique_ptr<httplib::ThreadPool> workers_, control_;
  std::thread reactor_;
  int wake_[2] = {-1, -1};  // a pipe: a byte wakes the reactor's poll
  std::mutex incoming_m_;
  std::vector<std::shared_ptr<Connection>> incoming_;  // new or returned connections for the reactor
  std::atomic<size_t> open_{0};
  std::atomic<bool> stopping_{false};
  bool stopped_ = false;
};

}  // namespace megatron
