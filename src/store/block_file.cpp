#include "store/block_file.h"

#include <fcntl.h>
#include <liburing.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "core/error.h"

namespace keel {

namespace {

std::string errno_text(int e) { return std::strerror(e); }


// A request's outcome: bytes moved, or -errno.
struct Outcome {
  int64_t result = 0;
  size_t want = 0;
  uint64_t offset = 0;
  bool is_write = false;
};

[[noreturn]] void io_failed(const std::string& path, const Outcome& o) {
  const std::string what = o.is_write ? "write" : "read";
  if (o.result < 0) {
    const int e = static_cast<int>(-o.result);
    throw Error("nvme tier: " + what + " of " + std::to_string(o.want) + " bytes at offset " + std::to_string(o.offset) +
                " of " + path + " failed: " + errno_text(e) + (e == ENOSPC ? " (the disk is full)" : ""));
  }
  throw Error("nvme tier: short " + what + " at offset " + std::to_string(o.offset) + " of " + path + ": " +
              std::to_string(o.result) + " of " + std::to_string(o.want) + " bytes");
}

// ---- io_uring ----

class UringFile final : public BlockFile {
 public:
  // Sets up the ring; init_error() is 0 on success, else -errno (then the object only closes).
  UringFile(std::string path, uint64_t size, int fd, unsigned depth)
      : BlockFile(std::move(path), size, IoEngine::io_uring, fd), depth_(depth) {
    init_error_ = io_uring_queue_init(depth, &ring_, 0);
  }
  ~UringFile() override {
    if (init_error_ != 0) return;  // the caller still owns the file
    // Drain what is in flight before the buffers (owned by callers) and the file go away.
    while (in_flight_ > 0) reap(true);
    io_uring_queue_exit(&ring_);
    close_and_remove();
  }
  int init_error() const { return init_error_; }

  uint64_t read(void* buf, size_t bytes, uint64_t offset) override { return submit(buf, bytes, offset, false); }
  uint64_t write(const void* buf, size_t bytes, uint64_t offset) override {
    return submit(const_cast<void*>(buf), bytes, offset, true);
  }
  void wait(uint64_t ticket) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_.find(ticket);
    check(it != pending_.end(), "nvme tier: wait on an unknown or already waited request");
    while (!complete_.count(ticket)) reap(true);
    finish(ticket);
  }
  bool done(uint64_t ticket) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!complete_.count(ticket)) reap(false);
    return complete_.count(ticket) != 0;
  }

 private:
  uint64_t submit(void* buf, size_t bytes, uint64_t offset, bool is_write) {
    check_request(buf, bytes, offset);
    std::lock_guard<std::mutex> lock(mu_);
    while (in_flight_ >= depth_) reap(true);
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    check(sqe != nullptr, "nvme tier: io_uring submission queue full");
    if (is_write) {
      io_uring_prep_write(sqe, fd_, buf, static_cast<unsigned>(bytes), offset);
    } else {
      io_uring_prep_read(sqe, fd_, buf, static_cast<unsigned>(bytes), offset);
    }
    const uint64_t ticket = ++next_;
    io_uring_sqe_set_data64(sqe, ticket);
    const int r = io_uring_submit(&ring_);
    check(r >= 1, "nvme tier: io_uring_submit on " + path_ + " failed: " + errno_text(-r));
    pending_[ticket] = Outcome{0, bytes, offset, is_write};
    ++in_flight_;
    return ticket;
  }

  // Collects completions; blocks for at least one when `block`.
  void reap(bool block) {
    io_uring_cqe* cqe = nullptr;
    int r = block ? io_uring_wait_cqe(&ring_, &cqe) : io_uring_peek_cqe(&ring_, &cqe);
    while (r == -EINTR && block) r = io_uring_wait_cqe(&ring_, &cqe);
    if (r == -EAGAIN && !block) return;
    check(r == 0, "nvme tier: waiting for io_uring completions on " + path_ + " failed: " + errno_text(-r));
    while (cqe != nullptr) {
      complete_[io_uring_cqe_get_data64(cqe)] = cqe->res;
      --in_flight_;
      io_uring_cqe_seen(&ring_, cqe);
      cqe = nullptr;
      if (io_uring_peek_cqe(&ring_, &cqe) != 0) break;
    }
  }

  void finish(uint64_t ticket) {
    Outcome o = pending_[ticket];
    o.result = complete_[ticket];
    pending_.erase(ticket);
    complete_.erase(ticket);
    if (o.result != static_cast<int64_t>(o.want)) io_failed(path_, o);
  }

  io_uring ring_{};
  int init_error_ = 0;
  unsigned depth_;
  unsigned in_flight_ = 0;
  uint64_t next_ = 0;
  std::mutex mu_;
  std::unordered_map<uint64_t, Outcome> pending_;
  std::unordered_map<uint64_t, int64_t> complete_;
};

