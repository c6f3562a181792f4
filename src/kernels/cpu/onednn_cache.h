// The oneDNN primitives Keel's float products run (bf16.cpp's bf16 matmuls, weight_gemm.cpp's
// packed-weight products, batched_gemm.cpp's per-head products): each created once per shape and
// layout, kept for the process, and run on the calling thread's stream with a scratchpad the
// caller owns (oneDNN's library-managed scratchpad is not safe to share between concurrent
// executions: two identical runs differed in their last bits when it was).
#pragma once

#include <cstddef>
#include <dnnl.hpp>
#include <map>
#include <memory>
#include <mutex>

namespace keel::onednn {

// The CPU engine every cached primitive is created on and runs on.
const dnnl::engine& engine();

// The calling thread's stream on engine(): a primitive may run on several threads at once.
dnnl::stream& thread_stream();

// Primitives by key: `make()` builds the value on the first request for its key; a key oneDNN
// has no implementation for (`make` throws dnnl::error) is kept as nullptr, so that the caller
// falls back without asking oneDNN again. Safe to call from concurrent threads.
template <typename Key, typename Value>
class Cache {
 public:
  template <typename Make>
  std::shared_ptr<const Value> get(const Key& key, Make make) {
    const std::lock_guard<std::mutex> lock(mutex_);
    const auto it = values_.find(key);
    if (it != values_.end()) return it->second;
    std::shared_ptr<const Value> value;
    try {
      value = std::make_shared<const Value>(make());
    } catch (const dnnl::error&) {
      value = nullptr;
    }
    values_.emplace(key, value);
    return value;
  }

 private:
  std::mutex mutex_;
  std::map<Key, std::shared_ptr<const Value>> values_;
};

// A growing buffer, 64-byte aligned, kept for its owner's next product (declare it
// `static thread_local`: one per thread).
class Buffer {
 public:
  Buffer() = default;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer();
  // At least `bytes` (at least one) bytes; the contents are not kept when it grows.
  void* get(size_t bytes);

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// A product's attributes: the caller's scratchpad, the output scaled by `alpha`, and for
// beta != 0 the destination's old value times beta added (a sum post-op).
dnnl::primitive_attr product_attr(float alpha, float beta);

// A scratchpad of `bytes` in `buffer`, as the memory argument DNNL_ARG_SCRATCHPAD takes.
dnnl::memory scratchpad(Buffer& buffer, size_t bytes);

}  // namespace keel::onednn
