#include "comm/grad_sync.h"

#include <algorithm>
#include <cstring>

namespace keel {

namespace {
double ms_between(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}
}  // namespace

GradSync::GradSync(Communicator& comm, ChunkStore& store, int64_t bucket_bytes, const ChunkPartition* scatter_to)
    : comm_(comm), store_(store), scatter_to_(scatter_to) {
  const std::vector<Chunk>& chunks = store.chunks();
  const int64_t bucket_floats = std::max<int64_t>(1, bucket_bytes / static_cast<int64_t>(sizeof(float)));
  // Walk chunks from the end of the flat space (the last layers: produced first by backward).
  int64_t end = store.numel();
  Bucket current;
  bool open = false;
  for (int c = static_cast<int>(chunks.size()) - 1; c >= 0; --c) {
    if (!open) {
      current = Bucket{};
      current.ready_layer = chunks[c].layer;
      open = true;
    }
    current.offset = chunks[c].offset;
    current.ready_layer = std::min(current.ready_layer, chunks[c].layer);
    if (end - current.offset >= bucket_floats || c == 0) {
      current.numel = end - current.offset;
      buckets_.push_back(current);
      end = current.offset;
      open = false;
    }
  }
}

void GradSync::begin(bool sync) {
  active_ = sync && comm_.size() > 1;
  next_ = 0;
  stats_ = SyncStats{};
  for (Bucket& b : buckets_) {
    b.request = Communicator::Request{};
    b.settled = true;
  }
}

void GradSync::progress() {
  for (size_t i = 0; i < next_; ++i) {
    Bucket& b = buckets_[i];
    if (!b.settled && comm_.test(b.request)) settle(b);
  }
}

void GradSync::settle(Bucket& b) {
  b.settled = true;
  if (scatter_to_ == nullptr) return;
  // MPI leaves this rank's sum at the start of the bucket; move it where it belongs, then let go
  // of everything else in the bucket.
  float* base = store_.range_view(Plane::grad, b.offset, b.numel).data();
  if (b.own_count > 0 && b.own_offset != b.offset) {
    std::memmove(base + (b.own_offset - b.offset), base, static_cast<size_t>(b.own_count) * sizeof(float));
  }
  const int64_t own_end = b.own_count > 0 ? b.own_offset + b.own_count : b.offset;
  const int64_t own_begin = b.own_count > 0 ? b.own_offset : b.offset;
  store_.discard(Plane::grad, b.offset, own_begin - b.offset);
  store_.discard(Plane::grad, own_end, b.offset + b.numel - own_end);
}

void GradSync::after_backward_input(int) {
  if (active_) progress();
}

void GradSync::after_backward_weight(int layer) {
  if (!active_) return;
  // Layers finish in descending order, so a bucket whose lowest layer is done is complete.
  while (next_ < buckets_.size() && buckets_[next_].ready_layer >= layer) {
    Bucket& b = buckets_[next_];
    if (next_ == 0) first_start_ = std::chrono::steady_clock::now();
    float* data = store_.range_view(Plane::grad, b.offset, b.numel).data();
    if (scatter_to_ == nullptr) {
      b.request = comm_.iallreduce_sum(data, static_cast<size_t>(b.numel));
    } else {
      const std::vector<int> counts = scatter_to_->intersect(b.offset, b.numel);
      b.own_offset = std::max(b.offset, scatter_to_->begin[comm_.rank()]);
      b.own_count = counts[comm_.rank()];
      b.request = comm_.ireduce_scatter_sum(data, counts);
    }
    b.settled = false;
    stats_.payload_bytes += static_cast<double>(b.numel) * sizeof(float);
    stats_.buckets++;
    next_++;
  }
  progress();
}

void GradSync::finish() {
  if (!active_) return;
  // Any bucket not started yet (e.g. a backward that skipped a layer's hook) starts now.
  while (next_ < buckets_.size()) after_backward_weight(-1);
  const auto t0 = std::chrono::steady_clock::now();
  for (Bucket& b : buckets_) comm_.wait(b.request);
  const auto t1 = std::chrono::steady_clock::now();
  for (Bucket& b : buckets_) {
    if (!b.settled) settle(b);
  }
  stats_.exposed_ms = ms_between(t0, t1);
  stats_.latency_ms = ms_between(first_start_, t1);
  const double n = comm_.size();
  // Ring algorithms: all-reduce sends 2 (N-1)/N of the payload, reduce-scatter (N-1)/N.
  stats_.sent_bytes = stats_.payload_bytes * (scatter_to_ != nullptr ? 1.0 : 2.0) * (n - 1) / n;
  active_ = false;
}

}  // namespace keel
