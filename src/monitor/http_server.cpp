#include "monitor/http_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>

#include "core/error.h"

namespace keel::http {

namespace {

// RFC 9110 5.6.2: the characters of a token (method, header field name).
bool is_tchar(unsigned char c) {
  return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
         (c != '\0' && std::strchr("!#$%&'*+-.^_`|~", c) != nullptr);
}

bool is_token(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return is_tchar(static_cast<unsigned char>(c)); });
}

// A byte that may appear in a request line: visible ASCII and the separating spaces.
bool is_request_line_byte(unsigned char c) { return c >= 0x20 && c < 0x7f; }

// A byte that may appear in a header field line: visible ASCII, spaces, tabs and obs-text.
bool is_field_byte(unsigned char c) { return c == '\t' || (c >= 0x20 && c != 0x7f); }

bool iequals(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) == std::tolower(static_cast<unsigned char>(y));
         });
}

std::string_view trim_ows(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

const char* reason(int status) {
  switch (status) {
    case 200: return "OK";
    case 400: return "Bad Request";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 414: return "URI Too Long";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 503: return "Service Unavailable";
    case 505: return "HTTP Version Not Supported";
    default: return "Error";
  }
}

const char* explanation(int status) {
  switch (status) {
    case 400: return "malformed request";
    case 404: return "not found; Keel's metrics are at /metrics";
    case 405:
    case 501: return "only GET and HEAD are served";
    case 408: return "no complete request in time";
    case 414: return "request line too long";
    case 431: return "request header fields too large";
    case 500: return "the metrics could not be collected";
    case 503: return "too many connections";
    case 505: return "only HTTP/1.0 and HTTP/1.1 are served";
    default: return "";
  }
}

std::string response(int status, const char* content_type, const std::string& body, bool head_only, bool close,
                     bool allow) {
  std::string r = "HTTP/1.1 " + std::to_string(status) + " " + reason(status) + "\r\nContent-Type: " + content_type +
                  "\r\nContent-Length: " + std::to_string(body.size()) + "\r\n";
  if (allow) r += "Allow: GET, HEAD\r\n";
  r += close ? "Connection: close\r\n\r\n" : "Connection: keep-alive\r\n\r\n";
  if (!head_only) r += body;
  return r;
}

Answer reply(int status, size_t consumed, bool close, bool head_only = false, bool allow = false) {
  Answer a;
  a.consumed = consumed;
  a.status = status;
  a.close = close;
  a.response = response(status, "text/plain; charset=utf-8", std::to_string(status) + " " + reason(status) + ": " +
                                                               explanation(status) + "\n",
                        head_only, close, allow);
  return a;
}

Answer need_more() {
  Answer a;
  a.need_more = true;
  return a;
}

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// The path of a request target (origin-form, or absolute-form with its scheme and authority
// dropped), without query or fragment, percent-decoded; false for a bad %-escape.
bool target_path(std::string_view target, std::string& path) {
  for (std::string_view scheme : {"http://", "https://"}) {
    if (target.size() >= scheme.size() && iequals(target.substr(0, scheme.size()), scheme)) {
      const size_t slash = target.find('/', scheme.size());
      target = slash == std::string_view::npos ? std::string_view("/") : target.substr(slash);
      break;
    }
  }
  target = target.substr(0, std::min(target.find('?'), target.find('#')));
  path.clear();
  for (size_t i = 0; i < target.size(); ++i) {
    if (target[i] != '%') {
      path += target[i];
      continue;
    }
    if (i + 2 >= target.size() || hex_value(target[i + 1]) < 0 || hex_value(target[i + 2]) < 0) return false;
    path += static_cast<char>(hex_value(target[i + 1]) * 16 + hex_value(target[i + 2]));
    i += 2;
  }
  return true;
}

const char* const kIndexPage =
    "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>Keel</title></head>\n"
    "<body><p>Keel's Prometheus metrics: <a href=\"/metrics\">/metrics</a></p></body></html>\n";

}  // namespace

std::string error_response(int status) { return reply(status, 0, true).response; }

