// Residency: where the chunk store's pages are between two uses, behind one interface.
//
// A page is one plane of one chunk. Compute always happens at the page's address in the store's
// flat planes; a residency decides whether the bytes there are valid between leases, and what it
// takes to make them so. The store reaches it only through this interface: the store, the
// optimizer and the checkpoint writer never ask *which* residency is attached, only what the
// memory can do (always_present, updates_at_home), so a new kind of memory (device memory with a
// host copy, a remote tier) is a new implementation and no caller changes.
//
// Three implementations exist: the store's own (every page always present in its planes: leases
// cost nothing but a version count), the memory tiers (store/tiered_memory.h: pages fetched
// from host DRAM or NVMe files ahead of use, evicted after, every copy versioned) and ZeRO-3's
// sharded parameters (comm/sharded_params.h: a parameter page's home is its owning rank).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>

namespace keel {

// The four planes of a chunk. Each plane has the same layout; gradient and moments mirror params.
enum class Plane : uint8_t { param = 0, grad = 1, adam_m = 2, adam_v = 3 };
inline constexpr int kNumPlanes = 4;

// One plane of one chunk: the unit a residency moves.
struct PageRef {
  int chunk = 0;
  Plane plane = Plane::param;
  bool operator==(const PageRef&) const = default;
};

class Residency {
 public:
  virtual ~Residency() = default;

  // True when every page is present at its address at all times: whole planes can be read,
  // written and communicated at once (a whole-plane all-gather, a snapshot of a plane). False
  // when pages come and go: such work goes page by page, under leases.
  virtual bool always_present() const = 0;

  // Makes `pages` present with their newest bytes and keeps them so until release(). Throws
  // keel::Error if they cannot all be present at once.
  virtual void acquire(std::span<const PageRef> pages) = 0;
  // The same, on behalf of one layer's pass (a forward, a backward): every rank of a data-parallel
  // group takes these leases for the same layers in the same order, so a residency whose pages
  // live on other ranks (ZeRO-3's sharded parameters) may communicate collectively here. Every
  // other acquire is one rank's own (an optimizer's chunk, a checkpoint's write) and must not.
  virtual void acquire_layer(std::span<const PageRef> pages) { acquire(pages); }
  // Ends an acquire; `modified`: the pages' bytes were written (their version moves on).
  virtual void release(std::span<const PageRef> pages, bool modified) = 0;
  // Ends an acquire_layer (local: no rank waits for another here).
  virtual void release_layer(std::span<const PageRef> pages, bool modified) { release(pages, modified); }
  // These pages will be acquired soon, nearest first. Returns the fetches the hint started.
  virtual int hint(std::span<const PageRef> pages) = 0;
  // The page's version: it moves on with every release that modified the page (and every zero
  // or update at home). Two reads at the same version saw the same bytes.
  virtual uint64_t version(PageRef p) const = 0;

  // The page's bytes become zero. `zeroed_in_place`: the caller has already zeroed them at
  // their address, under a lease that is over (AdamW consumes a gradient that way); any other
  // copy is now stale. Otherwise the residency zeroes them (without fetching the page).
  virtual void zero(PageRef p, bool zeroed_in_place) = 0;
  // Elements [offset, offset + numel) of a plane become zero and the memory of the whole pages
  // inside the range is given back (it costs nothing until written again). ZeRO-2 uses it for
  // the gradients a rank does not own once their reduce-scatter is done.
  virtual void discard(Plane plane, int64_t offset, int64_t numel) = 0;

  // True when `update_at_home` runs where the page lives (its home copy is not at the compute
  // address, e.g. AdamW moments kept in host DRAM): cheaper than fetching it and writing it back.
  virtual bool updates_at_home(PageRef p) const = 0;
  // Runs `update` on the page's authoritative copy in place and moves its version on.
  virtual void update_at_home(PageRef p, const std::function<void(float* data, size_t n)>& update) = 0;

  // The sum of squares of a gradient page's current bytes, when the residency computed it as the
  // page was last written (pages that move cache it so that the clipping norm need not fetch
  // every gradient page again). False when not known: read the page.
  virtual bool known_sum_squares(PageRef p, double* out) const = 0;

  // The shape of a step changed (e.g. a pipeline's micro-batch count): access patterns learned
  // from earlier steps no longer hold.
  virtual void step_shape_changed() = 0;
};

}  // namespace keel
