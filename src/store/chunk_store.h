// The chunk store: every trainable number of a model (parameters, their gradients and the
// two AdamW moments) lives here, in chunks of at most `chunk_bytes` per plane. A chunk belongs
// to one layer and one kind, carries a version that the optimizer bumps on every update, and
// knows which tensors (or slices of tensors) it holds. Layers never keep pointers: they ask the
// store for a typed view each time they run, after announcing the access, so that later tiers
// can move, shard or refresh chunks between two accesses.
//
// Every plane is one contiguous allocation (llm.c's "one malloc" idea, cut into movable pieces);
// the rest of Keel speaks chunks and views only. Whether a page's bytes are valid between two
// uses is the business of the store's Residency (store/residency.h): its own, where every page
// stays present, or one attached to it (the memory tiers).
#pragma once

#include <cstdint>
#include <cstddef>
#include <functional>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "store/residency.h"

namespace keel {

enum class ChunkKind : uint8_t { embedding, attention, ffn, norm, head };
const char* kind_name(ChunkKind kind);

struct TensorSpec {
  std::string name;            // e.g. "h.3.attn.qkv.weight"
  std::vector<int64_t> shape;  // row-major
  int layer = 0;               // index in the model's layer list
  ChunkKind kind = ChunkKind::embedding;
  bool decay = false;          // AdamW weight decay applies (matrices and embeddings only)
  // A copy of a tied tensor whose home layer is on another rank (a pipeline stage with the head
  // but not the embedding holds one of wte): its gradient is summed with the home's, and norms
  // count it once, at home. Replica tensors get chunks of their own.
  bool replica = false;
  // A mixture of experts' routed expert (model/moe.h) whose weights this is (-1: none). An
  // expert's tensors get chunks of their own: no chunk holds two experts' weights or an expert's
  // beside anything else, so expert parallelism, gradient syncs and tiers can treat each expert's
  // chunks apart.
  int expert = -1;
};

// A lookahead hint: a layer an operation will soon use, and the plane it needs (parameters for a
// forward or backward-input pass, gradients for a weight pass).
struct LayerHint {
  int layer = 0;
  Plane plane = Plane::param;
  bool operator==(const LayerHint&) const = default;
};

struct TensorInfo {
  TensorSpec spec;
  int64_t offset = 0;  // first element in the flat element space
  int64_t numel = 0;
};

// A piece of one tensor inside one chunk.
struct Segment {
  int tensor = 0;
  int64_t offset = 0;        // flat element offset
  int64_t numel = 0;
  int64_t tensor_offset = 0;  // where this piece starts inside its tensor
};

struct Chunk {
  int id = 0;
  int layer = 0;
  ChunkKind kind = ChunkKind::embedding;
  uint64_t version = 0;     // bumped by every optimizer update of this chunk
  int64_t offset = 0;       // flat element range [offset, offset + numel)
  int64_t numel = 0;
  std::vector<Segment> segments;
  uint64_t accesses = 0;    // times a layer announced use of this chunk (for tier policies)
  uint64_t hinted = 0;      // times a lookahead said the chunk would be used soon
  bool replica = false;     // holds a replica tensor (TensorSpec::replica)
  int expert = -1;          // holds routed expert `expert`'s weights (TensorSpec::expert); -1: none
};

using TensorId = int;

// Faults in, writable, every page overlapping [p, p + bytes) in one call (MADV_POPULATE_WRITE,
// Linux 5.14+; measured 40 % less CPU than touching fresh pages one fault at a time). Returns false
// where the kernel cannot (older kernels, other systems): the pages then fault in when first written.
bool populate_for_write(void* p, size_t bytes);
// Makes the bytes [p, p + bytes) of private anonymous memory zero and gives the whole pages inside
// back to the system (MADV_DONTNEED: they read back as zero); the partial pages at the ends are
// zeroed in place.
void zero_and_give_back(void* p, size_t bytes);

class ChunkStore;

// Sum of squares of `v` in double, in an order fixed by the length alone: blocks of 4096
// elements, each summed in 16 interleaved lanes (lane j takes the elements j, j + 16, ...) that
// are then added pairwise, the block sums added in block order. Each square of a float is exact in
// double, so the result is the same whatever the thread count, the timing or the vector width
// the compiler chose (with or without fused multiply-add).
double sum_squares(std::span<const float> v);

// The pages one operation uses, acquired from the store's residency while the lease lives
// (present, and pinned where pages move); when it ends, the pages of the planes it writes are
// released as modified.
class PageLease {
 public:
  PageLease() = default;
  // `layer`: a layer's pass (Residency::acquire_layer), else one rank's own acquire.
  PageLease(Residency* residency, std::vector<PageRef> read, std::vector<PageRef> written, bool layer = false);
  PageLease(PageLease&& o) noexcept;
  PageLease& operator=(PageLease&& o) noexcept;
  ~PageLease();
  PageLease(const PageLease&) = delete;
  PageLease& operator=(const PageLease&) = delete;
  // Ends the lease early (the destructor then does nothing).
  void end();

