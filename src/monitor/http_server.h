// The metrics endpoint's HTTP/1.1 server: one thread of Keel's own (an explicit 1 MiB stack, so
// the static TLS of the libraries linked in, OpenBLAS's ~60 KB, never eats it), non-blocking
// sockets and poll(). A client can only cost the server a bounded buffer and a deadline: the
// request head must arrive within head_timeout_ms (else 408) and within kMaxHeadBytes (else 431),
// a response must be taken within write_timeout_ms (else the connection is dropped), and beyond
// max_connections a client gets 503 at once. Training never waits on it: the page is made on the
// server's thread by the callback it was given, and that thread runs at nice 10, so a flood of
// requests costs its own share of the CPU rather than training's.
//
// Request handling is a pure function, `answer`, from the bytes a client has sent to the bytes
// of the response (fuzz/fuzz_http.cpp and tests/http_server_test.cpp drive it without sockets).
#pragma once

#include <pthread.h>

#include <atomic>
#include <cstddef>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace keel::http {

// A request head (request line and header fields, up to the empty line) longer than this gets
// 431 (a request line alone this long: 414).
constexpr size_t kMaxHeadBytes = 8192;

// The exposition text for GET /metrics, made when asked (on the server's thread).
using MetricsText = std::function<std::string()>;

// What to do with the bytes a client has sent so far on a connection.
struct Answer {
  bool need_more = false;  // no complete request head yet, and nothing wrong so far: read more
  size_t consumed = 0;     // bytes of the input the request took (its head); the rest is the next request
  int status = 0;          // the response's status code
  std::string response;    // the whole response: status line, header fields, body (none for HEAD)
  bool close = false;      // close the connection once the response is written
};

// The answer to the request at the front of `input`:
//   GET or HEAD /metrics (any query) -> 200 text/plain; version=0.0.4, the body from `metrics`
//     (500 if it throws); GET or HEAD / -> 200, a small HTML page linking /metrics; other paths -> 404;
//   other standard methods -> 405, an unknown method -> 501 (both with Allow: GET, HEAD);
//   a malformed request line or header field -> 400; a version other than HTTP/1.0 or 1.1 -> 505
//   (HTTP/0.9's two-word line too); a head over kMaxHeadBytes -> 431 (414 for the request line).
// need_more only while the input is a valid beginning of a request head shorter than kMaxHeadBytes;
// a byte that cannot belong to a request line is answered at once, without waiting for the rest.
// Errors, a request with a body (never read), HTTP/1.0 without keep-alive and "Connection: close"
// close the connection. The decision depends only on input[0, consumed) (or on all of it when
// need_more): more bytes never change an answer already given.
Answer answer(std::string_view input, const MetricsText& metrics);

// A complete response with a short text body for `status` (408, 500, 503, ...), closing the connection.
std::string error_response(int status);

struct ServerOptions {
  std::string bind = "127.0.0.1";  // an IPv4 or IPv6 literal (::1 or [::1]) or a host name
  int port = 0;                    // 0: the kernel picks one (port() says which)
  size_t max_connections = 256;    // open connections; a client beyond them gets 503 and is closed
  int head_timeout_ms = 10000;     // from accept (or the previous response) to a complete request head
  int write_timeout_ms = 10000;    // from a response queued to the client having taken all of it
  int linger_ms = 2000;            // after a closing response: reading the client's leftovers, so
                                   // that closing does not reset the connection before it reads the answer
};

// Serves `answer` on every address `bind` resolves to, from a thread of its own, until destroyed.
class Server {
 public:
  // Listens at once on every address of options.bind (IPv6 sockets are v6-only); throws keel::Error
  // "cannot listen on ADDR (reason)" if an address is in use, or if none can be bound.
  Server(const ServerOptions& options, MetricsText metrics);
  // Stops the thread (it wakes from poll at once) and closes every connection.
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // HOST:PORT as a URL writes it ([::1]:9100 for IPv6).
  const std::string& address() const { return address_; }
  int port() const { return port_; }
  // The connections the server holds open, as of its last pass over them (it passes after any
  // event: a connection, bytes, a close, a deadline).
  size_t open_connections() const { return open_connections_.load(); }

 private:
  static void* thread_main(void* self);
  void serve();

  ServerOptions options_;
  MetricsText metrics_;
  std::string address_;
  int port_ = 0;
  std::vector<int> listeners_;
  int wake_read_ = -1, wake_write_ = -1;
  std::atomic<size_t> open_connections_{0};
  pthread_t thread_{};
  bool thread_started_ = false;
};

}  // namespace keel::http
