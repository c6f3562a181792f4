// The metrics endpoint's HTTP server (monitor/http_server.h): the request handling as a function
// of bytes; the server over real loopback sockets (slow, idle, oversized and never-reading
// clients, a full house, IPv6); and a live `keel train` whose endpoint takes a battery of hostile
// and careless requests while Debian's Prometheus scrapes it, and still ends with the same
// checkpoint bytes as a run nobody talked to.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/fileio.h"
#include "monitor/http_server.h"
#include "test_util.h"

namespace keel {
namespace {

using http::Answer;

const std::string kExposition = "# HELP keel_step Optimizer steps done\n# TYPE keel_step gauge\nkeel_step 7\n";

Answer ask(const std::string& request) {
  return http::answer(request, [] { return kExposition; });
}

std::string field(const std::string& response, const std::string& name) {
  const std::string key = "\r\n" + name + ": ";
  const size_t at = response.find(key);
  if (at == std::string::npos || at > response.find("\r\n\r\n")) return "";
  return response.substr(at + key.size(), response.find("\r\n", at + key.size()) - at - key.size());
}

std::string body_of(const std::string& response) {
  const size_t end = response.find("\r\n\r\n");
  return end == std::string::npos ? "" : response.substr(end + 4);
}

TEST(HttpAnswer, MetricsAndTheIndexPageAreServedToGetAndHead) {
  const Answer get = ask("GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:9100\r\nAccept: */*\r\n\r\n");
  ASSERT_FALSE(get.need_more);
  EXPECT_EQ(get.status, 200);
  EXPECT_EQ(get.response, "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\nContent-Length: " +
                              std::to_string(kExposition.size()) + "\r\nConnection: keep-alive\r\n\r\n" + kExposition);
  EXPECT_FALSE(get.close);
  const Answer head = ask("HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_EQ(head.status, 200);
  EXPECT_EQ(head.response, get.response.substr(0, get.response.size() - kExposition.size()));
  const Answer index = ask("GET / HTTP/1.1\r\n\r\n");
  EXPECT_EQ(index.status, 200);
  EXPECT_EQ(field(index.response, "Content-Type"), "text/html; charset=utf-8");
  EXPECT_NE(body_of(index.response).find("<a href=\"/metrics\">"), std::string::npos) << index.response;
  EXPECT_EQ(field(index.response, "Content-Length"), std::to_string(body_of(index.response).size()));
  // A query, %-escapes of plain characters and the absolute form name the same page.
  for (const char* target : {"/metrics?x=1", "/metrics#top", "/%6D%65trics", "http://127.0.0.1:9100/metrics"}) {
    EXPECT_EQ(ask(std::string("GET ") + target + " HTTP/1.1\r\n\r\n").status, 200) << target;
  }
  // Leading empty lines are ignored.
  EXPECT_EQ(ask("\r\n\r\nGET /metrics HTTP/1.1\r\n\r\n").status, 200);
  // A page that cannot be made: 500, and the connection closes.
  const Answer failed = http::answer("GET /metrics HTTP/1.1\r\n\r\n", []() -> std::string { throw Error("gone"); });
  EXPECT_EQ(failed.status, 500);
  EXPECT_TRUE(failed.close);
}

TEST(HttpAnswer, OtherPathsAre404AndOtherMethods405Or501) {
  for (const char* target : {"/favicon.ico", "/../metrics", "/metrics/", "/metrics/..", "/%2e%2e/metrics", "*",
                             "/%00", "/metricsx"}) {
    const Answer a = ask(std::string("GET ") + target + " HTTP/1.1\r\n\r\n");
    EXPECT_EQ(a.status, 404) << target;
    EXPECT_FALSE(a.close) << target;  // a browser asks for /favicon.ico and goes on
    EXPECT_EQ(field(a.response, "Content-Length"), std::to_string(body_of(a.response).size())) << target;
  }
  EXPECT_EQ(ask(std::string("GET /") + std::string(7000, 'a') + " HTTP/1.1\r\n\r\n").status, 404);
  for (const char* method : {"POST", "PUT", "DELETE", "OPTIONS", "PATCH", "TRACE", "CONNECT"}) {
    const Answer a = ask(std::string(method) + " /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
    EXPECT_EQ(a.status, 405) << method;
    EXPECT_EQ(field(a.response, "Allow"), "GET, HEAD") << method;
    EXPECT_TRUE(a.close) << method;
  }
  EXPECT_EQ(ask("OPTIONS * HTTP/1.1\r\n\r\n").status, 405);
  EXPECT_EQ(ask("CONNECT 127.0.0.1:443 HTTP/1.1\r\n\r\n").status, 405);
  EXPECT_EQ(ask("get /metrics HTTP/1.1\r\n\r\n").status, 501);  // methods are case-sensitive
  EXPECT_EQ(ask("BREW /metrics HTTP/1.1\r\n\r\n").status, 501);
  EXPECT_EQ(field(ask("BREW /metrics HTTP/1.1\r\n\r\n").response, "Allow"), "GET, HEAD");
}

TEST(HttpAnswer, MalformedRequestsAre400AndOtherVersions505) {
  for (const std::string& request :
       {std::string("GET\r\n\r\n"), std::string("GET  /metrics HTTP/1.1\r\n\r\n"), std::string("GET /metrics HTTP/1.1 x\r\n\r\n"),
        std::string("GET /metrics http/1.1\r\n\r\n"), std::string("GET /metrics HTTP/1.1x\r\n\r\n"),
        std::string("GET /metrics HTTP/2\r\n\r\n"), std::string("G@T /metrics HTTP/1.1\r\n\r\n"),
        std::string("GET /metrics HTTP/1.1\r\nNoColon\r\n\r\n"), std::string("GET /metrics HTTP/1.1\r\nName : v\r\n\r\n"),
        std::string("GET /metrics HTTP/1.1\r\n: v\r\n\r\n"), std::string("GET /metrics HTTP/1.1\r\nA: b\r\n c\r\n\r\n"),
        std::string("GET /metrics HTTP/1.1\r\nContent-Length: -1\r\n\r\n"),
        std::string("GET /metrics HTTP/1.1\r\nContent-Length: 1 2\r\n\r\n"), std::string("GET /%zz HTTP/1.1\r\n\r\n"),
        std::string("GET /%4 HTTP/1.1\r\n\r\n"), std::string("GET /metrics HTTP/1.1\r\nA: b\x01\r\n\r\n"),
        std::string("GET /metrics HTTP/1.1\r\nA: b\rc\r\n\r\n"), std::string("GET /m\x80 HTTP/1.1\r\n\r\n"),
        std::string("GET /\rmetrics HTTP/1.1\r\n\r\n"), std::string("\x00\xff\r\n\r\n", 6)}) {
    const Answer a = ask(request);
    EXPECT_EQ(a.status, 400) << ::testing::PrintToString(request);
    EXPECT_TRUE(a.close) << ::testing::PrintToString(request);
  }
  // Bytes that cannot start a request line are answered at once (a TLS hello, binary noise).
  EXPECT_EQ(ask(std::string("\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", 11)).status, 400);
  EXPECT_EQ(ask(std::string("GET /metrics\0", 13)).status, 400);
  EXPECT_EQ(ask("GET /metrics\r\n").status, 505);  // HTTP/0.9
  EXPECT_EQ(ask("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").status, 505);  // HTTP/2's connection preface
  EXPECT_EQ(ask("GET /metrics HTTP/1.2\r\n\r\n").status, 505);
  EXPECT_EQ(ask("GET /metrics HTTP/0.9\r\n\r\n").status, 505);
  EXPECT_TRUE(ask("GET /metrics HTTP/3.0\r\n\r\n").close);
  // Header fields may carry obs-text and tabs.
  EXPECT_EQ(ask("GET /metrics HTTP/1.1\r\nUser-Agent: caf\xc3\xa9\t1\r\n\r\n").status, 200);
}

TEST(HttpAnswer, IncompleteHeadsWaitAndOversizedOnesAre414Or431) {
  const std::string request = "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: t\r\n\r\n";
  for (size_t n = 0; n < request.size(); ++n) {
    const Answer a = ask(request.substr(0, n));
    EXPECT_TRUE(a.need_more) << n;
    EXPECT_TRUE(a.response.empty()) << n;
  }
  EXPECT_EQ(ask(request).consumed, request.size());
  // Bare LF line ends are read too.
  EXPECT_EQ(ask("GET /metrics HTTP/1.1\nHost: x\n\n").status, 200);
  // A request line that does not end within the limit: 414, whatever follows.
  const std::string long_line = "GET /" + std::string(http::kMaxHeadBytes, 'a');
  EXPECT_EQ(ask(long_line).status, 414);
  EXPECT_EQ(ask(long_line + " HTTP/1.1\r\n\r\n").status, 414);
  EXPECT_TRUE(ask(long_line.substr(0, http::kMaxHeadBytes - 1)).need_more);
  // Header fields that do not end within the limit: 431.
  std::string many = "GET /metrics HTTP/1.1\r\n";
  while (many.size() < http::kMaxHeadBytes) many += "X-Filler: " + std::string(100, 'f') + "\r\n";
  EXPECT_EQ(ask(many).status, 431);
  EXPECT_EQ(ask(many + "\r\n").status, 431);
  EXPECT_EQ(ask("GET /metrics HTTP/1.1\r\nX: " + std::string(64 << 10, 'y') + "\r\n\r\n").status, 431);
  EXPECT_TRUE(ask("GET /metrics HTTP/1.1\r\nX: " + std::string(4000, 'y')).need_more);
  // A head of exactly the limit is served.
  std::string exact = "GET /metrics HTTP/1.1\r\nX: ";
  exact += std::string(http::kMaxHeadBytes - exact.size() - 4, 'z') + "\r\n\r\n";
  ASSERT_EQ(exact.size(), http::kMaxHeadBytes);
  EXPECT_EQ(ask(exact).status, 200);
}

TEST(HttpAnswer, ConnectionsCloseWhenAskedOnHttp10AndAfterABody) {
  EXPECT_FALSE(ask("GET /metrics HTTP/1.1\r\n\r\n").close);
  const Answer closing = ask("GET /metrics HTTP/1.1\r\nConnection: Close\r\n\r\n");
  EXPECT_TRUE(closing.close);
  EXPECT_EQ(field(closing.response, "Connection"), "close");
  EXPECT_TRUE(ask("GET /metrics HTTP/1.1\r\nConnection: TE, close\r\n\r\n").close);
  EXPECT_TRUE(ask("GET /metrics HTTP/1.0\r\n\r\n").close);
  const Answer kept = ask("GET /metrics HTTP/1.0\r\nConnection: keep-alive\r\n\r\n");
  EXPECT_FALSE(kept.close);
  EXPECT_EQ(field(kept.response, "Connection"), "keep-alive");
  // A body is never read: its bytes must not be taken for the next request.
  EXPECT_TRUE(ask("GET /metrics HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello").close);
  EXPECT_TRUE(ask("GET /metrics HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n").close);
  EXPECT_FALSE(ask("GET /metrics HTTP/1.1\r\nContent-Length: 000\r\n\r\n").close);
  // Pipelined requests: each answer takes its own head.
  const std::string two = "GET /favicon.ico HTTP/1.1\r\n\r\nHEAD /metrics HTTP/1.1\r\n\r\n";
  const Answer first = ask(two);
  EXPECT_EQ(first.status, 404);
  const Answer second = ask(two.substr(first.consumed));
  EXPECT_EQ(second.status, 200);
  EXPECT_EQ(body_of(second.response), "");
  EXPECT_EQ(first.consumed + second.consumed, two.size());
  // A response with no request behind it.
  EXPECT_EQ(http::error_response(408).substr(0, 30), "HTTP/1.1 408 Request Timeout\r\n");
  EXPECT_EQ(field(http::error_response(503), "Connection"), "close");
}

// ---------------------------------------------------------------------------------------------
// Over sockets

// A blocking client socket that gives up waiting for data after 30 s (no test hangs on it).
class Client {
 public:
  // receive_buffer_bytes > 0: a small receive buffer (a client slow to take its answer).
  Client(const std::string& host, int port, int receive_buffer_bytes = 0) {
    const bool v6 = host.find(':') != std::string::npos;
    fd_ = ::socket(v6 ? AF_INET6 : AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (receive_buffer_bytes > 0) {
      ::setsockopt(fd_, SOL_SOCKET, SO_RCVBUF, &receive_buffer_bytes, sizeof receive_buffer_bytes);
    }
    timeval tv{30, 0};
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    ::setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    sockaddr_storage addr{};
    socklen_t len;
    if (v6) {
      auto& a = reinterpret_cast<sockaddr_in6&>(addr);
      a.sin6_family = AF_INET6;
      a.sin6_port = htons(static_cast<uint16_t>(port));
      ::inet_pton(AF_INET6, host.c_str(), &a.sin6_addr);
      len = sizeof a;
    } else {
      auto& a = reinterpret_cast<sockaddr_in&>(addr);
      a.sin_family = AF_INET;
      a.sin_port = htons(static_cast<uint16_t>(port));
      ::inet_pton(AF_INET, host.c_str(), &a.sin_addr);
      len = sizeof a;
    }
    connected_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&addr), len) == 0;
  }
  ~Client() { ::close(fd_); }
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  bool connected() const { return connected_; }
  // False if the server has closed (or reset) the connection.
  bool send(const std::string& bytes) {
    for (size_t at = 0; at < bytes.size();) {
      const ssize_t n = ::send(fd_, bytes.data() + at, bytes.size() - at, MSG_NOSIGNAL);
      if (n <= 0) return false;
      at += static_cast<size_t>(n);
    }
    return true;
  }
  // One response: its head, then Content-Length bytes of body (none after HEAD); "" if the
  // connection ends first.
  std::string response(bool head_request = false) {
    while (buffer_.find("\r\n\r\n") == std::string::npos) {
      if (!fill()) return "";
    }
    const size_t head_end = buffer_.find("\r\n\r\n") + 4;
    const std::string length = field(buffer_.substr(0, head_end), "Content-Length");
    const size_t total = head_end + (head_request || length.empty() ? 0 : std::stoul(length));
    while (buffer_.size() < total) {
      if (!fill()) return "";
    }
    std::string r = buffer_.substr(0, total);
    buffer_.erase(0, total);
    return r;
  }
  // Everything until the server closes the connection (or 30 s pass without a byte).
  std::string rest() {
    while (fill()) {
    }
    return std::exchange(buffer_, "");
  }
  // True if the server has closed the connection: reading ends (EOF or reset), not times out.
  bool closed_by_server() {
    char byte[4096];
    for (;;) {
      const ssize_t n = ::recv(fd_, byte, sizeof byte, 0);
      if (n == 0) return true;
      if (n < 0) return errno == ECONNRESET;
    }
  }

 private:
  bool fill() {
    char chunk[65536];
    const ssize_t n = ::recv(fd_, chunk, sizeof chunk, 0);
    if (n <= 0) return false;
    buffer_.append(chunk, static_cast<size_t>(n));
    return true;
  }
  int fd_ = -1;
  bool connected_ = false;
  std::string buffer_;
};

int status_of(const std::string& response) {
  return response.size() >= 12 && response.compare(0, 9, "HTTP/1.1 ") == 0 ? std::stoi(response.substr(9, 3)) : -1;
}

// One request on a connection of its own; the status of the answer (-1 if none came).
int request_status(const std::string& host, int port, const std::string& request) {
  Client c(host, port);
  if (!c.connected() || !c.send(request)) return -1;
  return status_of(c.response(request.starts_with("HEAD ")));
}

std::string scrape(const std::string& host, int port) {
  Client c(host, port);
  if (!c.connected() || !c.send("GET /metrics HTTP/1.1\r\nHost: keel\r\n\r\n")) return "";
  return c.response();
}

http::ServerOptions local(int head_timeout_ms = 60000) {
  http::ServerOptions o;
  o.head_timeout_ms = head_timeout_ms;
  return o;
}

TEST(HttpServer, ServesKeepAliveAndPipelinedRequests) {
  http::Server server(local(), [] { return kExposition; });
  EXPECT_EQ(server.address(), "127.0.0.1:" + std::to_string(server.port()));
  Client c("127.0.0.1", server.port());
  ASSERT_TRUE(c.connected());
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(c.send("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"));
    EXPECT_EQ(body_of(c.response()), kExposition) << i;
  }
  ASSERT_TRUE(c.send("GET / HTTP/1.1\r\n\r\nGET /favicon.ico HTTP/1.1\r\n\r\nHEAD /metrics HTTP/1.1\r\n\r\n"
                     "DELETE /metrics HTTP/1.1\r\n\r\nGET /metrics HTTP/1.1\r\n\r\n"));
  EXPECT_EQ(status_of(c.response()), 200);
  EXPECT_EQ(status_of(c.response()), 404);
  EXPECT_EQ(status_of(c.response(true)), 200);
  EXPECT_EQ(status_of(c.response()), 405);
  EXPECT_TRUE(c.closed_by_server());  // after the 405, never to the GET behind it
}

// A head that does not arrive in time gets 408 and the connection closes; an idle keep-alive
// connection is closed without a word; a slow client that completes in time is served.
TEST(HttpServer, SlowAndIdleClientsTimeOutAndSlowButCompleteOnesAreServed) {
  http::Server impatient(local(3000), [] { return kExposition; });
  Client partial("127.0.0.1", impatient.port());
  ASSERT_TRUE(partial.send("GET /metrics HTTP/1.1\r\nHost: x\r\n"));
  Client idle("127.0.0.1", impatient.port());
  Client served_then_idle("127.0.0.1", impatient.port());
  ASSERT_TRUE(served_then_idle.send("GET /metrics HTTP/1.1\r\n\r\n"));
  EXPECT_EQ(status_of(served_then_idle.response()), 200);
  const std::string timed_out = partial.rest();
  EXPECT_EQ(status_of(timed_out), 408) << timed_out;
  EXPECT_EQ(field(timed_out, "Connection"), "close");
  EXPECT_TRUE(idle.closed_by_server());
  EXPECT_TRUE(served_then_idle.closed_by_server());

  http::Server patient(local(), [] { return kExposition; });
  Client slow("127.0.0.1", patient.port());
  for (char byte : std::string("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")) {
    ASSERT_TRUE(slow.send(std::string(1, byte)));
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  EXPECT_EQ(body_of(slow.response()), kExposition);
}

// Waits (up to 30 s) until the server holds `n` connections.
bool holds(const http::Server& server, size_t n) {
  for (int i = 0; i < 3000 && server.open_connections() != n; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return server.open_connections() == n;
}

// 50 idle connections, 50 that sent half a request, and one that sends requests without ever
// reading the answers: a scrape is served all the while.
TEST(HttpServer, ScrapesAreServedWithManyIdleSlowAndNeverReadingClientsOpen) {
  const std::string big(1 << 20, 'x');  // a page larger than the socket buffers
  http::Server server(local(), [&] { return big; });
  std::vector<std::unique_ptr<Client>> held;
  for (int i = 0; i < 100; ++i) {
    held.push_back(std::make_unique<Client>("127.0.0.1", server.port()));
    ASSERT_TRUE(held.back()->connected());
    if (i % 2 == 1) {
      ASSERT_TRUE(held.back()->send("GET /metrics HTTP/1.1\r\nHost: x\r\n"));
    }
  }
  Client never_reads("127.0.0.1", server.port(), 4096);
  std::string requests;
  for (int i = 0; i < 64; ++i) requests += "GET /metrics HTTP/1.1\r\n\r\n";
  ASSERT_TRUE(never_reads.send(requests));
  ASSERT_TRUE(holds(server, 101)) << server.open_connections();
  for (int i = 0; i < 5; ++i) {
    const std::string r = scrape("127.0.0.1", server.port());
    EXPECT_EQ(status_of(r), 200) << i;
    EXPECT_EQ(body_of(r).size(), big.size()) << i;
  }
  for (auto& c : held) EXPECT_TRUE(c->connected());
}

// A client that does not take its answer is dropped after write_timeout_ms.
TEST(HttpServer, AClientThatNeverReadsIsDropped) {
  http::ServerOptions o = local();
  o.write_timeout_ms = 200;
  const std::string big(16 << 20, 'x');  // more than the kernel buffers on both sides hold
  http::Server server(o, [&] { return big; });
  Client never_reads("127.0.0.1", server.port(), 4096);
  ASSERT_TRUE(never_reads.send("GET /metrics HTTP/1.1\r\n\r\nGET /metrics HTTP/1.1\r\n\r\n"));
  // Meanwhile others are served (the small index page: taking 16 MiB in 200 ms is not a given);
  // once the server has given up on it, the client finds the connection closed before it got
  // even one whole page.
  EXPECT_EQ(request_status("127.0.0.1", server.port(), "GET / HTTP/1.1\r\n\r\n"), 200);
  ASSERT_TRUE(holds(server, 0)) << server.open_connections();
  const std::string got = never_reads.rest();
  EXPECT_LT(got.size(), big.size());
}

// Beyond max_connections a client gets 503 at once; a freed place is taken again.
TEST(HttpServer, AFullHouseAnswers503) {
  http::ServerOptions o = local();
  o.max_connections = 4;
  http::Server server(o, [] { return kExposition; });
  std::vector<std::unique_ptr<Client>> held;
  for (int i = 0; i < 4; ++i) {
    held.push_back(std::make_unique<Client>("127.0.0.1", server.port()));
    // (each is answered, so the server has accepted it before the next connects)
    ASSERT_TRUE(held.back()->send("GET /favicon.ico HTTP/1.1\r\n\r\n"));
    ASSERT_EQ(status_of(held.back()->response()), 404);
  }
  Client fifth("127.0.0.1", server.port());
  EXPECT_EQ(status_of(fifth.rest()), 503);
  held.pop_back();
  ASSERT_TRUE(holds(server, 3)) << server.open_connections();
  EXPECT_EQ(request_status("127.0.0.1", server.port(), "GET /metrics HTTP/1.1\r\n\r\n"), 200);
}

// A client that sends far more than a head may hold still reads its 431 (the server reads on
// before closing, so the close does not reset the connection under the answer).
TEST(HttpServer, OversizedHeadsGet431WithoutAReset) {
  http::Server server(local(), [] { return kExposition; });
  Client c("127.0.0.1", server.port());
  std::string huge = "GET /metrics HTTP/1.1\r\n";
  for (int i = 0; i < 200; ++i) huge += "X-Filler-" + std::to_string(i) + ": " + std::string(1000, 'f') + "\r\n";
  ASSERT_TRUE(c.send(huge));  // (the server reads on, so this does not block)
  const std::string r = c.rest();
  EXPECT_EQ(status_of(r), 431) << r.substr(0, 200);
}

TEST(HttpServer, ABusyPortIsRefusedInOneLine) {
  http::Server first(local(), [] { return kExposition; });
  http::ServerOptions o = local();
  o.port = first.port();
  const std::string error = testing::error_of([&] { http::Server second(o, [] { return kExposition; }); });
  EXPECT_EQ(error, "cannot listen on 127.0.0.1:" + std::to_string(first.port()) + " (Address already in use)");
  o.bind = "no-such-host.invalid";
  EXPECT_NE(testing::error_of([&] { http::Server third(o, [] { return kExposition; }); })
                .find("cannot listen on no-such-host.invalid:"),
            std::string::npos);
}

// True if this machine has an IPv6 loopback to bind.
bool ipv6_loopback() {
  const int fd = ::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_in6 a{};
  a.sin6_family = AF_INET6;
  a.sin6_addr = in6addr_loopback;
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  ::close(fd);
  return ok;
}

TEST(HttpServer, ServesOnIpv6Loopback) {
  if (!ipv6_loopback()) GTEST_SKIP() << "no IPv6 loopback (::1) on this machine";
  for (const char* bind : {"::1", "[::1]"}) {
    http::ServerOptions o = local();
    o.bind = bind;
    http::Server server(o, [] { return kExposition; });
    EXPECT_EQ(server.address(), "[::1]:" + std::to_string(server.port()));
    EXPECT_EQ(body_of(scrape("::1", server.port())), kExposition) << bind;
  }
}

// ---------------------------------------------------------------------------------------------
// A live run

// A loopback port the kernel hands out now (free for the moment): a server's, closed at once.
int free_port() { return http::Server(local(), [] { return std::string(); }).port(); }

class LiveEndpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    testing::write_toy_corpus(dir.path());
    testing::write_toy_config(dir.path(), 1000000);
  }
  // `keel train` on the toy config with the endpoint at bind:port; runs until stopped.
  std::unique_ptr<testing::KeelJob> start(const std::string& run, const std::string& bind, int port,
                                          const std::vector<std::string>& extra = {}) {
    std::vector<std::string> args = {"train", "--config", dir / "toy.toml", "--set", "train.run_dir=" + dir / run,
                                     "--set", "train.eval_every=0", "--set", "optim.min_lr_ratio=1", "--set",
                                     "monitor.bind=" + bind, "--set", "monitor.port=" + std::to_string(port)};
    args.insert(args.end(), extra.begin(), extra.end());
    return std::make_unique<testing::KeelJob>(args, dir / (run + ".log"), std::vector<std::string>{});
  }
  // Scrapes until the run has published a step (or it ends, or 60 s pass); the last answer.
  std::string first_steps(testing::KeelJob& job, const std::string& host, int port) {
    std::string page;
    for (int i = 0; i < 600 && job.running(); ++i) {
      page = scrape(host, port);
      if (page.find("\nkeel_step ") != std::string::npos) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return page;
  }
  testing::TempDir dir{"keel-endpoint"};
};

TEST_F(LiveEndpoint, MonitorBindIpv6LoopbackServes) {
  if (!ipv6_loopback()) GTEST_SKIP() << "no IPv6 loopback (::1) on this machine";
  for (const char* bind : {"::1", "[::1]"}) {
    const int port = free_port();
    const std::string run = std::string("v6-") + (bind[0] == '[' ? "bracketed" : "bare");
    auto job = start(run, bind, port);
    const std::string page = first_steps(*job, "::1", port);
    EXPECT_EQ(status_of(page), 200) << bind << job->output();
    EXPECT_NE(page.find("\nkeel_step "), std::string::npos) << bind << page << job->output();
    ::kill(job->pid(), SIGTERM);
    EXPECT_EQ(job->wait(60), 128 + SIGTERM) << job->output();
    EXPECT_NE(job->output().find("Prometheus metrics at http://[::1]:" + std::to_string(port) + "/metrics"),
              std::string::npos)
        << job->output();
  }
}

// The answer body of a Prometheus query API call (HTTP/1.0: the server closes after it).
std::string prometheus_query(int port, const std::string& query) {
  std::string encoded;
  for (unsigned char c : query) {
    char hex[4];
    std::snprintf(hex, sizeof hex, "%%%02X", c);
    encoded += std::isalnum(c) ? std::string(1, static_cast<char>(c)) : std::string(hex);
  }
  Client c("127.0.0.1", port);
  if (!c.connected() || !c.send("GET /api/v1/query?query=" + encoded + " HTTP/1.0\r\nHost: prometheus\r\n\r\n")) {
    return "";
  }
  return body_of(c.rest());
}

// The newest sample's value of a one-series instant query, or NaN while there is none.
double prometheus_value(int port, const std::string& query) {
  const std::string answer = prometheus_query(port, query);
  const nlohmann::json j = nlohmann::json::parse(answer, nullptr, false);
  if (j.is_discarded() || !j.contains("data") || j["data"]["result"].empty()) return std::nan("");
  return std::stod(j["data"]["result"][0]["value"][1].get<std::string>());
}

int checkpoint_step(const std::string& root) {
  const std::string name = std::filesystem::path(testing::newest_checkpoint(root)).filename().string();
  return std::stoi(name.substr(name.find('-') + 1));
}

// The finding: any request but GET /metrics killed the trainer (civetweb's worker stacks overflowed),
// and two idle connections stopped every scrape. A live run's endpoint takes every method, odd
// paths, malformed heads, oversized ones, HTTP/0.9 and HTTP/2 bytes, dribbling clients, 50 idle
// and 50 half-sent connections and a client that never reads, while Debian's Prometheus scrapes it.
// The run is alive afterwards; stopped (SIGTERM, a checkpoint) and resumed to its end under the
// scraper it exits 0 with the bytes of a run nobody talked to. (The learning rate is flat after
// warm-up, so the first run's open-ended step count changes nothing; resuming is exact.)
TEST_F(LiveEndpoint, ABatteryOfRequestsNeitherStopsTheRunNorChangesItsBytes) {
  const int port = free_port();
  int prom_port = free_port();
  while (prom_port == port) prom_port = free_port();
  testing::write_text(dir / "prometheus.yml", "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n"
                                              "  - job_name: keel\n    static_configs:\n      - targets: ['127.0.0.1:" +
                                                  std::to_string(port) + "']\n");
  const testing::CommandResult prom = testing::run_command(
      "prometheus --config.file=" + dir / "prometheus.yml" + " --storage.tsdb.path=" + dir / "tsdb" +
      " --web.listen-address=127.0.0.1:" + std::to_string(prom_port) + " > " + dir / "prometheus.log" + " 2>&1 & echo $!");
  const pid_t prom_pid = std::atoi(prom.output.c_str());
  ASSERT_GT(prom_pid, 0) << prom.output;
  struct StopPrometheus {
    pid_t pid;
    ~StopPrometheus() {
      ::kill(pid, SIGTERM);
    }
  } stop_prometheus{prom_pid};

  // (slowed 10x by sleeps, so fewer steps pass while the battery runs; the bytes are the same)
  auto run = start("a", "127.0.0.1", port, {"--set", "runtime.slow_rank=0", "--set", "runtime.slow_factor=10"});
  ASSERT_NE(first_steps(*run, "127.0.0.1", port).find("\nkeel_step "), std::string::npos) << run->output();
  // Prometheus has scraped it once.
  double up = std::nan("");
  for (int i = 0; i < 600 && !(up == 1); ++i) {
    up = prometheus_value(prom_port, "up{job=\"keel\"}");
    if (!(up == 1)) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_EQ(up, 1) << read_text_file(dir / "prometheus.log");

  // Held open through the battery: half a request (answered 408 after 10 s), 50 idle connections,
  // 50 half-sent requests, and a client that sends 200 requests and never reads an answer.
  Client stalled("127.0.0.1", port);
  ASSERT_TRUE(stalled.send("GET /metrics HTTP/1.1\r\nHost: x\r\n"));
  std::vector<std::unique_ptr<Client>> held;
  for (int i = 0; i < 100; ++i) {
    held.push_back(std::make_unique<Client>("127.0.0.1", port));
    ASSERT_TRUE(held.back()->connected()) << i;
    if (i >= 50) {
      ASSERT_TRUE(held.back()->send("GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-"));
    }
  }
  Client never_reads("127.0.0.1", port, 4096);
  std::string pipelined;
  for (int i = 0; i < 200; ++i) pipelined += "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n";
  ASSERT_TRUE(never_reads.send(pipelined));
  const double held_since_s =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();

  // One request per connection, and the status it must get.
  std::vector<std::pair<std::string, int>> battery;
  for (const char* method : {"POST", "PUT", "DELETE", "OPTIONS", "PATCH", "TRACE", "CONNECT"}) {
    battery.push_back({std::string(method) + " /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc", 405});
  }
  battery.push_back({"BREW /metrics HTTP/1.1\r\n\r\n", 501});
  battery.push_back({"HEAD /metrics HTTP/1.1\r\n\r\n", 200});
  battery.push_back({"HEAD / HTTP/1.0\r\n\r\n", 200});
  battery.push_back({"GET / HTTP/1.1\r\nHost: x\r\nUser-Agent: curl/7.88.1\r\nAccept: */*\r\n\r\n", 200});
  battery.push_back({"GET /favicon.ico HTTP/1.1\r\n\r\n", 404});
  battery.push_back({"GET /metrics?x=1 HTTP/1.1\r\n\r\n", 200});
  battery.push_back({"GET /%6detrics HTTP/1.1\r\n\r\n", 200});
  battery.push_back({"GET /%zz HTTP/1.1\r\n\r\n", 400});
  battery.push_back({"GET /../../etc/passwd HTTP/1.1\r\n\r\n", 404});
  battery.push_back({"GET /" + std::string(7000, 'a') + " HTTP/1.1\r\n\r\n", 404});
  battery.push_back({"GET /" + std::string(100000, 'a') + " HTTP/1.1\r\n\r\n", 414});
  std::string huge = "GET /metrics HTTP/1.1\r\n";
  for (int i = 0; i < 300; ++i) huge += "X-Filler-" + std::to_string(i) + ": " + std::string(1000, 'f') + "\r\n";
  battery.push_back({huge + "\r\n", 431});
  battery.push_back({"GET /metrics HTTP/1.1\r\nCookie: " + std::string(1 << 20, 'c') + "\r\n\r\n", 431});
  battery.push_back({"GET\r\n\r\n", 400});
  battery.push_back({"GET /metrics HTTP/1.1 extra\r\n\r\n", 400});
  battery.push_back({"GET /metrics HTTP/1.1\r\nNo colon here\r\n\r\n", 400});
  battery.push_back({std::string("\x00\xff\xfe garbage\r\n\r\n", 14), 400});
  battery.push_back({std::string("\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", 11), 400});  // a TLS hello
  battery.push_back({"GET /metrics\r\n", 505});                                      // HTTP/0.9
  battery.push_back({"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 505});                       // HTTP/2's preface
  battery.push_back({"GET /metrics HTTP/1.1\r\nConnection: close\r\n\r\n", 200});
  // (the first failure ends the test: on a server that stopped answering each would wait 30 s)
  for (const auto& [request, status] : battery) {
    ASSERT_EQ(request_status("127.0.0.1", port, request), status) << ::testing::PrintToString(request.substr(0, 60));
  }
  // 20 clients dribbling their requests a byte at a time, taking turns.
  const std::string request = "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
  std::vector<std::unique_ptr<Client>> slow;
  for (int i = 0; i < 20; ++i) slow.push_back(std::make_unique<Client>("127.0.0.1", port));
  for (char byte : request) {
    for (auto& c : slow) ASSERT_TRUE(c->send(std::string(1, byte)));
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  for (auto& c : slow) ASSERT_NE(c->response().find("\nkeel_step "), std::string::npos);
  // Scrapes are served, ours and Prometheus's (one that started after the connections were held).
  for (int i = 0; i < 5; ++i) ASSERT_NE(scrape("127.0.0.1", port).find("\nkeel_step "), std::string::npos) << i;
  double scraped_at_s = 0;
  for (int i = 0; i < 600 && !(scraped_at_s > held_since_s); ++i) {
    scraped_at_s = prometheus_value(prom_port, "timestamp(up{job=\"keel\"} == 1)");
    if (!(scraped_at_s > held_since_s)) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_GT(scraped_at_s, held_since_s) << read_text_file(dir / "prometheus.log");
  EXPECT_EQ(status_of(stalled.rest()), 408);

  // The run is alive; stopped, it checkpoints; resumed to 10 steps more, it ends normally.
  ASSERT_TRUE(run->running()) << run->output();
  ::kill(run->pid(), SIGTERM);
  ASSERT_EQ(run->wait(120), 128 + SIGTERM) << run->output();
  const int stopped_at = checkpoint_step(dir / "a/ckpt");
  const std::string steps = "train.steps=" + std::to_string(stopped_at + 10);
  auto resumed = start("a", "127.0.0.1", port, {"--set", "train.resume=auto", "--set", steps});
  EXPECT_EQ(resumed->wait(300), 0) << resumed->output();
  const testing::CommandResult quiet =
      testing::run_keel("train --config " + dir / "toy.toml" + " --set train.run_dir=" + dir / "b" +
                        " --set train.eval_every=0 --set optim.min_lr_ratio=1 --set " + steps);
  ASSERT_EQ(quiet.exit_code, 0) << quiet.output;
  EXPECT_EQ(checkpoint_step(dir / "a/ckpt"), stopped_at + 10);
  EXPECT_EQ(checkpoint_step(dir / "b/ckpt"), stopped_at + 10);
  for (Plane plane : {Plane::param, Plane::adam_m, Plane::adam_v}) {
    EXPECT_TRUE(testing::checkpoint_bytes(dir / "a/ckpt", plane) == testing::checkpoint_bytes(dir / "b/ckpt", plane))
        << static_cast<int>(plane);
  }
}

}  // namespace
}  // namespace keel