 private:
  Residency* residency_ = nullptr;
  std::vector<PageRef> read_, written_;
  bool layer_ = false;
};

class ChunkStore {
 public:
  explicit ChunkStore(int64_t chunk_bytes);
  ~ChunkStore();
  ChunkStore(const ChunkStore&) = delete;
  ChunkStore& operator=(const ChunkStore&) = delete;

  // Registers a tensor. Requires: not finalized; layers registered in non-decreasing order.
  TensorId add(TensorSpec spec);
  // Lays tensors out in chunks and allocates all planes, zero-filled. Chunks never span two
  // layers, two kinds or two experts; a tensor larger than a chunk spans several consecutive chunks.
  // `touch_params`: fault the parameter plane in now (not page by page in the first step);
  // false when memory tiers will hold it (it is then never resident at full size).
  void finalize(bool touch_params = true);
  // Lays tensors out in chunks as finalize does, allocating nothing: a store that only describes
  // a layout (chunks, segments, tensors; every view of it throws). A pipeline stage's checkpoints
  // are written in the whole model's layout, described so.
  void finalize_layout();
  // Keeps the AdamW moment planes only for chunks [begin, end) (ZeRO: this rank's optimizer
  // shard), releasing the rest; the shard starts zero (call it before initialising or loading:
  // the moments are never resident at full size). Requires finalize(). Views outside it throw.
  // On a layout-only store (finalize_layout) it records the shard and allocates nothing: what a
  // ZeRO rank would hold, for placement and planning (keel simulate).
  void shard_moments(int chunk_begin, int chunk_end);
  // Chunks [begin, end) whose moments this store holds (all chunks unless sharded).
  std::pair<int, int> moment_chunks() const { return {moment_chunk_begin_, moment_chunk_end_}; }
  // The parameters of chunks [begin, end) have their home in this store (ZeRO-3: this rank's
  // shard; the other chunks' parameters are here only while a layer uses them, and their pages are
  // never touched otherwise). Drawing and loading the weights write only these, so a rank's start-up
  // holds its shard, never the whole model. `homed` (a flag per chunk of the store; empty: every
  // chunk of the range): those of the range whose parameters stay here once the weights settled
  // (ZeRO-3 with sharded experts: a rank's own chunks are not one range, and the others' in their
  // span are drawn or loaded, then given back). Requires finalize(). All chunks unless set.
  void home_params(int chunk_begin, int chunk_end, std::vector<uint8_t> homed = {});
  std::pair<int, int> param_chunks() const { return {param_chunk_begin_, param_chunk_end_}; }
  // Whether `chunk`'s parameters have their home here once the weights settled (in
  // param_chunks() and flagged by home_params), and whether some chunk's have theirs elsewhere
  // (ZeRO-3: the memory tiers home only the rest, and a layer's lease gathers it whole).
  bool param_homed(int chunk) const {
    return chunk >= param_chunk_begin_ && chunk < param_chunk_end_ &&
           (param_homed_.empty() || param_homed_[static_cast<size_t>(chunk)] != 0);
  }
  bool params_homed_in_part() const { return params_homed_in_part_; }
  // Elements [first, last) of the flat space that param_chunks() span (alignment gaps included).
  std::pair<int64_t, int64_t> param_home_elements() const;
  // Bytes allocated per plane, for memory reports.
  int64_t plane_bytes(Plane plane) const;
  // Bytes of the plane's elements [offset, offset + numel) that the operating system holds in
  // memory now (mincore over its pages; whole pages, rounded outwards). A measurement, not an
  // accounting: a page given back (discard) is not counted until written again.
  int64_t resident_bytes(Plane plane, int64_t offset, int64_t numel) const;
  int64_t resident_bytes(Plane plane) const { return resident_bytes(plane, plane_begin_[static_cast<int>(plane)],
                                                                    plane_end_[static_cast<int>(plane)] - plane_begin_[static_cast<int>(plane)]); }