Answer answer(std::string_view input, const MetricsText& metrics) {
  // Only the first kMaxHeadBytes count: a head that does not end within them is refused whatever follows.
  const bool over_limit = input.size() >= kMaxHeadBytes;
  input = input.substr(0, kMaxHeadBytes);
  // Empty lines before a request line are ignored (RFC 9112 2.2).
  size_t start = 0;
  while (start < input.size() && (input[start] == '\r' || input[start] == '\n')) ++start;

  // The request line: every byte is checked as it arrives, so binary garbage (a TLS hello, an
  // HTTP/2 frame) is answered without waiting for a line end that may never come.
  const size_t line_end = input.find('\n', start);
  const size_t scanned = line_end == std::string_view::npos ? input.size() : line_end;
  for (size_t i = start; i < scanned; ++i) {
    const unsigned char c = static_cast<unsigned char>(input[i]);
    const bool final_cr = c == '\r' && i + 1 == line_end;
    if (!is_request_line_byte(c) && !final_cr) {
      // (a CR as the last byte so far may be the start of CRLF)
      if (c == '\r' && i + 1 == input.size()) break;
      return reply(400, i + 1, true);
    }
  }
  if (line_end == std::string_view::npos) return over_limit ? reply(414, input.size(), true) : need_more();
  std::string_view line = input.substr(start, line_end - start);
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);

  const size_t sp1 = line.find(' ');
  const size_t sp2 = sp1 == std::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
  const std::string_view method = line.substr(0, sp1);
  if (sp1 != std::string_view::npos && sp2 == std::string_view::npos && is_token(method) && sp1 + 1 < line.size()) {
    return reply(505, line_end + 1, true);  // "GET /path": HTTP/0.9
  }
  if (sp2 == std::string_view::npos) return reply(400, line_end + 1, true);
  const std::string_view target = line.substr(sp1 + 1, sp2 - sp1 - 1);
  const std::string_view version = line.substr(sp2 + 1);
  if (!is_token(method) || target.empty() || target.find(' ') != std::string_view::npos) {
    return reply(400, line_end + 1, true);
  }
  if (version.size() != 8 || version.substr(0, 5) != "HTTP/" || !std::isdigit(static_cast<unsigned char>(version[5])) ||
      version[6] != '.' || !std::isdigit(static_cast<unsigned char>(version[7]))) {
    return reply(400, line_end + 1, true);
  }
  if (version != "HTTP/1.1" && version != "HTTP/1.0") return reply(505, line_end + 1, true);
  const bool http10 = version == "HTTP/1.0";

  // Header fields, up to the empty line.
  bool close_asked = false, keep_alive_asked = false, has_body = false;
  size_t at = line_end + 1;
  for (;;) {
    const size_t lf = input.find('\n', at);
    const size_t end = lf == std::string_view::npos ? input.size() : lf;
    for (size_t i = at; i < end; ++i) {
      const unsigned char c = static_cast<unsigned char>(input[i]);
      if (is_field_byte(c) || (c == '\r' && (i + 1 == lf || i + 1 == input.size()))) continue;
      return reply(400, i + 1, true);
    }
    if (lf == std::string_view::npos) return over_limit ? reply(431, input.size(), true) : need_more();
    std::string_view field = input.substr(at, lf - at);
    if (!field.empty() && field.back() == '\r') field.remove_suffix(1);
    at = lf + 1;
    if (field.empty()) break;
    if (field.front() == ' ' || field.front() == '\t') return reply(400, at, true);  // obsolete line folding
    const size_t colon = field.find(':');
    if (colon == std::string_view::npos || !is_token(field.substr(0, colon))) return reply(400, at, true);
    const std::string_view name = field.substr(0, colon);
    const std::string_view value = trim_ows(field.substr(colon + 1));
    if (iequals(name, "connection")) {
      for (std::string_view rest = value; !rest.empty();) {
        const size_t comma = rest.find(',');
        const std::string_view option = trim_ows(rest.substr(0, comma));
        close_asked = close_asked || iequals(option, "close");
        keep_alive_asked = keep_alive_asked || iequals(option, "keep-alive");
        rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
      }
    } else if (iequals(name, "content-length")) {
      if (value.empty() || !std::all_of(value.begin(), value.end(), [](char c) { return c >= '0' && c <= '9'; })) {
        return reply(400, at, true);
      }
      has_body = has_body || value.find_first_not_of('0') != std::string_view::npos;
    } else if (iequals(name, "transfer-encoding")) {
      has_body = true;
    }
  }
  const size_t consumed = at;
  // A body is never read: the connection closes after the answer rather than parse it as a request.
  const bool close = close_asked || has_body || (http10 && !keep_alive_asked);

  const bool head_only = method == "HEAD";
  if (method != "GET" && !head_only) {
    static const char* const kStandard[] = {"POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"};
    const bool standard =
        std::any_of(std::begin(kStandard), std::end(kStandard), [&](const char* m) { return method == m; });
    return reply(standard ? 405 : 501, consumed, true, false, true);
  }
  std::string path;
  if (!target_path(target, path)) return reply(400, consumed, true, head_only);
  Answer a;
  a.consumed = consumed;
  a.close = close;
  if (path == "/metrics") {
    std::string body;
    try {
      body = metrics();
    } catch (const std::exception&) {
      return reply(500, consumed, true, head_only);
    }
    a.status = 200;
    a.response = response(200, "text/plain; version=0.0.4; charset=utf-8", body, head_only, close, false);
  } else if (path == "/") {
    a.status = 200;
    a.response = response(200, "text/html; charset=utf-8", kIndexPage, head_only, close, false);
  } else {
    return reply(404, consumed, close, head_only);
  }
  return a;
}

