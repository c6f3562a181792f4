#include "store/chunk_store.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <omp.h>

#include "core/error.h"
#include "kernels/cpu/bf16.h"

namespace keel {

namespace {
// Tensors start on 64-byte boundaries so SIMD kernels and BLAS see aligned rows.
constexpr int64_t kAlignFloats = 16;
int64_t align_up(int64_t n) { return (n + kAlignFloats - 1) / kAlignFloats * kAlignFloats; }
// Chunks start on 4 KiB boundaries (and the planes end on one), so that a chunk's bytes, rounded
// up to whole 4 KiB blocks, stay inside its own range plus the gap before the next chunk: the
// memory tiers move them with O_DIRECT straight from and into the planes.
constexpr int64_t kChunkAlignFloats = 1024;
// A transparent huge page (2 MiB), in floats.
constexpr int64_t kHugeFloats = (2 << 20) / static_cast<int64_t>(sizeof(float));
int64_t align_chunk(int64_t n) { return (n + kChunkAlignFloats - 1) / kChunkAlignFloats * kChunkAlignFloats; }
}  // namespace

// The store's own residency: every page is present in its plane at all times. Leases cost a
// version count; zeroing and discarding act on the planes directly.
class PresentPlanes final : public Residency {
 public:
  explicit PresentPlanes(ChunkStore& store) : store_(store) {}
  bool always_present() const override { return true; }
  void acquire(std::span<const PageRef>) override {}
  void release(std::span<const PageRef> pages, bool modified) override {
    if (!modified) return;
    for (const PageRef& p : pages) versions_[index(p)]++;
  }
  int hint(std::span<const PageRef>) override { return 0; }
  uint64_t version(PageRef p) const override { return versions_.at(index(p)); }
  void zero(PageRef p, bool zeroed_in_place) override {
    if (!zeroed_in_place) {
      std::span<float> v = store_.chunk_view(p.chunk, p.plane);
      std::fill(v.begin(), v.end(), 0.0f);
    }
    versions_[index(p)]++;
  }
  void discard(Plane plane, int64_t offset, int64_t numel) override {
    store_.zero_and_release(plane, offset, numel);
    for (const Chunk& c : store_.chunks_overlapping(offset, numel)) versions_[index({c.id, plane})]++;
  }
  bool updates_at_home(PageRef) const override { return false; }  // home is the compute address
  void update_at_home(PageRef p, const std::function<void(float*, size_t)>& update) override {
    std::span<float> v = store_.chunk_view(p.chunk, p.plane);
    update(v.data(), v.size());
    versions_[index(p)]++;
  }
  bool known_sum_squares(PageRef, double*) const override { return false; }  // reading it is free
  void step_shape_changed() override {}
  void size_for(size_t chunks) { versions_.assign(chunks * kNumPlanes, 0); }

 private:
  static size_t index(PageRef p) { return static_cast<size_t>(p.chunk) * kNumPlanes + static_cast<size_t>(p.plane); }
  ChunkStore& store_;
  std::vector<uint64_t> versions_;
};

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

bool populate_for_write(void* p, size_t bytes) {
  if (bytes == 0) return true;
#ifdef MADV_POPULATE_WRITE
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t first = reinterpret_cast<uintptr_t>(p) / page * page;
  const uintptr_t last = (reinterpret_cast<uintptr_t>(p) + bytes + page - 1) / page * page;
  return ::madvise(reinterpret_cast<void*>(first), last - first, MADV_POPULATE_WRITE) == 0;
#else
  return false;
#endif
}

void zero_and_give_back(void* p, size_t bytes) {
  char* begin = static_cast<char*>(p);
  char* end = begin + bytes;
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  char* inner_begin = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(begin) + page - 1) / page * page);
  char* inner_end = reinterpret_cast<char*>(reinterpret_cast<uintptr_t>(end) / page * page);
  if (inner_begin >= inner_end) {
    std::memset(begin, 0, bytes);
    return;
  }
  std::memset(begin, 0, static_cast<size_t>(inner_begin - begin));
  std::memset(inner_end, 0, static_cast<size_t>(end - inner_end));
  check(::madvise(inner_begin, static_cast<size_t>(inner_end - inner_begin), MADV_DONTNEED) == 0,
        "chunk store: madvise(MADV_DONTNEED) failed");
}