  // Announces that `layer` is about to be used (forward, backward or update) in the planes
  // given, and counts the access. The layer's pages in those planes are acquired from the
  // residency until the lease ends; `write` planes are released modified then. Views of those
  // pages are valid while the lease lives.
  PageLease use_layer(int layer, std::initializer_list<Plane> read, std::initializer_list<Plane> write = {});
  // Lookahead (a pipeline executor): these layers' chunks will be used soon in these planes,
  // nearest first. Counted per chunk (Chunk::hinted) and passed on to the residency as pages.
  // Returns the fetches the hint started.
  int hint_layers(std::span<const LayerHint> hints);
  // The same for one chunk (the optimizer's unit).
  PageLease use_chunk(int chunk, std::initializer_list<Plane> read, std::initializer_list<Plane> write = {}) const;
  // The same for the chunks that elements [offset, offset + numel) of the flat space touch (a
  // gradient bucket in flight), all in one plane. `layer`: on behalf of a layer's pass
  // (Residency::acquire_layer: what a forward or backward computes with, e.g. a bf16 state's
  // working bits rather than a rank's float32 masters), else one rank's own acquire.
  PageLease use_range(Plane plane, int64_t offset, int64_t numel, bool write, bool layer = false);
  // The same for the chunks one tensor spans.
  PageLease use_tensor(TensorId id, std::initializer_list<Plane> read, std::initializer_list<Plane> write = {});
  // Before finalize: runs of chunks (one layer, one kind) of 2 MiB or more start on a 2 MiB
  // boundary (the gaps cost address space only), so that with prefer_huge_pages their memory is
  // whole transparent huge pages. Memory tiers give pages back and fetch them again every step;
  // at 4 KiB a page that returns is hundreds of page faults and page-table updates, which under
  // a hypervisor that shadows page tables (this machine's) made the step 1.3x slower (GPT-2
  // 124M at 4x the budgets: 7.8 s against 5.8 s).
  void set_huge_page_alignment(bool on) { huge_align_ = on; }
  // Asks for transparent huge pages on the whole 2 MiB pages inside each chunk (where the kernel
  // offers them on request). Best effort: no error where unsupported.
  void prefer_huge_pages();
  // Where pages live between uses: `residency` (not owned; the memory tiers), or nullptr for the
  // store's own, where every page stays present. Requires finalize().
  void attach_residency(Residency* residency);
  Residency& residency() const { return *residency_; }

  // A view of one tensor in one plane. Valid until the layer's next access announcement.
  std::span<float> view(TensorId id, Plane plane);
  std::span<const float> view(TensorId id, Plane plane) const;
  float* data(TensorId id, Plane plane) { return view(id, plane).data(); }
  // A view of a whole chunk in one plane.
  std::span<float> chunk_view(int chunk, Plane plane);
  std::span<const float> chunk_view(int chunk, Plane plane) const;

  // A view of elements [offset, offset + numel) of the flat space in one plane (may span chunks).
  std::span<float> range_view(Plane plane, int64_t offset, int64_t numel) {
    return {plane_at(plane, offset, numel), static_cast<size_t>(numel)};
  }
  std::span<const float> range_view(Plane plane, int64_t offset, int64_t numel) const {
    return {plane_at(plane, offset, numel), static_cast<size_t>(numel)};
  }

  void bump_version(int chunk) { chunks_[chunk].version++; }
  // Also forgets the chunk's bf16 copy: a version set from outside (a checkpoint, a migration)
  // may repeat one the copy was made at, with other bytes.
  void set_version(int chunk, uint64_t version);

  // bf16 copies of parameters, for the layers whose products run in bf16 (oneDNN reads them in
  // place instead of rounding the float32 weights on every product). A copy is made per chunk
  // and tagged with the chunk's version and its parameter page's residency version; it is used
  // only while both are unchanged, so a copy is never stale: the optimizer moves the version,
  // writes under a lease move the page version, and set_version and discard forget the copy.
  // Parameters written with neither (a model's initialisation, a weight import) must be written
  // before the first bf16 product. Copies are kept only where every page stays present (the
  // store's own residency); with memory tiers bf16_params returns nullptr and the products
  // round the float32 weights as they go. Derived state: never checkpointed.
  //
  // The bits of tensor `id`'s parameters, current (chunks whose copy is stale are converted
  // now), or nullptr where copies are not kept. Requires the tensor's parameter pages leased.
  // Marks the tensor's chunks as feeding products: the optimizer then writes their copies as it
  // updates them. Called from the thread that runs the layers (not thread-safe).
  const uint16_t* bf16_params(TensorId id);
  // Whether copies are kept (by default yes). Off: bf16_params returns nullptr and the products
  // round the float32 weights as they go; the arithmetic is the same, the bytes too (tests and
  // benches compare the two).
  void set_bf16_copies(bool on) { bf16_copies_on_ = on; }
  // Where the optimizer writes chunk `chunk`'s copy in the pass that updates its parameters
  // (nullptr when the chunk has no copy to keep). Once written and the chunk's version and page
  // moved on, bf16_written(chunk) tags the copy as current.
  uint16_t* bf16_chunk_to_write(int chunk);
  void bf16_written(int chunk);
  // Zeroes the gradient plane of every chunk.
  void zero_grads();
  // Zeroes one chunk's gradient (Residency::zero: where pages move, declared zero, nothing
  // written back or read).
  void zero_grad_chunk(int chunk);
  // Zeroes elements [offset, offset + numel) of a plane and gives the memory back (see
  // Residency::discard).
  void discard(Plane plane, int64_t offset, int64_t numel);

