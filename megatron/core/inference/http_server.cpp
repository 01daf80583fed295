#include "megatron/core/inference/http_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>
#include <optional>
#include <string_view>
#include <utility>

#include "megatron/runtime/check.h"

namespace megatron {

using Clock = std::chrono::steady_clock;

// One client connection. The reactor owns it while a request is arriving, one pool thread while
// the request is answered; it passes between them through HttpServer::incoming_.
struct HttpServer::Connection {
  int fd = -1;
  std::string in;  // received bytes; in[pos..] not yet consumed
  size_t pos = 0;
  size_t served = 0;  // requests answered on this connection
  Clock::time_point deadline;
  bool receiving = false;  // part of a request has arrived (else idle between requests)
  bool continued = false;  // "100 Continue" sent for this request's Expect header
  bool eof = false;        // the client shut its sending side
  bool broken = false;     // a read or write failed or timed out: close after this request
  bool draining = false;   // an error reply was sent: discard what still arrives, then close
  bool probed = false;     // Note [Hang-up probe]
  bool fresh = true;       // just handed to the reactor: inspect its buffer before polling

  size_t unread() const { return in.size() - pos; }
  std::string_view pending() const { return std::string_view(in).substr(pos); }
  void compact() {
    in.erase(0, pos);
    pos = 0;
  }
};

namespace {

using nlohmann::json;

// The connection the current pool thread answers (for client_gone); null elsewhere.
thread_local HttpServer::Connection* t_connection = nullptr;

constexpr size_t kMaxHeadBytes = 64u << 10;
constexpr double kLingerSeconds = 5;

Clock::duration seconds(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

const char* reason(int status) {
  switch (status) {
    case 400: return "Bad Request";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 411: return "Length Required";
    case 413: return "Payload Too Large";
    case 414: return "URI Too Long";
    case 416: return "Range Not Satisfiable";
    case 417: return "Expectation Failed";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 503: return "Service Unavailable";
    default: return status < 500 ? "Client Error" : "Server Error";
  }
}

std::string error_body(const std::string& message) {
  return json{{"error", message}}.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string error_reply(int status, const std::string& message) {
  const std::string body = error_body(message);
  return fmt::format(
      "HTTP/1.1 {} {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{}", status,
      reason(status), body.size(), body);
}

// poll() for `events` on fd for at most `timeout`: the revents, 0 on a timeout.
short wait_for(int fd, short events, Clock::duration timeout) {
  pollfd p{fd, events, 0};
  const auto ms = std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::milliseconds>(timeout).count());
  int n;
  do {
    n = ::poll(&p, 1, int(std::min<int64_t>(ms, INT32_MAX)));
  } while (n < 0 && errno == EINTR);
  return n > 0 ? p.revents : 0;
}

// Writes all of `data` (a short control message: an error reply, an interim 100), waiting at most
// `timeout` for room.
bool send_all(int fd, std::string_view data, Clock::duration timeout) {
  while (!data.empty()) {
    const ssize_t n = ::send(fd, data.data(), data.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      data.remove_prefix(size_t(n));
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (!(wait_for(fd, POLLOUT, timeout) & POLLOUT)) return false;
    } else {
      return false;
    }
  }
  return true;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

bool iequals(std::string_view a, std::string_view b) {
  return a.size() == b.size() &&
         std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) { return std::tolower(uint8_t(x)) == std::tolower(uint8_t(y)); });
}

std::string percent_decode(std::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '%' && i + 2 < s.size() && std::isxdigit(uint8_t(s[i + 1])) && std::isxdigit(uint8_t(s[i + 2]))) {
      out += char(std::stoi(std::string(s.substr(i + 1, 2)), nullptr, 16));
      i += 2;
    } else {
      out += s[i];
    }
  }
  return out;
}

std::string regex_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (std::strchr(".^$|()[]{}*+?\\", c)) out += '\\';
    out += c;
  }
  return out;
}