// ---------------------------------------------------------------------------------------------
// The server

namespace {

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct Connection {
  int fd = -1;
  std::string in;        // received bytes not yet answered (at most kMaxHeadBytes)
  std::string out;       // the response being written
  size_t out_at = 0;     // bytes of `out` already sent
  bool closing = false;  // close once `out` is sent
  bool peer_done = false;  // the client has shut down its side
  bool lingering = false;  // response sent, our side shut down: discarding the client's leftovers
  bool dead = false;
  size_t lingered_bytes = 0;
  int64_t deadline_ms = 0;
};

// What a closing connection reads and discards at most (a request body, the rest of an oversized head).
constexpr size_t kMaxLingerBytes = size_t{4} << 20;

void close_connection(Connection& c) {
  if (c.fd >= 0) ::close(c.fd);
  c.fd = -1;
  c.dead = true;
}

}  // namespace

Server::Server(const ServerOptions& options, MetricsText metrics) : options_(options), metrics_(std::move(metrics)) {
  std::string host = options.bind;
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  const bool v6_literal = host.find(':') != std::string::npos;
  const std::string shown_host = v6_literal ? "[" + host + "]" : host;
  address_ = shown_host + ":" + std::to_string(options.port);
  auto fail = [&](const std::string& why) {
    for (int fd : listeners_) ::close(fd);
    listeners_.clear();
    throw Error("cannot listen on " + address_ + " (" + why + ")");
  };

  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const int gai = ::getaddrinfo(host.c_str(), std::to_string(options.port).c_str(), &hints, &found);
  if (gai != 0) fail(std::string("address not found: ") + ::gai_strerror(gai));
  const std::unique_ptr<addrinfo, void (*)(addrinfo*)> owned(found, ::freeaddrinfo);
  std::string first_error;
  int port = options.port;
  for (const addrinfo* ai = found; ai != nullptr; ai = ai->ai_next) {
    if (ai->ai_family != AF_INET && ai->ai_family != AF_INET6) continue;
    const int fd = ::socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      if (first_error.empty()) first_error = std::strerror(errno);
      continue;
    }
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (ai->ai_family == AF_INET6) ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof one);
    sockaddr_storage where{};
    std::memcpy(&where, ai->ai_addr, ai->ai_addrlen);
    // With port 0 every address of a name gets the port the first one was given.
    if (ai->ai_family == AF_INET) reinterpret_cast<sockaddr_in&>(where).sin_port = htons(static_cast<uint16_t>(port));
    if (ai->ai_family == AF_INET6) reinterpret_cast<sockaddr_in6&>(where).sin6_port = htons(static_cast<uint16_t>(port));
    if (::bind(fd, reinterpret_cast<sockaddr*>(&where), ai->ai_addrlen) != 0 || ::listen(fd, 128) != 0) {
      const int err = errno;
      ::close(fd);
      // A port in use is an error even if another address of the name could be had.
      if (err == EADDRINUSE || err == EACCES) fail(std::strerror(err));
      if (first_error.empty()) first_error = std::strerror(err);
      continue;
    }
    if (port == 0) {
      sockaddr_storage bound{};
      socklen_t len = sizeof bound;
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
      port = ntohs(bound.ss_family == AF_INET ? reinterpret_cast<sockaddr_in&>(bound).sin_port
                                              : reinterpret_cast<sockaddr_in6&>(bound).sin6_port);
    }
    listeners_.push_back(fd);
  }
  if (listeners_.empty()) fail(first_error.empty() ? "no IPv4 or IPv6 address" : first_error);
  port_ = port;
  address_ = shown_host + ":" + std::to_string(port_);

  int pipe_fds[2];
  if (::pipe2(pipe_fds, O_NONBLOCK | O_CLOEXEC) != 0) fail(std::string("pipe: ") + std::strerror(errno));
  wake_read_ = pipe_fds[0];
  wake_write_ = pipe_fds[1];

  // The thread takes no signals (the training thread handles them) and has a stack of its own size.
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setstacksize(&attr, size_t{1} << 20);
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  const int rc = pthread_create(&thread_, &attr, &Server::thread_main, this);
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  pthread_attr_destroy(&attr);
  if (rc != 0) {
    ::close(wake_read_);
    ::close(wake_write_);
    fail(std::string("thread: ") + std::strerror(rc));
  }
  thread_started_ = true;
}