ChunkStore::Mapping::Mapping(size_t n) : bytes(std::max<size_t>(n, 4096)) {
  // On a 2 MiB boundary (flat offsets aligned to huge pages are then huge-page aligned in
  // memory): map 2 MiB more and give back what lies before and after the aligned range.
  constexpr size_t kHuge = 2 << 20;
  bytes = (bytes + 4095) / 4096 * 4096;
  void* p = ::mmap(nullptr, bytes + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  check(p != MAP_FAILED, "chunk store: cannot map " + std::to_string(bytes) + " bytes of memory");
  char* raw = static_cast<char*>(p);
  char* aligned = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(raw) + kHuge - 1) / kHuge * kHuge);
  if (aligned > raw) ::munmap(raw, static_cast<size_t>(aligned - raw));
  const size_t tail = static_cast<size_t>(raw + bytes + kHuge - (aligned + bytes));
  if (tail > 0) ::munmap(aligned + bytes, tail);
  data = reinterpret_cast<float*>(aligned);
}

ChunkStore::Mapping::Mapping(Mapping&& other) noexcept : data(other.data), bytes(other.bytes) {
  other.data = nullptr;
  other.bytes = 0;
}

ChunkStore::Mapping& ChunkStore::Mapping::operator=(Mapping&& other) noexcept {
  if (this != &other) {
    if (data != nullptr) ::munmap(data, bytes);
    data = other.data;
    bytes = other.bytes;
    other.data = nullptr;
    other.bytes = 0;
  }
  return *this;
}

ChunkStore::Mapping::~Mapping() {
  if (data != nullptr) ::munmap(data, bytes);
}

ChunkStore::ChunkStore(int64_t chunk_bytes) : chunk_bytes_(chunk_bytes) {
  check(chunk_bytes >= 4096 && chunk_bytes % 4096 == 0,
        "store.chunk_bytes: expected a multiple of 4096, found " + std::to_string(chunk_bytes));
  own_residency_ = std::make_unique<PresentPlanes>(*this);
  residency_ = own_residency_.get();
}

ChunkStore::~ChunkStore() = default;

void ChunkStore::attach_residency(Residency* residency) {
  check(finalized_, "chunk store: a residency attached before finalize");
  residency_ = residency != nullptr ? residency : own_residency_.get();
}

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

void ChunkStore::finalize_layout() {
  check(!finalized_, "chunk store: finalize called twice");
  lay_out();
  finalized_ = true;
  layout_only_ = true;
  moment_chunk_begin_ = 0;
  moment_chunk_end_ = static_cast<int>(chunks_.size());
  param_chunk_begin_ = 0;
  param_chunk_end_ = moment_chunk_end_;
}