// What the unread bytes of a connection hold (Note [Reactor]).
struct Head {
  enum Kind { Partial, Complete, Reject } kind = Partial;
  size_t length = 0;  // Complete: head and body bytes
  int status = 0;     // Reject
  std::string message;
  std::string method, target;
  size_t head_end = 0;                          // the offset just past the blank line, 0 if not there yet
  bool no_length = false;                       // no Content-Length: the body is empty (RFC 9112 6.3)
  std::optional<size_t> expect;                 // the offset of an "Expect: 100-continue" header's name
};

Head reject(int status, std::string message) {
  Head h;
  h.kind = Head::Reject;
  h.status = status;
  h.message = std::move(message);
  return h;
}

Head inspect(std::string_view in, size_t max_body) {
  Head h;
  const size_t blank = in.find("\r\n\r\n");
  if (blank == std::string_view::npos || blank + 4 > kMaxHeadBytes) {
    if (in.size() > kMaxHeadBytes || blank != std::string_view::npos)
      return reject(431, fmt::format("the request line and headers exceed {} KiB", kMaxHeadBytes >> 10));
    return h;
  }
  h.head_end = blank + 4;
  const std::string_view head = in.substr(0, blank + 2);  // every line with its CRLF
  const size_t eol = head.find("\r\n");
  const std::string_view line = head.substr(0, eol);
  const size_t sp1 = line.find(' '), sp2 = sp1 == std::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
  if (sp2 != std::string_view::npos) {
    h.method = line.substr(0, sp1);
    h.target = line.substr(sp1 + 1, sp2 - sp1 - 1);
  }
  std::optional<uint64_t> length;
  for (size_t p = eol + 2; p < head.size();) {
    const size_t e = head.find("\r\n", p);
    const std::string_view header = head.substr(p, e - p);
    const size_t at = p;
    p = e + 2;
    const size_t colon = header.find(':');
    if (colon == std::string_view::npos) continue;
    const std::string_view name = trim(header.substr(0, colon)), value = trim(header.substr(colon + 1));
    if (iequals(name, "transfer-encoding")) {
      return reject(411, "chunked request bodies are not accepted: send the body with a Content-Length header");
    } else if (iequals(name, "content-length")) {
      if (value.empty() || value.size() > 18 || !std::all_of(value.begin(), value.end(), [](char ch) { return ch >= '0' && ch <= '9'; }))
        return reject(400, fmt::format("Content-Length '{}' is not a byte count", value));
      const uint64_t n = std::stoull(std::string(value));
      if (length && *length != n) return reject(400, "conflicting Content-Length headers");
      length = n;
    } else if (iequals(name, "expect") && iequals(value, "100-continue")) {
      h.expect = at;
    }
  }
  if (length && *length > max_body)
    return reject(413, fmt::format("the request body of {} bytes exceeds the server's limit of {} bytes "
                                   "(--max-request-bytes)",
                                   *length, max_body));
  h.no_length = !length;
  const size_t total = h.head_end + size_t(length.value_or(0));
  if (in.size() < total) return h;
  h.kind = Head::Complete;
  h.length = total;
  return h;
}

// Runs each accepted socket's task on the accept thread: process_and_close_socket only hands the
// socket to the reactor.
struct InlineTaskQueue : httplib::TaskQueue {
  void enqueue(std::function<void()> fn) override { fn(); }
  void shutdown() override {}
};

// httplib's view of a connection on a pool thread: the buffered request first, then the socket,
// every wait bounded (the request's deadline for reads, write_timeout_s for each write).
class ConnectionStream : public httplib::Stream {
 public:
  ConnectionStream(HttpServer::Connection& c, double write_timeout_s)
      : c_(c), write_timeout_(seconds(write_timeout_s)) {}

  bool is_readable() const override { return c_.unread() > 0 || (wait_for(c_.fd, POLLIN, {}) & POLLIN); }
  bool is_writable() const override {
    const short ev = wait_for(c_.fd, POLLOUT, write_timeout_);
    return (ev & POLLOUT) && !(ev & (POLLERR | POLLHUP));
  }