Server::~Server() {
  if (thread_started_) {
    const char byte = 0;
    while (::write(wake_write_, &byte, 1) < 0 && errno == EINTR) {
    }
    pthread_join(thread_, nullptr);
  }
  for (int fd : listeners_) ::close(fd);
  if (wake_read_ >= 0) ::close(wake_read_);
  if (wake_write_ >= 0) ::close(wake_write_);
}

void* Server::thread_main(void* self) {
  // A flood of requests takes CPU time from this thread's share, not from training's threads.
  ::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), 10);
  static_cast<Server*>(self)->serve();
  return nullptr;
}

void Server::serve() {
  std::vector<Connection> connections;
  std::vector<pollfd> fds;
  int64_t accept_paused_until_ms = 0;  // out of file descriptors: the listeners rest a moment
  char scratch[16384];

  // Queues the answer to the next request in c.in, if nothing else is being written.
  auto answer_pending = [&](Connection& c, int64_t now) {
    while (!c.closing && c.out.empty()) {
      Answer a;
      try {
        a = answer(c.in, metrics_);
      } catch (const std::exception&) {  // out of memory: this connection is dropped
        close_connection(c);
        return;
      }
      if (a.need_more) {
        if (c.peer_done) close_connection(c);  // an incomplete request and no more to come
        return;
      }
      c.in.erase(0, a.consumed);
      c.out = std::move(a.response);
      c.out_at = 0;
      c.closing = a.close;
      c.deadline_ms = now + options_.write_timeout_ms;
    }
  };
  auto queue_closing = [&](Connection& c, int status, int64_t now) {
    c.out = error_response(status);
    c.out_at = 0;
    c.closing = true;
    c.deadline_ms = now + options_.write_timeout_ms;
  };
  auto write_out = [&](Connection& c, int64_t now) {
    while (c.out_at < c.out.size()) {
      const ssize_t n = ::send(c.fd, c.out.data() + c.out_at, c.out.size() - c.out_at, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        c.out_at += static_cast<size_t>(n);
      } else if (n < 0 && errno == EINTR) {
        continue;
      } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        return;
      } else {
        close_connection(c);
        return;
      }
    }
    c.out.clear();
    c.out_at = 0;
    if (c.closing) {
      ::shutdown(c.fd, SHUT_WR);
      c.lingering = true;
      c.deadline_ms = now + options_.linger_ms;
    } else if (c.peer_done && c.in.empty()) {
      close_connection(c);
    } else {
      c.deadline_ms = now + options_.head_timeout_ms;
    }
  };
  // Reads what the client sent, up to a head's worth; while lingering, discards a few chunks per
  // call (one client cannot keep the thread to itself) and gives up after kMaxLingerBytes.
  auto read_in = [&](Connection& c) {
    for (int chunks = 0; chunks < 4; ++chunks) {
      const size_t room = c.lingering ? sizeof scratch : std::min(sizeof scratch, kMaxHeadBytes - c.in.size());
      if (room == 0) return;
      const ssize_t n = ::recv(c.fd, scratch, room, MSG_DONTWAIT);
      if (n > 0) {
        if (!c.lingering) c.in.append(scratch, static_cast<size_t>(n));
        c.lingered_bytes += c.lingering ? static_cast<size_t>(n) : 0;
        if (c.lingered_bytes > kMaxLingerBytes) {
          close_connection(c);
          return;
        }
      } else if (n < 0 && errno == EINTR) {
        continue;
      } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        return;
      } else if (n == 0 && !c.lingering) {
        c.peer_done = true;
        return;
      } else {
        close_connection(c);
        return;
      }
    }
  };

  for (;;) {
    const int64_t before = now_ms();
    fds.clear();
    fds.push_back({wake_read_, POLLIN, 0});
    const bool accepting = before >= accept_paused_until_ms;
    for (int fd : listeners_) fds.push_back({fd, static_cast<short>(accepting ? POLLIN : 0), 0});
    int64_t next_ms = accepting ? before + 60000 : accept_paused_until_ms;
    for (const Connection& c : connections) {
      short events = 0;
      if (c.lingering) {
        events = POLLIN;
      } else if (!c.out.empty()) {
        events = POLLOUT;
      } else if (!c.peer_done && c.in.size() < kMaxHeadBytes) {
        events = POLLIN;
      }
      fds.push_back({c.fd, events, 0});
      next_ms = std::min(next_ms, c.deadline_ms);
    }
    const int timeout_ms = static_cast<int>(std::clamp<int64_t>(next_ms - before, 0, 60000));
    const int ready = ::poll(fds.data(), fds.size(), timeout_ms);
    if (ready < 0 && errno != EINTR) return;  // (only EFAULT, EINVAL or ENOMEM: nothing to serve with)
    if (ready > 0 && (fds[0].revents & POLLIN)) break;
    const int64_t now = now_ms();

    for (size_t i = 0; i < connections.size(); ++i) {
      Connection& c = connections[i];
      const short revents = fds[1 + listeners_.size() + i].revents;
      if (revents == 0 || c.dead) continue;
      if (c.lingering) {
        read_in(c);
        continue;
      }
      if (revents & (POLLIN | POLLHUP | POLLERR)) {
        if (c.out.empty()) read_in(c);
        if ((revents & POLLERR) && !c.dead && c.in.empty()) close_connection(c);
      }
      // Pipelined requests are answered one after another while the client takes the answers
      // (at most a head's worth of them: reading waits until they are done).
      while (!c.dead) {
        answer_pending(c, now);
        if (c.dead || c.out.empty()) break;
        write_out(c, now);
        if (c.dead || !c.out.empty() || c.lingering) break;
      }
    }
    for (Connection& c : connections) {
      if (c.dead || now < c.deadline_ms) continue;
      if (c.lingering || !c.out.empty()) {
        close_connection(c);  // done lingering, or a client that does not take its answer
      } else if (c.in.empty()) {
        close_connection(c);  // idle keep-alive
      } else {
        queue_closing(c, 408, now);  // a request head that did not arrive in time
        write_out(c, now);
      }
    }
    connections.erase(std::remove_if(connections.begin(), connections.end(), [](const Connection& c) { return c.dead; }),
                      connections.end());

    for (size_t l = 0; l < listeners_.size() && accepting; ++l) {
      if (!(fds[1 + l].revents & POLLIN)) continue;
      for (;;) {
        const int fd = ::accept4(listeners_[l], nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
          if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
            accept_paused_until_ms = now + 100;
          }
          break;  // EAGAIN, or a connection that died while queued (ECONNABORTED): next time
        }
        if (connections.size() >= options_.max_connections) {
          const std::string busy = error_response(503);
          (void)!::send(fd, busy.data(), busy.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
          ::close(fd);
          continue;
        }
        Connection c;
        c.fd = fd;
        c.deadline_ms = now + options_.head_timeout_ms;
        connections.push_back(std::move(c));
      }
    }
    open_connections_.store(connections.size());
  }
  for (Connection& c : connections) close_connection(c);
}

}  // namespace keel::http
