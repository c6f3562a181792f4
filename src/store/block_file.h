// The NVMe tier's storage: one preallocated file, read and written asynchronously in aligned
// blocks with O_DIRECT (no page cache: what the tier holds costs no DRAM, and what it moves is
// measured, not cached). io_uring (liburing) issues the I/O where the kernel allows it; where it
// does not (an old kernel, a seccomp filter), a small pool of threads calling pread/pwrite does
// the same job behind the same interface.
//
// The whole file is reserved with fallocate when it is created, so a disk too small fails then,
// with a clear error, and never halfway through a run. The file is removed when the BlockFile is
// destroyed: it holds a working copy of training state, never the only copy of anything a user
// keeps (checkpoints are written elsewhere).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "core/config.h"

namespace keel {

// (IoEngine: core/config.h, tier.engine.)
const char* io_engine_name(IoEngine e);  // "auto" | "io_uring" | "threads"

class BlockFile {
 public:
  // Every offset, size and buffer address must be a multiple of this (O_DIRECT's rule).
  static constexpr size_t kAlign = 4096;
  // `n` rounded up to a multiple of kAlign.
  static constexpr uint64_t align_up(uint64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

  // Creates `path` (which must not exist), reserves `bytes` (rounded up to kAlign) and opens it
  // for O_DIRECT I/O with `engine` (automatic: io_uring if it works here, else threads). Throws
  // keel::Error naming the path when the directory is not writable, the disk lacks the space, or
  // the file system refuses O_DIRECT; nothing is left behind when it throws.
  // `write_delay_us` (tests): the threads engine starts every write this much late, which holds
  // write-backs in flight across the caller's next steps (a disk slow to write, made repeatable).
  static std::unique_ptr<BlockFile> create(const std::string& path, uint64_t bytes, IoEngine engine, int queue_depth = 32,
                                           int write_delay_us = 0);
  virtual ~BlockFile() = default;
  BlockFile(const BlockFile&) = delete;
  BlockFile& operator=(const BlockFile&) = delete;

  // Starts a read of `bytes` at `offset` into buf (or a write from buf) and returns a ticket for
  // wait(). The buffer must stay valid until then. Requests are independent: two in flight on
  // overlapping ranges are the caller's problem (the tier manager never issues them).
  virtual uint64_t read(void* buf, size_t bytes, uint64_t offset) = 0;
  virtual uint64_t write(const void* buf, size_t bytes, uint64_t offset) = 0;
  // Blocks until the request is complete; throws keel::Error naming the file, the offset and the
  // system's reason if it failed or moved fewer bytes than asked. Each ticket is waited for once.
  virtual void wait(uint64_t ticket) = 0;
  // Whether the request has completed (then wait() returns at once). Never blocks.
  virtual bool done(uint64_t ticket) = 0;

  IoEngine engine() const { return engine_; }
  const std::string& path() const { return path_; }
  uint64_t size() const { return size_; }
  // Reserves the file up to `bytes` (rounded up to kAlign; never shrinks) with fallocate, as
  // create() does: throws keel::Error naming the path when the disk lacks the space. Requests in
  // flight are unaffected.
  void grow(uint64_t bytes);
  // The file's size as the file system reports it now (fstat): measured, not assumed. (Its disk
  // blocks can be a block or so more: the file system's own extent records.)
  uint64_t measured_size() const;

 protected:
  BlockFile(std::string path, uint64_t size, IoEngine engine, int fd) : path_(std::move(path)), size_(size), engine_(engine), fd_(fd) {}
  // Throws unless [offset, offset + bytes) is inside the file and everything is aligned.
  void check_request(const void* buf, size_t bytes, uint64_t offset) const;
  // Closes and removes the file (called by the engines' destructors after their I/O drained).
  void close_and_remove();
  std::string path_;
  uint64_t size_;
  IoEngine engine_;
  int fd_;
};

// An aligned heap buffer for BlockFile I/O.
struct AlignedBuffer {
  AlignedBuffer() = default;
  explicit AlignedBuffer(size_t bytes);
  AlignedBuffer(AlignedBuffer&& o) noexcept : data(o.data), bytes(o.bytes) { o.data = nullptr, o.bytes = 0; }
  AlignedBuffer& operator=(AlignedBuffer&& o) noexcept;
  ~AlignedBuffer();
  void* data = nullptr;
  size_t bytes = 0;
};

}  // namespace keel
