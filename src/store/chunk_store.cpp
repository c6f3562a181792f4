#include "store/chunk_store.h"

#include <cstdlib>
#include <cstring>

#include "core/error.h"

namespace keel {

namespace {
// Tensors start on 64-byte boundaries so SIMD kernels and BLAS see aligned rows.
constexpr int64_t kAlignFloats = 16;
int64_t align_up(int64_t n) { return (n + kAlignFloats - 1) / kAlignFloats * kAlignFloats; }
}  // namespace

const char* kind_name(ChunkKind kind) {
  switch (kind) {
    case ChunkKind::embedding: return "embedding";
    case ChunkKind::attention: return "attention";
    case ChunkKind::ffn: return "ffn";
    case ChunkKind::norm: return "norm";
    case ChunkKind::head: return "head";
  }
  return "?";
}

void ChunkStore::Free::operator()(float* p) const { std::free(p); }

ChunkStore::ChunkStore(int64_t chunk_bytes) : chunk_bytes_(chunk_bytes) {
  check(chunk_bytes >= 4096 && chunk_bytes % 64 == 0,
        "store.chunk_bytes: expected a multiple of 64 >= 4096, found " + std::to_string(chunk_bytes));
}

ChunkStore::~ChunkStore() = default;

TensorId ChunkStore::add(TensorSpec spec) {
  check(!finalized_, "chunk store: tensor " + spec.name + " added after finalize");
  check(tensors_.empty() || tensors_.back().spec.layer <= spec.layer,
        "chunk store: tensor " + spec.name + " registered out of layer order");
  TensorInfo info;
  info.numel = 1;
  for (int64_t d : spec.shape) info.numel *= d;
  info.spec = std::move(spec);
  tensors_.push_back(std::move(info));
  return static_cast<TensorId>(tensors_.size() - 1);
}

void ChunkStore::finalize() {
  check(!finalized_, "chunk store: finalize called twice");
  const int64_t cap = chunk_bytes_ / static_cast<int64_t>(sizeof(float));
  int64_t cursor = 0;
  Chunk* open = nullptr;
  auto start_chunk = [&](const TensorSpec& s) {
    Chunk c;
    c.id = static_cast<int>(chunks_.size());
    c.layer = s.layer;
    c.kind = s.kind;
    c.offset = cursor;
    chunks_.push_back(c);
    open = &chunks_.back();
  };
  for (int t = 0; t < static_cast<int>(tensors_.size()); ++t) {
    TensorInfo& info = tensors_[t];
    const TensorSpec& s = info.spec;
    if (open == nullptr || open->layer != s.layer || open->kind != s.kind) {
      cursor = align_up(cursor);
      start_chunk(s);
    }
    // Pad to alignment inside the chunk when there is room; otherwise start a new chunk.
    const int64_t aligned = align_up(cursor);
    if (aligned - open->offset >= cap) {
      cursor = aligned;
      start_chunk(s);
    }
    cursor = aligned;
    open->numel = cursor - open->offset;
    info.offset = cursor;
    int64_t remaining = info.numel;
    int64_t within = 0;
    while (remaining > 0) {
      int64_t room = cap - (cursor - open->offset);
      if (room <= 0) {
        start_chunk(s);
        room = cap;
      }
      const int64_t take = std::min(room, remaining);
      open->segments.push_back(Segment{t, cursor, take, within});
      cursor += take;
      within += take;
      remaining -= take;
      open->numel = cursor - open->offset;
    }
  }
  numel_ = align_up(cursor);
  if (!chunks_.empty()) chunks_.back().numel = numel_ - chunks_.back().offset;

  int max_layer = tensors_.empty() ? -1 : tensors_.back().spec.layer;
  layer_chunks_.assign(max_layer + 1, {});
  for (const Chunk& c : chunks_) layer_chunks_[c.layer].push_back(c.id);

  const size_t bytes = static_cast<size_t>(std::max<int64_t>(numel_, kAlignFloats)) * sizeof(float);
  for (auto& plane : planes_) {
    void* p = std::aligned_alloc(64, bytes);
    check(p != nullptr, "chunk store: cannot allocate " + std::to_string(bytes) + " bytes");
    std::memset(p, 0, bytes);  // touch every page once, now, rather than during the first step
    plane.reset(static_cast<float*>(p));
  }
  finalized_ = true;
}

void ChunkStore::access_layer(int layer) {
  if (layer < 0 || layer >= static_cast<int>(layer_chunks_.size())) return;
  for (int c : layer_chunks_[layer]) chunks_[c].accesses++;
}

std::span<float> ChunkStore::view(TensorId id, Plane plane) {
  const TensorInfo& t = tensors_.at(id);
  return {planes_[static_cast<int>(plane)].get() + t.offset, static_cast<size_t>(t.numel)};
}

std::span<const float> ChunkStore::view(TensorId id, Plane plane) const {
  const TensorInfo& t = tensors_.at(id);
  return {planes_[static_cast<int>(plane)].get() + t.offset, static_cast<size_t>(t.numel)};
}

std::span<float> ChunkStore::chunk_view(int chunk, Plane plane) {
  const Chunk& c = chunks_.at(chunk);
  return {planes_[static_cast<int>(plane)].get() + c.offset, static_cast<size_t>(c.numel)};
}

std::span<const float> ChunkStore::chunk_view(int chunk, Plane plane) const {
  const Chunk& c = chunks_.at(chunk);
  return {planes_[static_cast<int>(plane)].get() + c.offset, static_cast<size_t>(c.numel)};
}

void ChunkStore::zero_grads() {
  float* g = planes_[static_cast<int>(Plane::grad)].get();
  const int64_t n = numel_;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) g[i] = 0.0f;
}

TensorId ChunkStore::find(const std::string& name) const {
  for (size_t i = 0; i < tensors_.size(); ++i) {
    if (tensors_[i].spec.name == name) return static_cast<TensorId>(i);
  }
  throw Error("chunk store: no tensor named " + name);
}

int64_t ChunkStore::param_count() const {
  int64_t n = 0;
  for (const TensorInfo& t : tensors_) n += t.numel;
  return n;
}

}  // namespace keel