  ssize_t read(char* ptr, size_t size) override {
    if (c_.unread() > 0) {
      const size_t n = std::min(size, c_.unread());
      std::memcpy(ptr, c_.in.data() + c_.pos, n);
      c_.pos += n;
      return ssize_t(n);
    }
    while (true) {
      const ssize_t n = ::recv(c_.fd, ptr, size, 0);
      if (n > 0) return n;
      if (n == 0) {
        c_.eof = true;
        return 0;
      }
      if (errno == EINTR) continue;
      if ((errno != EAGAIN && errno != EWOULDBLOCK) ||
          !(wait_for(c_.fd, POLLIN, c_.deadline - Clock::now()) & (POLLIN | POLLHUP | POLLERR))) {
        c_.broken = true;
        return -1;
      }
    }
  }

  ssize_t write(const char* ptr, size_t size) override {
    while (true) {
      const ssize_t n = ::send(c_.fd, ptr, size, MSG_NOSIGNAL);
      if (n >= 0) return n;
      if (errno == EINTR) continue;
      if ((errno != EAGAIN && errno != EWOULDBLOCK) || !(wait_for(c_.fd, POLLOUT, write_timeout_) & POLLOUT)) {
        c_.broken = true;
        return -1;
      }
    }
  }

  void get_remote_ip_and_port(std::string& ip, int& port) const override { address(true, ip, port); }
  void get_local_ip_and_port(std::string& ip, int& port) const override { address(false, ip, port); }
  socket_t socket() const override { return c_.fd; }

 private:
  void address(bool remote, std::string& ip, int& port) const {
    sockaddr_storage a{};
    socklen_t len = sizeof(a);
    auto* sa = reinterpret_cast<sockaddr*>(&a);
    if ((remote ? ::getpeername(c_.fd, sa, &len) : ::getsockname(c_.fd, sa, &len)) != 0) return;
    char buf[INET6_ADDRSTRLEN] = {};
    if (a.ss_family == AF_INET) {
      auto* v4 = reinterpret_cast<sockaddr_in*>(&a);
      ::inet_ntop(AF_INET, &v4->sin_addr, buf, sizeof(buf));
      port = ntohs(v4->sin_port);
    } else if (a.ss_family == AF_INET6) {
      auto* v6 = reinterpret_cast<sockaddr_in6*>(&a);
      ::inet_ntop(AF_INET6, &v6->sin6_addr, buf, sizeof(buf));
      port = ntohs(v6->sin6_port);
    }
    ip = buf;
  }

  HttpServer::Connection& c_;
  Clock::duration write_timeout_;
};

}  // namespace