void ChunkStore::lay_out() {
  const int64_t cap = chunk_bytes_ / static_cast<int64_t>(sizeof(float));
  int64_t cursor = 0;
  Chunk* open = nullptr;
  auto start_chunk = [&](const TensorSpec& s) {
    Chunk c;
    c.id = static_cast<int>(chunks_.size());
    c.layer = s.layer;
    c.replica = s.replica;
    c.expert = s.expert;
    c.kind = s.kind;
    c.offset = cursor;
    chunks_.push_back(c);
    open = &chunks_.back();
  };
  for (int t = 0; t < static_cast<int>(tensors_.size()); ++t) {
    TensorInfo& info = tensors_[t];
    const TensorSpec& s = info.spec;
    if (open == nullptr || open->layer != s.layer || open->kind != s.kind || open->replica != s.replica ||
        open->expert != s.expert) {
      cursor = align_chunk(cursor);
      if (huge_align_) {
        // A run of chunks (one layer, one kind) of a huge page or more starts on a huge-page
        // boundary, so its pages are made of whole huge pages (see set_huge_page_alignment).
        int64_t run = 0;
        for (int u = t; u < static_cast<int>(tensors_.size()) && tensors_[u].spec.layer == s.layer &&
                        tensors_[u].spec.kind == s.kind && tensors_[u].spec.expert == s.expert;
             ++u)
          run += align_up(tensors_[u].numel);
        if (run >= kHugeFloats) cursor = (cursor + kHugeFloats - 1) / kHugeFloats * kHugeFloats;
      }
      start_chunk(s);
    }
    // Pad to alignment inside the chunk when there is room; otherwise start a new chunk.
    const int64_t aligned = align_up(cursor);
    if (aligned - open->offset >= cap) {
      cursor = align_chunk(aligned);
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
  numel_ = align_chunk(cursor);
  if (!chunks_.empty()) chunks_.back().numel = numel_ - chunks_.back().offset;

  int max_layer = tensors_.empty() ? -1 : tensors_.back().spec.layer;
  layer_chunks_.assign(max_layer + 1, {});
  for (const Chunk& c : chunks_) layer_chunks_[c.layer].push_back(c.id);
}

void ChunkStore::finalize(bool touch_params) {
  check(!finalized_, "chunk store: finalize called twice");
  lay_out();
  const size_t bytes = static_cast<size_t>(std::max<int64_t>(numel_, kAlignFloats)) * sizeof(float);
  for (int i = 0; i < kNumPlanes; ++i) {
    planes_[i] = Mapping(bytes);
    // Parameters are touched now rather than page by page in the first step. Gradients and
    // moments are left untouched until used: moments may be sharded first, and a ZeRO-2 rank
    // only ever holds its own gradient shard plus the buckets still being reduced.
    // One call faults every page in (a memset's page-by-page faults where it cannot; the pages
    // read as zero either way).
    if (i == static_cast<int>(Plane::param) && touch_params && !populate_for_write(planes_[i].data, planes_[i].bytes))
      std::memset(planes_[i].data, 0, bytes);
    plane_begin_[i] = 0;
    plane_end_[i] = numel_;
  }
  moment_chunk_begin_ = 0;
  moment_chunk_end_ = static_cast<int>(chunks_.size());
  param_chunk_begin_ = 0;
  param_chunk_end_ = moment_chunk_end_;
  finalized_ = true;
  pending_.assign(chunks_.size(), 0);
  static_cast<PresentPlanes*>(own_residency_.get())->size_for(chunks_.size());
}

void ChunkStore::shard_moments(int chunk_begin, int chunk_end) {
  check(finalized_ && 0 <= chunk_begin && chunk_begin <= chunk_end && chunk_end <= static_cast<int>(chunks_.size()),
        "chunk store: bad moment shard [" + std::to_string(chunk_begin) + ", " + std::to_string(chunk_end) + ")");
  // The flat range from the first chunk's start to the next chunk's start (alignment gap included).
  if (layout_only_) {
    moment_chunk_begin_ = chunk_begin, moment_chunk_end_ = chunk_end;
    return;
  }
  const int n = static_cast<int>(chunks_.size());
  const int64_t begin = chunk_begin < n ? chunks_[chunk_begin].offset : numel_;
  const int64_t end = chunk_end < n ? chunks_[chunk_end].offset : numel_;
  for (Plane p : {Plane::adam_m, Plane::adam_v}) {
    const int i = static_cast<int>(p);
    planes_[i] = Mapping(static_cast<size_t>(end - begin) * sizeof(float));
    plane_begin_[i] = begin;
    plane_end_[i] = end;
  }
  moment_chunk_begin_ = chunk_begin;
  moment_chunk_end_ = chunk_end;
}

void ChunkStore::home_params(int chunk_begin, int chunk_end, std::vector<uint8_t> homed) {
  const int n = static_cast<int>(chunks_.size());
  check(finalized_ && 0 <= chunk_begin && chunk_begin <= chunk_end && chunk_end <= n &&
            (homed.empty() || homed.size() == chunks_.size()),
        "chunk store: bad parameter home [" + std::to_string(chunk_begin) + ", " + std::to_string(chunk_end) + ")");
  param_chunk_begin_ = chunk_begin;
  param_chunk_end_ = chunk_end;
  param_homed_ = std::move(homed);
  params_homed_in_part_ = false;
  for (int c = 0; c < n && !params_homed_in_part_; ++c) params_homed_in_part_ = !param_homed(c);
}

std::pair<int64_t, int64_t> ChunkStore::param_home_elements() const {
  const int n = static_cast<int>(chunks_.size());
  return {param_chunk_begin_ < n ? chunks_[param_chunk_begin_].offset : numel_,
          param_chunk_end_ < n ? chunks_[param_chunk_end_].offset : numel_};
}

int64_t ChunkStore::plane_bytes(Plane plane) const {
  const int i = static_cast<int>(plane);
  return (plane_end_[i] - plane_begin_[i]) * static_cast<int64_t>(sizeof(float));
}

int64_t ChunkStore::resident_bytes(Plane plane, int64_t offset, int64_t numel) const {
  if (layout_only_ || numel <= 0) return 0;
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(plane_at(plane, offset, numel)) / page * page;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(plane_at(plane, offset, numel) + numel) + page - 1) / page * page;
  std::vector<unsigned char> in_core((end - begin) / page);
  check(::mincore(reinterpret_cast<void*>(begin), end - begin, in_core.data()) == 0, "chunk store: mincore failed");
  int64_t pages = 0;
  for (unsigned char c : in_core) pages += c & 1;
  return pages * static_cast<int64_t>(page);
}

float* ChunkStore::plane_at(Plane plane, int64_t offset, int64_t numel) const {
  const int i = static_cast<int>(plane);
  if (offset < plane_begin_[i] || offset + numel > plane_end_[i]) {
    throw Error(std::string("chunk store: elements [") + std::to_string(offset) + ", " + std::to_string(offset + numel) +
                ") of plane " + std::to_string(i) + " are not held by this rank (optimizer state is sharded)");
  }
  return planes_[i].get() + (offset - plane_begin_[i]);
}

namespace {

constexpr int64_t kSquaresBlock = 4096;
constexpr int kSquaresLanes = 16;

// One block of sum_squares (at most kSquaresBlock elements): lane j sums elements j, j + 16, ...
// (independent chains: the compiler keeps the lanes in vector registers), the tail goes to the
// lanes in the same way, and the lanes are added pairwise.
double block_sum_squares(const float* x, int64_t n) {
  double lane[kSquaresLanes] = {};
  int64_t i = 0;
  for (; i + kSquaresLanes <= n; i += kSquaresLanes) {
#pragma omp simd
    for (int j = 0; j < kSquaresLanes; ++j) lane[j] += static_cast<double>(x[i + j]) * x[i + j];
  }
  for (int j = 0; i + j < n; ++j) lane[j] += static_cast<double>(x[i + j]) * x[i + j];
  for (int width = kSquaresLanes / 2; width >= 1; width /= 2) {
    for (int j = 0; j < width; ++j) lane[j] += lane[j + width];
  }
  return lane[0];
}

}  // namespace

double sum_squares(std::span<const float> g) {
  const int64_t n = static_cast<int64_t>(g.size());
  const int64_t blocks = (n + kSquaresBlock - 1) / kSquaresBlock;
  if (blocks <= 1) return block_sum_squares(g.data(), n);
  std::vector<double> partial(static_cast<size_t>(blocks));
  const bool outer = !omp_in_parallel();
#pragma omp parallel for schedule(static) if (outer)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * kSquaresBlock;
    partial[static_cast<size_t>(b)] = block_sum_squares(g.data() + begin, std::min(kSquaresBlock, n - begin));
  }
  double total = 0;
  for (double p : partial) total += p;
  return total;
}

