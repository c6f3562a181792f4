#include "comm/expert_parallel.h"

#include <chrono>

#include "core/error.h"

namespace keel {

void MpiExpertGroup::start_exchange(const void* send, const std::vector<int>& send_counts,
                                    const std::vector<int>& send_displs, void* recv,
                                    const std::vector<int>& recv_counts, const std::vector<int>& recv_displs) {
  check(request_.done, "expert group: an exchange started while another is in flight");
  if (counting_) {
    for (int c : send_counts) bytes_ += c;
  }
  request_ = comm_.ialltoallv(static_cast<const uint8_t*>(send), send_counts, send_displs, static_cast<uint8_t*>(recv),
                              recv_counts, recv_displs);
}

void MpiExpertGroup::finish_exchange() {
  const auto start = std::chrono::steady_clock::now();
  comm_.wait(request_);
  if (counting_) wait_ms_ += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace keel
