// Copies between two places in host memory on a thread of its own, in the order asked, so that
// the tier manager's fetch of a host-homed page runs while the caller computes (as an NVMe read
// does through BlockFile), instead of on the calling thread at the moment it is hinted.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <thread>

namespace keel {

class HostCopier {
 public:
  HostCopier();
  ~HostCopier();  // finishes every copy asked for, then stops the thread
  HostCopier(const HostCopier&) = delete;
  HostCopier& operator=(const HostCopier&) = delete;

  // Starts copying `bytes` from src to dst (neither touched by the caller until wait() or done()
  // says the copy is complete) and returns its ticket. Tickets complete in the order issued.
  uint64_t copy(void* dst, const void* src, size_t bytes);
  void wait(uint64_t ticket);
  bool done(uint64_t ticket);

 private:
  struct Job {
    void* dst;
    const void* src;
    size_t bytes;
  };
  void run();
  std::mutex mutex_;
  std::condition_variable work_, finished_;
  std::deque<Job> jobs_;
  uint64_t issued_ = 0, completed_ = 0;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace keel