void ChunkStore::set_version(int chunk, uint64_t version) {
  chunks_[chunk].version = version;
  if (!bf16_copies_.empty()) forget_bf16(chunk);
}

bool ChunkStore::bf16_current(int chunk) const {
  const Bf16Copy& b = bf16_copies_[static_cast<size_t>(chunk)];
  return b.made && b.version == chunks_[chunk].version && b.page_version == residency_->version({chunk, Plane::param});
}

const uint16_t* ChunkStore::bf16_params(TensorId id) {
  if (!bf16_copies_on_ || layout_only_ || !residency_->always_present()) return nullptr;
  if (bf16_plane_.data == nullptr) {
    bf16_plane_ = Mapping(static_cast<size_t>(numel_) * sizeof(uint16_t));
    bf16_copies_.assign(chunks_.size(), Bf16Copy{});
  }
  uint16_t* bits = reinterpret_cast<uint16_t*>(bf16_plane_.data);
  const TensorInfo& t = tensors_.at(id);
  // The chunks are in flat order: the first one that ends past the tensor's start holds it.
  auto c = std::upper_bound(chunks_.begin(), chunks_.end(), t.offset,
                            [](int64_t offset, const Chunk& k) { return offset < k.offset + k.numel; });
  for (; c != chunks_.end() && c->offset < t.offset + t.numel; ++c) {
    Bf16Copy& b = bf16_copies_[static_cast<size_t>(c->id)];
    b.feeds_products = true;
    if (bf16_current(c->id)) continue;
    to_bf16(bits + c->offset, plane_at(Plane::param, c->offset, c->numel), c->numel);
    bf16_written(c->id);
  }
  return bits + t.offset;
}