  // Deferred optimizer updates (where pages move: each chunk's update runs just before its pages
  // are next used, so the optimizer's transfers overlap the next forward pass instead of stalling
  // a phase of their own). `defer_update` marks a chunk pending; every lease (use_*) that touches
  // a pending chunk first runs `updater` on it, exactly once. The updates are the same arithmetic
  // on the same bytes as an immediate step: results are bit-identical.
  void set_updater(std::function<void(int chunk)> updater) { updater_ = std::move(updater); }
  void defer_update(int chunk) { pending_.at(static_cast<size_t>(chunk)) = 1; }
  bool any_pending() const;
  // Runs every pending update now (before a checkpoint, an evaluation, the end of the run).
  void apply_pending() const;
  // The chunk whose deferred update is running now (-1: none): the memory tiers tell an update's
  // leases from the step's others (store/tiers.h: one applied between steps leaves the schedule).
  int updating() const { return updating_; }

  // The sum of squares of a chunk's gradient when the residency knows it without reading the
  // page (Residency::known_sum_squares). True (and *out set) when known.
  bool cached_grad_sum_squares(int chunk, double* out) const {
    return residency_->known_sum_squares({chunk, Plane::grad}, out);
  }

  const std::vector<Chunk>& chunks() const { return chunks_; }
  // The chunks that overlap the flat range [offset, offset + numel) (chunks lie in offset order:
  // a binary search, not a scan).
  std::span<const Chunk> chunks_overlapping(int64_t offset, int64_t numel) const;
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  TensorId find(const std::string& name) const;  // throws keel::Error if absent
  int64_t numel() const { return numel_; }
  int64_t param_count() const;  // elements that belong to tensors (excludes alignment padding)
  int64_t chunk_bytes() const { return chunk_bytes_; }
  bool finalized() const { return finalized_; }

 private:
  int64_t chunk_bytes_;
  bool finalized_ = false;
  bool huge_align_ = false;
  int64_t numel_ = 0;
  std::vector<TensorInfo> tensors_;
  std::vector<Chunk> chunks_;
  std::vector<std::vector<int>> layer_chunks_;
  float* plane_at(Plane plane, int64_t offset, int64_t numel) const;
  // One anonymous mapping per plane: page-aligned, zero, and resident only once written, so a
  // moment plane that is sharded before use never costs its full size.
  struct Mapping {
    float* data = nullptr;
    size_t bytes = 0;
    Mapping() = default;
    explicit Mapping(size_t bytes);
    Mapping(Mapping&& other) noexcept;
    Mapping& operator=(Mapping&& other) noexcept;
    ~Mapping();
    float* get() const { return data; }
  };
  void lay_out();  // chunks and segments from the registered tensors (finalize, finalize_layout)
  Mapping planes_[kNumPlanes];
  int64_t plane_begin_[kNumPlanes] = {};  // flat offset of each allocation's first element
  int64_t plane_end_[kNumPlanes] = {};
  int moment_chunk_begin_ = 0, moment_chunk_end_ = 0;
  int param_chunk_begin_ = 0, param_chunk_end_ = 0;
  std::vector<uint8_t> param_homed_;  // home_params' flags (empty: the whole range)
  bool params_homed_in_part_ = false;
  bool layout_only_ = false;  // finalize_layout: nothing allocated
  // The store's own residency (every page present) and the one in use.
  friend class PresentPlanes;
  friend class Bf16State;
  std::unique_ptr<Residency> own_residency_;
  Residency* residency_ = nullptr;
  // Zeroes [offset, offset + numel) of a plane and gives the whole OS pages inside back.
  void zero_and_release(Plane plane, int64_t offset, int64_t numel);
  void apply_pending(int chunk) const;
  // The bf16 copies (bf16_params): one plane of 16-bit elements in the param plane's layout,
  // mapped on first use; per chunk, whether a tensor in it feeds products and the versions its
  // copy was made at.
  struct Bf16Copy {
    bool feeds_products = false;
    bool made = false;
    uint64_t version = 0, page_version = 0;
  };
  Mapping bf16_plane_;
  bool bf16_copies_on_ = true;
  std::vector<Bf16Copy> bf16_copies_;
  bool bf16_current(int chunk) const;
  void forget_bf16(int chunk) { bf16_copies_[static_cast<size_t>(chunk)].made = false; }
  // Deferred updates (mutable: const leases trigger them too).
  mutable std::vector<uint8_t> pending_;
  mutable int updating_ = -1;
  std::function<void(int)> updater_;
};

}  // namespace keel