HttpServer::HttpServer(HttpServerOptions options) : options_(options) {
  MG_CHECK(options_.threads > 0, "the HTTP server needs at least one worker thread");
  MG_CHECK(options_.max_request_bytes > 0, "the largest request body must be positive");
  MG_CHECK(options_.request_timeout_s > 0 && options_.keep_alive_timeout_s > 0 && options_.write_timeout_s > 0,
           "HTTP timeouts must be positive");
  MG_CHECK(options_.max_connections > 0, "the HTTP server needs room for at least one connection");
  MG_CHECK(::pipe2(wake_, O_CLOEXEC | O_NONBLOCK) == 0, "cannot create a pipe: {}", std::strerror(errno));
  workers_ = std::make_unique<httplib::ThreadPool>(options_.threads);
  control_ = std::make_unique<httplib::ThreadPool>(2);
  new_task_queue = [] { return new InlineTaskQueue; };
  // cpp-httplib's default sets SO_REUSEPORT, which lets a second server bind the same port and
  // take a share of its connections. SO_REUSEADDR alone still allows a restart over TIME_WAIT.
  set_socket_options([](socket_t sock) {
    int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  set_keep_alive_timeout(time_t(std::ceil(options_.keep_alive_timeout_s)));
  set_payload_max_length(options_.max_request_bytes);
  set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    auto it = routes_.find(req.path);
    if (it == routes_.end()) {
      res.status = 404;
      res.set_content(error_body(fmt::format("no such path '{}'", req.path)), "application/json");
      return HandlerResponse::Handled;
    }
    const std::set<std::string>& methods = it->second.methods;
    if (methods.count(req.method) || (req.method == "HEAD" && methods.count("GET"))) return HandlerResponse::Unhandled;
    std::string allow;
    for (const std::string& m : methods) allow += (allow.empty() ? "" : ", ") + m + (m == "GET" ? ", HEAD" : "");
    res.status = 405;
    res.set_header("Allow", allow);
    res.set_content(error_body(fmt::format("{} takes {}, not {}", req.path, allow, req.method)), "application/json");
    return HandlerResponse::Handled;
  });
  set_error_handler(HandlerWithResponse([](const httplib::Request&, httplib::Response& res) {
    if (!res.body.empty()) return HandlerResponse::Unhandled;
    res.set_content(error_body(reason(res.status)), "application/json");
    return HandlerResponse::Handled;
  }));
  set_exception_handler([](const httplib::Request& req, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "an unknown exception";
    try {
      std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    std::fprintf(stderr, "%s %s: unexpected error: %s\n", req.method.c_str(), req.path.c_str(), what.c_str());
    res.status = 500;
    res.set_content(error_body("internal server error (see the server's log)"), "application/json");
  });
}

HttpServer::~HttpServer() {
  shutdown();
  if (!stopped_) {
    control_->shutdown();
    workers_->shutdown();
  }
  for (int fd : wake_)
    if (fd >= 0) ::close(fd);
}

void HttpServer::route(const std::string& method, const std::string& path, Handler handler, bool blocking) {
  Route& r = routes_[path];
  r.methods.insert(method);
  r.blocking = r.blocking || blocking;
  const std::string pattern = regex_escape(path);
  if (method == "GET") {
    Get(pattern, std::move(handler));
  } else if (method == "POST") {
    Post(pattern, std::move(handler));
  } else if (method == "PUT") {
    Put(pattern, std::move(handler));
  } else {
    MG_CHECK(false, "HttpServer::route: method {} is not served (GET, POST or PUT)", method);
  }
}

int HttpServer::bind(const std::string& host, int port) {
  errno = 0;
  const int bound = port == 0 ? bind_to_any_port(host) : (bind_to_port(host, port) ? port : -1);
  const int err = errno;
  MG_CHECK(bound > 0, "cannot listen on {}:{}: {}", host, port,
           err == EADDRINUSE ? "the port is in use (another server?): pick another --port"
           : err             ? fmt::format("{} (is {} an address of this machine?)", std::strerror(err), host)
                             : fmt::format("{} is not an address of this machine", host));
  // cpp-httplib listens with a backlog of 5: a burst of connections overflows it and the client
  // retries its SYN a second later. Listening again on a listening socket only resizes the queue.
  ::listen(svr_sock_, SOMAXCONN);
  return bound;
}

void HttpServer::serve() {
  reactor_ = std::thread([this] { reactor_loop(); });
  if (!stopping_) listen_after_bind();
  stopping_ = true;
  wake();
  reactor_.join();
  control_->shutdown();
  workers_->shutdown();
  stopped_ = true;
  std::lock_guard lock(incoming_m_);
  for (auto& c : incoming_) close_connection(*c);
  incoming_.clear();
}

void HttpServer::shutdown() {
  stopping_ = true;
  stop();
  wake();
}

void HttpServer::wake() {
  [[maybe_unused]] const ssize_t n = ::write(wake_[1], "x", 1);  // a full pipe is awake already
}

bool HttpServer::blocking_route(const std::string& method, const std::string& target) const {
  auto it = routes_.find(percent_decode(target.substr(0, target.find('?'))));
  return it != routes_.end() && it->second.blocking && it->second.methods.count(method);
}

bool HttpServer::process_and_close_socket(socket_t sock) {
  ::fcntl(sock, F_SETFL, ::fcntl(sock, F_GETFL) | O_NONBLOCK);
  if (stopping_ || open_.load() >= options_.max_connections) {
    send_all(sock, error_reply(503, "the server is at its connection limit or shutting down"), {});
    ::close(sock);
    return false;
  }
  int yes = 1;
  ::setsockopt(sock, IPPROTO_TCP, TCP_NODELAY, &yes, sizeof(yes));  // streamed tokens leave at once
  ++open_;
  auto c = std::make_shared<Connection>();
  c->fd = sock;
  c->deadline = Clock::now() + seconds(options_.request_timeout_s);
  hand_to_reactor(std::move(c));
  return true;
}

void HttpServer::hand_to_reactor(std::shared_ptr<Connection> c) {
  c->fresh = true;
  {
    std::lock_guard lock(incoming_m_);
    incoming_.push_back(std::move(c));  // after the reactor stopped: closed by serve()
  }
  wake();
}

void HttpServer::close_connection(Connection& c) {
  if (c.fd < 0) return;
  ::close(c.fd);
  c.fd = -1;
  --open_;
}

// Note [Reactor]: one thread polls every connection that is between requests or in the middle of
// one and buffers what arrives (at most the head limit plus max_request_bytes). When the unread
// bytes hold a whole request (the blank line after the headers, then Content-Length bytes) the
// connection goes to a pool thread, which runs httplib's process_request over the buffer and
// hands the connection back for the next request (keep-alive; pipelined bytes stay buffered).
// So a thread is only ever taken by a request that has fully arrived: slow or idle clients cost a
// buffer and a descriptor, bounded by max_connections and the timeouts. A request without
// Content-Length has no body (RFC 9112 6.3): the reactor adds "Content-Length: 0" so that httplib
// does not read to the end of the stream. Chunked bodies would need a streaming limit: 411. An
// error the reactor finds itself (408, 411, 413, 431) is answered at once with Connection: close;
// what the client still sends is read and dropped for a few seconds (so that it reads the reply
// rather than a reset), then the connection is closed.
void HttpServer::reactor_loop() {
  std::vector<std::shared_ptr<Connection>> conns, keep;
  std::vector<pollfd> fds;
  std::vector<char> buf(64u << 10);
  const size_t cap = kMaxHeadBytes + options_.max_request_bytes + 1;
  const size_t budget = std::max<size_t>(64u << 20, 8 * options_.max_request_bytes);
  while (!stopping_) {
    bool fresh = false;
    {
      std::lock_guard lock(incoming_m_);
      for (auto& c : incoming_) {
        fresh = fresh || c->unread() > 0;
        conns.push_back(std::move(c));
      }
      incoming_.clear();
    }
    // Past the budget, partly received requests wait (their deadlines still run) while idle
    // connections and those being drained are read: memory stays bounded whatever the clients do.
    size_t buffered = 0;
    for (auto& c : conns) buffered += c->in.size();
    fds.assign(1, pollfd{wake_[0], POLLIN, 0});
    for (auto& c : conns) {
      const bool want = c->draining || (c->unread() < cap && (buffered < budget || c->unread() == 0));
      fds.push_back({c->fd, short(want ? POLLIN : 0), 0});
    }
    int n;
    do {
      n = ::poll(fds.data(), fds.size(), fresh ? 0 : 100);
    } while (n < 0 && errno == EINTR);
    if (fds[0].revents & POLLIN)
      while (::read(wake_[0], buf.data(), buf.size()) > 0) {
      }
    const auto now = Clock::now();
    keep.clear();
    for (size_t i = 0; i < conns.size(); ++i) {
      std::shared_ptr<Connection>& c = conns[i];
      bool arrived = std::exchange(c->fresh, false);
      if (fds[i + 1].revents) {
        for (int reads = 0; reads < 16 && !c->eof && !c->broken; ++reads) {
          const size_t room = c->draining ? buf.size() : std::min(buf.size(), cap - std::min(cap, c->unread()));
          if (room == 0) break;
          const ssize_t got = ::recv(c->fd, buf.data(), room, 0);
          if (got > 0) {
            arrived = true;
            if (!c->draining) c->in.append(buf.data(), size_t(got));
          } else if (got == 0) {
            c->eof = true;
          } else if (errno != EINTR) {
            c->broken = errno != EAGAIN && errno != EWOULDBLOCK;
            break;
          }
        }
      }
      if (c->broken || (c->draining && (c->eof || now >= c->deadline))) {
        close_connection(*c);
        continue;
      }
      if (c->draining) {
        keep.push_back(c);
        continue;
      }
      if (c->unread() > 0 && !c->receiving) {
        c->receiving = true;
        c->continued = false;
        c->deadline = now + seconds(options_.request_timeout_s);
      }
      Head h = arrived && c->unread() > 0 ? inspect(c->pending(), options_.max_request_bytes) : Head{};
      if (h.kind == Head::Partial && h.expect && !c->continued) {
        c->continued = send_all(c->fd, "HTTP/1.1 100 Continue\r\n\r\n", {});
      }
      if (h.kind == Head::Complete) {
        if (h.expect && c->continued) c->in[c->pos + *h.expect] = 'X';  // answered here: "Xxpect" for httplib
        if (h.no_length) c->in.insert(c->pos + h.head_end - 2, "Content-Length: 0\r\n");
        const bool blocking = blocking_route(h.method, h.target);
        (blocking ? workers_ : control_)->enqueue([this, c] { serve_request(c); });
        continue;
      }
      if (h.kind == Head::Partial && (c->eof || now >= c->deadline)) {
        if (!c->receiving || c->eof) {
          close_connection(*c);
          continue;
        }
        h = reject(408, fmt::format("the request did not arrive within {} s", options_.request_timeout_s));
      }
      if (h.kind == Head::Reject) {
        send_all(c->fd, error_reply(h.status, h.message), {});  // the reactor never waits on a client
        ::shutdown(c->fd, SHUT_WR);
        c->draining = true;
        c->deadline = now + seconds(kLingerSeconds);
      }
      keep.push_back(c);
    }
    conns.swap(keep);
  }
  for (auto& c : conns) close_connection(*c);
}

void HttpServer::serve_request(const std::shared_ptr<Connection>& c) {
  ConnectionStream stream(*c, options_.write_timeout_s);
  c->probed = false;
  const bool last = stopping_ || c->eof || ++c->served >= keep_alive_max_count_;
  bool closed = false;
  t_connection = c.get();
  bool ok = false;
  try {
    ok = process_request(stream, last, closed, nullptr);  // handlers' exceptions are caught inside
  } catch (const std::exception& e) {
    std::fprintf(stderr, "HTTP request failed: %s\n", e.what());
  }
  t_connection = nullptr;
  if (!ok || closed || last || c->broken || c->eof) {
    close_connection(*c);
    return;
  }
  c->compact();
  c->receiving = c->unread() > 0;
  c->continued = false;
  c->deadline = Clock::now() + seconds(c->receiving ? options_.request_timeout_s : options_.keep_alive_timeout_s);
  hand_to_reactor(c);
}

// Note [Hang-up probe]: a client that closes its connection and one that only shuts its sending
// side after the request (and still waits for the reply) look the same from here: a FIN. Writing
// tells them apart: a closed socket answers with a reset. So when a FIN has arrived, the server
// writes an interim "HTTP/1.1 100 Continue" once (HTTP/1.1 clients must accept 1xx responses
// before the final one; none is sent to HTTP/1.0 clients, which then count as present); a closed
// client's reset then shows as POLLHUP/POLLERR on a later call, while a half-closed client reads
// and ignores the 100 and gets its reply.
bool HttpServer::client_gone(const httplib::Request& req) {
  Connection* c = t_connection;
  if (!c || c->fd < 0) return false;
  if (c->broken) return true;
  const short ev = wait_for(c->fd, POLLIN | POLLRDHUP, {});
  if (ev & (POLLERR | POLLHUP)) return true;
  if (!(ev & POLLRDHUP) || req.version != "HTTP/1.1") return false;
  if (!c->probed) {
    c->probed = true;
    if (!send_all(c->fd, "HTTP/1.1 100 Continue\r\n\r\n", seconds(1))) return true;
  }
  return false;
}

}  // namespace megatron