uint16_t* ChunkStore::bf16_chunk_to_write(int chunk) {
  if (!bf16_copies_on_ || bf16_copies_.empty() || !bf16_copies_[static_cast<size_t>(chunk)].feeds_products ||
      !residency_->always_present()) {
    return nullptr;
  }
  return reinterpret_cast<uint16_t*>(bf16_plane_.data) + chunks_[chunk].offset;
}

void ChunkStore::bf16_written(int chunk) {
  Bf16Copy& b = bf16_copies_[static_cast<size_t>(chunk)];
  b.made = true;
  b.version = chunks_[chunk].version;
  b.page_version = residency_->version({chunk, Plane::param});
}

PageLease::PageLease(Residency* residency, std::vector<PageRef> read, std::vector<PageRef> written, bool layer)
    : residency_(residency), read_(std::move(read)), written_(std::move(written)), layer_(layer) {
  std::vector<PageRef> all = read_;
  all.insert(all.end(), written_.begin(), written_.end());
  if (layer) {
    residency_->acquire_layer(all);
  } else {
    residency_->acquire(all);
  }
}

PageLease::PageLease(PageLease&& o) noexcept
    : residency_(o.residency_), read_(std::move(o.read_)), written_(std::move(o.written_)), layer_(o.layer_) {
  o.residency_ = nullptr;
}

PageLease& PageLease::operator=(PageLease&& o) noexcept {
  if (this != &o) {
    end();
    residency_ = o.residency_;
    read_ = std::move(o.read_);
    written_ = std::move(o.written_);
    layer_ = o.layer_;
    o.residency_ = nullptr;
  }
  return *this;
}

PageLease::~PageLease() { end(); }

void PageLease::end() {
  if (residency_ == nullptr) return;
  if (layer_) {
    if (!read_.empty()) residency_->release_layer(read_, false);
    if (!written_.empty()) residency_->release_layer(written_, true);
  } else {
    if (!read_.empty()) residency_->release(read_, false);
    if (!written_.empty()) residency_->release(written_, true);
  }
  residency_ = nullptr;
}

bool ChunkStore::any_pending() const {
  return std::any_of(pending_.begin(), pending_.end(), [](uint8_t p) { return p != 0; });
}

void ChunkStore::apply_pending(int chunk) const {
  if (pending_.empty() || !pending_[static_cast<size_t>(chunk)]) return;
  pending_[static_cast<size_t>(chunk)] = 0;  // first: the update's own lease must not recurse
  const int outer = updating_;
  updating_ = chunk;
  try {
    updater_(chunk);
  } catch (...) {
    updating_ = outer;
    throw;
  }
  updating_ = outer;
}

void ChunkStore::apply_pending() const {
  for (int c = 0; c < static_cast<int>(pending_.size()); ++c) apply_pending(c);
}

int ChunkStore::hint_layers(std::span<const LayerHint> hints) {
  std::vector<PageRef> pages;
  for (const LayerHint& h : hints) {
    if (h.layer < 0 || h.layer >= static_cast<int>(layer_chunks_.size())) continue;
    for (int c : layer_chunks_[h.layer]) {
      chunks_[c].hinted++;
      pages.push_back({c, h.plane});
    }
  }
  return residency_->hint(pages);
}

PageLease ChunkStore::use_layer(int layer, std::initializer_list<Plane> read, std::initializer_list<Plane> write) {
  if (layer < 0 || layer >= static_cast<int>(layer_chunks_.size())) return {};
  for (int c : layer_chunks_[layer]) {
    chunks_[c].accesses++;
    apply_pending(c);
  }
  std::vector<PageRef> r, w;
  for (int c : layer_chunks_[layer]) {
    for (Plane p : read) r.push_back({c, p});
    for (Plane p : write) w.push_back({c, p});
  }
  return PageLease(residency_, std::move(r), std::move(w), /*layer=*/true);
}

PageLease ChunkStore::use_range(Plane plane, int64_t offset, int64_t numel, bool write, bool layer) {
  std::vector<PageRef> pages;
  for (const Chunk& c : chunks_) {
    if (c.offset + c.numel <= offset || c.offset >= offset + numel) continue;
    apply_pending(c.id);
    pages.push_back({c.id, plane});
  }
  return write ? PageLease(residency_, {}, std::move(pages), layer) : PageLease(residency_, std::move(pages), {}, layer);
}

