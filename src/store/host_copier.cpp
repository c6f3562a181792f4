#include "store/host_copier.h"

#include <cstring>

namespace keel {

HostCopier::HostCopier() : thread_([this] { run(); }) {}

HostCopier::~HostCopier() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  work_.notify_one();
  thread_.join();
}

uint64_t HostCopier::copy(void* dst, const void* src, size_t bytes) {
  uint64_t ticket;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    jobs_.push_back(Job{dst, src, bytes});
    ticket = ++issued_;
  }
  work_.notify_one();
  return ticket;
}

void HostCopier::wait(uint64_t ticket) {
  std::unique_lock<std::mutex> lock(mutex_);
  finished_.wait(lock, [&] { return completed_ >= ticket; });
}

bool HostCopier::done(uint64_t ticket) {
  std::lock_guard<std::mutex> lock(mutex_);
  return completed_ >= ticket;
}

void HostCopier::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    work_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
    if (jobs_.empty()) return;  // stop_, and nothing left to copy
    const Job job = jobs_.front();
    jobs_.pop_front();
    lock.unlock();
    std::memcpy(job.dst, job.src, job.bytes);
    lock.lock();
    completed_++;
    finished_.notify_all();
  }
}

}  // namespace keel