// ---- thread pool ----

class ThreadFile final : public BlockFile {
 public:
  ThreadFile(std::string path, uint64_t size, int fd, int threads, int delay_us)
      : BlockFile(std::move(path), size, IoEngine::threads, fd), delay_us_(delay_us) {
    for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { run(); });
  }
  ~ThreadFile() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
    close_and_remove();
  }

  uint64_t read(void* buf, size_t bytes, uint64_t offset) override { return submit(buf, bytes, offset, false); }
  uint64_t write(const void* buf, size_t bytes, uint64_t offset) override {
    return submit(const_cast<void*>(buf), bytes, offset, true);
  }
  void wait(uint64_t ticket) override {
    std::unique_lock<std::mutex> lock(mu_);
    auto it = state_.find(ticket);
    check(it != state_.end(), "nvme tier: wait on an unknown or already waited request");
    finished_.wait(lock, [&] { return state_[ticket].done; });
    const Outcome o = state_[ticket].outcome;
    state_.erase(ticket);
    if (o.result != static_cast<int64_t>(o.want)) io_failed(path_, o);
  }
  bool done(uint64_t ticket) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = state_.find(ticket);
    return it != state_.end() && it->second.done;
  }

 private:
  struct Job {
    uint64_t ticket;
    void* buf;
  };
  struct State {
    Outcome outcome;
    bool done = false;
  };

  uint64_t submit(void* buf, size_t bytes, uint64_t offset, bool is_write) {
    check_request(buf, bytes, offset);
    uint64_t ticket;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ticket = ++next_;
      state_[ticket].outcome = Outcome{0, bytes, offset, is_write};
      queue_.push_back(Job{ticket, buf});
    }
    wake_.notify_one();
    return ticket;
  }

  void run() {
    for (;;) {
      Job job;
      Outcome o;
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, and nothing left to do
        job = queue_.front();
        queue_.pop_front();
        o = state_[job.ticket].outcome;
      }
      if (delay_us_ > 0 && o.is_write) std::this_thread::sleep_for(std::chrono::microseconds(delay_us_));
      size_t moved = 0;
      int64_t result = 0;
      while (moved < o.want) {
        char* p = static_cast<char*>(job.buf) + moved;
        const off_t at = static_cast<off_t>(o.offset + moved);
        const ssize_t r = o.is_write ? ::pwrite(fd_, p, o.want - moved, at) : ::pread(fd_, p, o.want - moved, at);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
          result = r < 0 ? -errno : static_cast<int64_t>(moved);
          break;
        }
        moved += static_cast<size_t>(r);
        result = static_cast<int64_t>(moved);
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        State& s = state_[job.ticket];
        s.outcome.result = result;
        s.done = true;
      }
      finished_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable wake_, finished_;
  std::deque<Job> queue_;
  std::unordered_map<uint64_t, State> state_;
  std::vector<std::thread> workers_;
  uint64_t next_ = 0;
  bool stop_ = false;
  int delay_us_;
};

}  // namespace

const char* io_engine_name(IoEngine e) { return to_string(e); }

