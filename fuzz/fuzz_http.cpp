// The metrics endpoint's request handling (monitor/http_server.h `answer`): the bytes a client
// sends, possibly several pipelined requests, go in; each answer must be "read more" (only for a
// valid beginning of a head under the limit) or one well-formed HTTP/1.1 response whose
// Content-Length matches its body (or no body, answering HEAD), and an answer given to a prefix of the bytes
// must be the answer to all of them.
#include <cstdint>
#include <string>
#include <string_view>

#include "monitor/http_server.h"

namespace {

const std::string kMetrics = "# HELP keel_step Optimizer steps done\n# TYPE keel_step gauge\nkeel_step 7\n";

void check_response(const keel::http::Answer& a, bool head_request) {
  const std::string& r = a.response;
  if (r.compare(0, 9, "HTTP/1.1 ") != 0 || r.size() < 13 || r[12] != ' ') __builtin_trap();
  if (std::to_string(a.status) != r.substr(9, 3) || a.status < 200 || a.status > 599) __builtin_trap();
  const size_t head_end = r.find("\r\n\r\n");
  if (head_end == std::string::npos) __builtin_trap();
  const std::string head = r.substr(0, head_end + 2);
  const size_t cl = head.find("\r\nContent-Length: ");
  if (cl == std::string::npos) __builtin_trap();
  const size_t length = std::stoul(head.substr(cl + 18, head.find("\r\n", cl + 2) - cl - 18));
  const size_t body = r.size() - head_end - 4;
  if (body != length && !(head_request && body == 0)) __builtin_trap();
  if (head.find(a.close ? "\r\nConnection: close\r\n" : "\r\nConnection: keep-alive\r\n") == std::string::npos) {
    __builtin_trap();
  }
  // Header fields are single lines of printable text.
  for (char c : head) {
    if ((static_cast<unsigned char>(c) < 0x20 && c != '\r' && c != '\n') || c == 0x7f) __builtin_trap();
  }
}

bool same(const keel::http::Answer& x, const keel::http::Answer& y) {
  return x.need_more == y.need_more && x.consumed == y.consumed && x.status == y.status && x.close == y.close &&
         x.response == y.response;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const keel::http::MetricsText metrics = [] { return kMetrics; };
  std::string_view input(reinterpret_cast<const char*>(data), size);
  // Up to 16 pipelined requests, as one connection would send them.
  for (int request = 0; request < 16 && !input.empty(); ++request) {
    const keel::http::Answer a = keel::http::answer(input, metrics);
    if (a.need_more) {
      if (input.size() >= keel::http::kMaxHeadBytes || a.consumed != 0 || !a.response.empty()) __builtin_trap();
      break;
    }
    if (a.consumed == 0 || a.consumed > input.size()) __builtin_trap();
    // The request's method, as the server saw it (after any empty lines).
    const size_t start = input.find_first_not_of("\r\n");
    const bool head_request = start != std::string_view::npos && input.substr(start, 5) == "HEAD ";
    check_response(a, head_request);
    // Any prefix: "read more", or this same answer.
    const size_t cut = size > 0 ? data[0] % (input.size() + 1) : 0;
    const keel::http::Answer early = keel::http::answer(input.substr(0, cut), metrics);
    if (!early.need_more && !same(early, a)) __builtin_trap();
    if (a.close) break;
    input.remove_prefix(a.consumed);
  }
  return 0;
}