PageLease ChunkStore::use_tensor(TensorId id, std::initializer_list<Plane> read, std::initializer_list<Plane> write) {
  const TensorInfo& t = tensors_.at(id);
  std::vector<PageRef> r, w;
  for (const Chunk& c : chunks_) {
    if (c.offset + c.numel <= t.offset || c.offset >= t.offset + t.numel) continue;
    apply_pending(c.id);
    for (Plane p : read) r.push_back({c.id, p});
    for (Plane p : write) w.push_back({c.id, p});
  }
  return PageLease(residency_, std::move(r), std::move(w));
}

PageLease ChunkStore::use_chunk(int chunk, std::initializer_list<Plane> read, std::initializer_list<Plane> write) const {
  apply_pending(chunk);
  std::vector<PageRef> r, w;
  for (Plane p : read) r.push_back({chunk, p});
  for (Plane p : write) w.push_back({chunk, p});
  return PageLease(residency_, std::move(r), std::move(w));
}

std::span<float> ChunkStore::view(TensorId id, Plane plane) {
  const TensorInfo& t = tensors_.at(id);
  return {plane_at(plane, t.offset, t.numel), static_cast<size_t>(t.numel)};
}

std::span<const float> ChunkStore::view(TensorId id, Plane plane) const {
  const TensorInfo& t = tensors_.at(id);
  return {plane_at(plane, t.offset, t.numel), static_cast<size_t>(t.numel)};
}

std::span<float> ChunkStore::chunk_view(int chunk, Plane plane) {
  const Chunk& c = chunks_.at(chunk);
  return {plane_at(plane, c.offset, c.numel), static_cast<size_t>(c.numel)};
}

std::span<const float> ChunkStore::chunk_view(int chunk, Plane plane) const {
  const Chunk& c = chunks_.at(chunk);
  return {plane_at(plane, c.offset, c.numel), static_cast<size_t>(c.numel)};
}

void ChunkStore::zero_grads() {
  float* g = planes_[static_cast<int>(Plane::grad)].get();
  const int64_t n = numel_;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) g[i] = 0.0f;
}

void ChunkStore::prefer_huge_pages() {
  // Only the whole huge pages inside each chunk: a huge page across two chunks (or a chunk and
  // the padding after it) would keep memory resident that belongs to neither.
  const char* huge = std::getenv("KEEL_HUGE_PAGES");  // "0": none (for measuring what they buy)
  if (huge != nullptr && std::string(huge) == "0") return;
  constexpr uintptr_t kHuge = 2 << 20;
  for (Mapping& m : planes_) {
    if (m.data == nullptr) continue;
    for (const Chunk& c : chunks_) {
      const uintptr_t begin = reinterpret_cast<uintptr_t>(m.data + c.offset);
      const uintptr_t end = reinterpret_cast<uintptr_t>(m.data + c.offset + c.numel);
      const uintptr_t lo = (begin + kHuge - 1) / kHuge * kHuge, hi = end / kHuge * kHuge;
      if (lo < hi) ::madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
    }
  }
}

void ChunkStore::zero_grad_chunk(int chunk) { residency_->zero({chunk, Plane::grad}, /*zeroed_in_place=*/false); }

void ChunkStore::discard(Plane plane, int64_t offset, int64_t numel) {
  if (numel <= 0) return;
  residency_->discard(plane, offset, numel);
  if (plane != Plane::param || bf16_copies_.empty()) return;
  for (const Chunk& c : chunks_overlapping(offset, numel)) forget_bf16(c.id);
}

std::span<const Chunk> ChunkStore::chunks_overlapping(int64_t offset, int64_t numel) const {
  if (numel <= 0) return {};
  const auto first = std::partition_point(chunks_.begin(), chunks_.end(),
                                          [&](const Chunk& c) { return c.offset + c.numel <= offset; });
  const auto last = std::partition_point(first, chunks_.end(), [&](const Chunk& c) { return c.offset < offset + numel; });
  return {first, last};
}

void ChunkStore::zero_and_release(Plane plane, int64_t offset, int64_t numel) {
  zero_and_give_back(plane_at(plane, offset, numel), static_cast<size_t>(numel) * sizeof(float));
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