void BlockFile::check_request(const void* buf, size_t bytes, uint64_t offset) const {
  check(reinterpret_cast<uintptr_t>(buf) % kAlign == 0 && bytes % kAlign == 0 && offset % kAlign == 0 && bytes > 0,
        "nvme tier: unaligned request (" + std::to_string(bytes) + " bytes at " + std::to_string(offset) + ")");
  check(offset <= size_ && bytes <= size_ - offset,
        "nvme tier: request [" + std::to_string(offset) + ", " + std::to_string(offset + bytes) + ") outside " + path_ +
            " (" + std::to_string(size_) + " bytes)");
}

void BlockFile::grow(uint64_t bytes) {
  const uint64_t size = align_up(bytes);
  if (size <= size_) return;
  if (::fallocate(fd_, 0, static_cast<off_t>(size_), static_cast<off_t>(size - size_)) != 0) {
    const int e = errno;
    if (e == ENOSPC) throw Error("nvme tier: " + path_ + ": the disk has no room to grow the tier's file to " + std::to_string(size) + " bytes");
    if (e != EOPNOTSUPP) throw Error("nvme tier: " + path_ + ": cannot reserve " + std::to_string(size) + " bytes: " + errno_text(e));
    if (::ftruncate(fd_, static_cast<off_t>(size)) != 0) throw Error("nvme tier: " + path_ + ": cannot size the file: " + errno_text(errno));
  }
  size_ = size;
}

uint64_t BlockFile::measured_size() const {
  struct stat st {};
  if (fd_ < 0 || ::fstat(fd_, &st) != 0) return 0;
  return static_cast<uint64_t>(st.st_size);
}

void BlockFile::close_and_remove() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  ::unlink(path_.c_str());
}

std::unique_ptr<BlockFile> BlockFile::create(const std::string& path, uint64_t bytes, IoEngine engine, int queue_depth,
                                             int write_delay_us) {
  const uint64_t size = align_up(std::max<uint64_t>(bytes, kAlign));
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_DIRECT | O_CLOEXEC, 0600);
  if (fd < 0) {
    const int e = errno;
    if (e == EINVAL) throw Error("nvme tier: " + path + ": the file system does not support O_DIRECT");
    throw Error("nvme tier: cannot create " + path + ": " + errno_text(e));
  }
  auto fail = [&](const std::string& why) {
    ::close(fd);
    ::unlink(path.c_str());
    throw Error("nvme tier: " + path + ": " + why);
  };
  if (::fallocate(fd, 0, 0, static_cast<off_t>(size)) != 0) {
    const int e = errno;
    if (e == ENOSPC) fail("the disk has no room for the tier's " + std::to_string(size) + " bytes");
    if (e != EOPNOTSUPP) fail("cannot reserve " + std::to_string(size) + " bytes: " + errno_text(e));
    if (::ftruncate(fd, static_cast<off_t>(size)) != 0) fail("cannot size the file: " + errno_text(errno));
  }
  check(write_delay_us == 0 || engine == IoEngine::threads, "nvme tier: a write delay needs the threads engine");
  if (engine != IoEngine::threads) {
    auto file = std::make_unique<UringFile>(path, size, fd, static_cast<unsigned>(std::max(1, queue_depth)));
    const int r = file->init_error();
    if (r == 0) return file;
    file.reset();
    if (engine == IoEngine::io_uring) fail("io_uring is unavailable here (" + errno_text(-r) + "); use engine \"threads\"");
  }
  return std::unique_ptr<BlockFile>(new ThreadFile(path, size, fd, 2, write_delay_us));
}

AlignedBuffer::AlignedBuffer(size_t n) : bytes(n) {
  if (n == 0) return;
  const size_t rounded = BlockFile::align_up(n);
  data = std::aligned_alloc(BlockFile::kAlign, rounded);
  check(data != nullptr, "cannot allocate an aligned buffer of " + std::to_string(rounded) + " bytes");
}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& o) noexcept {
  if (this != &o) {
    std::free(data);
    data = o.data;
    bytes = o.bytes;
    o.data = nullptr;
    o.bytes = 0;
  }
  return *this;
}

AlignedBuffer::~AlignedBuffer() { std::free(data); }

}  // namespace keel
